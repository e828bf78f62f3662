"""The producers' Prometheus metrics: both gateways' requests, the LLM gateway's calls, the runner's rollouts.

Served by :mod:`fulmen.infra.metrics` (``/metrics`` on each gateway's own port; the runner's on
``FULMEN_METRICS_PORT``). Labels stay few and bounded: ``gateway`` (``llm``, ``otlp``), ``route`` (the route's
tail from ``/v1/`` on, whatever rollout, agent or bundle prefix it was reached under), ``status`` (the HTTP
code), ``kind``, ``outcome``; never an id.
"""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import Counter, Gauge, Histogram

from fulmen.infra.metrics import LATENCY_BUCKETS

__all__ = [
    "FEEDBACK",
    "GATEWAY_IN_FLIGHT",
    "GATEWAY_REQUESTS",
    "GATEWAY_REQUEST_SECONDS",
    "LLM_ADDED_SECONDS",
    "LLM_BUNDLE_CALLS",
    "LLM_MODEL_VERSION",
    "LLM_TOKENS",
    "LLM_UPSTREAM_SECONDS",
    "OTLP_SPANS",
    "ROLLOUTS_FINISHED",
    "ROLLOUTS_IN_FLIGHT",
    "ROLLOUTS_RETRIED",
    "ROLLOUTS_STARTED",
    "request_metrics_middleware",
    "route_label",
]

GATEWAY_REQUESTS = Counter(
    "fulmen_gateway_requests_total", "HTTP requests answered, by route and status", ["gateway", "route", "status"]
)
GATEWAY_REQUEST_SECONDS = Histogram(
    "fulmen_gateway_request_duration_seconds",
    "time from a request's arrival to its answer",
    ["gateway", "route"],
    buckets=LATENCY_BUCKETS,
)
GATEWAY_IN_FLIGHT = Gauge("fulmen_gateway_requests_in_flight", "requests being answered", ["gateway"])

LLM_UPSTREAM_SECONDS = Histogram(
    "fulmen_llm_upstream_duration_seconds",
    "time the inference backend took to answer a call",
    ["backend"],
    buckets=LATENCY_BUCKETS,
)
LLM_ADDED_SECONDS = Histogram(
    "fulmen_llm_added_duration_seconds",
    "what the gateway added to a call: its handling minus the backend's time (parsing, the span, Kafka's ack)",
    ["backend"],
    buckets=LATENCY_BUCKETS,
)
LLM_TOKENS = Counter("fulmen_llm_tokens_total", "tokens of the calls answered", ["kind"])  # kind: prompt, completion
LLM_MODEL_VERSION = Gauge("fulmen_llm_model_version", "the model version the gateway serves", ["model"])
LLM_BUNDLE_CALLS = Counter(
    "fulmen_llm_prompt_bundle_calls_total", "calls answered, by the prompt bundle applied (none: no bundle)", ["bundle"]
)
FEEDBACK = Counter("fulmen_llm_feedback_total", "late feedback posted, accepted (202) or refused", ["outcome"])

OTLP_SPANS = Counter(
    "fulmen_otlp_spans_total", "spans received: accepted (acknowledged by Kafka) or rejected (invalid)", ["outcome"]
)

ROLLOUTS_STARTED = Counter("fulmen_runner_rollouts_started_total", "rollout attempts started")
ROLLOUTS_FINISHED = Counter(
    "fulmen_runner_rollouts_finished_total",
    "rollout attempts ended, by status (succeeded, failed, timeout)",
    ["status"],
)
ROLLOUTS_RETRIED = Counter("fulmen_runner_rollouts_retried_total", "failed attempts scheduled again")
ROLLOUTS_IN_FLIGHT = Gauge("fulmen_runner_rollouts_in_flight", "rollout attempts running now")

_UNMATCHED = "unmatched"
_NOT_COUNTED = frozenset({"/metrics", "/healthz", "/readyz"})


def route_label(request: web.Request) -> str | None:
    """The route a request took, from ``/v1/`` on (``/v1/chat/completions`` under any rollout prefix); None for the
    probes and ``/metrics`` (not counted); ``unmatched`` for a path no route has."""
    info = request.match_info
    route = getattr(info, "route", None)
    resource = getattr(route, "resource", None) if route is not None else None
    if resource is None:
        return _UNMATCHED
    canonical = resource.canonical
    if canonical in _NOT_COUNTED:
        return None
    at = canonical.find("/v1/")
    return canonical[at:] if at >= 0 else canonical


def request_metrics_middleware(gateway: str):
    """An aiohttp middleware (outermost, so a 401 or 413 counts too) that counts each request by route and status,
    times it and keeps the number in flight."""
    in_flight = GATEWAY_IN_FLIGHT.labels(gateway)

    @web.middleware
    async def measure(request: web.Request, handler):
        route = route_label(request)
        if route is None:
            return await handler(request)
        in_flight.inc()
        started = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            in_flight.dec()
            GATEWAY_REQUESTS.labels(gateway, route, str(status)).inc()
            GATEWAY_REQUEST_SECONDS.labels(gateway, route).observe(time.perf_counter() - started)

    return measure
