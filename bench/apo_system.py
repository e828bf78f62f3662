"""The end-to-end half of bench/apo.py: `fulmen.optimize_prompt` through the whole system with SmolLM2-135M-Instruct.

One local stack (:func:`fulmen.algorithm.local.local_stack`: Kafka, ``fulmen consume``, both gateways, a runner of
``bench.apo_agent:solve``) serves SmolLM2-135M-Instruct (bench/smollm2.py) with the transformers backend. Then:

1. ``optimize_prompt(..., local=False)`` on that stack: GEPA over the French task (bench/apo_agent.py: the agent's own
   system prompt does not ask for French), the scripted optimiser proposing five distractors then the good
   instruction; its report gives ``heldout_before``/``heldout_after`` (test split), ``rollouts_used`` and
   ``bundle_mismatches`` (SQL on the store: calls whose span names a bundle other than their rollout's);
2. ``publish_to_serve``: ``reps`` times, a new bundle is published (not timed), then its promotion is published
   (timed from here) and plain calls through the gateway (no rollout, the agent's own messages, one token) are
   sent back to back until one comes back served with it (the ``X-Fulmen-Prompt-Bundle`` response header):
   ``publish_to_serve_*`` to the start of that call (the gateway resolves the bundle when a call arrives, so it had
   the promotion by then; the resolution is one call, ``publish_to_serve_calls`` calls were made),
   ``publish_to_answer_p95_s`` to its answer (adds one SmolLM2 call).

Run from the repository root (the runner imports ``bench.apo_agent``).
"""

from __future__ import annotations

import asyncio
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.apo_agent import SYSTEM, write_splits
from bench.smollm2 import ensure_smollm2
from fulmen.algorithm.local import LocalPlan, LocalStack, local_stack
from fulmen.algorithm.prompts.bundles import PROMPTS_SENDER
from fulmen.infra.kafka.broker import kafka_broker
from fulmen.infra.kafka.clients import close_quietly, start_or_raise
from fulmen.infra.kafka.publish import EventPublisher
from fulmen.infra.settings import FulmenSettings
from fulmen.optimizer_testing import scripted_optimizer
from fulmen.prompt_optimization import optimize_prompt
from fulmen.schemas import semconv
from fulmen.schemas.events import PromotionAction
from fulmen.schemas.prompts import PromptBundle, PromptPromotion, fingerprint
from fulmen.schemas.topics import TopicKey

__all__ = ["run_system"]

AGENT = "bench.apo_agent:solve"


def p95(values: list[float]) -> float:
    """The nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


async def _served_with(
    client: httpx.AsyncClient, url: str, bundle_id: str, timeout_s: float
) -> tuple[float, float, int]:
    """Plain calls back to back until one comes back served with ``bundle_id``: seconds from now to that call's
    start (the gateway had the promotion by then: it resolves the bundle when the call arrives) and to its answer,
    and the calls it took. Raises after ``timeout_s``."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What do bees make?"}]
    body = {"model": "fulmen", "max_tokens": 1, "temperature": 0.0, "messages": messages}
    started, calls = time.perf_counter(), 0
    while time.perf_counter() - started < timeout_s:
        sent = time.perf_counter()
        answer = await client.post(url, json=body, timeout=60)
        answer.raise_for_status()
        calls += 1
        if answer.headers.get(semconv.PROMPT_BUNDLE_HEADER) == bundle_id:
            return sent - started, time.perf_counter() - started, calls
    raise TimeoutError(f"{bundle_id} was not served within {timeout_s} s of its promotion")


@dataclass
class Promotions:
    """Per promotion: seconds from publishing it to the start of the first call served with it (``serve``) and to
    that call's answer (``answer``), and the calls that took (the resolution is one call's duration)."""

    serve: list[float] = field(default_factory=list)
    answer: list[float] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)


async def publish_to_serve(stack: LocalStack, reps: int, timeout_s: float = 60.0) -> Promotions:
    """``reps`` promotions of fresh bundles (each bundle published first, untimed), each timed from publishing the
    promotion (module docstring)."""
    settings = stack.client_settings()
    broker = kafka_broker(settings)
    await start_or_raise(broker, settings, "bench publisher")
    publisher = EventPublisher(broker, PROMPTS_SENDER)
    url = f"{stack.ports.llm_url}/v1/chat/completions"
    slot, previous, measured = fingerprint("system", SYSTEM), "", Promotions()
    try:
        async with httpx.AsyncClient() as client:
            for rep in range(reps):
                bundle = PromptBundle.create({slot: f"Always reply in French. (promotion {rep})"}, source="bench")
                await publisher.publish_many(TopicKey.PROMPTS, [bundle])
                promotion = PromptPromotion(
                    action=PromotionAction.PROMOTE,
                    bundle_id=bundle.bundle_id,
                    previous=previous,
                    reason="bench/apo.py publish_to_serve",
                )
                started = time.perf_counter()
                await publisher.publish_many(TopicKey.PROMPT_PROMOTIONS, [promotion])
                acknowledged = time.perf_counter() - started
                serve, answer, calls = await _served_with(client, url, bundle.bundle_id, timeout_s)
                measured.serve.append(acknowledged + serve)
                measured.answer.append(acknowledged + answer)
                measured.calls.append(calls)
                previous = bundle.bundle_id
    finally:
        await close_quietly([broker])
    return measured


def run_system(max_rollouts: int, seed: int, reps: int, texts: list[str]) -> dict[str, Any]:
    """The end-to-end keys (module docstring); ``texts``: the scripted optimiser's proposals, in order."""
    model = ensure_smollm2()
    with tempfile.TemporaryDirectory(prefix="fulmen-apo-") as tmp:
        splits = write_splits(Path(tmp) / "data", (8, 8, 8))
        settings = FulmenSettings(home=Path(tmp) / "home")
        plan = LocalPlan(AGENT, model, runners=1, concurrency=16, run_prefix="apo")
        started = time.perf_counter()
        with scripted_optimizer(texts) as optimizer, local_stack(settings, plan) as stack:
            startup_s = time.perf_counter() - started
            report = optimize_prompt(
                AGENT,
                splits["train"],
                splits["val"],
                splits["test"],
                optimizer.url(),
                max_rollouts,
                seed=seed,
                minibatch=3,
                local=False,
                settings=stack.client_settings(),
            )
            promotions = asyncio.run(publish_to_serve(stack, reps))
    return {
        "system_model": "SmolLM2-135M-Instruct (transformers backend, CPU)",
        "heldout_before": report.heldout_before,
        "heldout_after": report.heldout_after,
        "rollouts_used": report.rollouts_used,
        "system_max_rollouts": max_rollouts,
        "system_best": next(iter(report.best_slots.values())),
        "system_rollouts_to_best": report.rollouts_to_best,
        "system_stopped_by": report.stopped_by,
        "calls_checked": report.calls_checked,
        "bundle_mismatches": report.bundle_mismatches,
        "publish_to_serve_p95_s": round(p95(promotions.serve), 3),
        "publish_to_serve_s": [round(s, 3) for s in promotions.serve],
        "publish_to_answer_p95_s": round(p95(promotions.answer), 3),
        "publish_to_serve_calls": promotions.calls,
        "system_startup_s": round(startup_s, 1),
        "system_search_s": round(report.wall_s, 1),
    }
