"""Generated store contents for the dashboard: a run's steps and versions, rollouts with their traces and
transitions, dead letters, inserted as Arrow batches the way the consumers insert them.

Each rollout looks like one of the demo's episodes behind the LLM gateway: the runner's ``fulmen.rollout`` span,
an agent span under it, per call an LLM span (gen_ai attributes, the messages as JSON, 80 prompt and 12 response
token ids, logprobs, the model version) and a tool span, and a reward span; its lifecycle row and one transition
per call. ``spans_per_rollout`` = 3 + 2 x calls. Deterministic for a seed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pyarrow as pa

from fulmen.consumers.dead_letters import DEAD_LETTER_SCHEMA
from fulmen.consumers.event_sinks import ROLLOUT_SCHEMA, TRAIN_STEP_SCHEMA, TRANSITION_SCHEMA
from fulmen.consumers.otlp_rows import SPAN_SCHEMA
from fulmen.infra.store import Store
from fulmen.schemas import semconv
from fulmen.schemas.ddl import TABLES

__all__ = ["Filled", "fill_store"]

PROMPT, RESPONSE = 80, 12
_STATUSES = ["succeeded"] * 8 + ["failed", "running"]


@dataclass(frozen=True)
class Filled:
    run_id: str
    rollouts: list[tuple[str, int, str]]  # (rollout id, attempt, status)
    spans: int
    steps: int
    dead_letters: int


def _span(
    rollout: str, trace: str, span: str, parent: str, name: str, start: datetime, ms: float, **extra: object
) -> dict:
    row = {field.name: [] for field in SPAN_SCHEMA if str(field.type).startswith("list")}
    row.update(
        {
            "Timestamp": start,
            "TraceId": trace,
            "SpanId": span,
            "ParentSpanId": parent,
            "TraceState": "",
            "SpanName": name,
            "SpanKind": "Internal",
            "ServiceName": "demo-agent",
            "ResourceAttributes": [],
            "ScopeName": "fulmen",
            "ScopeVersion": "",
            "SpanAttributes": [],
            "Duration": int(ms * 1e6),
            "StatusCode": "Ok",
            "StatusMessage": "",
            "RolloutId": rollout,
            "Attempt": 1,
            "AgentName": "",
            "ModelVersion": None,
            "Reward": None,
        }
    )
    row.update(extra)
    return row


def _rollout_spans(rng: random.Random, rollout: str, start: datetime, calls: int, version: int, reward: float):
    trace = f"{rng.getrandbits(128):032x}"
    root, agent = f"{rng.getrandbits(64):016x}", f"{rng.getrandbits(64):016x}"
    total_ms = 40.0 + calls * 30
    spans = [
        _span(
            rollout,
            trace,
            root,
            "",
            semconv.SPAN_ROLLOUT,
            start,
            total_ms,
            SpanAttributes=[(semconv.ROLLOUT_ID, rollout), (semconv.ROLLOUT_ATTEMPT, "1")],
        ),
        _span(
            rollout,
            trace,
            agent,
            root,
            "invoke_agent calc",
            start + timedelta(milliseconds=1),
            total_ms - 2,
            AgentName="calc",
            SpanAttributes=[(semconv.GEN_AI_OPERATION_NAME, "invoke_agent")],
        ),
    ]
    at = start + timedelta(milliseconds=2)
    for _ in range(calls):
        a, b = rng.randint(10, 49), rng.randint(10, 49)
        prompt = [{"role": "user", "content": f"Ann has {a} pears and finds {b} more. How many now?"}]
        answer = [
            {
                "role": "assistant",
                "content": f'<tool_call>{{"name": "calc", "arguments": {{"expr": "{a}+{b}"}}}}</tool_call>',
                "finish_reason": "stop",
            }
        ]
        spans.append(
            _span(
                rollout,
                f"{rng.getrandbits(128):032x}",
                f"{rng.getrandbits(64):016x}",
                agent,
                "chat tiny",
                at,
                20.0,
                SpanKind="Server",
                ServiceName="fulmen-llm-gateway",
                AgentName="calc",
                ModelVersion=version,
                PromptTokenIds=[rng.randrange(300) for _ in range(PROMPT)],
                ResponseTokenIds=[rng.randrange(300) for _ in range(RESPONSE)],
                ResponseLogprobs=[-rng.random() for _ in range(RESPONSE)],
                SpanAttributes=[
                    (semconv.GEN_AI_OPERATION_NAME, "chat"),
                    (semconv.GEN_AI_REQUEST_MODEL, "tiny"),
                    (semconv.GEN_AI_USAGE_INPUT_TOKENS, str(PROMPT)),
                    (semconv.GEN_AI_USAGE_OUTPUT_TOKENS, str(RESPONSE)),
                    (semconv.GEN_AI_INPUT_MESSAGES, json.dumps(prompt)),
                    (semconv.GEN_AI_OUTPUT_MESSAGES, json.dumps(answer)),
                    (semconv.MODEL_VERSION, str(version)),
                    (semconv.ROLLOUT_ID, rollout),
                ],
            )
        )
        spans.append(
            _span(
                rollout,
                trace,
                f"{rng.getrandbits(64):016x}",
                agent,
                "execute_tool calc",
                at + timedelta(milliseconds=21),
                3.0,
                AgentName="calc",
                SpanAttributes=[(semconv.GEN_AI_TOOL_NAME, "calc")],
            )
        )
        at += timedelta(milliseconds=30)
    spans.append(
        _span(
            rollout,
            trace,
            f"{rng.getrandbits(64):016x}",
            agent,
            semconv.SPAN_REWARD,
            at,
            0.1,
            Reward=reward,
            SpanAttributes=[(semconv.REWARD_VALUE, str(reward))],
        )
    )
    return spans


def fill_store(
    store: Store,
    *,
    rollouts: int = 100,
    calls: int = 2,
    steps: int = 5,
    dead_letters: int = 20,
    seed: int = 0,
    run_id: str = "bench-run",
) -> Filled:
    """Insert a run of ``steps`` steps, ``rollouts`` rollouts (their spans, lifecycle rows, transitions) and
    ``dead_letters`` parked records into ``store`` (already migrated)."""
    rng = random.Random(seed)
    began = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    span_rows, rollout_rows, transition_rows, made = [], [], [], []
    for index in range(rollouts):
        rollout, status = f"r{index:07d}", rng.choice(_STATUSES)
        group, version = f"g{index // 8:06d}", min(steps, index * steps // max(1, rollouts))
        start = began + timedelta(seconds=index * 0.05)
        reward = float(rng.random() < 0.5) if status == "succeeded" else None
        span_rows += _rollout_spans(rng, rollout, start, calls, version, reward or 0.0)
        rollout_rows.append(
            {
                "RolloutId": rollout,
                "Attempt": 1,
                "TaskId": f"t{index // 8}",
                "GroupId": group,
                "Mode": "val" if index % 10 == 9 else "train",
                "Status": status,
                "StatusRank": 3,
                "Reward": reward,
                "Error": "agent raised ValueError" if status == "failed" else "",
                "RunnerId": "runner-1",
                "ModelVersion": version,
                "Timestamp": start + timedelta(milliseconds=200),
            }
        )
        made.append((rollout, 1, status))
        if status == "succeeded":
            transition_rows += [
                {
                    "RolloutId": rollout,
                    "Attempt": 1,
                    "TaskId": f"t{index // 8}",
                    "GroupId": group,
                    "Mode": "train",
                    "Status": status,
                    "CallIndex": call,
                    "TraceId": "",
                    "SpanId": f"s{index}-{call}",
                    "AgentName": "calc",
                    "ModelVersion": version,
                    "PromptTokenIds": [1] * PROMPT,
                    "ResponseTokenIds": [2] * RESPONSE,
                    "ResponseLogprobs": [-0.5] * RESPONSE,
                    "Reward": None,
                    "IntermediateReward": None,
                    "EpisodeReward": reward,
                    "CreatedAt": start + timedelta(milliseconds=300),
                }
                for call in range(calls)
            ]
    for start in range(0, len(span_rows), 20_000):
        store.insert_batch(TABLES["spans"], pa.Table.from_pylist(span_rows[start : start + 20_000], SPAN_SCHEMA))
    store.insert_batch(TABLES["rollouts"], pa.Table.from_pylist(rollout_rows, ROLLOUT_SCHEMA))
    if transition_rows:
        store.insert_batch(TABLES["transitions"], pa.Table.from_pylist(transition_rows, TRANSITION_SCHEMA))
    step_rows = [
        {
            "RunId": run_id,
            "Step": step,
            "ModelVersion": step,
            "NumTransitions": 96,
            "NumGroups": 12,
            "RewardMean": 0.2 + 0.6 * step / max(1, steps),
            "RewardStd": 0.3,
            "AdvantageMean": 0.0,
            "AdvantageStd": 1.0,
            "Loss": 0.05 / step,
            "ClipFraction": 0.02,
            "Kl": 0.001 * step,
            "TokensPerS": 5000.0 + step,
            "RolloutWaitS": 5.0,
            "TrainS": 4.0,
            "PublishS": 0.5,
            "DroppedStale": 0,
            "Extra": [("val_accuracy", 0.3 + 0.1 * step)],
            "CreatedAt": began + timedelta(seconds=10 * step),
        }
        for step in range(1, steps + 1)
    ]
    if step_rows:
        store.insert_batch(TABLES["train_steps"], pa.Table.from_pylist(step_rows, TRAIN_STEP_SCHEMA))
    parked = [
        {
            "Topic": "fulmen.dlq",
            "Partition": 0,
            "Offset": n,
            "SourceTopic": "otlp_spans",
            "SourcePartition": n % 4,
            "SourceOffset": 1000 + n,
            "ErrorType": "DecodeError",
            "Error": "ExportTraceServiceRequest: not valid OTLP protobuf (Error parsing message)",
            "ConsumerGroup": "fulmen.consumers.spans",
            "FailedAt": began + timedelta(seconds=n),
            "Key": f"trace-{n}",
            "ValuePreview": "\\x00\\xff garbage",
            "ValueBytes": 14,
            "Timestamp": began + timedelta(seconds=n),
        }
        for n in range(dead_letters)
    ]
    if parked:
        store.insert_batch(TABLES["dead_letters"], pa.Table.from_pylist(parked, DEAD_LETTER_SCHEMA))
    return Filled(run_id, made, len(span_rows), steps, dead_letters)
