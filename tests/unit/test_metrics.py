"""Prometheus metrics without a broker: the routes as labels, the listener, the trainer's step metrics, what
`fulmen status` reads from a scrape, and the settings."""

from __future__ import annotations

import socket

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import REGISTRY

from fulmen.algorithm.service.metrics import observe_step
from fulmen.cli import activity as activity_module
from fulmen.infra.metrics import MetricsListener, add_metrics_route, add_probe, remove_probe
from fulmen.infra.settings import FulmenSettings, MetricsSettings
from fulmen.producers.metrics import request_metrics_middleware
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import TrainStep


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_requests_are_counted_by_the_route_they_took_not_by_their_ids() -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def refuse(request: web.Request) -> web.Response:
        raise web.HTTPBadRequest(text="no")

    app = web.Application(middlewares=[request_metrics_middleware("unit")])
    for prefix in ("", "/rollout/{rollout_id}/attempt/{attempt}"):
        app.router.add_post(f"{prefix}/v1/chat/completions", ok)
    app.router.add_post("/v1/refuse", refuse)
    app.router.add_get("/healthz", ok)
    add_metrics_route(app)
    route = "/v1/chat/completions"
    before = value("fulmen_gateway_requests_total", gateway="unit", route=route, status="200")
    async with TestClient(TestServer(app)) as client:
        for path in (
            "/v1/chat/completions",
            "/rollout/r-1/attempt/1/v1/chat/completions",
            "/rollout/r-2/attempt/3/v1/chat/completions",
        ):
            assert (await client.post(path)).status == 200
        assert (await client.post("/v1/refuse")).status == 400
        assert (await client.get("/nowhere")).status == 404
        assert (await client.get("/healthz")).status == 200
        text = await (await client.get("/metrics")).text()
    assert value("fulmen_gateway_requests_total", gateway="unit", route=route, status="200") - before == 3
    assert value("fulmen_gateway_requests_total", gateway="unit", route="/v1/refuse", status="400") >= 1
    assert value("fulmen_gateway_requests_total", gateway="unit", route="unmatched", status="404") >= 1
    assert value("fulmen_gateway_request_duration_seconds_count", gateway="unit", route=route) >= 3
    assert value("fulmen_gateway_requests_in_flight", gateway="unit") == 0
    assert 'route="/healthz"' not in text and "r-1" not in text  # probes are not counted; no id is a label


async def test_the_listener_serves_metrics_awaits_probes_and_says_when_its_port_is_taken() -> None:
    probed = []

    async def probe() -> None:
        probed.append(1)

    handle = add_probe(probe)
    try:
        async with MetricsListener("127.0.0.1", 0, what="unit") as listener:
            async with httpx.AsyncClient() as client:
                answer = await client.get(f"http://127.0.0.1:{listener.port}/metrics")
                assert (await client.get(f"http://127.0.0.1:{listener.port}/healthz")).status_code == 200
            assert answer.status_code == 200 and "process_start_time_seconds" in answer.text
            assert probed
            with socket.socket() as taken:
                taken.bind(("127.0.0.1", 0))
                taken.listen()
                with pytest.raises(ConfigurationError, match="FULMEN_METRICS_PORT"):
                    await MetricsListener("127.0.0.1", taken.getsockname()[1], what="unit").start()
    finally:
        remove_probe(handle)


def test_a_listener_only_where_a_port_is_set_and_metrics_are_on(monkeypatch: pytest.MonkeyPatch) -> None:
    assert MetricsListener.from_settings(MetricsSettings(), what="x") is None
    assert MetricsListener.from_settings(MetricsSettings(port=9464, enabled=False), what="x") is None
    monkeypatch.setenv("FULMEN_METRICS_PORT", "9464")
    listener = MetricsListener.from_settings(FulmenSettings().metrics, what="x")
    assert listener is not None and (listener.host, listener.port) == ("127.0.0.1", 9464)


def test_a_training_step_is_counted_timed_and_its_scores_kept() -> None:
    steps = value("fulmen_train_steps_total")
    refused = value("fulmen_train_promotions_total", decision="refuse")
    event = TrainStep(
        run_id="run-unit",
        step=4,
        model_version=4,
        num_transitions=12,
        num_groups=3,
        reward_mean=0.25,
        reward_std=0.1,
        loss=0.5,
        rollout_wait_s=7.0,
        train_s=2.0,
        publish_s=0.5,
        extra={"input_tokens": 300.0, "val_accuracy": 0.625, "promoted": 0.0},
    )
    observe_step(event)
    assert value("fulmen_train_steps_total") - steps == 1
    assert value("fulmen_train_model_version") == 4 and value("fulmen_train_reward_mean") == 0.25
    assert value("fulmen_train_heldout_accuracy") == 0.625
    assert value("fulmen_train_promotions_total", decision="refuse") - refused == 1
    assert value("fulmen_train_step_phase_seconds_count", phase="generation") >= 1
    assert value("fulmen_train_last_publish_timestamp_seconds") > 0


SCRAPE = """\
# TYPE fulmen_gateway_requests_total counter
fulmen_gateway_requests_total{gateway="llm",route="/v1/chat/completions",status="200"} 90.0
fulmen_gateway_requests_total{gateway="llm",route="/v1/chat/completions",status="503"} 10.0
fulmen_gateway_requests_total{gateway="llm",route="/v1/feedback",status="202"} 5.0
# TYPE fulmen_llm_model_version gauge
fulmen_llm_model_version{model="fulmen"} 7.0
# TYPE fulmen_consumer_lag_records gauge
fulmen_consumer_lag_records{sink="spans",topic="otlp_spans",partition="0"} 3.0
fulmen_consumer_lag_records{sink="rollouts",topic="fulmen.rollouts",partition="1"} 4.0
# TYPE fulmen_dead_letters_total counter
fulmen_dead_letters_total{topic="otlp_spans",reason="DecodeError"} 2.0
# TYPE fulmen_consumer_rows_stored_total counter
fulmen_consumer_rows_stored_total{sink="spans"} 1500.0
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1000.0
"""


def test_status_says_what_the_metrics_say(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(activity_module, "scrape", lambda url, timeout_s=2.0: SCRAPE)
    assert activity_module.activity("llm-gateway", "http://x/metrics", now=1100.0) == "100 calls (1.0/s), model v7"
    assert activity_module.activity("consume", "http://x/metrics", now=1100.0) == (
        "1,500 rows stored (15.0/s), lag 7, 2 dead letters"
    )
    assert activity_module.activity("dashboard", None) == "-"
    monkeypatch.setattr(activity_module, "scrape", lambda url, timeout_s=2.0: None)
    assert activity_module.activity("consume", "http://x/metrics") == "no metrics"


def test_the_board_and_the_alerts_use_only_metrics_fulmen_exports() -> None:
    import re
    from pathlib import Path

    import fulmen.consumers.metrics
    import fulmen.infra.kafka.dlq  # noqa: F401 (their metrics register on import)

    deploy = Path(__file__).parents[2] / "deploy"
    known = {
        family.name + suffix
        for family in REGISTRY.collect()
        for suffix in ("", "_total", "_bucket", "_sum", "_count")
        if family.name.startswith("fulmen_")
    }
    board = (deploy / "grafana" / "fulmen.json").read_text()
    alerts = (deploy / "prometheus" / "alerts.yml").read_text()
    used = set(re.findall(r"\bfulmen_[a-z_]+", board + alerts))
    assert used and used <= known, sorted(used - known)
    assert "fulmen_consumer_lag_records" in used and "fulmen_dead_letters_total" in used
