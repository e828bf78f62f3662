"""Topic administration: create Fulmen's topics from the registry, apply their settings, describe them."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from fulmen.infra.kafka.clients import admin_client, call_or_raise, start_or_raise
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas.errors import ConfigurationError, RetryableError
from fulmen.schemas.topics import TOPICS, Topic, min_insync_replicas, topic_name

__all__ = ["TopicState", "cluster_info", "describe_topics", "ensure_topics", "partition_count"]

log = logging.getLogger(__name__)

_TOPIC_ALREADY_EXISTS = 36
_UNKNOWN_TOPIC = 3
_DYNAMIC_TOPIC_CONFIG = 1  # config_source of a value set on the topic itself


@dataclass
class TopicState:
    """What one of Fulmen's topics looks like on the cluster."""

    key: str
    name: str
    exists: bool
    partitions: int = 0
    wanted_partitions: int = 0
    config: dict[str, str] = field(default_factory=dict)
    action: str = ""  # what ensure_topics did: created, updated, unchanged
    replicas: int = 0  # replication factor (the fewest replicas of any partition)
    in_sync: int = 0  # the fewest in-sync replicas of any partition (below ``replicas``: a replica is behind or down)


async def cluster_info(settings: FulmenSettings) -> dict[str, Any]:
    """A real metadata request: cluster id, controller and brokers. Raises BrokerUnavailableError."""
    admin = admin_client(settings)
    await start_or_raise(admin, settings, "metadata request")
    try:
        return await call_or_raise(admin.describe_cluster, settings, "metadata request")
    finally:
        await admin.close()


async def partition_count(settings: FulmenSettings, name: str) -> int:
    """How many partitions topic ``name`` has (0 if it does not exist)."""
    admin = admin_client(settings)
    await start_or_raise(admin, settings, "describe topic")
    try:
        if name not in set(await admin.list_topics()):
            return 0
        described = await admin.describe_topics([name])
        return len(described[0]["partitions"]) if described and described[0]["error_code"] == 0 else 0
    finally:
        await admin.close()


async def ensure_topics(settings: FulmenSettings, topics: list[Topic] | None = None) -> list[TopicState]:
    """Create the registry's topics that are missing and bring the settings of existing ones in line.

    Partitions are only ever added (never removed), and adding them is logged as a warning since it changes
    which partition a key maps to. Settings set on a topic by someone else are kept. A topic with 3 replicas or
    more gets ``min.insync.replicas`` of at least :data:`~fulmen.schemas.topics.MIN_INSYNC_REPLICAS` (a higher
    one set by an operator is kept).
    """
    topics = list(TOPICS.values()) if topics is None else topics
    admin = admin_client(settings)
    await start_or_raise(admin, settings, "topic administration")
    try:
        brokers = len((await admin.describe_cluster())["brokers"])
        replication = settings.kafka.replication_factor or min(3, brokers)
        if replication > brokers:
            raise ConfigurationError(
                f"FULMEN_KAFKA_REPLICATION_FACTOR={replication} but the cluster has {brokers} broker(s)"
            )
        states = await _describe(admin, settings, topics)
        missing = [t for t in topics if not states[t.key].exists]
        if missing:
            await _create(admin, settings, missing, replication)
        for t in topics:
            state = states[t.key]
            state.action = "created" if not state.exists else await _reconcile(admin, t, state)
        refreshed = await _settled(admin, settings, topics)
        for t in topics:
            refreshed[t.key].action = states[t.key].action
        return [refreshed[t.key] for t in topics]
    finally:
        await admin.close()


async def _settled(
    admin: AIOKafkaAdminClient, settings: FulmenSettings, topics: list[Topic], timeout_s: float = 15.0
) -> dict[str, TopicState]:
    """Describe until the metadata shows every topic with its partitions and settings (it lags a creation)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = await _describe(admin, settings, topics)
        pending = [
            t.key.value
            for t in topics
            if not states[t.key].exists
            or states[t.key].partitions < t.partitions
            or any(states[t.key].config.get(k) != v for k, v in t.config.items())
            or _durability_drift(states[t.key])
        ]
        if not pending or time.monotonic() > deadline:
            if pending:
                log.warning("topic metadata not settled after %.0fs: %s", timeout_s, ", ".join(pending))
            return states
        await asyncio.sleep(0.2)


async def describe_topics(settings: FulmenSettings) -> list[TopicState]:
    """The registry's topics as the cluster has them (missing ones included, with ``exists=False``)."""
    admin = admin_client(settings)
    await start_or_raise(admin, settings, "describe topics")
    try:
        topics = list(TOPICS.values())
        states = await _describe(admin, settings, topics)
        return [states[t.key] for t in topics]
    finally:
        await admin.close()


async def _describe(admin: AIOKafkaAdminClient, settings: FulmenSettings, topics: list[Topic]) -> dict[str, TopicState]:
    prefix = settings.kafka.topic_prefix
    names = {topic_name(t.key, prefix): t for t in topics}
    states = {
        t.key: TopicState(key=t.key.value, name=name, exists=False, wanted_partitions=t.partitions)
        for name, t in names.items()
    }
    # Describe only topics that exist: a metadata request for a missing topic makes a broker with
    # auto.create.topics.enable create it on the spot, with the broker's defaults instead of ours.
    existing = sorted(set(await admin.list_topics()) & set(names))
    if not existing:
        return states
    for entry in await admin.describe_topics(existing):
        state = states[names[entry["topic"]].key]
        if entry["error_code"] not in (0, _UNKNOWN_TOPIC):
            raise RetryableError(f"describing topic {entry['topic']} failed with error code {entry['error_code']}")
        state.exists = entry["error_code"] == 0
        state.partitions = len(entry["partitions"])
        state.replicas = min((len(p["replicas"]) for p in entry["partitions"]), default=0)
        state.in_sync = min((len(p["isr"]) for p in entry["partitions"]), default=0)
    configs = await _dynamic_configs(admin, [s.name for s in states.values() if s.exists])
    for state in states.values():
        state.config = configs.get(state.name, {})
    return states


async def _dynamic_configs(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, dict[str, str]]:
    """The settings set on each topic itself (not inherited from the broker's defaults)."""
    if not names:
        return {}
    responses = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n) for n in names])
    result: dict[str, dict[str, str]] = {}
    for response in responses:
        for resource in response.to_object()["resources"]:
            result[resource["resource_name"]] = {
                entry["config_names"]: entry["config_value"]
                for entry in resource["config_entries"]
                if entry["config_source"] == _DYNAMIC_TOPIC_CONFIG
            }
    return result


async def _create(admin: AIOKafkaAdminClient, settings: FulmenSettings, topics: list[Topic], replication: int) -> None:
    prefix = settings.kafka.topic_prefix
    durability = {"min.insync.replicas": str(isr)} if (isr := min_insync_replicas(replication)) else {}
    new = [
        NewTopic(topic_name(t.key, prefix), t.partitions, replication, topic_configs={**t.config, **durability})
        for t in topics
    ]
    response = (await admin.create_topics(new, timeout_ms=30_000)).to_object()
    for error in response["topic_errors"]:
        if error["error_code"] not in (0, _TOPIC_ALREADY_EXISTS):
            raise ConfigurationError(f"creating topic {error['topic']} failed: {error['error_message']}")
        log.info("topic %s created", error["topic"])


async def _reconcile(admin: AIOKafkaAdminClient, t: Topic, state: TopicState) -> str:
    action = "unchanged"
    if state.partitions < t.partitions:
        log.warning(
            "topic %s has %d partitions, adding up to %d: keys may map to other partitions from now on",
            state.name,
            state.partitions,
            t.partitions,
        )
        response = (await admin.create_partitions({state.name: NewPartitions(t.partitions)})).to_object()
        for error in response["topic_errors"]:
            if error["error_code"] != 0:
                raise ConfigurationError(f"adding partitions to {state.name} failed: {error['error_message']}")
        action = "updated"
    drift = {k: v for k, v in t.config.items() if state.config.get(k) != v} | _durability_drift(state)
    if drift:
        # AlterConfigs replaces the topic's whole dynamic set, so send what is there merged with ours.
        merged = {**state.config, **drift}
        responses = await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, state.name, merged)])
        for response in responses:
            for resource in response.to_object()["resources"]:
                if resource["error_code"] != 0:
                    raise ConfigurationError(
                        f"updating settings of topic {state.name} failed: {resource['error_message']}"
                    )
        log.info("topic %s settings updated: %s", state.name, drift)
        action = "updated"
    return action


def _durability_drift(state: TopicState) -> dict[str, str]:
    """``min.insync.replicas`` to set on a topic replicated 3 times or more whose own setting is missing or lower
    than Fulmen's (empty when nothing is to change)."""
    wanted = min_insync_replicas(state.replicas)
    current = state.config.get("min.insync.replicas", "")
    if wanted is None or (current.isdigit() and int(current) >= wanted):
        return {}
    return {"min.insync.replicas": str(wanted)}
