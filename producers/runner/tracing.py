"""Tracing inside the runner: every span an agent makes carries its rollout's id and attempt.

The runner installs the global tracer provider, so spans from any instrumentation (the openai client's, a
framework's, the agent's own) pass through :class:`RolloutStamper`, which reads the rollout of the current
asyncio task (a context variable, copied into the worker thread of a sync agent) and stamps it on the span.
Spans are exported (straight into the spans topic, :mod:`~fulmen.producers.runner.kafka_spans`, or by OTLP/HTTP to
the OTLP gateway) and flushed before a rollout's end is reported. An export the runner's exporter could not
complete is noted by rollout (:class:`ExportFailures`, the runner's): such a rollout ends failed (and is retried
when it has attempts left) rather than be trained on with spans missing.

An agent that sets up OpenTelemetry itself, as its framework's docs say (its own ``TracerProvider`` with an
OTLP exporter, installed globally when its module is imported, before the runner builds its provider), keeps
its provider: the runner adds its stamper to it. If that provider already exports to the runner's OTLP endpoint
the runner adds no exporter of its own (two would send every span twice) and uses the agent's provider for its
own ``fulmen.rollout`` span and its flushes; if it exports elsewhere (or nowhere), the runner's exporter is
added beside it, so Fulmen gets one copy.

An agent that sets its provider up later (inside its first call, say) cannot install it: the global provider
is set once and the runner's is already there. Such an agent traces on its own provider object
(``provider.get_tracer(...)``, or pydantic-ai's ``Agent.instrument_all`` with an explicit provider), and those
spans go out through its own exporter. So once the runner exports to an endpoint it watches every SDK
``TracerProvider`` of the process (:func:`watch_agent_providers` wraps ``TracerProvider.add_span_processor``):
a provider that is given an OTLP exporter to that same endpoint is joined, i.e. gets the runner's stamper
(once) and is flushed with the runner's provider before a rollout's end is reported (:func:`flush_all`). Its
spans reach the spans topic once, through the agent's exporter, with the rollout stamped on them.

Not covered: a provider that exports elsewhere (or through a processor that is not the SDK's batch or simple
processor, or by another protocol) is left alone, so its spans reach Fulmen not at all (the runner's own spans
and those of the global provider still do); a provider built before the runner's tracing was set up and never
installed globally is not seen; a ``TracerProvider`` subclass that overrides ``add_span_processor`` is not seen.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from fulmen.schemas import semconv
from fulmen.schemas.events import RolloutRequest

__all__ = [
    "CURRENT_ROLLOUT",
    "CoalescedFlush",
    "ExportFailures",
    "NotingExporter",
    "RolloutStamper",
    "build_tracer_provider",
    "exports_to",
    "flush_all",
    "joined_providers",
    "watch_agent_providers",
]

log = logging.getLogger(__name__)

CURRENT_ROLLOUT: ContextVar[RolloutRequest | None] = ContextVar("fulmen_current_rollout", default=None)


class ExportFailures:
    """The rollout attempts some of whose spans the runner's exporter could not write, and why (thread-safe: the
    SDK exports on its worker thread; the ``capacity`` noted last are kept)."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._failed: OrderedDict[tuple[str, int], str] = OrderedDict()

    def note(self, spans: Sequence[ReadableSpan], reason: str) -> None:
        """``spans`` were not exported: remember the rollout attempts they belong to (the stamped ones)."""
        keys = set()
        for span in spans:
            attributes = span.attributes or {}
            rollout = attributes.get(semconv.ROLLOUT_ID)
            if rollout:
                keys.add((str(rollout), int(attributes.get(semconv.ROLLOUT_ATTEMPT, 1))))  # type: ignore[arg-type]
        with self._lock:
            for key in keys:
                self._failed[key] = reason
                self._failed.move_to_end(key)
            while len(self._failed) > self.capacity:
                self._failed.popitem(last=False)

    def take(self, rollout_id: str, attempt: int) -> str | None:
        """Why spans of this attempt were not exported (forgotten then), or None if all were."""
        with self._lock:
            return self._failed.pop((rollout_id, attempt), None)


class NotingExporter(SpanExporter):
    """An exporter that notes in ``failures`` the rollouts of every export ``inner`` fails (the OTLP exporter of
    ``span_export = otlp``; the Kafka one notes its own). ``_endpoint`` is the inner one's, so the provider is
    still seen to export there (:func:`exports_to`)."""

    def __init__(self, inner: SpanExporter, failures: ExportFailures) -> None:
        self.inner = inner
        self.failures = failures
        self._endpoint = getattr(inner, "_endpoint", None)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # an exporter that raises loses the spans just the same
            self.failures.note(spans, f"{type(exc).__name__}: {exc}")
            raise
        if result is not SpanExportResult.SUCCESS:
            self.failures.note(spans, f"the OTLP export to {self._endpoint} failed")
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.inner.force_flush(timeout_millis)


class RolloutStamper(SpanProcessor):
    """Sets rollout id, attempt, group and task on every span started while a rollout runs."""

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        request = CURRENT_ROLLOUT.get()
        if request is None:
            return
        span.set_attributes(
            {
                semconv.ROLLOUT_ID: request.rollout_id,
                semconv.ROLLOUT_ATTEMPT: request.attempt,
                semconv.ROLLOUT_GROUP_ID: request.group_id,
                semconv.TASK_ID: request.task_id,
            }
        )

    def on_end(self, span: ReadableSpan) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def build_tracer_provider(
    otlp_endpoint: str | None,
    *,
    install: bool = True,
    exporter: Callable[[], SpanExporter] | None = None,
    failures: ExportFailures | None = None,
) -> TracerProvider:
    """The provider the runner traces with: it stamps rollouts and exports to ``otlp_endpoint`` (None: nowhere),
    or through the exporter ``exporter()`` makes when given (the runner's
    :class:`~fulmen.producers.runner.kafka_spans.KafkaSpanExporter`; called only when the runner's provider exports
    at all, not when the agent's own provider already exports to ``otlp_endpoint``; the agents' own providers are
    still joined by ``otlp_endpoint``). The OTLP exporter notes its failures in ``failures``, when given.

    With ``install``, it becomes the global provider; when the process already has one (the agent's own), that
    one is kept and joined as the module docstring says, and may be the provider returned.
    """
    if otlp_endpoint:
        watch_agent_providers(otlp_endpoint)
    current = trace.get_tracer_provider() if install else None
    if isinstance(current, TracerProvider) and otlp_endpoint and exports_to(current, otlp_endpoint):
        log.info(
            "the agent installed its own tracer provider exporting to %s: the runner stamps its spans and adds no "
            "second exporter",
            otlp_endpoint,
        )
        if not _stamped(current):
            current.add_span_processor(RolloutStamper())
        return current
    provider = TracerProvider(resource=Resource.create({semconv.SERVICE_NAME: "fulmen-agent"}))
    provider.add_span_processor(RolloutStamper())
    if otlp_endpoint and exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter()))
    elif otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        otlp = OTLPSpanExporter(endpoint=otlp_endpoint, timeout=30)
        provider.add_span_processor(BatchSpanProcessor(NotingExporter(otlp, failures) if failures else otlp))
    if install:
        _install(provider)
    return provider


def _install(provider: Any) -> None:
    # The global provider can be set once per process; the runner owns its process.
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        for processor in provider._active_span_processor._span_processors:
            current.add_span_processor(processor)
        return
    trace.set_tracer_provider(provider)


def exports_to(provider: TracerProvider, endpoint: str) -> bool:
    """Whether one of ``provider``'s span processors exports (OTLP) to ``endpoint``."""
    wanted = _endpoint_key(endpoint)
    return any(_exported_endpoint(processor) == wanted for processor in _processors(provider))


def _processors(provider: TracerProvider) -> tuple[SpanProcessor, ...]:
    return tuple(getattr(provider._active_span_processor, "_span_processors", ()))


def _stamped(provider: TracerProvider) -> bool:
    return any(isinstance(processor, RolloutStamper) for processor in _processors(provider))


def _exported_endpoint(processor: SpanProcessor) -> tuple[str, str, int | None, str] | None:
    """Where an SDK batch or simple span processor exports to by OTLP, as an :func:`_endpoint_key`; else None."""
    exporter = getattr(processor, "span_exporter", None) or getattr(
        getattr(processor, "_batch_processor", None), "_exporter", None
    )
    target = getattr(exporter, "_endpoint", None)
    return _endpoint_key(target) if isinstance(target, str) else None


def _endpoint_key(url: str) -> tuple[str, str, int | None, str]:
    parts = urlsplit(url.strip())
    host = (parts.hostname or "").lower()
    host = "127.0.0.1" if host in ("localhost", "::1") else host
    try:
        port = parts.port
    except ValueError:
        port = None
    return parts.scheme.lower(), host, port, parts.path.rstrip("/")


class _AgentProviders:
    """The endpoints the runner exports to, and the agents' providers joined because they export there too."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.endpoints: set[tuple[str, str, int | None, str]] = set()
        self.joined: weakref.WeakSet[TracerProvider] = weakref.WeakSet()
        self.original_add: Any = None  # TracerProvider.add_span_processor before it was wrapped


_AGENT_PROVIDERS = _AgentProviders()


def watch_agent_providers(otlp_endpoint: str) -> None:
    """From now on, join every SDK ``TracerProvider`` given an OTLP exporter to ``otlp_endpoint`` (see the
    module docstring): it gets the runner's stamper once and is flushed by :func:`flush_all`. Idempotent; the
    wrap of ``TracerProvider.add_span_processor`` is process-wide, as the global provider is."""
    watched = _AGENT_PROVIDERS
    with watched.lock:
        watched.endpoints.add(_endpoint_key(otlp_endpoint))
        if watched.original_add is None:
            watched.original_add = TracerProvider.add_span_processor
            TracerProvider.add_span_processor = _add_span_processor  # type: ignore[method-assign]


def _add_span_processor(self: TracerProvider, span_processor: SpanProcessor) -> None:
    watched = _AGENT_PROVIDERS
    watched.original_add(self, span_processor)
    if isinstance(span_processor, RolloutStamper) or _exported_endpoint(span_processor) not in watched.endpoints:
        return
    with watched.lock:
        if _stamped(self):  # the runner's own provider, or one joined already
            return
        watched.original_add(self, RolloutStamper())
        watched.joined.add(self)
    log.info(
        "a tracer provider of the agent exports to the runner's OTLP endpoint: the runner stamps rollouts on its "
        "spans and flushes it before each rollout's end is reported"
    )


def joined_providers() -> list[TracerProvider]:
    """The agents' providers joined so far (see :func:`watch_agent_providers`)."""
    with _AGENT_PROVIDERS.lock:
        return list(_AGENT_PROVIDERS.joined)


def flush_all(provider: Any, timeout_millis: int = 30_000) -> bool:
    """Flush ``provider`` and every joined agent provider; False if one of them did not finish in time."""
    flushed = bool(provider.force_flush(timeout_millis))
    for joined in joined_providers():
        if joined is not provider:
            flushed = bool(joined.force_flush(timeout_millis)) and flushed
    return flushed


class CoalescedFlush:
    """Flushes the provider (and the joined agent providers) for many finishing rollouts at once.

    A rollout's spans must be exported before its end is reported. Each flush is a round trip to the OTLP
    endpoint, so rollouts that finish while a flush is running wait for the next one, which covers all of
    them: one flush per wave of finishing rollouts instead of one per rollout.
    """

    def __init__(self, provider: Any) -> None:
        self.provider = provider
        self._waiting: list[asyncio.Future[None]] = []
        self._running: asyncio.Task[None] | None = None

    async def flush(self) -> None:
        """Return once every span ended before this call has been exported (or the flush gave up)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(self._drain())
        await future

    async def _drain(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, []
            try:
                await asyncio.to_thread(flush_all, self.provider)
            finally:
                for future in batch:
                    if not future.done():
                        future.set_result(None)
