"""The chaos bench's load and its observers: OTLP span batches, direct LLM calls, and topic tails.

- :class:`SpanLoad` posts OTLP/protobuf batches to the OTLP gateway at a fixed pace, each span tagged with the
  phase it was sent in (``chaos.phase``); a batch whose POST fails (connection refused during a kill, 5xx,
  503) is posted again, unchanged, until it gets a 200, as the stock exporter's retry would. A span is
  *sent* once its batch got a 200.
- :class:`LlmLoad` calls ``/v1/chat/completions`` on the LLM gateway directly (no rollout), retrying until a
  200; each 200's response id is a *sent* call.
- :class:`FeedbackLoad` posts late feedback to the LLM gateway's ``/v1/feedback`` for calls and rollouts that
  exist; each 202's feedback id is a *sent* feedback.
- :class:`TopicTail` follows topics from their beginning (no consumer group) and keeps each record's broker
  timestamp and decoded event, for recovery times; :func:`read_topic` reads a topic whole, for the counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from aiokafka import TopicPartition
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from fulmen.infra.kafka.clients import close_quietly, consumer, start_or_raise
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas import TopicKey, decode, topic, topic_name

__all__ = ["LOAD_SERVICE", "FeedbackLoad", "LlmLoad", "SpanLoad", "TopicTail", "first_after", "read_topic"]

log = logging.getLogger(__name__)

LOAD_SERVICE = "chaos-load"
"""``service.name`` of the bench's own spans (so the counts never mix them with the agent's or gateway's)."""


def first_after(times: list[float], moment: float) -> float | None:
    """The first time in ``times`` at or after ``moment``, or None."""
    return min((t for t in times if t >= moment), default=None)


def _kv(key: str, value: str | int) -> KeyValue:
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=value))


@dataclass
class SpanLoad:
    """OTLP span batches at ``batches_per_s``; ``sent`` maps each acknowledged span id (hex) to its phase."""

    url: str
    batch: int = 50
    batches_per_s: float = 4.0
    phase: str = "warmup"
    sent: dict[str, str] = field(default_factory=dict)
    acks: list[float] = field(default_factory=list)  # wall time of every 200
    retries: int = 0
    statuses: dict[str, int] = field(default_factory=dict)  # non-200 outcomes seen, by status or error name
    failures: list[float] = field(default_factory=list)  # wall time of every non-200 outcome
    _count: int = 0

    def _encode(self) -> tuple[list[str], bytes]:
        self._count += 1
        now = time.time_ns()
        trace_id = os.urandom(16)
        spans, ids = [], []
        for index in range(self.batch):
            span_id = os.urandom(8)
            ids.append(span_id.hex())
            spans.append(
                Span(
                    trace_id=trace_id,
                    span_id=span_id,
                    name=f"chaos load {index % 5}",
                    kind=Span.SPAN_KIND_INTERNAL,
                    start_time_unix_nano=now,
                    end_time_unix_nano=now + 1_000_000,
                    attributes=[_kv("chaos.phase", self.phase), _kv("chaos.batch", self._count), _kv("chaos.i", index)],
                )
            )
        request = ExportTraceServiceRequest(
            resource_spans=[
                ResourceSpans(
                    resource=Resource(attributes=[_kv("service.name", LOAD_SERVICE)]),
                    scope_spans=[ScopeSpans(spans=spans)],
                )
            ]
        )
        return ids, request.SerializeToString()

    async def run(self, stop: asyncio.Event) -> None:
        interval = 1.0 / self.batches_per_s
        headers = {"Content-Type": "application/x-protobuf"}
        async with httpx.AsyncClient(timeout=20.0) as client:
            while not stop.is_set():
                began = time.monotonic()
                phase = self.phase
                ids, body = self._encode()
                while True:  # until acknowledged, even after stop: an unacknowledged batch is never abandoned
                    wait = await self._post(client, body, headers)
                    if wait is None:
                        self.acks.append(time.time())
                        self.sent.update(dict.fromkeys(ids, phase))
                        break
                    self.retries += 1
                    await asyncio.sleep(wait)
                await asyncio.sleep(max(0.0, interval - (time.monotonic() - began)))

    async def _post(self, client: httpx.AsyncClient, body: bytes, headers: dict[str, str]) -> float | None:
        """None on a 200, else how long to wait before the retry."""
        try:
            answer = await client.post(self.url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            self._count_status(type(exc).__name__)
            return 0.5
        if answer.status_code == 200:
            return None
        self._count_status(str(answer.status_code))
        with contextlib.suppress(ValueError):
            return min(float(answer.headers.get("Retry-After", "0.5")), 2.0)
        return 0.5

    def outage(self, start: float, end: float | None = None) -> dict[str, float | int | None]:
        """What the client saw from ``start`` (a kill) to ``end`` (a restart; None: now): the POSTs that failed,
        seconds from the first of them to the next 200 (``unavailable_s``; 0 without failures), from ``start`` to
        the first 200 (``first_ack_s``; None if none came before ``end``) and the longest wait between two 200s
        from a second before ``start`` (``longest_ack_gap_s``: slow acknowledgements count too)."""
        end = time.time() if end is None else end
        failures = [t for t in self.failures if start <= t < end]
        recovered = first_after(self.acks, failures[-1]) if failures else None
        first = first_after(self.acks, start)
        acks = [t for t in self.acks if start - 1.0 <= t < end]
        return {
            "failed_posts": len(failures),
            "unavailable_s": round(recovered - failures[0], 2) if failures and recovered else 0.0,
            "first_ack_s": None if first is None or first >= end else round(first - start, 2),
            "longest_ack_gap_s": round(max((b - a for a, b in itertools.pairwise(acks)), default=0.0), 2),
        }

    def _count_status(self, key: str) -> None:
        self.statuses[key] = self.statuses.get(key, 0) + 1
        self.failures.append(time.time())


async def post_until(
    client: httpx.AsyncClient, url: str, body: dict, status: int, stop: asyncio.Event, statuses: dict[str, int]
) -> tuple[httpx.Response | None, int]:
    """POST ``body`` as JSON until it is answered ``status``, half a second between tries: the answer (None when
    ``stop`` was set first) and how many tries failed, each counted in ``statuses`` by status or error name."""
    failed = 0
    while not stop.is_set():
        try:
            answer = await client.post(url, json=body)
        except httpx.HTTPError as exc:
            key = type(exc).__name__
        else:
            if answer.status_code == status:
                return answer, failed
            key = str(answer.status_code)
        failed += 1
        statuses[key] = statuses.get(key, 0) + 1
        await asyncio.sleep(0.5)
    return None, failed


@dataclass
class LlmLoad:
    """Direct chat completions, one at a time at ``calls_per_s``; ``sent`` maps response id -> phase."""

    url: str
    calls_per_s: float = 2.0
    phase: str = "warmup"
    sent: dict[str, str] = field(default_factory=dict)
    acks: list[float] = field(default_factory=list)
    retries: int = 0
    statuses: dict[str, int] = field(default_factory=dict)

    async def run(self, stop: asyncio.Event) -> None:
        interval = 1.0 / self.calls_per_s
        async with httpx.AsyncClient(timeout=30.0) as client:
            while not stop.is_set():
                began = time.monotonic()
                await self.call(client, stop)
                await asyncio.sleep(max(0.0, interval - (time.monotonic() - began)))

    async def call(self, client: httpx.AsyncClient, stop: asyncio.Event) -> str | None:
        """One call, posted again until a 200: its response id (None: ``stop`` was set first)."""
        phase = self.phase
        body = {"model": "fulmen", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        answer, failed = await post_until(client, self.url, body, 200, stop, self.statuses)
        self.retries += failed
        if answer is None:
            return None
        self.acks.append(time.time())
        self.sent[answer.json()["id"]] = phase
        return answer.json()["id"]


@dataclass
class FeedbackLoad:
    """Feedback at ``per_s``, one at a time, each for the target ``pick(n)`` names (``(field, id)``: a response id
    answered 200, a rollout id seen on the rollouts topic; None: nothing to score yet). A feedback is posted again
    until a 202 (the gateway gives each request a new id: one answered 503 whose record reached Kafka anyway is
    stored but never *sent*). ``sent`` maps each 202's feedback id to its phase."""

    url: str
    pick: Callable[[int], tuple[str, str] | None]
    per_s: float = 2.0
    phase: str = "warmup"
    sent: dict[str, str] = field(default_factory=dict)
    retries: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    _picks: itertools.count = field(default_factory=itertools.count)

    async def run(self, stop: asyncio.Event) -> None:
        interval = 1.0 / self.per_s
        async with httpx.AsyncClient(timeout=30.0) as client:
            while not stop.is_set():
                began = time.monotonic()
                count = next(self._picks)
                await self.send(client, self.pick(count), float(count % 3), stop)
                await asyncio.sleep(max(0.0, interval - (time.monotonic() - began)))

    async def stream(self, targets: list[tuple[str, str]], stop: asyncio.Event) -> None:
        """Feedback for each of ``targets`` in turn, each sent as soon as the one before is answered 202."""
        async with httpx.AsyncClient(timeout=30.0) as client:
            for target in targets:
                await self.send(client, target, 1.0, stop)

    async def send(
        self, client: httpx.AsyncClient, target: tuple[str, str] | None, value: float, stop: asyncio.Event
    ) -> None:
        """One feedback for ``target`` (None: nothing to score yet), posted again until a 202."""
        phase = self.phase
        if target is None:
            return
        body = {target[0]: target[1], "value": value, "comment": phase}
        answer, failed = await post_until(client, self.url, body, 202, stop, self.statuses)
        self.retries += failed
        if answer is not None:
            self.sent[answer.json()["feedback_id"]] = phase


class TopicTail:
    """Follows the topics of ``keys`` from their beginning; ``events[key]`` = [(broker timestamp s, event)]."""

    def __init__(self, settings: FulmenSettings, models: dict[TopicKey, type]) -> None:
        self.settings = settings
        self.models = models
        self.events: dict[TopicKey, list[tuple[float, object]]] = {key: [] for key in models}

    async def run(self, stop: asyncio.Event) -> None:
        reader = consumer(self.settings, None)
        await start_or_raise(reader, self.settings, "chaos tail")
        names = {topic_name(key, self.settings.kafka.topic_prefix): key for key in self.models}
        partitions = [TopicPartition(name, p) for name, key in names.items() for p in range(topic(key).partitions)]
        try:
            reader.assign(partitions)
            await reader.seek_to_beginning(*partitions)
            while not stop.is_set():
                try:
                    batches = await reader.getmany(timeout_ms=300)
                except Exception as exc:  # the broker is down: keep trying, like any client
                    log.debug("tail: %s", exc)
                    await asyncio.sleep(0.5)
                    continue
                for tp, records in batches.items():
                    key = names[tp.topic]
                    for record in records:
                        with contextlib.suppress(Exception):
                            self.events[key].append((record.timestamp / 1000, decode(self.models[key], record.value)))
        finally:
            await close_quietly([reader])


async def read_topic(settings: FulmenSettings, key: TopicKey, model: type) -> list[tuple[float, object]]:
    """Every record of the topic up to its current end: (broker timestamp s, decoded event); undecodable skipped."""
    reader = consumer(settings, None)
    await start_or_raise(reader, settings, "chaos count")
    name = topic_name(key, settings.kafka.topic_prefix)
    partitions = [TopicPartition(name, p) for p in range(topic(key).partitions)]
    events: list[tuple[float, object]] = []
    try:
        reader.assign(partitions)
        await reader.seek_to_beginning(*partitions)
        ends = await reader.end_offsets(partitions)
        while [tp for tp, end in ends.items() if await reader.position(tp) < end]:
            for records in (await reader.getmany(timeout_ms=500)).values():
                for record in records:
                    with contextlib.suppress(Exception):
                        events.append((record.timestamp / 1000, decode(model, record.value)))
    finally:
        await close_quietly([reader])
    return events
