"""Find, in one record of the spans topic, the traces with an LLM call that no rollout owns (a production call).

A production call is a span that carries prompt and response token ids (the LLM gateway records them) and no rollout
id (neither the span nor its resource has ``fulmen.rollout.id``, as the spans consumer reads it): a call to the
gateway's plain ``/v1`` endpoint by an agent that Fulmen does not run.

Cheap on the hot path: a record whose bytes do not hold the prompt token ids key has no call at all and is not
parsed (a rollout's call records hold it, and are parsed to see that each span has its rollout id). A record that is
not valid OTLP protobuf holds nothing here: the spans consumer dead-letters it, once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from google.protobuf.message import DecodeError as ProtobufDecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from fulmen.consumers.otlp_rows import any_value_text
from fulmen.schemas import semconv

__all__ = ["Scan", "scan_record"]

_TOKEN_KEY = semconv.PROMPT_TOKEN_IDS.encode()
_TRACE_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Scan:
    """What a record says about production episodes: the trace of each production call it holds, and the trace its key
    names (both gateways key a record by the trace id of its spans; None when the key is not a trace id)."""

    calls: tuple[str, ...] = ()
    key_trace: str | None = None


def scan_record(key: bytes | None, value: bytes | None) -> Scan:
    """The trace of each production call in one spans-topic record (lowercase hex) and its key's trace."""
    key_trace = _trace_of_key(key)
    if not value or _TOKEN_KEY not in value:
        return Scan(key_trace=key_trace)
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(value)
    except ProtobufDecodeError:
        return Scan(key_trace=key_trace)
    calls = []
    for resource_spans in request.resource_spans:
        owned = _has_rollout(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                if len(span.trace_id) == 16 and any(span.trace_id) and not owned and _is_production_call(span):
                    calls.append(span.trace_id.hex())
    return Scan(tuple(calls), key_trace)


def _is_production_call(span: Span) -> bool:
    """Prompt and response token ids (non-empty arrays), no rollout id."""
    prompt = response = False
    for kv in span.attributes:
        key = kv.key
        if key == semconv.ROLLOUT_ID and any_value_text(kv.value):
            return False
        if key == semconv.PROMPT_TOKEN_IDS:
            prompt = len(kv.value.array_value.values) > 0
        elif key == semconv.RESPONSE_TOKEN_IDS:
            response = len(kv.value.array_value.values) > 0
    return prompt and response


def _has_rollout(attributes: Iterable[KeyValue]) -> bool:
    return any(kv.key == semconv.ROLLOUT_ID and any_value_text(kv.value) for kv in attributes)


def _trace_of_key(key: bytes | None) -> str | None:
    if key is None or len(key) != 32:
        return None
    text = key.decode("ascii", errors="replace").lower()
    return text if set(text) <= _TRACE_HEX and text != "0" * 32 else None
