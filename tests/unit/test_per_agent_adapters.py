"""One LoRA adapter per trained agent (``FULMEN_TRAIN_ADAPTERS=per_agent``): the trainer updates each adapter from its
own agent's samples only, on a frozen base, and saves and resumes them; each agent's samples get advantages within
its own groups; the gateway's in-process backend serves each call with its agent's adapter in one mixed batch (the
base model for an agent without one) and says which; the models follower and the models topic keep each adapter's
versions apart; the settings refuse what cannot work."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fulmen.algorithm.batch import Sample
from fulmen.algorithm.service.groups import ClosedGroup
from fulmen.algorithm.service.samples import build_agent_samples
from fulmen.algorithm.settings import TrainSection
from fulmen.algorithm.tiny_model import TinyModelConfig, build_tiny_model
from fulmen.algorithm.trainer.adapters import PerAgentTrainer, is_adapter_checkpoint
from fulmen.algorithm.trainer.torch_backend import TorchTrainerConfig
from fulmen.producers.llm_gateway.backends.transformers_backend import TransformersBackend
from fulmen.producers.llm_gateway.protocol import parse_chat
from fulmen.producers.llm_gateway.settings import LlmSection
from fulmen.schemas import ModelVersion
from fulmen.schemas.errors import ConfigurationError, PoisonInputError
from fulmen.schemas.events import RolloutMode, RolloutStatus, Transition, TransitionBatch

pytestmark = pytest.mark.multiagent

TINY = TinyModelConfig(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128
)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", TINY)


def trainer(base: Path, resume_from: Path | None = None) -> PerAgentTrainer:
    config = TorchTrainerConfig(base, device="cpu", dtype="float32", lr=1e-2, micro_batch_size=4)
    return PerAgentTrainer(config, ["write", "re.write"], resume_from)


def samples(agent: str, seed: int) -> list[Sample]:
    generator = torch.Generator().manual_seed(seed)
    made = []
    for index in range(4):
        prompt = torch.randint(5, 100, (6,), generator=generator).tolist()
        response = torch.randint(5, 100, (5,), generator=generator).tolist()
        made.append(Sample(prompt, response, advantage=1.0 if index % 2 else -1.0, group_id="g", agent=agent))
    return made


def adapter_weights(model: PerAgentTrainer, agent: str) -> dict[str, torch.Tensor]:
    name = model.names[agent]
    return {k: v.detach().clone() for k, v in model.model.named_parameters() if f".{name}." in k}


def base_weights(model: PerAgentTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.model.named_parameters() if "lora_" not in k}


def test_each_adapter_learns_from_its_own_agent_only_and_the_base_stays_frozen(base: Path, tmp_path: Path) -> None:
    model = trainer(base)
    before = {agent: adapter_weights(model, agent) for agent in model.agents}
    frozen = base_weights(model)
    metrics = model.step(samples("write", 1))  # only the writer's calls this step
    after = {agent: adapter_weights(model, agent) for agent in model.agents}
    assert any(not torch.equal(before["write"][k], after["write"][k]) for k in before["write"])
    assert all(torch.equal(before["re.write"][k], after["re.write"][k]) for k in before["re.write"])
    assert set(model.agent_metrics) == {"write"} and metrics.tokens == 20 and metrics.step == 1
    model.step(samples("write", 2) + samples("re.write", 3))  # both: each adapter moves, by its own samples
    assert model.steps == 2 and set(model.agent_metrics) == {"write", "re.write"}
    assert any(not torch.equal(after["re.write"][k], v) for k, v in adapter_weights(model, "re.write").items())
    assert all(torch.equal(frozen[k], v) for k, v in base_weights(model).items())
    with pytest.raises(PoisonInputError, match="without an adapter: 'check'"):
        model.step(samples("check", 4))

    saved = model.save(tmp_path / "v2")
    assert is_adapter_checkpoint(saved)
    assert json.loads((saved / "adapters.json").read_text())["agents"] == ["write", "re.write"]
    for agent in model.agents:
        assert (saved / agent / "adapter_config.json").is_file() and (
            saved / agent / "adapter_model.safetensors"
        ).is_file()
    resumed = trainer(base, resume_from=saved)
    for agent in model.agents:
        mine, theirs = adapter_weights(model, agent), adapter_weights(resumed, agent)
        assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)


def _rollout(rollout: str, reward: float, agents: list[str]) -> TransitionBatch:
    calls = [
        Transition(
            rollout_id=rollout,
            attempt=1,
            index=i,
            trace_id="0" * 31 + "1",
            span_id="0" * 15 + "1",
            agent_name=agent,
            prompt_token_ids=[1, 2, i + 3],
            response_token_ids=[4],
        )
        for i, agent in enumerate(agents)
    ]
    return TransitionBatch(
        rollout_id=rollout,
        attempt=1,
        task_id="t",
        group_id="g",
        mode=RolloutMode.TRAIN,
        status=RolloutStatus.SUCCEEDED,
        episode_reward=reward,
        transitions=calls,
    )


def test_an_agents_advantages_come_from_the_rollouts_in_which_it_acted() -> None:
    """The rewriter acted in two of the four rollouts (rewards 1 and 0): its advantages compare those two only;
    the writer's compare all four; calls of an agent without an adapter are not trained."""
    group = ClosedGroup(
        "g",
        "t",
        RolloutMode.TRAIN,
        4,
        (
            _rollout("a", 1.0, ["write"]),
            _rollout("b", 0.0, ["write", "check", "rewrite"]),
            _rollout("c", 1.0, ["write", "check", "rewrite"]),
            _rollout("d", 0.0, ["write", "check"]),
        ),
    )
    data = build_agent_samples([group], ["write", "rewrite"], estimator="rloo")
    by_agent = {}
    for sample in data.samples:
        by_agent.setdefault(sample.agent, []).append(sample.advantage)
    assert set(by_agent) == {"write", "rewrite"}
    assert by_agent["rewrite"] == pytest.approx([-1.0, 1.0])  # RLOO over its two rollouts: 0 - 1, 1 - 0
    assert by_agent["write"] == pytest.approx([2 / 3, -2 / 3, 2 / 3, -2 / 3])
    assert data.returns == [1.0, 0.0, 1.0, 0.0]  # the step reports the whole rollouts once


def test_the_settings_need_the_agents_and_one_torch_process() -> None:
    section = TrainSection(adapters="per_agent", adapter_agents="write, rewrite")
    assert section.per_agent == ["write", "rewrite"] and TrainSection().per_agent is None
    for bad, message in (
        ({}, "needs the agents to train"),
        ({"adapter_agents": "a,a"}, "listed twice"),
        ({"adapter_agents": "a b"}, "not a valid identifier"),
        ({"adapter_agents": "a", "backend": "verl"}, "torch backend in one process"),
    ):
        with pytest.raises(ValueError, match=message):
            TrainSection(adapters="per_agent", **bad)


def test_an_agents_adapter_is_its_own_record_on_the_models_topic() -> None:
    model = ModelVersion(model_name="m", version=2, uri="/x")
    adapter = ModelVersion(model_name="m", version=2, uri="/x/write", format="hf_lora_adapter", adapter="write")
    assert model.topic_key == "m" and adapter.topic_key == "m/write"
    with pytest.raises(ValueError, match="is an hf_lora_adapter"):
        ModelVersion(model_name="m", version=2, uri="/x/write", adapter="write")


def _chat(agent: str | None, content: str) -> object:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0}
    request = parse_chat(body, 4)
    return request if agent is None else dataclasses.replace(request, agent=agent)


async def test_the_gateway_serves_each_agent_its_adapter_in_one_batch(base: Path, tmp_path: Path) -> None:
    """Two adapters trained apart; calls of write, of re.write and of an agent without one arrive together and
    share a batch: each is answered as its adapter (or the base model) answers alone, and says which served it.
    A new version of one adapter replaces it; the other keeps its version."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = trainer(base)
    model.step(samples("write", 5) + samples("re.write", 6))
    model.step(samples("write", 7) + samples("re.write", 8))
    saved = model.save(tmp_path / "v1")
    backend = TransformersBackend(LlmSection(model=str(base), device="cpu", batch_wait_ms=200, max_batch_rows=8))
    await backend.start()
    try:
        for agent in ("write", "re.write"):
            await backend.load_version(
                ModelVersion(
                    model_name="m",
                    version=1,
                    uri=str(saved / agent),
                    format="hf_lora_adapter",
                    adapter=agent,
                    base_model=str(base),
                )
            )
        assert backend.adapter_version("write") == 1 and backend.adapter_version("check") is None
        prompts = [("write", "one two"), ("re.write", "one two"), ("check", "one two"), (None, "one two")]
        results = await asyncio.gather(*(backend.chat(_chat(agent, text)) for agent, text in prompts))
        assert [r.adapter for r in results] == ["write", "re.write", None, None]
        assert [r.model_version for r in results] == [1, 1, None, None]  # the base model: the gateway's start version

        def alone(agent: str | None, prompt_ids: list[int]) -> list[int]:
            reference = AutoModelForCausalLM.from_pretrained(base)
            if agent is not None:
                reference = PeftModel.from_pretrained(reference, str(saved / agent)).merge_and_unload()
            out = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False, pad_token_id=0)
            return out[0, len(prompt_ids) :].tolist()

        for (agent, _), result in zip(prompts, results, strict=True):
            expected = alone(agent if agent in ("write", "re.write") else None, result.prompt_token_ids)
            assert result.choices[0].token_ids == expected[: len(result.choices[0].token_ids)], agent

        model.step(samples("write", 9))
        newer = model.save(tmp_path / "v2")
        await backend.load_version(
            ModelVersion(
                model_name="m",
                version=2,
                uri=str(newer / "write"),
                format="hf_lora_adapter",
                adapter="write",
                base_model=str(base),
            )
        )
        assert backend.adapter_version("write") == 2 and backend.adapter_version("re.write") == 1
        assert len(backend._loaded.model.peft_config) == 2  # the writer's first version was dropped
        with pytest.raises(Exception, match="does not exist"):
            await backend.load_version(
                ModelVersion(
                    model_name="m", version=3, uri=str(tmp_path / "nowhere"), format="hf_lora_adapter", adapter="write"
                )
            )
        assert backend.adapter_version("write") == 2
    finally:
        await backend.close()


async def test_the_models_follower_loads_the_newest_version_of_each_adapter_apart() -> None:
    from fulmen.infra.settings import FulmenSettings
    from fulmen.producers.llm_gateway.models_follower import ModelsFollower
    from fulmen.schemas.codec import encode

    served: dict[str, int] = {}
    loaded: list[tuple[str, int]] = []

    async def load(event: ModelVersion) -> None:
        loaded.append((event.adapter, event.version))
        served[event.adapter] = event.version

    follower = ModelsFollower(FulmenSettings(), "m", lambda adapter: served.get(adapter), load)
    follower._caught_up = True

    def record(offset: int, **fields: object) -> SimpleNamespace:
        event = ModelVersion(model_name="m", uri="/x", **fields)
        return SimpleNamespace(value=encode(event), topic="fulmen.models", partition=0, offset=offset)

    lora = {"format": "hf_lora_adapter"}
    await follower.handle(
        [
            record(0, version=0),
            record(1, version=1, adapter="write", **lora),
            record(2, version=2, adapter="write", **lora),
            record(3, version=1, adapter="rewrite", **lora),
        ]
    )
    assert loaded == [("", 0), ("write", 2), ("rewrite", 1)]  # the model first, then each adapter's newest
    await follower.handle([record(4, version=1, adapter="write", **lora)])  # older than what serves: ignored
    assert loaded[-1] == ("rewrite", 1) and served == {"": 0, "write": 2, "rewrite": 1}


def test_a_per_agent_run_cannot_resume_a_whole_model_checkpoint(tmp_path: Path) -> None:
    from fulmen.algorithm.service.run import _per_agent_backend

    (tmp_path / "v3").mkdir()
    (tmp_path / "v3" / "config.json").write_text("{}")
    with pytest.raises(ConfigurationError, match="holds a whole model"):
        _per_agent_backend(TrainSection(adapters="per_agent", adapter_agents="a"), "base", tmp_path / "v3")


def test_an_agent_names_itself_in_the_url_the_runner_handed_it() -> None:
    from fulmen.producers.runner.agent import LLMEndpoint

    llm = LLMEndpoint(base_url="http://gw:8000/rollout/r1/attempt/2/v1", model="fulmen")
    write = llm.for_agent("write")
    assert write.base_url == "http://gw:8000/rollout/r1/attempt/2/agent/write/v1" and write.model == "fulmen"
    assert write.for_agent("check").base_url == "http://gw:8000/rollout/r1/attempt/2/agent/check/v1"
    assert (
        LLMEndpoint(base_url="http://gw:8000/v1/", model="m").for_agent("a.b").base_url == "http://gw:8000/agent/a.b/v1"
    )
    with pytest.raises(ConfigurationError, match="agent name"):
        llm.for_agent("not/allowed")
