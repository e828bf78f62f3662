"""The LLM gateway over several vLLM replicas: throughput with 1 and 3, a replica killed under load, a version
rolled over the replicas under load.

Starts a Kafka broker and, in this process, three vLLM stand-ins (``fulmen/testing/vllm_standin.py``: vLLM 0.33's routes
and shapes; each generation takes ``--generation-ms``, at most ``--max-num-seqs`` at once, as a server whose batch
is full) and the gateway (``vllm`` backend) in front of them. ``--clients`` agents call in a closed loop, each its
own rollout of ``--calls-per-rollout`` calls. Phases of ``--seconds`` each:

1. one replica, then three: calls/s and latency;
2. three replicas, one killed halfway: calls answered, errors, spans on Kafka (one per call?), failovers;
3. three replicas, a new version published on the models topic halfway (reload takes ``--load-ms``): calls/s,
   errors, how long the roll took, and whether each span's version is the one that produced its answer.

    .venv/bin/python bench/replicas.py [--seconds 8 --clients 32]

Prints one JSON object on its last line. The stand-ins run in the gateway's process on the same cores, so the
figures are the gateway's and the router's costs and behaviour, not a GPU server's speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.span_ingest import free_port
from fulmen.infra.kafka.admin import ensure_topics
from fulmen.infra.kafka.local import LocalKafka
from fulmen.infra.settings import BrokerSettings, FulmenSettings
from fulmen.producers.llm_gateway import LlmGateway, LlmGatewaySettings
from fulmen.schemas import ModelVersion, TopicKey, semconv
from fulmen.testing.llm_pipeline import all_published_spans
from fulmen.testing.publishing import event_publisher
from fulmen.testing.vllm_standin import BASE_MODEL, VllmStandIn


async def agents(port: int, clients: int, calls_per_rollout: int, seconds: float) -> dict[str, Any]:
    """Closed-loop agents for ``seconds``: their answers, latencies and errors."""
    answers: list[str] = []
    latencies: list[float] = []
    errors = 0
    deadline = time.monotonic() + seconds

    async def agent(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        while time.monotonic() < deadline:
            rollout = secrets.token_hex(6)
            url = f"http://127.0.0.1:{port}/rollout/{rollout}/attempt/1/v1/chat/completions"
            for call in range(calls_per_rollout):
                body = {"model": "fulmen", "messages": [{"role": "user", "content": f"{rollout}-{call}"}]}
                started = time.perf_counter()
                async with session.post(url, json=body) as response:
                    data = await response.json()
                if response.status != 200:
                    errors += 1
                    continue
                latencies.append(time.perf_counter() - started)
                answers.append(data["choices"][0]["message"]["content"])

    began = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:
        await asyncio.gather(*(agent(session) for _ in range(clients)))
    elapsed = time.monotonic() - began
    latencies.sort()
    return {
        "answers": answers,
        "calls_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(1000 * statistics.median(latencies), 1) if latencies else None,
        "p99_ms": round(1000 * latencies[int(0.99 * (len(latencies) - 1))], 1) if latencies else None,
        "errors": errors,
    }


def version_of(answer: str) -> int:
    label = answer.rsplit("| weights ", 1)[1]
    return 0 if label == "default" else int(label)


async def phase(settings: FulmenSettings, servers: list[VllmStandIn], args: argparse.Namespace, during=None) -> dict:
    """One run of agents against a fresh gateway over ``servers``; ``during(gateway)`` runs halfway."""
    prefix = f"b{secrets.token_hex(4)}."
    run = FulmenSettings(home=settings.home, kafka=settings.kafka.model_copy(update={"topic_prefix": prefix}))
    await ensure_topics(run)
    gateway = LlmGateway(
        LlmGatewaySettings(
            home=run.home,
            kafka=run.kafka.model_dump(),
            llm={
                "backend": "vllm",
                "model": BASE_MODEL,
                "upstream_url": ",".join(s.url for s in servers),
                "model_version": 0,
                "port": free_port(),
                "replica_retry_s": 0.5,
            },
        )
    )
    await gateway.start()
    try:
        load = asyncio.create_task(agents(gateway.port, args.clients, args.calls_per_rollout, args.seconds))
        extra: dict[str, Any] = {}
        if during is not None:
            await asyncio.sleep(args.seconds / 2)
            extra = await during(gateway, run)
        result = await load
        result["failovers"] = gateway.backend.failovers
    finally:
        await gateway.stop()
    spans = await all_published_spans(run, timeout_s=120)
    outputs = [json.loads(s["attributes"][semconv.GEN_AI_OUTPUT_MESSAGES])[0]["content"] for s in spans]
    answers = result.pop("answers")
    result |= extra | {
        "calls": len(answers),
        "spans": len(spans),
        "spans_match_answers": sorted(outputs) == sorted(answers),
        "duplicates": len(outputs) - len(set(outputs)),
        "versions_right": all(
            s["attributes"][semconv.MODEL_VERSION] == version_of(o) for s, o in zip(spans, outputs, strict=True)
        ),
    }
    return result


async def measure(args: argparse.Namespace, home: Path, bootstrap: str) -> dict[str, Any]:
    settings = FulmenSettings(home=home, kafka={"bootstrap": bootstrap})
    checkpoint = home / "v1"
    checkpoint.mkdir()
    options = {
        "delay_s": args.generation_ms / 1000,
        "load_delay_s": args.load_ms / 1000,
        "max_num_seqs": args.max_num_seqs,
        "root": str(home),
    }
    servers = [VllmStandIn(**options) for _ in range(3)]
    for server in servers:
        await server.start()
    report: dict[str, Any] = {}
    try:
        report["one_replica"] = await phase(settings, servers[:1], args)
        report["three_replicas"] = await phase(settings, servers, args)

        async def kill(gateway: LlmGateway, run: FulmenSettings) -> dict:
            await servers[1].kill()
            return {}

        report["one_killed"] = await phase(settings, servers, args, kill)
        await servers[1].start()

        async def publish(gateway: LlmGateway, run: FulmenSettings) -> dict:
            started = time.monotonic()
            async with event_publisher(run) as publisher:
                await publisher.publish(
                    TopicKey.MODELS, ModelVersion(model_name="fulmen", version=1, uri=str(checkpoint))
                )
            while gateway.backend.model_version != 1:
                await asyncio.sleep(0.01)
            return {"roll_s": round(time.monotonic() - started, 2)}

        report["version_rolled"] = await phase(settings, servers, args, publish)
    finally:
        for server in servers:
            await server.stop()
    report["settings"] = dict(vars(args))
    return report


def main(args: argparse.Namespace) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="fulmen-bench-replicas-"))
    broker = LocalKafka(BrokerSettings(port=free_port(), controller_port=free_port()), home / "kafka")
    broker.start()  # runs its own event loop: before ours
    try:
        return asyncio.run(measure(args, home, broker.bootstrap))
    finally:
        broker.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--calls-per-rollout", type=int, default=4)
    parser.add_argument("--generation-ms", type=float, default=50.0)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--load-ms", type=float, default=500.0)
    print(json.dumps(main(parser.parse_args())))
