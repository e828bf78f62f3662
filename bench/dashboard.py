"""How fast the dashboard's pages load on a store of 100k spans: their API calls, and the pages in Chromium.

Fills a fresh embedded store (``bench/dashboard_data.py``: a run of 30 steps, rollouts of 3 LLM calls = 9 spans
each, their lifecycle rows and transitions, 500 dead letters), serves it as ``fulmen consume`` does (the read
endpoint) and the dashboard over it (reading through the endpoint, as ``fulmen dashboard`` does), then per page:

* ``api``: the API calls the page makes when it opens, one after the other (what it waits for), timed with
  httpx, ``--repeat`` times;
* ``browser``: Debian's Chromium (Playwright) opens the page: ``load`` = navigation to the load event,
  ``drawn`` = until its data is on the page (the table or the trace), ``--browser-repeat`` times.

Prints one JSON line: p50/p95 in milliseconds per page for each, and the store's size. Target: under a second.

    .venv/bin/python bench/dashboard.py [--spans 100000] [--repeat 20] [--browser-repeat 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.dashboard_data import fill_store
from fulmen.dashboard import Dashboard, DashboardQueries
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import RemoteReader, Store
from fulmen.testing.served import Served, ServedEndpoint

CALLS = 3
SPANS_PER_ROLLOUT = 3 + 2 * CALLS


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"p50_ms": round(statistics.median(ordered) * 1000, 1), "p95_ms": round(p95 * 1000, 1)}


def pages(run_id: str, rollout: str) -> dict[str, tuple[str, list[str], str]]:
    """page -> (its path, the API calls it makes on opening, the selector that shows its data is drawn)."""
    failed = "status=failed&mode=train&attempt=1"
    return {
        "runs": ("/", ["/api/runs", f"/api/steps?run={run_id}"], "#versions-table"),
        "rollouts": ("/rollouts", ["/api/rollouts?limit=50"], "#rollouts-table tbody tr"),
        "rollouts_filtered": (f"/rollouts?{failed}", [f"/api/rollouts?{failed}&limit=50"], "#rollouts-table tbody tr"),
        "rollout": (f"/rollout?id={rollout}", [f"/api/rollout?id={rollout}"], ".span-row"),
        "dead_letters": ("/dead-letters", ["/api/dead-letters?limit=100"], "#dead-table tbody tr"),
    }


def time_api(base: str, calls: list[str], repeat: int) -> list[float]:
    samples = []
    with httpx.Client(base_url=base, timeout=60) as client:
        for _ in range(repeat + 1):  # the first warms the handles up and is not counted
            started = time.perf_counter()
            for call in calls:
                client.get(call).raise_for_status()
            samples.append(time.perf_counter() - started)
    return samples[1:]


def time_browser(base: str, plan: dict[str, tuple[str, list[str], str]], repeat: int) -> dict[str, dict]:
    from playwright.sync_api import sync_playwright

    found: dict[str, dict] = {}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        page = browser.new_page()
        for name, (path, _, drawn_selector) in plan.items():
            loads, drawn = [], []
            for index in range(repeat + 1):
                started = time.perf_counter()
                page.goto(base + path, wait_until="load")
                loaded = time.perf_counter()
                page.wait_for_selector(drawn_selector, timeout=60_000)
                if index:  # the first run warms the browser's cache up
                    loads.append(loaded - started)
                    drawn.append(time.perf_counter() - started)
            found[name] = {"load": percentiles(loads), "drawn": percentiles(drawn)}
        browser.close()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--browser-repeat", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fulmen-bench-dashboard-") as home:
        settings = FulmenSettings(home=Path(home), clickhouse={"path": Path(home) / "chdb", "read_port": 0})
        store = Store.open(settings)
        store.migrate()
        started = time.perf_counter()
        filled = fill_store(store, rollouts=args.spans // SPANS_PER_ROLLOUT, calls=CALLS, steps=30, dead_letters=500)
        fill_s = time.perf_counter() - started
        rollout = next(r for r, _, status in filled.rollouts if status == "succeeded")
        plan = pages(filled.run_id, rollout)
        with ServedEndpoint(store) as reads:
            dashboard = Dashboard(DashboardQueries(RemoteReader(reads.url)), "127.0.0.1", 0, poll_s=60.0)
            with Served(dashboard.start, dashboard.stop):
                api = {
                    name: percentiles(time_api(dashboard.url, calls, args.repeat))
                    for name, (_, calls, _) in plan.items()
                }
                browser = time_browser(dashboard.url, plan, args.browser_repeat)
        store.close()
    worst = max([v["p95_ms"] for v in api.values()] + [v["drawn"]["p95_ms"] for v in browser.values()])
    print(
        json.dumps(
            {
                "spans": filled.spans,
                "rollouts": len(filled.rollouts),
                "steps": filled.steps,
                "dead_letters": filled.dead_letters,
                "fill_s": round(fill_s, 1),
                "api": api,
                "browser": browser,
                "worst_p95_ms": worst,
                "under_a_second": worst < 1000,
            }
        )
    )


if __name__ == "__main__":
    main()
