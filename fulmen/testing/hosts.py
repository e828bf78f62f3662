"""Hosts on one machine, for tests and benches of Fulmen across machines: network namespaces on a bridge.

:class:`Network` makes a bridge in this (the operator's) namespace with the first address of a private /24 that
no interface here uses, and :meth:`Network.host` makes a host: a network namespace of its own with loopback and
one interface (a veth pair to the bridge) holding the next address, and its own directory (``root/<name>``:
its ``FULMEN_HOME`` and data). A host sees no other host's directory: each command runs in a mount namespace
of its own where ``root`` is an empty tmpfs with only the host's directory mounted back in it (the rest of the
machine, the installed software included, stays visible, as an image's would), so nothing is shared on disk
that a test does not hand over itself; the operator sees every directory. Hosts reach each other and the
operator's address, nothing else: no default route, and this machine does not forward (``ip_forward`` is 0; the
network refuses to start where it is 1), so no traffic leaves the namespaces the harness made.

A process runs on a host through ``ip netns exec`` (:meth:`Host.spawn`; ``ip`` execs the command, so the pid is
the process's own). Faults: :meth:`Host.kill` kills every process in the host's namespace with SIGKILL (a
machine losing power), :meth:`Host.partition` takes its link down (and :meth:`Host.heal` up again).
:meth:`Network.close` kills every host's processes and removes the namespaces and the bridge; every loop is
bounded. Needs root (``CAP_NET_ADMIN``) and iproute2: :func:`unavailable` says why not, for a skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fulmen.infra.kafka.local import LocalKafka

__all__ = ["Host", "Network", "reachable", "start_kafka", "unavailable", "until"]

log = logging.getLogger(__name__)

_SUBNETS = [ipaddress.ip_network(f"10.213.{n}.0/24") for n in range(16, 240)]


def unavailable() -> str | None:
    """Why hosts cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() != "0":
        return "this machine forwards IP packets (ip_forward=1): hosts could reach beyond their namespaces"
    probe = f"fh-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def reachable(address: str, port: int, host: Host | None = None, timeout_s: float = 2.0) -> bool:
    """Whether a TCP connection to address:port succeeds from ``host`` (None: the operator, this process)."""
    if host is None:
        with socket.socket() as sock:
            sock.settimeout(timeout_s)
            return sock.connect_ex((address, port)) == 0
    probe = (
        f"import socket; s = socket.socket(); s.settimeout({timeout_s}); "
        f"raise SystemExit(s.connect_ex(({address!r}, {port})))"
    )
    done = subprocess.run([*host.launcher, sys.executable, "-c", probe], timeout=30 + timeout_s, check=False)
    return done.returncode == 0


async def until(probe: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """``probe()``'s first value that is not None (it runs on a thread: it may block), polled every 0.5 s for at
    most ``timeout_s`` (then TimeoutError naming ``what``)."""
    deadline = time.monotonic() + timeout_s
    while (value := await asyncio.to_thread(probe)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(0.5)
    return value


# sh -c script: $1 the host's directory, $2 the hosts' directory, then the command. The host's directory is bound
# to a spare mount point, an empty tmpfs hides the hosts' directory, the host's own is bound back inside it.
_OWN_DISK_ONLY = (
    'set -e; own="$1"; hidden="$2"; shift 2; keep=$(mktemp -d); mount --bind "$own" "$keep"; '
    'mount -t tmpfs -o size=1m,mode=0755 fulmen-hosts "$hidden"; mkdir -p "$own"; mount --bind "$keep" "$own"; '
    'umount "$keep"; rmdir "$keep"; exec "$@"'
)


def _ip(*args: str, namespace: str | None = None) -> None:
    command = ["ip", "netns", "exec", namespace, "ip", *args] if namespace else ["ip", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")


@dataclass
class Host:
    """One host: its namespace, address, directory, and the processes started on it."""

    name: str
    namespace: str
    address: str
    link: str  # the bridge side of its veth pair (in the operator's namespace)
    root: Path
    hidden: Path | None = None  # the directory of every host, hidden from this one's commands (None: visible)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def launcher(self) -> tuple[str, ...]:
        """The prefix that runs a command on this host: in its network namespace and, with ``hidden``, a mount
        namespace where only its own directory is left under ``hidden`` (every step execs: the pid is the
        command's own)."""
        network = ("ip", "netns", "exec", self.namespace)
        if self.hidden is None:
            return network
        mounts = ("unshare", "--mount", "--propagation", "private", "sh", "-c", _OWN_DISK_ONLY, "sh")
        return (*network, *mounts, str(self.root), str(self.hidden))

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], log_name: str) -> subprocess.Popen[bytes]:
        """Start ``argv`` on this host in its own session, output to ``<root>/<log_name>.log``."""
        with open(self.root / f"{log_name}.log", "ab") as out:
            process = subprocess.Popen(
                [*self.launcher, *argv],
                env=dict(env),
                cwd=self.root,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.processes.append(process)
        return process

    def pids(self) -> list[int]:
        done = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True, text=True, check=False)
        return [int(pid) for pid in done.stdout.split()]

    def kill(self, timeout_s: float = 30) -> int:
        """SIGKILL every process in the namespace (until none is left, bounded); how many were killed."""
        killed, deadline = set(), time.monotonic() + timeout_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
            time.sleep(0.1)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(1)  # reaped, so no zombie keeps its pid in the namespace's list
        if self.pids():
            raise RuntimeError(f"host {self.name}: processes {self.pids()} survived SIGKILL for {timeout_s:g}s")
        return len(killed)

    def partition(self) -> None:
        """Cut the host off the network (its link down): its processes run on, unreachable."""
        _ip("link", "set", self.link, "down")

    def heal(self) -> None:
        _ip("link", "set", self.link, "up")


class Network:
    """A bridge and the hosts on it (a context manager: :meth:`close` on the way out)."""

    def __init__(self, root: Path, *, private_disks: bool = True) -> None:
        self.root = Path(root)
        self.private_disks = private_disks  # each host sees its own directory only (module docstring)
        self.tag = secrets.token_hex(2)
        self.bridge = f"fbr{self.tag}"
        self.subnet = _free_subnet()
        addresses = self.subnet.hosts()
        self.address = str(next(addresses))  # the operator's, on the bridge
        self._addresses = addresses
        self.hosts: dict[str, Host] = {}
        _ip("link", "add", self.bridge, "type", "bridge")
        try:
            _ip("addr", "add", f"{self.address}/{self.subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except Exception:
            self.close()
            raise

    def host(self, name: str) -> Host:
        index = len(self.hosts)
        namespace, link = f"fh-{self.tag}-{name}", f"fv{self.tag}{index}"
        address = str(next(self._addresses))
        host = Host(name, namespace, address, link, self.root / name, self.root if self.private_disks else None)
        host.root.mkdir(parents=True, exist_ok=True)
        self.hosts[name] = host
        _ip("netns", "add", namespace)
        _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        _ip("link", "set", link, "master", self.bridge, "up")
        _ip("addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0", namespace=namespace)
        _ip("link", "set", "eth0", "up", namespace=namespace)
        _ip("link", "set", "lo", "up", namespace=namespace)
        log.info("host %s: %s (namespace %s, directory %s)", name, address, namespace, host.root)
        return host

    def close(self) -> None:
        """Kill every host's processes, remove the namespaces (with their veth pairs) and the bridge."""
        for host in self.hosts.values():
            with contextlib.suppress(Exception):
                host.kill()
            with contextlib.suppress(Exception):
                _ip("netns", "del", host.namespace)
        with contextlib.suppress(Exception):
            _ip("link", "del", self.bridge)
        self.hosts.clear()

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of :data:`_SUBNETS` that no interface of this machine has an address in."""
    done = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True)
    words = [word for line in done.stdout.splitlines() for word in line.split()]
    used = [ipaddress.ip_interface(word) for word in words if "/" in word and word[0].isdigit()]
    for subnet in _SUBNETS:
        if not any(interface.ip in subnet for interface in used):
            return subnet
    raise RuntimeError("no free 10.213.x.0/24 subnet for the hosts' network")


def start_kafka(hosts: Sequence[Host], heap: str = "512m") -> list[LocalKafka]:
    """One Kafka node (broker and controller) on each host, on its own address with Kafka's usual ports
    (9092, 9093) and its data in ``<host root>/kafka``: one cluster, replication factor 3 (min ISR 2) from three
    hosts; returned once every node is a member."""
    from fulmen.infra.kafka.cluster import format_cluster, wait_members
    from fulmen.infra.kafka.local import ClusterRole, LocalKafka, Voter
    from fulmen.infra.settings import BrokerSettings

    broker = BrokerSettings(heap=heap)
    voters = tuple(Voter(i + 1, host.address, 9093) for i, host in enumerate(hosts))
    nodes = [
        LocalKafka(
            broker.model_copy(update={"host": host.address, "port": 9092, "controller_port": 9093}),
            host.root / "kafka",
            ClusterRole(i + 1, voters),
            launcher=host.launcher,
        )
        for i, host in enumerate(hosts)
    ]
    format_cluster(nodes)
    launched = [(node, node.launch()) for node in nodes]
    for (node, process), host in zip(launched, hosts, strict=True):
        host.processes.append(process)
        node.wait_ready(process)
    wait_members(nodes, broker.start_timeout_s)
    return nodes
