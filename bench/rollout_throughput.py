"""Rollouts per second through the runner, done = the terminal state queryable in the store, as a user sees it.

Starts what a deployment runs: a local Kafka broker, ``fulmen consume`` (owns a fresh embedded store, serves
read-only SQL), and per case one ``fulmen runner`` process with 16 workers (``--concurrency``); for the ten-span
case the runner writes each rollout's spans straight into the spans topic (``FULMEN_RUNNER_SPAN_EXPORT=kafka``, the
default); ``--only ten_spans_otlp`` runs the same by OTLP through ``fulmen otlp-gateway``
(``rollouts_per_s_10_spans_otlp``: the way before, and the way agents in other processes still go). Each case:

1. warm-up: a burst of ``--warmup`` rollouts (start-up costs), then one of ``--burst`` whose rate sizes the bursts
   that follow so that each lasts at least ``--seconds`` (the window; ``--burst`` is the smallest burst); neither
   is counted, nor is a burst that took less than the window (the next one is made bigger);
2. three repetitions (``--repetitions``): the burst is published at once on the tasks topic; two clocks run from
   the publish: **in store**, polling ``fulmen.rollouts`` until every rollout of the burst has a terminal row
   (and, for ten spans, ``fulmen.otel_traces`` until all 10 x N spans are there: the rollout is not done for a
   user before its spans are queryable), and **Kafka only**, reading the rollouts topic until every terminal
   event was read (the figure this bench gave before: nothing stored).

Latency percentiles are from the store's clock: when 50% / 99% of the burst was queryable (the poll's time;
polls every 0.1 s). Per rollout and process (runner, consumer, kafka, bench, and gateway for ten spans): CPU
microseconds, context switches and, with ``--syscalls``, system calls (``perf stat``); ``runner_cpu_ms_per_rollout``
is the runner's CPU. The JSON has the medians at the top level (``spread`` holds min and max, ``runs`` each
repetition, the load average before and after).

    .venv/bin/python bench/rollout_throughput.py [--seconds 10] [--burst 2000] [--repetitions 3] [--syscalls]

Prints one JSON object on its last line: ``rollouts_per_s`` (no-op, done in store, median),
``rollouts_per_s_10_spans`` (ten stored spans each), ``kafka_only_rollouts_per_s`` (no-op, Kafka only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiokafka import TopicPartition

from bench.anchor import PYTHON, AnchorStore
from bench.harness import ProcessCounters, add_env_option, fulmen_env, load_average, started_broker, summarise
from bench.span_ingest import _ready, free_port, wait_for
from fulmen.infra.kafka.admin import ensure_topics, partition_count
from fulmen.infra.kafka.broker import kafka_broker
from fulmen.infra.kafka.clients import close_quietly, consumer, start_or_raise
from fulmen.infra.kafka.publish import EventPublisher
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import RemoteReader
from fulmen.schemas import RolloutEvent, RolloutRequest, TopicKey, decode, topic_name
from fulmen.schemas.events import TERMINAL_STATUSES

TERMINAL = ", ".join(f"'{status.value}'" for status in TERMINAL_STATUSES)


def stored_counts(reader: RemoteReader, tag: str, spans: bool) -> tuple[int, int]:
    """(rollouts of the burst with a terminal row, the burst's agent spans) in the store now; ``tag`` is the bench's
    own (letters, digits, dashes)."""
    done = reader.query(
        f"SELECT uniqExact(RolloutId) FROM fulmen.rollouts WHERE startsWith(RolloutId, '{tag}-') "
        f"AND Status IN ({TERMINAL})",
        final=False,
    ).rows[0][0]
    if not spans:
        return done, 0
    count = reader.query(
        f"SELECT count() FROM fulmen.otel_traces WHERE startsWith(RolloutId, '{tag}-') "
        "AND startsWith(SpanName, 'step ')",
        final=False,
    ).rows[0][0]
    return done, count


async def burst(settings: FulmenSettings, reader: RemoteReader, count: int, tag: str, spans: bool) -> dict:
    """Publish ``count`` requests at once; the time until all are terminal in the store and in Kafka."""
    requests = [
        RolloutRequest(rollout_id=f"{tag}-{i}", task_id=f"t{i}", group_id=f"{tag}-g{i // 8}", input={"i": i})
        for i in range(count)
    ]
    kafka = kafka_broker(settings)
    await start_or_raise(kafka, settings)
    events = consumer(settings, None)
    await start_or_raise(events, settings)
    name = topic_name(TopicKey.ROLLOUTS, settings.kafka.topic_prefix)
    partitions = [TopicPartition(name, p) for p in range(await partition_count(settings, name))]
    events.assign(partitions)
    await events.seek_to_end(*partitions)
    for tp in partitions:
        await events.position(tp)
    want_spans = 10 * count if spans else 0
    marks: dict[float, float] = {}  # share of the burst queryable -> seconds after the publish

    async def kafka_clock() -> float:
        ended: set[str] = set()
        while len(ended) < count:
            for records in (await events.getmany(timeout_ms=200)).values():
                for record in records:
                    event = decode(RolloutEvent, record.value)
                    if event.status.terminal and event.rollout_id.startswith(f"{tag}-"):
                        ended.add(event.rollout_id)
        return time.perf_counter() - start

    async def store_clock() -> tuple[float, int]:
        while True:
            done, stored_spans = await asyncio.to_thread(stored_counts, reader, tag, spans)
            now = time.perf_counter() - start
            for share in (0.5, 0.99):
                if done >= share * count:
                    marks.setdefault(share, now)
            if done >= count and stored_spans >= want_spans:
                return now, stored_spans
            await asyncio.sleep(0.1)

    try:
        start = time.perf_counter()
        await EventPublisher(kafka, timeout_s=120).publish_many(TopicKey.TASKS, requests)
        async with asyncio.timeout(900):
            kafka_s, (store_s, stored_spans) = await asyncio.gather(kafka_clock(), store_clock())
    finally:
        await close_quietly([kafka, events])
    return {
        "rollouts": count,
        "rollouts_per_s": count / store_s,
        "kafka_only_rollouts_per_s": count / kafka_s,
        "wall_s": store_s,
        "p50_s": marks[0.5],
        "p99_s": marks[0.99],
        "spans_expected": want_spans,
        "spans_stored": stored_spans,
    }


def anchor_burst(anchor: AnchorStore, count: int, workers: int, spans: bool) -> dict:
    """One burst through the anchor's store by its HTTP runners (``bench/anchor_runner.py`` in its virtualenv)."""
    script = Path(__file__).with_name("anchor_runner.py")
    out = subprocess.run(
        [str(PYTHON), str(script), anchor.url, str(count), str(workers), str(10 if spans else 0)],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    return {key: round(value, 4) for key, value in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def run_case(
    settings: FulmenSettings,
    reader: RemoteReader,
    tag: str,
    spans: bool,
    args: argparse.Namespace,
    pids: dict[str, int],
    anchor: AnchorStore | None = None,
) -> dict:
    asyncio.run(burst(settings, reader, args.warmup, f"{tag}-warm", spans))  # start-up: groups join, JIT, caches
    warm = asyncio.run(burst(settings, reader, args.burst, f"{tag}-size", spans))  # the rate that sizes the bursts
    size = max(args.burst, int(warm["rollouts_per_s"] * args.seconds * 1.2))
    print(f"{tag}: warm-up {warm['rollouts_per_s']:.0f}/s; bursts of {size}", file=sys.stderr, flush=True)
    if anchor:  # sized like ours: a burst that lasts the window at the rate of a first, uncounted one
        anchor_warm = anchor_burst(anchor, 500, args.workers, spans)
        anchor_size = max(500, int(anchor_warm["rollouts_per_s"] * args.seconds * 1.2))
    load = load_average()
    runs: list[dict] = []
    anchor_runs: list[dict] = []
    attempt = 0
    while len(runs) < args.repetitions and attempt < args.repetitions + 3:
        counters = ProcessCounters(pids, syscalls=args.syscalls)
        result = asyncio.run(burst(settings, reader, size, f"{tag}-r{attempt}", spans))
        result |= counters.per(size, "rollout")  # CPU, context switches, system calls by process
        result["runner_cpu_ms_per_rollout"] = result["cpu_us_per_rollout_runner"] / 1000
        print(f"{tag} #{attempt + 1}: {json.dumps({k: round(v, 3) for k, v in result.items()})}", file=sys.stderr)
        attempt += 1
        if result["wall_s"] < args.seconds:  # shorter than the window: not counted, the next burst is bigger
            size = int(size * args.seconds / result["wall_s"] * 1.2)
            continue
        runs.append({key: round(value, 4) for key, value in result.items()})
        if anchor:  # interleaved: Fulmen, anchor, Fulmen, anchor, ...
            anchor_runs.append(anchor_burst(anchor, anchor_size, args.workers, spans))
            print(f"{tag} anchor #{len(anchor_runs)}: {json.dumps(anchor_runs[-1])}", file=sys.stderr, flush=True)
    report = summarise(runs, load)
    if anchor_runs:
        report["anchor"] = summarise(anchor_runs, load)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="each measured burst lasts at least this long")
    parser.add_argument("--burst", type=int, default=2000, help="the smallest measured burst")
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument(
        "--only",
        choices=("noop", "ten_spans", "ten_spans_otlp"),
        action="append",
        help="ten_spans_otlp: ten spans by OTLP through the gateway (FULMEN_RUNNER_SPAN_EXPORT=otlp), no anchor",
    )
    parser.add_argument("--no-anchor", action="store_true", help="skip Agent Lightning 0.3.0 (bench/anchor.py)")
    parser.add_argument("--profile", type=Path, default=None, help="write a cProfile of each runner here")
    parser.add_argument("--syscalls", action="store_true", help="count each process's system calls (perf stat)")
    add_env_option(parser)
    args = parser.parse_args()
    home, broker = started_broker("fulmen-bench-rollouts-")
    otlp_port, read_port = free_port(), free_port()
    base_env = fulmen_env(
        broker.bootstrap,
        home,
        args.env,
        FULMEN_OTLP_PORT=str(otlp_port),
        FULMEN_CLICKHOUSE_READ_PORT=str(read_port),
    )
    fulmen = [sys.executable, "-m", "fulmen.cli.main"]
    report: dict = {}
    logs = open(home / "services.log", "wb")  # noqa: SIM115
    asyncio.run(ensure_topics(FulmenSettings(kafka={"bootstrap": broker.bootstrap})))
    services = [
        subprocess.Popen([*fulmen, "consume"], env=base_env, stdout=logs, stderr=logs),
        subprocess.Popen([*fulmen, "otlp-gateway"], env=base_env, stdout=logs, stderr=logs),
    ]
    anchor = None
    try:
        print(f"logs in {home}", file=sys.stderr)
        anchor = None if args.no_anchor else AnchorStore(free_port(), home / "anchor.log").__enter__()
        reader = wait_for(lambda: RemoteReader.find("127.0.0.1", read_port), 120, "the store's read endpoint")
        wait_for(lambda: _ready(otlp_port), 60, "the OTLP gateway")
        settings = FulmenSettings(kafka={"bootstrap": broker.bootstrap})
        for case in args.only or ("noop", "ten_spans"):
            spans = case.startswith("ten_spans")
            agent = "ten_spans" if spans else case
            otlp = f"http://127.0.0.1:{otlp_port}/v1/traces" if spans else ""
            export = "otlp" if case == "ten_spans_otlp" else "kafka"
            env = base_env | {"FULMEN_RUNNER_OTLP_ENDPOINT": otlp, "FULMEN_RUNNER_SPAN_EXPORT": export}
            profile = ["-m", "cProfile", "-o", str(args.profile / f"{case}.prof")] if args.profile else []
            runner = subprocess.Popen(
                [
                    sys.executable,
                    *profile,
                    "-m",
                    "fulmen.cli.main",
                    "runner",
                    "--agent",
                    f"bench.agents:{agent}",
                    "--concurrency",
                    str(args.workers),
                ],
                env=env,
                stdout=logs,
                stderr=logs,
            )
            try:
                time.sleep(3)  # the runner joins its group
                pids = {
                    "runner": runner.pid,
                    "consumer": services[0].pid,
                    "kafka": broker.status().pid or 0,
                    "bench": os.getpid(),
                }
                if spans:
                    pids["gateway"] = services[1].pid
                mine = anchor if case != "ten_spans_otlp" else None
                report[case] = run_case(settings, reader, case, spans, args, pids, mine)
            finally:
                runner.send_signal(signal.SIGTERM)
                runner.wait(timeout=60)
    finally:
        for process in services:
            process.send_signal(signal.SIGTERM)
        for process in services:
            process.wait(timeout=60)
        broker.stop()
        if anchor:
            anchor.__exit__(None, None, None)
    for agent, key in (("noop", "rollouts"), ("ten_spans", "rollouts_10_spans")):
        if "anchor" in report.get(agent, {}):
            report[f"anchor_rollouts_per_s{key[8:]}"] = report[agent]["anchor"]["rollouts_per_s"]
            ours, theirs = report[agent]["rollouts_per_s"], report[agent]["anchor"]["rollouts_per_s"]
            report[f"ratio_{key}"] = round(ours / theirs, 2)
    if "noop" in report:
        report["rollouts_per_s"] = report["noop"]["rollouts_per_s"]
        report["kafka_only_rollouts_per_s"] = report["noop"]["kafka_only_rollouts_per_s"]
    for case, key in (("ten_spans", "rollouts_per_s_10_spans"), ("ten_spans_otlp", "rollouts_per_s_10_spans_otlp")):
        if case in report:
            report[key] = report[case]["rollouts_per_s"]
            report["all_spans_stored"] = report.get("all_spans_stored", True) and all(
                run["spans_stored"] >= run["spans_expected"] for run in report[case]["runs"]
            )
    report["done"] = "the terminal state of every rollout of a burst queryable in fulmen.rollouts (and its 10 spans "
    report["done"] += "in fulmen.otel_traces); kafka_only: every terminal event read back from the rollouts topic"
    report["workers"] = args.workers
    report["env"] = args.env
    print(json.dumps(report))


if __name__ == "__main__":
    main()
