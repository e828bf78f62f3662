"""The system evaluator over in-memory Kafka: each candidate a published bundle, its rollouts dispatched naming it
(through the trainer's Dispatcher) and collected as transition batches (through the trainer's Collector), the
search's budget counted before dispatch; the whole gepa search runs on it from its own thread."""

from __future__ import annotations

import asyncio

import pytest

from fulmen.algorithm.prompts import Proposal, SearchConfig, optimize
from fulmen.algorithm.prompts.system import EvaluatorOptions, SystemEvaluator
from fulmen.algorithm.service.collector import Collector
from fulmen.algorithm.service.groups import GroupBook
from fulmen.algorithm.settings import IncompletePolicy
from fulmen.schemas.codec import encode
from fulmen.schemas.events import RolloutMode, RolloutRequest, RolloutStatus, TransitionBatch
from fulmen.schemas.prompts import PromptBundle, fingerprint
from fulmen.schemas.task_file import TaskSpec
from fulmen.schemas.topics import TopicKey
from tests.fakes import FakeConsumer

pytestmark = pytest.mark.apo

SLOT = fingerprint("system", "You are a helpful assistant.")
GOOD = "Always reply in French."
TASKS = [TaskSpec(f"{split}-{i}", {"question": f"q{i}"}) for split in ("train", "val", "test") for i in range(4)]


class FakeSystem:
    """The tasks and prompts topics as one publisher: a request is 'run' at once (reward 1 when its bundle says
    GOOD, 0 otherwise; no bundle: the agent's own prompt), its batch appended to the transitions consumer."""

    def __init__(self, source: FakeConsumer) -> None:
        self.source = source
        self.bundles: dict[str, PromptBundle] = {}
        self.requests: list[RolloutRequest] = []
        self.published: list[tuple[TopicKey, str]] = []  # (topic, bundle id or rollout id), in order

    async def publish_many(self, key: TopicKey, events) -> None:
        for event in events:
            if key is TopicKey.PROMPTS:
                self.bundles[event.bundle_id] = event
                self.published.append((key, event.bundle_id))
            elif key is TopicKey.TASKS:
                self.published.append((key, event.rollout_id))
                self.requests.append(event)
                self._run(event)

    def _run(self, request: RolloutRequest) -> None:
        if request.prompt_bundle is not None and request.prompt_bundle not in self.bundles:
            raise AssertionError(f"{request.rollout_id} names {request.prompt_bundle}, not published before it")
        slots = self.bundles[request.prompt_bundle].slots if request.prompt_bundle else {}
        reward = 1.0 if slots.get(SLOT) == GOOD else 0.0
        batch = TransitionBatch(
            rollout_id=request.rollout_id,
            attempt=1,
            task_id=request.task_id,
            group_id=request.group_id,
            mode=request.mode,
            status=RolloutStatus.SUCCEEDED,
            episode_reward=reward,
        )
        self.source.append("transitions", 0, encode(batch), batch.group_id.encode())


class Script:
    """A proposer: one distractor, then the good instruction, then nothing."""

    def __init__(self) -> None:
        self.texts = ["Be concise.", GOOD]
        self.failing_seen: list[list[str]] = []

    def propose(self, request) -> Proposal:
        self.failing_seen.append([e.evidence for e in request.failing])
        return Proposal({SLOT: self.texts.pop(0)} if self.texts else None)


def _evaluator(system: FakeSystem, source: FakeConsumer, loop, evidence) -> SystemEvaluator:
    collector = Collector(source, GroupBook(timeout_s=60, policy=IncompletePolicy.DROP), poll_timeout_ms=0)
    options = EvaluatorOptions(agent="agents:solve", run_id="prompts-1", source="gepa")
    return SystemEvaluator(system, system, collector, TASKS, loop, options, evidence=evidence)


def test_a_search_through_the_evaluator_dispatches_bundles_and_counts_every_rollout() -> None:
    source = FakeConsumer()
    system = FakeSystem(source)
    asked: list[list[str]] = []

    def evidence(ids: list[str]) -> dict[str, str]:
        asked.append(list(ids))
        return {rid: f"what {rid} saw" for rid in ids}

    async def main():
        evaluator = _evaluator(system, source, asyncio.get_running_loop(), evidence)
        proposer = Script()
        result = await asyncio.to_thread(
            optimize,
            evaluator,
            proposer,
            {SLOT: "You are a helpful assistant."},
            train=[t.task_id for t in TASKS[:4]],
            val=[t.task_id for t in TASKS[4:8]],
            test=[t.task_id for t in TASKS[8:]],
            max_rollouts=40,
            config=SearchConfig(minibatch=2),
        )
        return evaluator, proposer, result

    evaluator, proposer, result = asyncio.run(main())
    assert result.best.slots == {SLOT: GOOD}
    assert (result.report["heldout_before"], result.report["heldout_after"]) == (0.0, 1.0)
    # every rollout the budget counted was dispatched, and only those: base val 4, two minibatch pairs 8, the good
    # one's val 4, the test report 8
    assert result.rollouts_used == len(system.requests) == len(evaluator.rollout_ids) == 24
    assert all(r.mode is RolloutMode.VAL and r.metadata == {"agent": "agents:solve"} for r in system.requests)
    # each candidate's bundle went out once (FakeSystem refuses a request whose bundle was not published before it)
    bundles = [b for key, b in system.published if key is TopicKey.PROMPTS]
    refused = evaluator.bundle({SLOT: "Be concise."}).bundle_id
    assert bundles == [result.candidates[0].id, refused, result.best.id]  # base, the refused distractor, the good one
    assert {r.prompt_bundle for r in system.requests} == set(bundles)
    assert system.bundles[result.best.id].source == "gepa" and system.bundles[result.best.id].run_id == "prompts-1"
    # the failing episodes carried their rollouts' evidence, read for the failing rollouts only
    assert proposer.failing_seen and all(text.startswith("what ") for seen in proposer.failing_seen for text in seen)
    rewards = {e.rollout_id: e.reward for c in result.candidates for e in c.episodes}
    assert all(rewards.get(rid, 0.0) < 1.0 for ids in asked for rid in ids)


def test_no_slots_dispatches_rollouts_that_name_no_bundle() -> None:
    source = FakeConsumer()
    system = FakeSystem(source)

    async def main():
        evaluator = _evaluator(system, source, asyncio.get_running_loop(), None)
        return await evaluator.evaluate(None, ["train-0", "train-1"])

    episodes = asyncio.run(main())
    assert [(e.task_id, e.reward) for e in episodes] == [("train-0", 0.0), ("train-1", 0.0)]
    assert [r.prompt_bundle for r in system.requests] == [None, None] and not system.bundles
    assert [e.rollout_id for e in episodes] == [r.rollout_id for r in system.requests]


def test_run_refuses_to_block_its_own_event_loop() -> None:
    source = FakeConsumer()

    async def main():
        evaluator = _evaluator(FakeSystem(source), source, asyncio.get_running_loop(), None)
        evaluator.run({SLOT: GOOD}, ["val-0"])

    with pytest.raises(RuntimeError, match="another thread"):
        asyncio.run(main())
