"""One local Apache Kafka (KRaft) node, run from its Maven Central jars: a single-node Kafka, or one node of a
local cluster (:mod:`fulmen.infra.kafka.cluster` starts several and gives each its :class:`ClusterRole`).

Lifecycle: :meth:`LocalKafka.fetch` resolves the jars once into the cache (``~/.cache/fulmen/kafka-<version>``);
:meth:`LocalKafka.start` writes ``server.properties``, formats the storage the first time (a single node; the
nodes of a cluster are formatted together by the cluster), starts the JVM in its own session (it outlives the
command that started it) and returns once a real metadata request succeeds; :meth:`LocalKafka.stop` sends
SIGTERM for a controlled shutdown and SIGKILL only after the grace period. Every failure raises
:class:`ConfigurationError` (fix something and retry) or :class:`BrokerUnavailableError` with the broker's log
path and its last lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from fulmen.infra.processes import port_is_free
from fulmen.infra.settings import BrokerSettings, FulmenSettings
from fulmen.schemas.errors import BrokerUnavailableError, ConfigurationError
from fulmen.schemas.topics import min_insync_replicas

__all__ = ["BrokerStatus", "ClusterRole", "LocalKafka", "Voter", "process_alive"]

log = logging.getLogger(__name__)

_MIN_JAVA = 17
_LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class BrokerStatus:
    running: bool
    pid: int | None
    bootstrap: str
    data_dir: Path
    log_file: Path
    node_id: int = 1


@dataclass(frozen=True)
class Voter:
    """A controller of the cluster's quorum: node id and controller endpoint."""

    node_id: int
    host: str
    port: int

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class ClusterRole:
    """A node's place in a local cluster: its id and the quorum's voters (every node is broker and controller)."""

    node_id: int
    voters: tuple[Voter, ...]

    @property
    def replication_factor(self) -> int:
        """The cluster's default replication (internal topics included): 3, or every node of a smaller cluster."""
        return min(3, len(self.voters))

    @property
    def min_insync_replicas(self) -> int:
        return min_insync_replicas(self.replication_factor) or 1


class LocalKafka:
    """One local node, identified by its data directory (which holds its pid file and log).

    Without a ``role`` it is a single-node Kafka (node 1, its own quorum, replication factor 1), as the demo and
    the tests run it; with one it is a node of a local cluster, listening on ``broker.port`` and
    ``broker.controller_port``.
    """

    def __init__(
        self, broker: BrokerSettings, data_dir: Path, role: ClusterRole | None = None, launcher: tuple[str, ...] = ()
    ) -> None:
        if broker.port == broker.controller_port:
            raise ConfigurationError("FULMEN_BROKER_PORT and FULMEN_BROKER_CONTROLLER_PORT must differ")
        self.broker = broker
        self.data_dir = data_dir
        self.role = role
        self.launcher = launcher  # a prefix that runs the JVM elsewhere (another network namespace: a test's host)
        self.libs_dir = broker.cache_dir / f"kafka-{broker.version}" / "libs"
        self.log_file = data_dir / "broker.log"
        self.pid_file = data_dir / "broker.pid"
        self.properties_file = data_dir / "server.properties"
        self.logs_dir = data_dir / "logs"

    @classmethod
    def from_settings(cls, settings: FulmenSettings) -> LocalKafka:
        return cls(settings.broker, settings.broker_data_dir)

    @property
    def bootstrap(self) -> str:
        return f"{self.broker.host}:{self.broker.port}"

    @property
    def node_id(self) -> int:
        return self.role.node_id if self.role else 1

    @property
    def formatted(self) -> bool:
        """Whether the storage was formatted (it holds a cluster id and this node's id)."""
        return (self.logs_dir / "meta.properties").exists()

    # --- jars -----------------------------------------------------------------------------------------------
    def fetch(self) -> Path:
        """Resolve the broker's jars from Maven Central into the cache (once; later calls are free)."""
        if (self.libs_dir / ".complete").exists():
            return self.libs_dir
        _require_java()
        mvn = shutil.which("mvn")
        if mvn is None:
            raise ConfigurationError(
                "Maven (mvn) is needed once to fetch the Kafka jars: install it (apt-get install maven), "
                "or set FULMEN_KAFKA_BOOTSTRAP to an existing Kafka cluster"
            )
        self.libs_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="libs-", dir=self.libs_dir.parent))
        pom = resources.files("fulmen.infra.kafka").joinpath("pom.xml")
        log.info("fetching Apache Kafka %s jars from Maven Central into %s", self.broker.version, self.libs_dir)
        with resources.as_file(pom) as pom_path:
            result = subprocess.run(
                [
                    mvn,
                    "-q",
                    "-B",
                    "-f",
                    str(pom_path),
                    "dependency:copy-dependencies",
                    f"-Dkafka.version={self.broker.version}",
                    f"-DoutputDirectory={staging}",
                    "-DincludeScope=runtime",
                ],
                capture_output=True,
                text=True,
                check=False,
            )
        if result.returncode != 0 or not any(staging.glob("kafka_2.13-*.jar")):
            shutil.rmtree(staging, ignore_errors=True)
            tail = (result.stdout + result.stderr).strip().splitlines()[-_LOG_TAIL_LINES:]
            raise ConfigurationError(
                f"could not fetch Kafka {self.broker.version} jars with Maven (exit {result.returncode}); "
                "check that Maven Central is reachable:\n" + "\n".join(tail)
            )
        (staging / ".complete").write_text(self.broker.version)
        if self.libs_dir.exists():
            shutil.rmtree(self.libs_dir)
        staging.rename(self.libs_dir)
        return self.libs_dir

    # --- lifecycle ------------------------------------------------------------------------------------------
    def status(self) -> BrokerStatus:
        pid = self._live_pid()
        return BrokerStatus(pid is not None, pid, self.bootstrap, self.data_dir, self.log_file, self.node_id)

    def start(self) -> BrokerStatus:
        """Start the broker unless it already runs; return once it answers a metadata request."""
        if self._live_pid() is not None:
            self.wait_ready()
            return self.status()
        process = self.launch()
        self.wait_ready(process)
        return self.status()

    def check_ports(self) -> None:
        """ConfigurationError unless both ports of this node are free (not checked from here for a node that runs
        through a ``launcher``: its address is not this namespace's)."""
        for port in () if self.launcher else (self.broker.port, self.broker.controller_port):
            if not port_is_free(self.broker.host, port):
                raise ConfigurationError(
                    f"port {port} on {self.broker.host} is taken by another process: stop it, choose another "
                    "port (FULMEN_BROKER_PORT / FULMEN_BROKER_CONTROLLER_PORT), or if it is a Kafka broker "
                    "point FULMEN_KAFKA_BOOTSTRAP at it"
                )

    def launch(self) -> subprocess.Popen[bytes]:
        """Spawn the JVM (formatting a single node's storage the first time) without waiting for it to answer;
        a node of a cluster must have been formatted (:meth:`format`)."""
        self.check_ports()
        java = _require_java()
        libs = self.fetch()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._write_properties()
        if not self.formatted:
            if self.role is not None:
                raise ConfigurationError(f"node {self.node_id}'s storage in {self.logs_dir} is not formatted")
            self.format(base64_uuid())
        process = self._spawn(java, libs)
        self.pid_file.write_text(str(process.pid))
        log.info(
            "local Kafka node %d starting: pid %d on %s, log %s",
            self.node_id,
            process.pid,
            self.bootstrap,
            self.log_file,
        )
        return process

    def stop(self, grace_s: float = 30.0) -> bool:
        """Stop the broker (controlled shutdown, then SIGKILL after ``grace_s``). False if it was not running."""
        pid = self._live_pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and process_alive(pid):
            time.sleep(0.1)
        if process_alive(pid):
            log.warning("local Kafka pid %d ignored SIGTERM for %.0fs: killing it", pid, grace_s)
            os.kill(pid, signal.SIGKILL)
            while process_alive(pid):
                time.sleep(0.05)
        self.pid_file.unlink(missing_ok=True)
        log.info("local Kafka stopped (pid %d)", pid)
        return True

    def wait_ready(self, process: subprocess.Popen[bytes] | None = None) -> None:
        """Block until a metadata request succeeds; fail early if the process dies."""
        from fulmen.infra.kafka.admin import cluster_info  # local import: admin needs aiokafka, this module need not

        settings = FulmenSettings(kafka={"bootstrap": self.bootstrap, "connect_timeout_s": 2.0})
        deadline = time.monotonic() + self.broker.start_timeout_s
        while True:
            if process is not None and process.poll() is not None:
                raise BrokerUnavailableError(
                    f"local Kafka exited with code {process.returncode} while starting; log {self.log_file}:\n"
                    + self.log_tail()
                )
            try:
                if _accepts(self.broker.host, self.broker.port):  # cheap first: no client errors in the log
                    asyncio.run(cluster_info(settings))
                    return
            except BrokerUnavailableError:
                pass
            if time.monotonic() > deadline:
                raise BrokerUnavailableError(
                    f"local Kafka did not answer on {self.bootstrap} within {self.broker.start_timeout_s:g}s; "
                    f"log {self.log_file}:\n" + self.log_tail()
                )
            time.sleep(0.3)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log yet)"

    # --- internals ------------------------------------------------------------------------------------------
    def _live_pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        if not process_alive(pid):
            return None
        # Guard against pid reuse: the process must be our broker with our properties file.
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if "kafka.Kafka" not in cmdline or str(self.properties_file) not in cmdline:
                return None
        return pid

    def _write_properties(self) -> None:
        b = self.broker
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.bootstrap.servers": f"{b.host}:{b.controller_port}",
            "listeners": f"PLAINTEXT://{b.host}:{b.port},CONTROLLER://{b.host}:{b.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{b.host}:{b.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.logs_dir),
            "num.partitions": "1",
            "default.replication.factor": "1",
            "min.insync.replicas": "1",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "8",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            # Topics come from schemas/topics.py with their settings; a typo must not create a topic.
            "auto.create.topics.enable": "false",
            "message.max.bytes": str(8 * 1024 * 1024),
            "log.retention.check.interval.ms": "60000",
        }
        if self.role is not None:
            props.update(_cluster_properties(self.role))
        text = "# Written by Fulmen (infra/kafka/local.py) at every start; edit FULMEN_BROKER_* instead.\n"
        text += "".join(f"{k}={v}\n" for k, v in props.items())
        self.properties_file.write_text(text)

    def format(self, cluster_id: str, initial_controllers: str | None = None) -> None:
        """Format the storage: a single node as its own quorum (``--standalone``), a node of a cluster with the
        quorum every node is formatted with (``id@host:port:directory-id,...``, Kafka's ``--initial-controllers``)."""
        java, libs = _require_java(), self.fetch()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._write_properties()
        quorum = ["--standalone"] if initial_controllers is None else ["--initial-controllers", initial_controllers]
        result = subprocess.run(
            [
                java,
                "-cp",
                f"{libs}/*",
                "kafka.tools.StorageTool",
                "format",
                *quorum,
                f"--cluster-id={cluster_id}",
                "-c",
                str(self.properties_file),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise ConfigurationError(
                f"formatting the Kafka storage in {self.logs_dir} failed: {(result.stdout + result.stderr).strip()}"
            )

    def _spawn(self, java: str, libs: Path) -> subprocess.Popen[bytes]:
        log4j = resources.files("fulmen.infra.kafka").joinpath("log4j2.yaml")
        with resources.as_file(log4j) as log4j_path:
            log4j_copy = self.data_dir / "log4j2.yaml"
            shutil.copyfile(log4j_path, log4j_copy)
        heap = self.broker.heap
        # Several nodes share the machine's cores: each JVM keeps its garbage collector to one thread.
        gc_threads = ["-XX:ParallelGCThreads=1", "-XX:ConcGCThreads=1"] if self.role is not None else []
        command = [
            *self.launcher,
            java,
            f"-Xms{heap}",
            f"-Xmx{heap}",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            *gc_threads,
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={log4j_copy}",
            f"-Dkafka.logs.dir={self.data_dir}",
            "-cp",
            f"{libs}/*",
            "kafka.Kafka",
            str(self.properties_file),
        ]
        with open(self.log_file, "ab") as log_out:
            return subprocess.Popen(
                command, stdout=log_out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )


def _cluster_properties(role: ClusterRole) -> dict[str, str]:
    """What a node of a local cluster sets differently from a single node: the quorum of every node's controller,
    replication of 3 with 2 in sync for the topics and Kafka's own (offsets, transactions, share groups), and a
    node declared dead after 6 s without a heartbeat (Kafka's 9 s default; its leaderships move then)."""
    replicas, in_sync = str(role.replication_factor), str(role.min_insync_replicas)
    return {
        "controller.quorum.bootstrap.servers": ",".join(v.endpoint for v in role.voters),
        "default.replication.factor": replicas,
        "min.insync.replicas": in_sync,
        "offsets.topic.replication.factor": replicas,
        "transaction.state.log.replication.factor": replicas,
        "transaction.state.log.min.isr": in_sync,
        "share.coordinator.state.topic.replication.factor": replicas,
        "share.coordinator.state.topic.min.isr": in_sync,
        "broker.heartbeat.interval.ms": "1000",
        "broker.session.timeout.ms": "6000",
    }


def base64_uuid() -> str:
    """A Kafka cluster id: a random UUID in URL-safe base64 without padding (22 characters).

    Like Kafka's own ``Uuid.randomUuid()``, never one that starts with "-": a command line would take it for
    an option (one start in 64 failed that way before).
    """
    import base64

    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def _accepts(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1.0):
        return True
    return False


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) is not alive.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def _require_java() -> str:
    java = shutil.which("java")
    if java is None:
        raise ConfigurationError(
            f"Java {_MIN_JAVA}+ is needed to run the local Kafka broker: install it "
            "(apt-get install openjdk-17-jre-headless), or set FULMEN_KAFKA_BOOTSTRAP to an existing cluster"
        )
    result = subprocess.run([java, "-version"], capture_output=True, text=True, check=False)
    match = re.search(r'version "(\d+)(?:\.(\d+))?', result.stderr + result.stdout)
    if match:
        major = int(match.group(1))
        if major == 1 and match.group(2):  # "1.8.0_x" style
            major = int(match.group(2))
        if major < _MIN_JAVA:
            raise ConfigurationError(
                f"Java {major} found at {java}, but Kafka 4 needs Java {_MIN_JAVA}+: install a newer JDK "
                "or set JAVA_HOME/PATH to one"
            )
    return java
