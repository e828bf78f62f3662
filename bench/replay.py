"""Learning from what the agent already did: replay of stored transitions and late feedback, against on-policy.

On the demo task (``fulmen demo``'s agent, warmed-up tiny model, its tuned GRPO settings), every arm through the
whole system (Kafka, ``fulmen consume``, both gateways, a runner for validation, the trainer):

- ``onpolicy``: a demo run of N steps; ``onpolicy_gain`` = its held-out accuracy after minus before;
- ``replay``: a fresh run from the same warmed-up model that trains N steps on the first run's stored transitions
  (``FULMEN_TRAIN_REPLAY_SQL``: its train rollouts, read from its store; no training rollout is run), validated on
  the same held-out set through the system: ``replay_gain``, ``replay_fraction`` = replay_gain / onpolicy_gain;
- ``late``: the first run's store copied, its recorded rewards withheld (the copy's transitions lose their call
  and episode rewards, as if the agent had reported none at run time), then every train rollout's reward sent
  through the LLM gateway's ``POST /v1/feedback`` (Kafka, the feedback sink, the store's feedback table), then the
  same replay from the copy: ``late_feedback_gain``. The rewards sent are the ones the first run recorded (the
  grader's verdict, arriving late), so the arm checks that the late path loses nothing;
- ``refused_rows``: what the replays refused, by reason;
- ``promote`` and ``promote_shuffled``: two demo runs with ``--promote-if-better`` (every version validated on the
  held-out set, promoted only when it reaches the serving version's accuracy), the second with its rewards shuffled
  (the control: nothing it learns is real): ``promoted_versions`` and ``rejected_versions`` of each.

Each arm runs in its own process (one embedded store per process); the first run's store is reused by the others.

    .venv/bin/python bench/replay.py [--steps 15] [--home DIR] [--out DIR]

The warmed-up model is built once (``fulmen.algorithm.demo.warmup``, ~5 min on 2 cores) or reused from ``--home``
(default: the e2e tests' cache). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from fulmen.algorithm.demo.run import AGENT, DemoOptions, train_fields
from fulmen.algorithm.demo.tasks import heldout_tasks, train_tasks
from fulmen.algorithm.demo.warmup import warm_up
from fulmen.algorithm.local import LocalPlan, run_locally
from fulmen.infra.settings import FulmenSettings

TRAIN_ROLLOUTS = "SELECT RolloutId FROM fulmen.rollouts WHERE Mode = 'train'"
HERE = Path(__file__).resolve()


def _settings(home: Path) -> FulmenSettings:
    return FulmenSettings.model_validate({"home": home})


def _options(steps: int) -> DemoOptions:
    return DemoOptions(steps=steps)


def _summary(run: Any) -> dict[str, Any]:
    curve = run.accuracy_curve()
    before, after = curve[0][1], curve[-1][1]
    extra = run.steps[-1].extra if run.steps else {}
    refused = {k.removeprefix("replay_refused_"): int(v) for k, v in extra.items() if k.startswith("replay_refused_")}
    return {
        "run_dir": str(run.run_dir),
        "store": str(run.store_path),
        "before": before,
        "after": after,
        "gain": round(after - before, 4),
        "curve": [[s, round(a, 4)] for s, a in curve],
        "steps": len(run.steps),
        "s_per_step": round(run.train_s / max(len(run.steps), 1), 2),
        "refused": refused,
        "replayed_rollouts": int(extra.get("replay_rollouts", 0)),
    }


def arm_onpolicy(args: argparse.Namespace) -> dict[str, Any]:
    from fulmen.algorithm.demo.run import run_demo

    options = DemoOptions(steps=args.steps, warmup_dir=args.home / "demo-warmup", run_dir=args.out / "onpolicy")
    return _summary(run_demo(_settings(args.home), options, on_phase=_say, on_step=_step))


def arm_replay(args: argparse.Namespace) -> dict[str, Any]:
    options = _options(args.steps)
    model = warm_up(args.home / "demo-warmup", options.warmup)
    plan = LocalPlan(AGENT, model, runners=1, concurrency=options.concurrency, run_prefix="replay")
    heldout = heldout_tasks(options.heldout, warmup_count=options.warmup.steps * options.warmup.batch)
    fields = train_fields(options) | {"replay_sql": TRAIN_ROLLOUTS, "source_store": str(args.store)}
    run = run_locally(
        _settings(args.home), plan, fields, [], heldout, run_dir=args.out / args.name, on_phase=_say, on_step=_step
    )
    return _summary(run)


WITHHELD_TABLES = ("transitions", "rollouts", "model_versions")
"""What the late arm's store holds of the first run's: the trained-on calls, the rollouts (feedback on a rollout
id resolves there) and the versions (replay's base-model check)."""


def arm_promote(args: argparse.Namespace) -> dict[str, Any]:
    """A demo run with gated promotion (``--shuffled``: the rewards shuffled within each step)."""
    options = _options(args.steps)
    model = warm_up(args.home / "demo-warmup", options.warmup)
    plan = LocalPlan(AGENT, model, runners=1, concurrency=options.concurrency, run_prefix="promote")
    heldout = heldout_tasks(options.heldout, warmup_count=options.warmup.steps * options.warmup.batch)
    fields = train_fields(options) | {"promote_if_better": True, "shuffle_rewards": args.shuffled}
    run = run_locally(
        _settings(args.home),
        plan,
        fields,
        train_tasks(),
        heldout,
        run_dir=args.out / args.name,
        on_phase=_say,
        on_step=_step,
    )
    summary = _summary(run)
    summary["promoted_versions"] = [s.step for s in run.steps if s.extra.get("promoted") == 1.0]
    summary["rejected_versions"] = [s.step for s in run.steps if s.extra.get("promoted") == 0.0]
    summary["held_out_by_version"] = [
        [s.step, round(s.extra["val_accuracy"], 4)] for s in run.steps if "val_accuracy" in s.extra
    ]
    return summary


def arm_withhold(args: argparse.Namespace) -> dict[str, Any]:
    """Read the first run's train rollouts' rewards (the verdicts sent later) and export its tables with every
    recorded reward erased, as Arrow files for :func:`arm_import` (one embedded store per process)."""
    import pyarrow as pa

    from fulmen.infra.store import Store

    settings = FulmenSettings.model_validate({"home": args.home, "clickhouse": {"path": args.store, "read_port": 0}})
    store = Store.open(settings)
    rows = store.query(
        "SELECT RolloutId, any(EpisodeReward) FROM fulmen.transitions WHERE Mode = 'train' GROUP BY RolloutId"
    ).rows
    verdicts = {str(r[0]): r[1] for r in rows if r[1] is not None}
    export = args.to.parent / "export"
    export.mkdir(parents=True, exist_ok=True)
    for table in WITHHELD_TABLES:
        data = store.query_arrow(f"SELECT * FROM fulmen.{table}")
        for column in ("Reward", "IntermediateReward", "EpisodeReward"):  # as if the agent had reported none
            if column in data.column_names:
                index = data.column_names.index(column)
                data = data.set_column(index, column, pa.nulls(len(data), data.schema.field(column).type))
        with pa.OSFile(str(export / f"{table}.arrow"), "wb") as sink, pa.ipc.new_stream(sink, data.schema) as out:
            out.write_table(data)
    (args.to.parent / "verdicts.json").write_text(json.dumps(verdicts))
    return {"rollouts": len(verdicts)}


def arm_import(args: argparse.Namespace) -> dict[str, Any]:
    """A fresh store at ``--to`` holding the exported tables (rewards erased)."""
    import pyarrow as pa

    from fulmen.infra.store import Store

    shutil.rmtree(args.to, ignore_errors=True)
    settings = FulmenSettings.model_validate({"home": args.home, "clickhouse": {"path": args.to, "read_port": 0}})
    store = Store.open(settings)
    store.migrate()
    counts = {}
    for table in WITHHELD_TABLES:
        with pa.OSFile(str(args.to.parent / "export" / f"{table}.arrow"), "rb") as source:
            counts[table] = store.insert_arrow(table, pa.ipc.open_stream(source).read_all())
    left = store.query("SELECT count() FROM fulmen.transitions WHERE Reward IS NOT NULL OR EpisodeReward IS NOT NULL")
    return {"rows": counts, "rewards_left": int(left.rows[0][0])}


def arm_feedback(args: argparse.Namespace) -> dict[str, Any]:
    """Serve the copy (``fulmen consume`` and the LLM gateway on it), send each verdict to ``POST /v1/feedback``
    and wait until the store holds them all."""
    from fulmen.infra.processes import Services
    from fulmen.infra.services import ensure_kafka
    from fulmen.infra.stack import StackPorts, core_services
    from fulmen.infra.store.read_endpoint import RemoteReader

    verdicts: dict[str, float] = json.loads((args.to.parent / "verdicts.json").read_text())
    options = _options(args.steps)
    model = warm_up(args.home / "demo-warmup", options.warmup)
    settings = _settings(args.home)
    settings = settings.model_copy(update={"kafka": settings.kafka.model_copy(update={"topic_prefix": "late."})})
    ready = ensure_kafka(settings)
    ports = StackPorts.free()
    env = {
        "FULMEN_KAFKA_BOOTSTRAP": ready.bootstrap,
        "FULMEN_KAFKA_TOPIC_PREFIX": "late.",
        "FULMEN_HOME": str(args.home),
        "FULMEN_CLICKHOUSE_PATH": str(args.to),
    }
    started = time.perf_counter()
    try:
        with Services(args.to.parent / "logs", env) as services:
            for spec in core_services(ports, model=str(model), llm_env={"FULMEN_LLM_DEVICE": "cpu"}):
                services.start(spec)
            latencies = []
            with httpx.Client(base_url=ports.llm_url, timeout=30) as client:
                for rollout_id, value in verdicts.items():
                    sent = time.perf_counter()
                    answer = client.post(
                        "/v1/feedback",
                        json={"rollout_id": rollout_id, "value": value, "comment": "graded after the run"},
                    )
                    answer.raise_for_status()
                    latencies.append(time.perf_counter() - sent)
            reader = RemoteReader(ports.read_url)
            deadline = time.monotonic() + 300
            stored = 0
            while time.monotonic() < deadline:
                stored = int(reader.query("SELECT uniqExact(RolloutId) FROM fulmen.feedback").rows[0][0])
                if stored >= len(verdicts):
                    break
                time.sleep(1.0)
            reader.close()
    finally:
        if ready.started is not None:
            ready.started.stop()
    latencies.sort()
    return {
        "sent": len(verdicts),
        "stored": stored,
        "s": round(time.perf_counter() - started, 1),
        "feedback_p50_ms": round(1000 * latencies[len(latencies) // 2], 1) if latencies else None,
        "feedback_p99_ms": round(1000 * latencies[int(len(latencies) * 0.99)], 1) if latencies else None,
    }


ARMS = {
    "onpolicy": arm_onpolicy,
    "replay": arm_replay,
    "withhold": arm_withhold,
    "import": arm_import,
    "feedback": arm_feedback,
    "promote": arm_promote,
}


def _say(text: str) -> None:
    print(f"• {text}", file=sys.stderr, flush=True)


def _step(event: Any) -> None:
    held = event.extra.get("val_accuracy")
    print(
        f"step {event.step}: reward {event.reward_mean:.3f}" + (f", held-out {held:.3f}" if held is not None else ""),
        file=sys.stderr,
        flush=True,
    )


def _arm(arm: str, args: argparse.Namespace, **more: Any) -> dict[str, Any]:
    """Run one arm in its own process; its JSON line."""
    command = [
        sys.executable,
        str(HERE),
        "--arm",
        arm,
        "--steps",
        str(args.steps),
        "--home",
        str(args.home),
        "--out",
        str(args.out),
    ]
    for key, value in more.items():
        command += [f"--{key}", str(value)] if value != "" else [f"--{key}"]
    _say(f"arm {arm} {more or ''}")
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"arm {arm} failed (exit {done.returncode})")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--home", type=Path, default=Path.home() / ".cache" / "fulmen" / "test-models" / "demo-home")
    parser.add_argument("--out", type=Path, default=Path("/tmp/fulmen-bench-replay"))
    parser.add_argument("--arm", choices=sorted(ARMS), help="(internal) run one arm in this process")
    parser.add_argument("--store", type=Path, help="(internal) the store an arm reads")
    parser.add_argument("--to", type=Path, help="(internal) where the withheld copy goes")
    parser.add_argument("--name", default="replay", help="(internal) the arm's run directory name")
    parser.add_argument("--shuffled", action="store_true", help="(internal) promote arm: shuffle the rewards")
    parser.add_argument("--only", default="replay,late,promote", help="which comparisons: replay, late, promote")
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(ARMS[args.arm](args)), flush=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    only = set(args.only.split(","))
    result: dict[str, Any] = {"steps": args.steps}
    if only & {"replay", "late"}:
        onpolicy = _arm("onpolicy", args)
        gain = onpolicy["gain"]
        result.update(onpolicy_gain=gain, onpolicy=onpolicy)
    if "replay" in only:
        replay = _arm("replay", args, store=onpolicy["store"], name="replay")
        result.update(
            replay_gain=replay["gain"],
            replay_fraction=round(replay["gain"] / gain, 3) if gain > 0 else None,
            refused_rows=replay["refused"],
            replay=replay,
        )
    if "late" in only:
        copy = args.out / "late" / "chdb"
        withheld = _arm("withhold", args, store=onpolicy["store"], to=copy) | _arm("import", args, to=copy)
        feedback = _arm("feedback", args, to=copy)
        late = _arm("replay", args, store=copy, name="late-replay")
        result.update(
            late_feedback_gain=late["gain"],
            late_refused_rows=late["refused"],
            withheld=withheld,
            feedback=feedback,
            late=late,
        )
    if "promote" in only:
        normal = _arm("promote", args, name="promote")
        control = _arm("promote", args, name="promote-shuffled", shuffled="")
        result.update(
            promoted_versions={"normal": normal["promoted_versions"], "shuffled": control["promoted_versions"]},
            rejected_versions={"normal": normal["rejected_versions"], "shuffled": control["rejected_versions"]},
            promote=normal,
            promote_shuffled=control,
        )
    result["wall_s"] = round(time.perf_counter() - began, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
