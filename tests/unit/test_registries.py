"""The registries that everyone reads: topics, span attribute names, migrations, exported contracts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fulmen.asyncapi import NOT_ON_FASTSTREAM, asyncapi_document, declare_components, from_broker, senders
from fulmen.cli.main import app
from fulmen.consumers.event_sinks import EVENT_SINKS
from fulmen.infra.kafka.broker import kafka_broker
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas import semconv
from fulmen.schemas.ddl import MIGRATIONS, TABLES
from fulmen.schemas.export import json_schemas
from fulmen.schemas.topics import TOPICS, TopicKey, topic, topic_name


def test_every_topic_key_is_registered_once() -> None:
    assert set(TOPICS) == set(TopicKey)
    names = [t.name for t in TOPICS.values()]
    assert len(names) == len(set(names))


def test_topic_names_and_settings() -> None:
    assert topic_name(TopicKey.SPANS) == "otlp_spans"  # the OpenTelemetry Collector's Kafka exporter default
    assert topic_name(TopicKey.TASKS, "staging.") == "staging.fulmen.tasks"
    assert topic(TopicKey.MODELS).config["cleanup.policy"] == "compact"
    for t in TOPICS.values():
        assert t.partitions >= 1
        if t.value is not None:
            keyed = t.record_key in t.value.model_fields or isinstance(getattr(t.value, t.record_key, None), property)
            assert keyed, f"{t.name} keyed by a field (or property) its events lack"


def test_unknown_topic_lists_the_valid_ones() -> None:
    with pytest.raises(KeyError, match="valid: tasks, spans"):
        topic("task")


def test_semconv_has_no_duplicate_keys() -> None:
    keys = semconv.all_keys()
    attribute_values = [v for k, v in keys.items() if not k.startswith(("OPERATION_", "SPAN_"))]
    assert len(attribute_values) == len(set(attribute_values))
    ours = [v for v in attribute_values if v.startswith("fulmen.")]
    assert semconv.ROLLOUT_ID in ours and semconv.PROMPT_TOKEN_IDS in ours


def test_migrations_are_ordered_and_unique() -> None:
    versions = [m.version for m in MIGRATIONS]
    assert versions == sorted(versions) and len(versions) == len(set(versions))
    rendered = "\n".join(s for m in MIGRATIONS for s in m.render("somedb"))
    assert "{db}" not in rendered
    for table in TABLES.values():
        assert f"somedb.{table}" in rendered
    assert all("IF NOT EXISTS" in s for m in MIGRATIONS for s in m.statements)


def test_spans_table_keeps_the_collector_columns() -> None:
    ddl = MIGRATIONS[0].statements[0]
    for column in (
        "Timestamp",
        "TraceId",
        "SpanId",
        "ParentSpanId",
        "SpanName",
        "SpanKind",
        "ServiceName",
        "ResourceAttributes",
        "SpanAttributes",
        "Duration",
        "StatusCode",
        "StatusMessage",
        "`Events.Timestamp`",
        "`Links.TraceId`",
    ):
        assert f"\n    {column} " in ddl, column


@pytest.fixture(scope="module")
def prefixed() -> FulmenSettings:
    return FulmenSettings(kafka={"topic_prefix": "p.", "bootstrap": "kafka-1:9092"})


@pytest.fixture(scope="module")
def asyncapi(prefixed: FulmenSettings) -> dict:
    return asyncapi_document(prefixed)


def operations_by_topic(doc: dict) -> dict[str, dict[str, set[str]]]:
    """topic key -> action -> the titles of the operations (``party:action:topic``) on its channel."""
    found: dict[str, dict[str, set[str]]] = {}
    for name, operation in doc["operations"].items():
        key = operation["channel"]["$ref"].removeprefix("#/channels/")
        found.setdefault(key, {}).setdefault(operation["action"], set()).add(name)
    return found


def test_asyncapi_lists_every_topic_with_the_declared_senders_and_receivers(asyncapi: dict) -> None:
    by_topic = operations_by_topic(asyncapi)
    assert set(by_topic) == {k.value for k in TopicKey}
    for key in TopicKey:
        assert by_topic[key.value].keys() == {"send", "receive"}, key
    # each publishing component's Sender is a faststream publisher per topic, hence a send operation
    for sender in senders():
        for key in sender.topics:
            assert f"{sender.name}:send:{key.value}" in by_topic[key.value]["send"]
    # the JSON sinks and the model follower are faststream subscribers: receive operations
    for sink in EVENT_SINKS.values():
        assert f"consumers.{sink.name}:receive:{sink.topic.value}" in by_topic[sink.topic.value]["receive"]
    assert "llm-gateway:receive:models" in by_topic["models"]["receive"]
    for endpoint in NOT_ON_FASTSTREAM:  # the aiokafka loops and outside parties, declared for the document
        assert (
            f"{endpoint.party}:{endpoint.action}:{endpoint.key.value}" in by_topic[endpoint.key.value][endpoint.action]
        )
    expected = sum(len(s.topics) for s in senders()) + len(EVENT_SINKS) + 4 + len(NOT_ON_FASTSTREAM)  # 4 followers
    assert len(asyncapi["operations"]) == expected  # nothing else: the document is the declarations
    assert asyncapi["servers"]["development"]["host"] == "kafka-1:9092"  # the broker's bootstrap


def test_asyncapi_follows_a_new_declaration(prefixed: FulmenSettings) -> None:
    broker = kafka_broker(prefixed)
    declare_components(broker, prefixed)
    broker.subscriber("fulmen.metrics", title="auditor:receive:metrics", description="reads the metrics")
    doc = from_broker(broker, "p.")
    assert doc["operations"]["auditor:receive:metrics"] == {
        "action": "receive",
        "channel": {"$ref": "#/channels/metrics"},
        "description": "reads the metrics",
        "messages": [{"$ref": "#/channels/metrics/messages/metricsMessage"}],
    }


def test_asyncapi_keeps_every_event_schema_and_topic_description(asyncapi: dict) -> None:
    for key, spec in TOPICS.items():
        channel = asyncapi["channels"][key.value]
        assert (channel["address"], channel["description"]) == (topic_name(key, "p."), spec.description)
        assert channel["bindings"]["kafka"]["partitions"] == spec.partitions
    assert set(json_schemas()) <= set(asyncapi["components"]["schemas"])
    assert asyncapi["components"]["messages"]["modelsMessage"]["payload"] == {
        "$ref": "#/components/schemas/ModelVersion"
    }


def test_asyncapi_document_is_complete_and_its_refs_resolve(asyncapi: dict) -> None:
    doc = asyncapi
    assert doc["asyncapi"].startswith("3.")
    assert {c["address"] for c in doc["channels"].values()} == {topic_name(k, "p.") for k in TopicKey}
    refs = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            refs.extend(v for k, v in node.items() if k == "$ref" and isinstance(v, str) and v.startswith("#/"))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    assert refs
    for ref in refs:
        node = doc
        for part in ref[2:].split("/"):
            assert part in node, f"dangling {ref}"
            node = node[part]


def test_schemas_export_writes_files(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["schemas", "export", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    written = {p.name for p in tmp_path.iterdir()}
    assert "asyncapi.json" in written
    assert {f"{name}.schema.json" for name in json_schemas()} <= written
    schema = json.loads((tmp_path / "RolloutRequest.schema.json").read_text())
    assert "task_id" in schema["required"]


def test_cluster_ids_never_look_like_options() -> None:
    from fulmen.infra.kafka.local import base64_uuid

    ids = [base64_uuid() for _ in range(2000)]
    assert all(len(i) == 22 and not i.startswith("-") for i in ids)
    assert len(set(ids)) == len(ids)
