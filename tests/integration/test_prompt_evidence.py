"""The failing episodes' evidence read from the real embedded store by rollout id (issue 29)."""

from __future__ import annotations

import json

import pytest

from fulmen.algorithm.prompts.evidence import episode_evidence
from fulmen.infra.store import Store
from fulmen.infra.store.reads import bind_parameters
from fulmen.schemas import semconv

pytestmark = [pytest.mark.apo, pytest.mark.integration]


def _span(store: Store, rollout: str, span: str, ts: str, operation: str, seen: list, answered: list) -> None:
    attrs = {
        semconv.GEN_AI_OPERATION_NAME: operation,
        semconv.GEN_AI_INPUT_MESSAGES: json.dumps(seen),
        semconv.GEN_AI_OUTPUT_MESSAGES: json.dumps(answered),
    }
    store.command(
        bind_parameters(
            f"INSERT INTO {store.database}.otel_traces (RolloutId, TraceId, SpanId, Timestamp, SpanName, SpanAttributes) "
            "VALUES (%(r)s, 't', %(s)s, %(ts)s, 'chat', mapFromArrays(%(k)s, %(v)s))",
            {"r": rollout, "s": span, "ts": ts, "k": list(attrs), "v": list(attrs.values())},
        )
    )


def test_evidence_lists_each_call_of_the_asked_rollouts_in_order(store: Store) -> None:
    system = {"role": "system", "content": "You are a helpful assistant."}
    _span(
        store,
        "r1",
        "b",
        "2026-01-01 00:00:02",
        "chat",
        [system, {"role": "user", "content": "second?"}],
        [{"role": "assistant", "content": "two"}],
    )
    _span(
        store,
        "r1",
        "a",
        "2026-01-01 00:00:01",
        "chat",
        [system, {"role": "user", "content": "capital of France?"}],
        [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "lookup", "arguments": "{}"}}]}],
    )
    _span(store, "r1", "c", "2026-01-01 00:00:03", "execute_tool", [], [])
    _span(store, "r2", "d", "2026-01-01 00:00:01", "chat", [{"role": "user", "content": "other"}], [])
    found = episode_evidence(store, store.database, ["r1", "missing"])
    assert list(found) == ["r1"]
    text = found["r1"]
    assert text.index("capital of France?") < text.index("second?")  # time order
    assert "system: You are a helpful assistant." in text
    assert "assistant: tool_call lookup({})" in text and "assistant: two" in text
    assert "### call 3" not in text  # the tool span is not an LLM call
