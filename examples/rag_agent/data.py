"""Two- and three-hop questions over the RAG corpus, in three splits: training, held-out, and unseen.

The corpus (:mod:`examples.rag_agent.corpus`) has an inland region (people born in towns, towns on rivers,
rivers rising in mountain ranges) and a coastal region (workers at companies, companies headquartered in ports,
ports on islands, islands in seas, ships with home ports). A question names one entity and follows its
relations one page at a time; each template is one such chain, written as a question:

* ``born-river`` (2 hops): "On which river lies the town where <person> was born?";
* ``born-river-range`` (3): "In which mountains does the river rise that flows through the town where <person>
  was born?";
* ``works-hq`` (2): "In which port is the company that <worker> works for headquartered?";
* ``works-hq-island`` (3): "On which island is the port where the company that <worker> works for is
  headquartered?";
* ``homeport-island`` (2): "On which island is the home port of the ship <ship>?";
* ``homeport-island-sea`` (3): "In which sea is the island where the ship <ship> has its home port?".

Splits (fixed seeds, each question once):

* :func:`train_tasks`: the two inland templates about the first ``TRAIN_PEOPLE`` people (2,000 questions; a
  longer request repeats them in order), the templates in turn, so any even prefix has as many of each;
* :func:`heldout_tasks` (in distribution): the same two templates about the other 150 people (300 questions),
  whose pages no training question reaches (their towns and rivers are shared: that is the distribution);
* :func:`unseen_tasks`: the four coastal templates (400 questions): entities and relation kinds no training
  question's path touches.

A task input: ``{"question", "answer", "gold_docs": [the path's document ids], "hops", "template"}``, plus
``"greedy": true`` in both held-out splits.

    python -m examples.rag_agent.data OUT_DIR [--train 256] [--val 64]   # train.jsonl, val.jsonl (in distribution)
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

from examples.rag_agent.corpus import Corpus, corpus
from examples.spec import write_splits_command

__all__ = [
    "TEMPLATES",
    "TRAIN_PEOPLE",
    "TRAIN_TEMPLATES",
    "UNSEEN_TEMPLATES",
    "Template",
    "corpus",
    "heldout_tasks",
    "question",
    "train_tasks",
    "unseen_tasks",
]

SEED = 777
TRAIN_PEOPLE = 1000  # the first people of the corpus; the others are the held-out split's


@dataclass(frozen=True)
class Template:
    """A question family: the kind of entity it names, the relations it follows, and its wording."""

    kind: str
    relations: tuple[str, ...]
    wording: str  # "{}" is the entity's name

    @property
    def hops(self) -> int:
        return len(self.relations)


TEMPLATES = {
    "born-river": Template("person", ("born_in", "on_river"), "On which river lies the town where {} was born?"),
    "born-river-range": Template(
        "person",
        ("born_in", "on_river", "rises_in"),
        "In which mountains does the river rise that flows through the town where {} was born?",
    ),
    "works-hq": Template(
        "worker", ("works_for", "headquartered_in"), "In which port is the company that {} works for headquartered?"
    ),
    "works-hq-island": Template(
        "worker",
        ("works_for", "headquartered_in", "on_island"),
        "On which island is the port where the company that {} works for is headquartered?",
    ),
    "homeport-island": Template("ship", ("home_port", "on_island"), "On which island is the home port of the ship {}?"),
    "homeport-island-sea": Template(
        "ship", ("home_port", "on_island", "in_sea"), "In which sea is the island where the ship {} has its home port?"
    ),
}
TRAIN_TEMPLATES = ("born-river", "born-river-range")
UNSEEN_TEMPLATES = ("works-hq", "works-hq-island", "homeport-island", "homeport-island-sea")


def question(c: Corpus, template: str, entity: str) -> dict[str, Any]:
    """The task input asking ``template`` about ``entity``: its path of pages, one per relation, ends at the
    answer."""
    family = TEMPLATES[template]
    gold_docs, subject = [], entity
    for relation in family.relations:
        fact = c.fact_of(subject)
        if fact.relation != relation:
            raise ValueError(f"{template}: the page of {subject!r} says {fact.relation}, not {relation}")
        gold_docs.append(c.pages[subject])
        subject = fact.object
    return {
        "question": family.wording.format(entity),
        "answer": subject,
        "gold_docs": gold_docs,
        "hops": family.hops,
        "template": template,
    }


def _interleaved(templates: tuple[str, ...], entities: dict[str, list[str]], seed: int) -> list[dict[str, Any]]:
    """Every template about each of its entities, each template's entities in its own shuffled order, the
    templates taken in turn (one of each, then the next of each...)."""
    c, columns = corpus(), []
    for k, template in enumerate(templates):
        names = list(entities[TEMPLATES[template].kind])
        random.Random(seed * 100 + k).shuffle(names)
        columns.append([question(c, template, name) for name in names])
    return [column[i] for i in range(max(map(len, columns))) for column in columns if i < len(column)]


def _people(train: bool) -> list[str]:
    people = list(corpus().entities["person"])
    return people[:TRAIN_PEOPLE] if train else people[TRAIN_PEOPLE:]


@functools.cache
def _pool(split: str) -> tuple[dict[str, Any], ...]:
    if split == "train":
        return tuple(_interleaved(TRAIN_TEMPLATES, {"person": _people(train=True)}, SEED + 1))
    if split == "heldout":
        return tuple(_interleaved(TRAIN_TEMPLATES, {"person": _people(train=False)}, SEED + 2))
    entities = {kind: list(corpus().entities[kind]) for kind in ("worker", "ship")}
    return tuple(_interleaved(UNSEEN_TEMPLATES, entities, SEED + 3))


def _copy(task: dict[str, Any]) -> dict[str, Any]:
    return task | {"gold_docs": list(task["gold_docs"])}


def _first(split: str, count: int) -> list[dict[str, Any]]:
    pool = _pool(split)
    if count > len(pool):
        raise ValueError(f"the RAG example has {len(pool)} {split} questions, not {count}")
    return [_copy(task) | {"greedy": True} for task in pool[:count]]


def train_tasks(count: int) -> list[dict[str, Any]]:
    """``count`` training questions: ``born-river`` and ``born-river-range`` in turn, about people no held-out
    question names (2,000 distinct; repeated in order beyond that)."""
    pool = _pool("train")
    return [_copy(pool[i % len(pool)]) for i in range(count)]


def heldout_tasks(count: int) -> list[dict[str, Any]]:
    """``count`` in-distribution held-out questions (at most 300): the training templates about other people;
    greedy."""
    return _first("heldout", count)


def unseen_tasks(count: int) -> list[dict[str, Any]]:
    """``count`` unseen held-out questions (at most 400): the coastal region's four templates in turn; greedy."""
    return _first("unseen", count)


def main(argv: list[str] | None = None) -> None:
    write_splits_command("rag", train_tasks, heldout_tasks, argv, unseen_tasks)


if __name__ == "__main__":
    main()
