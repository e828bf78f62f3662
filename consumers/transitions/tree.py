"""The trace tree of one rollout: its spans (from every trace it touched), parents repaired, in episode order.

A rollout's spans are those stamped with its id and attempt. They may belong to several traces: the agent's own
(under the runner's ``fulmen.rollout`` span), and one per LLM call when the agent does not propagate the W3C
``traceparent`` to the LLM gateway, plus any a tool or a second process started. Some parents may be missing
(a span lost, or not stamped). :meth:`TraceTree.build` turns that forest into one tree:

1. duplicates (the same trace id and span id twice) are kept once; parent links that form a cycle are cut;
2. the *main root* is the ``fulmen.rollout`` span if there is one, else the earliest root;
3. every other root (the root of another trace, or a span whose parent is missing) is *grafted* under the
   deepest span that encloses it in time (start <= its start, its end <= end), ties to the latest-started
   span; a root that nothing encloses stays a root. So an LLM gateway span that arrived as a trace of its
   own hangs under the client span, node or agent that was waiting for it, and inherits that agent's name.

Grafting by time assumes the processes share a clock (one machine, or NTP-synchronised hosts); with
parallel branches it picks the deepest enclosing span, which is the right one unless two branches overlap.
Order: spans are ordered by (start, end, trace id, span id), which is the order of the calls in the episode.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from fulmen.schemas import semconv

__all__ = ["SpanKey", "SpanRecord", "TraceTree"]

SpanKey = tuple[str, str]
"""(trace id, span id), both lowercase hex."""


@dataclass(frozen=True, slots=True)
class SpanRecord:
    """What the transitions consumer reads of one span (a row of ``otel_traces``).

    ``attributes`` holds only the few attributes the selection reads (see ``reader.EXTRA_ATTRIBUTES``);
    ``event_rewards`` are (time in ns, value) of the span's events that carry a reward (such as the gen_ai
    ``gen_ai.evaluation.result`` event), ``event_response_ids`` the ``gen_ai.response.id`` each of those events
    names ("" when none; aligned with ``event_rewards``); ``links`` are the spans this one links to.
    """

    trace_id: str
    span_id: str
    parent_span_id: str = ""
    name: str = ""
    start_ns: int = 0
    end_ns: int = 0
    agent_name: str = ""
    attributes: Mapping[str, str] = field(default_factory=dict)
    prompt_token_ids: tuple[int, ...] = ()
    response_token_ids: tuple[int, ...] = ()
    response_logprobs: tuple[float, ...] = ()
    model_version: int | None = None
    reward: float | None = None
    event_rewards: tuple[tuple[int, float], ...] = ()
    event_response_ids: tuple[str, ...] = ()
    links: tuple[SpanKey, ...] = ()

    @property
    def key(self) -> SpanKey:
        return (self.trace_id, self.span_id)

    @property
    def is_llm_call(self) -> bool:
        """An LLM call that training can use: it carries the prompt and the response token ids."""
        return bool(self.prompt_token_ids) and bool(self.response_token_ids)

    @property
    def is_rollout_root(self) -> bool:
        """The runner's span around the whole agent run (its reward is the episode reward)."""
        return self.name == semconv.SPAN_ROLLOUT


@dataclass
class TraceTree:
    """Spans of one rollout with parent links (repaired), in episode order; build it with :meth:`build`.

    ``spans`` is ordered by (start, end, trace id, span id); ``parent`` maps a span to its parent (original or
    grafted); ``grafted`` holds the links :meth:`build` added; ``roots`` are the spans left without parent.
    """

    spans: dict[SpanKey, SpanRecord]
    parent: dict[SpanKey, SpanKey]
    roots: list[SpanKey]
    grafted: dict[SpanKey, SpanKey]
    position: dict[SpanKey, int]

    @classmethod
    def build(cls, records: Iterable[SpanRecord]) -> TraceTree:
        unique: dict[SpanKey, SpanRecord] = {}
        for record in records:
            unique.setdefault(record.key, record)
        ordered = sorted(unique.values(), key=lambda s: (s.start_ns, s.end_ns, s.trace_id, s.span_id))
        spans = {s.key: s for s in ordered}
        parent = {
            s.key: (s.trace_id, s.parent_span_id)
            for s in ordered
            if s.parent_span_id and s.parent_span_id != s.span_id and (s.trace_id, s.parent_span_id) in spans
        }
        _cut_cycles(parent, spans)
        tree = cls(spans, parent, [], {}, {key: i for i, key in enumerate(spans)})
        tree._graft_roots()
        return tree

    # --- navigation -----------------------------------------------------------------------------------------
    def ancestors(self, key: SpanKey, *, include_self: bool = True) -> Iterator[SpanKey]:
        """``key`` (if asked), its parent, its grandparent... up to a root."""
        current: SpanKey | None = key if include_self else self.parent.get(key)
        while current is not None:
            yield current
            current = self.parent.get(current)

    def depth(self, key: SpanKey) -> int:
        return sum(1 for _ in self.ancestors(key, include_self=False))

    def is_under(self, key: SpanKey, ancestor: SpanKey) -> bool:
        """Whether ``ancestor`` is ``key`` or one of its ancestors."""
        return any(k == ancestor for k in self.ancestors(key))

    def __len__(self) -> int:
        return len(self.spans)

    # --- repair ---------------------------------------------------------------------------------------------
    def _graft_roots(self) -> None:
        roots = [key for key in self.spans if key not in self.parent]
        main = next((key for key in roots if self.spans[key].is_rollout_root), roots[0] if roots else None)
        for root in roots:
            if root == main:
                continue
            host = self._enclosing(root)
            if host is not None:
                self.parent[root] = host
                self.grafted[root] = host
        self.roots = [key for key in self.spans if key not in self.parent]

    def _enclosing(self, root: SpanKey) -> SpanKey | None:
        """The deepest span (latest-started on ties) that encloses ``root`` in time and is not under it."""
        span = self.spans[root]
        best: tuple[int, int, int] | None = None
        host = None
        for key, other in self.spans.items():
            if other.start_ns > span.start_ns:
                break  # ordered by start: nothing later can enclose it
            if key == root or other.end_ns < span.end_ns or self.is_under(key, root):
                continue
            rank = (self.depth(key), other.start_ns, -(other.end_ns - other.start_ns))
            if best is None or rank > best:
                best, host = rank, key
        return host


def _cut_cycles(parent: dict[SpanKey, SpanKey], spans: Mapping[SpanKey, SpanRecord]) -> None:
    """Parent links never form a loop in valid data; if they do, the loop's earliest span becomes a root."""
    done: set[SpanKey] = set()
    for start in spans:
        path: list[SpanKey] = []
        on_path: set[SpanKey] = set()
        current: SpanKey | None = start
        while current is not None and current not in done:
            if current in on_path:
                loop = path[path.index(current) :]
                del parent[min(loop, key=lambda k: (spans[k].start_ns, k))]
                break
            path.append(current)
            on_path.add(current)
            current = parent.get(current)
        done.update(path)
