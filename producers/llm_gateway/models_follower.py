"""Follows ``fulmen.models`` and hands each newer version of the served model to the backend.

The topic is compacted and keyed by model name, so reading it from the beginning (no consumer group: every
gateway sees every version) gives the latest version of each model. At start the follower reads up to the
end and loads the newest version if it is newer than what the backend serves; then it loads each newer
version as it is published. A version that fails to load is logged and skipped: the gateway keeps serving
the one it has.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaConsumer, TopicPartition

from fulmen.infra.kafka.admin import partition_count
from fulmen.infra.kafka.clients import close_quietly, consumer, start_or_raise
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas import ModelVersion, TopicKey, decode, topic_name
from fulmen.schemas.errors import FulmenError

__all__ = ["ModelsFollower"]

log = logging.getLogger(__name__)

Loader = Callable[[ModelVersion], Awaitable[None]]


class ModelsFollower:
    """Build with the model name to follow and a loader; :meth:`catch_up` once, then :meth:`run`."""

    def __init__(
        self, settings: FulmenSettings, model_name: str, current: Callable[[], int | None], load: Loader
    ) -> None:
        self.settings = settings
        self.model_name = model_name
        self.current = current
        self.load = load
        self.topic = topic_name(TopicKey.MODELS, settings.kafka.topic_prefix)
        self._consumer: AIOKafkaConsumer | None = None

    async def catch_up(self) -> None:
        """Read the topic to its end now, and load the newest version found (if newer)."""
        self._consumer = consumer(self.settings, None)
        await start_or_raise(self._consumer, self.settings, "model follower")
        partitions = [TopicPartition(self.topic, p) for p in range(await partition_count(self.settings, self.topic))]
        self._consumer.assign(partitions)
        await self._consumer.seek_to_beginning(*partitions)
        ends = await self._consumer.end_offsets(partitions)
        newest: ModelVersion | None = None
        while await self._behind(ends):
            for event in await self._poll():
                newest = event if newest is None or event.version > newest.version else newest
        if newest is not None:
            await self._maybe_load(newest)

    async def _behind(self, ends: dict[TopicPartition, int]) -> bool:
        for tp, end in ends.items():  # not any(await ...): that would build an async generator
            if await self._consumer.position(tp) < end:  # type: ignore[union-attr]
                return True
        return False

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                for event in await self._poll():
                    await self._maybe_load(event)
        finally:
            await close_quietly([self._consumer] if self._consumer else [])

    async def _poll(self) -> list[ModelVersion]:
        if self._consumer is None:
            raise RuntimeError("catch_up() first")
        batches = await self._consumer.getmany(timeout_ms=500)
        events = []
        for records in batches.values():
            for record in records:
                try:
                    event = decode(
                        ModelVersion, record.value, topic=record.topic, partition=record.partition, offset=record.offset
                    )
                except FulmenError as exc:
                    log.error("skipping an unreadable model version: %s", exc)
                    continue
                if event.model_name == self.model_name:
                    events.append(event)
        return events

    async def _maybe_load(self, event: ModelVersion) -> None:
        current = self.current()
        if current is not None and event.version <= current:
            return
        if event.format != "hf":
            log.error(
                "model version %d of %s is a %s; only full 'hf' checkpoints can be served",
                event.version,
                event.model_name,
                event.format,
            )
            return
        try:
            await self.load(event)
        except Exception:
            log.exception(
                "could not load model version %d from %s; still serving %s", event.version, event.uri, current
            )
