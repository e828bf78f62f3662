"""Fulmen across hosts, with faults: hosts in network namespaces on this machine (:mod:`fulmen.testing.hosts`),
each its own address and directory, nothing shared on disk but the object store.

Layout: three Kafka nodes on hosts ``kafka1..3`` (replication 3, min ISR 2), ``fulmen consume`` and its store on
``store``, the OTLP gateway on ``gateway``, SeaweedFS's S3 on ``s3``, and ``fetcher`` (a gateway's machine with
no shared disk). The operator (this process) posts OTLP span batches to the gateway's address at a steady pace
(:class:`bench.chaos_load.SpanLoad`, retried until acknowledged) while each fault happens in turn:

- ``broker_host_killed``: every process of a broker's host killed with SIGKILL; the node started again after;
- ``broker_host_partitioned``: a broker's host cut off the network for ``--partition-s`` (its link down), healed;
- ``otlp_gateway_host_killed``: the gateway's host killed, the same command started again on it;
- ``consumers_host_killed``: the store's host killed mid-stream (``fulmen consume`` and its embedded store), the
  same command started again on it.

Per fault ``first_ack_s`` (from the fault to the first acknowledged batch after it), ``recovery_s`` (until
batches were acknowledged steadily again: the end of the last gap of more than 2 s without one) and
``stalled_s`` (the time in gaps of more than 1 s); for the consumers' host ``recovery_s`` is from the kill to the
store holding every span acknowledged so far. At the end every acknowledged span is counted in the store by
SQL (through the store host's read endpoint): ``lost`` and ``doubled`` must be 0. ``spans_per_s`` is the
acknowledged rate of four clients posting as fast as they are answered, beside the same workload with
everything on one host (``spans_per_s_one_host``: one Kafka node, the consumers and the gateway in one
namespace). ``checkpoint_fetch_s``: a checkpoint (SmolLM2-135M, or ``--checkpoint-mb`` of random bytes) uploaded
by the operator to the store host's S3 and fetched by ``fetcher`` as a gateway does (checked against its
manifest): from the upload's start to the folder in place there.

The ``training`` part (:mod:`bench.cluster_training`): a training run on the tiny model across ten hosts
(three Kafka nodes, the store, the OTLP gateway, the LLM gateway, a runner, the trainer as a torchrun job of two
hosts, S3), versions through the object store only, with the chaos load (spans, LLM calls, feedback, submitted
tasks, the trainer's rollouts); the host of rank 0 (it comes back without its disk and resumes from the store),
of rank 1, of the LLM gateway, the runner, the consumers, the OTLP gateway and a broker is killed in turn.
Every span, call, feedback, rollout, transition and version is counted by SQL: ``rollouts``, ``lost`` and
``doubled`` include them, and ``faults`` has each host's ``recovery_s`` (from the restart to the first new unit
of work it did).

The ``wan`` part: the same with one trainer host and a ``wan`` host, where the runner reaches both gateways
through a slow, lossy link (``--latency-ms`` each way, ``--loss`` of the connections reset: Toxiproxy on host
``wan``, as this kernel has no netem), and the runner's host is killed midway.

Parts run on their own (``--parts``) and are merged into ``--results`` as each ends; the top-level keys are
computed from the parts there.

    .venv/bin/python bench/cluster.py [--parts spans,training,wan] [--checkpoint-mb 0] [--partition-s 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import itertools
import logging

from bench.chaos_count import span_counts
from bench.chaos_load import SpanLoad, first_after
from fulmen.infra.kafka.admin import describe_topics, ensure_topics
from fulmen.infra.kafka.local import LocalKafka
from fulmen.infra.objectstore import upload_dir
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import RemoteReader
from fulmen.testing.hosts import Host, Network, reachable, start_kafka, unavailable, until
from fulmen.testing.seaweedfs import SeaweedS3

FULMEN = [sys.executable, "-m", "fulmen.cli.main"]
TOKEN = "cluster-bench-read-token"
NOT_MEASURED = [
    "packet loss inside a live TCP connection (the proxy resets a share of the connections instead)",
]
PARTS = ("spans", "training", "wan")
RESULTS = Path(__file__).resolve().parent / "results" / "cluster.json"
TRAINING_FAULTS = {  # chaos phase -> the fault's name here, in the order they happen
    "trainer": "trainer_host_lost",
    "trainer_node2": "trainer_node2_host_killed",
    "llm_gateway": "llm_gateway_host_killed",
    "runner": "runner_host_killed",
    "consume": "consumers_host_killed_in_training",
    "otlp_gateway": "otlp_gateway_host_killed_in_training",
    "broker": "broker_host_killed_in_training",
}


@dataclass
class Deployment:
    """Kafka on ``brokers``, ``fulmen consume`` on ``store``, the OTLP gateway on ``gateway``."""

    brokers: list[Host]
    store: Host
    gateway: Host
    nodes: list[LocalKafka] = field(default_factory=list)
    reader: Any = None
    extra_env: dict[str, str] = field(default_factory=dict)  # settings every Fulmen process on the hosts gets

    @property
    def bootstrap(self) -> str:
        return ",".join(f"{h.address}:9092" for h in self.brokers)

    @property
    def url(self) -> str:
        return f"http://{self.gateway.address}:4318/v1/traces"

    def env(self, host: Host) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("FULMEN_", "AWS_"))}
        base |= {"FULMEN_KAFKA_BOOTSTRAP": self.bootstrap, "FULMEN_HOME": str(host.root / "home")}
        return base | self.extra_env

    def start_consumers(self) -> None:
        env = self.env(self.store)
        env |= {"FULMEN_CLICKHOUSE_READ_HOST": self.store.address, "FULMEN_CLICKHOUSE_READ_TOKEN": TOKEN}
        self.store.spawn([*FULMEN, "consume"], env, "consume")

    def start_gateway(self) -> None:
        env = self.env(self.gateway) | {"FULMEN_OTLP_HOST": self.gateway.address}
        self.gateway.spawn([*FULMEN, "otlp-gateway"], env, "otlp-gateway")

    async def start(self) -> Deployment:
        self.nodes = await asyncio.to_thread(start_kafka, self.brokers)
        await ensure_topics(FulmenSettings(kafka={"bootstrap": self.bootstrap}))
        self.start_consumers()
        self.start_gateway()
        await self.ready()
        return self

    async def ready(self) -> None:
        self.reader = await until(lambda: RemoteReader.find(self.store.address, 8124, TOKEN), 180, "the store")
        await until(lambda: reachable(self.gateway.address, 4318) or None, 120, "the OTLP gateway")


async def throughput(deployment: Deployment, seconds: float, clients: int = 4) -> float:
    """Acknowledged spans a second from ``clients`` loads posting 100-span batches as fast as answered."""
    loads = [SpanLoad(deployment.url, batch=100, batches_per_s=1000.0, phase="throughput") for _ in range(clients)]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(load.run(stop)) for load in loads]
    await asyncio.sleep(3)  # connections and the gateway's producer warmed up
    began = time.time()
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 120)
    acked = sum(100 for load in loads for t in load.acks if began <= t < began + seconds)
    return acked / seconds


def steady(acks: list[float], start: float, end: float, gap_s: float = 2.0) -> dict[str, float]:
    """From a fault at ``start`` to the next phase's ``end``: ``recovery_s``, until acknowledgements flowed for good
    (the end of the last gap of more than ``gap_s`` without one; 0: none), and ``stalled_s``, the time in gaps of
    more than 1 s (the load's pace is one batch every 0.2 s)."""
    times = [start, *sorted(t for t in acks if start <= t < end)]
    gaps = [(a, b) for a, b in itertools.pairwise(times) if b - a > 1.0]
    recovery = max((b - start for a, b in gaps if b - a > gap_s), default=0.0)
    return {"recovery_s": round(recovery, 2), "stalled_s": round(sum(b - a for a, b in gaps), 2)}


def all_stored(deployment: Deployment, sent: dict[str, str]) -> bool | None:
    return span_counts(deployment.reader, "fulmen", sent).row()["lost"] == 0 or None


async def in_sync(deployment: Deployment, replicas: int) -> bool | None:
    settings = FulmenSettings(kafka={"bootstrap": deployment.bootstrap})
    return all(s.in_sync == replicas for s in await describe_topics(settings)) or None


async def faults(
    deployment: Deployment, load: SpanLoad, partition_s: float, starts: dict[str, float]
) -> dict[str, dict[str, float]]:
    """Each fault in turn under ``load`` (module docstring): per fault the first acknowledgement after it
    (``first_ack_s``); ``starts`` gets each phase's start, for :func:`steady`."""
    figures: dict[str, dict[str, float]] = {}

    async def acked_after(moment: float, count: int = 5) -> float:
        await until(lambda: sum(t >= moment for t in load.acks) >= count or None, 180, "acknowledgements")
        return round((first_after(load.acks, moment) or moment) - moment, 2)

    def begin(phase: str) -> float:
        load.phase, at = phase, time.time()
        starts[phase] = at
        return at

    async def back_in_sync() -> None:
        await until(lambda: asyncio.run(in_sync(deployment, 3)), 180, "every replica back in sync")

    victim, node = deployment.brokers[1], deployment.nodes[1]
    at = begin("broker_host_killed")
    await asyncio.to_thread(victim.kill)
    figures[load.phase] = {"first_ack_s": await acked_after(at)}
    await asyncio.to_thread(node.start)
    await back_in_sync()

    victim = deployment.brokers[2]
    at = begin("broker_host_partitioned")
    await asyncio.to_thread(victim.partition)
    figures[load.phase] = {"first_ack_s": await acked_after(at)}
    await asyncio.sleep(max(0.0, partition_s - (time.time() - at)))
    await asyncio.to_thread(victim.heal)
    await back_in_sync()
    figures[load.phase]["partitioned_s"] = round(time.time() - at, 1)

    at = begin("otlp_gateway_host_killed")
    await asyncio.to_thread(deployment.gateway.kill)
    deployment.start_gateway()
    figures[load.phase] = {"first_ack_s": await acked_after(at)}

    at = begin("consumers_host_killed")
    await asyncio.to_thread(deployment.store.kill)
    await asyncio.sleep(2)
    deployment.start_consumers()
    await deployment.ready()
    sent_so_far = dict(load.sent)
    await until(lambda: all_stored(deployment, sent_so_far), 300, "every span acknowledged so far in the store")
    figures[load.phase] = {"recovery_s": round(time.time() - at, 2)}
    return figures


async def checkpoint_fetch(network: Network, mb: int, work: Path) -> float:
    """Seconds from the upload's start to the checkpoint fetched and checked on a host with no shared disk."""
    s3_host, fetcher = network.host("s3"), network.host("fetcher")
    if mb > 0:
        folder = work / "checkpoint"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(os.urandom(mb * 1024 * 1024))
        (folder / "config.json").write_text("{}")
    else:
        from fulmen.pretrained import ensure_smollm2

        folder = ensure_smollm2()
    server = SeaweedS3(s3_host.root / "seaweedfs", s3_host.address, launcher=s3_host.launcher)
    await asyncio.to_thread(server.start)
    try:
        os.environ.update(server.environment())
        uri = f"s3://{server.bucket}/runs/bench/v1"
        began = time.monotonic()
        await asyncio.to_thread(upload_dir, folder, uri)
        fetch = (
            "import sys; from pathlib import Path; from fulmen.infra.objectstore import download_dir; "
            f"download_dir({uri!r}, Path({str(fetcher.root / 'model-cache')!r}))"
        )
        env = {**os.environ, **server.environment()}
        process = fetcher.spawn([sys.executable, "-c", fetch], env, "fetch")
        code = await asyncio.to_thread(process.wait, 600)
        if code != 0:
            raise SystemExit(f"the fetch on {fetcher.name} failed: {(fetcher.root / 'fetch.log').read_text()[-2000:]}")
        return round(time.monotonic() - began, 2)
    finally:
        server.stop()


async def one_host(network: Network, seconds: float) -> float:
    solo = network.host("solo")
    deployment = await Deployment([solo], solo, solo).start()
    try:
        return await throughput(deployment, seconds)
    finally:
        solo.kill()


async def spans_part(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    result: dict[str, Any] = {"finished": ""}
    with Network(work / "hosts") as network:
        brokers = [network.host(f"kafka{i}") for i in (1, 2, 3)]
        extra = {"FULMEN_KAFKA_REQUEST_TIMEOUT_MS": str(args.request_timeout_ms)} if args.request_timeout_ms else {}
        deployment = Deployment(brokers, network.host("store"), network.host("gateway"), extra_env=extra)
        await deployment.start()
        result["request_timeout_ms"] = args.request_timeout_ms or "default"
        result["spans_per_s"] = round(await throughput(deployment, args.seconds), 1)
        load, stop = SpanLoad(deployment.url, batch=20, batches_per_s=5.0, phase="before"), asyncio.Event()
        loading = asyncio.create_task(load.run(stop))
        try:
            await asyncio.sleep(5)
            starts: dict[str, float] = {}
            result["faults"] = await faults(deployment, load, args.partition_s, starts)
            load.phase, starts["after"] = "after", time.time()
            await asyncio.sleep(5)
        finally:
            stop.set()
            await asyncio.wait_for(loading, 180)
        phases = list(starts)
        for phase, following in itertools.pairwise(phases):
            if phase != "consumers_host_killed":  # its recovery is the store's, already measured
                result["faults"][phase] |= steady(load.acks, starts[phase], starts[following])
        await until(lambda: all_stored(deployment, load.sent), 300, "every acknowledged span in the store")
        counts = span_counts(deployment.reader, "fulmen", load.sent)
        result |= {"spans": counts.row()["sent"], "lost": counts.row()["lost"], "doubled": counts.row()["doubled"]}
        result["by_phase"] = {p: counts.row(p) for p in ("before", *result["faults"], "after")}
        result["checkpoint_fetch_s"] = await checkpoint_fetch(network, args.checkpoint_mb, work)
        result["checkpoint"] = "smollm2-135m" if args.checkpoint_mb <= 0 else f"random-{args.checkpoint_mb}mb"
        result["hosts"] = len(network.hosts)
        for host in list(network.hosts.values()):
            host.kill()
        result["spans_per_s_one_host"] = round(await one_host(network, args.seconds), 1)
    return result | {"finished": time.strftime("%Y-%m-%d %H:%M")}


async def training_part(args: argparse.Namespace, work: Path, *, wan: bool = False) -> dict[str, Any]:
    from bench.chaos import Plan
    from bench.cluster_training import train_across_hosts

    env = {"FULMEN_KAFKA_REQUEST_TIMEOUT_MS": str(args.request_timeout_ms)} if args.request_timeout_ms else {}
    if wan:  # the runner's host killed while its links to the gateways are slow and lossy
        only, extra = ["runner"], {"wan": {"latency_ms": args.latency_ms, "loss": args.loss}}
    else:  # every role's host killed in turn, the trainer a torchrun job of two hosts
        only, extra = list(TRAINING_FAULTS), {"trainer_nodes": 2}
    with Network(work / "hosts") as network:
        report = await train_across_hosts(network, work / "operator", Plan.quick(), only, env=env, **extra)
    return report | {"finished": time.strftime("%Y-%m-%d %H:%M")}


async def wan_part(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    return await training_part(args, work, wan=True)


def combined(parts: dict[str, Any]) -> dict[str, Any]:
    """The issue's keys from the parts run so far (a part not run yet adds nothing)."""
    spans = parts.get("spans") or {}
    runs = [parts[name] for name in ("training", "wan") if parts.get(name)]
    faults = dict(spans.get("faults") or {})
    keep = ("recovery_s", "down_s", "sent", "lost", "doubled")
    for name, run in (("training", parts.get("training")), ("wan", parts.get("wan"))):
        for phase, fault in TRAINING_FAULTS.items():
            if run and phase in run:
                faults[fault if name == "training" else f"{fault}_over_slow_link"] = {
                    k: run[phase].get(k) for k in keep
                }
    units = [unit for run in runs for unit in (run.get("totals") or {}).values()]  # spans, calls, rollouts...

    def summed(key: str) -> int:
        return (spans.get(key) or 0) + sum(unit.get(key) or 0 for unit in units)

    def sent(kind: str) -> int:
        return sum(((run.get("totals") or {}).get(kind) or {}).get("sent") or 0 for run in runs)

    return {
        "bench": "cluster",
        "hosts": max([spans.get("hosts") or 0, *(len(run.get("hosts") or {}) for run in runs)]),
        "rollouts": sent("rollouts") if runs else None,
        "spans": (spans.get("spans") or 0) + sent("spans"),
        "lost": summed("lost"),
        "doubled": summed("doubled"),
        "faults": faults,
        "checkpoint_fetch_s": spans.get("checkpoint_fetch_s"),
        "spans_per_s": spans.get("spans_per_s"),
        "spans_per_s_one_host": spans.get("spans_per_s_one_host"),
        "request_timeout_ms": spans.get("request_timeout_ms"),
        "not_measured": NOT_MEASURED,
        "parts": parts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-mb", type=int, default=0, help="0: SmolLM2-135M's checkpoint")
    parser.add_argument("--partition-s", type=float, default=30.0)
    parser.add_argument("--seconds", type=float, default=15.0, help="each throughput window")
    parser.add_argument(
        "--request-timeout-ms", type=int, default=0, help="FULMEN_KAFKA_REQUEST_TIMEOUT_MS of every Fulmen process"
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--latency-ms", type=int, default=50, help="the wan part: latency added each way")
    parser.add_argument("--loss", type=float, default=0.01, help="the wan part: share of connections reset")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the JSON file the parts are merged into")
    args = parser.parse_args()
    chosen = [part.strip() for part in args.parts.split(",") if part.strip()]
    if unknown := set(chosen) - set(PARTS):
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    why_not = unavailable()
    if why_not:
        raise SystemExit(f"hosts cannot be made here: {why_not}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "aiokafka"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    previous = json.loads(args.results.read_text()) if args.results.is_file() else {}
    parts = dict(previous.get("parts") or ({"spans": previous} if "spans_per_s" in previous else {}))
    for part in chosen:
        work = Path(tempfile.mkdtemp(prefix=f"fulmen-cluster-{part}-"))
        try:
            run = {"spans": spans_part, "training": training_part, "wan": wan_part}[part]
            parts[part] = asyncio.run(run(args, work))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        args.results.write_text(json.dumps(combined(parts), indent=1) + "\n")  # kept before the next part
    print(json.dumps(combined(parts)))


if __name__ == "__main__":
    main()
