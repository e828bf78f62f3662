"""Crash benchmark: kill -9 each Fulmen process in turn under load, restart it, and count what was lost or doubled.

Starts the whole system as a user would, each part its own process on loopback with its own ``FULMEN_HOME``
and free ports: a local Kafka (:class:`fulmen.infra.kafka.cluster.LocalCluster`: one node, or a cluster of
``--brokers N``), ``fulmen consume`` (owns a fresh embedded store, serves reads), ``fulmen otlp-gateway``,
``fulmen llm-gateway --model DIR`` on the tiny model (``algorithm/tiny_model.py``, version 0),
``fulmen runner --agent bench.chaos_agent:run`` and ``fulmen train`` on the same model (GRPO, groups of rollouts
dispatched through the runner); a :class:`Placement` puts each on a host of its own instead (``bench/cluster.py``'s
training part, where a phase kills the whole host). The load: OTLP span batches from the bench's client, direct
chat completions, ``fulmen submit`` of a few tasks per phase, the trainer's own rollouts (each makes two LLM calls
through the rollout-scoped gateway path and one agent span), and late feedback through the LLM gateway's
``/v1/feedback`` for calls answered 200 and rollouts under way (so the consume phase's kill falls between feedback
accepted and stored).

Phases, one per component, in this order: trainer, otlp_gateway, llm_gateway, runner, consume, broker. In each:
``fulmen submit`` a few tasks and load for ``pre_s``; SIGKILL the process (the broker: its JVM; of a cluster, the
node that leads the controller quorum, the others running on); wait ``down_s`` (a cluster node: ``cluster_down_s``);
start it again (same settings, same data) and submit a few more tasks; wait until it has done a new unit of work
(``recovery_s``); load for ``post_s``. A process other than the killed one that exits is restarted and reported
under ``unexpected_exits``. Then the drain: the trainer is stopped (SIGTERM), the load stops, and the bench
waits until every rollout is terminal and every span is stored (or ``drain_s`` passes). Finally it counts
(definitions in :data:`bench.chaos_count.DEFINITIONS`, printed under ``definitions``):

- spans: sent = spans whose OTLP POST got a 200 (a failed POST is retried unchanged until 200, counted once);
  stored = distinct span ids in ``otel_traces``; doubled = rows visible more than once with FINAL (the dedup
  ``fulmen sql`` applies by default); ``raw_copies``: extra rows without FINAL.
- llm_calls: calls answered 200 (response id) must have exactly one span.
- feedback: feedback answered 202 must have exactly one row in ``feedback``, never a dead letter (its target exists);
  the consume phase kills amid a stream of ``feedback_stream`` of them on calls it has just made, and reports how
  many records of the feedback topic the killed consumer had not committed (``feedback_uncommitted_at_kill``).
- rollouts: every requested rollout reaches a terminal state in ``rollouts``; transitions: one row per LLM call
  of every succeeded rollout's final attempt.
- model_versions (trainer): no version published twice, none checkpointed and not published, steps continue
  after the restart.

Each component's entry sums the units of all kinds sent in its phase window (``detail`` splits them by kind);
``totals`` covers the whole run. The last line of output is one JSON object. Goal: lost 0, doubled 0.
Everything started is stopped at the end, also on error or Ctrl-C.

    .venv/bin/python bench/chaos.py [--quick] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.chaos_count import DEFINITIONS, Phases, count_all
from bench.chaos_load import FeedbackLoad, LlmLoad, SpanLoad, TopicTail, first_after, read_topic
from bench.chaos_procs import Broker, Fleet, Proc, fulmen_command
from fulmen.consumers.app import ConsumerOptions
from fulmen.consumers.barrier import OffsetBarrier, behind
from fulmen.consumers.feedback import FeedbackSink
from fulmen.infra.kafka.admin import ensure_topics
from fulmen.infra.kafka.cluster import LocalCluster
from fulmen.infra.processes import free_port
from fulmen.infra.settings import BrokerSettings, FulmenSettings
from fulmen.infra.store import RemoteReader
from fulmen.schemas import ModelVersion, RolloutEvent, RolloutRequest, TopicKey, TrainStep, TransitionBatch, topic_name

log = logging.getLogger("bench.chaos")

REPO = Path(__file__).resolve().parent.parent
AGENT = "bench.chaos_agent:run"
COMPONENTS = ("trainer", "otlp_gateway", "llm_gateway", "runner", "consume", "broker")
DB = "fulmen"


@dataclass(frozen=True)
class Plan:
    pre_s: float = 8.0
    down_s: float = 3.0
    post_s: float = 12.0
    recover_timeout_s: float = 240.0  # a restarted trainer loads torch and the model first (100 s seen)
    cluster_down_s: float = 20.0  # a node of a cluster stays down longer: the others must take over meanwhile
    drain_s: float = 150.0
    train_steps: int = 200  # more than the phases take: training goes on under every kill (drain stops it)
    submit_tasks: int = 4
    group_size: int = 2
    span_batches_per_s: float = 4.0
    llm_calls_per_s: float = 2.0
    feedback_per_s: float = 2.0
    feedback_stream: int = 100  # feedback for fresh calls, one after the other, amid which consume is killed

    @classmethod
    def quick(cls) -> Plan:
        return cls(pre_s=4.0, down_s=2.0, post_s=5.0, drain_s=90.0, submit_tasks=2)


@dataclass
class Ports:
    broker: int
    controller: int
    otlp: int
    llm: int
    read: int


@dataclass(frozen=True)
class Placement:
    """Where the components run. Default: all on 127.0.0.1 with the bench's home, and a local Kafka of its own.
    ``bench/cluster.py`` puts each on a host of its own (:class:`fulmen.testing.hosts.Host`: its address, its
    directory as ``FULMEN_HOME``; a phase kills the whole host), with ``broker`` the Kafka nodes on other hosts."""

    hosts: dict[str, Any] = field(default_factory=dict)  # component name -> Host
    broker: Any = None  # like chaos_procs.Broker: start, kill9, stop, alive, kafka (nodes, bootstrap, quorum_leader)
    env: dict[str, str] = field(default_factory=dict)  # more variables for every process (the store's, a token)
    trainer_disk_lost: bool = False  # the trainer's host comes back without its run dir: it resumes from the store
    trainer_nodes: int = 1  # >1: a torchrun job of that many machines, ``trainer`` (rank 0), ``trainer_node2``...
    runner_via: Any = None  # a host whose proxy forwards the runner's calls to both gateways on the same ports


class Chaos:
    """One run: the fleet, the load, the phases; :meth:`run` returns the report."""

    def __init__(self, plan: Plan, home: Path, brokers: int = 1, placement: Placement | None = None) -> None:
        self.plan = plan
        self.home = home
        self.placement = placement or Placement()
        self.ports = Ports(*(free_port() for _ in range(5)))
        nodes = [(self.ports.broker, self.ports.controller)] + [(free_port(), free_port()) for _ in range(brokers - 1)]
        heap = "512m" if brokers > 1 else "768m"
        broker = self.placement.broker or Broker(
            LocalCluster(BrokerSettings(heap=heap), home / "kafka", brokers, nodes)
        )
        self.fleet = Fleet(broker)
        self.settings = FulmenSettings(home=home, kafka={"bootstrap": broker.kafka.bootstrap})
        self.calls_file = self.home_of("runner") / "agent-calls.jsonl"
        self.run_dir = self.home_of("trainer") / "run"
        self.phases = Phases()
        self.spans = SpanLoad(
            f"{self.url('otlp_gateway', self.ports.otlp)}/v1/traces", batches_per_s=plan.span_batches_per_s
        )
        llm = self.url("llm_gateway", self.ports.llm)
        self.llm = LlmLoad(f"{llm}/v1/chat/completions", calls_per_s=plan.llm_calls_per_s)
        self.feedback = FeedbackLoad(f"{llm}/v1/feedback", self._feedback_target, per_s=plan.feedback_per_s)
        self.tail = TopicTail(self.settings, {TopicKey.ROLLOUTS: RolloutEvent, TopicKey.MODELS: ModelVersion})
        self.results: dict[str, dict[str, Any]] = {}
        self.unexpected: dict[str, list[int]] = {}

    # --- where things run -----------------------------------------------------------------------------------
    def address(self, name: str) -> str:
        host = self.placement.hosts.get(name)
        return "127.0.0.1" if host is None else host.address

    def url(self, name: str, port: int) -> str:
        return f"http://{self.address(name)}:{port}"

    def home_of(self, name: str) -> Path:
        host = self.placement.hosts.get(name)
        return self.home if host is None else host.root / "home"

    def reader(self) -> RemoteReader | None:
        token = self.placement.env.get("FULMEN_CLICKHOUSE_READ_TOKEN")
        return RemoteReader.find(self.address("consume"), self.ports.read, token)

    # --- setup ----------------------------------------------------------------------------------------------
    def _env(self, name: str, extra: dict[str, str]) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")}
        return (
            base
            | {
                "FULMEN_KAFKA_BOOTSTRAP": self.settings.bootstrap,
                "FULMEN_HOME": str(self.home_of(name)),
                "FULMEN_CLICKHOUSE_READ_PORT": str(self.ports.read),
                "FULMEN_LOG_LEVEL": "INFO",
                "PYTHONPATH": str(REPO),
                "CHAOS_CALLS_FILE": str(self.calls_file),
            }
            | self.placement.env
            | extra
        )

    def _procs(self, dataset: Path) -> None:
        """The fulmen commands, each with the model on its own disk (``<FULMEN_HOME>/model``)."""
        logs, ports = self.home / "logs", self.ports
        llm, otlp = self.url("llm_gateway", ports.llm), self.url("otlp_gateway", ports.otlp)
        specs = [
            (
                "consume",
                ["consume"],
                {"FULMEN_CLICKHOUSE_READ_HOST": self.address("consume")},
                f"{self.url('consume', ports.read)}/ping",
            ),
            (
                "otlp_gateway",
                ["otlp-gateway"],
                {"FULMEN_OTLP_PORT": str(ports.otlp), "FULMEN_OTLP_HOST": self.address("otlp_gateway")},
                f"{otlp}/readyz",
            ),
            (
                "llm_gateway",
                ["llm-gateway", "--model", str(self.home_of("llm_gateway") / "model")],
                {
                    "FULMEN_LLM_PORT": str(ports.llm),
                    "FULMEN_LLM_HOST": self.address("llm_gateway"),
                    "FULMEN_LLM_MODEL_VERSION": "0",
                    "FULMEN_LLM_DEVICE": "cpu",
                },
                f"{llm}/readyz",
            ),
            (
                "runner",
                ["runner", "--agent", AGENT, "--concurrency", "4"],
                {
                    "FULMEN_RUNNER_LLM_BASE_URL": self._via(llm),
                    "FULMEN_RUNNER_OTLP_ENDPOINT": f"{self._via(otlp)}/v1/traces",
                },
                None,
            ),
            (
                "trainer",
                [
                    "train",
                    "--dataset",
                    str(dataset),
                    "--model",
                    str(self.home_of("trainer") / "model"),
                    "--agent",
                    AGENT,
                    "--steps",
                    str(self.plan.train_steps),
                ],
                {
                    "FULMEN_TRAIN_RUN_ID": "chaos",
                    "FULMEN_TRAIN_RUN_DIR": str(self.run_dir),
                    "FULMEN_TRAIN_GROUP_SIZE": "4",
                    "FULMEN_TRAIN_GROUPS_PER_STEP": "2",
                    "FULMEN_TRAIN_DEVICE": "cpu",
                    "FULMEN_TRAIN_DTYPE": "float32",
                    "FULMEN_TRAIN_ROLLOUT_TIMEOUT_S": "60",
                    "FULMEN_TRAIN_MAX_ATTEMPTS": "3",
                    "FULMEN_TRAIN_GROUP_TIMEOUT_S": "200",
                    "FULMEN_TRAIN_LR": "1e-4",
                },
                None,
            ),
        ]
        for name, args, env, ready in specs[:-1]:
            self.fleet.add(Proc(name, args, self._env(name, env), logs, ready, host=self.placement.hosts.get(name)))
        for proc in self._trainer_nodes(*specs[-1][1:3]):
            self.fleet.add(proc)

    def _via(self, url: str) -> str:
        """``url`` as the runner reaches it: through ``runner_via``'s proxy (the same port) when there is one."""
        via = self.placement.runner_via
        return url if via is None else f"http://{via.address}:{url.rsplit(':', 1)[1]}"

    def _trainer_nodes(self, args: list[str], env: dict[str, str]) -> list[Proc]:
        """``fulmen train``, or with ``trainer_nodes`` > 1 the same command under torchrun on each trainer host
        (one rank each; rank 0, on ``trainer``, is the master)."""
        nodes, logs = self.placement.trainer_nodes, self.home / "logs"
        if nodes == 1:
            return [Proc("trainer", args, self._env("trainer", env), logs, host=self.placement.hosts.get("trainer"))]
        procs = []
        for rank in range(nodes):
            name = "trainer" if rank == 0 else f"trainer_node{rank + 1}"
            torchrun = [
                *(sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={rank}"),
                *("--nproc-per-node=1", f"--master-addr={self.address('trainer')}", "--master-port=29500"),
                *("-m", "fulmen.cli.main"),
            ]
            gloo = {"GLOO_SOCKET_IFNAME": "eth0"}  # the host's link (its hostname resolves to another network)
            host = self.placement.hosts.get(name)
            procs.append(Proc(name, args, self._env(name, env | gloo), logs, host=host, program=torchrun))
        return procs

    def _companions(self, name: str) -> list[Proc]:
        """The other nodes of the torchrun job ``name`` belongs to: started again with it, as a job of several
        machines is (a node cannot rejoin a job whose other nodes went on)."""
        if not name.startswith("trainer") or self.placement.trainer_nodes == 1:
            return []
        return [proc for other, proc in self.fleet.procs.items() if other.startswith("trainer") and other != name]

    def _prepare(self) -> Path:
        """The tiny model, built once and copied to each machine that loads it (one machine: the bench's home), and
        the training dataset on the trainer's; the dataset's path."""
        model = self.home / "model"
        code = "import sys; from fulmen.algorithm.tiny_model import build_tiny_model; build_tiny_model(sys.argv[1])"
        subprocess.run([sys.executable, "-c", code, str(model)], check=True, cwd=REPO, capture_output=True)
        for name in self.placement.hosts:
            self.home_of(name).mkdir(parents=True, exist_ok=True)
        for name in ("trainer", "llm_gateway"):  # not the trainer's other nodes: they fetch it from the store
            if self.home_of(name) != self.home:
                shutil.copytree(model, self.home_of(name) / "model")
        dataset = self.home_of("trainer") / "train.jsonl"
        dataset.parent.mkdir(parents=True, exist_ok=True)
        dataset.write_text("".join(json.dumps({"question": f"what is {i} plus {i}?"}) + "\n" for i in range(16)))
        return dataset

    async def _submit(self, tag: str) -> None:
        path = self.home / f"tasks-{tag}.jsonl"
        path.write_text(
            "".join(
                json.dumps({"input": {"question": f"{tag} question {i}"}, "timeout_s": 60}) + "\n"
                for i in range(self.plan.submit_tasks)
            )
        )
        process = await asyncio.create_subprocess_exec(
            *fulmen_command(),
            "submit",
            str(path),
            "--group-size",
            str(self.plan.group_size),
            env=self._env("submit", {}),
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await process.communicate()
        if process.returncode != 0:  # e.g. the broker is down: a user would submit again
            log.warning("fulmen submit %s failed (%s); retrying: %s", tag, process.returncode, out.decode()[-500:])
            await asyncio.sleep(2.0)
            await self._submit(tag)

    # --- the run --------------------------------------------------------------------------------------------
    async def run(self, only: list[str]) -> dict[str, Any]:
        began = time.time()
        dataset = await asyncio.to_thread(self._prepare)
        await asyncio.to_thread(self.fleet.broker.start)
        await ensure_topics(self.settings)
        self._procs(dataset)
        for proc in self.fleet.procs.values():  # consume, both gateways, the runner, the trainer (its nodes)
            proc.start()
            await asyncio.to_thread(proc.wait_ready, 240.0)
        stop = asyncio.Event()
        loads = [asyncio.create_task(x.run(stop)) for x in (self.spans, self.llm, self.feedback)]
        tail_stop = asyncio.Event()
        tail = asyncio.create_task(self.tail.run(tail_stop))
        try:
            await self._submit("warmup")
            log.info("warm-up: waiting for the trainer's first model version")
            await self._until(lambda: self._event_after(TopicKey.MODELS, 0.0), 300.0, "the first model version")
            for name in only:
                await self._phase(name)
            self.phases.begin("drain", time.time())
            self.spans.phase = self.llm.phase = self.feedback.phase = "drain"
            for name, proc in self.fleet.procs.items():  # rank 0 first: it tells the other nodes to stop
                if name.startswith("trainer"):
                    await asyncio.to_thread(proc.stop, 90.0)
                    proc.process = None  # stopped by the bench, or ended by rank 0: no exit to report
            stop.set()
            await asyncio.wait_for(asyncio.gather(*loads), 120.0)
            counts = await self._drain()
        finally:
            stop.set()
            tail_stop.set()
            for task in (*loads, tail):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        return self._report(counts, time.time() - began)

    async def _phase(self, name: str) -> None:
        log.info("phase %s", name)
        self.phases.begin(name, time.time())
        self.spans.phase = self.llm.phase = self.feedback.phase = name
        submit = asyncio.create_task(self._submit(name))
        await asyncio.sleep(self.plan.pre_s)
        target = self.fleet.broker if name == "broker" else self.fleet.procs[name]
        if name == "consume":
            pid, pending = await self._kill_amid_feedback(target)
        else:
            pid = await asyncio.to_thread(target.kill9)
        killed = time.time()
        if name == "trainer" and self.placement.trainer_disk_lost:  # a new machine: the run is in the store only
            await asyncio.to_thread(shutil.rmtree, self.run_dir, True)
        cluster = name == "broker" and len(self.fleet.broker.kafka.nodes) > 1
        await asyncio.sleep(self.plan.cluster_down_s if cluster else self.plan.down_s)
        for companion in self._companions(name):
            await asyncio.to_thread(companion.kill9)
            await asyncio.to_thread(companion.start)
        restarted = await asyncio.to_thread(target.start)
        if isinstance(target, Proc):
            await asyncio.to_thread(target.wait_ready, 240.0)
        # work that starts after the restart: without it a runner had nothing to show it recovered (its phase's
        # first tasks were done before the kill, and the trainer may have trained every step it was asked for)
        submit_after = asyncio.create_task(self._submit(f"{name}-after"))
        recovered = await self._until(
            lambda: self._recovered(name, restarted), self.plan.recover_timeout_s, f"{name} to recover", fail=False
        )
        self.results[name] = {
            "pid_killed": pid,
            "down_s": round(restarted - killed, 2),
            "recovery_s": None if recovered is None else round(recovered - restarted, 2),
        }
        if name == "consume":
            self.results[name]["feedback_uncommitted_at_kill"] = pending
        if cluster:  # the other nodes ran on: how the clients fared before the killed node came back
            self.results[name] |= self._without_a_node(killed, restarted)
        await asyncio.gather(submit, submit_after)
        await asyncio.sleep(self.plan.post_s)
        await self._check_others(name)

    def _without_a_node(self, killed: float, restarted: float) -> dict[str, Any]:
        """The killed node, and how the span clients fared from the kill to its restart (:meth:`SpanLoad.outage`)."""
        broker = self.fleet.broker
        return {
            "node_killed": broker.killed_node,
            "quorum_leader_after": broker.kafka.quorum_leader(),
            "spans_while_down": self.spans.outage(killed, restarted),
        }

    async def _check_others(self, killed: str) -> None:
        """Restart any process that exited on its own (reported under ``unexpected_exits``)."""
        for name, proc in self.fleet.procs.items():
            code = proc.reap()
            if code is None:
                continue
            self.unexpected.setdefault(name, []).append(code)
            if name.startswith("trainer") and code == 0:
                continue  # it trained every step it was asked for
            log.warning("%s exited with %s during the %s phase; restarting it:\n%s", name, code, killed, proc.tail())
            proc.start()
            await asyncio.to_thread(proc.wait_ready, 240.0)

    def _feedback_target(self, count: int) -> tuple[str, str] | None:
        """What feedback ``count`` scores, in turn: the latest direct call answered 200, the latest call of the chaos
        agent, the latest rollout on the rollouts topic (each on its topic already, so in the store once the
        consumers catch up; the latest ones often not yet: the feedback waits for them)."""
        kind = count % 3
        if kind == 0 and self.llm.sent:
            return "response_id", next(reversed(self.llm.sent))
        if kind == 1 and self.calls_file.is_file():
            lines = self.calls_file.read_text().splitlines()
            with contextlib.suppress(ValueError, KeyError, IndexError):
                return "response_id", json.loads(lines[-2 if len(lines) > 1 else -1])["id"]  # the last may be cut
        events = self.tail.events[TopicKey.ROLLOUTS]
        return ("rollout_id", events[-1][1].rollout_id) if events else None

    async def _feedback_stream(self, calls: int = 5) -> asyncio.Task | None:
        """``calls`` direct calls, then a stream of ``feedback_stream`` feedback on them, one after the other as fast
        as the gateway answers; returns once half of it is answered 202, with the task that sends the rest (None:
        the calls took over a minute)."""
        never, size = asyncio.Event(), self.plan.feedback_stream
        async with httpx.AsyncClient(timeout=30.0) as client:
            try:
                ids = await asyncio.wait_for(asyncio.gather(*(self.llm.call(client, never) for _ in range(calls))), 60)
            except TimeoutError:
                return None
        before, targets = len(self.feedback.sent), [("response_id", ids[i % calls]) for i in range(size)]
        stream = asyncio.create_task(self.feedback.stream(targets, never))
        while not stream.done() and len(self.feedback.sent) < before + size // 2:
            await asyncio.sleep(0.002)
        return stream

    async def _kill_amid_feedback(self, consume: Proc) -> tuple[int, int | None]:
        """SIGKILL ``fulmen consume`` in the middle of a stream of feedback (some of it on the topic and not yet
        stored). The pid, and how many feedback records on the topic just before the kill its feedback consumer had
        not committed: stored after the restart, or lost (None: the broker did not say)."""
        topic = topic_name(TopicKey.FEEDBACK, self.settings.kafka.topic_prefix)
        group = f"{ConsumerOptions().group_prefix}.{FeedbackSink.name}"  # as fulmen consume names it
        offsets, stream, ends, pending = OffsetBarrier(self.settings, topic, group, user="chaos"), None, None, None
        try:
            await offsets.start()
            await offsets.snapshot()  # the partitions looked up once, so the snapshot before the kill is quick
            stream = await self._feedback_stream()
            ends = await offsets.snapshot()
        except Exception as exc:  # a figure for the report, not a reason to stop the run
            log.warning("could not read the feedback topic's end offsets: %r", exc)
        pid = consume.kill9()  # at once, not on a thread: the stream goes on meanwhile
        with contextlib.suppress(Exception):
            pending = None if ends is None else sum(behind(ends, await offsets.committed()).values())
        await offsets.stop()
        if stream is not None:  # the rest is answered while consume is down (the gateway does not need it)
            await asyncio.wait_for(stream, 120.0)
        return pid, pending

    # --- recovery probes ------------------------------------------------------------------------------------
    def _event_after(self, key: TopicKey, moment: float) -> float | None:
        times = [at for at, event in self.tail.events[key] if key is not TopicKey.ROLLOUTS or event.status.terminal]
        return first_after(times, moment)

    def _recovered(self, name: str, restarted: float) -> float | None:
        if name in ("otlp_gateway", "broker"):
            return first_after(self.spans.acks, restarted)
        if name == "llm_gateway":
            return first_after(self.llm.acks, restarted)
        if name == "runner":
            return self._event_after(TopicKey.ROLLOUTS, restarted)
        if name.startswith("trainer"):
            return self._event_after(TopicKey.MODELS, restarted)
        reader = self.reader()
        if reader is None:
            return None
        ms = int(restarted * 1000)
        with contextlib.suppress(Exception):
            rows = reader.query(
                f"SELECT toUnixTimestamp64Milli(min(IngestedAt)), count() FROM {DB}.otel_traces "
                f"WHERE IngestedAt >= fromUnixTimestamp64Milli({ms})",
                final=False,
            ).rows
            return rows[0][0] / 1000 if rows and rows[0][1] else None
        return None

    async def _until(self, probe: Any, timeout_s: float, what: str, *, fail: bool = True) -> float | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = await asyncio.to_thread(probe)
            if found is not None:
                return found
            await asyncio.sleep(0.5)
        if fail:
            raise RuntimeError(f"timed out waiting for {what}; logs in {self.home / 'logs'}")
        log.warning("timed out waiting for %s", what)
        return None

    # --- counting -------------------------------------------------------------------------------------------
    async def _drain(self) -> Any:
        """Count until nothing is missing any more (the system caught up) or ``drain_s`` passed."""
        deadline = time.monotonic() + self.plan.drain_s
        while True:
            await self._check_others("drain")
            counts = await self._count()
            missing = sum(c.row()["lost"] for c in counts.kinds.values())
            if missing == 0 or time.monotonic() > deadline:
                return counts
            log.info("drain: %d units not stored yet", missing)
            await asyncio.sleep(5.0)

    async def _count(self) -> Any:
        topics = {
            "tasks": await read_topic(self.settings, TopicKey.TASKS, RolloutRequest),
            "transitions": await read_topic(self.settings, TopicKey.TRANSITIONS, TransitionBatch),
            "models": await read_topic(self.settings, TopicKey.MODELS, ModelVersion),
            "metrics": await read_topic(self.settings, TopicKey.METRICS, TrainStep),
        }
        reader = self.reader()
        if reader is None:
            raise RuntimeError("the read endpoint of fulmen consume does not answer")
        from bench.chaos_count import agent_calls

        calls = dict(self.llm.sent) | agent_calls(self.calls_file, self.phases)
        return await asyncio.to_thread(
            count_all,
            reader,
            DB,
            spans=dict(self.spans.sent),
            calls=calls,
            feedback=dict(self.feedback.sent),
            phases=self.phases,
            topics=topics,
            feedback_topic=topic_name(TopicKey.FEEDBACK, self.settings.kafka.topic_prefix),
            run_dir=self.run_dir,
        )

    def _report(self, counts: Any, wall_s: float) -> dict[str, Any]:
        report: dict[str, Any] = {}
        for name, result in self.results.items():
            detail = {kind: c.row(name) for kind, c in counts.kinds.items()}
            if name == "trainer":
                detail["model_versions"] = counts.versions
            sums = {k: sum(d[k] for d in detail.values()) for k in ("sent", "stored", "lost", "doubled")}
            report[name] = {**sums, **result, "detail": detail}
        totals = {kind: c.row() for kind, c in counts.kinds.items()} | {"model_versions": counts.versions}
        report["totals"] = totals
        report["details"] = counts.details
        report["client_retries"] = {
            "spans": self.spans.retries,
            "span_statuses": self.spans.statuses,
            "llm": self.llm.retries,
            "llm_statuses": self.llm.statuses,
            "feedback": self.feedback.retries,
            "feedback_statuses": self.feedback.statuses,
        }
        report["unexpected_exits"] = self.unexpected
        report["ok"] = all(t["lost"] == 0 and t["doubled"] == 0 for t in totals.values())
        report["wall_s"] = round(wall_s, 1)
        report["home"] = str(self.home)
        report["definitions"] = DEFINITIONS
        return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short phases (about 5 minutes in all)")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (logs, store) afterwards")
    parser.add_argument("--only", default=",".join(COMPONENTS), help=f"components to kill, of {','.join(COMPONENTS)}")
    parser.add_argument(
        "--brokers",
        type=int,
        default=1,
        help="local Kafka nodes; more than 1: the broker phase kills the quorum leader",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "aiokafka"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = set(only) - set(COMPONENTS)
    if unknown:
        parser.error(f"unknown component(s) {', '.join(sorted(unknown))}")
    home = Path(tempfile.mkdtemp(prefix="fulmen-chaos-"))
    print(f"run directory {home}", file=sys.stderr)
    if args.brokers < 1:
        parser.error("--brokers must be at least 1")
    chaos = Chaos(Plan.quick() if args.quick else Plan(), home, args.brokers)
    report = None
    try:
        report = asyncio.run(chaos.run(only))
    except KeyboardInterrupt:
        print("interrupted: stopping everything", file=sys.stderr)
    finally:
        chaos.fleet.stop(grace_s=20.0)
        if not args.keep and report is not None and report["ok"]:
            shutil.rmtree(home, ignore_errors=True)
    if report is None:
        sys.exit(130)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
