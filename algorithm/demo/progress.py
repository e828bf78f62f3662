"""The demo's live view of training: the ``TrainStep`` events of one run, read from the metrics topic.

:func:`watch_metrics` reads the metrics topic from its beginning (no consumer group: nothing is committed)
and calls ``on_step`` with each ``TrainStep`` of ``settings.train.run_id`` once, in the order published,
until ``stop`` is set. It sees exactly what any other reader of the system (the store, a dashboard) sees.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiokafka import TopicPartition

from fulmen.algorithm.settings import TrainSettings
from fulmen.infra.kafka.admin import partition_count
from fulmen.infra.kafka.clients import close_quietly, consumer, start_or_raise
from fulmen.schemas import TopicKey, decode, topic_name
from fulmen.schemas.errors import DecodeError
from fulmen.schemas.events import TrainStep

__all__ = ["watch_metrics"]

log = logging.getLogger(__name__)


async def watch_metrics(settings: TrainSettings, on_step: Callable[[TrainStep], None], stop: asyncio.Event) -> None:
    """Call ``on_step`` for each TrainStep of this run until ``stop`` is set (module docstring)."""
    topic = topic_name(TopicKey.METRICS, settings.kafka.topic_prefix)
    reader = consumer(settings, None)
    await start_or_raise(reader, settings, "demo metrics reader")
    seen: set[int] = set()
    try:
        partitions = [TopicPartition(topic, p) for p in range(await partition_count(settings, topic))]
        reader.assign(partitions)
        await reader.seek_to_beginning(*partitions)
        while not stop.is_set():
            for records in (await reader.getmany(timeout_ms=500)).values():
                for record in records:
                    try:
                        event = decode(TrainStep, record.value)
                    except DecodeError:
                        continue
                    if event.run_id == settings.train.run_id and event.step not in seen:
                        seen.add(event.step)
                        on_step(event)
    finally:
        await close_quietly([reader])
