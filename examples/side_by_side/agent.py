"""The same agent for Agent Lightning and for Fulmen, side by side (docs/from-agent-lightning.md).

``answer`` is the agent: one chat call through the plain ``openai`` client to whatever endpoint it is given,
scored by ``score``. Everything else is the glue each trainer asks for:

* Fulmen: ``run(task, llm)`` as is. The runner passes ``llm`` (``base_url`` scoped to this rollout, ``model``,
  ``api_key``); the return value is the episode reward. ``fulmen train --local --agent
  examples.side_by_side.agent:run ...`` trains it (``python -m examples.side_by_side.agent`` checks it against a
  scripted model, no Kafka, no model).
* Agent Lightning: :func:`lightning_agent` builds the ``LitAgent`` subclass its ``Trainer.fit`` takes: the LLM is a
  resource (``main_llm``) whose base URL is scoped by rollout and attempt id; the return value is the reward.
  ``agentlightning`` is imported only there, so this module imports without it.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from openai import OpenAI

SYSTEM = "Answer with the number only."


def answer(task: dict[str, Any], base_url: str, model: str, api_key: str, temperature: float = 1.0) -> str:
    """The agent itself: one call, the reply's text."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}],
        max_tokens=16,
        temperature=temperature,
    )
    return reply.choices[0].message.content or ""


def score(text: str, task: dict[str, Any]) -> float:
    """1.0 when the reply's only number is the task's answer."""
    numbers = re.findall(r"-?\d+", text.replace(",", ""))
    return 1.0 if len(numbers) == 1 and int(numbers[0]) == int(task["answer"]) else 0.0


def run(task: dict[str, Any], llm: Any) -> float:
    """Fulmen's entry point: ``fulmen train --agent examples.side_by_side.agent:run``."""
    temperature = 0.0 if task.get("greedy") else 1.0  # validation rollouts ask for greedy answers
    return score(answer(task, llm.base_url, llm.model, llm.api_key, temperature), task)


def teach(task: dict[str, Any], messages: list[dict[str, Any]]) -> Any:
    """The warm-up's teacher (``--warmup-teacher examples.side_by_side.agent:teach``): the right answer."""
    from fulmen.testing import Reply

    return Reply(content=str(task["answer"]))


def lightning_agent() -> Any:
    """Agent Lightning's entry point: an instance of a ``LitAgent`` subclass, for ``agl.Trainer(...).fit(agent,
    train_dataset=..., val_dataset=...)`` (needs ``pip install agentlightning``; its VERL algorithm needs a GPU)."""
    import agentlightning as agl

    class NumberAgent(agl.LitAgent):
        def rollout(self, task: dict[str, Any], resources: Any, rollout: Any) -> float:
            llm = resources["main_llm"]
            base_url = llm.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
            return score(answer(task, base_url, llm.model, llm.api_key or "none"), task)

    return NumberAgent()


def main() -> int:
    """Run the Fulmen entry point on three tasks against a scripted model that answers right: each earns 1.0."""
    from fulmen import LLMEndpoint
    from fulmen.testing import ScriptedOpenAI

    tasks = [{"question": f"What number comes right after {n}?", "answer": n + 1} for n in (9, 41, 99)]
    rewards = []
    for task in tasks:
        with ScriptedOpenAI(lambda request, task=task: teach(task, request.body["messages"])) as server:
            rewards.append(run(task, LLMEndpoint(base_url=server.url(), model="scripted", api_key="x")))
    print(json.dumps({"rewards": rewards}))
    return 0 if rewards == [1.0, 1.0, 1.0] else 1


if __name__ == "__main__":
    sys.exit(main())
