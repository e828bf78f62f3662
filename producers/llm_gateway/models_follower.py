"""Follows ``fulmen.models`` and hands each newer version of the served model to the backend.

The topic is compacted and keyed by model name (and agent, for an agent's adapter: ``ModelVersion.topic_key``), so
reading it from the beginning gives the latest version of each model and of each of its agents' adapters, which
the follower tracks apart: the model's versions and each adapter's are compared and loaded on their own. The
follower is a faststream batch subscriber with no consumer group (every gateway sees every version) that starts
from the earliest offset, as there are no committed offsets to start from; its acknowledgement policy is
``AckPolicy.MANUAL`` and it never commits (without a group there is nothing to commit to: its position lives in
memory and each start reads the topic again).

At start (:meth:`ModelsFollower.catch_up`) the follower reads up to the end offsets it finds and loads the
newest version seen (of the model, and of each adapter) if it is newer than what the backend serves; then
(:meth:`ModelsFollower.run`) it loads, for each batch it receives, the newest versions in it if newer. A version
that fails to load is logged and skipped: the gateway keeps serving the one it has. An unreadable record is logged
and skipped (the gateway has no dead-letter topic of its own; the ``model_versions`` sink dead-letters it).

:class:`PromotionsFollower` (``FULMEN_LLM_FOLLOW=promoted``: a gateway for agents in production) follows the
compacted promotions topic instead (:mod:`fulmen.algorithm.service.promotion`): the version in force is the LATEST
``promote`` or ``rollback`` of the model, older or newer than the one served (a rollback goes back), and it is
loaded when it is not the one the gateway serves (compared by run and version: two runs both have a version 3).
Rejections are skipped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage
from faststream.middlewares import AckPolicy

from fulmen.infra.kafka.admin import partition_count
from fulmen.infra.kafka.broker import endpoint_title, kafka_broker, provisioned, subscriber_options
from fulmen.infra.kafka.clients import close_quietly, start_or_raise
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas import Event, ModelPromotion, ModelVersion, PromotionAction, TopicKey, decode, topic
from fulmen.schemas.errors import FulmenError

__all__ = ["ModelsFollower", "PromotionsFollower", "TopicFollower", "decode_or_skip", "subscribe"]

log = logging.getLogger(__name__)

Loader = Callable[[ModelVersion], Awaitable[None]]
Current = Callable[[str], int | None]
"""The version the backend serves of the model (``""``) or of an agent's adapter (its name); None: none."""

_POLL_S = 0.5
_SERVING = (PromotionAction.PROMOTE, PromotionAction.ROLLBACK)


_FOLLOWS = {
    TopicKey.MODELS: "Every gateway reads every version (no consumer group) and hot-loads the newest.",
    TopicKey.PROMOTIONS: "A gateway that follows promotions (no consumer group) serves the version in force.",
    TopicKey.PROMPTS: "Every gateway reads every prompt bundle (no consumer group) and applies the ones calls name.",
    TopicKey.PROMPT_PROMOTIONS: "Every gateway (no consumer group) applies the bundle in force to calls naming none.",
}


def subscribe(broker: KafkaBroker, key: TopicKey = TopicKey.MODELS) -> Any:
    """Declare a follower's subscriber on ``broker``: the models (promotions, prompts, prompt promotions) topic from
    its beginning, no group, no commits."""
    return broker.subscriber(
        provisioned(topic(key).name),
        title=endpoint_title("llm-gateway", "receive", key),
        description=_FOLLOWS[key],
        **subscriber_options(group_id=None, ack_policy=AckPolicy.MANUAL, max_records=500, max_wait_s=_POLL_S),
    )


class TopicFollower:
    """Follows one small compacted topic from its beginning, with no group and no commits (the module docstring's
    mechanism, shared by the model and the prompt followers). A subclass names its topic (``key``) and handles each
    batch (:meth:`handle`, calling :meth:`_mark_read` per record); :meth:`_on_caught_up` runs once the records up
    to the end offsets found at start were handled. Build it, :meth:`catch_up` once, then :meth:`run`."""

    key = TopicKey.MODELS
    what = "model follower"

    def __init__(self, settings: FulmenSettings) -> None:
        self.settings = settings
        self.broker = kafka_broker(settings, consumer_only=True, graceful_timeout=5.0)
        self.subscriber = subscribe(self.broker, self.key)
        self.subscriber(self._handler())
        self.topic = self.subscriber.topics[0].name
        self._read: dict[TopicPartition, int] = {}  # per partition, the offset after the last record handled
        self._caught_up = False
        self._started = False

    async def catch_up(self) -> None:
        """Start following; return once every record up to the end offsets found now was handled (then
        :meth:`_on_caught_up` ran).

        Raises :class:`~fulmen.schemas.errors.BrokerUnavailableError` when the broker does not answer in time.
        """
        partitions = [TopicPartition(self.topic, p) for p in range(await partition_count(self.settings, self.topic))]
        self._started = True
        try:
            await start_or_raise(self.broker, self.settings, self.what)
            consumer = self.subscriber.consumer
            ends = await consumer.end_offsets(partitions)
            starts = await consumer.beginning_offsets(partitions)
            # the last record before an end offset is never compacted away (it is in the active segment)
            targets = {tp: end for tp, end in ends.items() if end > starts[tp]}
            while any(self._read.get(tp, 0) < end for tp, end in targets.items()):
                await asyncio.sleep(0.05)
        except BaseException:
            await self.close()
            raise
        self._caught_up = True
        await self._on_caught_up()

    async def run(self, stop: asyncio.Event) -> None:
        """Follow until ``stop`` is set, then stop the subscriber."""
        try:
            await stop.wait()
        finally:
            await self.close()

    async def close(self) -> None:
        if self._started:
            self._started = False
            await close_quietly([self.broker])

    def _handler(self) -> Callable[..., Any]:
        async def on_records(message: KafkaMessage) -> None:
            await self.handle(message.raw_message)

        on_records.__name__ = f"on_{self.key.value}"
        return on_records

    def _mark_read(self, record: ConsumerRecord) -> None:
        tp = TopicPartition(record.topic, record.partition)
        self._read[tp] = max(self._read.get(tp, 0), record.offset + 1)

    async def handle(self, records: Sequence[ConsumerRecord]) -> None:
        raise NotImplementedError

    async def _on_caught_up(self) -> None:
        """What to do once caught up (nothing by default)."""


class ModelsFollower(TopicFollower):
    """Build with the model name to follow and a loader; :meth:`catch_up` once, then :meth:`run`."""

    key = TopicKey.MODELS

    def __init__(self, settings: FulmenSettings, model_name: str, current: Current, load: Loader) -> None:
        super().__init__(settings)
        self.model_name = model_name
        self.current = current
        self.load = load
        self.newest: dict[str, ModelVersion] = {}  # the newest version seen so far, of the model ("") and per adapter
        self._loading = asyncio.Lock()

    async def _on_caught_up(self) -> None:
        """Load the newest version found (if newer than the backend's)."""
        for event in self._in_load_order(self.newest.values()):
            await self._maybe_load(event)

    async def handle(self, records: Sequence[ConsumerRecord]) -> None:
        """One batch: note the newest version of the model in it; once caught up, load it if newer (full weights
        or a LoRA adapter: the backend refuses what it cannot serve, and the failure is logged)."""
        newest: dict[str, ModelVersion] = {}
        for record in records:
            event = self._decode(record)
            if event is not None and event.model_name == self.model_name:
                seen = newest.get(event.adapter)
                newest[event.adapter] = event if seen is None or event.version > seen.version else seen
            self._mark_read(record)
        for adapter, event in newest.items():
            if adapter not in self.newest or event.version > self.newest[adapter].version:
                self.newest[adapter] = event
        if self._caught_up:
            for event in self._in_load_order(newest.values()):
                await self._maybe_load(event)

    @staticmethod
    def _in_load_order(events) -> list[ModelVersion]:
        """The model first (a full-weight version starts without adapters), then the adapters."""
        return sorted(events, key=lambda event: event.adapter != "")

    def _decode(self, record: ConsumerRecord) -> ModelVersion | None:
        return decode_or_skip(ModelVersion, record)

    async def _maybe_load(self, event: ModelVersion) -> None:
        async with self._loading:  # catch_up's load and the handler's never overlap
            current = self.current(event.adapter)
            if current is not None and event.version <= current:
                return
            try:
                await self.load(event)
            except Exception:
                what = f"agent {event.adapter}'s adapter" if event.adapter else "model"
                log.exception(
                    "could not load %s version %d from %s; still serving %s", what, event.version, event.uri, current
                )


class PromotionsFollower(ModelsFollower):
    """Serves the version in force on the promotions topic (module docstring); built and run as its parent."""

    key = TopicKey.PROMOTIONS

    def __init__(self, settings: FulmenSettings, model_name: str, current: Current, load: Loader) -> None:
        super().__init__(settings, model_name, current, load)
        self._applied: dict[str, tuple[str, int]] = {}  # per adapter, the (run, version) loaded from a promotion

    async def handle(self, records: Sequence[ConsumerRecord]) -> None:
        """One batch: the latest promote or rollback of the model (and of each adapter) in it is in force; once
        caught up, load it unless it is what the gateway serves."""
        latest: dict[str, ModelVersion] = {}
        for record in records:
            event = decode_or_skip(ModelPromotion, record)
            if event is not None and event.model.model_name == self.model_name and event.action in _SERVING:
                latest[event.model.adapter] = event.model
            self._mark_read(record)
        self.newest.update(latest)
        if self._caught_up:
            for event in self._in_load_order(latest.values()):
                await self._maybe_load(event)

    async def _maybe_load(self, event: ModelVersion) -> None:
        async with self._loading:
            key = (event.run_id, event.version)
            if self._applied.get(event.adapter) == key:
                return
            if (
                event.adapter not in self._applied
                and self.current(event.adapter) == event.version
                and event.version == 0
            ):
                self._applied[event.adapter] = key  # version 0 is the base the gateway started with
                return
            try:
                await self.load(event)
            except Exception:
                log.exception(
                    "could not load the promoted version %d (run %s) from %s; still serving %s",
                    event.version,
                    event.run_id,
                    event.uri,
                    self._applied.get(event.adapter),
                )
                return
            self._applied[event.adapter] = key
            log.info("serving the promoted version %d of %s (run %s)", event.version, event.model_name, event.run_id)


E = TypeVar("E", bound=Event)


def decode_or_skip(event_type: type[E], record: ConsumerRecord) -> E | None:
    """The record's event, or None (logged) when it is unreadable: the gateway keeps serving what it has."""
    try:
        return decode(event_type, record.value, topic=record.topic, partition=record.partition, offset=record.offset)
    except FulmenError as exc:
        log.error("skipping an unreadable %s: %s", event_type.__name__, exc)
        return None
