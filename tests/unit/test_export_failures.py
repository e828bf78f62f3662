"""The runner's note of rollouts whose spans were not exported."""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from fulmen.producers.runner.tracing import ExportFailures, NotingExporter
from fulmen.schemas import semconv


def spans(*rollouts: tuple[str, int] | None) -> list[ReadableSpan]:
    tracer = TracerProvider().get_tracer("t")
    made = []
    for rollout in rollouts:
        attributes = {} if rollout is None else {semconv.ROLLOUT_ID: rollout[0], semconv.ROLLOUT_ATTEMPT: rollout[1]}
        with tracer.start_as_current_span("s", attributes=attributes) as span:
            pass
        made.append(span)
    return made


class Answering(SpanExporter):
    def __init__(self, result: SpanExportResult) -> None:
        self.result = result
        self._endpoint = "http://gateway/v1/traces"

    def export(self, batch: Sequence[ReadableSpan]) -> SpanExportResult:
        return self.result


def test_the_rollouts_of_failed_spans_are_noted_once_each() -> None:
    failures = ExportFailures()
    failures.note(spans(("r1", 1), ("r1", 1), ("r2", 3), None), "broker down")
    assert failures.take("r1", 1) == "broker down" and failures.take("r1", 1) is None
    assert failures.take("r2", 3) == "broker down" and failures.take("r2", 1) is None


def test_only_the_latest_are_kept() -> None:
    failures = ExportFailures(capacity=2)
    for i in range(3):
        failures.note(spans((f"r{i}", 1)), "x")
    assert [failures.take(f"r{i}", 1) for i in range(3)] == [None, "x", "x"]


def test_the_noting_exporter_notes_failures_and_keeps_the_inner_endpoint() -> None:
    failures = ExportFailures()
    failing = NotingExporter(Answering(SpanExportResult.FAILURE), failures)
    assert failing._endpoint == "http://gateway/v1/traces"
    assert failing.export(spans(("r1", 1))) is SpanExportResult.FAILURE
    assert "failed" in (failures.take("r1", 1) or "")
    assert (
        NotingExporter(Answering(SpanExportResult.SUCCESS), failures).export(spans(("r2", 1)))
        is SpanExportResult.SUCCESS
    )
    assert failures.take("r2", 1) is None
