"""Every service's /metrics, scraped over HTTP while it works: the counters move with the work done (N calls -> N in
the counter), and a real Prometheus server scrapes the consumers and answers a PromQL query over their lag."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fulmen.consumers import ConsumerOptions, ConsumersApp
from fulmen.consumers.app import consume_sinks
from fulmen.infra.kafka.clients import close_quietly, producer, start_or_raise
from fulmen.infra.processes import free_port
from fulmen.infra.settings import FulmenSettings, MetricsSettings
from fulmen.infra.store import Store
from fulmen.producers.runner import Runner, RunnerSettings, load_agent
from fulmen.schemas import RolloutRequest, TopicKey, topic_name
from fulmen.testing.llm_pipeline import llm_gateway_running
from fulmen.testing.prometheus import PrometheusServer, build_prometheus, cached_prometheus
from tests.integration.span_pipeline import gateway_running
from tests.integration.test_runner import submit, wait_terminal
from tests.integration.transition_pipeline import BASE_NS, FakeSpan, encode

pytestmark = [pytest.mark.integration, pytest.mark.metrics]

ALERTS = Path(__file__).parents[2] / "deploy" / "prometheus" / "alerts.yml"


async def sample(url: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``, as the service at ``url`` says now."""
    async with httpx.AsyncClient() as client:
        response = await client.get(url, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    total = 0.0
    for family in text_string_to_metric_families(response.text):
        for found in family.samples:
            if found.name == name and all(found.labels.get(k) == v for k, v in labels.items()):
                total += found.value
    return total


async def until(check, what: str, timeout_s: float = 60.0):
    """``await check()`` until truthy (a liveness bound, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()
        if value or time.monotonic() > deadline:
            assert value, f"never happened: {what}"
            return value
        await asyncio.sleep(0.2)


async def _answers(url: str) -> bool:
    try:
        async with httpx.AsyncClient() as client:
            return (await client.get(url, timeout=2)).status_code == 200
    except httpx.HTTPError:
        return False


def with_metrics(settings: FulmenSettings) -> FulmenSettings:
    return settings.model_copy(update={"metrics": MetricsSettings(port=free_port())})


async def test_gateways_and_consumers_count_what_they_did(
    settings: FulmenSettings, linked_store: Store, tiny_model: Path
) -> None:
    settings = with_metrics(settings)
    consumers_url = f"http://127.0.0.1:{settings.metrics.port}/metrics"
    stop, ready = asyncio.Event(), asyncio.Event()
    app = ConsumersApp(settings, linked_store, consume_sinks(settings), ConsumerOptions(max_wait_s=0.1))
    consuming = asyncio.create_task(app.run(stop, ready))
    await asyncio.wait_for(ready.wait(), 60)
    try:
        async with (
            llm_gateway_running(settings, tiny_model, model_version=3, follow_models=False) as llm,
            gateway_running(settings) as otlp,
        ):
            llm_url, otlp_url = f"http://127.0.0.1:{llm.port}", f"http://127.0.0.1:{otlp.port}"
            await _llm_calls_and_feedback_are_counted(llm_url)
            await _otlp_spans_are_counted(otlp_url)
            await _consumers_store_count_and_catch_up(settings, consumers_url)
    finally:
        stop.set()
        await asyncio.wait_for(consuming, 60)


async def _llm_calls_and_feedback_are_counted(root: str) -> None:
    metrics = f"{root}/metrics"
    chat = {"gateway": "llm", "route": "/v1/chat/completions", "status": "200"}
    before = await sample(metrics, "fulmen_gateway_requests_total", **chat)
    tokens_before = await sample(metrics, "fulmen_llm_tokens_total", kind="completion")
    body = {"model": "fulmen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with httpx.AsyncClient(timeout=60) as client:
        ids = []
        for path in ("/v1/chat/completions", "/rollout/r-1/attempt/1/v1/chat/completions", "/v1/chat/completions"):
            answer = await client.post(f"{root}{path}", json=body)
            assert answer.status_code == 200, answer.text
            ids.append(answer.json()["id"])
        assert (await client.post(f"{root}/v1/chat/completions", json={**body, "model": "other"})).status_code == 404
        accepted = await client.post(f"{root}/v1/feedback", json={"response_id": ids[0], "value": 1.0})
        refused = await client.post(f"{root}/v1/feedback", json={"value": 1.0})
    assert (accepted.status_code, refused.status_code) == (202, 400)
    assert await sample(metrics, "fulmen_gateway_requests_total", **chat) - before == 3  # under any rollout prefix
    assert await sample(metrics, "fulmen_gateway_requests_total", gateway="llm", status="404") >= 1
    assert await sample(metrics, "fulmen_llm_tokens_total", kind="completion") - tokens_before >= 3
    assert await sample(metrics, "fulmen_llm_model_version", model="fulmen") == 3
    assert await sample(metrics, "fulmen_llm_feedback_total", outcome="accepted") >= 1
    assert await sample(metrics, "fulmen_llm_feedback_total", outcome="refused") >= 1
    assert await sample(metrics, "fulmen_llm_added_duration_seconds_count") >= 3
    assert await sample(metrics, "fulmen_gateway_requests_in_flight", gateway="llm") == 0


async def _otlp_spans_are_counted(root: str) -> None:
    metrics = f"{root}/metrics"
    before = await sample(metrics, "fulmen_otlp_spans_total", outcome="accepted")
    spans = [FakeSpan("step-a", "r-metrics"), FakeSpan("step-b", "r-metrics", parent="step-a")]
    async with httpx.AsyncClient(timeout=30) as client:
        answer = await client.post(
            f"{root}/v1/traces",
            content=encode(spans, BASE_NS),
            headers={"Content-Type": "application/x-protobuf"},
        )
    assert answer.status_code == 200, answer.text
    assert await sample(metrics, "fulmen_otlp_spans_total", outcome="accepted") - before == 2
    assert await sample(metrics, "fulmen_gateway_requests_total", gateway="otlp", route="/v1/traces") >= 1


async def _consumers_store_count_and_catch_up(settings: FulmenSettings, metrics: str) -> None:
    spans_topic = topic_name(TopicKey.SPANS, settings.kafka.topic_prefix)
    kafka = producer(settings)
    await start_or_raise(kafka, settings, "test producer")
    try:
        await kafka.send_and_wait(spans_topic, b"not an OTLP request", key=b"poison")
    finally:
        await close_quietly([kafka])

    async def stored() -> bool:  # 3 LLM spans and 2 OTLP spans, the poison record dead-lettered
        rows = await sample(metrics, "fulmen_consumer_rows_stored_total", sink="spans")
        dead = await sample(metrics, "fulmen_dead_letters_total", topic=spans_topic)
        return rows >= 5 and dead == 1

    await until(stored, "the spans stored and the poison record dead-lettered, as /metrics says")
    # 4 records (an OTLP request of one trace is one record) besides the poison one, which is not stored
    assert await sample(metrics, "fulmen_consumer_records_total", sink="spans", topic=spans_topic) >= 4
    assert await sample(metrics, "fulmen_consumer_batch_records_count", sink="spans") >= 1

    async def caught_up() -> bool:
        lags = [await sample(metrics, "fulmen_consumer_lag_records", sink="spans", topic=spans_topic)]
        text = (await httpx.AsyncClient().get(metrics)).text
        return lags == [0.0] and f'sink="spans",topic="{spans_topic}"' in text

    await until(caught_up, "the spans sink's lag reported, and 0 once it stored everything")


async def test_the_runner_counts_its_rollouts(settings: FulmenSettings, tmp_path: Path) -> None:
    port = free_port()
    options = RunnerSettings(
        home=settings.home,
        kafka=settings.kafka.model_dump(),
        clickhouse=settings.clickhouse.model_dump(),
        metrics={"port": port},
        runner={"agent": "tests.agents.simple:flaky", "concurrency": 2, "otlp_endpoint": "", "retry_backoff_s": 0},
    )
    url = f"http://127.0.0.1:{port}/metrics"
    requests = [  # each fails its first attempt, then succeeds
        RolloutRequest(
            rollout_id=r, task_id=f"task-{r}", group_id="g1", input={"dir": str(tmp_path), "name": r}, max_attempts=2
        )
        for r in ("r-1", "r-2")
    ]
    stop = asyncio.Event()
    runner = Runner(options, load_agent(options.runner.agent))
    running = asyncio.create_task(runner.run(stop))
    try:
        await until(lambda: _answers(url), "the runner's metrics listener")
        names = ("started_total", "finished_total", "retried_total")
        counted = {name: await sample(url, f"fulmen_runner_rollouts_{name}") for name in names}  # earlier tests'
        succeeded = await sample(url, "fulmen_runner_rollouts_finished_total", status="succeeded")
        await submit(settings, requests)
        await wait_terminal(settings, {"r-1", "r-2"}, final=2)

        async def moved(name: str) -> float:
            return await sample(url, f"fulmen_runner_rollouts_{name}") - counted[name]

        async def all_ended() -> bool:
            return await moved("finished_total") == 4

        await until(all_ended, "four attempts ended, as the runner's /metrics says")
        assert await moved("started_total") == 4 and await moved("retried_total") == 2
        assert await sample(url, "fulmen_runner_rollouts_finished_total", status="succeeded") - succeeded == 2
        assert await sample(url, "fulmen_runner_rollouts_in_flight") == 0
    finally:
        stop.set()
        await asyncio.wait_for(running, 60)


def board_queries() -> list[str]:
    """The PromQL of every panel of deploy/grafana/fulmen.json, Grafana's ``$__rate_interval`` made a duration."""
    board = json.loads((ALERTS.parents[1] / "grafana" / "fulmen.json").read_text())
    exprs = [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]
    return [expr.replace("$__rate_interval", "1m") for expr in exprs]


def _prometheus() -> Path:
    if shutil.which("go") is None and not cached_prometheus().is_file():
        pytest.skip("Prometheus is built with Go (make test builds it): no Go toolchain here")
    return build_prometheus()


async def test_prometheus_scrapes_the_consumers_and_promql_reads_their_lag(
    settings: FulmenSettings, linked_store: Store, tmp_path: Path
) -> None:
    binary = await asyncio.to_thread(_prometheus)
    settings = with_metrics(settings)
    spans_topic = topic_name(TopicKey.SPANS, settings.kafka.topic_prefix)
    stop, ready = asyncio.Event(), asyncio.Event()
    app = ConsumersApp(settings, linked_store, consume_sinks(settings), ConsumerOptions(max_wait_s=0.1))
    consuming = asyncio.create_task(app.run(stop, ready))
    await asyncio.wait_for(ready.wait(), 60)
    target = f"http://127.0.0.1:{settings.metrics.port}/metrics"
    server = PrometheusServer(tmp_path / "prometheus", [target], rule_files=[ALERTS], binary=binary)
    await asyncio.to_thread(server.start)
    try:
        async with gateway_running(settings) as otlp:
            async with httpx.AsyncClient(timeout=30) as client:
                answer = await client.post(
                    f"http://127.0.0.1:{otlp.port}/v1/traces",
                    content=encode([FakeSpan("step", "r-prom")], BASE_NS),
                    headers={"Content-Type": "application/x-protobuf"},
                )
                assert answer.status_code == 200, answer.text

            async def lag_series() -> list:
                query = f'sum by (topic) (fulmen_consumer_lag_records{{sink="spans", topic="{spans_topic}"}})'
                found = await asyncio.to_thread(server.query, query)
                stored = await asyncio.to_thread(server.query, 'fulmen_consumer_rows_stored_total{sink="spans"}')
                done = found and stored and float(stored[0]["value"][1]) >= 1
                return found if done and float(found[0]["value"][1]) == 0 else []

            [series] = await until(lag_series, "PromQL over the scraped lag: the spans topic, caught up", 90)
            assert series["metric"] == {"topic": spans_topic}
            assert await asyncio.to_thread(server.targets_up) == {target: "up"}
            [group] = await asyncio.to_thread(server.rules)  # the alerting rules the docs give, as Prometheus read them
            assert {rule["name"] for rule in group["rules"]} >= {"FulmenConsumerLagGrowing", "FulmenDeadLetters"}
            for expr in board_queries():  # every panel of the Grafana board is a query this Prometheus accepts
                await asyncio.to_thread(server.query, expr)
    finally:
        server.stop()
        stop.set()
        await asyncio.wait_for(consuming, 60)
