"""`fulmen.train(...)`: any agent trained in one call, through the whole system, on the tiny model (two steps).

The agent is tests/agents/chat.py's plain `openai` agent; Kafka is the session's broker (FULMEN_KAFKA_BOOTSTRAP),
everything else is started and stopped by the call (:func:`fulmen.algorithm.local.run_locally`). This checks the
plumbing and the report, not learning (the demo's e2e test does that).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fulmen
from fulmen.infra.kafka.local import LocalKafka
from fulmen.infra.store import Store
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import TrainStep
from fulmen.schemas.prompts import PromptBundle, fingerprint

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
    report = fulmen.train(
        agent="tests.agents.chat:ask",
        dataset=dataset,
        model=tiny_model,
        val=[{"question": "Say yes.", "greedy": True}, {"question": "What is 1+1?"}],
        steps=2,
        on_step=seen.append,
        group_size=2,
        groups_per_step=2,
        val_group_size=1,
        lr=1e-5,
        micro_batch_size=8,
        dtype="float32",
        rollout_timeout_s=120.0,
    )
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
    # every run's metrics: a line a step, TensorBoard event files, and the curves drawn at the end
    lines = (report.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert list((report.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (report.run_dir / "curves.png").is_file()


def stored(run_dir: Path, query: str) -> list[dict]:
    """``fulmen sql`` on a finished run's own store."""
    env = os.environ | {"FULMEN_CLICKHOUSE_PATH": str(run_dir / "chdb"), "FULMEN_CLICKHOUSE_READ_PORT": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "fulmen.cli.main", "sql", "-f", "jsonl", query],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def test_grpo_on_a_prompt_bundles_rollouts(env: None, tiny_model: Path, tmp_path: Path) -> None:
    """prompt_bundle=: every training and validation rollout names the bundle (published on the run's own topic);
    the gateway applied it to every call, and each rollout and transition records the bundle and a model version."""
    bundle = PromptBundle.create({fingerprint("system", "Answer briefly."): "Answer in one word."})
    report = fulmen.train(
        agent="tests.agents.chat:ask",
        dataset=[{"question": q} for q in QUESTIONS[:2]],
        model=tiny_model,
        val=[{"question": "Say yes."}],
        steps=1,
        prompt_bundle=bundle,
        group_size=2,
        groups_per_step=1,
        val_group_size=1,
        micro_batch_size=8,
        dtype="float32",
        rollout_timeout_s=120.0,
    )
    assert report.steps == 1
    rollouts = stored(report.run_dir, "SELECT Mode, PromptBundle, ModelVersion, Status FROM rollouts FINAL")
    assert {r["Mode"] for r in rollouts} == {"train", "val"} and len(rollouts) >= 4, rollouts
    assert all(r["PromptBundle"] == bundle.bundle_id and r["ModelVersion"] is not None for r in rollouts), rollouts
    assert all(r["Status"] == "succeeded" for r in rollouts), rollouts
    transitions = stored(report.run_dir, "SELECT Mode, PromptBundle, ModelVersion FROM transitions FINAL")
    assert {t["Mode"] for t in transitions} == {"train", "val"}, transitions
    assert all(t["PromptBundle"] == bundle.bundle_id and t["ModelVersion"] is not None for t in transitions)
    [calls] = stored(
        report.run_dir,
        (
            "SELECT count() AS calls, countIf(SpanAttributes['fulmen.prompt.bundle'] = '" + bundle.bundle_id + "') AS "
            "named, countIf(SpanAttributes['gen_ai.input.messages'] LIKE '%Answer in one word.%') AS replaced "
            "FROM otel_traces WHERE SpanAttributes['gen_ai.operation.name'] = 'chat'"
        ),
    )
    assert calls["calls"] == calls["named"] == calls["replaced"] == len(rollouts), calls

    # the command line names it by id: --local reads it from --source-store and publishes it on its own topics
    dataset = tmp_path / "again.jsonl"
    dataset.write_text('{"input": {"question": "Say hi."}}\n')
    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "fulmen.cli.main",
            "train",
            "--local",
            "--agent",
            "tests.agents.chat:ask",
            "--dataset",
            str(dataset),
            "--model",
            str(tiny_model),
            "--steps",
            "1",
            "--prompt-bundle",
            bundle.bundle_id,
            "--source-store",
            str(report.run_dir / "chdb"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=os.environ
        | {
            "FULMEN_TRAIN_GROUP_SIZE": "2",
            "FULMEN_TRAIN_GROUPS_PER_STEP": "1",
            "FULMEN_TRAIN_MICRO_BATCH_SIZE": "8",
            "FULMEN_TRAIN_DTYPE": "float32",
            "FULMEN_TRAIN_ROLLOUT_TIMEOUT_S": "120",
        },
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    run_dir = Path(next(line for line in again.stdout.splitlines() if "run dir" in line).rsplit("run dir ", 1)[1])
    named = stored(run_dir, "SELECT DISTINCT PromptBundle AS b FROM transitions FINAL")
    assert named == [{"b": bundle.bundle_id}], named


def test_a_stored_bundle_comes_back_as_the_event_that_published_it(store: Store) -> None:
    """What ``fulmen.train(prompt_bundle="pb-...")`` publishes on a local run's own topic: the stored bundle."""
    from fulmen.consumers.event_sinks import EVENT_SINKS
    from fulmen.prompt_queries import stored_bundle

    bundle = PromptBundle.create(
        {"tpl:ask": "Q: {question} (in French)"},
        templates={"ask": "Q: {question}"},
        parents=["pb-0123456789ab"],
        scores={"v1": 0.5},
        agent="write",
        source="gepa",
        run_id="s-run",
    )
    sink = EVENT_SINKS["prompt_bundles"]
    store.insert_batch(sink.table, sink.to_batch([sink.rows(bundle)]))
    again = stored_bundle(store, store.database, bundle.bundle_id)
    assert again is not None and again.model_dump(exclude={"created_at"}) == bundle.model_dump(exclude={"created_at"})
    assert stored_bundle(store, store.database, "pb-000000000000") is None


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
    with pytest.raises(ConfigurationError, match="train_steps: GRPO needs the served model's token ids"):
        monkeypatch.setenv("FULMEN_LLM_BACKEND", "openai")
        fulmen.optimize_prompt("a:b", [{"q": 1}], [{"q": 2}], [{"q": 3}], "http://127.0.0.1:9/v1", 10, train_steps=1)
    with pytest.raises(ConfigurationError, match="against a deployment, run `fulmen train --prompt-bundle"):
        fulmen.optimize_prompt(
            "a:b", [{"q": 1}], [{"q": 2}], [{"q": 3}], "http://127.0.0.1:9/v1", 10, train_steps=1, local=False
        )
    with pytest.raises(ConfigurationError, match="serach: Extra inputs.*the search options: search, slots"):
        fulmen.optimize_prompt("a:b", [{"q": 1}], [{"q": 2}], [{"q": 3}], "http://127.0.0.1:9/v1", 10, serach="beam")
    with pytest.raises(ConfigurationError, match="unknown search 'bream'"):
        fulmen.optimize_prompt("a:b", [{"q": 1}], [{"q": 2}], [{"q": 3}], "http://127.0.0.1:9/v1", 10, search="bream")
    with pytest.raises(ConfigurationError, match="discover: Input should be greater than or equal to 1"):
        fulmen.optimize_prompt("a:b", [{"q": 1}], [{"q": 2}], [{"q": 3}], "http://127.0.0.1:9/v1", 10, discover=0)
