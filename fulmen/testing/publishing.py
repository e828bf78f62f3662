"""An :class:`EventPublisher` on a started broker, for tests that put events on the real topics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fulmen.infra.kafka.broker import kafka_broker
from fulmen.infra.kafka.clients import close_quietly, start_or_raise
from fulmen.infra.kafka.publish import EventPublisher
from fulmen.infra.settings import FulmenSettings


@asynccontextmanager
async def event_publisher(settings: FulmenSettings, **options: Any) -> AsyncIterator[EventPublisher]:
    """``options`` go to :class:`EventPublisher` (``sender``, ``timeout_s``)."""
    broker = kafka_broker(settings)
    try:
        await start_or_raise(broker, settings, "test publisher")
        yield EventPublisher(broker, **options)
    finally:
        await close_quietly([broker])
