"""A gen_ai ``gen_ai.evaluation.result`` event made with the stock OpenTelemetry SDK is read like a
``fulmen.reward`` span: through the runner, the OTLP and LLM gateways and the transitions consumer, it is credited
to the call whose response it names (``gen_ai.response.id``), not to the call it follows in time; and the OTLP
gateway publishes it as a Feedback for that response too, so it lands where late feedback lands."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fulmen.consumers.transitions import TransitionsSection
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import Store
from fulmen.schemas import Feedback, TopicKey
from fulmen.testing.llm_pipeline import llm_gateway_running
from tests.integration.span_pipeline import gateway_running
from tests.integration.test_runner import request, submit
from tests.integration.test_train_loop import read_topic
from tests.integration.transition_pipeline import BatchReader, consumers_running

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


async def test_an_evaluation_event_is_credited_to_the_response_it_names(
    settings: FulmenSettings, linked_store: Store, tiny_model: Path, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {
        "FULMEN_KAFKA_BOOTSTRAP": settings.bootstrap,
        "FULMEN_KAFKA_TOPIC_PREFIX": settings.kafka.topic_prefix,
        "FULMEN_HOME": str(settings.home),
        "PYTHONPATH": str(ROOT),
    }
    log = tmp_path / "runner.log"
    async with (
        consumers_running(settings, linked_store, TransitionsSection(late_window_s=0)),
        gateway_running(settings) as otlp,
        llm_gateway_running(settings, tiny_model, default_max_tokens=6) as llm,
        BatchReader(settings) as reader,
    ):
        env |= {
            "FULMEN_RUNNER_LLM_BASE_URL": f"http://127.0.0.1:{llm.port}",
            "FULMEN_RUNNER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp.port}/v1/traces",
        }
        with open(log, "ab") as out:
            runner = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "fulmen.cli.main",
                    "runner",
                    "--agent",
                    "tests.agents.chat:ask_twice_and_rate_the_first",
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        try:
            await submit(settings, [request("judged", {"question": "Weather?", "score": 0.75})])
            (batch,) = await reader.until(1, timeout_s=120)
        finally:
            runner.send_signal(signal.SIGTERM)
            await asyncio.to_thread(runner.wait, 60)
    assert [t.index for t in batch.transitions] == [0, 1], log.read_text()[-2000:]
    # by time the rating follows the second call; it names the first one's response
    assert [t.intermediate_reward for t in batch.transitions] == [0.75, None]
    assert batch.episode_reward == 1.0
    # the same rating, as late feedback would bring it: a Feedback for the first call's response (the OTLP gateway)
    (feedback,) = await read_topic(settings, TopicKey.FEEDBACK, Feedback)
    rated = linked_store.query(
        f"SELECT SpanId FROM {linked_store.database}.otel_traces WHERE SpanAttributes['gen_ai.response.id'] = "
        "{id:String} AND length(ResponseTokenIds) > 0",
        {"id": feedback.target_id},
    ).rows
    assert [r[0] for r in rated] == [batch.transitions[0].span_id]
    assert (feedback.name, feedback.value, feedback.source) == ("reward", 0.75, "otel")
    assert feedback.comment.startswith("helpfulness")
