"""Read a topic from its beginning to the end offsets it has now, with no consumer group: the events on it.

For the small compacted topics whose whole content is the state (``fulmen.models``, ``fulmen.promotions``): the
trainer reads them at start (has this version landed? which version serves?), ``fulmen models`` to list and to
decide. An undecodable record is logged and skipped (the topic's sink dead-letters it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TypeVar

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from fulmen.infra.kafka.admin import partition_count
from fulmen.infra.kafka.clients import close_quietly, consumer, start_or_raise
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas.codec import decode
from fulmen.schemas.errors import BrokerUnavailableError, DecodeError
from fulmen.schemas.events import Event
from fulmen.schemas.topics import TopicKey, topic_name

__all__ = ["READ_TIMEOUT_S", "read_to_end"]

log = logging.getLogger(__name__)

E = TypeVar("E", bound=Event)

READ_TIMEOUT_S = 60.0
"""How long reading a topic to its end may take before it counts as a broker outage."""


async def read_to_end(
    settings: FulmenSettings, key: TopicKey, event_type: type[E], *, timeout_s: float = READ_TIMEOUT_S
) -> list[E]:
    """Every ``event_type`` on topic ``key`` now, in offset order per partition (partitions one after the other).

    Raises :class:`BrokerUnavailableError` when the broker does not answer within ``timeout_s``."""
    name = topic_name(key, settings.kafka.topic_prefix)
    reader = consumer(settings, None)
    await start_or_raise(reader, settings, f"{key.value} topic reader")
    found: dict[TopicPartition, list[E]] = {}
    try:
        async with asyncio.timeout(timeout_s):
            partitions = [TopicPartition(name, p) for p in range(await partition_count(settings, name))]
            if not partitions:
                return []
            reader.assign(partitions)
            await reader.seek_to_beginning(*partitions)
            ends = await reader.end_offsets(partitions)
            while [tp for tp, end in ends.items() if await reader.position(tp) < end]:
                for tp, records in (await reader.getmany(*partitions, timeout_ms=500)).items():
                    found.setdefault(tp, []).extend(_decoded(records, event_type))
    except TimeoutError:
        raise BrokerUnavailableError(f"reading {name} to its end took over {timeout_s:g}s", topic=name) from None
    except KafkaError as exc:
        raise BrokerUnavailableError(f"reading {name} failed: {type(exc).__name__}: {exc}", topic=name) from exc
    finally:
        await close_quietly([reader])
    return [event for tp in sorted(found, key=lambda tp: tp.partition) for event in found[tp]]


def _decoded(records: list, event_type: type[E]) -> list[E]:
    events = []
    for record in records:
        try:
            events.append(
                decode(event_type, record.value, topic=record.topic, partition=record.partition, offset=record.offset)
            )
        except DecodeError as exc:
            log.error("skipping an unreadable %s: %s", event_type.__name__, exc)
    return events
