"""The consumers' Prometheus metrics: records consumed and rows stored per sink, batches and their inserts, dead
letters (:data:`fulmen.infra.kafka.dlq.DEAD_LETTERS`), transitions built, late spans, and the lag per partition.

The counts are the workers' own (each worker's ``stats``: nothing more is counted on the hot path); a collector
reads them from every running :class:`~fulmen.consumers.app.ConsumersApp` of the process when Prometheus scrapes.
The batch sizes and insert times are histograms observed once per batch. The lag of a partition is its high
watermark (asked of Kafka when Prometheus scrapes, :func:`fulmen.infra.metrics.add_probe`) minus the offset the
sink's group committed there: how many records the sink has still to store. Only the partitions this process owns
are reported, so the lags of several ``fulmen consume`` processes add up.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from aiokafka.structs import TopicPartition
from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fulmen.infra.metrics import add_probe
from fulmen.schemas.topics import topic_name

__all__ = ["BATCH_RECORDS", "INSERT_SECONDS", "ConsumersCollector", "observe_batch", "unwatch", "watch"]

BATCH_RECORDS = Histogram(
    "fulmen_consumer_batch_records",
    "records in a batch a sink inserted",
    ["sink"],
    buckets=(1, 5, 10, 50, 100, 500, 1000, 2500, 5000, 10000, 25000),
)
INSERT_SECONDS = Histogram(
    "fulmen_consumer_insert_duration_seconds",
    "time a batch's insert into the store took (its retries included)",
    ["sink"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)


def observe_batch(sink: str, records: int, started: float) -> None:
    """A batch of ``records`` inserted by ``sink``, its insert started at ``time.perf_counter()`` = ``started``."""
    BATCH_RECORDS.labels(sink).observe(records)
    INSERT_SECONDS.labels(sink).observe(time.perf_counter() - started)


class ConsumersCollector(Collector):
    """Reads the workers' counts and the last lag seen, for every app :func:`watch` was given (weakly held)."""

    def __init__(self) -> None:
        self.apps: weakref.WeakSet[Any] = weakref.WeakSet()
        # (sink, topic, partition) -> (committed offset, high watermark), refreshed by the lag probe
        self.lag: dict[tuple[str, str, int], int] = {}

    def collect(self) -> Iterator[Metric]:
        families = {
            "records": CounterMetricFamily(
                "fulmen_consumer_records", "records consumed (read from Kafka)", labels=["sink", "topic"]
            ),
            "rows": CounterMetricFamily("fulmen_consumer_rows_stored", "rows inserted into the store", labels=["sink"]),
            "batches": CounterMetricFamily(
                "fulmen_consumer_batches", "batches inserted and committed", labels=["sink"]
            ),
            "transitions": CounterMetricFamily(
                "fulmen_transitions_built", "transitions built (one per LLM call of a finished rollout)", labels=[]
            ),
            "late": CounterMetricFamily(
                "fulmen_transitions_late_rebuilds",
                "rollouts built again because spans arrived after their transitions",
                labels=[],
            ),
            "sources": CounterMetricFamily(
                "fulmen_transitions_rollouts_built",
                "rollouts built, by where their spans came from: feed (the spans this process stored) or store "
                "(read back)",
                labels=["source"],
            ),
        }
        sums: dict[tuple[str, tuple[str, ...]], float] = {}
        for app in list(self.apps):
            prefix = app.settings.kafka.topic_prefix
            for worker in list(app.workers):
                for key, value in _worker_counts(worker, prefix):
                    sums[key] = sums.get(key, 0.0) + value
        for (family, labels), value in sorted(sums.items()):
            families[family].add_metric(list(labels), value)
        yield from families.values()
        lag = GaugeMetricFamily(
            "fulmen_consumer_lag_records",
            "records of a partition the sink has not stored yet: high watermark minus committed offset",
            labels=["sink", "topic", "partition"],
        )
        for (sink, topic, partition), value in sorted(self.lag.items()):
            lag.add_metric([sink, topic, str(partition)], value)
        yield lag

    async def refresh_lag(self) -> None:
        """Ask Kafka for the high watermark of every partition the running sinks own, and keep the lags."""
        lag: dict[tuple[str, str, int], int] = {}
        for app in list(self.apps):
            asks = [_partition_lag(worker) for worker in list(app.workers)]
            for found in await asyncio.gather(*asks, return_exceptions=True):
                if isinstance(found, dict):
                    lag.update(found)
        self.lag = lag


def _worker_counts(worker: Any, prefix: str) -> Iterable[tuple[tuple[str, tuple[str, ...]], float]]:
    sink = worker.sink.name
    stats = worker.stats
    yield ("records", (sink, topic_name(worker.sink.topic, prefix))), stats.records
    if hasattr(stats, "rows"):
        yield ("rows", (sink,)), stats.rows
    if hasattr(stats, "batches"):
        yield ("batches", (sink,)), stats.batches
    if hasattr(stats, "transitions"):
        yield ("transitions", ()), stats.transitions
        yield ("late", ()), stats.late_rebuilds
        yield ("sources", ("feed",)), stats.from_feed
        yield ("sources", ("store",)), stats.from_store


async def _partition_lag(worker: Any) -> dict[tuple[str, str, int], int]:
    """``worker``'s partitions (assigned, or committed to by it) and their lag; empty without a consumer yet."""
    consumer = getattr(worker, "consumer", None)
    if consumer is None:
        return {}
    partitions: set[TopicPartition] = set(worker.stats.committed) | set(consumer.assignment())
    if not partitions:
        return {}
    ends = await consumer.end_offsets(sorted(partitions))
    lag = {}
    for tp, end in ends.items():
        committed = worker.stats.committed.get(tp)
        if committed is None:
            committed = await consumer.committed(tp)
        lag[(worker.sink.name, tp.topic, tp.partition)] = max(end - (committed or 0), 0)
    return lag


_COLLECTOR = ConsumersCollector()
REGISTRY.register(_COLLECTOR)
add_probe(_COLLECTOR.refresh_lag)  # a no-op in a process that runs no consumers


def watch(app: Any) -> ConsumersCollector:
    """Report ``app``'s workers (its ``workers``, each with ``sink`` and ``stats``) until it is collected."""
    _COLLECTOR.apps.add(app)
    return _COLLECTOR


def unwatch(app: Any) -> None:
    """Stop reporting ``app`` (it stopped): its counts leave /metrics, its lags at the next scrape."""
    _COLLECTOR.apps.discard(app)
