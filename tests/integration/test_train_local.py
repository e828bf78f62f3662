"""`fulmen.train(...)`: any agent trained in one call, through the whole system, on the tiny model (two steps).

The agent is tests/agents/chat.py's plain `openai` agent; Kafka is the session's broker (FULMEN_KAFKA_BOOTSTRAP),
everything else is started and stopped by the call (:func:`fulmen.algorithm.local.run_locally`). This checks the
plumbing and the report, not learning (the demo's e2e test does that).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import fulmen
from fulmen.infra.errors import ConfigurationError
from fulmen.infra.kafka.local import LocalKafka
from fulmen.schemas.events import TrainStep

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = ["What is 2+3?", "Name a colour.", "Say hi.", "What is 7-4?"]


@pytest.fixture
def env(kafka_broker: LocalKafka, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FULMEN_KAFKA_BOOTSTRAP", kafka_broker.bootstrap)
    monkeypatch.setenv("FULMEN_HOME", str(tmp_path))
    monkeypatch.setenv("FULMEN_TRAIN_DEVICE", "cpu")  # the FULMEN_TRAIN_* in force are the base settings
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the runners import tests.agents.chat


def test_train_in_one_call_returns_the_report(env: None, tiny_model: Path, tmp_path: Path) -> None:
    dataset = tmp_path / "train.jsonl"
    dataset.write_text("".join(f'{{"input": {{"question": "{q}"}}}}\n' for q in QUESTIONS))
    seen: list[TrainStep] = []
    report = fulmen.train(agent="tests.agents.chat:ask", dataset=dataset, model=tiny_model,
                          val=[{"question": "Say yes.", "greedy": True}, {"question": "What is 1+1?"}], steps=2,
                          on_step=seen.append, group_size=2, groups_per_step=2, val_group_size=1, lr=1e-5,
                          micro_batch_size=8, dtype="float32", rollout_timeout_s=120.0)  # fmt: skip
    assert isinstance(report, fulmen.TrainReport)
    assert report.steps == 2 and [step for step, _ in report.reward_curve] == [1, 2]
    assert [reward for _, reward in report.reward_curve] == [1.0, 1.0]  # the agent's reward: it answered
    assert [step for step, _ in report.val_accuracy_curve] == [0, 2]  # before the first step, after the last
    assert report.curves["loss"] == report.loss_curve and len(report.loss_curve) == 2
    assert report.run_id.startswith("train-") and report.run_dir.is_dir()
    assert report.final_model == report.run_dir / "checkpoints" / "v2"
    assert (report.final_model / "config.json").is_file()
    assert [event.step for event in seen] == [1, 2]
    assert (report.run_dir / "logs" / "runner-1.log").is_file()


def test_bad_arguments_are_refused_before_anything_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FULMEN_HOME", str(tmp_path))
    with pytest.raises(ConfigurationError, match="unknown training setting.*learning_rate.*valid:.*lr"):
        fulmen.train(agent="a:b", dataset=[{"q": 1}], learning_rate=0.1)
    with pytest.raises(ConfigurationError, match="module:function"):
        fulmen.train(agent="no_colon", dataset=[{"q": 1}])
    with pytest.raises(ConfigurationError, match="importable module"):
        fulmen.train(agent=lambda task, llm: 1.0, dataset=[{"q": 1}])
    with pytest.raises(ConfigurationError, match="config.json"):
        fulmen.train(agent="a:b", dataset=[{"q": 1}], model=tmp_path)
    with pytest.raises(ConfigurationError, match="no such task file"):
        fulmen.train(agent="a:b", dataset=tmp_path / "missing.jsonl", model="tiny")
