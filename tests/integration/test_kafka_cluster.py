"""A local Kafka cluster of three KRaft nodes (`fulmen kafka up --brokers 3`): the command line, replication, and
kill -9 of one node in the middle of span ingest and rollouts: nothing lost, nothing doubled, the gateway recovers.

One cluster for the module, started and stopped by the CLI as a user would (its own FULMEN_HOME and ports).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bench.chaos_count import Phases, rollout_counts, rollout_facts, span_counts
from bench.chaos_load import SpanLoad
from fulmen.consumers import EVENT_SINKS, SpanSink
from fulmen.infra.kafka.admin import cluster_info, describe_topics, ensure_topics
from fulmen.infra.kafka.cluster import LocalCluster
from fulmen.infra.processes import port_is_free
from fulmen.infra.settings import BrokerSettings, FulmenSettings
from fulmen.infra.store import Store
from fulmen.schemas import TOPICS, RolloutRequest
from fulmen.schemas.errors import BrokerUnavailableError
from tests.conftest import make_settings
from tests.integration.span_pipeline import span_pipeline
from tests.integration.test_cli import run
from tests.integration.test_runner import events_by_rollout, runner_running, submit

pytestmark = [pytest.mark.integration, pytest.mark.scale]

log = logging.getLogger(__name__)

HEAP = "384m"  # per node: three JVMs share the machine
WAVE = 6  # rollouts submitted in each phase
AGENT = "tests.agents.simple:echo_reward"


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive free ports on loopback, below the kernel's ephemeral range (where an
    outgoing connection could take one before its node binds it; see ``free_port``)."""
    for _ in range(500):
        base = random.randint(16_384, 32_768 - count)
        if all(port_is_free("127.0.0.1", base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports found")


@dataclass
class Cluster:
    local: LocalCluster
    env: dict[str, str]
    up_output: str


@pytest.fixture(scope="module")
def kafka_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Three nodes started with `fulmen kafka up --brokers 3` (node i on base + 2(i-1), controller one above),
    stopped with `fulmen kafka down`."""
    home = tmp_path_factory.mktemp("cluster-home")
    base = free_port_run(6)
    env = {
        "FULMEN_HOME": str(home),
        "FULMEN_BROKER_PORT": str(base),
        "FULMEN_BROKER_CONTROLLER_PORT": str(base + 1),
        "FULMEN_BROKER_HEAP": HEAP,
        "FULMEN_CLICKHOUSE_READ_PORT": "0",
    }
    local = LocalCluster(BrokerSettings(port=base, controller_port=base + 1, heap=HEAP, nodes=3), home / "kafka")
    try:
        up = run(["kafka", "up", "--brokers", "3"], env)
        assert up.returncode == 0, up.stdout + up.stderr
        yield Cluster(local, env, up.stdout)
        down = run(["kafka", "down"], env)
        assert down.returncode == 0, down.stdout + down.stderr
        assert all(f"node {i} (127.0.0.1:{base + 2 * (i - 1)})" in down.stdout for i in (1, 2, 3)), down.stdout
        assert not local.status().any_running
    finally:
        local.stop()


def test_kafka_up_brokers_3_is_a_replicated_cluster_that_status_and_down_handle(kafka_cluster: Cluster) -> None:
    local, env = kafka_cluster.local, kafka_cluster.env
    assert f"local cluster of 3 nodes ready at {local.bootstrap}" in kafka_cluster.up_output
    assert "FULMEN_BROKER_NODES=3" in kafka_cluster.up_output
    # Three nodes, one cluster id, one quorum of every node's controller, distinct directories.
    meta = [(n.logs_dir / "meta.properties").read_text() for n in local.nodes]
    assert len({line for m in meta for line in m.splitlines() if line.startswith("cluster.id=")}) == 1
    assert [f"node.id={i}" in m for i, m in zip((1, 2, 3), meta, strict=True)] == [True] * 3
    quorum = ",".join(f"127.0.0.1:{n.broker.controller_port}" for n in local.nodes)
    assert all(f"controller.quorum.bootstrap.servers={quorum}\n" in n.properties_file.read_text() for n in local.nodes)
    assert len({n.data_dir for n in local.nodes}) == 3
    status = run(["kafka", "status"], env | {"FULMEN_BROKER_NODES": "3"})
    assert status.returncode == 0, status.stdout + status.stderr
    for node in local.nodes:
        assert f"local Kafka node {node.node_id}: running (pid {node.status().pid})" in status.stdout
        assert f"{node.node_id}={node.bootstrap}" in status.stdout
    assert f"controller quorum leader: node {local.quorum_leader()}" in status.stdout
    states = asyncio.run(describe_topics(FulmenSettings(kafka={"bootstrap": local.bootstrap})))
    assert {s.name: (s.replicas, s.in_sync, s.config.get("min.insync.replicas")) for s in states} == {
        t.name: (3, 3, "2") for t in TOPICS.values()
    }
    # The single node of the same home would take node 1's ports: refused with what to do instead.
    single = run(["kafka", "up"], env)
    assert single.returncode == 1
    assert "a local Kafka cluster of 3 nodes runs from" in single.stderr and "FULMEN_BROKER_NODES=3" in single.stderr


@dataclass
class Scenario:
    """The load and what it saw: span batches through the OTLP gateway and waves of rollouts, by phase."""

    settings: FulmenSettings
    store: Store
    spans: SpanLoad
    phases: Phases = field(default_factory=Phases)
    tasks: list[tuple[float, RolloutRequest]] = field(default_factory=list)
    submit_retries: int = 0

    def begin(self, phase: str) -> None:
        self.phases.begin(phase, time.time())
        self.spans.phase = phase

    async def wave(self, phase: str) -> None:
        """Submit WAVE rollouts; a publish that fails (the cluster is electing leaders) is sent again."""
        requests = [
            RolloutRequest(task_id=f"{phase}-{i}", group_id=f"g-{phase}", input={"reward": 1.0}) for i in range(WAVE)
        ]
        while True:
            try:
                await submit(self.settings, requests)
                break
            except BrokerUnavailableError:
                self.submit_retries += 1
                await asyncio.sleep(0.5)
        self.tasks.extend((time.time(), r) for r in requests)

    def rollouts(self) -> tuple[Any, dict[str, Any]]:
        counts, _, detail = rollout_counts(rollout_facts(self.store, self.store.database, self.tasks, self.phases))
        return counts, detail

    def span_counts(self) -> Any:
        return span_counts(self.store, self.store.database, dict(self.spans.sent))


async def until(probe: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(0.5)


async def test_kill_9_of_one_node_mid_ingest_loses_and_doubles_nothing(
    kafka_cluster: Cluster, tmp_path: Path, store_path: Path, record_property: Callable[[str, object], None]
) -> None:
    local = kafka_cluster.local
    settings = make_settings(tmp_path, local.bootstrap, store_path)
    assert {(s.replicas, s.config["min.insync.replicas"]) for s in await ensure_topics(settings)} == {(3, "2")}
    store = Store.open(settings)
    store.migrate()
    sinks = [SpanSink(), EVENT_SINKS["rollouts"]]
    try:
        async with span_pipeline(settings, store, sinks=sinks) as pipeline, runner_running(settings, AGENT):
            scenario = Scenario(settings, store, SpanLoad(pipeline.url, batch=20, batches_per_s=5.0))
            figures = await _kill_and_rejoin(scenario, local)
        await until(lambda: _all_stored(scenario), 90, "every acknowledged span and every rollout in the store")
        spans, (rollouts, detail) = scenario.span_counts(), scenario.rollouts()
        for phase in ("before", "down", "rejoined"):
            assert spans.row(phase)["sent"] > 0 and rollouts.row(phase)["sent"] == WAVE, phase
            assert (spans.row(phase)["lost"], spans.row(phase)["doubled"]) == (0, 0), (phase, spans.row(phase))
            assert (rollouts.row(phase)["lost"], rollouts.row(phase)["doubled"]) == (0, 0), (phase, detail)
        assert detail["latest_status"] == {"succeeded": 3 * WAVE} and detail["succeeded_more_than_once"] == 0
        events = await events_by_rollout(settings)
        figures["rollouts_run_more_than_once"] = sum(
            1 for _, r in scenario.tasks if sum(e.status.value == "succeeded" for e in events[r.rollout_id]) > 1
        )
        figures |= {
            "spans_acknowledged": spans.row()["sent"],
            "submit_retries": scenario.submit_retries,
            "span_statuses": dict(scenario.spans.statuses),
        }
        log.warning("3-node kill -9 figures: %s", figures)  # shown with -rA; also in the junit properties
        for name, value in figures.items():
            record_property(name, value)
    finally:
        store.command(f"DROP DATABASE IF EXISTS {store.database}")


async def _kill_and_rejoin(scenario: Scenario, local: LocalCluster) -> dict[str, Any]:
    """Load, kill -9 the quorum leader, load with two nodes, restart it, load until it is back in every ISR."""
    load, stop = scenario.spans, asyncio.Event()
    loading = asyncio.create_task(load.run(stop))
    try:
        scenario.begin("before")
        await scenario.wave("before")
        await until(lambda: _rollouts_done(scenario, "before"), 60, "the first rollouts")
        victim = local.quorum_leader()
        assert victim is not None
        await asyncio.to_thread(local.kill, victim)
        killed = time.time()
        scenario.begin("down")
        # New clients right away, while the cluster still lists the dead node (as `fulmen submit` would start):
        # every metadata and topic request is answered (aiokafka's own admin client sends each to a random node).
        for _ in range(10):
            assert len((await cluster_info(scenario.settings))["brokers"]) in (2, 3)
            assert len(await describe_topics(scenario.settings)) == len(TOPICS)
        await scenario.wave("down")
        # Recovery with the node still down: new spans acknowledged, the rollouts submitted meanwhile done.
        await until(lambda: _acks_after(load, killed, 10), 90, "span acknowledgements after the kill")
        await until(lambda: _rollouts_done(scenario, "down"), 90, "the rollouts submitted with a node down")
        assert not local.node(victim).status().running
        new_leader, restarted = local.quorum_leader(), time.time()
        await asyncio.to_thread(local.start)  # only the killed node is started
        scenario.begin("rejoined")
        await scenario.wave("rejoined")
        await until(lambda: _in_sync(scenario.settings, 3), 120, "the restarted node back in every ISR")
        await until(lambda: _rollouts_done(scenario, "rejoined"), 60, "the rollouts after the restart")
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        await asyncio.wait_for(loading, 60)
    return load.outage(killed, restarted) | {"killed_node": victim, "quorum_leader_after": new_leader}


async def _acks_after(load: SpanLoad, moment: float, count: int) -> bool:
    return sum(1 for t in load.acks if t >= moment) >= count


async def _rollouts_done(scenario: Scenario, phase: str) -> bool:
    counts, _ = await asyncio.to_thread(scenario.rollouts)
    return counts.row(phase)["sent"] == WAVE and counts.row(phase)["lost"] == 0


async def _in_sync(settings: FulmenSettings, replicas: int) -> bool:
    return all(s.in_sync == replicas for s in await describe_topics(settings))


async def _all_stored(scenario: Scenario) -> bool:
    spans = await asyncio.to_thread(scenario.span_counts)
    rollouts, _ = await asyncio.to_thread(scenario.rollouts)
    return spans.row()["lost"] == 0 and rollouts.row()["lost"] == 0
