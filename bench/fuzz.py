"""Fuzz every HTTP endpoint with bounded random and structured malformed input; count crashes, hangs and 5xx.

Starts what it needs, each server its own process (so its death and memory are visible): a local Kafka broker,
``fulmen otlp-gateway``, ``fulmen llm-gateway`` on the transformers backend with a tiny model built offline
(``algorithm/tiny_model.py``; this backend batches calls, so a bad request that fails its batch shows up) and
``fulmen consume`` (the owner of a fresh embedded store, which serves the read-only SQL endpoint). Every server
gets a bearer token (``FULMEN_*_TOKEN``), which the normal inputs carry; some inputs fuzz it.

Endpoints, each fed ``--inputs`` inputs (default 10,000) by ``--concurrency`` clients over fresh loopback
connections: ``otlp_protobuf`` and ``otlp_json`` (``POST /v1/traces``, gzip variants mixed in), ``llm_chat``
(``/v1/chat/completions``), ``llm_completions`` (``/v1/completions``), ``llm_rollout_paths``
(``/rollout/{id}/attempt/{n}/v1/...`` with fuzzed path parts), ``llm_feedback`` (``POST /v1/feedback``, late
feedback: inputs in :mod:`bench.fuzz_feedback`), ``sql_query`` (``POST /query`` JSON) and
``sql_http`` (``GET|POST /?query=``); then ``sql_limits``, a few reads that only limits can stop. The mix:
random bytes, byte mutations of valid requests, type confusion of every field (other types, integers past 64
bits, nesting 1,000 deep, lone surrogates in values and keys, huge strings, odd numbers), wrong methods and
content types, bad gzip, truncated or hand-written protobuf, odd headers (non-UTF-8 Authorization...), odd
framing; for SQL, grammar-made reads, garbled statements and hostile ones (INTO OUTFILE, file(), url(),
multi-statements, SET, comments, cross-site requests) that must get a 4xx.

Per endpoint, on the last line of stdout (one JSON object keyed by endpoint):

* ``inputs``: inputs sent;
* ``crashes`` = ``deaths`` (the server process died; it is restarted) + ``unexplained_5xx`` (any 5xx except a
  503 that carries ``Retry-After``, which means "busy, retry": Kafka slow, for instance);
* ``hangs``: no complete answer within ``--deadline`` seconds (default 10);
* ``status_5xx``: every 5xx, the explained 503s included;
* ``rss_growth_mb``: the server's resident memory after the endpoint's inputs minus before (``/proc``);
* ``good_after``: after each batch of inputs one good request is sent: the number of batches after which it
  was answered 200 (of ``batches``);
* ``hostile_accepted`` (SQL): hostile inputs answered below 400; ``no_answer``: connections closed with no
  status line while the server lived; ``statuses``; ``server_errors``: exception lines the server logged
  during the endpoint's run, by count (the causes of the 5xx); ``examples``: the first failing inputs by
  reason, truncated, with their index (``--replay ENDPOINT:INDEX`` makes one again, byte for byte).

``llm_feedback`` also says whether anything it accepted was lost: ``accepted`` (answers 202, the good requests'
included), ``on_topic`` (feedback records on the topic, read to its end after the run), ``lost`` (ids answered 202
that are not on it), ``doubled`` (on it more than once), ``valid_refused`` (valid requests answered 4xx).

``store_after`` says whether the store still ingests a span after the SQL inputs, which tables the inputs
created, and how many files hostile statements managed to write (only ever under the run's ``canary/``).

    .venv/bin/python bench/fuzz.py [--inputs 10000] [--quick] [--endpoints sql_http,llm_chat] [--seed 1]

Loopback only; every loop is bounded in count and time; a server past ``--rss-limit-mb`` is killed (the box is
shared); everything started is stopped on exit, on error and on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fuzz_client import Answer, Server, send
from bench.fuzz_feedback import accepted_id, feedback_case, good_feedback, topic_check
from bench.fuzz_inputs import Case, Target, good_llm, good_otlp, llm_case, otlp_case
from bench.fuzz_sql import good_sql, heavy_case, sql_case
from bench.span_ingest import free_port

ENDPOINTS = [
    "otlp_protobuf",
    "otlp_json",
    "llm_chat",
    "llm_completions",
    "llm_rollout_paths",
    "llm_feedback",
    "sql_query",
    "sql_http",
]
SERVER_OF = {"otlp": "otlp", "llm": "llm", "sql": "consume"}
REPO = Path(__file__).resolve().parent.parent
TOKEN = "fuzz-token-0123456789"  # every server's bearer token; the normal inputs carry it


def server_of(endpoint: str) -> str:
    return SERVER_OF[endpoint.split("_")[0]]


def make_case(endpoint: str, index: int, seed: int, target: Target) -> Case:
    rng = random.Random(f"{seed}:{endpoint}:{index}")
    if endpoint.startswith("otlp"):
        return otlp_case(rng, endpoint, target)
    if endpoint == "llm_feedback":
        return feedback_case(rng, target)
    if endpoint.startswith("llm"):
        return llm_case(rng, endpoint, target)
    return sql_case(rng, endpoint, target, index)


def good_case(endpoint: str, token: str) -> Case:
    if endpoint.startswith("otlp"):
        return good_otlp(endpoint, token)
    if endpoint == "llm_feedback":
        return good_feedback(token)
    if endpoint.startswith("llm"):
        return good_llm(endpoint, token)
    return good_sql(endpoint, token)


@dataclass
class Tally:
    """What one endpoint's run found."""

    inputs: int = 0
    deaths: int = 0
    unexplained_5xx: int = 0
    hangs: int = 0
    status_5xx: int = 0
    no_answer: int = 0
    hostile_accepted: int = 0
    good_after: int = 0
    batches: int = 0
    restarts: int = 0
    statuses: Counter = field(default_factory=Counter)
    examples: dict[str, list[dict]] = field(default_factory=dict)
    recent: deque = field(default_factory=lambda: deque(maxlen=8))

    def example(self, reason: str, index: int, case: Case, answer: Answer | None, limit: int) -> None:
        if len(self.examples) >= 12 and reason not in self.examples:
            return
        kept = self.examples.setdefault(reason, [])
        if len(kept) < limit:
            entry = {"index": index, **case.summary()}
            if answer is not None:
                entry["answer"] = f"{answer.status} {answer.body[:240]!r}" if answer.status else answer.error
            kept.append(entry)

    def record(self, index: int, case: Case, answer: Answer) -> None:
        self.inputs += 1
        self.recent.append((index, case))
        self.statuses[str(answer.status or answer.error)] += 1
        if answer.status is None:
            if answer.error == "hang":
                self.hangs += 1
                self.example(f"hang:{case.kind.split(':')[0]}", index, case, answer, 3)
            elif answer.error != "refused":
                self.no_answer += 1
                self.example(f"no_answer:{answer.error}", index, case, answer, 3)
            return
        if answer.status >= 500:
            self.status_5xx += 1
            if not answer.explained_5xx:
                self.unexplained_5xx += 1
                self.example(f"{answer.status}:{case.kind.split('+')[0][:40]}", index, case, answer, 2)
        elif case.hostile and answer.status < 400:
            self.hostile_accepted += 1
            self.example(f"hostile_accepted:{case.kind[:40]}", index, case, answer, 2)

    def report(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            "crashes": self.deaths + self.unexplained_5xx,
            "hangs": self.hangs,
            "status_5xx": self.status_5xx,
            "rss_growth_mb": 0.0,
            "good_after": self.good_after,
            "batches": self.batches,
            "deaths": self.deaths,
            "unexplained_5xx": self.unexplained_5xx,
            "no_answer": self.no_answer,
            "hostile_accepted": self.hostile_accepted,
            "restarts": self.restarts,
            "statuses": dict(self.statuses.most_common()),
            "examples": self.examples,
        }


class Bench:
    """The servers, the target description and the run's options."""

    def __init__(
        self, args: argparse.Namespace, home: Path, servers: dict[str, Server], target: Target, bootstrap: str = ""
    ) -> None:
        self.args = args
        self.home = home
        self.servers = servers
        self.target = target
        self.bootstrap = bootstrap  # the broker's, to read the feedback topic back
        self.feedback_ids: list[str] = []  # of every feedback answered 202 ('' when the answer had none)
        self.valid_refused = 0

    async def good(self, endpoint: str) -> bool:
        """The endpoint's good request answered 200 (202 for feedback; a 503 with Retry-After is retried, three
        times at most)."""
        server = self.servers[server_of(endpoint)]
        for _ in range(4):
            case = good_case(endpoint, self.target.token)
            answer = await send(server.port, case, self.args.deadline)
            self.note_feedback(endpoint, case, answer)
            if answer.status == (202 if endpoint == "llm_feedback" else 200):
                return True
            if not answer.explained_5xx:
                return False
            await asyncio.sleep(min(5.0, float(answer.headers.get("retry-after", "1") or 1)))
        return False

    def restart(self, endpoint: str, tally: Tally, why: str) -> bool:
        server = self.servers[server_of(endpoint)]
        if tally.restarts >= self.args.max_restarts:
            print(f"  {endpoint}: {why}; restarts used up, stopping this endpoint", file=sys.stderr)
            return False
        print(f"  {endpoint}: {why}; restarting {server.name}", file=sys.stderr)
        server.kill()
        tally.restarts += 1
        try:
            server.start(lambda: asyncio.run(self.good(endpoint)), 240)
        except RuntimeError as exc:
            print(f"  {endpoint}: {exc}", file=sys.stderr)
            return False
        return True

    async def batch(self, endpoint: str, indices: list[int], tally: Tally, heavy: bool = False) -> None:
        server = self.servers[server_of(endpoint)]
        pending = iter(indices)

        async def client() -> None:
            for index in pending:
                case = (
                    heavy_case(index, endpoint, self.target)
                    if heavy
                    else make_case(endpoint, index, self.args.seed, self.target)
                )
                answer = await send(server.port, case, self.args.deadline)
                tally.record(index, case, answer)
                if self.note_feedback(endpoint, case, answer):
                    tally.example(f"valid_refused:{answer.status}", index, case, answer, 3)
                if answer.status is None and answer.error != "hang" and not server.alive():
                    return

        await asyncio.gather(*(client() for _ in range(self.args.concurrency)))

    def note_feedback(self, endpoint: str, case: Case, answer: Answer) -> bool:
        """Keep the id of a feedback answered 202 (the topic must hold it once); True for a valid one refused."""
        if endpoint != "llm_feedback":
            return False
        if answer.status == 202:
            self.feedback_ids.append(accepted_id(answer.body))
            return False
        refused = case.kind == "valid" and answer.status is not None and 400 <= answer.status < 500
        self.valid_refused += refused
        return refused

    def feedback_report(self) -> dict[str, Any]:
        """What ``llm_feedback`` accepted against what its topic holds (:func:`bench.fuzz_feedback.topic_check`)."""
        report = asyncio.run(topic_check(self.bootstrap, self.feedback_ids))
        return report | {"valid_refused": self.valid_refused}

    def after_batch(self, endpoint: str, tally: Tally) -> bool:
        """Liveness, memory guard, good request; False to stop the endpoint."""
        server = self.servers[server_of(endpoint)]
        if not server.alive():
            tally.deaths += 1
            for index, case in list(tally.recent):
                tally.example(f"died:exit {server.process.returncode if server.process else '?'}", index, case, None, 8)
            return self.restart(endpoint, tally, f"{server.name} died")
        if server.rss_mb() > self.args.rss_limit_mb:
            for index, case in list(tally.recent):
                tally.example("rss_over_limit", index, case, None, 8)
            return self.restart(endpoint, tally, f"{server.name} RSS {server.rss_mb():.0f} MB over the guard")
        tally.batches += 1
        if asyncio.run(self.good(endpoint)):
            tally.good_after += 1
            return True
        if not asyncio.run(self.good(endpoint)):  # twice in a row: wedged
            return self.restart(endpoint, tally, f"{server.name} no longer answers the good request")
        return True

    def run_endpoint(self, endpoint: str, indices: list[int], heavy: bool = False) -> dict[str, Any]:
        server = self.servers[server_of(endpoint)]
        if not any(asyncio.run(self.good(endpoint)) or time.sleep(2) for _ in range(3)) and not self.restart(
            endpoint, Tally(), "not answering its good request before the run"
        ):
            return {"error": "the server did not answer its good request before the run"}
        log_offset = server.log_path.stat().st_size
        tally = Tally()
        rss_before, began = server.rss_mb(), time.monotonic()
        size = 1 if heavy else max(1, len(indices) // self.args.batches)
        for start in range(0, len(indices), size):
            if time.monotonic() - began > self.args.endpoint_seconds:
                print(f"  {endpoint}: time budget spent after {tally.inputs} inputs", file=sys.stderr)
                break
            asyncio.run(self.batch(endpoint, indices[start : start + size], tally, heavy))
            if not self.after_batch(endpoint, tally):
                break
            rate = tally.inputs / max(1e-9, time.monotonic() - began)
            crashes = tally.deaths + tally.unexplained_5xx
            print(
                f"  {endpoint}: {tally.inputs}/{len(indices)} ({rate:.0f}/s) crashes={crashes} hangs={tally.hangs} "
                f"5xx={tally.status_5xx} hostile_ok={tally.hostile_accepted} good={tally.good_after}/{tally.batches}",
                file=sys.stderr,
            )
        report = tally.report()
        report["rss_growth_mb"] = round(server.rss_mb() - rss_before, 1) if server.alive() else None
        report["seconds"] = round(time.monotonic() - began, 1)
        report["server_errors"] = server_errors(server.log_path, log_offset)
        if endpoint == "llm_feedback":
            report |= self.feedback_report()
        return report


_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Exit|Interrupt))(?::\s?(.*))?$")


def server_errors(path: Path, offset: int, top: int = 12) -> dict[str, int]:
    """Exception lines of tracebacks the server logged since ``offset``, by count (the 5xx causes)."""
    counts: Counter = Counter()
    with open(path, "rb") as log_file:
        log_file.seek(offset)
        for line in log_file.read(64 * 1024 * 1024).decode("utf-8", "replace").splitlines():
            match = _EXCEPTION.match(line.strip())
            if match:
                message = re.sub(r"\d{3,}", "N", (match.group(2) or "")[:90])
                counts[f"{match.group(1)}: {message}".rstrip(": ")] += 1
    return dict(counts.most_common(top))


# --- set-up --------------------------------------------------------------------------------------------------
def build_model(home: Path) -> Path:
    """The tiny model, built in a child process (the bench itself stays free of torch)."""
    directory = home / "tiny-model"
    code = "import sys; from fulmen.algorithm.tiny_model import build_tiny_model; build_tiny_model(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(directory)], cwd=REPO, check=True, timeout=600)
    return directory


def environment(home: Path, bootstrap: str, ports: dict[str, int], model: Path | None, token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")}
    return env | {
        "FULMEN_KAFKA_BOOTSTRAP": bootstrap,
        "FULMEN_HOME": str(home),
        "FULMEN_LOG_LEVEL": "WARNING",
        "FULMEN_CLICKHOUSE_PATH": str(home / "chdb"),
        "FULMEN_CLICKHOUSE_READ_PORT": str(ports["consume"]),
        "FULMEN_CLICKHOUSE_READ_TOKEN": token,
        "FULMEN_OTLP_PORT": str(ports["otlp"]),
        # A read's own limit below the bench's 10 s per-request deadline: an expensive read must end in a 400.
        "FULMEN_CLICKHOUSE_READ_MAX_EXECUTION_S": "5",
        "FULMEN_OTLP_BEARER_TOKEN": token,
        "FULMEN_LLM_PORT": str(ports["llm"]),
        "FULMEN_LLM_BEARER_TOKEN": token,
        "FULMEN_LLM_BACKEND": "transformers",
        "FULMEN_LLM_MODEL": str(model or ""),
        "FULMEN_LLM_DEVICE": "cpu",
        "FULMEN_LLM_DTYPE": "float32",
        "FULMEN_LLM_MAX_MODEL_LEN": "256",
        "FULMEN_LLM_DEFAULT_MAX_TOKENS": "4",
        "FULMEN_LLM_MAX_N": "4",
        "FULMEN_LLM_FOLLOW_MODELS": "false",
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def store_after(bench: Bench) -> dict[str, Any]:
    """After the SQL inputs: does a new span still reach the store, what did the inputs create or write?"""
    result: dict[str, Any] = {"files_written": sorted(p.name for p in Path(bench.target.canary).iterdir())[:20]}
    result["files_written_count"] = sum(1 for _ in Path(bench.target.canary).iterdir())
    sql_port = bench.servers["consume"].port

    async def sql(text: str) -> str:
        case = good_sql("sql_http", bench.target.token)
        case.method, case.path = "POST", "/?default_format=TSV"
        case.body = text.encode()
        answer = await send(sql_port, case, bench.args.deadline)
        return answer.body.decode("utf-8", "replace") if answer.status == 200 else f"!{answer.status or answer.error}"

    result["tables_created"] = asyncio.run(
        sql("SELECT name FROM system.tables WHERE database = 'fulmen' AND name LIKE 'fuzz%' ORDER BY name")
    ).split()[:20]
    if "otlp" not in bench.servers or not bench.servers["otlp"].alive():
        return result
    from bench.fuzz_otlp import field, wrap_span

    marker = f"fuzz-ingest-{os.getpid()}-{int(time.time())}"
    now = time.time_ns().to_bytes(8, "little")
    span = (
        field(1, os.urandom(16)) + field(2, os.urandom(8)) + field(5, marker.encode()) + b"\x39" + now + b"\x41" + now
    )
    case = good_otlp("otlp_protobuf", bench.target.token)
    case.body = wrap_span(span)
    answer = asyncio.run(send(bench.servers["otlp"].port, case, bench.args.deadline))
    result["ingest_accepted"] = answer.status
    deadline, found = time.monotonic() + 60, "0"
    while time.monotonic() < deadline and answer.status == 200:
        found = asyncio.run(sql(f"SELECT count() FROM fulmen.otel_traces WHERE SpanName = '{marker}'")).strip()
        if found not in ("0", ""):
            break
        time.sleep(1)
    result["ingest_after"] = found not in ("0", "") and not found.startswith("!")
    result["ingest_probe"] = found[:200]
    return result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=10_000, help="inputs per endpoint")
    parser.add_argument("--quick", action="store_true", help="a small run: 300 inputs per endpoint, 10 batches")
    parser.add_argument("--endpoints", default=",".join(ENDPOINTS), help="comma-separated subset")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--batches", type=int, default=50, help="batches per endpoint (a good request after each)")
    parser.add_argument("--deadline", type=float, default=10.0, help="seconds a request may take before it hangs")
    parser.add_argument("--endpoint-seconds", type=float, default=900.0, help="time budget per endpoint")
    parser.add_argument("--max-restarts", type=int, default=3, help="restarts of a server per endpoint")
    parser.add_argument("--rss-limit-mb", type=float, default=6000.0, help="kill a server past this RSS")
    parser.add_argument("--heavy", type=int, default=4, help="expensive reads for sql_limits (0: none)")
    parser.add_argument("--replay", default="", help="ENDPOINT:INDEX: print that input's request and exit")
    args = parser.parse_args()
    if args.quick:
        args.inputs, args.batches, args.heavy = min(args.inputs, 300), 10, min(args.heavy, 2)
    unknown = set(args.endpoints.split(",")) - set(ENDPOINTS)
    if unknown:
        parser.error(f"unknown endpoint(s) {', '.join(sorted(unknown))}; valid: {', '.join(ENDPOINTS)}")
    return args


def replay(args: argparse.Namespace) -> None:
    endpoint, _, index = args.replay.partition(":")
    case = make_case(endpoint, int(index), args.seed, Target(token=TOKEN, canary="/tmp/fulmen-fuzz-canary"))
    sys.stdout.buffer.write(case.raw(0))


def main() -> None:
    args = parse_args()
    if args.replay:
        replay(args)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    home = Path(tempfile.mkdtemp(prefix="fulmen-fuzz-"))
    endpoints = [e for e in ENDPOINTS if e in args.endpoints.split(",")]
    needed = {server_of(e) for e in endpoints} | ({"otlp"} if any(e.startswith("sql") for e in endpoints) else set())
    print(f"logs and canary in {home}", file=sys.stderr)
    from fulmen.infra.kafka.admin import ensure_topics
    from fulmen.infra.kafka.local import LocalKafka
    from fulmen.infra.settings import BrokerSettings, FulmenSettings

    broker = LocalKafka(BrokerSettings(port=free_port(), controller_port=free_port()), home / "kafka")
    servers: dict[str, Server] = {}
    report: dict[str, Any] = {}
    began = time.monotonic()
    try:
        model = build_model(home) if "llm" in needed else None
        broker.start()
        asyncio.run(ensure_topics(FulmenSettings(kafka={"bootstrap": broker.bootstrap})))
        ports = {"otlp": free_port(), "llm": free_port(), "consume": free_port()}
        target = Target(token=TOKEN, canary=str(home / "canary"), closed_port=free_port(), self_port=ports["consume"])
        Path(target.canary).mkdir()
        env = environment(home, broker.bootstrap, ports, model, target.token)
        fulmen = [sys.executable, "-m", "fulmen.cli.main"]
        commands = {"otlp": ["otlp-gateway"], "llm": ["llm-gateway"], "consume": ["consume", "--sink", "spans"]}
        for name in ("otlp", "llm", "consume"):
            if name in needed:
                servers[name] = Server(name, [*fulmen, *commands[name]], env, home / f"{name}.log", ports[name])
        bench = Bench(args, home, servers, target, broker.bootstrap)
        for name, server in servers.items():
            probe = next(e for e in ENDPOINTS if server_of(e) == name)
            print(f"starting {name}...", file=sys.stderr)
            server.start(lambda probe=probe: asyncio.run(bench.good(probe)), 300)
        for endpoint in endpoints:
            print(f"{endpoint}: {args.inputs} inputs", file=sys.stderr)
            try:
                report[endpoint] = bench.run_endpoint(endpoint, list(range(args.inputs)))
            except Exception as exc:  # a defect of the bench itself: keep the other endpoints' results
                print(f"  {endpoint}: the bench failed: {exc!r}", file=sys.stderr)
                report[endpoint] = {"error": f"the bench failed: {exc!r}"}
        if "consume" in servers:
            report["store_after"] = store_after(bench)
            if args.heavy:
                print(f"sql_limits: {args.heavy} expensive reads", file=sys.stderr)
                report["sql_limits"] = bench.run_endpoint("sql_http", list(range(args.heavy)), heavy=True)
    finally:
        for server in servers.values():
            server.stop()
        broker.stop()
    report["meta"] = {
        "seed": args.seed,
        "inputs_per_endpoint": args.inputs,
        "concurrency": args.concurrency,
        "deadline_s": args.deadline,
        "seconds": round(time.monotonic() - began, 1),
        "home": str(home),
        "good_after": "batches after which the good request was answered 200 (feedback: 202), of 'batches'",
        "crashes": "deaths of the server process + 5xx other than 503 with Retry-After",
    }
    print(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
