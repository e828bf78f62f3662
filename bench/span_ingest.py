"""Span ingestion end to end: concurrent OTLP/HTTP exporters -> gateway -> Kafka -> spans consumer -> ClickHouse.

Starts what it needs, as a deployment would: a local Kafka broker, `fulmen otlp-gateway` and
`fulmen consume --sink spans` in their own processes (the consumer owns a fresh embedded store). The load
comes from concurrent exporters posting OTLP protobuf batches of 512 spans (the SDK's default batch size),
each span ~1.2 KB with ~20 attributes; batches are encoded before the clock starts, so the load generator's
own encoding does not compete for the two cores.

Two latencies per batch: **export -> queryable** = when its last span became queryable (the row's IngestedAt) -
when its POST started; **request** = POST -> 200 (what the exporter waits for: the gateway answers once Kafka
acknowledged the batch). A warm-up (``--warmup-s`` of the same load, not counted) comes first, then
``--repetitions`` windows of ``--seconds``, each with its own fresh batches; the JSON has the medians at the top
level (``lost``, ``duplicated`` and ``refused_503`` summed over the windows), ``spread`` (min, max), ``runs`` and the
load average. Done = every span of the window queryable in ``fulmen.otel_traces``.

    .venv/bin/python bench/span_ingest.py [--seconds 10] [--exporters 4] [--batch 512] [--rate 25000]
        [--compression none|gzip|snappy|lz4|zstd]

``--compression`` sets the gateway's ``FULMEN_KAFKA_COMPRESSION`` (default: the setting's, zstd);
``kafka_bytes_per_span`` is the spans topic's log on disk per span, what the codec saves on the network and the
brokers' disks. ``consumer_peak_rss_mb`` is the consumers process's peak resident memory (``VmHWM``);
``consumer_memory_mb`` says what it is made of, sampled every 0.1 s: the peak of the anonymous memory (heap, the
engine's working memory) and, at the largest sample, the file-backed part (mostly the engine library's code);
``consumer_anon_peak_mb`` is that anonymous peak on its own (what the process itself holds, not the code).

``--metrics on`` (the default) has a Prometheus-like scraper read the gateway's and the consumers' ``/metrics``
every ``--scrape-s`` seconds while the windows run; ``--metrics off`` starts both with ``FULMEN_METRICS_ENABLED=false``
and scrapes nothing: run both, one after the other, to see what the metrics cost beside the run-to-run spread.

Prints one JSON object on the last line: ``spans_per_s``, ``p99_ms`` (export -> queryable), ``request_p99_ms``,
``lost``, ``duplicated``, ``compression``, ``kafka_bytes_per_span``, ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.anchor import ATTEMPT_ID_KEY, ROLLOUT_ID_KEY, AnchorStore
from bench.harness import (
    MemorySampler,
    ProcessCounters,
    add_env_option,
    fulmen_env,
    load_average,
    started_broker,
    summarise,
)
from bench.otlp_payloads import make_request
from fulmen.infra.kafka.admin import ensure_topics
from fulmen.infra.processes import free_port
from fulmen.infra.settings import FulmenSettings, KafkaSettings
from fulmen.infra.store import RemoteReader
from fulmen.schemas import TopicKey, topic_name


def encode_batches(
    count: int, size: int, prefix: str = "", resource: dict[str, str] | None = None
) -> list[tuple[str, bytes]]:
    """``count`` distinct batches (fresh ids, one marker ``<prefix>b<i>`` each) made by patching one template;
    ``resource`` adds string resource attributes (the anchor files spans by its rollout and attempt ids)."""
    template = make_request(size, seed=7)
    for key, value in (resource or {}).items():
        attribute = template.resource_spans[0].resource.attributes.add()
        attribute.key = key
        attribute.value.string_value = value
    spans = template.resource_spans[0].scope_spans[0].spans
    marker_index = next(i for i, kv in enumerate(spans[0].attributes) if kv.key == "bench.marker")
    batches = []
    for b in range(count):
        marker = f"{prefix}b{b}"
        for i, span in enumerate(spans):
            if i % 10 == 0:
                trace_id = os.urandom(16)
            span.trace_id = trace_id
            span.span_id = os.urandom(8)
            span.attributes[marker_index].value.string_value = marker
        batches.append((marker, template.SerializeToString()))
    return batches


def peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


async def send_all(
    url: str, batches: list[tuple[str, bytes]], exporters: int, seconds: float, rate: float | None, batch_spans: int
) -> tuple[dict, int, float, list[float]]:
    """Each exporter posts its next batch when the previous one is answered (closed loop), or, with ``rate``,
    on a fixed schedule that offers ``rate`` spans/s in total (open loop: a slow system falls behind it)."""
    sent: dict[str, float] = {}
    answered: list[float] = []  # POST -> 200, seconds
    refused = 0
    queue = iter(batches)
    begin = time.monotonic()
    deadline = begin + seconds
    headers = {"Content-Type": "application/x-protobuf"}
    interval = None if rate is None else batch_spans / rate
    scheduled = 0

    async def exporter(session: aiohttp.ClientSession) -> None:
        nonlocal refused, scheduled
        for marker, body in queue:
            if interval is not None:
                due = begin + scheduled * interval
                scheduled += 1
                await asyncio.sleep(max(0.0, due - time.monotonic()))
            if time.monotonic() > deadline:
                return
            while True:
                started = time.time()
                async with session.post(url, data=body, headers=headers) as response:
                    await response.read()
                    if response.status == 200:
                        sent[marker] = started
                        answered.append(time.time() - started)
                        break
                    refused += 1
                    await asyncio.sleep(float(response.headers.get("Retry-After", "1")))

    started = time.time()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(exporter(session) for _ in range(exporters)))
    return sent, refused, started, answered


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0, help="each measured window")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--exporters", type=int, default=4)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--max-rate", type=float, default=60_000, help="spans/s the pre-encoded batches can cover")
    parser.add_argument(
        "--rate", type=float, default=None, help="offer this many spans/s (open loop); default: as fast as answered"
    )
    parser.add_argument(
        "--compression",
        choices=("none", "gzip", "snappy", "lz4", "zstd"),
        help="FULMEN_KAFKA_COMPRESSION of the gateway (default: the setting's default)",
    )
    parser.add_argument("--no-anchor", action="store_true", help="skip Agent Lightning 0.3.0 (bench/anchor.py)")
    parser.add_argument("--syscalls", action="store_true", help="count each process's system calls (perf stat)")
    parser.add_argument("--metrics", choices=("on", "off"), default="on", help="Prometheus metrics, scraped while on")
    parser.add_argument("--scrape-s", type=float, default=1.0, help="how often /metrics is scraped (--metrics on)")
    add_env_option(parser)
    args = parser.parse_args()
    args.compression = args.compression or KafkaSettings().compression

    home, broker = started_broker("fulmen-bench-")
    gateway_port, read_port = free_port(), free_port()
    env = fulmen_env(
        broker.bootstrap,
        home,
        args.env,
        FULMEN_CLICKHOUSE_READ_PORT=str(read_port),
        FULMEN_OTLP_PORT=str(gateway_port),
        FULMEN_KAFKA_COMPRESSION=args.compression,
        FULMEN_METRICS_ENABLED="true" if args.metrics == "on" else "false",
    )
    asyncio.run(ensure_topics(FulmenSettings(kafka={"bootstrap": broker.bootstrap})))
    fulmen = [sys.executable, "-m", "fulmen.cli.main"]
    logs = {name: open(home / f"{name}.log", "wb") for name in ("gateway", "consume")}  # noqa: SIM115
    gateway = subprocess.Popen([*fulmen, "otlp-gateway"], env=env, stdout=logs["gateway"], stderr=subprocess.STDOUT)
    consume = subprocess.Popen(
        [*fulmen, "consume", "--sink", "spans"], env=env, stdout=logs["consume"], stderr=subprocess.STDOUT
    )
    try:
        print(f"logs in {home}", file=sys.stderr)
        reader = wait_for(lambda: RemoteReader.find("127.0.0.1", read_port), 120, "the consumers' read endpoint")
        url = f"http://127.0.0.1:{gateway_port}/v1/traces"
        wait_for(lambda: _ready(gateway_port), 60, "the gateway")
        pids = {"gateway": gateway.pid, "consumer": consume.pid, "kafka": broker.status().pid or 0, "load": os.getpid()}
        with contextlib.ExitStack() as stack:
            anchor = None if args.no_anchor else stack.enter_context(AnchorStore(free_port(), home / "anchor.log"))
            memory = stack.enter_context(MemorySampler(consume.pid))
            targets = [f"http://127.0.0.1:{port}/metrics" for port in (gateway_port, read_port)]
            scraper = stack.enter_context(Scraper(targets, args.scrape_s)) if args.metrics == "on" else None
            window(reader, url, args, "w-", args.warmup_s, pids)
            if anchor:
                anchor_window(anchor, args, "aw-", args.warmup_s)
            load = load_average()
            runs, anchor_runs = [], []
            for rep in range(args.repetitions):  # interleaved: Fulmen, anchor, Fulmen, anchor, ...
                runs.append(window(reader, url, args, f"r{rep}-", args.seconds, pids))
                if anchor:
                    anchor_runs.append(anchor_window(anchor, args, f"ar{rep}-", args.seconds))
        report = summarise(runs, load, totals=("lost", "duplicated", "refused_503"))
        if anchor_runs:
            anchor_report = summarise(anchor_runs, load)
            report["anchor"] = anchor_report
            report["anchor_spans_per_s"] = anchor_report["spans_per_s"]
            report["ratio_spans"] = round(report["spans_per_s"] / anchor_report["spans_per_s"], 2)
        report["consumer_peak_rss_mb"] = round(peak_rss_mb(consume.pid) + children_peak_rss_mb(consume.pid), 1)
        report["consumer_memory_mb"] = memory.peaks()  # what the peak is made of: anonymous, file-backed (code)
        report["consumer_anon_peak_mb"] = report["consumer_memory_mb"]["peak_anon_mb"]  # the process's own memory
        report["peak_rss_mb"] = {
            "gateway": peak_rss_mb(gateway.pid),
            "consumer": peak_rss_mb(consume.pid),
            "kafka": peak_rss_mb(broker.status().pid or 0),
        }
        # the spans topic's log on disk (record batches as produced) per span of all windows and the warm-up
        log_bytes = sum(f.stat().st_size for f in broker.logs_dir.glob(f"{topic_name(TopicKey.SPANS, '')}-*/*.log"))
        all_spans = reader.query("SELECT count() FROM fulmen.otel_traces", final=False).rows[0][0]
        report |= {
            "metrics": args.metrics,
            "scrapes": scraper.scrapes if scraper else 0,
            "compression": args.compression,
            "kafka_bytes_per_span": round(log_bytes / max(all_spans, 1), 1),
            "offered_rate": args.rate or "closed loop",
            "exporters": args.exporters,
            "batch": args.batch,
            "seconds": args.seconds,
            "span_bytes": 1200,
            "done": "every span of the window queryable in fulmen.otel_traces",
        }
    finally:
        for process in (gateway, consume):
            process.send_signal(signal.SIGTERM)
        for process in (gateway, consume):
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
        broker.stop()
    report["env"] = args.env
    print(json.dumps(report))


class Scraper:
    """Reads ``targets`` every ``every_s`` seconds on a thread, as Prometheus would (a context manager)."""

    def __init__(self, targets: list[str], every_s: float) -> None:
        self.targets, self.every_s = targets, every_s
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scraper", daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            while not self._stop.wait(self.every_s):
                for target in self.targets:
                    if client.get(target).status_code == 200:
                        self.scrapes += 1

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def window(
    reader: RemoteReader, url: str, args: argparse.Namespace, prefix: str, seconds: float, pids: dict[str, int]
) -> dict:
    """One window of load with fresh batches (markers ``<prefix>b<i>``), until all its spans are queryable."""
    count = int(args.max_rate * seconds / args.batch) + args.exporters
    print(f"{prefix}: encoding {count} batches of {args.batch} spans...", file=sys.stderr, flush=True)
    batches = encode_batches(count, args.batch, prefix)
    # the wait polls a plain count (cheap for the store, which shares the consumer's process) of all windows so far
    before = reader.query("SELECT count() FROM fulmen.otel_traces", final=False).rows[0][0]
    counters = ProcessCounters(pids, syscalls=args.syscalls)
    sent, refused, t0, answered = asyncio.run(send_all(url, batches, args.exporters, seconds, args.rate, args.batch))
    send_end = time.time()
    total = len(sent) * args.batch
    mine = f"startsWith(SpanAttributes['bench.marker'], '{prefix}')"
    stored = wait_stored(reader, before + total, timeout_s=180) - before
    rows = reader.query(
        "SELECT SpanAttributes['bench.marker'] AS m, count(), toUnixTimestamp64Milli(max(IngestedAt)) "
        f"FROM fulmen.otel_traces WHERE {mine} GROUP BY m"
    ).rows
    doubled = reader.query(
        f"SELECT count() FROM (SELECT 1 FROM fulmen.otel_traces WHERE {mine} GROUP BY TraceId, SpanId "
        "HAVING count() > 1)"
    ).rows[0][0]
    per_span = counters.per(total, "span")
    result = summarize(sent, rows, args, t0, send_end, total, stored, doubled, refused, answered)
    # Where the time goes, per stored span and process: CPU (2 cores = 2 s of CPU per second), context switches and
    # (with --syscalls) system calls.
    result |= per_span
    print(f"{prefix}: {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


def anchor_window(anchor: AnchorStore, args: argparse.Namespace, prefix: str, seconds: float) -> dict:
    """The same load against the anchor's OTLP endpoint, until its store holds every span (``total_spans``)."""
    count = int(args.max_rate * seconds / args.batch) + args.exporters
    rollout_id, attempt_id = anchor.start_rollout()
    batches = encode_batches(count, args.batch, prefix, {ROLLOUT_ID_KEY: rollout_id, ATTEMPT_ID_KEY: attempt_id})
    before = anchor.total_spans()
    sent, refused, t0, answered = asyncio.run(
        send_all(anchor.traces_url, batches, args.exporters, seconds, args.rate, args.batch)
    )
    send_end = time.time()
    total = len(sent) * args.batch
    deadline = time.monotonic() + 180
    while (stored := anchor.total_spans() - before) < total and time.monotonic() < deadline:
        time.sleep(0.25)
    done = time.time()
    requests = sorted(1000 * s for s in answered)
    result = {
        "spans_per_s": round(total / (done - t0), 1),
        "accepted_spans_per_s": round(total / (send_end - t0), 1),
        "request_p50_ms": round(requests[len(requests) // 2], 1) if requests else -1.0,
        "request_p99_ms": round(requests[min(len(requests) - 1, int(0.99 * len(requests)))], 1) if requests else -1.0,
        "spans_sent": total,
        "spans_stored": stored,
        "refused": refused,
        "peak_rss_mb": peak_rss_mb(anchor.pid),
    }
    print(f"anchor {prefix}: {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


def children_peak_rss_mb(pid: int) -> float:
    """Peak RSS of the direct children of ``pid`` (the consumers process starts none today; counted if it does)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return 0.0
    return sum(peak_rss_mb(int(child)) for child in children)


def _ready(port: int) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(probe, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.2)
    raise SystemExit(f"{what} did not come up within {timeout_s:.0f}s")


def wait_stored(reader: RemoteReader, total: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    stored = 0
    while time.monotonic() < deadline:
        stored = reader.query("SELECT count() FROM fulmen.otel_traces", final=False).rows[0][0]
        if stored >= total:
            break
        time.sleep(0.25)
    return stored


def summarize(sent, rows, args, t0, send_end, total, stored, doubled, refused, answered) -> dict:
    by_marker = {m: (n, ms / 1000) for m, n, ms in rows}
    latencies = sorted((by_marker[m][1] - at) * 1000 for m, at in sent.items() if m in by_marker)
    last_queryable = max((by_marker[m][1] for m in sent if m in by_marker), default=send_end)
    complete = sum(1 for m in sent if m in by_marker and by_marker[m][0] == args.batch)

    requests = sorted(1000 * seconds for seconds in answered)

    def pct(p: float, values: list[float] = latencies) -> float:
        return round(values[min(len(values) - 1, int(p * len(values)))], 1) if values else -1.0

    return {
        "spans_per_s": round(total / (last_queryable - t0), 1),
        "accepted_spans_per_s": round(total / (send_end - t0), 1),
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "max_ms": round(latencies[-1], 1) if latencies else -1.0,
        "request_p50_ms": pct(0.50, requests),
        "request_p99_ms": pct(0.99, requests),
        "spans_sent": total,
        "spans_stored": stored,
        "lost": max(0, total - stored),
        "duplicated": doubled,
        "batches_complete": complete,
        "refused_503": refused,
    }


if __name__ == "__main__":
    main()
