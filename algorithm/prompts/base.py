"""The search's vocabulary: candidates, episodes, the rollout budget, and the evaluator and proposer protocols.

Pure Python, no services: the searches in ``gepa`` and ``beam`` run against any ``Evaluator`` (a fake table of
rewards in the unit tests, the whole system through the gateway in production) and any ``Proposer`` (a script in
tests, an OpenAI-compatible optimiser otherwise).

Errors::

    FulmenError
    ├── ConfigurationError      bad search arguments (budget smaller than one validation pass, no slots, ...)
    └── SearchStopped           the search cannot go on; it ends and reports what it has
        ├── BudgetExhausted     a dispatch would exceed max_rollouts (refused before anything ran)
        └── OptimizerExhausted  the optimiser's token cap is spent
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fulmen.schemas.errors import ConfigurationError, FulmenError
from fulmen.schemas.prompts import bundle_id

__all__ = [
    "BudgetExhausted",
    "Candidate",
    "Episode",
    "Evaluator",
    "OptimizerExhausted",
    "Proposal",
    "ProposalRequest",
    "Proposer",
    "RolloutBudget",
    "Scorer",
    "SearchStopped",
    "candidate_id",
]


class SearchStopped(FulmenError):
    """The search must end now; it reports the candidates it has."""


class BudgetExhausted(SearchStopped):
    """A dispatch of ``requested`` rollouts would exceed ``max_rollouts``; nothing of it ran."""

    def __init__(self, requested: int, used: int, max_rollouts: int) -> None:
        super().__init__(f"{requested} more rollouts would exceed the budget ({used} of {max_rollouts} used)")
        self.requested, self.used, self.max_rollouts = requested, used, max_rollouts


class OptimizerExhausted(SearchStopped):
    """The optimiser LLM's token cap is spent."""


def candidate_id(slots: Mapping[str, str], templates: Mapping[str, str] | None = None) -> str:
    """The id the candidate has once published: ``fulmen.schemas.prompts.bundle_id`` (a content hash)."""
    return bundle_id(slots, templates)


@dataclass(frozen=True)
class Episode:
    """One rollout of a candidate on a task: its reward, its id in the store, and what went wrong (for reflection)."""

    task_id: str
    reward: float
    rollout_id: str = ""
    evidence: str = ""


@dataclass
class Candidate:
    """A bundle the search has scored: its slots, where it came from, and the scores that chose it."""

    id: str
    slots: dict[str, str]
    parents: list[str]
    scores: dict[str, float] = field(default_factory=dict)  # validation task id -> reward
    episodes: list[Episode] = field(default_factory=list)  # its validation episodes
    found_at_rollouts: int = 0  # rollouts used when its validation scores were in
    accepted_by: dict[str, Any] = field(default_factory=dict)  # the minibatch test (gepa) or round (beam)

    @property
    def mean(self) -> float:
        return sum(self.scores.values()) / len(self.scores) if self.scores else 0.0

    def lineage_row(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "parents": list(self.parents),
            "slots": dict(self.slots),
            "scores": dict(self.scores),
            "mean": self.mean,
            "found_at_rollouts": self.found_at_rollouts,
            "accepted_by": dict(self.accepted_by),
        }


@dataclass(frozen=True)
class ProposalRequest:
    """What a proposer sees: the parent's texts, the slots to edit, the failing episodes, the texts already refused."""

    parent: Mapping[str, str]
    slots: Sequence[str]
    failing: Sequence[Episode]
    rejected: Mapping[str, Sequence[str]]


@dataclass(frozen=True)
class Proposal:
    """A proposer's answer: new texts for (some of) the requested slots; ``None`` means it had nothing new."""

    texts: Mapping[str, str] | None
    tokens: int = 0


class Proposer(Protocol):
    """Proposes new slot texts. Raises ``OptimizerExhausted`` when its token cap is spent."""

    def propose(self, request: ProposalRequest) -> Proposal: ...


class Evaluator(Protocol):
    """Runs a candidate's slots on tasks, one rollout per task, and returns one episode per task, in order.

    It never sees the budget: the ``Scorer`` reserves rollouts before calling it.
    """

    def run(self, slots: Mapping[str, str], task_ids: Sequence[str]) -> list[Episode]: ...


class RolloutBudget:
    """A hard cap on rollouts: ``reserve(n)`` either counts all n or refuses (``BudgetExhausted``) with none counted."""

    def __init__(self, max_rollouts: int) -> None:
        if max_rollouts < 1:
            raise ConfigurationError(f"max_rollouts must be at least 1, got {max_rollouts}")
        self.max_rollouts = max_rollouts
        self.used = 0

    @property
    def remaining(self) -> int:
        return self.max_rollouts - self.used

    def reserve(self, n: int) -> None:
        if self.used + n > self.max_rollouts:
            raise BudgetExhausted(n, self.used, self.max_rollouts)
        self.used += n


class Scorer:
    """The one door to the evaluator: checks the budget before each dispatch and counts every rollout."""

    def __init__(self, evaluator: Evaluator, budget: RolloutBudget) -> None:
        self.evaluator = evaluator
        self.budget = budget

    def run(self, slots: Mapping[str, str], task_ids: Sequence[str]) -> list[Episode]:
        self.budget.reserve(len(task_ids))
        episodes = self.evaluator.run(dict(slots), list(task_ids))
        if len(episodes) != len(task_ids):
            raise FulmenError(f"the evaluator returned {len(episodes)} episodes for {len(task_ids)} tasks")
        return episodes
