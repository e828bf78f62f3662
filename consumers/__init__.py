"""What materialises: Kafka topics into ClickHouse tables, in batches, committed after the insert."""

from fulmen.consumers.app import ConsumerOptions, ConsumersApp, WorkerSink, consume_sinks, default_sinks
from fulmen.consumers.batch import BatchConsumer, BatchStats, Sink
from fulmen.consumers.event_sinks import EVENT_SINKS, EventSink
from fulmen.consumers.spans import SpanSink

__all__ = [
    "EVENT_SINKS",
    "BatchConsumer",
    "BatchStats",
    "ConsumerOptions",
    "ConsumersApp",
    "EventSink",
    "Sink",
    "SpanSink",
    "WorkerSink",
    "consume_sinks",
    "default_sinks",
]
