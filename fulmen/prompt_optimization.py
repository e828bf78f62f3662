"""``fulmen.optimize_prompt(...)``: optimise the prompts an agent already sends, through the whole system, in one call.

    report = fulmen.optimize_prompt(agent="my_agents.solver:run", dataset="train.jsonl", val="val.jsonl",
                                    test="test.jsonl", optimizer_url="https://api.example.com/v1", max_rollouts=200)
    report.best_bundle, report.heldout_before, report.heldout_after

It starts the local stack as ``fulmen.train`` does (:func:`fulmen.algorithm.local.local_stack`: Kafka unless
``FULMEN_KAFKA_BOOTSTRAP``, ``fulmen consume``, both gateways, ``runners`` runners of the agent), then:

1. finds the slots: ``discover`` rollouts (default 1) of the first training tasks with no bundle, and the prompts
   of the chosen ``roles`` (of the chosen ``agents``' calls) they sent, as ``fulmen prompts scan`` would list them;
   ``slots`` picks among them;
2. searches (``gepa`` or ``beam``, :mod:`fulmen.algorithm.prompts.search`) with the
   :class:`~fulmen.algorithm.prompts.system.SystemEvaluator` (each candidate a published bundle, its rollouts
   dispatched through Kafka to the runners, the gateway applying it) and the
   :class:`~fulmen.algorithm.prompts.reflect.ReflectiveProposer` at ``optimizer_url`` (key:
   ``FULMEN_OPTIMIZER_API_KEY``), within ``max_rollouts`` rollouts, the discovery rollout and the test report
   included;
3. scores the agent's own prompts and the best bundle on the test split, publishes every candidate again with its
   lineage (parents, validation scores), counts the calls whose span names a bundle other than their rollout's
   (SQL on the store), and promotes the best bundle when ``promote``, unless it is the agent's own prompts or does
   worse than them on the test split;
4. with ``train_steps`` N: N GRPO steps on the same stack, every training and validation rollout naming the best
   bundle (:func:`fulmen.algorithm.local.train_in_stack`, ``fulmen.train``'s path with ``prompt_bundle``): prompts
   first, then weights; each rollout and transition records its bundle and its model version. The model must be
   one the trainer can load ('tiny' or a directory) served with token ids (not ``FULMEN_LLM_BACKEND=openai``);
   ``train`` holds ``TrainSection`` fields (``fulmen.train``'s keyword arguments), the ``FULMEN_TRAIN_*`` in force
   are the base.

The LLM gateway gets the ``FULMEN_LLM_*`` variables in force (``FULMEN_LLM_BACKEND=openai`` and
``FULMEN_LLM_UPSTREAM_URL`` put any OpenAI-compatible model behind it; ``model`` is then the upstream's name).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fulmen.schemas.errors import ConfigurationError
from fulmen.training import Tasks, _agent_name, _tasks, model_directory

if TYPE_CHECKING:
    from fulmen.algorithm.local import TrainReport
    from fulmen.algorithm.prompts.search import SearchResult
    from fulmen.infra.settings import FulmenSettings

__all__ = ["PromptReport", "PromptSearchOptions", "optimize_prompt"]

log = logging.getLogger(__name__)

_LLM_RUN_OWN = ("FULMEN_LLM_PORT", "FULMEN_LLM_HOST", "FULMEN_LLM_MODEL", "FULMEN_LLM_MODEL_VERSION")
_UPSTREAM_BACKENDS = ("openai", "vllm")


@dataclass(frozen=True)
class PromptReport:
    """What a prompt search gave: the best bundle and its texts, the test-split scores of the agent's own prompts
    (``heldout_before``) and of the best bundle (``heldout_after``), the rollouts used of the budget (discovery and
    test included), the candidates' lineage, calls checked and ``bundle_mismatches`` (calls whose span names a bundle
    other than their rollout's), the promotion made (None: none), the run's id and directory, its wall time, and the
    GRPO phase's report on the best bundle's rollouts (``train_steps``; None without one)."""

    run_id: str
    run_dir: Path
    search: str
    base_bundle: str
    base_slots: dict[str, str]
    best_bundle: str
    best_slots: dict[str, str]
    heldout_before: float
    heldout_after: float
    rollouts_used: int
    max_rollouts: int
    rollouts_to_best: int
    stopped_by: str
    lineage: list[dict[str, Any]]
    calls_checked: int
    bundle_mismatches: int
    promoted: str | None = None
    optimizer_tokens: int = 0
    rollout_ids: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    train: TrainReport | None = None

    def summary(self) -> dict[str, Any]:
        """The report as one JSON-ready object, without the lineage's texts."""
        keys = (
            "run_id",
            "search",
            "base_bundle",
            "best_bundle",
            "heldout_before",
            "heldout_after",
            "rollouts_used",
            "max_rollouts",
            "rollouts_to_best",
            "stopped_by",
            "calls_checked",
            "bundle_mismatches",
            "promoted",
            "optimizer_tokens",
            "wall_s",
        )
        trained = (
            {
                "train_steps": self.train.steps,
                "final_model": str(self.train.final_model or "") or None,
                "train_reward_curve": self.train.reward_curve,
            }
            if self.train is not None
            else {}
        )
        return {k: getattr(self, k) for k in keys} | {"candidates": len(self.lineage)} | trained


class PromptSearchOptions(BaseModel):
    """How :func:`optimize_prompt` searches: its keyword arguments besides the run's, and ``fulmen optimize-prompt``'s
    options (one declaration each)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    search: str = Field("gepa", description="gepa (reflective, Pareto frontier) or beam (the anchor's APO)")
    slots: tuple[str, ...] = Field(
        (), description="the slots to optimise, fp-... as `fulmen prompts scan` lists them; none: every prompt found"
    )
    roles: tuple[str, ...] = Field(("system",), description="the roles whose prompts to optimise")
    agents: tuple[str, ...] = Field(
        (), description="only the prompts of these agents' calls, by their /agent/NAME; none: every agent's"
    )
    discover: int = Field(1, ge=1, description="rollouts of the agent's own prompts that find them")
    seed: int = Field(0, description="the search's seed")
    minibatch: int = Field(4, ge=1, description="gepa: training tasks per minibatch")
    optimizer_model: str = Field("optimizer", description="the model name sent to the optimiser")
    max_optimizer_tokens: int = Field(200_000, ge=1, description="the optimiser's token cap")
    promote: bool = Field(False, description="serve the best bundle to the calls that name none")
    promote_agent: str | None = Field(None, description="promote for this agent only (its /agent/NAME)")
    rollout_timeout_s: float = Field(300.0, gt=0, description="seconds one rollout may take")

    @field_validator("search")
    @classmethod
    def _known_search(cls, name: str) -> str:
        from fulmen.algorithm.prompts.search import get_search

        get_search(name)  # an unknown name fails before anything starts
        return name


def optimize_prompt(
    agent: str | Callable[..., Any],
    dataset: Tasks,
    val: Tasks,
    test: Tasks,
    optimizer_url: str,
    max_rollouts: int,
    *,
    model: str | Path = "tiny",
    runners: int = 1,
    concurrency: int = 32,
    local: bool = True,
    train_steps: int = 0,
    train: Mapping[str, Any] | None = None,
    settings: FulmenSettings | None = None,
    on_phase: Callable[[str], None] | None = None,
    **options: Any,
) -> PromptReport:
    """Optimise ``agent``'s prompts (module docstring). ``dataset``/``val``/``test``: task files or task inputs
    (distinct task ids across the three); ``options``: :class:`PromptSearchOptions` fields (``search="beam"``,
    ``slots=[...]``, ``promote=True``, ...); ``local=False``: no stack is started, the deployment the settings name
    runs the rollouts (its runners must run ``agent``); ``train_steps``/``train``: then GRPO on the best bundle's
    rollouts (step 4 of the module docstring). Raises ConfigurationError for bad arguments, FulmenError when a
    service or the optimiser fails."""
    started = time.perf_counter()
    settings = settings or _settings()
    search = _search_options(options)
    splits = _splits(dataset, val, test, max_rollouts, search.discover)
    discover = min(search.discover, len(splits["dataset"]))
    args = _SearchArgs(
        **search.model_dump() | {"discover": discover}, optimizer_url=optimizer_url, max_rollouts=max_rollouts
    )
    phase = on_phase or (lambda _: None)
    if local:
        report = _run_local(settings, agent, model, splits, args, phase, runners, concurrency, train_steps, train)
    elif train_steps or train:
        raise ConfigurationError(
            "train_steps: the GRPO phase trains on the stack this call starts; against a "
            "deployment, run `fulmen train --prompt-bundle <best bundle>` after the search"
        )
    else:  # the deployment in force (`fulmen up`, or services started by hand) runs the agent
        report = asyncio.run(_run(_deployed(settings), _agent_name(agent), splits, args, phase))
    return dataclasses.replace(report, wall_s=time.perf_counter() - started)


def _settings() -> FulmenSettings:
    from fulmen.infra.settings import FulmenSettings

    return FulmenSettings()


def _search_options(options: Mapping[str, Any]) -> PromptSearchOptions:
    """The search options given as keyword arguments; a ConfigurationError naming the bad ones."""
    try:
        return PromptSearchOptions(**options)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}" for e in exc.errors())
        raise ConfigurationError(
            f"optimize_prompt: {problems} (the search options: {', '.join(PromptSearchOptions.model_fields)})"
        ) from None


def _deployed(settings: FulmenSettings) -> _Where:
    from fulmen.schemas.events import new_id

    run_id = f"prompts-{new_id()[:10]}"
    return _Where(settings, run_id, settings.home / "runs" / run_id, lambda: None)


def _run_local(
    settings: FulmenSettings,
    agent: str | Callable[..., Any],
    model: str | Path,
    splits: dict[str, list],
    args: _SearchArgs,
    phase: Callable[[str], None],
    runners: int,
    concurrency: int,
    train_steps: int,
    train: Mapping[str, Any] | None,
) -> PromptReport:
    """The search on a stack this call starts (and stops), then the GRPO phase when asked for."""
    from fulmen.algorithm.local import LocalPlan, local_stack

    llm_env = {k: v for k, v in os.environ.items() if k.startswith("FULMEN_LLM_") and k not in _LLM_RUN_OWN}
    upstream = llm_env.get("FULMEN_LLM_BACKEND") in _UPSTREAM_BACKENDS
    fields = _train_phase(train_steps, train, upstream)
    plan = LocalPlan(
        _agent_name(agent),
        Path(str(model)) if upstream else model_directory(model, settings.home),
        runners=runners,
        concurrency=concurrency,
        llm_env=llm_env,
        run_prefix="prompts",
    )
    with local_stack(settings, plan, on_phase=phase) as stack:
        where = _Where(stack.client_settings(), stack.run.run_id, stack.run.run_dir, stack.services.check)
        report = asyncio.run(_run(where, plan.agent, splits, args, phase))
        if fields is not None:
            report = dataclasses.replace(report, train=_train_best(stack, plan, fields, report, splits, phase))
    return report


def _train_phase(train_steps: int, train: Mapping[str, Any] | None, upstream: bool) -> dict[str, Any] | None:
    """The GRPO phase's ``TrainSection`` fields (None: no phase), refused before anything starts when it cannot run."""
    from fulmen.algorithm.settings import TrainSettings
    from fulmen.training import train_fields

    if train_steps < 0:
        raise ConfigurationError("train_steps: 0 (no GRPO phase) or more")
    if not train_steps:
        if train:
            raise ConfigurationError("train: GRPO settings without a GRPO phase; pass train_steps too")
        return None
    if upstream:
        raise ConfigurationError(
            "train_steps: GRPO needs the served model's token ids and weights, which "
            "FULMEN_LLM_BACKEND=openai/vllm does not give here; serve 'tiny' or a model "
            "directory with the transformers backend"
        )
    return train_fields(TrainSettings(), train or {}, train_steps)


def _train_best(
    stack: Any,
    plan: Any,
    fields: dict[str, Any],
    report: PromptReport,
    splits: dict[str, list],
    phase: Callable[[str], None],
) -> TrainReport:
    """Step 4: GRPO on the training split, validated on the validation split, every rollout naming the best bundle
    (already on this run's prompts topic: the search published it)."""
    from fulmen.algorithm.local import train_in_stack

    phase(f"GRPO: {fields['steps']} step(s) on rollouts naming the best bundle {report.best_bundle}")
    steps = train_in_stack(
        stack, plan, fields | {"prompt_bundle": report.best_bundle}, splits["dataset"], splits["val"], on_phase=phase
    )
    run = stack.run
    final = run.run_dir / "checkpoints" / f"v{steps[-1].model_version}" if steps else None
    return dataclasses.replace(run.report(), steps=len(steps), final_model=final, wall_s=run.train_s)


def _splits(dataset: Tasks, val: Tasks, test: Tasks, max_rollouts: int, discover: int) -> dict[str, list]:
    splits = {name: _tasks(tasks) for name, tasks in (("dataset", dataset), ("val", val), ("test", test))}
    ids = [t.task_id for tasks in splits.values() for t in tasks]
    if len(set(ids)) != len(ids):
        raise ConfigurationError("dataset, val and test must not share task ids (the report is on test alone)")
    least = discover + len(splits["val"]) + 2 * len(splits["test"])
    if max_rollouts < least:
        raise ConfigurationError(
            f"max_rollouts={max_rollouts} cannot pay for finding the prompts ({discover}), one "
            f"validation pass ({len(splits['val'])}) and the test report of the agent's own "
            f"prompts and the best bundle ({2 * len(splits['test'])}): raise it to at least "
            f"{least}"
        )
    return splits


@dataclass(frozen=True)
class _Where:
    """Where a search runs: the settings its clients use, its run id and directory, and a health check."""

    settings: FulmenSettings
    run_id: str
    run_dir: Path
    check: Callable[[], None]


class _SearchArgs(PromptSearchOptions):
    """The search options with the optimiser's URL and the rollout budget."""

    optimizer_url: str
    max_rollouts: int


async def _run(
    where: _Where, agent: str, splits: dict[str, list], args: _SearchArgs, phase: Callable[[str], None]
) -> PromptReport:
    from fulmen.algorithm.prompts.bundles import PROMPTS_SENDER
    from fulmen.algorithm.prompts.evidence import episode_evidence
    from fulmen.algorithm.prompts.system import EvaluatorOptions, SystemEvaluator
    from fulmen.algorithm.service.collector import Collector
    from fulmen.algorithm.service.groups import GroupBook
    from fulmen.algorithm.service.run import SENDER
    from fulmen.algorithm.settings import IncompletePolicy
    from fulmen.infra.kafka.broker import kafka_broker
    from fulmen.infra.kafka.clients import close_quietly, consumer, start_or_raise
    from fulmen.infra.kafka.publish import EventPublisher
    from fulmen.infra.store import open_reader
    from fulmen.schemas.topics import TopicKey, topic_name

    settings = where.settings
    broker = kafka_broker(settings)
    transitions = topic_name(TopicKey.TRANSITIONS, settings.kafka.topic_prefix)
    source = consumer(settings, f"{where.run_id}.prompts", transitions)
    await start_or_raise(broker, settings, "prompt search publisher")
    reader = None
    try:
        await start_or_raise(source, settings, "prompt search collector")
        reader = await asyncio.to_thread(open_reader, settings)
        db = settings.clickhouse.database
        book = GroupBook(timeout_s=args.rollout_timeout_s + 60.0, policy=IncompletePolicy.DROP)
        options = EvaluatorOptions(
            agent=agent,
            run_id=where.run_id,
            source=args.search,
            bundle_agent=args.promote_agent,
            rollout_timeout_s=args.rollout_timeout_s,
        )
        evaluator = SystemEvaluator(
            EventPublisher(broker, SENDER),
            EventPublisher(broker, PROMPTS_SENDER),
            Collector(source, book),
            [t for tasks in splits.values() for t in tasks],
            asyncio.get_running_loop(),
            options,
            evidence=lambda ids: episode_evidence(reader, db, ids),
            check=where.check,
        )
        first = splits["dataset"][: args.discover]
        phase(f"finding the prompts the agent sends ({len(first)} rollout(s) of training tasks, no bundle)")
        base = await _discover(evaluator, reader, db, first, args)
        phase(
            f"searching ({args.search}, at most {args.max_rollouts} rollouts in all) over {len(base)} slot(s): "
            f"{', '.join(sorted(base))}"
        )
        result, tokens = await asyncio.to_thread(_search, evaluator, base, splits, args)
        return await _finish(where, evaluator, reader, base, result, tokens, args, phase)
    finally:
        if reader is not None:
            reader.close()
        await close_quietly([source, broker])


async def _discover(evaluator: Any, reader: Any, database: str, tasks: list, args: _SearchArgs) -> dict[str, str]:
    """The base slots: the prompts of ``args.roles`` (of ``args.agents``' calls, when named) that rollouts of
    ``tasks`` sent with no bundle; or those ``args.slots`` names."""
    from fulmen.prompt_queries import scan_prompts

    episodes = await evaluator.evaluate(None, [t.task_id for t in tasks])
    rollouts = tuple(e.rollout_id for e in episodes)
    found = await asyncio.to_thread(scan_prompts, reader, database, args.roles, 100, rollouts)
    sent = {p.slot: p.text for p in found if not args.agents or set(p.agents) & set(args.agents)}
    wanted = list(args.slots) or sorted(sent)
    missing = [s for s in wanted if s not in sent]
    if not wanted or missing:
        whose = f" by agent(s) {', '.join(args.agents)}" if args.agents else ""
        raise ConfigurationError(
            f"the agent's {len(rollouts)} rollout(s) with its own prompts sent no {'/'.join(args.roles)} prompt{whose}"
            + (f" named {', '.join(missing)}" if missing else "")
            + f" (found: {', '.join(sorted(sent)) or 'none'}); check that it calls the LLM through the base_url it "
            "is given, or change --role / --only-agent / --slot, or run more rollouts first (--discover)"
        )
    return {s: sent[s] for s in wanted}


def _search(
    evaluator: Any, base: dict[str, str], splits: dict[str, list], args: _SearchArgs
) -> tuple[SearchResult, int]:
    from fulmen.algorithm.prompts.reflect import ReflectiveProposer
    from fulmen.algorithm.prompts.search import SearchConfig, optimize
    from fulmen.schemas.prompts import validate_slot_text

    proposer = ReflectiveProposer(
        args.optimizer_url,
        args.optimizer_model,
        max_tokens_total=args.max_optimizer_tokens,
        validate=validate_slot_text,
    )
    try:
        config = SearchConfig(seed=args.seed, minibatch=args.minibatch)
        result = optimize(
            evaluator,
            proposer,
            base,
            train=[t.task_id for t in splits["dataset"]],
            val=[t.task_id for t in splits["val"]],
            test=[t.task_id for t in splits["test"]],
            max_rollouts=args.max_rollouts - args.discover,
            search=args.search,
            config=config,
        )
    finally:
        proposer.close()
    return result, proposer.tokens_used


async def _finish(
    where: _Where,
    evaluator: Any,
    reader: Any,
    base: dict[str, str],
    result: SearchResult,
    tokens: int,
    args: _SearchArgs,
    phase: Callable[[str], None],
) -> PromptReport:
    from fulmen.prompt_queries import bundle_mismatches
    from fulmen.schemas.prompts import PromptBundle
    from fulmen.schemas.topics import TopicKey

    settings = where.settings
    o = evaluator.options
    lineage = [
        PromptBundle.create(
            c.slots,
            templates=o.templates,
            parents=c.parents,
            scores=c.scores,
            agent=o.bundle_agent,
            source=args.search,
            run_id=o.run_id,
        )
        for c in result.candidates
    ]
    await evaluator.bundles.publish_many(TopicKey.PROMPTS, lineage)
    calls, mismatches = await asyncio.to_thread(
        bundle_mismatches, reader, settings.clickhouse.database, tuple(evaluator.rollout_ids)
    )
    base_id = evaluator.bundle(base).bundle_id
    promoted = await _promote(settings, result, base_id, args, o.run_id, phase) if args.promote else None
    return PromptReport(
        run_id=o.run_id,
        run_dir=where.run_dir,
        search=args.search,
        base_bundle=base_id,
        base_slots=dict(base),
        best_bundle=result.best.id,
        best_slots=dict(result.best.slots),
        heldout_before=result.report["heldout_before"],
        heldout_after=result.report["heldout_after"],
        rollouts_used=result.rollouts_used + args.discover,
        max_rollouts=args.max_rollouts,
        rollouts_to_best=result.rollouts_to_best + args.discover,
        stopped_by=result.stopped_by,
        lineage=[row | {"found_at_rollouts": row["found_at_rollouts"] + args.discover} for row in result.lineage()],
        calls_checked=calls,
        bundle_mismatches=mismatches,
        promoted=promoted,
        optimizer_tokens=tokens,
        rollout_ids=list(evaluator.rollout_ids),
    )


async def _promote(
    settings: FulmenSettings,
    result: SearchResult,
    base_id: str,
    args: _SearchArgs,
    run_id: str,
    phase: Callable[[str], None],
) -> str | None:
    """Promote the best bundle unless it is the agent's own prompts or does worse than them on the test split; the
    bundle promoted (None: none)."""
    from fulmen.algorithm.prompts.bundles import decide_prompt
    from fulmen.schemas.events import PromotionAction

    before, after = result.report["heldout_before"], result.report["heldout_after"]
    if result.best.id == base_id:
        phase("not promoting: no candidate beat the agent's own prompts")
        return None
    if after < before:
        phase(f"not promoting {result.best.id}: it does worse than the agent's own prompts on test")
        return None
    phase(f"promoting {result.best.id} for {args.promote_agent or 'every agent'}")
    reason = f"fulmen optimize-prompt {run_id}: test {after:.3f} (was {before:.3f})"
    event = await decide_prompt(settings, PromotionAction.PROMOTE, result.best.id, args.promote_agent, reason)
    return event.bundle_id
