"""Production traffic for ``bench/improve.py``: an agent serving users, and a judge whose verdicts arrive late.

    .venv/bin/python bench/improve_traffic.py --base-url http://127.0.0.1:PORT/v1 --otlp http://127.0.0.1:PORT \
        --example calc_agent --per-min 12 --out DIR [--shuffle]

- the agent: the example's agent function, unchanged, called with the production gateway's plain endpoint (no
  rollout id) on training tasks, one episode after another at ``--per-min`` episodes a minute (a few at once when
  the gateway is slow). The process is instrumented as a user's would be: an OpenTelemetry SDK exporting to the
  OTLP gateway, and the stock httpx instrumentation (httpx2's too: the openai client 2.x sends through it), which
  sends each LLM call's ``traceparent``: one trace per episode, which is how the gateway groups the calls of an
  agent it does not run. A call the gateway refuses or fails ends its episode; its time goes to ``failed.jsonl``;
- the judge (a second process): each episode's reward (the example's grader: what the agent function returns),
  posted as feedback for the episode's trace id to the gateway's ``POST /v1/feedback`` 5 to 60 s after the answer
  (uniform). ``--shuffle`` (the control): the rewards of each block of 16 episodes are permuted among them before
  they are posted, so a verdict no longer belongs to the episode it is posted for.

Each episode is a line of ``episodes.jsonl`` (trace id, task, reward, times) and each feedback a line of
``feedback.jsonl`` (status, time). Stops on SIGTERM after the episodes in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import multiprocessing
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the examples package

BLOCK = 16  # episodes whose rewards the control permutes among themselves
IN_FLIGHT = 4  # episodes at once at most (a slow gateway is not sent more and more)


class Endpoint:
    """What a runner hands an agent (``llm.base_url``, ``llm.model``, ``llm.api_key``), pointed at production."""

    def __init__(self, base_url: str) -> None:
        self.base_url, self.model, self.api_key = base_url, "fulmen", "production"


def tracing(otlp: str) -> Any:
    """The agent process's OpenTelemetry: spans to the OTLP gateway, ``traceparent`` on every httpx request."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.httpx import HTTPX2ClientInstrumentor, HTTPXClientInstrumentor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "calc-agent-production"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{otlp}/v1/traces")))
    trace.set_tracer_provider(provider)
    HTTPXClientInstrumentor().instrument()
    HTTPX2ClientInstrumentor().instrument()  # the openai client (2.x) sends through httpx2
    return trace.get_tracer("bench.improve.production")


async def serve(args: argparse.Namespace, verdicts: Any, stop: asyncio.Event) -> None:
    """Episodes at the asked rate until ``stop``; each one's verdict to the judge."""
    example = importlib.import_module(f"examples.{args.example}").EXAMPLE
    module, function = example.agent.split(":")
    agent = getattr(importlib.import_module(module), function)
    tasks = example.train_tasks(args.skip + args.tasks)[args.skip :]
    tracer = tracing(args.otlp)
    endpoint, rng = Endpoint(args.base_url), random.Random(args.seed)
    gate = asyncio.Semaphore(IN_FLIGHT)
    episodes, failed = (args.out / "episodes.jsonl").open("a"), (args.out / "failed.jsonl").open("a")

    async def episode(task: dict[str, Any]) -> None:
        async with gate:
            started = time.time()
            with tracer.start_as_current_span("production episode") as span:
                trace_id = f"{span.get_span_context().trace_id:032x}"
                try:
                    reward = float(await agent(task, endpoint))
                except Exception as exc:  # a call the gateway failed: what the bench counts
                    failed.write(json.dumps({"t": time.time(), "trace_id": trace_id, "error": repr(exc)[:300]}) + "\n")
                    failed.flush()
                    return
            line = {"trace_id": trace_id, "template": task.get("template"), "reward": reward}
            episodes.write(json.dumps(line | {"started": started, "ended": time.time()}) + "\n")
            episodes.flush()
            verdicts.put((trace_id, reward, time.time()))

    running: set[asyncio.Task] = set()
    while not stop.is_set():
        task = rng.choice(tasks)
        running.add(asyncio.create_task(episode(task)))
        running = {t for t in running if not t.done()}
        with_jitter = 60.0 / args.per_min * rng.uniform(0.5, 1.5)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=with_jitter)
    await asyncio.gather(*running, return_exceptions=True)
    verdicts.put(None)


def judge(feedback_url: str, verdicts: Any, out: Path, shuffle: bool, seed: int) -> None:
    """The judge's process: each verdict posted 5 to 60 s after the answer (permuted in blocks with ``shuffle``)."""
    rng = random.Random(seed + 1)
    due: list[tuple[float, str, float]] = []
    block: list[tuple[str, float, float]] = []
    ended = False
    log = out.open("a")
    with httpx.Client(timeout=30.0) as client:
        while not ended or due or block:
            while True:
                try:
                    item = verdicts.get(timeout=0.5)
                except Exception:  # queue.Empty
                    break
                if item is None:
                    ended = True
                    break
                block.append(item)
            if len(block) >= (BLOCK if shuffle else 1) or (ended and block):
                rewards = [reward for _, reward, _ in block]
                if shuffle:
                    rng.shuffle(rewards)
                due += [(at + rng.uniform(5, 60), trace, r) for (trace, _, at), r in zip(block, rewards, strict=True)]
                block = []
            now = time.time()
            for item in sorted(d for d in due if d[0] <= now):
                due.remove(item)
                body = {"trace_id": item[1], "name": "reward", "value": item[2]}
                try:
                    status = client.post(feedback_url, json=body).status_code
                except httpx.HTTPError as exc:
                    status = repr(exc)[:200]
                log.write(json.dumps({"t": now, "trace_id": item[1], "value": item[2], "status": status}) + "\n")
                log.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the production LLM gateway's /v1")
    parser.add_argument("--otlp", required=True, help="the OTLP gateway's root")
    parser.add_argument("--example", default="calc_agent")
    parser.add_argument("--per-min", type=float, default=12.0)
    parser.add_argument("--skip", type=int, default=32, help="training tasks the warm-up used (not served)")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shuffle", action="store_true", help="the control: the judge's rewards permuted")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    verdicts: Any = multiprocessing.Queue()
    feedback_url = args.base_url.removesuffix("/v1").rstrip("/") + "/v1/feedback"
    judging = multiprocessing.Process(
        target=judge, args=(feedback_url, verdicts, args.out / "feedback.jsonl", args.shuffle, args.seed)
    )
    judging.start()

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(args, verdicts, stop)

    asyncio.run(run())
    judging.join(timeout=90)
    if judging.is_alive():
        judging.terminate()


if __name__ == "__main__":
    main()
