"""OTLP/HTTP trace payloads: decode (protobuf or JSON), validate spans, split into Kafka records by trace.

Pure functions, no I/O. The JSON encoding is OTLP's (https://opentelemetry.io/docs/specs/otlp/#json-protobuf-encoding):
proto3 JSON with lowerCamelCase names, but trace and span ids in hex rather than base64, which is why ids are
rewritten before the standard JSON parser sees them.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field

from google.protobuf import json_format
from google.protobuf.message import DecodeError as ProtobufDecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from fulmen.producers.otlp_gateway.evaluations import EVALUATION_EVENT, evaluation_feedback
from fulmen.schemas.codec import encode
from fulmen.schemas.errors import PoisonInputError

try:  # the split on the wire bytes (native/otlp_rows/src/wire.rs); without cargo at install, the reference below
    from fulmen.infra._otlp_rows import split_traces as _split_on_wire
except ImportError:
    _split_on_wire = None

__all__ = [
    "OtlpRecord",
    "Prepared",
    "Validated",
    "decode_json",
    "decode_protobuf",
    "encode_response",
    "prepare",
    "split_by_trace",
    "validate",
]

_ID_FIELDS = ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id")
_ZERO_TRACE, _ZERO_SPAN = bytes(16), bytes(8)


def decode_protobuf(body: bytes) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except (ProtobufDecodeError, RecursionError) as exc:
        raise PoisonInputError(f"body is not an OTLP ExportTraceServiceRequest in protobuf: {_text(exc)}") from None
    return request


def decode_json(body: bytes) -> ExportTraceServiceRequest:
    """Decode OTLP JSON; :class:`PoisonInputError` with an encodable reason for anything that is not (nesting
    too deep, lone surrogates in keys or values, wrong types)."""
    try:
        document = json.loads(body)
    except RecursionError:
        raise PoisonInputError("body is JSON nested too deep") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise PoisonInputError(f"body is not JSON: {_text(exc)}") from None
    if not isinstance(document, dict):
        raise PoisonInputError("body must be a JSON object (an ExportTraceServiceRequest)")
    if re.search(rb"\\u[dD][89a-fA-F]", body):  # a surrogate escape: lone ones cannot reach protobuf
        try:
            json.dumps(document, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise PoisonInputError("body has a string or key with a lone surrogate (\\ud800-\\udfff)") from None
    for path, span in _spans_and_links(document):
        for name in _ID_FIELDS:
            value = span.get(name)
            if isinstance(value, str) and value:
                try:
                    span[name] = base64.b64encode(bytes.fromhex(value)).decode()
                except ValueError:
                    raise PoisonInputError(f"{path}.{name}: {value!r} is not hex") from None
    try:
        return json_format.ParseDict(document, ExportTraceServiceRequest(), ignore_unknown_fields=True)
    except RecursionError:
        raise PoisonInputError("body is JSON nested too deep for an OTLP ExportTraceServiceRequest") from None
    # UnicodeError is a ValueError; OverflowError: a number past float range (1e400) in an integer or enum field
    except (json_format.ParseError, binascii.Error, TypeError, ValueError, OverflowError) as exc:
        raise PoisonInputError(f"body is not an OTLP ExportTraceServiceRequest in JSON: {_text(exc)}") from None


def _text(error: BaseException, limit: int = 500) -> str:
    """An error's text, sendable: lone surrogates escaped, cut to ``limit`` characters."""
    text = str(error).encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _spans_and_links(document: dict) -> list[tuple[str, dict]]:
    found: list[tuple[str, dict]] = []
    for r, resource_spans in enumerate(_list(document, "resourceSpans", "resource_spans")):
        for s, scope_spans in enumerate(_list(resource_spans, "scopeSpans", "scope_spans")):
            for i, span in enumerate(_list(scope_spans, "spans")):
                if not isinstance(span, dict):
                    continue
                path = f"resourceSpans[{r}].scopeSpans[{s}].spans[{i}]"
                found.append((path, span))
                found.extend((f"{path}.links[{j}]", link) for j, link in enumerate(_list(span, "links")))
    return found


def _list(node: object, *names: str) -> list:
    if not isinstance(node, dict):
        return []
    for name in names:
        value = node.get(name)
        if isinstance(value, list):
            return [v for v in value if isinstance(v, dict)]
    return []


@dataclass
class Validated:
    request: ExportTraceServiceRequest
    accepted: int = 0
    rejected: int = 0
    reasons: list[str] = field(default_factory=list)

    def error_message(self) -> str:
        return "; ".join(sorted(set(self.reasons)))


def validate(request: ExportTraceServiceRequest, max_span_bytes: int) -> Validated:
    """Drop spans that cannot be stored (bad ids, too large for one record); count them for partial_success."""
    result = Validated(request)
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            keep = []
            for span in scope_spans.spans:
                reason = _span_problem(span, max_span_bytes)
                if reason:
                    result.rejected += 1
                    result.reasons.append(reason)
                else:
                    keep.append(span)
            if len(keep) != len(scope_spans.spans):
                kept = [type(s)() for s in keep]
                for new, old in zip(kept, keep, strict=True):
                    new.CopyFrom(old)
                del scope_spans.spans[:]
                scope_spans.spans.extend(kept)
            result.accepted += len(keep)
    return result


def _span_problem(span: object, max_span_bytes: int) -> str | None:
    trace_id, span_id = span.trace_id, span.span_id  # type: ignore[attr-defined]
    if len(trace_id) != 16 or trace_id == _ZERO_TRACE:
        return "trace_id must be 16 bytes and not all zero"
    if len(span_id) != 8 or span_id == _ZERO_SPAN:
        return "span_id must be 8 bytes and not all zero"
    if span.ByteSize() > max_span_bytes:  # type: ignore[attr-defined]
        return f"span larger than the {max_span_bytes}-byte record limit"
    return None


@dataclass(frozen=True)
class OtlpRecord:
    key: bytes  # the trace id in hex
    value: bytes  # an ExportTraceServiceRequest with spans of that one trace
    spans: int


def split_by_trace(request: ExportTraceServiceRequest, max_record_bytes: int) -> list[OtlpRecord]:
    """One record per trace (keyed by trace id, as the Collector's Kafka exporter partitions traces), each
    an ``ExportTraceServiceRequest`` under ``max_record_bytes``; a trace too big for one record is cut by spans.
    """
    traces: dict[bytes, list[tuple[object, object, list]]] = defaultdict(list)
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            by_trace: dict[bytes, list] = defaultdict(list)
            for span in scope_spans.spans:
                by_trace[span.trace_id].append(span)
            for trace_id, spans in by_trace.items():
                traces[trace_id].append((resource_spans, scope_spans, spans))
    if len(traces) == 1 and request.ByteSize() <= max_record_bytes:  # already one trace: send as it came
        trace_id = next(iter(traces))
        spans = sum(len(group[2]) for group in traces[trace_id])
        return [OtlpRecord(trace_id.hex().encode(), request.SerializeToString(), spans)]
    records = []
    for trace_id, groups in traces.items():
        records.extend(_records_for_trace(trace_id.hex().encode(), groups, max_record_bytes))
    return records


def _records_for_trace(key: bytes, groups: list[tuple], max_record_bytes: int) -> list[OtlpRecord]:
    record = _build(groups)
    size = record.ByteSize()
    spans = sum(len(g[2]) for g in groups)
    if size <= max_record_bytes or spans == 1:
        return [OtlpRecord(key, record.SerializeToString(), spans)]
    # Too big: halve by spans until each part fits (validate() guarantees a single span fits).
    flat = [(resource, scope, [span]) for resource, scope, group in groups for span in group]
    middle = len(flat) // 2
    return _records_for_trace(key, flat[:middle], max_record_bytes) + _records_for_trace(
        key, flat[middle:], max_record_bytes
    )


def _build(groups: list[tuple]) -> ExportTraceServiceRequest:
    out = ExportTraceServiceRequest()
    for resource_spans, scope_spans, spans in groups:
        new_resource = out.resource_spans.add()
        new_resource.resource.CopyFrom(resource_spans.resource)
        new_resource.schema_url = resource_spans.schema_url
        new_scope = new_resource.scope_spans.add()
        new_scope.scope.CopyFrom(scope_spans.scope)
        new_scope.schema_url = scope_spans.schema_url
        new_scope.spans.extend(spans)
    return out


@dataclass
class Prepared:
    """A body decoded, validated and split into records, in plain values that cross a process boundary cheaply
    (two lists of bytes rather than 10,000 record objects: bytes are not tracked by the garbage collector)."""

    accepted: int
    rejected: int
    error_message: str
    keys: list[bytes] = field(default_factory=list)  # record i's key: its trace id in hex
    values: list[bytes] = field(default_factory=list)  # record i's value: an ExportTraceServiceRequest
    feedback_keys: list[bytes] = field(default_factory=list)  # feedback i's key: the response id it rates
    feedback_values: list[bytes] = field(default_factory=list)  # feedback i: a Feedback event's JSON


def prepare(body: bytes, as_json: bool, max_span_bytes: int, max_record_bytes: int, split: bool = True) -> Prepared:
    """Decode (:class:`PoisonInputError` when undecodable), validate, and unless ``split`` is false cut the
    accepted spans into records as :func:`split_by_trace` does, and take the feedback their evaluation events give
    (:func:`~fulmen.producers.otlp_gateway.evaluations.evaluation_feedback`; looked for only when the body names
    such an event). Pure CPU work: run it off the event loop.

    A protobuf body is parsed by protobuf's parser as always (its verdict on the bytes stands), then split on
    its wire bytes by the native module, which copies spans as they came rather than re-encoding them (the same
    records; 1.6 us a span instead of 8.0 on 512-span batches). A body with evaluation events, or anything the
    native walk leaves to this module (see ``native/otlp_rows/src/wire.rs``), takes :func:`validate` and
    :func:`split_by_trace`."""
    request = decode_json(body) if as_json else decode_protobuf(body)
    if _split_on_wire is not None and split and not as_json and EVALUATION_EVENT.encode() not in body:
        on_wire = _split_on_wire(body, max_span_bytes, max_record_bytes)
        if on_wire is not None:
            accepted, rejected, reasons, keys, values = on_wire
            return Prepared(accepted, rejected, "; ".join(sorted(reasons)), keys, values)
    checked = validate(request, max_span_bytes)
    prepared = Prepared(checked.accepted, checked.rejected, checked.error_message())
    if split and checked.accepted:
        records = split_by_trace(checked.request, max_record_bytes)
        prepared.keys = [record.key for record in records]
        prepared.values = [record.value for record in records]
        if EVALUATION_EVENT.encode() in body:
            for feedback in evaluation_feedback(checked.request):
                prepared.feedback_keys.append(feedback.target_id.encode())
                prepared.feedback_values.append(encode(feedback))
    return prepared


def encode_response(rejected: int, message: str, *, as_json: bool) -> bytes:
    response = ExportTraceServiceResponse()
    if rejected:
        response.partial_success.rejected_spans = rejected
        response.partial_success.error_message = message
    if as_json:
        return json_format.MessageToJson(response, indent=None).encode()
    return response.SerializeToString()
