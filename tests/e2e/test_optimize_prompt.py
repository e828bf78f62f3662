"""`fulmen optimize-prompt` through the whole system (issue 29): the bench's French task (bench/apo_agent.py, an agent
that imports nothing of Fulmen's and whose own system prompt does not ask for French) run by real runners through
the LLM gateway, whose upstream is a scripted policy that answers in French only when its system prompt asks for it;
the optimiser is the scripted one (fulmen/optimizer_testing.py: distractors, then the good instruction).

Checked afterwards with SQL on the run's store (`fulmen sql`): every rollout counted, none over the budget; every
call's span names its rollout's bundle; the best bundle is the good instruction, stored with its lineage; the test
split ran only for the report (the agent's own prompts and the best bundle, once each); --promote promoted the best."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.apo_agent import SYSTEM, write_splits
from fulmen.infra.kafka.local import LocalKafka
from fulmen.optimizer_testing import scripted_optimizer
from fulmen.schemas.prompts import fingerprint
from fulmen.schemas.task_file import load_task_file
from fulmen.testing import RecordedRequest, Reply, ScriptedOpenAI

pytestmark = [pytest.mark.e2e, pytest.mark.apo, pytest.mark.timeout(600)]

FULMEN = [sys.executable, "-m", "fulmen.cli.main"]
REPO = Path(__file__).parents[2]  # the runners import bench.apo_agent from here
GOOD = "Always reply in French."
DISTRACTORS = ["Be concise.", "Answer with one word in UPPERCASE."]
BUDGET = 40


def _policy(request: RecordedRequest) -> Reply:
    """French when the system prompt asks for it, English otherwise (what SmolLM2-135M-Instruct did when probed)."""
    system = " ".join(str(m.get("content")) for m in request.body.get("messages", []) if m.get("role") == "system")
    if "French" in system:
        return Reply(content="C'est le ciel bleu et la mer est belle.")
    return Reply(content="The sky is blue and the sea is calm.")


def _sql(env: dict[str, str], query: str) -> list[dict]:
    done = subprocess.run(
        [*FULMEN, "sql", "-f", "jsonl", query], capture_output=True, text=True, env=env, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def test_optimize_prompt_finds_the_instruction_through_the_whole_system(
    kafka_broker: LocalKafka, tmp_path: Path
) -> None:
    splits = write_splits(tmp_path / "data", (4, 4, 4))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")}
    env |= {"FULMEN_KAFKA_BOOTSTRAP": kafka_broker.bootstrap, "FULMEN_HOME": str(tmp_path / "home")}
    with ScriptedOpenAI(_policy) as upstream, scripted_optimizer([*DISTRACTORS, GOOD]) as optimizer:
        env_run = env | {"FULMEN_LLM_BACKEND": "openai", "FULMEN_LLM_UPSTREAM_URL": upstream.url()}
        done = subprocess.run(
            [
                *FULMEN,
                "optimize-prompt",
                "--agent",
                "bench.apo_agent:solve",
                "--dataset",
                str(splits["train"]),
                "--val",
                str(splits["val"]),
                "--test",
                str(splits["test"]),
                "--optimizer-url",
                optimizer.url(),
                "--max-rollouts",
                str(BUDGET),
                "--model",
                "scripted",
                "--minibatch",
                "2",
                "--promote",
                "--json",
            ],
            capture_output=True,
            text=True,
            env=env_run,
            timeout=540,
            cwd=REPO,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
        asked = len(optimizer.chat_requests())
        shown = list(optimizer.script.prompts)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    slot = fingerprint("system", SYSTEM)
    assert report["best_slots"] == {slot: GOOD}, report
    assert (report["heldout_before"], report["heldout_after"]) == (0.0, 1.0), report
    assert report["rollouts_used"] <= BUDGET and report["bundle_mismatches"] == 0, report
    assert report["promoted"] == report["best_bundle"], report  # --promote: it beat the agent's own prompts on test
    assert asked >= len(DISTRACTORS) + 1  # the good instruction came last: the distractors were tried and refused
    # the optimiser was shown the failing episodes as the store has them: what the model saw and answered
    assert f"system: {SYSTEM}" in shown[0] and "assistant: The sky is blue" in shown[0], shown[0]

    store = env | {"FULMEN_CLICKHOUSE_PATH": str(Path(report["run_dir"]) / "chdb"), "FULMEN_CLICKHOUSE_READ_PORT": "0"}
    [counted] = _sql(store, "SELECT count(DISTINCT RolloutId) AS n, countIf(Status = 'succeeded') AS ok FROM rollouts")
    assert counted["n"] == report["rollouts_used"] == counted["ok"], counted  # every rollout dispatched is counted
    [calls] = _sql(
        store,
        (
            "SELECT count() AS calls, countIf(s.SpanAttributes['fulmen.prompt.bundle'] != r.b) AS mismatches "
            "FROM otel_traces AS s INNER JOIN (SELECT RolloutId, Attempt, max(PromptBundle) AS b FROM rollouts "
            "GROUP BY RolloutId, Attempt) AS r ON s.RolloutId = r.RolloutId AND s.Attempt = r.Attempt "
            "WHERE s.SpanAttributes['gen_ai.operation.name'] = 'chat'"
        ),
    )
    assert calls == {"calls": report["rollouts_used"], "mismatches": 0}, calls  # one call a rollout, its own bundle
    [best] = _sql(
        store,
        f"SELECT Slots, Parents, Source, length(Scores) AS scored FROM prompt_bundles "
        f"WHERE BundleId = '{report['best_bundle']}'",
    )
    assert dict(best["Slots"]) == {slot: GOOD} and best["Parents"] and best["Source"] == "gepa" and best["scored"] == 4
    promotions = _sql(store, "SELECT Action, BundleId, Agent FROM prompt_promotions")
    assert promotions == [{"Action": "promote", "BundleId": report["best_bundle"], "Agent": ""}], promotions
    test_ids = ", ".join(f"'{t.task_id}'" for t in load_task_file(splits["test"]))
    test_runs = _sql(
        store,
        f"SELECT PromptBundle AS bundle, count() AS n, avg(Reward) AS reward FROM rollouts "
        f"WHERE TaskId IN ({test_ids}) GROUP BY PromptBundle ORDER BY reward",
    )
    assert test_runs == [
        {"bundle": report["base_bundle"], "n": 4, "reward": 0.0},
        {"bundle": report["best_bundle"], "n": 4, "reward": 1.0},
    ], test_runs


def test_optimize_prompt_then_grpo_on_the_best_bundles_rollouts(
    kafka_broker: LocalKafka, tmp_path: Path, tiny_model: Path
) -> None:
    """--train-steps: after the search (here on the tiny model, which earns no reward: plumbing, not learning), GRPO
    steps on the same stack whose every rollout names the best bundle; its rollouts and transitions record the bundle
    and the model version that served them."""
    splits = write_splits(tmp_path / "data", (2, 2, 2))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")}
    env |= {
        "FULMEN_KAFKA_BOOTSTRAP": kafka_broker.bootstrap,
        "FULMEN_HOME": str(tmp_path / "home"),
        "FULMEN_TRAIN_GROUP_SIZE": "2",
        "FULMEN_TRAIN_GROUPS_PER_STEP": "1",
        "FULMEN_TRAIN_VAL_GROUP_SIZE": "1",
        "FULMEN_TRAIN_MICRO_BATCH_SIZE": "8",
        "FULMEN_TRAIN_DTYPE": "float32",
        "FULMEN_TRAIN_DEVICE": "cpu",
        "FULMEN_TRAIN_ROLLOUT_TIMEOUT_S": "120",
    }
    with scripted_optimizer([GOOD]) as optimizer:
        done = subprocess.run(
            [
                *FULMEN,
                "optimize-prompt",
                "--agent",
                "bench.apo_agent:solve",
                "--dataset",
                str(splits["train"]),
                "--val",
                str(splits["val"]),
                "--test",
                str(splits["test"]),
                "--optimizer-url",
                optimizer.url(),
                "--max-rollouts",
                "12",
                "--model",
                str(tiny_model),
                "--minibatch",
                "2",
                "--train-steps",
                "1",
                "--json",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=540,
            cwd=REPO,
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["train_steps"] == 1 and report["final_model"].endswith("/checkpoints/v1"), report
    assert report["rollouts_used"] <= 12, report  # the GRPO phase's rollouts are not the search's budget

    store = env | {"FULMEN_CLICKHOUSE_PATH": str(Path(report["run_dir"]) / "chdb"), "FULMEN_CLICKHOUSE_READ_PORT": "0"}
    grpo = _sql(store, "SELECT RolloutId, Mode, PromptBundle, ModelVersion FROM rollouts FINAL WHERE Mode = 'train'")
    assert len(grpo) >= 2 and all(r["PromptBundle"] == report["best_bundle"] for r in grpo), grpo  # only GRPO trains
    assert all(r["ModelVersion"] is not None for r in grpo), grpo
    ids = ", ".join(f"'{r['RolloutId']}'" for r in grpo)
    transitions = _sql(store, f"SELECT PromptBundle, ModelVersion FROM transitions FINAL WHERE RolloutId IN ({ids})")
    assert len(transitions) >= 2, transitions  # at least the trained group's, one call a rollout
    assert all(t["PromptBundle"] == report["best_bundle"] and t["ModelVersion"] is not None for t in transitions)
