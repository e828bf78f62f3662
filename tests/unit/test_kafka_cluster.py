"""The local Kafka cluster's layout, settings and bookkeeping, without Java: ports, directories, quorum,
replication, what runs from a data directory (stand-in processes that look like nodes) and how it is stopped."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fulmen.infra.kafka.admin import TopicState, _durability_drift
from fulmen.infra.kafka.clients import connection_kwargs
from fulmen.infra.kafka.cluster import LocalCluster, running_layouts, stop_all
from fulmen.infra.kafka.local import LocalKafka
from fulmen.infra.settings import BrokerSettings, FulmenSettings
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.topics import min_insync_replicas

pytestmark = pytest.mark.scale


def properties(node: LocalKafka) -> dict[str, str]:
    node.data_dir.mkdir(parents=True, exist_ok=True)
    node._write_properties()
    lines = node.properties_file.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if not line.startswith("#"))


def test_nodes_setting_gives_every_node_to_clients() -> None:
    settings = FulmenSettings(broker={"nodes": 3})
    assert settings.broker.node_ports() == [(9092, 9093), (9094, 9095), (9096, 9097)]
    assert settings.bootstrap == "127.0.0.1:9092,127.0.0.1:9094,127.0.0.1:9096"
    assert connection_kwargs(settings)["bootstrap_servers"] == ["127.0.0.1:9092", "127.0.0.1:9094", "127.0.0.1:9096"]
    assert FulmenSettings().bootstrap == "127.0.0.1:9092"  # one node, as before
    remote = FulmenSettings(kafka={"bootstrap": "k1:9092, k2:9092"}, broker={"nodes": 3})
    assert connection_kwargs(remote)["bootstrap_servers"] == ["k1:9092", "k2:9092"]


def test_a_cluster_has_a_directory_ports_and_quorum_per_node(tmp_path: Path) -> None:
    cluster = LocalCluster(BrokerSettings(port=19092, controller_port=19093), tmp_path, nodes=3)
    assert [n.data_dir for n in cluster.nodes] == [tmp_path / "cluster-3" / f"node-{i}" for i in (1, 2, 3)]
    assert cluster.bootstrap == "127.0.0.1:19092,127.0.0.1:19094,127.0.0.1:19096"
    quorum = "127.0.0.1:19093,127.0.0.1:19095,127.0.0.1:19097"
    for node_id, node in enumerate(cluster.nodes, start=1):
        props = properties(node)
        port, controller = 19092 + 2 * (node_id - 1), 19093 + 2 * (node_id - 1)
        assert props["node.id"] == str(node_id) and props["controller.quorum.bootstrap.servers"] == quorum
        assert props["listeners"] == f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}"
        assert props["log.dirs"] == str(node.logs_dir)
        for key in (
            "default.replication.factor",
            "offsets.topic.replication.factor",
            "transaction.state.log.replication.factor",
            "share.coordinator.state.topic.replication.factor",
        ):
            assert props[key] == "3", key
        for key in ("min.insync.replicas", "transaction.state.log.min.isr", "share.coordinator.state.topic.min.isr"):
            assert props[key] == "2", key
        assert "controller.quorum.voters" not in props  # a dynamic quorum: bootstrap servers + --initial-controllers


def test_one_node_keeps_the_single_node_layout(tmp_path: Path) -> None:
    single = LocalCluster(BrokerSettings(port=19092, controller_port=19093), tmp_path)
    assert [n.data_dir for n in single.nodes] == [tmp_path] and single.bootstrap == "127.0.0.1:19092"
    props = properties(single.nodes[0])
    assert props == properties(LocalKafka(BrokerSettings(port=19092, controller_port=19093), tmp_path / "plain")) | {
        "log.dirs": str(tmp_path / "logs")
    }
    assert (props["node.id"], props["default.replication.factor"], props["min.insync.replicas"]) == ("1", "1", "1")
    assert props["controller.quorum.bootstrap.servers"] == "127.0.0.1:19093"


def test_a_smaller_cluster_replicates_to_every_node(tmp_path: Path) -> None:
    props = properties(LocalCluster(BrokerSettings(), tmp_path, nodes=2).nodes[1])
    assert (props["default.replication.factor"], props["min.insync.replicas"]) == ("2", "1")


@pytest.mark.parametrize(
    ("broker", "nodes"),
    [({"port": 9092, "controller_port": 9094}, 3), ({"port": 65533, "controller_port": 65532}, 3)],
)
def test_ports_that_clash_or_overflow_are_a_configuration_error(broker: dict, nodes: int, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="distinct ports up to 65535.*FULMEN_BROKER_CONTROLLER_PORT"):
        LocalCluster(BrokerSettings(**broker), tmp_path, nodes=nodes)


def test_min_insync_replicas_only_where_three_replicas_allow_two() -> None:
    assert [min_insync_replicas(n) for n in (1, 2, 3, 5)] == [None, None, 2, 2]

    def state(replicas: int, **config: str) -> TopicState:
        return TopicState(key="spans", name="otlp_spans", exists=True, replicas=replicas, config=config)

    assert _durability_drift(state(3)) == {"min.insync.replicas": "2"}
    assert _durability_drift(state(3, **{"min.insync.replicas": "1"})) == {"min.insync.replicas": "2"}
    assert _durability_drift(state(5, **{"min.insync.replicas": "3"})) == {}  # an operator's stricter choice stays
    assert _durability_drift(state(1)) == {}


@pytest.fixture
def stand_ins() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes that look like nodes to the pid checks (their command line names kafka.Kafka and the node's
    properties file) but only sleep; killed at the end."""
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for process in processes:
        process.kill()
        process.wait()


def pretend_running(node: LocalKafka, processes: list[subprocess.Popen[bytes]]) -> int:
    """Start a stand-in for ``node`` that exits 0 on SIGTERM; its pid, once its handler is in place."""
    properties(node)
    code = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); print('ready', "
        "flush=True); time.sleep(120)"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code, "kafka.Kafka", str(node.properties_file)], stdout=subprocess.PIPE
    )
    processes.append(process)
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    node.pid_file.write_text(str(process.pid))
    return process.pid


def test_other_layouts_are_found_refused_and_stopped(tmp_path: Path, stand_ins: list) -> None:
    broker = BrokerSettings(port=19092, controller_port=19093)
    cluster = LocalCluster(broker, tmp_path, nodes=3)
    pids = [pretend_running(node, stand_ins) for node in cluster.nodes]
    assert cluster.status().running and [s.pid for s in cluster.status().nodes] == pids
    found = running_layouts(tmp_path)
    assert list(found) == [3] and [(s.node_id, s.bootstrap) for s in found[3]] == [
        (1, "127.0.0.1:19092"),
        (2, "127.0.0.1:19094"),
        (3, "127.0.0.1:19096"),
    ]
    with pytest.raises(ConfigurationError, match=r"a local Kafka cluster of 3 nodes runs from .*FULMEN_BROKER_NODES=3"):
        LocalCluster(broker, tmp_path).start()
    stopped = stop_all(tmp_path, grace_s=10)
    assert sorted(s.pid for s in stopped) == sorted(pids)
    assert running_layouts(tmp_path) == {} and not any(n.pid_file.exists() for n in cluster.nodes)
    assert all(p.wait(timeout=10) == 0 for p in stand_ins)  # SIGTERM, not SIGKILL


def test_a_running_single_node_refuses_a_cluster_next_to_it(tmp_path: Path, stand_ins: list) -> None:
    single = LocalCluster(BrokerSettings(port=19092, controller_port=19093), tmp_path)
    pretend_running(single.nodes[0], stand_ins)
    with pytest.raises(ConfigurationError, match="a single-node local Kafka runs from .*unset FULMEN_BROKER_NODES"):
        LocalCluster(BrokerSettings(port=19092, controller_port=19093), tmp_path, nodes=3).start()
    assert [s.node_id for s in stop_all(tmp_path, grace_s=10)] == [1]


def test_a_partly_formatted_cluster_is_not_formatted_again(tmp_path: Path) -> None:
    cluster = LocalCluster(BrokerSettings(port=19092, controller_port=19093), tmp_path, nodes=3)
    for node in cluster.nodes[:2]:
        node.logs_dir.mkdir(parents=True)
        (node.logs_dir / "meta.properties").write_text("cluster.id=x\n")
    with pytest.raises(ConfigurationError, match=r"formatted storage on nodes 1, 2 but none in .*node-3.*remove"):
        cluster._format_if_new()


def test_the_quorum_leader_is_read_from_the_running_nodes(tmp_path: Path, stand_ins: list) -> None:
    cluster = LocalCluster(BrokerSettings(port=19092, controller_port=19093), tmp_path, nodes=3)
    assert cluster.quorum_leader() is None
    for node, (leader, epoch) in zip(cluster.nodes, [(2, 4), (3, 5), (2, 4)], strict=True):
        pretend_running(node, stand_ins)
        state = node.logs_dir / "__cluster_metadata-0" / "quorum-state"
        state.parent.mkdir(parents=True)
        state.write_text(json.dumps({"leaderId": leader, "leaderEpoch": epoch, "votedId": -1}))
    assert cluster.quorum_leader() == 3  # the latest epoch wins
    stand_ins[2].kill()  # node 3 dies: the others still name it until they elect another
    stand_ins[2].wait()
    state = cluster.nodes[0].logs_dir / "__cluster_metadata-0" / "quorum-state"
    state.write_text(json.dumps({"leaderId": 3, "leaderEpoch": 5, "votedId": -1}))
    assert cluster.quorum_leader() is None
    state.write_text(json.dumps({"leaderId": 1, "leaderEpoch": 6, "votedId": 1}))
    assert cluster.quorum_leader() == 1
    stop_all(tmp_path, grace_s=10)
