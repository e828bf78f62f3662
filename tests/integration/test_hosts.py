"""Fulmen across hosts: network namespaces on one machine (:mod:`fulmen.testing.hosts`), each host its own address
and directory, nothing shared on disk.

- the network: hosts reach each other and the operator (this test), a partitioned host is unreachable until
  healed, and no host reaches an address outside the hosts' network; a host sees its own directory only;
- a Kafka cluster of three nodes on three hosts (Kafka's usual ports on each address), ``fulmen consume`` with
  its store on a fourth host, the OTLP gateway on a fifth; the operator posts OTLP span batches to the gateway's
  address and kills the host of a broker (every process in it, SIGKILL) mid-stream: every acknowledged span is
  stored exactly once (counted by SQL through the store host's read endpoint), and the time from the kill to the
  first acknowledged batch after it is recorded;
- a training run across hosts (:mod:`bench.cluster_training`), versions through the object store only, whose
  trainer host is lost with its disk: the same command resumes from the store, and nothing sent is lost or doubled.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.chaos import Plan
from bench.chaos_count import span_counts
from bench.chaos_load import SpanLoad, first_after
from bench.cluster_training import train_across_hosts
from fulmen.infra.kafka.admin import ensure_topics
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import RemoteReader
from fulmen.testing.hosts import Host, Network, reachable, start_kafka, unavailable, until
from fulmen.testing.seaweedfs import cached_weed

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

log = logging.getLogger(__name__)

WHY_NOT = unavailable()
FULMEN = [sys.executable, "-m", "fulmen.cli.main"]
TOKEN = "hosts-test-read-token"


@pytest.fixture
def network(tmp_path: Path) -> Iterator[Network]:
    if WHY_NOT is not None:
        pytest.skip(f"hosts cannot be made here: {WHY_NOT}")
    with Network(tmp_path / "hosts") as net:
        yield net


def listen(host: Host, port: int) -> subprocess.Popen[bytes]:
    server = host.spawn([sys.executable, "-m", "http.server", str(port), "--bind", host.address], os.environ, "http")
    deadline = time.monotonic() + 30
    while not reachable(host.address, port):
        assert server.poll() is None and time.monotonic() < deadline, "the http server did not start"
        time.sleep(0.2)
    return server


def outside_address() -> str:
    """An address of this machine beyond the hosts' network (its first global IPv4 address, else loopback's)."""
    done = subprocess.run(["ip", "-o", "-4", "addr", "show", "scope", "global"], capture_output=True, text=True)
    for line in done.stdout.splitlines():
        address = line.split()[3].split("/")[0]
        if not address.startswith("10.213."):
            return address
    return "127.0.0.1"


def test_hosts_reach_each_other_and_nothing_beyond(network: Network) -> None:
    a, b = network.host("a"), network.host("b")
    (a.root / "own.txt").write_text("a's")
    assert subprocess.run([*a.launcher, "cat", str(a.root / "own.txt")], capture_output=True).stdout == b"a's"
    assert subprocess.run([*b.launcher, "test", "-e", str(a.root / "own.txt")]).returncode != 0  # no shared disk
    subprocess.run([*b.launcher, "sh", "-c", f"echo b > {b.root / 'written.txt'}"], check=True)
    assert (b.root / "written.txt").read_text() == "b\n"  # what a host writes is in its directory
    listen(a, 8000)
    assert reachable(a.address, 8000) and reachable(a.address, 8000, host=b)
    outside = outside_address()
    with socket.socket() as sock:  # something listens out there, which the hosts must not reach
        sock.bind((outside, 0))
        sock.listen()
        assert reachable(outside, sock.getsockname()[1])
        assert not reachable(outside, sock.getsockname()[1], host=b)
    a.partition()
    assert not reachable(a.address, 8000) and not reachable(a.address, 8000, host=b)
    a.heal()
    deadline = time.monotonic() + 10
    while not reachable(a.address, 8000, host=b):
        assert time.monotonic() < deadline, "the healed host stayed unreachable"
    assert a.kill() >= 1 and not a.pids()


async def test_spans_through_kafka_on_three_hosts_survive_a_broker_host_killed(
    network: Network, record_property: Callable[[str, object], None]
) -> None:
    brokers = [network.host(f"kafka{i}") for i in (1, 2, 3)]
    store, gateway = network.host("store"), network.host("gateway")
    await asyncio.to_thread(start_kafka, brokers)
    bootstrap = ",".join(f"{h.address}:9092" for h in brokers)
    operator = FulmenSettings(kafka={"bootstrap": bootstrap})
    assert {(s.replicas, s.config["min.insync.replicas"]) for s in await ensure_topics(operator)} == {(3, "2")}

    base = {k: v for k, v in os.environ.items() if not k.startswith(("FULMEN_", "AWS_"))} | {
        "FULMEN_KAFKA_BOOTSTRAP": bootstrap
    }
    store.spawn(
        [*FULMEN, "consume"],
        base
        | {
            "FULMEN_HOME": str(store.root / "home"),
            "FULMEN_CLICKHOUSE_READ_HOST": store.address,
            "FULMEN_CLICKHOUSE_READ_TOKEN": TOKEN,
        },
        "consume",
    )
    gateway.spawn(
        [*FULMEN, "otlp-gateway"],
        base | {"FULMEN_HOME": str(gateway.root / "home"), "FULMEN_OTLP_HOST": gateway.address},
        "otlp-gateway",
    )
    reader = await until(lambda: RemoteReader.find(store.address, 8124, TOKEN), 120, "the store host's reads")
    await until(lambda: reachable(gateway.address, 4318) or None, 120, "the OTLP gateway")

    load, stop = SpanLoad(f"http://{gateway.address}:4318/v1/traces", batch=20, batches_per_s=5.0), asyncio.Event()
    loading = asyncio.create_task(load.run(stop))
    try:
        load.phase = "before"
        await until(lambda: len(load.acks) >= 10 or None, 60, "acknowledged spans before the kill")
        victim = brokers[1]
        killed_at = time.time()
        killed = await asyncio.to_thread(victim.kill)
        load.phase = "down"
        await until(lambda: sum(t >= killed_at for t in load.acks) >= 10 or None, 120, "spans after the kill")
    finally:
        stop.set()
        await asyncio.wait_for(loading, 120)

    def all_stored() -> bool | None:
        counts = span_counts(reader, "fulmen", load.sent)
        return counts.row()["lost"] == 0 or None

    await until(all_stored, 120, "every acknowledged span in the store")
    counts = span_counts(reader, "fulmen", load.sent)
    for phase in ("before", "down"):
        row = counts.row(phase)
        assert row["sent"] > 0 and (row["lost"], row["doubled"]) == (0, 0), (phase, row)
    recovery_s = (first_after(load.acks, killed_at) or float("nan")) - killed_at
    figures = {
        "broker_host_recovery_s": round(recovery_s, 2),
        "processes_killed": killed,
        "spans": counts.row()["sent"],
    }
    log.warning("broker host killed: %s", figures)  # shown with -rA; also in the junit properties
    for name, value in figures.items():
        record_property(name, value)


async def test_a_training_run_across_hosts_resumes_from_the_store_when_the_trainer_host_is_lost(
    network: Network, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """``bench/chaos.py``'s system, each part on a host of its own (one Kafka host here; the bench has three) and
    versions through the object store only: the trainer's host is killed and comes back without its run
    directory; the same ``fulmen train`` resumes from the store, the LLM gateway on its own host serves the
    versions it fetched, and every span, call, feedback, rollout, transition and version is stored once."""
    if shutil.which("go") is None and not cached_weed().is_file():
        pytest.skip("SeaweedFS (the S3 server) is built with Go, which this machine lacks")
    report = await train_across_hosts(network, tmp_path / "operator", Plan.quick(), ["trainer"], brokers=1)
    for kind, row in report["totals"].items():
        assert row["sent"] > 0 and (row["lost"], row["doubled"]) == (0, 0), (kind, row, report["details"])
    assert report["trainer"]["recovery_s"] is not None, report["trainer"]
    versions = report["details"]["model_versions"]
    assert versions["uris"] and all(uri.startswith("s3://fulmen/runs/chaos/v") for uri in versions["uris"]), versions
    assert max(versions["served"]) >= 1, versions  # the gateway on its host served a version fetched from the store
    for name, value in (("trainer_host_recovery_s", report["trainer"]["recovery_s"]), ("wall_s", report["wall_s"])):
        record_property(name, value)
