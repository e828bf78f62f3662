"""What ``fulmen status`` says a service is doing, read from its Prometheus metrics (its ``/metrics``).

One short line per service: the LLM gateway's calls and the model version it serves, the OTLP gateway's spans,
the consumers' rows stored, lag and dead letters. Rates are averages since the service started (its
``process_start_time_seconds``); for rates over the last minutes, point Prometheus at the same URLs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["activity", "metric_sums", "scrape"]

_CALL_ROUTES = ("/v1/chat/completions", "/v1/completions")


def scrape(url: str, timeout_s: float = 2.0) -> str | None:
    """The metrics text at ``url``, or None when it does not answer 200."""
    try:
        response = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


def metric_sums(text: str, wanted: Iterable[str]) -> dict[str, float]:
    """Each sample name of ``wanted`` summed over its labels (a counter's name with its ``_total``)."""
    sums: dict[str, float] = {}
    names = set(wanted)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names and _counted(sample.name, sample.labels):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def _counted(name: str, labels: dict[str, str]) -> bool:
    if name == "fulmen_gateway_requests_total":
        return labels.get("route") in _CALL_ROUTES
    if name == "fulmen_otlp_spans_total":
        return labels.get("outcome") == "accepted"
    return True


def activity(service: str, metrics_url: str | None, now: float | None = None) -> str:
    """One line on what ``service`` did since it started, or '-' when it has no metrics to read."""
    if not metrics_url:
        return "-"
    text = scrape(metrics_url)
    if text is None:
        return "no metrics"
    sums = metric_sums(
        text,
        (
            "fulmen_gateway_requests_total",
            "fulmen_llm_model_version",
            "fulmen_otlp_spans_total",
            "fulmen_consumer_rows_stored_total",
            "fulmen_consumer_lag_records",
            "fulmen_dead_letters_total",
            "process_start_time_seconds",
        ),
    )
    started = sums.get("process_start_time_seconds")
    up_s = max((now or time.time()) - started, 1.0) if started else None

    def counted(value: float, what: str) -> str:
        rate = f" ({value / up_s:.1f}/s)" if up_s else ""
        return f"{value:,.0f} {what}{rate}"

    if service == "llm-gateway":
        line = counted(sums.get("fulmen_gateway_requests_total", 0.0), "calls")
        version = sums.get("fulmen_llm_model_version")
        return line if version is None else f"{line}, model v{version:.0f}"
    if service == "otlp-gateway":
        return counted(sums.get("fulmen_otlp_spans_total", 0.0), "spans")
    if service == "consume":
        rows = counted(sums.get("fulmen_consumer_rows_stored_total", 0.0), "rows stored")
        lag, dead = sums.get("fulmen_consumer_lag_records", 0.0), sums.get("fulmen_dead_letters_total", 0.0)
        return f"{rows}, lag {lag:,.0f}, {dead:,.0f} dead letters"
    return "-"
