"""Prompt bundles through the real broker, store and LLM gateway (tiny model): a rollout naming a bundle gets its
system prompt replaced before tokenising, a call naming none is unchanged until a bundle is promoted and again after
the rollback; an unknown bundle is a 404; the bundles and promotions land in the store (issue 29)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI
from opentelemetry.sdk.trace import TracerProvider

from fulmen.algorithm.prompts.bundles import decide_prompt, publish_bundles, read_prompt_promotions
from fulmen.consumers.event_sinks import EVENT_SINKS
from fulmen.consumers.spans import SpanSink
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import Store
from fulmen.producers.llm_gateway import LlmGateway
from fulmen.producers.runner import Runner, RunnerSettings, load_agent
from fulmen.prompt_queries import bundle_rows, scan_prompts, serving_by_scope
from fulmen.schemas import PromotionAction, RolloutStatus, semconv
from fulmen.schemas.prompts import PromptBundle, fingerprint
from fulmen.testing.llm_pipeline import base_url, llm_gateway_running, published_spans
from tests.integration.span_pipeline import span_pipeline
from tests.integration.test_feedback import consumers_running, rows
from tests.integration.test_models_follower import until
from tests.integration.test_promotion import cli
from tests.integration.test_runner import request, submit, wait_terminal
from tests.polling import count_reaches

pytestmark = [pytest.mark.integration, pytest.mark.apo]

SYSTEM = "You add two numbers.\n  Reply politely."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "12+7"}]
BETTER = "Answer with the sum in digits only."


async def _call(gateway: LlmGateway, rollout_id: str, bundle: str | None = None, messages=MESSAGES) -> str | None:
    """One call; the bundle the gateway says it applied (its response header), None when none."""
    url = base_url(gateway, rollout_id)
    if bundle is not None:
        url = url.removesuffix("/v1") + f"/bundle/{bundle}/v1"
    async with AsyncOpenAI(base_url=url, api_key="x") as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="fulmen", messages=messages, max_tokens=3, seed=1
        )
    return raw.headers.get(semconv.PROMPT_BUNDLE_HEADER)


async def test_a_bundle_rewrites_the_calls_of_the_rollouts_naming_it_and_a_promotion_the_others(
    settings: FulmenSettings, linked_store: Store, tiny_model: Path
) -> None:
    bundle = PromptBundle.create({fingerprint("system", SYSTEM): BETTER}, source="manual")
    async with (
        consumers_running(settings, linked_store),
        llm_gateway_running(settings, tiny_model, follow_models=False) as gateway,
    ):
        await publish_bundles(settings, [bundle])
        # may arrive before the gateway saw the bundle: it waits; the response names the bundle it was served with
        assert await _call(gateway, "named", bundle.bundle_id) == bundle.bundle_id
        assert await _call(gateway, "plain") is None
        await decide_prompt(settings, PromotionAction.PROMOTE, bundle.bundle_id, None, "test")
        await until(lambda: gateway.prompts.serving(None) == bundle.bundle_id)
        assert await _call(gateway, "promoted") == bundle.bundle_id
        await decide_prompt(settings, PromotionAction.ROLLBACK, None, None, "test")
        await until(lambda: gateway.prompts.serving(None) == "")
        await _call(gateway, "rolled-back")
        await _call(gateway, "by-hand", messages=[{"role": "system", "content": BETTER}, MESSAGES[1]])
        async with httpx.AsyncClient() as http:
            unknown = await http.post(
                base_url(gateway, "unknown").removesuffix("/v1") + "/bundle/pb-000000000000/v1/chat/completions",
                json={"model": "fulmen", "messages": MESSAGES, "max_tokens": 2},
                timeout=60,
            )
        assert unknown.status_code == 404 and "pb-000000000000" in unknown.json()["error"]["message"]
        spans = {s["attributes"][semconv.ROLLOUT_ID]: s["attributes"] for s in await published_spans(settings, 5)}
        for table, expected in (("prompt_bundles", 1), ("prompt_promotions", 2), ("otel_traces", 5)):
            await count_reaches(linked_store, f"SELECT count() FROM {linked_store.database}.{table} FINAL", expected)
    for rollout in ("named", "promoted"):
        attributes = spans[rollout]
        assert attributes[semconv.PROMPT_BUNDLE] == bundle.bundle_id
        assert attributes[semconv.PROMPT_SLOTS] == [fingerprint("system", SYSTEM)]
        assert json.loads(attributes[semconv.GEN_AI_INPUT_MESSAGES])[0]["content"] == BETTER
        # what was tokenised is the bundle's text: the same ids as the same messages sent by hand
        assert attributes[semconv.PROMPT_TOKEN_IDS] == spans["by-hand"][semconv.PROMPT_TOKEN_IDS]
    for rollout in ("plain", "rolled-back"):
        attributes = spans[rollout]
        assert semconv.PROMPT_BUNDLE not in attributes
        assert json.loads(attributes[semconv.GEN_AI_INPUT_MESSAGES])[0]["content"] == SYSTEM
        assert attributes[semconv.PROMPT_TOKEN_IDS] != spans["by-hand"][semconv.PROMPT_TOKEN_IDS]
    [[stored_id, slots, source]] = rows(linked_store, "SELECT BundleId, Slots, Source FROM {db}.prompt_bundles FINAL")
    assert (stored_id, slots, source) == (bundle.bundle_id, bundle.slots, "manual")
    # `fulmen prompts scan` and `list`: the agent's own system prompt (the calls no bundle rewrote), and the bundle
    scanned = {p.slot: p for p in scan_prompts(linked_store, linked_store.database)}
    assert (scanned[fingerprint("system", SYSTEM)].calls, scanned[fingerprint("system", SYSTEM)].text) == (2, SYSTEM)
    assert scanned[fingerprint("user", "12+7")].calls == 3  # the by-hand call's too; its system prompt is BETTER
    [listed] = bundle_rows(linked_store, linked_store.database)
    assert (listed.bundle_id, listed.slots, listed.parents) == (bundle.bundle_id, bundle.slots, ())
    assert serving_by_scope(linked_store, linked_store.database) == {"": ""}  # rolled back to the agent's own
    decisions = rows(
        linked_store, "SELECT Action, BundleId, Previous FROM {db}.prompt_promotions FINAL ORDER BY CreatedAt"
    )
    assert decisions == [["promote", bundle.bundle_id, ""], ["rollback", "", bundle.bundle_id]]


async def test_a_bundle_id_that_is_not_one_is_refused_with_400(settings: FulmenSettings, tiny_model: Path) -> None:
    async with llm_gateway_running(settings, tiny_model, follow_models=False) as gateway, httpx.AsyncClient() as http:
        answer = await http.post(
            base_url(gateway, "r").removesuffix("/v1") + "/bundle/not-a-bundle/v1/chat/completions",
            json={"model": "fulmen", "messages": MESSAGES},
            timeout=60,
        )
    assert answer.status_code == 400 and "bundle" in answer.json()["error"]["message"]


def test_prompts_create_promote_and_rollback_from_the_command_line(settings: FulmenSettings) -> None:
    slot = fingerprint("system", SYSTEM)
    done = cli(settings, "prompts", "create", "--slot", f"{slot}={BETTER}", "--agent", "adder")
    bundle = PromptBundle.create({slot: BETTER}, agent="adder")
    assert done.returncode == 0 and f"published {bundle.bundle_id}" in done.stdout, done.stdout + done.stderr
    bad = cli(settings, "prompts", "create", "--slot", "tpl:q=Answer {question}", "--template", "q={question} {hint}")
    assert bad.returncode != 0 and "drops {hint}" in bad.stdout + bad.stderr
    done = cli(settings, "prompts", "promote", bundle.bundle_id, "--agent", "adder")
    assert done.returncode == 0 and f"promoted {bundle.bundle_id} for adder" in done.stdout, done.stdout + done.stderr
    unknown = cli(settings, "prompts", "promote", "pb-000000000000")
    assert unknown.returncode != 0 and "no bundle pb-000000000000" in unknown.stdout + unknown.stderr
    done = cli(settings, "prompts", "rollback", "--agent", "adder")
    assert done.returncode == 0 and "rolled adder back to the agents' own prompts" in done.stdout
    nothing = cli(settings, "prompts", "rollback")
    assert nothing.returncode != 0 and "nothing to roll back" in nothing.stdout + nothing.stderr
    dataset = settings.home / "tasks.jsonl"
    dataset.write_text('{"input": {"q": 1}}\n')
    untrained = cli(settings, "train", "--dataset", str(dataset), "--prompt-bundle", "pb-000000000000")
    assert untrained.returncode != 0 and "pb-000000000000: not on this deployment's prompts topic" in (
        untrained.stdout + untrained.stderr
    ), untrained.stdout + untrained.stderr
    decisions = asyncio.run(read_prompt_promotions(settings))
    assert [(d.action.value, d.agent, d.bundle_id, d.previous) for d in decisions] == [
        ("promote", "adder", bundle.bundle_id, ""),
        ("rollback", "adder", "", bundle.bundle_id),
    ]


async def test_a_runner_gets_the_rollouts_bundle_to_the_gateway_with_no_change_to_the_agent(
    settings: FulmenSettings, linked_store: Store, tiny_model: Path
) -> None:
    """tests.agents.chat:ask sends the system prompt "Answer briefly." through the URL the runner hands it."""
    bundle = PromptBundle.create({fingerprint("system", "Answer briefly."): BETTER})
    await publish_bundles(settings, [bundle])
    sinks = [SpanSink(), EVENT_SINKS["rollouts"]]
    async with (
        span_pipeline(settings, linked_store, sinks=sinks) as pipeline,
        llm_gateway_running(settings, tiny_model, follow_models=False) as gateway,
    ):
        options = RunnerSettings(
            home=settings.home,
            kafka=settings.kafka.model_dump(),
            clickhouse=settings.clickhouse.model_dump(),
            runner={
                "agent": "tests.agents.chat:ask",
                "concurrency": 2,
                "otlp_endpoint": "",
                "shutdown_grace_s": 5,
                "llm_base_url": f"http://127.0.0.1:{gateway.port}",
            },
        )
        runner = Runner(options, load_agent("tests.agents.chat:ask"), tracer_provider=TracerProvider())
        stop = asyncio.Event()
        running = asyncio.create_task(runner.run(stop))
        try:
            await submit(
                settings,
                [
                    request("with", {"question": "2+2?"}, prompt_bundle=bundle.bundle_id),
                    request("without", {"question": "2+2?"}),
                ],
            )
            events = await wait_terminal(settings, {"with", "without"}, timeout_s=120)
        finally:
            stop.set()
            await asyncio.wait_for(running, 60)
        assert [events[r][-1].status for r in ("with", "without")] == [RolloutStatus.SUCCEEDED] * 2
        assert [events[r][-1].prompt_bundle for r in ("with", "without")] == [bundle.bundle_id, None]
        await pipeline.wait_spans("ServiceName = 'fulmen-llm-gateway'", 2, timeout_s=60)
        db = linked_store.database
        await count_reaches(linked_store, f"SELECT count() FROM {db}.rollouts FINAL WHERE Status = 'succeeded'", 2)
    calls = {
        row[0]: row[1:]
        for row in rows(
            linked_store,
            (
                "SELECT RolloutId, SpanAttributes['fulmen.prompt.bundle'], SpanAttributes['gen_ai.input.messages'] "
                "FROM {db}.otel_traces FINAL WHERE ServiceName = 'fulmen-llm-gateway'"
            ),
        )
    }
    assert calls["with"][0] == bundle.bundle_id and json.loads(calls["with"][1])[0]["content"] == BETTER
    assert calls["without"][0] == "" and json.loads(calls["without"][1])[0]["content"] == "Answer briefly."
    stored = rows(linked_store, "SELECT RolloutId, PromptBundle FROM {db}.rollouts FINAL ORDER BY RolloutId")
    assert stored == [["with", bundle.bundle_id], ["without", ""]]


async def test_scan_names_the_agent_a_call_named_in_its_url_and_reads_chosen_rollouts(
    settings: FulmenSettings, linked_store: Store, tiny_model: Path
) -> None:
    """A framework's gateway span carries no agent name of its own: scan takes the one the URL named
    (``/agent/{name}``), which is what `fulmen optimize-prompt --only-agent` filters on; ``rollout_ids`` keeps
    only those rollouts' calls."""
    async with (
        consumers_running(settings, linked_store),
        llm_gateway_running(settings, tiny_model, follow_models=False) as gateway,
    ):
        async with AsyncOpenAI(
            base_url=base_url(gateway, "w1").removesuffix("/v1") + "/agent/writer/v1", api_key="x"
        ) as client:
            await client.chat.completions.create(model="fulmen", messages=MESSAGES, max_tokens=2, seed=1)
        other = [{"role": "system", "content": "Another prompt."}, MESSAGES[1]]
        await _call(gateway, "o1", messages=other)
        await count_reaches(linked_store, f"SELECT count() FROM {linked_store.database}.otel_traces FINAL", 2)
    scanned = scan_prompts(linked_store, linked_store.database, ("system",), rollout_ids=("w1",))
    assert [(p.slot, p.agents) for p in scanned] == [(fingerprint("system", SYSTEM), ("writer",))]
