"""Machine-readable contracts: a JSON Schema per event, and each topic's AsyncAPI channel and message.

These are the parts of the AsyncAPI document that the contracts alone decide: what a topic carries, how it is
keyed, its partitions and settings. Who sends and receives on each topic is the components' declaration; the
document is put together from those in :mod:`fulmen.asyncapi` (above the layers, since it reads them all).
"""

from __future__ import annotations

from typing import Any

from fulmen.schemas.events import DeadLetterHeaders
from fulmen.schemas.topics import TOPICS, Topic, TopicKey, topic, topic_name

__all__ = ["asyncapi_channel", "asyncapi_components", "json_schemas", "message_name"]

_OTLP_PROTO = "https://github.com/open-telemetry/opentelemetry-proto/blob/main/opentelemetry/proto/collector/trace/v1/trace_service.proto"


def json_schemas() -> dict[str, dict[str, Any]]:
    """JSON Schema (draft 2020-12) of every event model, by model name."""
    models: list[type[Any]] = [t.value for t in TOPICS.values() if t.value is not None]
    models.append(DeadLetterHeaders)
    return {model.__name__: model.model_json_schema(mode="serialization") for model in models}


def message_name(key: TopicKey) -> str:
    """The name of topic ``key``'s message under ``components.messages``."""
    return f"{TopicKey(key).value}Message"


def asyncapi_channel(key: TopicKey, prefix: str = "") -> dict[str, Any]:
    """The AsyncAPI 3.0 channel of topic ``key``: its address, description, message and Kafka bindings."""
    t = topic(key)
    name = message_name(t.key)
    return {
        "address": topic_name(t.key, prefix),
        "description": t.description,
        "messages": {name: {"$ref": f"#/components/messages/{name}"}},
        "bindings": {
            "kafka": {
                "topic": topic_name(t.key, prefix),
                "partitions": t.partitions,
                "topicConfiguration": _topic_config(t),
                "bindingVersion": "0.4.0",
            }
        },
    }


def asyncapi_components() -> dict[str, Any]:
    """``components``: one message per topic, and every event's schema (pydantic's ``$defs`` hoisted)."""
    schemas = json_schemas()
    messages = {message_name(t.key): _message(t) for t in TOPICS.values()}
    component_schemas: dict[str, Any] = {}
    for name, schema in schemas.items():
        for def_name, definition in schema.pop("$defs", {}).items():
            component_schemas[def_name] = definition
        component_schemas[name] = schema
    return {"messages": messages, "schemas": _rewrite_refs(component_schemas)}


def _message(t: Topic) -> dict[str, Any]:
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
