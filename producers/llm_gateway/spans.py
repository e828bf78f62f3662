"""The span the gateway records for each LLM call, as an OTLP record for the spans topic.

One SERVER span per choice (``n`` choices share the prompt, and each is one action to train on), named
``chat {model}`` or ``text_completion {model}``, with the gen_ai semantic conventions and Fulmen's training
attributes (exact prompt and response token ids, response logprobs, the serving model version, the rollout).
When the request carried a W3C ``traceparent``, the spans join that trace under the caller's span.
The record has the same format and key (the trace id in hex) as the OTLP gateway's, so the spans consumer
stores both alike.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from fulmen.producers.llm_gateway.backends.base import CallResult, Choice
from fulmen.producers.llm_gateway.otlp_wire import (
    SPAN_KIND_SERVER,
    STATUS_CODE_OK,
    export_request,
    resource_bytes,
    scope_bytes,
    span_bytes,
)
from fulmen.schemas import semconv

__all__ = ["CallContext", "TraceParent", "build_record", "parse_traceparent"]

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
SERVICE_NAME = "fulmen-llm-gateway"
_RESOURCE = resource_bytes({semconv.SERVICE_NAME: SERVICE_NAME})  # the same for every record: written once
_SCOPE = scope_bytes("fulmen.llm_gateway")


@dataclass(frozen=True)
class TraceParent:
    trace_id: bytes
    parent_span_id: bytes


def parse_traceparent(header: str | None) -> TraceParent | None:
    """The caller's trace context, or None when the header is absent or invalid (then a new trace starts)."""
    match = _TRACEPARENT.match((header or "").strip().lower())
    if match is None or match.group(1) == "ff":
        return None
    trace_id, span_id = bytes.fromhex(match.group(2)), bytes.fromhex(match.group(3))
    if not any(trace_id) or not any(span_id):
        return None
    return TraceParent(trace_id, span_id)


@dataclass(frozen=True)
class CallContext:
    """What the gateway knows about a call besides the backend's result."""

    operation: str  # semconv.OPERATION_CHAT or OPERATION_TEXT_COMPLETION
    request: dict[str, Any]  # the request body
    provider: str
    started_ns: int
    ended_ns: int
    parent: TraceParent | None = None
    rollout_id: str | None = None
    attempt: int | None = None
    agent: str | None = None  # the agent the call named in its path
    prompt_bundle: str | None = None  # the prompt bundle applied to the messages (named by the rollout or promoted)
    prompt_slots: tuple[str, ...] = ()  # the bundle's slots that replaced a message


def build_record(call: CallContext, result: CallResult) -> tuple[bytes, bytes]:
    """``(key, value)`` of the Kafka record holding the call's spans: an ``ExportTraceServiceRequest``, written
    straight in protobuf's wire format (:mod:`~fulmen.producers.llm_gateway.otlp_wire`: a call's token ids are one
    ``AnyValue`` message each, which protobuf's message objects made the largest part of the gateway's CPU)."""
    trace_id = call.parent.trace_id if call.parent else secrets.token_bytes(16)
    spans = [_span(call, result, choice, trace_id) for choice in result.choices]
    return trace_id.hex().encode(), export_request(_RESOURCE, _SCOPE, spans)


def _span(call: CallContext, result: CallResult, choice: Choice, trace_id: bytes) -> bytes:
    return span_bytes(
        trace_id=trace_id,
        span_id=secrets.token_bytes(8),
        parent_span_id=call.parent.parent_span_id if call.parent else b"",
        name=f"{call.operation} {call.request.get('model', '')}",
        kind=SPAN_KIND_SERVER,
        start_ns=call.started_ns,
        end_ns=call.ended_ns,
        attributes=_attributes(call, result, choice),
        status_code=STATUS_CODE_OK,
    )


def _attributes(call: CallContext, result: CallResult, choice: Choice) -> dict[str, Any]:
    body = call.request
    attributes: dict[str, Any] = {
        semconv.GEN_AI_OPERATION_NAME: call.operation,
        semconv.GEN_AI_PROVIDER_NAME: call.provider,
        semconv.GEN_AI_REQUEST_MODEL: str(body.get("model", "")),
        semconv.GEN_AI_RESPONSE_ID: result.id,
        semconv.GEN_AI_RESPONSE_MODEL: result.model,
        semconv.GEN_AI_RESPONSE_FINISH_REASONS: [choice.finish_reason],
        semconv.GEN_AI_USAGE_INPUT_TOKENS: result.prompt_tokens,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: len(choice.token_ids) if choice.token_ids is not None else 0,
    }
    for key, field in (
        (semconv.GEN_AI_REQUEST_TEMPERATURE, "temperature"),
        (semconv.GEN_AI_REQUEST_TOP_P, "top_p"),
        (semconv.GEN_AI_REQUEST_MAX_TOKENS, "max_tokens"),
        (semconv.GEN_AI_REQUEST_SEED, "seed"),
    ):
        if isinstance(body.get(field), (int, float)) and not isinstance(body.get(field), bool):
            attributes[key] = body[field]
    if body.get("n", 1) != 1:
        attributes[semconv.GEN_AI_REQUEST_CHOICE_COUNT] = body["n"]
    stop = body.get("stop")
    if stop:
        attributes[semconv.GEN_AI_REQUEST_STOP_SEQUENCES] = [stop] if isinstance(stop, str) else list(stop)
    attributes.update(_messages(call, result, choice))
    if choice.token_ids is not None and result.prompt_token_ids is not None:
        attributes[semconv.PROMPT_TOKEN_IDS] = result.prompt_token_ids
        attributes[semconv.RESPONSE_TOKEN_IDS] = choice.token_ids
        if choice.logprobs is not None:
            attributes[semconv.RESPONSE_LOGPROBS] = choice.logprobs
    else:
        attributes[semconv.TOKEN_IDS_ABSENT_REASON] = result.token_ids_absent or "the backend returned no token ids"
    if result.model_version is not None:
        attributes[semconv.MODEL_VERSION] = result.model_version
    if result.replica is not None:
        attributes[semconv.LLM_REPLICA] = result.replica
    if call.agent is not None:  # which agent called, and whose adapter served it (``base``: the model's own weights)
        attributes[semconv.LLM_AGENT] = call.agent
        attributes[semconv.LLM_ADAPTER] = result.adapter or semconv.ADAPTER_NONE
    if call.prompt_bundle is not None:
        attributes[semconv.PROMPT_BUNDLE] = call.prompt_bundle
        attributes[semconv.PROMPT_SLOTS] = list(call.prompt_slots)
    if call.rollout_id is not None:
        attributes[semconv.ROLLOUT_ID] = call.rollout_id
        attributes[semconv.ROLLOUT_ATTEMPT] = call.attempt or 1
    return attributes


def _messages(call: CallContext, result: CallResult, choice: Choice) -> dict[str, str]:
    """Input and output messages as the gen_ai conventions' JSON (role + parts)."""
    body = call.request
    if call.operation == semconv.OPERATION_CHAT:
        inputs = body.get("messages", [])
    else:
        inputs = [
            {"role": "user", "content": result.prompt_text if result.prompt_text is not None else body.get("prompt")}
        ]
    output: dict[str, Any] = {"role": "assistant", "content": choice.text, "finish_reason": choice.finish_reason}
    if choice.tool_calls:
        output["tool_calls"] = choice.tool_calls
    attributes = {
        semconv.GEN_AI_INPUT_MESSAGES: json.dumps(inputs, ensure_ascii=False, default=str),
        semconv.GEN_AI_OUTPUT_MESSAGES: json.dumps([output], ensure_ascii=False),
    }
    if body.get("tools"):
        attributes[semconv.GEN_AI_TOOL_DEFINITIONS] = json.dumps(body["tools"], ensure_ascii=False, default=str)
    return attributes
