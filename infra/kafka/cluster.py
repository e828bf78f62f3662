"""The local Kafka as a whole: one node (as the demo and the tests run it) or a KRaft cluster of several.

A cluster of N nodes (``FULMEN_BROKER_NODES``, ``fulmen kafka up --brokers N``) is N :class:`LocalKafka` nodes from
the same jars, each a broker and a controller in its own JVM, with distinct ports (node i on
``FULMEN_BROKER_PORT + 2(i-1)`` and ``FULMEN_BROKER_CONTROLLER_PORT + 2(i-1)``) and its own directory
``<data dir>/cluster-<N>/node-<i>`` (storage, ``server.properties``, pid file, log). They share one cluster id and an
N-voter controller quorum (``controller.quorum.bootstrap.servers`` lists every controller; the storage of every node
is formatted with the same ``--initial-controllers``), so losing one node of three keeps both the quorum and a
leader for every partition. Topics get replication factor 3 and ``min.insync.replicas=2``
(:data:`fulmen.schemas.topics.MIN_INSYNC_REPLICAS`).

A single node keeps the layout it always had, directly in the data directory, so an existing single-node data
directory goes on working; a cluster next to it is a separate cluster (its topics and offsets are not moved), and
only one of them runs at a time (they would share ports): starting one while the other runs is a
:class:`ConfigurationError` that says what to stop or set. :func:`stop_all` stops whatever runs from a data
directory, every node of every layout.

Lifecycle: :meth:`LocalCluster.start` starts the nodes that do not run (formatting the storage of a new cluster
first), all of them before waiting for any (a node answers only once a majority of the quorum runs), and returns
once every node answers and the cluster lists all of them; :meth:`LocalCluster.stop` sends SIGTERM to every node
at once (one by one, the last ones would wait for a quorum that is gone) and SIGKILL after the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from fulmen.infra.kafka.local import BrokerStatus, ClusterRole, LocalKafka, Voter, base64_uuid, process_alive
from fulmen.infra.settings import BrokerSettings, FulmenSettings
from fulmen.schemas.errors import BrokerUnavailableError, ConfigurationError

__all__ = [
    "ClusterStatus",
    "LocalCluster",
    "format_cluster",
    "quorum_leader",
    "running_layouts",
    "stop_all",
    "wait_members",
]

log = logging.getLogger(__name__)

_PORT_HINT = "choose FULMEN_BROKER_PORT and FULMEN_BROKER_CONTROLLER_PORT so that node i's ports (+2 per node) differ"


@dataclass(frozen=True)
class ClusterStatus:
    """Every node's status; ``running`` only when all of them run."""

    nodes: list[BrokerStatus]
    bootstrap: str
    data_dir: Path

    @property
    def running(self) -> bool:
        return all(n.running for n in self.nodes)

    @property
    def any_running(self) -> bool:
        return any(n.running for n in self.nodes)


class LocalCluster:
    """The local Kafka of ``nodes`` nodes (1: the single node in ``data_dir`` itself), identified by its data
    directory. ``ports`` (client, controller) per node replace the layout derived from ``broker`` (tests)."""

    def __init__(
        self,
        broker: BrokerSettings,
        data_dir: Path,
        nodes: int | None = None,
        ports: list[tuple[int, int]] | None = None,
    ) -> None:
        count = broker.nodes if nodes is None else nodes
        if count < 1:
            raise ConfigurationError("a local Kafka needs at least one node (FULMEN_BROKER_NODES)")
        layout = broker.model_copy(update={"nodes": count}).node_ports() if ports is None else ports
        if len(layout) != count:
            raise ConfigurationError(f"{count} nodes need {count} (port, controller port) pairs, not {len(layout)}")
        flat = [p for pair in layout for p in pair]
        if len(set(flat)) != len(flat) or max(flat) > 65535:
            raise ConfigurationError(f"the {count} local Kafka nodes need distinct ports up to 65535: {_PORT_HINT}")
        self.broker = broker
        self.data_dir = data_dir
        self.size = count
        self.home = data_dir if count == 1 else cluster_dir(data_dir, count)
        if count == 1:
            port, controller = layout[0]
            self.nodes = [LocalKafka(broker.model_copy(update={"port": port, "controller_port": controller}), data_dir)]
            return
        voters = tuple(Voter(i + 1, broker.host, controller) for i, (_, controller) in enumerate(layout))
        self.nodes = [
            LocalKafka(
                broker.model_copy(update={"port": port, "controller_port": controller}),
                self.home / f"node-{i + 1}",
                ClusterRole(i + 1, voters),
            )
            for i, (port, controller) in enumerate(layout)
        ]

    @classmethod
    def from_settings(cls, settings: FulmenSettings) -> LocalCluster:
        return cls(settings.broker, settings.broker_data_dir)

    @property
    def bootstrap(self) -> str:
        return ",".join(node.bootstrap for node in self.nodes)

    def node(self, node_id: int) -> LocalKafka:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(f"no node {node_id}; nodes: {', '.join(str(n.node_id) for n in self.nodes)}")

    def fetch(self) -> Path:
        return self.nodes[0].fetch()

    def quorum_leader(self) -> int | None:
        """The node that leads the controller quorum (:func:`quorum_leader`)."""
        return quorum_leader(self.nodes)

    def status(self) -> ClusterStatus:
        return ClusterStatus([n.status() for n in self.nodes], self.bootstrap, self.home)

    # --- lifecycle ------------------------------------------------------------------------------------------
    def check_ports(self) -> list[LocalKafka]:
        """The nodes that do not run, once every port they need is known free (ConfigurationError naming a taken
        one): checked before any JVM starts, so a taken port never leaves a half-started cluster, and by callers
        before a long preparation (the demo's warm-up) so it does not fail only at the end."""
        self._refuse_other_layouts()
        stopped = [n for n in self.nodes if not n.status().running]
        for node in stopped:
            node.check_ports()
        return stopped

    def start(self) -> ClusterStatus:
        """Start every node that does not run; return once all answer and the cluster lists every broker."""
        stopped = self.check_ports()
        if self.size > 1:
            self._format_if_new()
        spawned = [(node, node.launch()) for node in stopped]
        for node, process in spawned:
            node.wait_ready(process)
        for node in self.nodes:
            if node not in stopped:
                node.wait_ready()
        if self.size > 1:
            self._wait_members()
        return self.status()

    def stop(self, grace_s: float = 30.0) -> bool:
        """Stop every node (SIGTERM to all at once, SIGKILL after ``grace_s``). False if none was running."""
        return _stop_nodes(self.nodes, grace_s)

    def kill(self, node_id: int) -> int:
        """SIGKILL one node's JVM, as a crash would (no controlled shutdown); its pid."""
        pid = self.node(node_id).status().pid
        if pid is None:
            raise BrokerUnavailableError(f"node {node_id} of the local Kafka is not running")
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        log.warning("local Kafka node %d (pid %d) killed with SIGKILL", node_id, pid)
        return pid

    # --- internals ------------------------------------------------------------------------------------------
    def _refuse_other_layouts(self) -> None:
        for size, statuses in running_layouts(self.data_dir).items():
            if size == self.size:
                continue
            what = "a single-node local Kafka" if size == 1 else f"a local Kafka cluster of {size} nodes"
            pids = ", ".join(str(s.pid) for s in statuses)
            use = "unset FULMEN_BROKER_NODES" if size == 1 else f"set FULMEN_BROKER_NODES={size}"
            raise ConfigurationError(
                f"{what} runs from {self.data_dir} (pid {pids}): stop it first with `fulmen kafka down`, or use "
                f"it ({use}, or pass --brokers {size})"
            )

    def _format_if_new(self) -> None:
        formatted = [n.node_id for n in self.nodes if n.formatted]
        if len(formatted) == self.size:
            return
        if formatted:
            missing = [str(n.logs_dir) for n in self.nodes if not n.formatted]
            raise ConfigurationError(
                f"the local Kafka cluster in {self.home} has formatted storage on nodes "
                f"{', '.join(map(str, formatted))} but none in {', '.join(missing)}: restore it, or remove "
                f"{self.home} to start a new cluster (its data is lost)"
            )
        if (self.data_dir / "logs" / "meta.properties").exists():
            log.warning(
                "a single-node Kafka's data is in %s: the %d-node cluster in %s is a new cluster without its "
                "topics and offsets (it is kept; unset FULMEN_BROKER_NODES to run it again)",
                self.data_dir,
                self.size,
                self.home,
            )
        cluster_id = format_cluster(self.nodes)
        log.info("local Kafka cluster %s of %d nodes formatted in %s", cluster_id, self.size, self.home)

    def _wait_members(self) -> None:
        wait_members(self.nodes, self.broker.start_timeout_s)


def quorum_leader(nodes: list[LocalKafka]) -> int | None:
    """The node that leads the controller quorum (the active controller), as the running nodes last recorded it
    (``quorum-state`` in each node's metadata log); None if none knows a running leader (an election is under
    way). Clients cannot ask for it: the metadata a broker answers names some broker as "controller", not the
    quorum's leader."""
    best: tuple[int, int] | None = None
    running = {node.node_id for node in nodes if node.status().running}
    for node in nodes:
        if node.node_id not in running:
            continue
        with contextlib.suppress(OSError, ValueError, KeyError):
            text = (node.logs_dir / "__cluster_metadata-0" / "quorum-state").read_text()
            state = json.loads(text)
            epoch, leader = int(state["leaderEpoch"]), int(state["leaderId"])
            if leader >= 0 and (best is None or epoch > best[0]):
                best = (epoch, leader)
    return best[1] if best is not None and best[1] in running else None


def format_cluster(nodes: list[LocalKafka]) -> str:
    """Format every node's storage as one new cluster whose controller quorum is all of them; its id."""
    cluster_id = base64_uuid()
    quorum = ",".join(f"{n.node_id}@{n.broker.host}:{n.broker.controller_port}:{base64_uuid()}" for n in nodes)
    for node in nodes:
        node.format(cluster_id, quorum)
    return cluster_id


def wait_members(nodes: list[LocalKafka], timeout_s: float) -> None:
    """Until the cluster's metadata lists every node (topics get all their replicas only then)."""
    from fulmen.infra.kafka.admin import cluster_info  # local import: admin needs aiokafka, this module need not

    bootstrap = ",".join(node.bootstrap for node in nodes)
    settings = FulmenSettings(kafka={"bootstrap": bootstrap, "connect_timeout_s": 5.0})
    deadline = time.monotonic() + timeout_s
    while True:
        brokers: list[int] = []
        with contextlib.suppress(BrokerUnavailableError):
            brokers = sorted(b["node_id"] for b in asyncio.run(cluster_info(settings))["brokers"])
        if len(brokers) == len(nodes):
            return
        if time.monotonic() > deadline:
            raise BrokerUnavailableError(
                f"the Kafka cluster at {bootstrap} lists brokers {brokers} after {timeout_s:g}s, not all "
                f"{len(nodes)}; logs: " + ", ".join(str(n.log_file) for n in nodes)
            )
        time.sleep(0.3)


def cluster_dir(data_dir: Path, nodes: int) -> Path:
    """Where a local cluster of ``nodes`` nodes keeps its nodes' directories."""
    return data_dir / f"cluster-{nodes}"


def running_layouts(data_dir: Path) -> dict[int, list[BrokerStatus]]:
    """What runs from ``data_dir``: the running nodes of each layout by its size (1 = the single node)."""
    found: dict[int, list[BrokerStatus]] = {}
    for size, nodes in _layouts(data_dir).items():
        running = [s for s in (n.status() for n in nodes) if s.running]
        if running:
            found[size] = running
    return found


def stop_all(data_dir: Path, grace_s: float = 30.0) -> list[BrokerStatus]:
    """Stop every node that runs from ``data_dir``, of every layout; the nodes that were running."""
    layouts = _layouts(data_dir)
    running = [n for nodes in layouts.values() for n in nodes if n.status().running]
    statuses = [n.status() for n in running]
    _stop_nodes(running, grace_s)
    return statuses


def _layouts(data_dir: Path) -> dict[int, list[LocalKafka]]:
    """Every layout with a node started in ``data_dir`` (one that has a pid file; its ports and node id are read
    back from the ``server.properties`` it was started with, never assumed)."""
    layouts: dict[int, list[LocalKafka]] = {}
    if (single := _started_node(data_dir, cluster=False)) is not None:
        layouts[1] = [single]
    for directory in sorted(data_dir.glob("cluster-*")):
        size = directory.name.removeprefix("cluster-")
        nodes = [n for path in sorted(directory.glob("node-*")) if (n := _started_node(path, cluster=True))]
        if size.isdigit() and nodes:
            layouts[int(size)] = nodes
    return layouts


def _started_node(path: Path, *, cluster: bool) -> LocalKafka | None:
    """The node started from ``path`` as its properties describe it (None: never started there)."""
    try:
        text = (path / "server.properties").read_text() if (path / "broker.pid").exists() else ""
    except OSError:
        return None
    props = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    listeners = dict(
        (name, address.rpartition(":"))
        for name, _, address in (item.partition("://") for item in props.get("listeners", "").split(","))
    )
    try:
        host, _, port = listeners["PLAINTEXT"]
        controller = int(listeners["CONTROLLER"][2])
        node_id = int(props["node.id"])
        broker = BrokerSettings(host=host, port=int(port), controller_port=controller)
    except (KeyError, ValueError):
        return None
    # A role without voters: enough to find, report and stop the node (it is never started from this object).
    return LocalKafka(broker, path, ClusterRole(node_id, ()) if cluster else None)


def _stop_nodes(nodes: list[LocalKafka], grace_s: float) -> bool:
    pids = {node: pid for node in nodes if (pid := node.status().pid) is not None}
    for node in nodes:
        if node not in pids:
            node.pid_file.unlink(missing_ok=True)
    if not pids:
        return False
    for pid in pids.values():
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(process_alive(p) for p in pids.values()):
        time.sleep(0.1)
    for node, pid in pids.items():
        if process_alive(pid):
            log.warning(
                "local Kafka node %d (pid %d) ignored SIGTERM for %.0fs: killing it", node.node_id, pid, grace_s
            )
            os.kill(pid, signal.SIGKILL)
            while process_alive(pid):
                time.sleep(0.05)
        node.pid_file.unlink(missing_ok=True)
        log.info("local Kafka node %d stopped (pid %d)", node.node_id, pid)
    return True
