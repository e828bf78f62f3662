"""One finished rollout attempt and its spans → one :class:`TransitionBatch` (pure: no I/O).

Steps: build the trace tree (``tree``), select the calls (``selection``), match the intermediate rewards
(``rewards``), and make one :class:`Transition` per call, in episode order (``index`` 0, 1, ...).

* What was observed, not what it is worth: ``intermediate_reward`` is the sum of the rewards matched to the
  call, ``TransitionBatch.episode_reward`` the rollout event's reward (only a succeeded rollout has one).
  ``Transition.reward`` stays None: the run that trains credits each call from these
  (``fulmen.algorithm.service.groups.credit_groups``, its ``FULMEN_TRAIN_CREDIT``), so two runs with different
  strategies can share one consumer.
* A failed or timed-out attempt still yields its batch (status, its calls, their intermediate rewards): the
  calls happened and the trainer may use them (as reward 0, or not at all).
* A call whose ids cannot make a Transition (an id that is not hex, say) is skipped and reported. Response
  logprobs that do not pair one-to-one with the response tokens are dropped (``response_logprobs=None``).
* ``model_version`` is the version the span says served the call, else the rollout event's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import ValidationError

from fulmen.consumers.transitions.rewards import match_rewards
from fulmen.consumers.transitions.selection import Call, select_calls
from fulmen.consumers.transitions.tree import SpanRecord, TraceTree
from fulmen.schemas import semconv
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import RolloutEvent, Transition, TransitionBatch

__all__ = ["BuildOptions", "BuildResult", "build_batch"]


@dataclass(frozen=True)
class BuildOptions:
    """Which calls are kept. ``agent_pattern`` None keeps every call."""

    agent_pattern: re.Pattern[str] | None = None

    @classmethod
    def create(cls, agent_pattern: str | None = None) -> BuildOptions:
        try:
            pattern = re.compile(agent_pattern) if agent_pattern else None
        except re.error as exc:
            raise ConfigurationError(f"agent pattern {agent_pattern!r} is not a regular expression: {exc}") from None
        return cls(pattern)


@dataclass(frozen=True)
class BuildResult:
    """The batch and what building it saw: distinct spans read, LLM calls made (before the agent filter),
    parents repaired, rewards that matched no call, calls skipped (with the reason)."""

    batch: TransitionBatch
    span_count: int
    calls_made: int
    grafted: int
    unmatched_rewards: int
    skipped: list[str] = field(default_factory=list)


def build_batch(event: RolloutEvent, spans: Sequence[SpanRecord], options: BuildOptions) -> BuildResult:
    """The TransitionBatch of terminal ``event`` from the spans of its rollout attempt."""
    if not event.status.terminal:
        raise ValueError(f"rollout {event.rollout_id} attempt {event.attempt} is {event.status.value}, not finished")
    tree = TraceTree.build(spans)
    calls, made = select_calls(tree, options.agent_pattern)
    kept: list[Call] = []
    transitions: list[Transition] = []
    skipped = []
    for call in calls:
        try:
            transitions.append(_transition(event, len(transitions), call))
        except ValidationError as exc:
            skipped.append(f"span {call.span.trace_id}/{call.span.span_id}: {_first_error(exc)}")
        else:
            kept.append(call)
    matched = match_rewards(tree, kept)
    transitions = [
        t.model_copy(update={"intermediate_reward": intermediate})
        for t, intermediate in zip(transitions, matched.per_call, strict=True)
    ]
    batch = TransitionBatch(
        rollout_id=event.rollout_id,
        attempt=event.attempt,
        task_id=event.task_id,
        group_id=event.group_id,
        mode=event.mode,
        status=event.status,
        episode_reward=event.reward,
        model_version=event.model_version,
        transitions=transitions,
    )
    return BuildResult(batch, len(tree), made, len(tree.grafted), len(matched.unmatched), skipped)


def _transition(event: RolloutEvent, index: int, call: Call) -> Transition:
    """The transition of ``call`` without its rewards (filled in once every call is known)."""
    span = call.span
    logprobs = list(span.response_logprobs) if len(span.response_logprobs) == len(span.response_token_ids) else None
    return Transition(
        rollout_id=event.rollout_id,
        attempt=event.attempt,
        index=index,
        trace_id=span.trace_id,
        span_id=span.span_id,
        agent_name=call.agent,
        prompt_bundle=span.attributes.get(semconv.PROMPT_BUNDLE, ""),
        model_version=span.model_version if span.model_version is not None else event.model_version,
        prompt_token_ids=list(span.prompt_token_ids),
        response_token_ids=list(span.response_token_ids),
        response_logprobs=logprobs,
    )


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error.get("loc", ()))
    return f"{where}: {error.get('msg', '')}" if where else str(error.get("msg", ""))
