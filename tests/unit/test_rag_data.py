"""The RAG example's corpus and splits: deterministic, disjoint, large enough, every answer reachable, and its
teacher and exact match right on every template."""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

import pytest

from examples.rag_agent import data
from examples.rag_agent.corpus import corpus
from examples.rag_agent.reward import exact_match, token_f1
from examples.rag_agent.search import search
from examples.rag_agent.teacher import queries, teach
from fulmen.schemas import semconv
from tests.agents.frameworks.fake_openai import SCRIPTS, FakeOpenAI
from tests.unit.test_framework_agents import exporter, run_rollout  # noqa: F401  (the fixture and the helper)

pytestmark = [pytest.mark.scenarios]

TRAIN, HELDOUT, UNSEEN = 2000, 300, 400  # distinct questions in each split
GENERIC_WORDS = {"the", "Island", "Sea", "Company", "River", "Mountains"}  # in names of both regions


def splits() -> dict[str, list[dict[str, Any]]]:
    return {
        "train": data.train_tasks(TRAIN),
        "heldout": data.heldout_tasks(HELDOUT),
        "unseen": data.unseen_tasks(UNSEEN),
    }


def relation_kinds(tasks: list[dict[str, Any]]) -> set[str]:
    facts = corpus().facts
    return {facts[doc_id].relation for task in tasks for doc_id in task["gold_docs"]}


def test_splits_are_deterministic_and_well_formed() -> None:
    assert corpus.__wrapped__() == corpus()  # a second build is the same corpus
    for split in ("train", "heldout", "unseen"):
        assert data._pool.__wrapped__(split) == data._pool(split)
    again = splits()
    assert again == splits()
    assert data.train_tasks(TRAIN + 3)[TRAIN:] == data.train_tasks(3)  # repeated in order beyond the pool
    for name, tasks in again.items():
        for task in tasks:
            assert set(task) == {"question", "answer", "gold_docs", "hops", "template"} | (
                {"greedy"} if name != "train" else set()
            )
            assert task.get("greedy", False) is (name != "train")
            assert task["hops"] == len(task["gold_docs"]) == data.TEMPLATES[task["template"]].hops in (2, 3)


def test_held_out_splits_are_large_and_never_trained_on() -> None:
    tasks = splits()
    distinct = {name: {t["question"] for t in split} for name, split in tasks.items()}
    assert len(distinct["train"]) == TRAIN >= 1000
    assert len(distinct["heldout"]) == HELDOUT >= 200 and len(distinct["unseen"]) == UNSEEN >= 200
    assert not distinct["train"] & distinct["heldout"] and not distinct["train"] & distinct["unseen"]
    assert not distinct["heldout"] & distinct["unseen"]
    with pytest.raises(ValueError, match="held"):
        data.heldout_tasks(HELDOUT + 1)
    with pytest.raises(ValueError, match="unseen"):
        data.unseen_tasks(UNSEEN + 1)
    trained_pages = {doc_id for task in tasks["train"] for doc_id in task["gold_docs"]}
    assert not trained_pages & {t["gold_docs"][0] for t in tasks["heldout"]}  # other people
    assert relation_kinds(tasks["heldout"]) == relation_kinds(tasks["train"])  # in distribution


def test_unseen_questions_touch_no_entity_or_relation_kind_of_training() -> None:
    c, tasks = corpus(), splits()
    trained_pages = {doc_id for task in tasks["train"] for doc_id in task["gold_docs"]}
    trained_words = {word for doc_id in trained_pages for word in re.findall(r"\w+", c.documents[doc_id])}
    assert not relation_kinds(tasks["unseen"]) & relation_kinds(tasks["train"])
    for task in tasks["unseen"]:
        assert not set(task["gold_docs"]) & trained_pages
        entities = {c.facts[doc_id].subject for doc_id in task["gold_docs"]} | {task["answer"]}
        names = {word for entity in entities for word in re.findall(r"\w+", entity)} - GENERIC_WORDS
        assert names and not names & trained_words, (task["question"], names & trained_words)


def test_every_answer_is_stated_on_the_path_and_the_question_finds_its_first_page() -> None:
    c = corpus()
    for name, tasks in splits().items():
        for task in tasks:
            assert c.facts[task["gold_docs"][0]].subject in task["question"], task
            assert search(task["question"])[0][0] == task["gold_docs"][0], (name, task["question"])
            for doc_id, next_doc in zip(task["gold_docs"], [*task["gold_docs"][1:], None], strict=True):
                fact = c.facts[doc_id]
                assert fact.subject.removeprefix("the ") in c.documents[doc_id] and fact.object in c.documents[doc_id]
                assert fact.object == (c.facts[next_doc].subject if next_doc else task["answer"])


def test_searching_a_pages_title_finds_it_first() -> None:
    c = corpus()
    on_paths = {doc_id for tasks in splits().values() for task in tasks for doc_id in task["gold_docs"]}
    assert on_paths == set(c.documents)  # every page is on some question's path
    for doc_id in on_paths:
        assert search(c.titles[doc_id])[0][0] == doc_id, c.titles[doc_id]


def test_every_template_is_present_and_interleaved() -> None:
    tasks = splits()
    assert Counter(t["template"] for t in tasks["train"][:32]) == {"born-river": 16, "born-river-range": 16}
    assert Counter(t["template"] for t in tasks["heldout"][:200]) == {"born-river": 100, "born-river-range": 100}
    assert Counter(t["template"] for t in tasks["unseen"][:200]) == {name: 50 for name in data.UNSEEN_TEMPLATES}
    present = {t["template"] for split in tasks.values() for t in split}
    assert present == set(data.TEMPLATES) == set(data.TRAIN_TEMPLATES) | set(data.UNSEEN_TEMPLATES)
    assert {t["hops"] for t in tasks["unseen"]} == {2, 3}


def test_exact_match_is_normalised_and_stricter_than_f1() -> None:
    assert exact_match("The Zibrou River.", "the Zibrou River") == 1.0 and exact_match("zibrou", "the Zibrou River")
    assert exact_match("Kelo Island", "Kelo Island") == exact_match("the kelo sea!", "the Kelo Sea") == 1.0
    assert exact_match("Zibrou or Tatu", "the Zibrou River") == 0.0 and token_f1("Zibrou or Tatu", "Zibrou") == 0.5
    assert exact_match("Tatu Zibrou", "Zibrou Tatu") == 0.0 and token_f1("Tatu Zibrou", "Zibrou Tatu") == 1.0
    assert exact_match("a river", "the Zibrou River") == exact_match("", "") == exact_match("x", "") == 0.0


@pytest.mark.parametrize("template", list(data.TEMPLATES))
def test_teacher_searches_each_page_then_answers(template: str) -> None:
    task = next(t for split in splits().values() for t in split if t["template"] == template)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["question"]}]
    for doc_id in task["gold_docs"]:
        reply = teach(task, messages)
        assert reply.content is None and len(reply.tool_calls) == 1
        query = json.loads(reply.tool_calls[0].arguments)["query"]
        assert search(query)[0][0] == doc_id
        messages += [{"role": "assistant"}, {"role": "tool", "content": search(query)}]
    assert teach(task, messages).content == task["answer"] and len(queries(task)) == task["hops"]
    with pytest.raises(ValueError, match="not in the corpus"):
        queries(task | {"gold_docs": ["nowhere"]})


@pytest.mark.frameworks
@pytest.mark.parametrize("template", data.UNSEEN_TEMPLATES)
async def test_the_agent_reaches_full_reward_on_unseen_templates(exporter, monkeypatch, template: str) -> None:  # noqa: F811
    from examples.rag_agent.agent import HIT_REWARD, run

    task = next(t for t in data.unseen_tasks(8) if t["template"] == template)
    monkeypatch.setitem(SCRIPTS, "rag-teacher", lambda body: teach(task, body["messages"]))
    with FakeOpenAI("rag-teacher") as server:
        rollout = await run_rollout(exporter, server, run, task, f"rag-teacher-{template}")
    assert rollout.reward == 1.0 and len(rollout.requests) == task["hops"] + 1
    hits = [(s.attributes or {}).get(semconv.REWARD_VALUE) for s in rollout.spans if s.name == semconv.SPAN_REWARD]
    assert hits == [HIT_REWARD] * task["hops"]  # each search found its gold page
