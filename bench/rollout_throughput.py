"""Rollouts per second through the runner: from submit to the terminal event, for agents that do nothing.

Starts a Kafka broker and, per case, one ``fulmen runner`` process with N workers (``--concurrency``); for the
ten-span case also ``fulmen otlp-gateway``, to which the runner exports its spans by OTLP (each rollout's spans
are flushed before its end is reported, so they are in Kafka when the rollout ends). Submits ``--rollouts``
requests at once and reads the rollouts topic until every rollout has its terminal event. Time per rollout =
terminal event timestamp - submit time.

    .venv/bin/python bench/rollout_throughput.py [--rollouts 3000]

Prints one JSON object on its last line; ``rollouts_per_s`` is the 16-worker no-op case.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiokafka import TopicPartition

from bench.span_ingest import _ready, cpu_seconds, free_port, wait_for
from fulmen.infra.kafka.admin import ensure_topics, partition_count
from fulmen.infra.kafka.broker import kafka_broker
from fulmen.infra.kafka.clients import close_quietly, consumer, start_or_raise
from fulmen.infra.kafka.local import LocalKafka
from fulmen.infra.kafka.publish import EventPublisher
from fulmen.infra.settings import BrokerSettings, FulmenSettings
from fulmen.schemas import RolloutEvent, RolloutRequest, TopicKey, decode, topic_name


async def run_case(settings: FulmenSettings, count: int, tag: str) -> dict:
    requests = [RolloutRequest(rollout_id=f"{tag}-{i}", task_id=f"t{i}", group_id=f"g{i // 8}", input={"i": i})
                for i in range(count)]  # fmt: skip
    kafka = kafka_broker(settings)
    await start_or_raise(kafka, settings)
    reader = consumer(settings, None)
    await start_or_raise(reader, settings)
    name = topic_name(TopicKey.ROLLOUTS, settings.kafka.topic_prefix)
    partitions = [TopicPartition(name, p) for p in range(await partition_count(settings, name))]
    reader.assign(partitions)
    await reader.seek_to_end(*partitions)
    for tp in partitions:
        await reader.position(tp)
    try:
        submitted = time.time()
        await EventPublisher(kafka, timeout_s=120).publish_many(TopicKey.TASKS, requests)
        ended: dict[str, float] = {}
        async with asyncio.timeout(600):
            while len(ended) < count:
                for records in (await reader.getmany(timeout_ms=500)).values():
                    for record in records:
                        event = decode(RolloutEvent, record.value)
                        if event.status.terminal and event.rollout_id.startswith(f"{tag}-"):
                            ended.setdefault(event.rollout_id, event.timestamp.timestamp())
    finally:
        await close_quietly([kafka, reader])
    latencies = sorted(end - submitted for end in ended.values())
    wall = max(ended.values()) - submitted
    return {
        "rollouts_per_s": count / wall,
        "p50_s": statistics.median(latencies),
        "p99_s": latencies[int(0.99 * (len(latencies) - 1))],
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rollouts", type=int, default=3000)
    parser.add_argument("--profile", type=Path, default=None, help="write a cProfile of each runner here")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="fulmen-bench-rollouts-"))
    broker = LocalKafka(BrokerSettings(port=free_port(), controller_port=free_port()), home / "kafka")
    broker.start()
    otlp_port = free_port()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {
        "FULMEN_KAFKA_BOOTSTRAP": broker.bootstrap, "FULMEN_HOME": str(home), "FULMEN_LOG_LEVEL": "WARNING",
        "FULMEN_OTLP_PORT": str(otlp_port), "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
    }  # fmt: skip
    fulmen = [sys.executable, "-m", "fulmen.cli.main"]
    report: dict = {}
    cases = [("noop", 4, False), ("noop", 16, False), ("ten_spans", 16, True)]
    try:
        print(f"logs in {home}", file=sys.stderr)
        for agent, workers, spans in cases:
            tag = f"{agent}-w{workers}"
            prefix = f"{tag}."
            settings = FulmenSettings(kafka={"bootstrap": broker.bootstrap, "topic_prefix": prefix})
            asyncio.run(ensure_topics(settings))
            otlp = f"http://127.0.0.1:{otlp_port}/v1/traces" if spans else ""
            env = base_env | {"FULMEN_KAFKA_TOPIC_PREFIX": prefix, "FULMEN_RUNNER_OTLP_ENDPOINT": otlp}
            log = open(home / f"{tag}.log", "wb")  # noqa: SIM115
            processes = []
            if spans:
                processes.append(subprocess.Popen([*fulmen, "otlp-gateway"], env=env, stdout=log, stderr=log))
                wait_for(lambda: _ready(otlp_port), 60, "the OTLP gateway")
            profile = ["-m", "cProfile", "-o", str(args.profile / f"{tag}.prof")] if args.profile else []
            command = [sys.executable, *profile, "-m", "fulmen.cli.main"]
            runner = subprocess.Popen([*command, "runner", "--agent", f"bench.agents:{agent}", "--concurrency",
                                       str(workers)], env=env, stdout=log, stderr=log)  # fmt: skip
            processes.append(runner)
            time.sleep(3)  # the runner joins its group
            cpu_before = cpu_seconds(runner.pid)
            result = asyncio.run(run_case(settings, args.rollouts, tag))
            result["runner_cpu_ms_per_rollout"] = 1000 * (cpu_seconds(runner.pid) - cpu_before) / args.rollouts
            print(f"{tag}: {result}", file=sys.stderr)
            report[tag] = {k: round(v, 4) for k, v in result.items()}
            for process in processes:
                process.send_signal(signal.SIGTERM)
            for process in processes:
                process.wait(timeout=60)
    finally:
        broker.stop()
    report["rollouts_per_s"] = report["noop-w16"]["rollouts_per_s"]
    report["rollouts_per_s_4_workers"] = report["noop-w4"]["rollouts_per_s"]
    report["ten_span_rollouts_per_s"] = report["ten_spans-w16"]["rollouts_per_s"]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
