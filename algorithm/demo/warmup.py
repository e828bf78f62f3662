"""The demo's starting model: the tiny model, briefly fine-tuned on correct two-call conversations.

:func:`warm_up` builds the tiny model (``algorithm.tiny_model``) and runs ``WarmupPlan.steps`` supervised steps
(``TorchTrainer.sft_step``) on batches of correct episodes rendered with the chat template exactly as the LLM
gateway renders the agent's calls: for each problem two samples, ``(prompt of call 1, tool call + <|im_end|>)``
and ``(prompt of call 2, answer + <|im_end|>)``. It is meant to be short, so held-out accuracy starts low and
GRPO has something left to learn (copying the numbers, choosing the operator). Measured on 2 busy cores: the
default plan (~1.5-6 min) teaches the tool-call format, but not yet to copy the numbers (first operand right
5%, exact calls 0%, the tool result copied into the answer 0%); 400 steps of 32 did not either (loss plateau
~0.26 per token). So held-out accuracy starts at 0 and GRPO gets no reward signal: the open problem. The
result is cached: a directory whose ``warmup.json`` records the same plan and task templates is reused.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from algorithm.batch import Sample
from algorithm.demo.agent import TOOLS
from algorithm.demo.tasks import TEMPLATES, TRAIN_SEED, VERBS, Problem, generate

__all__ = ["WarmupPlan", "conversation_samples", "warm_up"]

log = logging.getLogger(__name__)

MARKER = "warmup.json"


@dataclass(frozen=True)
class WarmupPlan:
    """``steps`` SFT updates of ``batch`` problems (2 samples each) at learning rate ``lr``."""

    steps: int = 80
    batch: int = 16
    lr: float = 3e-3
    seed: int = 0


def conversation_samples(problem: Problem, tokenizer) -> list[Sample]:
    """The two supervised samples of one correct episode of ``problem`` (see the module docstring)."""
    user = [{"role": "user", "content": problem.question}]
    call = {"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": {"expr": problem.expr}}}
    after = [*user, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_0", "content": str(problem.answer)}]  # fmt: skip
    tool_call = '<tool_call>{"name": "calc", "arguments": {"expr": "' + problem.expr + '"}}</tool_call>'
    return [_sample(tokenizer, user, tool_call), _sample(tokenizer, after, str(problem.answer))]


def _sample(tokenizer, messages: list[dict], reply: str) -> Sample:
    prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    response_ids = [*tokenizer(reply, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    return Sample(prompt_token_ids=prompt_ids, response_token_ids=response_ids)


def warm_up(directory: Path, plan: WarmupPlan | None = None) -> Path:
    """The warmed-up model directory ``directory/model`` (built, or reused when its plan matches)."""
    from algorithm.tiny_model import TinyModelConfig, build_tiny_model
    from algorithm.trainer.torch_backend import TorchTrainer, TorchTrainerConfig

    plan = plan or WarmupPlan()
    target = directory / "model"
    marker = target / MARKER
    recipe = json.loads(json.dumps({**asdict(plan), "templates": TEMPLATES, "verbs": VERBS}))  # task changes too
    if marker.is_file() and json.loads(marker.read_text()) == recipe:
        log.info("reusing the warmed-up model at %s", target)
        return target
    base = build_tiny_model(directory / "base", TinyModelConfig(seed=plan.seed))
    trainer = TorchTrainer(TorchTrainerConfig(model_path=base, device="cpu", dtype="float32", lr=plan.lr,
                                              micro_batch_size=64, seed=plan.seed))  # fmt: skip
    problems = generate(plan.steps * plan.batch, TRAIN_SEED + 1)
    random.Random(plan.seed).shuffle(problems)
    for step in range(plan.steps):
        chunk = problems[step * plan.batch : (step + 1) * plan.batch]
        samples = [s for p in chunk for s in conversation_samples(p, trainer.tokenizer)]
        metrics = trainer.sft_step(samples)
        log.info("warm-up step %d: loss %.4f", step + 1, metrics.loss)
    trainer.save(target)
    marker.write_text(json.dumps(recipe) + "\n")
    log.info("warmed up the tiny model in %d steps (last loss %.4f): %s", plan.steps, metrics.loss, target)
    return target
