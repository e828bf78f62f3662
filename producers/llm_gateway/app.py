"""``fulmen llm-gateway``: an OpenAI-compatible server that records every call as a span with its token ids.

Routes (each also under ``/rollout/{rollout_id}/attempt/{attempt}``, which ties the call to a rollout with no
header or SDK, optionally followed by ``/seed/{seed}``, the rollout's sampling seed, from which each call that
names no seed of its own gets one (:mod:`~fulmen.producers.llm_gateway.call_seeds`), then by
``/bundle/{bundle_id}``, the prompt bundle applied to the rollout's calls
(:mod:`~fulmen.producers.llm_gateway.prompts_follower`; calls naming none get the promoted bundle, if any; the
response's ``X-Fulmen-Prompt-Bundle`` header names the bundle applied), and
under any of these with ``/agent/{name}`` after it, which names the agent that calls, for agents that
give each of their agents its own ``base_url``): ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``; plus ``POST /v1/feedback`` (late feedback, below), ``/healthz`` and ``/readyz``. A call that
names an agent is served by that agent's LoRA adapter when one is loaded (``FULMEN_TRAIN_ADAPTERS=per_agent``
publishes one per trained agent), else by the model; its span says which (``fulmen.llm.agent``,
``fulmen.llm.adapter``: the agent's name, or ``base``).

A call is answered only after its span is acknowledged by Kafka (``acks=all``), so every LLM span of a
rollout is in Kafka by the time the agent has its answer. When the span cannot be recorded the call fails
with 503 and ``Retry-After``: the gateway never serves an answer it did not record. Errors use OpenAI's
shape (``{"error": {"message", "type", "param", "code"}}``).

``POST /v1/feedback`` takes a reward for an earlier call (its ``response_id``, the ``id`` this gateway answered with),
a ``rollout_id`` or a ``trace_id``, any time after it: ``{"response_id": "...", "name": "reward", "value": 1.0,
"comment": "..."}`` (:mod:`fulmen.producers.feedback`). It publishes a ``Feedback`` event to the feedback topic and
answers 202 ``{"feedback_id": ...}`` once Kafka acknowledged it; a bad request is a 400 naming the field, Kafka not
taking it a 503 with ``Retry-After``. Whether the target exists is checked later, in the store, by the feedback
consumer (an unknown one is dead-lettered, never dropped).

Edges (``fulmen.infra.http``): with ``FULMEN_LLM_BEARER_TOKEN`` set every route but ``/healthz`` and ``/readyz`` needs
``Authorization: Bearer <token>`` (401 otherwise); a body over ``FULMEN_LLM_MAX_BODY_BYTES`` is refused (413)
from its ``Content-Length`` before it is read; headers and then the body must arrive within
``FULMEN_LLM_READ_TIMEOUT_S`` (the connection is closed, or 408). For a large call (a body over ``INLINE_BYTES``
or more than ``INLINE_TOKENS`` tokens) JSON decoding, validation, span encoding and response encoding run on
threads, so it never stalls the event loop; a small one stays on the loop (a thread hop costs more than the work).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from fulmen.infra.http import read_body
from fulmen.infra.kafka.clients import producer
from fulmen.infra.seeds import SEED_LIMIT
from fulmen.producers.feedback import FeedbackRequestError, feedback_from
from fulmen.producers.gateway import Gateway, GatewayStats
from fulmen.producers.llm_gateway.backends import Backend, build_backend
from fulmen.producers.llm_gateway.backends.base import CallResult
from fulmen.producers.llm_gateway.call_seeds import CallSeeds
from fulmen.producers.llm_gateway.model_cache import local_version
from fulmen.producers.llm_gateway.models_follower import ModelsFollower, PromotionsFollower
from fulmen.producers.llm_gateway.prompts_follower import PromptRegistry, UnknownBundleError, prompt_followers
from fulmen.producers.llm_gateway.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    load_body,
    parse_chat,
    parse_completion,
)
from fulmen.producers.llm_gateway.responses import (
    chat_chunks,
    chat_response,
    completion_chunks,
    completion_response,
    sse,
)
from fulmen.producers.llm_gateway.settings import LlmGatewaySettings, LlmSection
from fulmen.producers.llm_gateway.spans import CallContext, build_record, parse_traceparent
from fulmen.producers.metrics import (
    FEEDBACK,
    LLM_ADDED_SECONDS,
    LLM_BUNDLE_CALLS,
    LLM_MODEL_VERSION,
    LLM_TOKENS,
    LLM_UPSTREAM_SECONDS,
)
from fulmen.schemas import ModelVersion, TopicKey, semconv, topic_name
from fulmen.schemas.codec import encode
from fulmen.schemas.errors import BrokerUnavailableError
from fulmen.schemas.events import IDENTIFIER_PATTERN
from fulmen.schemas.prompts import apply as apply_bundle

INLINE_BYTES = 64 * 1024  # requests up to this size are parsed, recorded and answered on the event loop
INLINE_TOKENS = 8192  # ... and calls up to this many prompt + completion tokens
FEEDBACK_MAX_BYTES = 64 * 1024  # a feedback body is a few ids, a number and a comment of at most 4096 characters
_ATTEMPT = re.compile(r"[0-9]{1,9}")  # ASCII digits only ("²".isdigit() is true), and bounded
_SEED = re.compile(r"[0-9]{1,19}")
_BUNDLE = re.compile(r"pb-[0-9a-f]{12}")

__all__ = ["LlmGateway", "LlmGatewayStats"]

log = logging.getLogger(__name__)


@dataclass
class LlmGatewayStats(GatewayStats):
    """:class:`GatewayStats` (``requests``: chat and completion calls) plus the gateway's own counts."""

    errors: int = 0  # calls answered with an error
    spans: int = 0  # spans recorded (one per choice)
    feedback: int = 0  # feedback published (acknowledged)


class LlmGateway(Gateway):
    """The server. Build it, then :meth:`run` it (or :meth:`start`/:meth:`stop` it inside another loop).

    Lifecycle (:class:`~fulmen.producers.gateway.Gateway`): start loads the model (or reaches the upstream),
    connects to Kafka, catches up on model versions and follows them, then listens; stop closes the backend
    after the producer.
    """

    name = "LLM gateway"
    metrics_label = "llm"

    def __init__(
        self,
        settings: LlmGatewaySettings,
        backend: Backend | None = None,
        kafka_producer: AIOKafkaProducer | None = None,
    ) -> None:
        # linger 0: a lone call's span goes out at once (the agent waits for it); under load records still batch
        # while a request to the broker is in flight.
        super().__init__(
            settings,
            settings.llm,
            kafka_producer or producer(settings, max_request_size=8 * 1024 * 1024, linger_ms=0),
            topic=topic_name(TopicKey.SPANS, settings.kafka.topic_prefix),
            respond=_error_response,
        )
        self.options: LlmSection = settings.llm  # the base knows only its ListenOptions
        self.backend = backend or build_backend(settings.llm, settings.home)
        self.model_cache = settings.home / "model-cache"  # versions published in an object store, fetched here
        follower = PromotionsFollower if self.options.follow == "promoted" else ModelsFollower
        self.follower = follower(settings, self.options.served_model_name, self._served_version, self._load_version)
        self.feedback_topic = topic_name(TopicKey.FEEDBACK, settings.kafka.topic_prefix)
        self.prompts = PromptRegistry()
        self.prompt_followers = prompt_followers(settings, self.prompts)
        self.stats = LlmGatewayStats()
        self.measured = settings.metrics.enabled  # record each call's metrics (fulmen.producers.metrics)
        self.call_seeds = CallSeeds()
        # JSON decoding and checks, span and response encoding: CPU work kept off the event loop.
        self._cpu = ThreadPoolExecutor(2, thread_name_prefix="llm-gateway-cpu")

    # --- lifecycle hooks (the order is Gateway's) ---------------------------------------------------------------
    def _add_routes(self, app: web.Application) -> None:
        rollouts = ("/rollout/{rollout_id}/attempt/{attempt}", "/rollout/{rollout_id}/attempt/{attempt}/seed/{seed}")
        scoped = [
            f"{rollout}{tail}"
            for rollout in rollouts
            for tail in ("", "/agent/{agent}", "/bundle/{bundle}", "/bundle/{bundle}/agent/{agent}")
        ]
        for prefix in ("", "/agent/{agent}", *scoped):
            app.router.add_post(f"{prefix}/v1/chat/completions", self.handle_chat)
            app.router.add_post(f"{prefix}/v1/completions", self.handle_completion)
            app.router.add_get(f"{prefix}/v1/models", self.handle_models)
        app.router.add_post("/v1/feedback", self.handle_feedback)

    async def _setup(self) -> None:
        await self.backend.start()
        self._version_loaded()

    async def _on_connected(self) -> None:
        await asyncio.gather(*(follower.catch_up() for follower in self.prompt_followers))
        for follower in self.prompt_followers:
            self.spawn(follower.run(self.stopping), f"{follower.key.value}-follower")
        if self.options.follow_models:
            await self.follower.catch_up()
            self.spawn(self.follower.run(self.stopping), "model-follower")

    async def _teardown(self) -> None:
        await self.backend.close()
        self._cpu.shutdown(wait=False, cancel_futures=True)

    def _description(self) -> str:
        backend, model, version = self.backend.name, self.options.served_model_name, self.backend.model_version
        return f"{self.name} (OpenAI API at /v1; {backend} backend, model {model}, version {version})"

    async def _load_version(self, event: ModelVersion) -> None:
        local, fetch_s = await asyncio.to_thread(local_version, event, self.model_cache)
        if fetch_s:
            log.info("fetched model version %d from %s in %.1fs", event.version, event.uri, fetch_s)
        await self.backend.load_version(local)
        self._version_loaded()

    def _version_loaded(self) -> None:
        if self.measured and self.backend.model_version is not None:
            LLM_MODEL_VERSION.labels(self.options.served_model_name).set(self.backend.model_version)

    def _served_version(self, adapter: str) -> int | None:
        """The version served of the model (``adapter`` empty) or of an agent's adapter (the models follower's
        question)."""
        return self.backend.adapter_version(adapter) if adapter else self.backend.model_version

    # --- handlers -------------------------------------------------------------------------------------------
    async def handle_models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.options.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "fulmen",
            "max_model_len": self.backend.context_length,
            "fulmen_model_version": self.backend.model_version,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, semconv.OPERATION_CHAT)

    async def handle_completion(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, semconv.OPERATION_TEXT_COMPLETION)

    async def _handle(self, request: web.Request, operation: str) -> web.StreamResponse:
        self.stats.requests += 1
        arrived = time.perf_counter_ns()
        try:
            rollout_id, attempt = _rollout(request)
            agent = _agent(request)
            named = _bundle(request)
            raw = await read_body(request, max_bytes=self.options.max_body_bytes, timeout_s=self.options.read_timeout_s)
            chat = operation == semconv.OPERATION_CHAT
            body, parsed = await self._off_loop(len(raw) > INLINE_BYTES, _parse, raw, chat, self.options.max_n)
            self._check_model(parsed.model)
            if agent is not None:
                parsed = dataclasses.replace(parsed, agent=agent)
            body, parsed = self._seeded(request, rollout_id, attempt, body, parsed)
            body, parsed, bundle, slots = await self._apply_prompts(named, agent, body, parsed)
            started = time.time_ns()
            call = self.backend.chat if chat else self.backend.complete
            result = await call(parsed, affinity=rollout_id)  # type: ignore[arg-type]
            context = CallContext(
                operation,
                body,
                f"fulmen.{self.backend.name}",
                started,
                time.time_ns(),
                parse_traceparent(request.headers.get("traceparent")),
                rollout_id,
                attempt,
                agent,
                bundle,
                slots,
            )
            big = len(raw) > INLINE_BYTES or result.prompt_tokens + result.completion_tokens > INLINE_TOKENS
            await self._record(context, result, big)
            if self.measured:
                self._measure(arrived, context, result, bundle)
        except ApiError as exc:
            self.stats.errors += 1
            if exc.status >= 500:
                log.warning("LLM call failed with %d: %s", exc.status, exc.message)
            return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
        except web.HTTPException as exc:  # 408/413/400 from reading the body: answered in OpenAI's shape
            self.stats.errors += 1
            response = _error_response(request, exc.status, (exc.text or exc.reason).strip(), {})
            response.force_close()  # the body was not read to its end: the connection cannot be reused
            return response
        served = {semconv.PROMPT_BUNDLE_HEADER: bundle} if bundle else {}  # which bundle the call was served with
        if not parsed.stream:
            response = chat_response(result) if chat else completion_response(result)
            payload = await self._off_loop(big, _json_bytes, response)
            return web.Response(body=payload, content_type="application/json", headers=served)
        chunks = chat_chunks if chat else completion_chunks
        return await self._stream(request, chunks(result, parsed.include_usage), served)

    async def handle_feedback(self, request: web.Request) -> web.Response:
        """``POST /v1/feedback``: publish one Feedback; 202 with its id once Kafka acknowledged (module docstring)."""
        try:
            raw = await read_body(request, max_bytes=FEEDBACK_MAX_BYTES, timeout_s=self.options.read_timeout_s)
            try:
                feedback = feedback_from(load_body(raw), source="api")
            except FeedbackRequestError as exc:
                raise ApiError(400, exc.message, param=exc.param) from None
            labelled = [("content-type", b"application/json")]  # as EventPublisher labels events
            await self._send(
                self.feedback_topic, feedback.target_id.encode(), encode(feedback), "the feedback", headers=labelled
            )
        except ApiError as exc:
            self._count_feedback("refused")
            return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
        except web.HTTPException as exc:  # 408/413/400 from reading the body
            self._count_feedback("refused")
            response = _error_response(request, exc.status, (exc.text or exc.reason).strip(), {})
            response.force_close()
            return response
        self.stats.feedback += 1
        self._count_feedback("accepted")
        log.info(
            "feedback %s for %s %s: %s=%g",
            feedback.feedback_id,
            feedback.target.value,
            feedback.target_id,
            feedback.name,
            feedback.value,
        )
        return web.json_response({"feedback_id": feedback.feedback_id}, status=202)

    def _measure(self, arrived_ns: int, context: CallContext, result: CallResult, bundle: str | None) -> None:
        """A call answered: its tokens, the backend's time and what the gateway added (all of its handling so far,
        the span's acknowledgement included, minus the backend's time), the bundle it was served with."""
        upstream_s = (context.ended_ns - context.started_ns) / 1e9
        handled_s = (time.perf_counter_ns() - arrived_ns) / 1e9
        backend = self.backend.name
        LLM_UPSTREAM_SECONDS.labels(backend).observe(upstream_s)
        LLM_ADDED_SECONDS.labels(backend).observe(max(handled_s - upstream_s, 0.0))
        LLM_TOKENS.labels("prompt").inc(result.prompt_tokens)
        LLM_TOKENS.labels("completion").inc(result.completion_tokens)
        LLM_BUNDLE_CALLS.labels(bundle or "none").inc()

    def _count_feedback(self, outcome: str) -> None:
        if self.measured:
            FEEDBACK.labels(outcome).inc()

    async def _apply_prompts(
        self, named: str | None, agent: str | None, body: dict[str, Any], parsed: Any
    ) -> tuple[dict[str, Any], Any, str | None, tuple[str, ...]]:
        """The call with its prompt bundle applied (the one its rollout names, else the one in force for its agent):
        the body (what the span records) and the parsed request (what is tokenised) both carry the bundle's texts.
        Returns ``(body, parsed, bundle id or None, slots applied)``; 404 for a bundle that is not known in time.
        Only chat messages are rewritten; a completion's prompt is left as sent (its span still names the bundle)."""
        try:
            bundle = await self.prompts.resolve(named, agent)
        except UnknownBundleError as exc:
            raise ApiError(404, exc.message, param="bundle", code="bundle_not_found") from None
        if bundle is None:
            return body, parsed, None, ()
        if not isinstance(parsed, ChatRequest):
            return body, parsed, bundle.bundle_id, ()
        messages, slots = apply_bundle(bundle, parsed.messages)
        if not slots:
            return body, parsed, bundle.bundle_id, ()
        body = {**body, "messages": apply_bundle(bundle, body.get("messages", []))[0]}
        return body, dataclasses.replace(parsed, messages=messages, raw=body), bundle.bundle_id, tuple(slots)

    def _seeded(
        self, request: web.Request, rollout_id: str | None, attempt: int | None, body: dict[str, Any], parsed: Any
    ) -> tuple[dict[str, Any], Any]:
        """The call with its own seed when its rollout is seeded (``/seed/{seed}`` in the path) and the call names
        none (:mod:`~fulmen.producers.llm_gateway.call_seeds`); the body carries it too, so the span records it and
        an upstream backend forwards it."""
        rollout_seed = _seed(request)
        if rollout_seed is None or rollout_id is None or parsed.sampling.seed is not None:
            return body, parsed
        seed = self.call_seeds.next(rollout_id, attempt or 1, rollout_seed)
        body = {**body, "seed": seed}
        return body, dataclasses.replace(parsed, sampling=dataclasses.replace(parsed.sampling, seed=seed), raw=body)

    def _check_model(self, model: str) -> None:
        if model != self.options.served_model_name:
            shown = model if len(model) <= 200 else model[:197] + "..."
            raise ApiError(
                404,
                f"The model `{shown}` does not exist; this gateway serves `{self.options.served_model_name}`.",
                param="model",
                code="model_not_found",
            )

    async def _record(self, context: CallContext, result: CallResult, big: bool) -> None:
        """Publish the call's spans and wait for the acknowledgement (503 when Kafka does not take them)."""
        key, value = await self._off_loop(big, build_record, context, result)
        await self._send(self.topic, key, value, "the call's span")
        self.stats.spans += len(result.choices)

    async def _send(self, topic: str, key: bytes, value: bytes, what: str, **options: Any) -> None:
        """Publish one record (``options``: the producer's, e.g. ``headers``) and wait for the acknowledgement (503
        when Kafka does not take it in time)."""
        try:
            async with asyncio.timeout(self.options.publish_timeout_s):
                await self.producer.send_and_wait(topic, value=value, key=key, **options)
        except (TimeoutError, KafkaError, BrokerUnavailableError) as exc:
            self.stats.unavailable += 1
            reason = "no acknowledgement in time" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            error = ApiError(503, f"{what} could not be recorded in Kafka ({reason}); retry")
            error.headers["Retry-After"] = "1"
            raise error from None
        self.stats.records += 1

    async def _off_loop(self, big: bool, function: Any, *args: Any) -> Any:
        """``function(*args)`` on the CPU threads for a big call, inline for a small one: a hop to a thread costs
        more than parsing or encoding a small call (three hops a call tripled the gateway's CPU per call and
        its added latency), while a big one must not stall the event loop."""
        if not big:
            return function(*args)
        return await asyncio.get_running_loop().run_in_executor(self._cpu, function, *args)

    async def _stream(self, request: web.Request, chunks, headers: dict[str, str]) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
        )
        await response.prepare(request)
        for chunk in chunks:
            await response.write(sse(chunk))
        await response.write(sse("[DONE]"))
        await response.write_eof()
        return response


def _parse(raw: bytes, chat: bool, max_n: int) -> tuple[dict[str, Any], ChatRequest | CompletionRequest]:
    """The body decoded, checked and parsed (runs on a thread: a large body takes a while)."""
    body = load_body(raw)
    return body, parse_chat(body, max_n) if chat else parse_completion(body, max_n)


def _json_bytes(data: Any) -> bytes:
    return json.dumps(data).encode()


def _error_response(request: web.Request, status: int, message: str, headers: dict[str, str]) -> web.Response:
    """An error from the HTTP guards (401, 408, 413...) in OpenAI's shape."""
    error = ApiError(status, message, code={401: "invalid_api_key", 413: "request_too_large"}.get(status))
    return web.json_response(error.body(), status=status, headers=headers)


def _agent(request: web.Request) -> str | None:
    agent = request.match_info.get("agent")
    if agent is not None and not IDENTIFIER_PATTERN.fullmatch(agent):
        raise ApiError(400, f"agent {agent[:200]!r} in the path is not a valid identifier", param="agent")
    return agent


def _bundle(request: web.Request) -> str | None:
    bundle = request.match_info.get("bundle")
    if bundle is not None and not _BUNDLE.fullmatch(bundle):
        raise ApiError(
            400, f"prompt bundle {bundle[:200]!r} in the path is not a bundle id (pb-<12 hex>)", param="bundle"
        )
    return bundle


def _seed(request: web.Request) -> int | None:
    text = request.match_info.get("seed")
    if text is None:
        return None
    if not _SEED.fullmatch(text) or int(text) >= SEED_LIMIT:
        raise ApiError(400, f"seed {text[:40]!r} in the path must be an integer in [0, 2**63)", param="seed")
    return int(text)


def _rollout(request: web.Request) -> tuple[str | None, int | None]:
    rollout_id = request.match_info.get("rollout_id")
    if rollout_id is None:
        return None, None
    attempt_text = request.match_info.get("attempt", "")
    if not IDENTIFIER_PATTERN.fullmatch(rollout_id):
        raise ApiError(400, f"rollout id {rollout_id!r} in the path is not a valid identifier", param="rollout_id")
    if not _ATTEMPT.fullmatch(attempt_text) or int(attempt_text) < 1:
        raise ApiError(400, f"attempt {attempt_text!r} in the path must be a positive integer", param="attempt")
    return rollout_id, int(attempt_text)
