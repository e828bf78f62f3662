"""What the LLM gateway adds to an LLM call: latency per call and the most calls/s, against calling the
backend directly.

Starts a Kafka broker, a trivial OpenAI-compatible upstream (``bench/upstream_stub.py``: an instant answer with
token ids, as vLLM gives them) and ``fulmen llm-gateway --backend vllm`` in front of it, each its own process.
Then, with 1 and with 16 concurrent clients (closed loop, aiohttp, keep-alive), calls the upstream directly and
through the gateway for ``--seconds`` each. Through the gateway every call is parsed, forwarded, turned into a
span with its token ids and published to the spans topic, acknowledged by Kafka (acks=all) before the answer;
done = the answer received. A warm-up pass (2 s of each, not counted) comes first, then ``--repetitions`` passes;
the JSON has the medians at the top level, ``spread`` (min, max), ``runs`` and the load average.

What the Prometheus metrics cost per call is measured in the same run: a second gateway, the same but with
``FULMEN_METRICS_ENABLED=false``, gets the same passes, interleaved (``metrics_off`` in the JSON, and
``metrics_cost``: on minus off; ``--no-metrics-off`` skips it).

    .venv/bin/python bench/gateway_overhead.py [--seconds 10] [--repetitions 3]

Prints one JSON object on its last line: ``added_p50_ms_c1``, ``added_p99_ms_c1``, ``calls_per_s_c16``,
``direct_calls_per_s_c16``... and CPU per call by process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.anchor import AnchorLLMProxy, AnchorStore
from bench.harness import ProcessCounters, add_env_option, fulmen_env, load_average, started_broker, summarise
from bench.span_ingest import _ready, free_port, peak_rss_mb, wait_for
from fulmen.infra.kafka.admin import ensure_topics
from fulmen.infra.settings import FulmenSettings

BODY = {
    "model": "fulmen",
    "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}],
    "max_tokens": 8,
}


async def load(url: str, clients: int, seconds: float) -> dict:
    latencies: list[float] = []
    errors = 0
    deadline = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=clients)

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        while time.monotonic() < deadline:
            started = time.perf_counter()
            async with session.post(url, json=BODY) as response:
                await response.read()
                if response.status != 200:
                    errors += 1
                    continue
            latencies.append(time.perf_counter() - started)

    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(20):  # warm the connections and the code paths
            async with session.post(url, json=BODY) as response:
                await response.read()
        began = time.monotonic()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        elapsed = time.monotonic() - began
    latencies.sort()
    return {
        "calls_per_s": len(latencies) / elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
        "calls": len(latencies),
        "errors": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--no-anchor", action="store_true", help="skip Agent Lightning 0.3.0 (bench/anchor.py)")
    parser.add_argument("--syscalls", action="store_true", help="count each process's system calls (perf stat)")
    parser.add_argument("--no-metrics-off", action="store_true", help="skip the gateway without Prometheus metrics")
    add_env_option(parser)
    args = parser.parse_args()
    home, broker = started_broker("fulmen-bench-gw-")
    upstream_port, gateway_port, off_port = free_port(), free_port(), free_port()
    env = fulmen_env(
        broker.bootstrap,
        home,
        args.env,
        FULMEN_LLM_PORT=str(gateway_port),
        FULMEN_LLM_BACKEND="vllm",
        FULMEN_LLM_MODEL="stub",
        FULMEN_LLM_UPSTREAM_URL=f"http://127.0.0.1:{upstream_port}/v1",
    )
    asyncio.run(ensure_topics(FulmenSettings(kafka={"bootstrap": broker.bootstrap})))
    logs = {name: open(home / f"{name}.log", "wb") for name in ("upstream", "gateway", "gateway-off")}  # noqa: SIM115
    upstream = subprocess.Popen(
        [sys.executable, "-m", "bench.upstream_stub", str(upstream_port)],
        env=env,
        stdout=logs["upstream"],
        stderr=subprocess.STDOUT,
    )
    gateway = subprocess.Popen(
        [sys.executable, "-m", "fulmen.cli.main", "llm-gateway"],
        env=env,
        stdout=logs["gateway"],
        stderr=subprocess.STDOUT,
    )
    gateway_off = None
    if not args.no_metrics_off:
        gateway_off = subprocess.Popen(
            [sys.executable, "-m", "fulmen.cli.main", "llm-gateway"],
            env=env | {"FULMEN_LLM_PORT": str(off_port), "FULMEN_METRICS_ENABLED": "false"},
            stdout=logs["gateway-off"],
            stderr=subprocess.STDOUT,
        )
    report: dict = {}
    try:
        print(f"logs in {home}", file=sys.stderr)
        wait_for(lambda: _ready(gateway_port), 120, "the LLM gateway")
        if gateway_off is not None:
            wait_for(lambda: _ready(off_port), 120, "the LLM gateway without metrics")
        direct_url = f"http://127.0.0.1:{upstream_port}/v1/chat/completions"
        gateway_url = f"http://127.0.0.1:{gateway_port}/rollout/bench/attempt/1/v1/chat/completions"
        pids = {
            "gateway": gateway.pid,
            "upstream": upstream.pid,
            "kafka": broker.status().pid or 0,
            "load": os.getpid(),
        }
        urls = (direct_url, gateway_url)
        off_urls = (direct_url, gateway_url.replace(f":{gateway_port}/", f":{off_port}/"))
        off_pids = pids | {"gateway": gateway_off.pid} if gateway_off is not None else None
        with contextlib.ExitStack() as stack:
            anchor_urls = None
            if not args.no_anchor:
                store = stack.enter_context(AnchorStore(free_port(), home / "anchor.log"))
                proxy = stack.enter_context(
                    AnchorLLMProxy(free_port(), f"http://127.0.0.1:{upstream_port}/v1", store, home / "anchor.log")
                )
                anchor_urls = (direct_url, proxy.chat_url(*store.start_rollout()))
                anchor_pids = {"store": store.pid}  # the proxy serves from a child process of its own
            one_pass(urls, pids, 2.0)  # warm-up
            if anchor_urls:
                one_pass(anchor_urls, anchor_pids, 2.0)
            if off_pids:
                one_pass(off_urls, off_pids, 2.0)
            load_before = load_average()
            runs, anchor_runs, off_runs = [], [], []
            for rep in range(args.repetitions):  # interleaved: Fulmen, anchor, Fulmen without metrics, Fulmen, ...
                runs.append(one_pass(urls, pids, args.seconds, args.syscalls))
                print(f"#{rep + 1}: {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
                if off_pids:
                    off_runs.append(one_pass(off_urls, off_pids, args.seconds))
                    print(f"metrics off #{rep + 1}: {json.dumps(off_runs[-1])}", file=sys.stderr, flush=True)
                if anchor_urls:
                    anchor_runs.append(one_pass(anchor_urls, anchor_pids, args.seconds))
                    print(f"anchor #{rep + 1}: {json.dumps(anchor_runs[-1])}", file=sys.stderr, flush=True)
        report = summarise(runs, load_before, totals=("errors_c1", "errors_c16"))
        if anchor_runs:
            anchor = summarise(anchor_runs, load_before, totals=("errors_c1", "errors_c16"))
            report["anchor"] = anchor
            report |= {f"anchor_{key}": anchor[key] for key in ("added_p50_ms_c1", "calls_per_s_c16", "errors_c16")}
            report["ratio_added_p50"] = round(anchor["added_p50_ms_c1"] / max(report["added_p50_ms_c1"], 1e-3), 2)
            report["ratio_calls_c16"] = round(report["calls_per_s_c16"] / max(anchor["calls_per_s_c16"], 1e-3), 2)
        if off_runs:
            report["metrics_off"] = summarise(off_runs, load_before, totals=("errors_c1", "errors_c16"))
            report["metrics_cost"] = metrics_cost(report, report["metrics_off"])
        report["env"] = args.env
        report["peak_rss_mb"] = {"gateway": peak_rss_mb(gateway.pid), "kafka": peak_rss_mb(broker.status().pid or 0)}
    finally:
        processes = [p for p in (gateway, gateway_off, upstream) if p is not None]
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        broker.stop()
    print(json.dumps(report))


def metrics_cost(on: dict, off: dict) -> dict:
    """What the metrics change, on minus off, beside each side's spread over the repetitions."""
    keys = ("added_p50_ms_c1", "added_p99_ms_c1", "calls_per_s_c16", "cpu_us_per_call_c16_gateway")
    cost = {key: round(on[key] - off[key], 3) for key in keys if key in on and key in off}
    cost["spread_on"] = {key: on["spread"][key] for key in keys if key in on.get("spread", {})}
    cost["spread_off"] = {key: off["spread"][key] for key in keys if key in off.get("spread", {})}
    return cost


def one_pass(urls: tuple[str, str], pids: dict[str, int], seconds: float, syscalls: bool = False) -> dict:
    """1 and 16 clients, each directly and through the gateway; the figures, CPU per call by process at 16."""
    direct_url, gateway_url = urls
    result: dict = {}
    for clients in (1, 16):
        direct = asyncio.run(load(direct_url, clients, seconds))
        counters = ProcessCounters(pids, syscalls=syscalls and clients == 16)
        through = asyncio.run(load(gateway_url, clients, seconds))
        if clients == 16:  # per call and process: CPU, context switches, system calls (with --syscalls)
            result |= counters.per(through["calls"], "call_c16")
        result |= {
            f"added_p50_ms_c{clients}": through["p50_ms"] - direct["p50_ms"],
            f"added_p99_ms_c{clients}": through["p99_ms"] - direct["p99_ms"],
            f"calls_per_s_c{clients}": through["calls_per_s"],
            f"direct_calls_per_s_c{clients}": direct["calls_per_s"],
            f"gateway_p50_ms_c{clients}": through["p50_ms"],
            f"gateway_p99_ms_c{clients}": through["p99_ms"],
            f"direct_p50_ms_c{clients}": direct["p50_ms"],
            f"errors_c{clients}": through["errors"] + direct["errors"],
        }
    return {key: round(value, 3) if isinstance(value, float) else value for key, value in result.items()}


if __name__ == "__main__":
    main()
