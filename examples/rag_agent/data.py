"""A corpus of short documents about invented people, towns, rivers and mountains, and multi-hop questions over it.

Everything is made up (names are built from syllables with a fixed seed), so no model can know an answer without
reading the documents. Each person was born in a town, each town lies on a river, each river rises in a
mountain range; one document states one fact and is titled with the entity it is about (a person's, a town's or
a river's page, as in an encyclopedia). Questions:

* two hops: "On which river lies the town where <person> was born?" (the person's document, then the town's);
* three hops: "In which mountains does the river rise that flows through the town where <person> was born?".

A task input: ``{"question", "answer", "gold_docs": [document ids on the path], "hops"}``, plus ``"greedy":
true`` on held-out tasks. Training and held-out questions are about different people (a held-out question is
never trained on, though its towns and rivers may be).

    python -m examples.rag_agent.data OUT_DIR [--train 256] [--val 64]
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

from examples.spec import write_splits_command

__all__ = ["Corpus", "corpus", "heldout_tasks", "person_of", "train_tasks"]

SEED = 777
PEOPLE, TOWNS, RIVERS, RANGES = 240, 40, 12, 5
HELDOUT_PEOPLE = 40  # the last ones: held-out questions are about them only
ONSETS = ("b", "d", "k", "l", "m", "n", "r", "s", "t", "v", "z", "th", "gr", "br", "st")
VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")


@dataclass(frozen=True)
class Corpus:
    """The documents (id -> text), their titles (id -> the entity a document is about) and the facts behind them."""

    documents: dict[str, str]
    titles: dict[str, str]
    born_in: dict[str, str]  # person -> town
    river_of: dict[str, str]  # town -> river
    source_of: dict[str, str]  # river -> mountain range


def _name(r: random.Random, syllables: int, used: set[str]) -> str:
    while True:
        name = "".join(r.choice(ONSETS) + r.choice(VOWELS) for _ in range(syllables)).capitalize()
        if name not in used:
            used.add(name)
            return name


@functools.cache
def corpus() -> Corpus:
    r, used = random.Random(SEED), set()
    ranges = [f"the {_name(r, 2, used)} Mountains" for _ in range(RANGES)]
    rivers = [f"the {_name(r, 2, used)} River" for _ in range(RIVERS)]
    towns = [_name(r, 3, used) for _ in range(TOWNS)]
    people = [f"{_name(r, 2, used)} {_name(r, 3, used)}" for _ in range(PEOPLE)]
    source_of = {river: r.choice(ranges) for river in rivers}
    river_of = {town: r.choice(rivers) for town in towns}
    born_in = {person: r.choice(towns) for person in people}
    documents: dict[str, str] = {}
    titles: dict[str, str] = {}
    for i, person in enumerate(people):
        documents[f"p{i}"] = f"{person} was born in {born_in[person]} and works as a {r.choice(_JOBS)}."
        titles[f"p{i}"] = person
    for i, town in enumerate(towns):
        documents[f"t{i}"] = f"{town} is a town on {river_of[town]}, known for its {r.choice(_GOODS)}."
        titles[f"t{i}"] = town
    for i, river in enumerate(rivers):
        documents[f"r{i}"] = f"{river} rises in {source_of[river]} and is {r.randint(40, 900)} km long."
        titles[f"r{i}"] = river.removeprefix("the ")
    return Corpus(documents, titles, born_in, river_of, source_of)


_JOBS = ("baker", "weaver", "pilot", "miller", "potter", "teacher", "smith", "clerk")
_GOODS = ("bridges", "markets", "wool", "bells", "orchards", "glass", "salt", "ferries")


def _doc_id(c: Corpus, prefix: str, key: str, keys: list[str]) -> str:
    return f"{prefix}{keys.index(key)}"


def _questions(people: list[str]) -> list[dict[str, Any]]:
    c = corpus()
    everyone, towns, rivers = list(c.born_in), list(c.river_of), list(c.source_of)
    tasks = []
    for person in people:
        town = c.born_in[person]
        river = c.river_of[town]
        path = [_doc_id(c, "p", person, everyone), _doc_id(c, "t", town, towns)]
        tasks.append(
            {
                "question": f"On which river lies the town where {person} was born?",
                "answer": river,
                "gold_docs": path,
                "hops": 2,
            }
        )
        tasks.append(
            {
                "question": f"In which mountains does the river rise that flows through the town where "
                f"{person} was born?",
                "answer": c.source_of[river],
                "gold_docs": [*path, _doc_id(c, "r", river, rivers)],
                "hops": 3,
            }
        )
    return tasks


def person_of(question: str) -> str:
    """The person a question is about (both question forms end with "where <person> was born?")."""
    return question.rsplit("where ", 1)[-1].removesuffix(" was born?")


def train_tasks(count: int) -> list[dict[str, Any]]:
    """``count`` training questions (two- and three-hop in turn, shuffled with a fixed seed; repeated beyond the
    400 there are)."""
    pool = _questions(list(corpus().born_in)[: PEOPLE - HELDOUT_PEOPLE])
    random.Random(SEED + 1).shuffle(pool)
    return [pool[i % len(pool)] for i in range(count)]


def heldout_tasks(count: int) -> list[dict[str, Any]]:
    """``count`` held-out questions (at most 80), about people no training question names; greedy."""
    pool = _questions(list(corpus().born_in)[PEOPLE - HELDOUT_PEOPLE :])
    random.Random(SEED + 2).shuffle(pool)
    if count > len(pool):
        raise ValueError(f"the RAG example has {len(pool)} held-out questions, not {count}")
    return [t | {"greedy": True} for t in pool[:count]]


def main(argv: list[str] | None = None) -> None:
    write_splits_command("rag", train_tasks, heldout_tasks, argv)


if __name__ == "__main__":
    main()
