"""The dashboard's query layer without a store: filters, the trace tree, JSON values, and what reaches SQL."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import pytest

from fulmen.dashboard.queries import DashboardQueries, FilterError, RolloutFilters, jsonable, parse_filters, trace_tree


class RecordingReader:
    """Answers every query with no rows and keeps what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, dict[str, Any]]] = []

    def query(self, sql: str, parameters: Any = None, *, final: bool = True, read_only: bool = True) -> Any:
        assert read_only, "the dashboard reads through the read-only surface only"
        self.asked.append((sql, dict(parameters or {})))
        return type("Result", (), {"columns": [], "rows": []})()


def test_filters_are_validated_and_defaulted() -> None:
    assert parse_filters({}) == RolloutFilters()
    assert parse_filters({"status": "failed", "mode": "val", "run": "demo-1a", "attempt": "2", "limit": "10"}) == (
        RolloutFilters(status="failed", mode="val", run="demo-1a", attempt=2, limit=10)
    )
    for bad in (
        {"status": "done"},
        {"mode": "TRAIN"},
        {"attempt": "-1"},
        {"attempt": "101"},
        {"limit": "0"},
        {"run": "a b"},
        {"run": "x" * 129},
        {"offset": "1e3"},
    ):
        with pytest.raises(FilterError, match=next(iter(bad))):
            parse_filters(bad)


def test_values_reach_sql_as_parameters_only() -> None:
    reader = RecordingReader()
    DashboardQueries(reader).rollouts({"status": "failed", "mode": "train", "attempt": "3"})
    for sql, parameters in reader.asked:
        assert "failed" not in sql and "train" not in sql
        assert parameters["status"] == "failed" and parameters["mode"] == "train" and parameters["attempt"] == 3


def test_jsonable_turns_what_json_cannot_carry_into_what_it_can() -> None:
    moment = datetime(2026, 12, 1, tzinfo=UTC)
    assert jsonable({"a": math.nan, "b": [math.inf, 1.5], "c": (1, moment)}) == {
        "a": None,
        "b": [None, 1.5],
        "c": [1, "2026-12-01T00:00:00+00:00"],
    }


def span(span_id: str, parent: str, second: int, **extra: Any) -> dict[str, Any]:
    return {
        "SpanId": span_id,
        "ParentSpanId": parent,
        "Timestamp": f"2026-12-01T00:00:{second:02d}+00:00",
        "Duration": 2_000_000,
        "InputMessages": None,
        "OutputMessages": None,
        "Attributes": [],
        **extra,
    }


def test_the_trace_tree_puts_children_under_parents_in_time_order() -> None:
    spans = [
        span("root", "", 0),
        span("a", "root", 1),
        span("b", "root", 3),
        span("a1", "a", 2),
        span("call", "elsewhere", 4, InputMessages='[{"role": "user", "content": "hi"}]', Attributes=[("k", "v")]),
    ]
    tree = trace_tree(spans)
    assert [(s["SpanId"], s["Depth"]) for s in tree] == [("root", 0), ("a", 1), ("a1", 2), ("b", 1), ("call", 0)]
    assert tree[1]["OffsetMs"] == 1000 and tree[1]["DurationMs"] == 2.0
    assert tree[-1]["InputMessages"] == [{"role": "user", "content": "hi"}] and tree[-1]["Attributes"] == {"k": "v"}


def test_a_cycle_of_parents_is_shown_not_dropped() -> None:
    tree = trace_tree([span("x", "y", 0), span("y", "x", 1), span("cut", "", 2, InputMessages='[{"role": "us')])
    assert sorted(s["SpanId"] for s in tree) == ["cut", "x", "y"]
    assert next(s for s in tree if s["SpanId"] == "cut")["InputMessages"] == '[{"role": "us'  # cut JSON: text
