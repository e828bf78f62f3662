"""Agents instrumented with the stock OpenTelemetry SDKs: spans through the OTLP gateway, Kafka and the spans
consumer into ClickHouse, with the right shape, nothing lost and nothing doubled."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import Store
from fulmen.schemas import semconv
from tests.integration.span_pipeline import span_pipeline

pytestmark = pytest.mark.integration

JS_AGENT = Path(__file__).parent / "js_agent"


def run_python_agent(url: str, compression: Compression, rollout: str) -> dict[str, str]:
    """A small agent traced with the Python SDK and its OTLP/HTTP protobuf exporter (nothing of ours)."""
    exporter = OTLPSpanExporter(endpoint=url, compression=compression, timeout=30)
    provider = TracerProvider(resource=Resource.create({"service.name": "py-agent", "deployment.environment": "test"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("fulmen.tests", "1.2.3")
    with tracer.start_as_current_span(
        "invoke_agent solver",
        attributes={
            semconv.GEN_AI_OPERATION_NAME: "invoke_agent",
            semconv.GEN_AI_AGENT_NAME: "solver",
            semconv.ROLLOUT_ID: rollout,
            semconv.ROLLOUT_ATTEMPT: 3,
        },
    ) as root:
        with tracer.start_as_current_span(
            "chat tiny",
            kind=SpanKind.CLIENT,
            attributes={
                semconv.GEN_AI_OPERATION_NAME: "chat",
                semconv.GEN_AI_REQUEST_MODEL: "tiny",
                semconv.ROLLOUT_ID: rollout,
                semconv.GEN_AI_REQUEST_TEMPERATURE: 0.7,
                semconv.GEN_AI_USAGE_INPUT_TOKENS: 4,
                "stream": False,
                semconv.GEN_AI_RESPONSE_FINISH_REASONS: ("stop",),
                semconv.MODEL_VERSION: 5,
                semconv.PROMPT_TOKEN_IDS: (101, 102, 103, 104),
                semconv.RESPONSE_TOKEN_IDS: (7, 8),
                semconv.RESPONSE_LOGPROBS: (-0.25, -1.5),
            },
        ) as chat:
            chat.add_event("gen_ai.choice", {"index": 0, "finish_reason": "stop"})
        with tracer.start_as_current_span(
            "execute_tool calculator", links=[Link(chat.get_span_context(), {"why": "uses"})]
        ) as tool:
            tool.set_status(Status(StatusCode.ERROR, "division by zero"))
            tool.record_exception(ZeroDivisionError("division by zero"))
        with tracer.start_as_current_span(
            semconv.SPAN_REWARD, attributes={semconv.REWARD_VALUE: 0.5, semconv.ROLLOUT_ID: rollout}
        ):
            pass
    provider.shutdown()
    ids = {
        "trace": root.get_span_context().trace_id,
        "root": root.get_span_context().span_id,
        "chat": chat.get_span_context().span_id,
        "tool": tool.get_span_context().span_id,
    }
    return {k: f"{v:032x}" if k == "trace" else f"{v:016x}" for k, v in ids.items()}


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip], ids=["plain", "gzip"])
async def test_python_sdk_protobuf_spans_land_with_their_shape(
    settings: FulmenSettings, linked_store: Store, compression: Compression
) -> None:
    db = linked_store.database
    async with span_pipeline(settings, linked_store) as pipeline:
        ids = await asyncio.to_thread(run_python_agent, pipeline.url, compression, "rollout-py")
        assert await pipeline.wait_spans(f"TraceId = '{ids['trace']}'", 4) == 4
    rows = {
        r[0]: r
        for r in linked_store.query(
            "SELECT SpanName, SpanId, ParentSpanId, SpanKind, ServiceName, ScopeName, ScopeVersion, StatusCode, "
            "StatusMessage, Duration, SpanAttributes, ResourceAttributes, Events.Name, Events.Attributes, "
            "Links.SpanId, Links.Attributes, RolloutId, Attempt, AgentName, ModelVersion, PromptTokenIds, "
            "ResponseTokenIds, ResponseLogprobs, Reward, Timestamp "
            f"FROM {db}.otel_traces WHERE TraceId = '{ids['trace']}'"
        ).rows
    }
    root, chat = rows["invoke_agent solver"], rows["chat tiny"]
    tool, reward = rows["execute_tool calculator"], rows[semconv.SPAN_REWARD]
    assert root[1] == ids["root"] and root[2] == ""
    assert chat[2] == ids["root"] and tool[2] == ids["root"] and reward[2] == ids["root"]
    assert (chat[3], root[3]) == ("Client", "Internal")
    assert chat[4] == "py-agent" and chat[5] == "fulmen.tests" and chat[6] == "1.2.3"
    assert (tool[7], tool[8]) == ("Error", "division by zero") and chat[7] == "Unset"
    assert all(r[9] > 0 for r in rows.values()) and root[9] >= chat[9] + tool[9]
    attrs = chat[10]
    assert attrs[semconv.GEN_AI_REQUEST_TEMPERATURE] == "0.7" and attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == "4"
    assert attrs["stream"] == "false" and attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == '["stop"]'
    assert semconv.PROMPT_TOKEN_IDS not in attrs  # stored in its typed column only
    assert chat[11]["deployment.environment"] == "test" and chat[11]["service.name"] == "py-agent"
    assert chat[12] == ["gen_ai.choice"] and chat[13][0]["finish_reason"] == "stop"
    assert tool[12] == ["exception"] and "ZeroDivisionError" in tool[13][0]["exception.type"]
    assert tool[14] == [ids["chat"]] and tool[15] == [{"why": "uses"}]
    assert (chat[16], root[17], root[18], chat[19]) == ("rollout-py", 3, "solver", 5)
    assert (chat[20], chat[21], chat[22]) == ([101, 102, 103, 104], [7, 8], [-0.25, -1.5])
    assert reward[23] == 0.5 and chat[23] is None


@pytest.mark.skipif(
    shutil.which("node") is None or shutil.which("npm") is None,
    reason="needs Node.js and npm for the JS SDK's OTLP/JSON exporter",
)
async def test_js_sdk_json_exporter_spans_land(
    settings: FulmenSettings, linked_store: Store, tmp_path_factory: pytest.TempPathFactory
) -> None:
    agent = _js_agent_dir()
    async with span_pipeline(settings, linked_store) as pipeline:
        result = await asyncio.to_thread(
            subprocess.run, ["node", "agent.js", pipeline.url], cwd=agent, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        ids = json.loads(result.stdout.strip().splitlines()[-1])
        assert await pipeline.wait_spans(f"TraceId = '{ids['trace_id']}'", 2) == 2
    rows = {
        r[0]: r
        for r in linked_store.query(
            "SELECT SpanName, SpanId, ParentSpanId, ServiceName, StatusCode, StatusMessage, PromptTokenIds, "
            "ResponseTokenIds, ResponseLogprobs, RolloutId, Attempt, SpanAttributes, Events.Name, AgentName "
            f"FROM {linked_store.database}.otel_traces WHERE TraceId = '{ids['trace_id']}'"
        ).rows
    }
    root, chat = rows["invoke_agent planner"], rows["chat tiny"]
    assert root[1] == ids["root"] and chat[1] == ids["chat"] and chat[2] == ids["root"]
    assert root[3] == "js-agent" and (root[4], root[5]) == ("Error", "tool failed")
    assert (chat[6], chat[7], chat[8]) == ([11, 12, 13], [14, 15], [-0.5, -1.25])
    assert (chat[9], chat[10]) == ("js-rollout", 2) and root[13] == "planner"
    assert chat[11][semconv.GEN_AI_USAGE_INPUT_TOKENS] == "3" and chat[12] == ["gen_ai.content.prompt"]


def _js_agent_dir() -> Path:
    """The JS agent with its npm packages, installed once into the cache (keyed by the lock file)."""
    import hashlib

    digest = hashlib.sha256((JS_AGENT / "package-lock.json").read_bytes()).hexdigest()[:12]
    target = Path.home() / ".cache" / "fulmen" / f"js-otlp-agent-{digest}"
    if not (target / "node_modules" / ".fulmen-complete").exists():
        target.mkdir(parents=True, exist_ok=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copyfile(JS_AGENT / name, target / name)
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"], cwd=target, check=True, capture_output=True, timeout=300
        )
        (target / "node_modules" / ".fulmen-complete").write_text(digest)
    shutil.copyfile(JS_AGENT / "agent.js", target / "agent.js")
    return target
