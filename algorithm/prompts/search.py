"""The two prompt searches, ``gepa`` (reflective, Pareto frontier, minibatch-gated) and ``beam`` (the anchor's APO).

Both take a ``Scorer`` (evaluator + hard rollout budget) and a ``Proposer``, record every candidate's lineage,
stop when the budget or the optimiser's tokens run out, and are deterministic for a given seed (given a
deterministic evaluator and proposer). Neither looks at the test split: ``optimize`` scores the best candidate
on it after the search, with rollouts reserved for it up front.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fulmen.algorithm.prompts.base import (
    Candidate,
    Episode,
    ProposalRequest,
    Proposer,
    RolloutBudget,
    Scorer,
    SearchStopped,
    candidate_id,
)
from fulmen.schemas.errors import ConfigurationError

__all__ = ["SEARCHES", "SearchConfig", "SearchResult", "beam", "frontier", "gepa", "get_search", "optimize"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SearchConfig:
    """Knobs of both searches. ``slots``: the slots to edit (None: all); ``all_slots``: edit them all at once."""

    seed: int = 0
    minibatch: int = 4
    slots: Sequence[str] | None = None
    all_slots: bool = False
    success: float = 1.0  # an episode below this reward is a failure shown to the proposer
    width: int = 2  # beam
    branch: int = 2  # beam
    rounds: int = 3  # beam
    max_iterations: int = 1000  # a safety net; the budget ends a search first
    templates: Mapping[str, str] | None = None  # the bundle's original templates (part of its published id)


@dataclass
class SearchResult:
    """The candidates in creation order, the best one, the refused proposals, and the rollouts used."""

    candidates: list[Candidate]
    best: Candidate
    rejected: list[dict[str, Any]]
    rollouts_used: int
    stopped_by: str = ""
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def rollouts_to_best(self) -> int:
        return self.best.found_at_rollouts

    def lineage(self) -> list[dict[str, Any]]:
        return [c.lineage_row() for c in self.candidates]


class _State:
    """What a search run carries: scorer, proposer, candidates, refused texts per slot, round-robin cursor."""

    def __init__(self, scorer: Scorer, proposer: Proposer, base: Mapping[str, str], config: SearchConfig) -> None:
        slots = list(config.slots) if config.slots else sorted(base)
        missing = [s for s in slots if s not in base]
        if not slots or missing:
            raise ConfigurationError(f"no slots to edit (asked {list(config.slots or [])}, base has {sorted(base)})")
        self.scorer, self.proposer, self.config = scorer, proposer, config
        self.slots = slots
        self.rng = random.Random(config.seed)
        self.candidates: list[Candidate] = []
        self.by_id: dict[str, Candidate] = {}
        self.rejected: dict[str, list[str]] = {s: [] for s in slots}
        self.rejected_log: list[dict[str, Any]] = []
        self.cursor = 0

    def next_slots(self) -> list[str]:
        if self.config.all_slots:
            return list(self.slots)
        slot = self.slots[self.cursor % len(self.slots)]
        self.cursor += 1
        return [slot]

    def score(self, slots: Mapping[str, str], parents: list[str], val: Sequence[str], **why: Any) -> Candidate:
        episodes = self.scorer.run(slots, val)
        cand = Candidate(
            id=candidate_id(slots, self.config.templates),
            slots=dict(slots),
            parents=parents,
            scores={e.task_id: e.reward for e in episodes},
            episodes=episodes,
            found_at_rollouts=self.scorer.budget.used,
            accepted_by=dict(why),
        )
        self.candidates.append(cand)
        self.by_id[cand.id] = cand
        log.info("candidate %s scored %.3f on validation (rollouts %d)", cand.id, cand.mean, cand.found_at_rollouts)
        return cand

    def propose(self, parent: Candidate, failing: Sequence[Episode], edit: list[str]) -> dict[str, str] | None:
        """A child slot map, or None when the proposer had nothing new (already tried, refused, unchanged)."""
        request = ProposalRequest(
            parent=dict(parent.slots),
            slots=edit,
            failing=list(failing),
            rejected={s: list(self.rejected[s]) for s in edit},
        )
        proposal = self.proposer.propose(request)
        texts = {s: t for s, t in (proposal.texts or {}).items() if s in edit}
        child = {**parent.slots, **texts}
        if not texts or child == parent.slots or candidate_id(child, self.config.templates) in self.by_id:
            return None
        if any(texts[s] in self.rejected[s] for s in texts):
            return None
        return child

    def refuse(self, parent: Candidate, child: Mapping[str, str], **why: Any) -> None:
        for slot in self.slots:
            if child[slot] != parent.slots[slot]:
                self.rejected[slot].append(child[slot])
        self.rejected_log.append({"parent": parent.id, "id": candidate_id(child, self.config.templates), **why})

    def best(self) -> Candidate:
        # highest validation mean; the earliest wins a tie
        return max(self.candidates, key=lambda c: (c.mean, -self.candidates.index(c)))

    def result(self, stopped_by: str) -> SearchResult:
        return SearchResult(self.candidates, self.best(), self.rejected_log, self.scorer.budget.used, stopped_by)


def frontier(candidates: Sequence[Candidate], tasks: Sequence[str]) -> dict[str, int]:
    """Candidate id -> number of validation tasks on which it has the best score (ties count for every leader)."""
    leads: dict[str, int] = {}
    for task in tasks:
        top = max(c.scores.get(task, float("-inf")) for c in candidates)
        for c in candidates:
            if c.scores.get(task, float("-inf")) == top:
                leads[c.id] = leads.get(c.id, 0) + 1
    return leads


def _failing(episodes: Sequence[Episode], success: float) -> list[Episode]:
    return [e for e in episodes if e.reward < success]


def gepa(
    scorer: Scorer,
    proposer: Proposer,
    base: Mapping[str, str],
    train: Sequence[str],
    val: Sequence[str],
    config: SearchConfig,
) -> SearchResult:
    """Reflective search: parent from the Pareto frontier, minibatch-gated child, validation scores for the accepted."""
    st = _State(scorer, proposer, base, config)
    k = min(config.minibatch, len(train))
    if k < 1:
        raise ConfigurationError("gepa needs at least one training task for its minibatches")
    try:
        st.score(base, [], val, role="base")
        for iteration in range(config.max_iterations):
            if all(r >= config.success for r in st.best().scores.values()):
                return st.result("solved")  # every validation task succeeds: nothing left to learn from
            leads = frontier(st.candidates, val)
            ids = [c.id for c in st.candidates if c.id in leads]
            parent = st.by_id[st.rng.choices(ids, weights=[leads[i] for i in ids])[0]]
            batch = st.rng.sample(list(train), k)
            if scorer.budget.remaining < 2 * k:
                return st.result("budget")
            parent_eps = scorer.run(parent.slots, batch)
            failing = _failing(parent_eps, config.success)
            if not failing:
                continue  # nothing to learn from on this minibatch
            child = st.propose(parent, failing, st.next_slots())
            if child is None:
                continue
            child_eps = scorer.run(child, batch)
            parent_sum, child_sum = sum(e.reward for e in parent_eps), sum(e.reward for e in child_eps)
            why = {"iteration": iteration, "minibatch": batch, "parent_sum": parent_sum, "child_sum": child_sum}
            if child_sum > parent_sum:
                st.score(child, [parent.id], val, **why)
            else:
                st.refuse(parent, child, **why)
        return st.result("iterations")
    except SearchStopped as stop:
        log.info("gepa stopped: %s", stop)
        return st.result(type(stop).__name__)


def beam(
    scorer: Scorer,
    proposer: Proposer,
    base: Mapping[str, str],
    train: Sequence[str],
    val: Sequence[str],
    config: SearchConfig,
) -> SearchResult:
    """The anchor's APO: each round each beam member proposes ``branch`` children; keep the top ``width``."""
    del train  # beam selects on the validation set only, as the anchor does
    st = _State(scorer, proposer, base, config)
    try:
        members = [st.score(base, [], val, role="base")]
        for rnd in range(config.rounds):
            children = []
            for member in members:
                failing = _failing(member.episodes, config.success)
                for _ in range(config.branch):
                    child = st.propose(member, failing, st.next_slots())
                    if child is not None:
                        children.append(st.score(child, [member.id], val, round=rnd))
            pool = members + children
            members = sorted(pool, key=lambda c: (-c.mean, st.candidates.index(c)))[: config.width]
        return st.result("rounds")
    except SearchStopped as stop:
        log.info("beam stopped: %s", stop)
        return st.result(type(stop).__name__)


SEARCHES: dict[str, Callable[..., SearchResult]] = {"gepa": gepa, "beam": beam}


def get_search(name: str) -> Callable[..., SearchResult]:
    if name not in SEARCHES:
        raise ConfigurationError(f"unknown search {name!r}; choose one of {sorted(SEARCHES)}")
    return SEARCHES[name]


def optimize(
    evaluator,
    proposer: Proposer,
    base: Mapping[str, str],
    *,
    train: Sequence[str],
    val: Sequence[str],
    test: Sequence[str],
    max_rollouts: int,
    search: str = "gepa",
    config: SearchConfig | None = None,
) -> SearchResult:
    """Search within ``max_rollouts`` (the test passes reserved up front), then score base and best on test."""
    config = config or SearchConfig()
    run = get_search(search)
    if not val or not test:
        raise ConfigurationError("both a validation and a test split are needed (the report is on test)")
    held = 2 * len(test)
    if max_rollouts < held + len(val):
        raise ConfigurationError(
            f"max_rollouts={max_rollouts} cannot pay for one validation pass ({len(val)}) and the test report "
            f"({held}); raise it to at least {held + len(val)}"
        )
    budget = RolloutBudget(max_rollouts)
    budget.max_rollouts -= held  # the search cannot touch what the report needs
    result = run(Scorer(evaluator, budget), proposer, base, train, val, config)
    budget.max_rollouts += held
    report_scorer = Scorer(evaluator, budget)
    before = report_scorer.run(base, test)
    after = before if result.best.slots == dict(base) else report_scorer.run(result.best.slots, test)
    result.rollouts_used = budget.used
    result.report = {
        "search": search,
        "heldout_before": sum(e.reward for e in before) / len(before),
        "heldout_after": sum(e.reward for e in after) / len(after),
        "rollouts_used": budget.used,
        "max_rollouts": max_rollouts,
        "rollouts_to_best": result.rollouts_to_best,
        "best": result.best.id,
        "stopped_by": result.stopped_by,
    }
    return result
