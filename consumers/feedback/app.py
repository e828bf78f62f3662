"""The feedback consumer as one entry of ``fulmen consume``: builds its worker and the barrier it waits on.

It has its own consumer group over the feedback topic (``<group_prefix>.feedback``). Before dead-lettering a
feedback whose target was never found, it waits until the spans consumer (``<group_prefix>.spans``) and the rollouts
consumer (``<group_prefix>.rollouts``) have committed past what their topics held by then: see
:mod:`fulmen.consumers.feedback.worker`.
"""

from __future__ import annotations

from fulmen.consumers.barrier import OffsetBarrier, Snapshot
from fulmen.consumers.feedback.settings import FeedbackSection
from fulmen.consumers.feedback.worker import FeedbackWorker
from fulmen.consumers.tracked import WorkerContext
from fulmen.schemas.ddl import TABLES
from fulmen.schemas.topics import TopicKey, topic_name

__all__ = ["FeedbackSink", "StoreBarrier"]


class StoreBarrier:
    """Several topics' end offsets and their consumers' commits as one barrier (keyed by topic and partition)."""

    def __init__(self, barriers: list[OffsetBarrier]) -> None:
        self.barriers = barriers

    async def start(self) -> None:
        for barrier in self.barriers:
            await barrier.start()

    async def stop(self) -> None:
        for barrier in self.barriers:
            await barrier.stop()

    async def snapshot(self) -> Snapshot:
        return {tp: offset for barrier in self.barriers for tp, offset in (await barrier.snapshot()).items()}

    async def committed(self) -> Snapshot:
        return {tp: offset for barrier in self.barriers for tp, offset in (await barrier.committed()).items()}


class FeedbackSink:
    """Not a row sink: :meth:`worker` makes the :class:`FeedbackWorker` that ``ConsumersApp`` runs."""

    name = "feedback"
    topic = TopicKey.FEEDBACK
    table = TABLES["feedback"]

    def __init__(self, section: FeedbackSection | None = None) -> None:
        self.section = section or FeedbackSection()

    def worker(self, context: WorkerContext) -> FeedbackWorker:
        settings, prefix = context.settings, context.settings.kafka.topic_prefix
        barrier = StoreBarrier(
            [
                OffsetBarrier(settings, topic_name(key, prefix), f"{context.group_prefix}.{key.value}", user="feedback")
                for key in (TopicKey.SPANS, TopicKey.ROLLOUTS)
            ]
        )
        return FeedbackWorker(self, context.consumer, context.store, context.dead_letters, barrier, self.section)
