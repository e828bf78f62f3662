"""A training run across hosts, with hosts lost: ``bench/chaos.py``'s whole system, each part on a host of its own
(:mod:`fulmen.testing.hosts`: a network namespace, its own address and ``FULMEN_HOME``, nothing shared on disk).

Hosts: the Kafka nodes (``kafka1..N``), ``store`` (``fulmen consume`` and its store, reads served with a token),
``otlp`` (the OTLP gateway), ``llm`` (the LLM gateway), ``runner`` (``fulmen runner`` with the chaos agent),
``trainer`` (``fulmen train``; with ``trainer_nodes=2`` rank 0 of a torchrun job whose rank 1 is on ``trainer2``,
with no model on its disk) and ``s3`` (SeaweedFS). Versions go through the object store only: the trainer
uploads each one and publishes its ``s3://`` URI, the LLM gateway fetches it into its own cache before serving
it. The base model is installed on the two machines that load it (copied once, as an image would hold it).

Each phase kills a whole host (every process on it, SIGKILL) and starts its command again on it; the trainer's
host comes back without its run directory (a replaced machine), so the same ``fulmen train`` command resumes
from the latest version in the store. Meanwhile the chaos load runs: OTLP span batches, direct LLM calls and
feedback from the operator, ``fulmen submit`` tasks and the trainer's own rollouts. At the end everything sent
is counted in the store by SQL (:mod:`bench.chaos_count`): nothing may be lost or doubled.

With ``wan``, the runner reaches both gateways through a slow, lossy link: a Toxiproxy on host ``wan``
(:mod:`fulmen.testing.toxiproxy`; this kernel has no netem) adding latency each way and resetting a share of the
connections as they open.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.chaos import Chaos, Placement, Plan
from fulmen.infra.kafka.cluster import quorum_leader
from fulmen.testing.hosts import Host, Network, start_kafka
from fulmen.testing.seaweedfs import SeaweedS3
from fulmen.testing.toxiproxy import Toxiproxy

__all__ = ["HOSTS", "HostKafka", "train_across_hosts"]

HOSTS = {"consume": "store", "otlp_gateway": "otlp", "llm_gateway": "llm", "runner": "runner", "trainer": "trainer"}
TOKEN = "cluster-training-read-token"


class HostKafka:
    """Kafka nodes on hosts, as the chaos bench's broker: :meth:`kill9` takes the host of the node that leads the
    controller quorum down (every process on it), :meth:`start` starts what does not run."""

    name = "broker"

    def __init__(self, hosts: Sequence[Host]) -> None:
        self.hosts = list(hosts)
        self.nodes: list[Any] = []
        self.started_at = 0.0
        self.exits: list[int] = []
        self.killed_node: int | None = None

    @property
    def kafka(self) -> HostKafka:
        return self  # what the chaos bench asks of a cluster: nodes, bootstrap, quorum_leader

    @property
    def bootstrap(self) -> str:
        return ",".join(f"{host.address}:9092" for host in self.hosts)

    def quorum_leader(self) -> int | None:
        return quorum_leader(self.nodes)

    @property
    def alive(self) -> bool:
        return bool(self.nodes) and all(node.status().running for node in self.nodes)

    def start(self) -> float:
        self.started_at = time.time()
        if not self.nodes:
            self.nodes = start_kafka(self.hosts)
            return self.started_at
        for node in self.nodes:
            node.start()
        return self.started_at

    def kill9(self) -> int:
        leader = self.quorum_leader() if len(self.nodes) > 1 else None
        self.killed_node = leader if leader is not None else self.nodes[0].node_id
        return self.hosts[self.killed_node - 1].kill()

    def stop(self, grace_s: float) -> None:
        for node in self.nodes:
            node.stop(grace_s)


async def train_across_hosts(
    network: Network,
    work: Path,
    plan: Plan,
    only: Sequence[str],
    *,
    brokers: int = 3,
    trainer_nodes: int = 1,
    wan: dict[str, float] | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The run (module docstring) on ``network``: the chaos report, with ``hosts`` (name: address) added.
    ``trainer_nodes`` > 1: the trainer is a torchrun job of that many hosts (``trainer``, ``trainer2``...; phases
    ``trainer_node2``...), the ranks beyond rank 0's host fetching the model from the store. ``wan``: the runner
    reaches both gateways through a Toxiproxy on host ``wan`` with these :meth:`Toxiproxy.wan` settings
    (``latency_ms``, ``loss``). ``env``: more variables for every Fulmen process
    (``FULMEN_KAFKA_REQUEST_TIMEOUT_MS``...)."""
    kafka = HostKafka([network.host(f"kafka{i}") for i in range(1, brokers + 1)])
    hosts = {component: network.host(name) for component, name in HOSTS.items()}
    hosts |= {f"trainer_node{n}": network.host(f"trainer{n}") for n in range(2, trainer_nodes + 1)}
    s3_host = network.host("s3")
    server = SeaweedS3(s3_host.root / "seaweedfs", s3_host.address, launcher=s3_host.launcher)
    server.start()
    placement = Placement(
        hosts=hosts,
        broker=kafka,
        env=server.environment()
        | {"FULMEN_TRAIN_CHECKPOINT_URI": f"s3://{server.bucket}/runs", "FULMEN_CLICKHOUSE_READ_TOKEN": TOKEN}
        | (env or {}),
        trainer_disk_lost=True,
        trainer_nodes=trainer_nodes,
        runner_via=network.host("wan") if wan is not None else None,
    )
    chaos = Chaos(plan, work, placement=placement)
    proxy = None
    try:
        if wan is not None:
            proxy = slow_links(chaos, wan)
        report = await chaos.run(list(only))
    finally:
        chaos.fleet.stop(grace_s=20.0)
        server.stop()
        if proxy is not None:
            proxy.stop()
    return report | {"hosts": {host.name: host.address for host in network.hosts.values()}, "wan": wan}


def slow_links(chaos: Chaos, wan: dict[str, float]) -> Toxiproxy:
    """Toxiproxy on the ``wan`` host, forwarding the runner's calls to the LLM and OTLP gateways (the same ports),
    each link made a slow, lossy one."""
    via = chaos.placement.runner_via
    proxy = Toxiproxy(via.address, via.root, launcher=via.launcher).start()
    for name, component, port in (("llm", "llm_gateway", chaos.ports.llm), ("otlp", "otlp_gateway", chaos.ports.otlp)):
        proxy.proxy(name, port, f"{chaos.address(component)}:{port}")
        proxy.wan(name, latency_ms=int(wan.get("latency_ms", 50)), loss=float(wan.get("loss", 0.01)))
    return proxy
