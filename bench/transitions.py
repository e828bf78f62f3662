"""Transitions under load: finished rollouts → spans consumer → transitions consumer → TransitionBatches on Kafka.

Starts what it needs, as a deployment would: a local Kafka broker and ``fulmen consume --sink spans --sink
transition_builder`` in its own process (it owns a fresh embedded store; the late-span check stays on). Each
rollout is 20 spans, as an instrumented agent behind the LLM gateway makes them: the agent's trace (the runner's
``fulmen.rollout`` span, an agent span, a planning span, 5 framework LLM spans, 5 tool spans, 2 reward spans) and
5 LLM-gateway spans in traces of their own (no traceparent, as the frameworks behave), each with 256 prompt and
64 response token ids and logprobs; then its ``succeeded`` event. Everything is encoded before the clock starts.

Phases:

1. saturation: ``--rollouts`` rollouts published as fast as Kafka acknowledges them. transitions/s = transitions
   read back / (last batch read - first span sent).
2. paced: ``--rate`` rollouts/s (default: half the saturation rate) for ``--seconds``. Latency of a rollout = when
   its TransitionBatch was read from ``fulmen.transitions`` - when its end event was acknowledged by Kafka.

Prints one JSON object on the last line.

    .venv/bin/python bench/transitions.py [--rollouts 2000] [--seconds 20] [--rate R]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiokafka import AIOKafkaProducer, TopicPartition
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from bench.harness import cpu_seconds
from bench.span_ingest import free_port, peak_rss_mb
from fulmen.infra.kafka.admin import ensure_topics
from fulmen.infra.kafka.clients import consumer, producer, start_or_raise
from fulmen.infra.kafka.local import LocalKafka
from fulmen.infra.settings import BrokerSettings, FulmenSettings
from fulmen.schemas import semconv
from fulmen.schemas.codec import decode, encode
from fulmen.schemas.events import RolloutEvent, RolloutStatus, TransitionBatch
from fulmen.schemas.topics import TopicKey, topic, topic_name

CALLS, PROMPT, RESPONSE = 5, 256, 64
Rollout = tuple[str, list[tuple[bytes, bytes]], bytes]  # rollout id, span records (key, value), end event


def _kv(key: str, value: object) -> KeyValue:
    if isinstance(value, list):
        any_value = AnyValue()
        items = [AnyValue(double_value=v) if isinstance(v, float) else AnyValue(int_value=v) for v in value]
        any_value.array_value.values.extend(items)
        return KeyValue(key=key, value=any_value)
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


def _record(spans: list[tuple[bytes, bytes, bytes, str, int, int, dict]], rollout: str) -> tuple[bytes, bytes]:
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    for trace_id, span_id, parent, name, start, end, attributes in spans:
        span = scope.spans.add()
        span.trace_id, span.span_id, span.parent_span_id, span.name = trace_id, span_id, parent, name
        span.start_time_unix_nano, span.end_time_unix_nano = start, end
        merged = {semconv.ROLLOUT_ID: rollout, semconv.ROLLOUT_ATTEMPT: 1, **attributes}
        span.attributes.extend(_kv(k, v) for k, v in merged.items())
    return spans[0][0].hex().encode(), request.SerializeToString()


def make_rollout(index: int, rng: random.Random) -> Rollout:
    """One rollout's 6 span records (agent trace + 5 gateway traces, 20 spans) and its encoded end event."""
    rollout, now, ms = f"bench-{index}", time.time_ns(), 1_000_000
    main, ids = os.urandom(16), [os.urandom(8) for _ in range(20)]
    root, agent = ids[0], ids[1]
    agent_spans = [
        (main, root, b"", semconv.SPAN_ROLLOUT, now, now + 1000 * ms, {}),
        (main, agent, root, "invoke_agent solver", now + ms, now + 990 * ms, {semconv.GEN_AI_AGENT_NAME: "solver"}),
        (main, ids[2], agent, "plan", now + 2 * ms, now + 3 * ms, {}),
    ]
    records = []
    for call in range(CALLS):
        base = now + (10 + 190 * call) * ms
        llm = ids[3 + call]
        agent_spans.append((main, llm, agent, "ChatOpenAI", base, base + 100 * ms, {"openinference.span.kind": "LLM"}))
        tool = (main, ids[8 + call], agent, "execute_tool search", base + 110 * ms, base + 150 * ms, {})
        agent_spans.append(tool)
        if call < 2:
            reward = {semconv.REWARD_VALUE: 0.1, semconv.REWARD_NAME: "format"}
            at = base + 160 * ms
            agent_spans.append((main, ids[13 + call], agent, semconv.SPAN_REWARD, at, at, reward))
        tokens = {
            semconv.GEN_AI_OPERATION_NAME: "chat",
            semconv.GEN_AI_REQUEST_MODEL: "tiny",
            semconv.MODEL_VERSION: 1,
            semconv.GEN_AI_RESPONSE_ID: f"chatcmpl-{rng.getrandbits(64):x}",
            semconv.PROMPT_TOKEN_IDS: [rng.randrange(50_000) for _ in range(PROMPT)],
            semconv.RESPONSE_TOKEN_IDS: [rng.randrange(50_000) for _ in range(RESPONSE)],
            semconv.RESPONSE_LOGPROBS: [-rng.random() for _ in range(RESPONSE)],
        }
        gateway = (os.urandom(16), os.urandom(8), b"", "chat tiny", base + 5 * ms, base + 95 * ms, tokens)
        records.append(_record([gateway], rollout))
    records.insert(0, _record(agent_spans, rollout))
    event = RolloutEvent(
        rollout_id=rollout,
        attempt=1,
        status=RolloutStatus.SUCCEEDED,
        task_id=f"task-{index}",
        group_id=f"group-{index // 8}",
        reward=1.0,
    )
    return rollout, records, encode(event)


class Collector:
    """Reads TransitionBatches from the transitions topic: when each rollout's arrived, and how many calls."""

    def __init__(self, settings: FulmenSettings) -> None:
        self.settings = settings
        self.reader = consumer(settings, None)
        self.arrived: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.duplicates = 0

    async def start(self) -> None:
        await start_or_raise(self.reader, self.settings)
        name = topic_name(TopicKey.TRANSITIONS, self.settings.kafka.topic_prefix)
        partitions = [TopicPartition(name, p) for p in range(topic(TopicKey.TRANSITIONS).partitions)]
        self.reader.assign(partitions)
        await self.reader.seek_to_beginning(*partitions)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for records in (await self.reader.getmany(timeout_ms=100)).values():
                now = time.time()
                for record in records:
                    batch = decode(TransitionBatch, record.value)
                    if batch.rollout_id in self.arrived:
                        self.duplicates += 1
                        continue
                    self.arrived[batch.rollout_id] = now
                    self.calls[batch.rollout_id] = len(batch.transitions)

    async def until(self, rollouts: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(r not in self.arrived for r in rollouts) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


async def publish(client: AIOKafkaProducer, settings: FulmenSettings, rollout: Rollout) -> float:
    """The rollout's spans, then its end event; returns when the event was acknowledged."""
    prefix = settings.kafka.topic_prefix
    spans, rollouts = topic_name(TopicKey.SPANS, prefix), topic_name(TopicKey.ROLLOUTS, prefix)
    rollout_id, records, event = rollout
    acks = [await client.send(spans, value=value, key=key) for key, value in records]
    await asyncio.gather(*acks)
    await client.send_and_wait(rollouts, value=event, key=rollout_id.encode())
    return time.time()


async def run_load(settings: FulmenSettings, args: argparse.Namespace, rollouts: list[Rollout]) -> dict:
    client = producer(settings)
    await start_or_raise(client, settings)
    collector = Collector(settings)
    await collector.start()
    stop = asyncio.Event()
    reading = asyncio.create_task(collector.run(stop))
    try:
        warm = rollouts.pop()
        await publish(client, settings, warm)
        await collector.until([warm[0]], timeout_s=120)
        if warm[0] not in collector.arrived:
            raise SystemExit("the consumers did not build the warm-up rollout within 120s (see consume.log)")
        burst, paced = rollouts[: args.rollouts], rollouts[args.rollouts :]
        t0 = time.time()
        await asyncio.gather(*(publish(client, settings, r) for r in burst))
        await collector.until([r[0] for r in burst], timeout_s=300)
        last = max((collector.arrived.get(r[0], 0.0) for r in burst), default=t0)
        built = [collector.calls[r[0]] for r in burst if r[0] in collector.arrived]
        saturation = sum(built) / (last - t0)
        rate = args.rate or max(1.0, saturation / CALLS / 2)
        ended = await paced_load(client, settings, paced, rate, args.seconds)
        await collector.until(list(ended), timeout_s=120)
    finally:
        stop.set()
        await reading
        await collector.reader.stop()
        await client.stop()
    latencies = sorted((collector.arrived[r] - at) * 1000 for r, at in ended.items() if r in collector.arrived)
    all_ids = [r[0] for r in burst] + list(ended)
    return {
        "transitions_per_s": round(saturation, 1),
        "rollouts_per_s": round(saturation / CALLS, 1),
        "paced_rollouts_per_s": round(rate, 1),
        "p50_ms": _pct(latencies, 0.50),
        "p99_ms": _pct(latencies, 0.99),
        "max_ms": round(latencies[-1], 1) if latencies else -1.0,
        "rollouts": len(all_ids),
        "batches_missing": sum(1 for r in all_ids if r not in collector.arrived),
        "batches_incomplete": sum(1 for r in all_ids if collector.calls.get(r, CALLS) != CALLS),
        "batches_duplicated": collector.duplicates,
    }


async def paced_load(
    client: AIOKafkaProducer, settings: FulmenSettings, rollouts: list[Rollout], rate: float, seconds: float
) -> dict[str, float]:
    """Start one rollout every 1/rate s (open loop) for ``seconds``; when each end was acknowledged."""
    ended: dict[str, float] = {}
    begin = time.monotonic()
    count = min(len(rollouts), int(rate * seconds))

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, begin + i / rate - time.monotonic()))
        ended[rollouts[i][0]] = await publish(client, settings, rollouts[i])

    await asyncio.gather(*(one(i) for i in range(count)))
    return ended


def _pct(values: list[float], p: float) -> float:
    return round(values[min(len(values) - 1, int(p * len(values)))], 1) if values else -1.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rollouts", type=int, default=2000, help="rollouts in the saturation burst")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the paced phase")
    parser.add_argument("--rate", type=float, default=None, help="paced rollouts/s (default: half of saturation)")
    parser.add_argument("--max-paced", type=int, default=4000, help="rollouts encoded for the paced phase")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="fulmen-bench-"))
    broker = LocalKafka(BrokerSettings(port=free_port(), controller_port=free_port()), home / "kafka")
    broker.start()
    settings = FulmenSettings(kafka={"bootstrap": broker.bootstrap})
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {
        "FULMEN_KAFKA_BOOTSTRAP": broker.bootstrap,
        "FULMEN_HOME": str(home),
        "FULMEN_LOG_LEVEL": "WARNING",
        "FULMEN_CLICKHOUSE_READ_PORT": "0",
    }
    asyncio.run(ensure_topics(settings))
    log = open(home / "consume.log", "wb")  # noqa: SIM115
    command = [sys.executable, "-m", "fulmen.cli.main", "consume", "--sink", "spans", "--sink", "transition_builder"]
    consume = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        print(f"logs in {home}; encoding rollouts...", file=sys.stderr)
        rng = random.Random(7)
        rollouts = [make_rollout(i, rng) for i in range(args.rollouts + args.max_paced + 1)]
        pids = {"consumer": consume.pid, "kafka": broker.status().pid or 0, "load": os.getpid()}
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        report = asyncio.run(run_load(settings, args, rollouts))
        cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
        transitions = max(1, report["rollouts"] * CALLS)
        report["cpu_us_per_transition"] = {name: round(s * 1e6 / transitions, 1) for name, s in cpu.items()}
        report["peak_rss_mb"] = {"consumer": peak_rss_mb(consume.pid), "kafka": peak_rss_mb(broker.status().pid or 0)}
        report |= {
            "calls_per_rollout": CALLS,
            "spans_per_rollout": 20,
            "prompt_tokens": PROMPT,
            "response_tokens": RESPONSE,
        }
    finally:
        consume.send_signal(signal.SIGTERM)
        try:
            consume.wait(timeout=60)
        except subprocess.TimeoutExpired:
            consume.kill()
        broker.stop()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
