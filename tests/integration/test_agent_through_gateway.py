"""An agent written with the official openai client, run by a runner process, served by the LLM gateway.

Runner (its own process, exporting its spans by OTLP) -> LLM gateway (transformers backend, tiny model) ->
spans topic -> spans consumer -> ClickHouse. The LLM spans in the store must carry token ids that decode to
exactly the rendered prompt and the answer the agent got; the OpenTelemetry instrumentation of the openai
client adds its own client span, stamped with the rollout like every span the agent makes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import Store
from fulmen.schemas import RolloutStatus
from fulmen.testing.llm_pipeline import llm_gateway_running
from tests.integration.span_pipeline import span_pipeline
from tests.integration.test_runner import request, submit, wait_terminal

pytestmark = pytest.mark.integration

FULMEN = [sys.executable, "-m", "fulmen.cli.main"]


def spawn_runner(settings: FulmenSettings, agent: str, llm_port: int, otlp_url: str, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {
        "FULMEN_KAFKA_BOOTSTRAP": settings.bootstrap,
        "FULMEN_KAFKA_TOPIC_PREFIX": settings.kafka.topic_prefix,
        "FULMEN_HOME": str(settings.home),
        "FULMEN_RUNNER_OTLP_ENDPOINT": otlp_url,
        "FULMEN_RUNNER_LLM_BASE_URL": f"http://127.0.0.1:{llm_port}",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    with open(log, "ab") as out:
        return subprocess.Popen(
            [*FULMEN, "runner", "--agent", agent, "--concurrency", "2"], env=env, stdout=out, stderr=subprocess.STDOUT
        )


@pytest.mark.parametrize("agent", ["ask", "ask_instrumented"])
async def test_openai_client_agent_spans_carry_token_ids_that_decode_exactly(
    settings: FulmenSettings, linked_store: Store, tiny_model: Path, tmp_path: Path, agent: str
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rollouts = {"q-1": "What is 2+2?", "q-2": "Name a colour."}
    log = tmp_path / "runner.log"
    async with span_pipeline(settings, linked_store) as pipeline, llm_gateway_running(settings, tiny_model) as gateway:
        runner = spawn_runner(settings, f"tests.agents.chat:{agent}", gateway.port, pipeline.url, log)
        try:
            await submit(settings, [request(r, {"question": q}) for r, q in rollouts.items()])
            events = await wait_terminal(settings, set(rollouts), timeout_s=120)
            assert all(events[r][-1].status is RolloutStatus.SUCCEEDED for r in rollouts), log.read_text()[-3000:]
            expected = 2 * len(rollouts) if agent == "ask" else 3 * len(rollouts)  # rollout + LLM (+ client) spans
            await pipeline.wait_spans("RolloutId != ''", expected, timeout_s=60)
        finally:
            runner.send_signal(signal.SIGTERM)
            runner.wait(timeout=60)
    db = linked_store.database
    llm_rows = linked_store.query(
        f"SELECT RolloutId, Attempt, PromptTokenIds, ResponseTokenIds, length(ResponseLogprobs), ModelVersion, "
        f"SpanAttributes['gen_ai.input.messages'], SpanAttributes['gen_ai.output.messages'] FROM {db}.otel_traces "
        "WHERE ServiceName = 'fulmen-llm-gateway' ORDER BY RolloutId",
        final=True,
    ).rows
    assert [row[0] for row in llm_rows] == sorted(rollouts)
    for rollout, attempt, prompt_ids, response_ids, logprob_count, _version, inputs, outputs in llm_rows:
        messages = json.loads(inputs)
        assert attempt == 1 and messages[-1]["content"] == rollouts[rollout]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer.decode(prompt_ids) == rendered
        assert tokenizer.decode(response_ids, skip_special_tokens=True) == json.loads(outputs)[0]["content"]
        assert logprob_count == len(response_ids) > 0
    if agent == "ask_instrumented":
        client_spans = linked_store.query(
            f"SELECT RolloutId, SpanKind FROM {db}.otel_traces WHERE ServiceName = 'fulmen-agent' "
            "AND SpanAttributes['gen_ai.operation.name'] = 'chat' ORDER BY RolloutId",
            final=True,
        ).rows
        assert [row[0] for row in client_spans] == sorted(rollouts)
