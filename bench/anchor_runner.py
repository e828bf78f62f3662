"""One burst of rollouts through the anchor's store (Agent Lightning 0.3.0) by HTTP runners; prints its JSON.

Runs only inside the anchor's virtualenv (``bench/anchor.py`` starts it there):

    anchor-venv/bin/python bench/anchor_runner.py STORE_URL COUNT WORKERS SPANS

Enqueues ``COUNT`` rollouts in the store at ``STORE_URL``, then ``WORKERS`` concurrent runners (the store's HTTP
client, as its runners use it) each claim a rollout, mark the attempt running, export ``SPANS`` spans to the
store's OTLP endpoint as one request (stamped with the rollout and attempt ids) and mark it succeeded. Done = the
store reports every rollout of the burst succeeded and holds all its spans (polled every 0.1 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time


def otlp_body(rollout_id: str, attempt_id: str, spans: int) -> bytes:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    resource = request.resource_spans.add()
    for key, value in (("agentlightning.rollout_id", rollout_id), ("agentlightning.attempt_id", attempt_id)):
        attribute = resource.resource.attributes.add()
        attribute.key, attribute.value.string_value = key, value
    scope = resource.scope_spans.add()
    trace_id, now = os.urandom(16), time.time_ns()
    for step in range(spans):
        span = scope.spans.add()
        span.trace_id, span.span_id, span.name = trace_id, os.urandom(8), f"step {step}"
        span.start_time_unix_nano, span.end_time_unix_nano = now, now + 1000
    return request.SerializeToString()


async def burst(store_url: str, count: int, workers: int, spans: int) -> dict:
    import aiohttp
    from agentlightning.store.client_server import LightningStoreClient
    from agentlightning.types import EnqueueRolloutRequest

    store = LightningStoreClient(store_url)
    before = (await store.statistics()).get("total_spans", 0)
    start = time.perf_counter()
    rollouts = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(count)])
    ids = [rollout.rollout_id for rollout in rollouts]
    left = [count]

    async def runner(session: aiohttp.ClientSession, worker: int) -> None:
        while left[0] > 0:
            claimed = await store.dequeue_rollout(worker_id=f"w{worker}")
            if claimed is None:
                await asyncio.sleep(0.01)
                continue
            left[0] -= 1
            attempt = claimed.attempt.attempt_id
            await store.update_attempt(claimed.rollout_id, attempt, status="running")
            if spans:
                body = otlp_body(claimed.rollout_id, attempt, spans)
                headers = {"Content-Type": "application/x-protobuf"}
                async with session.post(f"{store_url}/v1/traces", data=body, headers=headers) as response:
                    await response.read()
            await store.update_attempt(claimed.rollout_id, attempt, status="succeeded")

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(runner(session, w) for w in range(workers)))
    while True:
        done = await store.query_rollouts(status_in=["succeeded"], rollout_id_in=ids)
        stored = (await store.statistics()).get("total_spans", 0) - before
        if len(done) >= count and stored >= spans * count:
            break
        await asyncio.sleep(0.1)
    wall = time.perf_counter() - start
    await store.close()
    return {"rollouts": count, "rollouts_per_s": count / wall, "wall_s": wall, "spans_stored": stored}


if __name__ == "__main__":
    url, n, w, s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(asyncio.run(burst(url, n, w, s))))
