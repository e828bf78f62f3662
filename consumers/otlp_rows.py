"""Flatten OTLP ``ExportTraceServiceRequest``s into columns of the spans table (``otel_traces``).

The layout follows the OpenTelemetry Collector's ClickHouse exporter: one row per span, resource and span
attributes as ``Map(String, String)`` (scalars as text, arrays and maps as JSON), events and links as parallel
arrays, kinds and status codes as the Collector spells them ("Server", "Error"). On top of that, typed columns
for what training reads: rollout id and attempt, agent name, model version, reward, and the exact token ids
and logprobs. The token arrays live only in their typed columns (not also as JSON in ``SpanAttributes``):
they are most of a span's bytes.

This is the hot path of span ingestion; it builds column lists directly, without a dict per row.
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Iterable
from typing import Any

import pyarrow as pa
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from fulmen.schemas import semconv

__all__ = ["SPAN_SCHEMA", "SpanColumns", "any_value", "any_value_text"]

_KINDS = ("Unspecified", "Internal", "Server", "Client", "Producer", "Consumer")
_STATUS = ("Unset", "Ok", "Error")
_TS = pa.timestamp("ns", tz="UTC")
_ATTRS = pa.map_(pa.string(), pa.string())
_TYPED_ARRAYS = frozenset(semconv.TOKEN_ARRAY_KEYS)
_ROLLOUT_KEYS = frozenset((semconv.ROLLOUT_ID, semconv.ROLLOUT_ATTEMPT, semconv.MODEL_VERSION))
_AGENT_KEYS = semconv.AGENT_NAME_KEYS
_REWARD_KEYS = semconv.REWARD_KEYS

SPAN_SCHEMA = pa.schema(
    [
        ("Timestamp", _TS),
        ("TraceId", pa.string()),
        ("SpanId", pa.string()),
        ("ParentSpanId", pa.string()),
        ("TraceState", pa.string()),
        ("SpanName", pa.string()),
        ("SpanKind", pa.string()),
        ("ServiceName", pa.string()),
        ("ResourceAttributes", _ATTRS),
        ("ScopeName", pa.string()),
        ("ScopeVersion", pa.string()),
        ("SpanAttributes", _ATTRS),
        ("Duration", pa.uint64()),
        ("StatusCode", pa.string()),
        ("StatusMessage", pa.string()),
        ("Events.Timestamp", pa.list_(_TS)),
        ("Events.Name", pa.list_(pa.string())),
        ("Events.Attributes", pa.list_(_ATTRS)),
        ("Links.TraceId", pa.list_(pa.string())),
        ("Links.SpanId", pa.list_(pa.string())),
        ("Links.TraceState", pa.list_(pa.string())),
        ("Links.Attributes", pa.list_(_ATTRS)),
        ("RolloutId", pa.string()),
        ("Attempt", pa.uint32()),
        ("AgentName", pa.string()),
        ("ModelVersion", pa.uint64()),
        ("PromptTokenIds", pa.list_(pa.uint32())),
        ("ResponseTokenIds", pa.list_(pa.uint32())),
        ("ResponseLogprobs", pa.list_(pa.float32())),
        ("Reward", pa.float64()),
    ]
)


def any_value(value: AnyValue) -> Any:
    """An OTLP value as plain Python (lists and dicts for arrays and key-value lists)."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value).decode()
    return getattr(value, kind)


def any_value_text(value: AnyValue) -> str:
    """An OTLP value as the text stored in an attribute map (the Collector's ``AsString``)."""
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind == "int_value":
        return str(value.int_value)
    if kind == "double_value":
        return repr(value.double_value)
    if kind == "bool_value":
        return "true" if value.bool_value else "false"
    if kind is None:
        return ""
    return json.dumps(any_value(value), separators=(",", ":"))


def _attrs(pairs: Iterable[KeyValue]) -> list[tuple[str, str]]:
    return [(kv.key, any_value_text(kv.value)) for kv in pairs]


class SpanColumns:
    """Accumulates spans as columns; :meth:`to_table` makes the Arrow batch for one insert.

    The attribute maps are kept as flat key and value lists with offsets (how Arrow stores a map), which is
    several times faster to turn into Arrow than a list of pairs per row.
    """

    def __init__(self) -> None:
        self.columns: dict[str, list[Any]] = {field.name: [] for field in SPAN_SCHEMA}
        self.rows = 0
        # Flat map storage: offsets into keys/values, one offset per row plus the leading 0.
        self._span_keys: list[str] = []
        self._span_values: list[str] = []
        self._span_offsets: list[int] = [0]
        self._res_keys: list[str] = []
        self._res_values: list[str] = []
        self._res_offsets: list[int] = [0]

    def add_request(self, request: ExportTraceServiceRequest) -> int:
        """Add every span of ``request``; return how many."""
        before = self.rows
        for resource_spans in request.resource_spans:
            resource_attrs = _attrs(resource_spans.resource.attributes)
            resource = dict(resource_attrs)
            service = resource.get(semconv.SERVICE_NAME, "")
            res_keys = [k for k, _ in resource_attrs]
            res_values = [v for _, v in resource_attrs]
            for scope_spans in resource_spans.scope_spans:
                scope = scope_spans.scope
                spans = scope_spans.spans
                for span in spans:
                    self._add_span(span, resource, service, scope.name, scope.version)
                n = len(spans)
                self._res_keys.extend(res_keys * n)
                self._res_values.extend(res_values * n)
                offsets, width = self._res_offsets, len(res_keys)
                last = offsets[-1]
                offsets.extend(range(last + width, last + width * n + 1, width) if width else [last] * n)
        return self.rows - before

    def _add_span(self, span: Any, resource: dict[str, str], service: str, scope_name: str, scope_version: str) -> None:
        c = self.columns
        keys, values = self._span_keys, self._span_values
        typed: dict[str, Any] = {}
        arrays: dict[str, list[Any]] = {}
        for kv in span.attributes:
            key = kv.key
            value = kv.value
            kind = value.WhichOneof("value")
            if kind == "string_value":
                text = value.string_value
            elif kind == "int_value":
                text = str(value.int_value)
            elif kind == "double_value":
                text = repr(value.double_value)
            elif kind == "bool_value":
                text = "true" if value.bool_value else "false"
            else:
                if key in _TYPED_ARRAYS:
                    numbers = _numbers(value, integers=key != semconv.RESPONSE_LOGPROBS)
                    if numbers is not None:
                        arrays[key] = numbers
                        continue
                    keys.append(semconv.TOKEN_ARRAY_INVALID)
                    values.append(f"{key} is not an array of token ids or logprobs")
                text = any_value_text(value)
            keys.append(key)
            values.append(text)
            typed[key] = text
        self._span_offsets.append(len(keys))
        start, end = span.start_time_unix_nano, span.end_time_unix_nano
        c["Timestamp"].append(start)
        c["TraceId"].append(span.trace_id.hex())
        c["SpanId"].append(span.span_id.hex())
        c["ParentSpanId"].append(span.parent_span_id.hex())
        c["TraceState"].append(span.trace_state)
        c["SpanName"].append(span.name)
        kind_number = span.kind
        c["SpanKind"].append(_KINDS[kind_number] if 0 <= kind_number < len(_KINDS) else str(kind_number))
        c["ServiceName"].append(service)
        c["ScopeName"].append(scope_name)
        c["ScopeVersion"].append(scope_version)
        c["Duration"].append(end - start if end > start else 0)
        status = span.status
        code = status.code
        c["StatusCode"].append(_STATUS[code] if 0 <= code < len(_STATUS) else str(code))
        c["StatusMessage"].append(status.message)
        self._add_events_and_links(span)
        self._add_typed(typed, arrays, resource)
        self.rows += 1

    def _add_events_and_links(self, span: Any) -> None:
        c = self.columns
        events, links = span.events, span.links
        if events:
            c["Events.Timestamp"].append([e.time_unix_nano for e in events])
            c["Events.Name"].append([e.name for e in events])
            c["Events.Attributes"].append([_attrs(e.attributes) for e in events])
        else:
            c["Events.Timestamp"].append(_EMPTY)
            c["Events.Name"].append(_EMPTY)
            c["Events.Attributes"].append(_EMPTY)
        if links:
            c["Links.TraceId"].append([link.trace_id.hex() for link in links])
            c["Links.SpanId"].append([link.span_id.hex() for link in links])
            c["Links.TraceState"].append([link.trace_state for link in links])
            c["Links.Attributes"].append([_attrs(link.attributes) for link in links])
        else:
            c["Links.TraceId"].append(_EMPTY)
            c["Links.SpanId"].append(_EMPTY)
            c["Links.TraceState"].append(_EMPTY)
            c["Links.Attributes"].append(_EMPTY)

    def _add_typed(self, typed: dict[str, Any], arrays: dict[str, list[Any]], resource: dict[str, str]) -> None:
        c = self.columns
        get = typed.get
        c["RolloutId"].append(get(semconv.ROLLOUT_ID) or resource.get(semconv.ROLLOUT_ID, ""))
        attempt = get(semconv.ROLLOUT_ATTEMPT) or resource.get(semconv.ROLLOUT_ATTEMPT)
        c["Attempt"].append(_int(attempt, 0, 2**32 - 1))
        agent = ""
        for key in _AGENT_KEYS:
            agent = get(key) or ""
            if agent:
                break
        c["AgentName"].append(agent)
        c["ModelVersion"].append(_int(get(semconv.MODEL_VERSION), None, 2**63 - 1))
        c["PromptTokenIds"].append(arrays.get(semconv.PROMPT_TOKEN_IDS, _EMPTY))
        c["ResponseTokenIds"].append(arrays.get(semconv.RESPONSE_TOKEN_IDS, _EMPTY))
        c["ResponseLogprobs"].append(arrays.get(semconv.RESPONSE_LOGPROBS, _EMPTY))
        reward = None
        for key in _REWARD_KEYS:
            if key in typed:
                reward = _float(typed[key])
                break
        c["Reward"].append(reward)

    def to_table(self) -> pa.Table:
        arrays = []
        for field in SPAN_SCHEMA:
            if field.name == "SpanAttributes":
                arrays.append(_map(self._span_offsets, self._span_keys, self._span_values))
            elif field.name == "ResourceAttributes":
                arrays.append(_map(self._res_offsets, self._res_keys, self._res_values))
            elif field.name == "Timestamp":  # ints to timestamps: build int64, then cast (10x faster)
                arrays.append(pa.array(self.columns[field.name], type=pa.int64()).cast(_TS))
            elif field.name == "Events.Timestamp":
                arrays.append(pa.array(self.columns[field.name], type=pa.list_(pa.int64())).cast(pa.list_(_TS)))
            else:
                arrays.append(pa.array(self.columns[field.name], type=field.type))
        return pa.Table.from_arrays(arrays, schema=SPAN_SCHEMA)


_EMPTY: list[Any] = []


def _map(offsets: list[int], keys: list[str], values: list[str]) -> pa.MapArray:
    return pa.MapArray.from_arrays(
        pa.array(offsets, type=pa.int32()), pa.array(keys, type=pa.string()), pa.array(values, type=pa.string())
    )


_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_ASCII_SPACE = " \t\n\r\x0b\x0c"


def _number(text: str | None) -> float | None:
    """A finite decimal number written in ASCII (as the native flattener reads one too), else None.

    Stricter than ``float()``, which also takes "nan", "1_000" or Arabic-Indic digits.
    """
    if text is None:
        return None
    text = text.strip(_ASCII_SPACE)
    if not _NUMBER.fullmatch(text):
        return None
    number = float(text)
    return number if math.isfinite(number) else None


def _int(text: str | None, default: int | None, maximum: int) -> int | None:
    """The whole part of a number in [0, maximum], else ``default``."""
    number = _number(text)
    if number is None or number < 0 or int(number) > maximum:
        return default
    return int(number)


def _float(text: str | None) -> float | None:
    return _number(text)


def _numbers(value: AnyValue, *, integers: bool) -> list[Any] | None:
    """The numbers of an array attribute, or None when it is not a clean array (kept as text then)."""
    if value.WhichOneof("value") != "array_value":
        return None
    items = value.array_value.values
    if integers:
        ids = [v.int_value for v in items]
        if any(not 0 <= i < 2**32 for i in ids) or any(v.WhichOneof("value") != "int_value" for v in items):
            return None
        return ids
    out = []
    for v in items:
        kind = v.WhichOneof("value")
        if kind == "double_value":
            out.append(v.double_value)
        elif kind == "int_value":
            out.append(float(v.int_value))
        else:
            return None
    return out
