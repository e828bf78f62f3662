"""Intermediate rewards: find the rewards recorded in a rollout's spans and match each to the call it follows.

A reward is observed as a span attribute (``semconv.REWARD_KEYS``: ``fulmen.reward.value``, written by
``emit_reward``; ``gen_ai.evaluation.score.value``) or as a span event carrying one of those attributes (the
gen_ai ``gen_ai.evaluation.result`` event). The runner's ``fulmen.rollout`` span is not one: its reward is
the episode reward, which comes from the rollout event.

Each observation goes to one selected call, by the first rule that applies:

0. it names the response it rates (``gen_ai.response.id`` on the event, else on the span that carries it, as
   on the agent's own LLM span that a ``gen_ai.evaluation.result`` event is attached to) and a selected call
   returned that response (the LLM gateway records the id it answered with): that call;
1. it is recorded on a selected call or inside one (a descendant span, an event of the call span): that call;
2. its span links to selected calls: the last of them;
3. (spans only) its span encloses selected calls in the tree (an agent or evaluation span around the work it
   rates): the last of them;
4. else the last selected call that ended at or before the observation (the reward span's start, or the
   event's time): the call it follows.

An observation before every selected call is unmatched (reported, not credited). A call followed by several
rewards gets their sum.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from fulmen.consumers.transitions.selection import Call
from fulmen.consumers.transitions.tree import SpanKey, TraceTree
from fulmen.schemas import semconv

__all__ = ["RewardMatch", "RewardObservation", "match_rewards", "observe_rewards"]


@dataclass(frozen=True)
class RewardObservation:
    """One reward seen in the spans: its value, when, and the span that carries it."""

    value: float
    time_ns: int
    owner: SpanKey
    on_event: bool = False
    response_id: str = ""  # the response it names (rule 0), "" when none


@dataclass(frozen=True)
class RewardMatch:
    """Per selected call, the sum of the rewards matched to it (None when none was), and what matched nothing."""

    per_call: list[float | None]
    unmatched: list[RewardObservation]


def observe_rewards(tree: TraceTree) -> list[RewardObservation]:
    """Every reward recorded in the rollout's spans, in time order."""
    observed = []
    for key, span in tree.spans.items():
        own = span.attributes.get(semconv.GEN_AI_RESPONSE_ID, "")
        if span.reward is not None and not span.is_rollout_root:
            observed.append(RewardObservation(span.reward, span.start_ns, key, response_id=own))
        named = span.event_response_ids or ("",) * len(span.event_rewards)
        for (time_ns, value), response_id in zip(span.event_rewards, named, strict=True):
            observed.append(RewardObservation(value, time_ns, key, on_event=True, response_id=response_id or own))
    observed.sort(key=lambda o: (o.time_ns, tree.position[o.owner]))
    return observed


def match_rewards(tree: TraceTree, calls: Sequence[Call]) -> RewardMatch:
    """Match every reward observation of ``tree`` to one of ``calls`` (the rules of the module docstring)."""
    per_call: list[float | None] = [None] * len(calls)
    unmatched = []
    index_of = {call.key: i for i, call in enumerate(calls)}
    by_response = {
        response: i
        for i, call in enumerate(calls)
        if (response := call.span.attributes.get(semconv.GEN_AI_RESPONSE_ID))
    }
    by_end = sorted(range(len(calls)), key=lambda i: (calls[i].span.end_ns, calls[i].span.start_ns, i))
    ends = [calls[i].span.end_ns for i in by_end]
    for observation in observe_rewards(tree):
        index = by_response.get(observation.response_id) if observation.response_id else None
        if index is None:
            index = _inside_call(tree, observation.owner, index_of)
        if index is None:
            index = _linked_call(tree, observation.owner, index_of)
        if index is None and not observation.on_event:
            index = _last_enclosed_call(tree, observation.owner, calls)
        if index is None:
            position = bisect.bisect_right(ends, observation.time_ns)
            index = by_end[position - 1] if position else None
        if index is None:
            unmatched.append(observation)
            continue
        previous = per_call[index]
        per_call[index] = observation.value if previous is None else previous + observation.value
    return RewardMatch(per_call, unmatched)


def _inside_call(tree: TraceTree, owner: SpanKey, index_of: dict[SpanKey, int]) -> int | None:
    for ancestor in tree.ancestors(owner):
        if ancestor in index_of:
            return index_of[ancestor]
    return None


def _linked_call(tree: TraceTree, owner: SpanKey, index_of: dict[SpanKey, int]) -> int | None:
    linked = [index_of[link] for link in tree.spans[owner].links if link in index_of]
    return max(linked) if linked else None


def _last_enclosed_call(tree: TraceTree, owner: SpanKey, calls: Sequence[Call]) -> int | None:
    inside = [i for i, call in enumerate(calls) if tree.is_under(call.key, owner)]
    return inside[-1] if inside else None
