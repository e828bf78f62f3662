"""A real OpenTelemetry Collector feeding Fulmen's spans topic gives the same rows as Fulmen's own OTLP gateway.

The Collector is built once with the Collector builder (``ocb``, ``go.opentelemetry.io/collector/cmd/builder``
from the Go module proxy) into ``~/.cache/fulmen/otelcol/<release>/``: the OTLP receiver, the batch processor and
the contrib Kafka exporter (``encoding: otlp_proto``, ``partition_traces_by_id: true``: records keyed by trace id,
the same records Fulmen's gateway writes). Building takes minutes the first time (Go compiles the Kafka client and
the Collector); later runs reuse the binary.

Then, against one local Kafka broker: ``fulmen otlp-gateway`` publishing to topic prefix ``gw.`` with a
``fulmen consume`` (store A) behind it, and the Collector publishing to ``col.otlp_spans`` with a second
``fulmen consume`` (topic prefix ``col.``, store B). The same OTLP/HTTP protobuf bodies (agent-like spans with
resource and span attributes of every type, events, links, statuses; ``bench/otlp_payloads.py``) are POSTed to
both, and every stored row (every column but ``IngestedAt``, which is when it landed) is compared.

    .venv/bin/python bench/collector_interop.py [--spans 2000] [--batch 200]

Prints one JSON object on its last line: ``spans_sent``, ``rows_gateway``, ``rows_collector``, ``rows_equal``
(true when the two paths stored identical rows), and the first differences when there are any.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.otlp_payloads import make_request
from bench.span_ingest import free_port, wait_for
from fulmen.infra.kafka.admin import ensure_topics
from fulmen.infra.kafka.local import LocalKafka
from fulmen.infra.settings import BrokerSettings, FulmenSettings
from fulmen.infra.store import RemoteReader

COLLECTOR_RELEASE = "0.165.0"  # the core modules; contrib's Kafka exporter is 0.165.1 (one release: FINDINGS/go)
CONTRIB_RELEASE = "0.165.1"
CACHE = Path.home() / ".cache" / "fulmen" / "otelcol" / COLLECTOR_RELEASE
FULMEN = [sys.executable, "-m", "fulmen.cli.main"]
COLUMNS = (
    "Timestamp, TraceId, SpanId, ParentSpanId, TraceState, SpanName, SpanKind, ServiceName, ResourceAttributes, "
    "ScopeName, ScopeVersion, SpanAttributes, Duration, StatusCode, StatusMessage, `Events.Timestamp`, "
    "`Events.Name`, `Events.Attributes`, `Links.TraceId`, `Links.SpanId`, `Links.TraceState`, `Links.Attributes`, "
    "RolloutId, Attempt, AgentName, ModelVersion, PromptTokenIds, ResponseTokenIds, ResponseLogprobs, Reward"
)

MANIFEST = f"""\
dist:
  name: fulmen-otelcol
  description: OpenTelemetry Collector for Fulmen's interop bench (OTLP receiver, batch, Kafka exporter)
  output_path: {{out}}
receivers:
  - gomod: go.opentelemetry.io/collector/receiver/otlpreceiver v{COLLECTOR_RELEASE}
processors:
  - gomod: go.opentelemetry.io/collector/processor/batchprocessor v{COLLECTOR_RELEASE}
exporters:
  - gomod: github.com/open-telemetry/opentelemetry-collector-contrib/exporter/kafkaexporter v{CONTRIB_RELEASE}
"""

CONFIG = """\
receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:{port}
processors:
  batch:
    send_batch_size: 512
    timeout: 200ms
exporters:
  kafka:
    brokers: [{bootstrap}]
    traces:
      topic: {topic}
      encoding: otlp_proto
    partition_traces_by_id: true
    producer:
      required_acks: -1
service:
  telemetry:
    metrics:
      level: none
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [kafka]
"""


def build_collector() -> Path:
    """The Collector binary, built into the cache the first time (``ocb`` installed from the Go proxy first)."""
    binary = CACHE / "dist" / "fulmen-otelcol"
    if binary.is_file():
        return binary
    if shutil.which("go") is None:
        raise SystemExit("the Collector is built with Go (go.opentelemetry.io/collector/cmd/builder); go not found")
    CACHE.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GOBIN": str(CACHE / "bin"), "GOPATH": str(CACHE.parent / "go"), "CGO_ENABLED": "0"}
    builder = CACHE / "bin" / "builder"
    if not builder.is_file():
        print(f"installing the Collector builder v{COLLECTOR_RELEASE}...", file=sys.stderr, flush=True)
        subprocess.run(
            ["go", "install", f"go.opentelemetry.io/collector/cmd/builder@v{COLLECTOR_RELEASE}"], env=env, check=True
        )
    staging = Path(tempfile.mkdtemp(prefix="build-", dir=CACHE))
    (staging / "manifest.yaml").write_text(MANIFEST.format(out=staging / "dist"))
    print("building the Collector (minutes, once)...", file=sys.stderr, flush=True)
    subprocess.run([str(builder), "--config", str(staging / "manifest.yaml")], env=env, check=True, cwd=staging)
    (staging / "dist").replace(CACHE / "dist")
    shutil.rmtree(staging, ignore_errors=True)
    return binary


def payloads(spans: int, batch: int) -> list[bytes]:
    """OTLP/HTTP bodies of agent-like spans, each with some events and links added (what the payloads lack)."""
    rng = random.Random(11)
    bodies = []
    for index in range(spans // batch):
        request = make_request(batch, marker=f"interop-{index}", seed=index)
        spans_of = request.resource_spans[0].scope_spans[0].spans
        for position, span in enumerate(spans_of):
            if position % 3 == 0:
                event = span.events.add(
                    time_unix_nano=span.start_time_unix_nano + 1000, name="gen_ai.evaluation.result"
                )
                event.attributes.add(key="gen_ai.evaluation.score.value").value.double_value = rng.random()
                event.attributes.add(key="gen_ai.evaluation.name").value.string_value = "relevance"
            if position % 5 == 1:
                link = span.links.add(trace_id=spans_of[0].trace_id, span_id=spans_of[0].span_id)
                link.attributes.add(key="link.kind").value.string_value = "follows"
        bodies.append(request.SerializeToString())
    return bodies


async def post_all(url: str, bodies: list[bytes]) -> int:
    """POST every body (retrying a 503 as an exporter would); the spans acknowledged."""
    async with aiohttp.ClientSession() as session:
        for body in bodies:
            for _ in range(50):
                async with session.post(url, data=body, headers={"Content-Type": "application/x-protobuf"}) as reply:
                    if reply.status == 200:
                        break
                    await asyncio.sleep(0.2)
            else:
                raise RuntimeError(f"{url} refused a batch 50 times")
    return len(bodies)


def rows(reader: RemoteReader, expected: int, timeout_s: float = 180.0) -> list[tuple]:
    """Every stored span, once count() is stable at ``expected`` (or the timeout passes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if reader.query("SELECT count() FROM fulmen.otel_traces").rows[0][0] >= expected:
            break
        time.sleep(0.5)
    found = reader.query(f"SELECT {COLUMNS} FROM fulmen.otel_traces ORDER BY TraceId, SpanId").rows
    return [tuple(json.dumps(value, sort_keys=True, default=str) for value in row) for row in found]


def start(env: dict[str, str], args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=200)
    args = parser.parse_args()
    collector = build_collector()
    home = Path(tempfile.mkdtemp(prefix="fulmen-interop-"))
    broker = LocalKafka(BrokerSettings(port=free_port(), controller_port=free_port()), home / "kafka")
    broker.start()
    processes: list[subprocess.Popen] = []
    try:
        base = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {
            "FULMEN_KAFKA_BOOTSTRAP": broker.bootstrap,
            "FULMEN_LOG_LEVEL": "WARNING",
        }
        readers, ports = {}, {}
        for path in ("gw", "col"):
            asyncio.run(
                ensure_topics(FulmenSettings(kafka={"bootstrap": broker.bootstrap, "topic_prefix": f"{path}."}))
            )
            ports[path] = free_port()
            env = base | {
                "FULMEN_KAFKA_TOPIC_PREFIX": f"{path}.",
                "FULMEN_HOME": str(home / path),
                "FULMEN_CLICKHOUSE_READ_PORT": str(ports[path]),
            }
            processes.append(start(env, [*FULMEN, "consume", "--sink", "spans"], home / f"consume-{path}.log"))
            readers[path] = env
        gateway_port, collector_port = free_port(), free_port()
        processes.append(
            start(
                readers["gw"] | {"FULMEN_OTLP_PORT": str(gateway_port)}, [*FULMEN, "otlp-gateway"], home / "gateway.log"
            )
        )
        config = home / "collector.yaml"
        config.write_text(CONFIG.format(port=collector_port, bootstrap=broker.bootstrap, topic="col.otlp_spans"))
        processes.append(start(base, [str(collector), "--config", str(config)], home / "collector.log"))
        reader = {
            path: wait_for(lambda p=path: RemoteReader.find("127.0.0.1", ports[p]), 120, f"consume ({path})")
            for path in ("gw", "col")
        }
        bodies = payloads(args.spans, args.batch)
        spans_sent = len(bodies) * args.batch
        for path, port in (("gw", gateway_port), ("col", collector_port)):
            url = f"http://127.0.0.1:{port}/v1/traces"
            wait_for(lambda u=url: _accepts(u), 60, f"{path} OTLP endpoint")
            asyncio.run(post_all(url, bodies))
        gateway_rows = rows(reader["gw"], spans_sent)
        collector_rows = rows(reader["col"], spans_sent)
        differences = [
            {"gateway": g, "collector": c} for g, c in zip(gateway_rows, collector_rows, strict=False) if g != c
        ][:3]
        report = {
            "spans_sent": spans_sent,
            "rows_gateway": len(gateway_rows),
            "rows_collector": len(collector_rows),
            "rows_equal": gateway_rows == collector_rows,
            "first_differences": differences,
            "collector": {"release": COLLECTOR_RELEASE, "kafka_exporter": CONTRIB_RELEASE, "binary": str(collector)},
            "logs": str(home),
        }
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        broker.stop()
    print(json.dumps(report))
    return 0 if report["rows_equal"] else 1


def _accepts(url: str) -> bool:
    """The OTLP endpoint answers (an empty export is a valid request)."""
    import urllib.request

    request = urllib.request.Request(url, data=b"", headers={"Content-Type": "application/x-protobuf"})
    try:
        with urllib.request.urlopen(request, timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
