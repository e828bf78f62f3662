"""Machine-readable contracts: a JSON Schema per event and an AsyncAPI 3.0 document of the topics."""

from __future__ import annotations

from typing import Any

from fulmen.schemas.events import DeadLetterHeaders
from fulmen.schemas.topics import TOPICS, Topic, topic_name

__all__ = ["asyncapi_document", "json_schemas"]

_OTLP_PROTO = "https://github.com/open-telemetry/opentelemetry-proto/blob/main/opentelemetry/proto/collector/trace/v1/trace_service.proto"


def json_schemas() -> dict[str, dict[str, Any]]:
    """JSON Schema (draft 2020-12) of every event model, by model name."""
    models: list[type[Any]] = [t.value for t in TOPICS.values() if t.value is not None]
    models.append(DeadLetterHeaders)
    return {model.__name__: model.model_json_schema(mode="serialization") for model in models}


def asyncapi_document(prefix: str = "", version: str = "0.1.0") -> dict[str, Any]:
    """An AsyncAPI 3.0 document: one channel per topic, its message, and who sends and receives it."""
    schemas = json_schemas()
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    for t in TOPICS.values():
        message_name = f"{t.key.value}Message"
        messages[message_name] = _message(t, schemas)
        channels[t.key.value] = {
            "address": topic_name(t.key, prefix),
            "description": t.description,
            "messages": {message_name: {"$ref": f"#/components/messages/{message_name}"}},
            "bindings": {"kafka": {"partitions": t.partitions, "topicConfiguration": _topic_config(t)}},
        }
        for action, parties in (("send", t.producers), ("receive", t.consumers)):
            operations[f"{action}_{t.key.value}"] = {
                "action": action,
                "channel": {"$ref": f"#/channels/{t.key.value}"},
                "summary": f"{'Sent' if action == 'send' else 'Received'} by: {', '.join(parties)}",
            }
    component_schemas = {}
    for name, schema in schemas.items():
        for def_name, definition in schema.pop("$defs", {}).items():
            component_schemas[def_name] = definition
        component_schemas[name] = schema
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "Fulmen",
            "version": version,
            "description": "The Kafka topics through which Fulmen's components talk.",
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": _rewrite_refs(component_schemas)},
    }


def _message(t: Topic, schemas: dict[str, Any]) -> dict[str, Any]:
    key_doc = {"type": "string", "description": f"the record key: {t.record_key}"}
    if t.value is not None:
        return {
            "name": t.value.__name__,
            "contentType": "application/json",
            "payload": {"$ref": f"#/components/schemas/{t.value.__name__}"},
            "bindings": {"kafka": {"key": key_doc}},
        }
    if t.value_format == "otlp_proto":
        return {
            "name": "ExportTraceServiceRequest",
            "contentType": "application/x-protobuf",
            "payload": {
                "schemaFormat": "application/vnd.google.protobuf;version=3",
                "schema": {"$ref": _OTLP_PROTO},
            },
            "bindings": {"kafka": {"key": key_doc}},
        }
    return {
        "name": "DeadLetter",
        "contentType": "application/octet-stream",
        "description": "The original record's key and value; headers fulmen.dlq.* carry DeadLetterHeaders.",
        "headers": {"$ref": "#/components/schemas/DeadLetterHeaders"},
        "bindings": {"kafka": {"key": key_doc}},
    }


def _topic_config(t: Topic) -> dict[str, Any]:
    config: dict[str, Any] = {}
    if "cleanup.policy" in t.config:
        config["cleanup.policy"] = [t.config["cleanup.policy"]]
    if "retention.ms" in t.config:
        config["retention.ms"] = int(t.config["retention.ms"])
    if "max.message.bytes" in t.config:
        config["max.message.bytes"] = int(t.config["max.message.bytes"])
    return config


def _rewrite_refs(node: Any) -> Any:
    """pydantic writes ``#/$defs/X``; in AsyncAPI the definitions live under ``#/components/schemas/X``."""
    if isinstance(node, dict):
        return {
            k: (v.replace("#/$defs/", "#/components/schemas/") if k == "$ref" else _rewrite_refs(v))
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_rewrite_refs(v) for v in node]
    return node
