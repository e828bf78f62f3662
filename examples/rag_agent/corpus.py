"""The RAG example's invented world and its documents: one short page per entity, each stating one fact.

Everything is made up (names are built from syllables with a fixed seed, every name unique), so no model can
know a fact without reading its page. The world has two regions, both in the one corpus the ``search`` tool
searches (nothing in a document says which region it belongs to):

* the inland region: people (``p``: born in a town), towns (``t``: lie on a river) and rivers (``r``: rise in a
  mountain range). Training questions and the in-distribution held-out questions are asked here;
* the coastal region: workers (``w``: work for a company), companies (``c``: headquartered in a port), ports
  (``h``, harbours: lie on an island), islands (``i``: lie in a sea) and ships (``s``: have a home port). Only the
  unseen held-out questions are asked here: no entity and no relation kind of this region is on the path of any
  training question.

A page is titled with its entity (as in an encyclopedia) and states one fact, ``subject relation object``, plus
a detail no question asks about (a trade, a length, a population). Mountain ranges and seas are answers only:
they have no page. Each relation deals its objects out in turn from a shuffled list of their kind (every river
has as many towns as any other, within one), so no answer is a good guess.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["KINDS", "Corpus", "Fact", "corpus"]

SEED = 777
ONSETS = ("b", "d", "k", "l", "m", "n", "r", "s", "t", "v", "z", "th", "gr", "br", "st")
VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
KINDS = {  # kind -> (how many, document id prefix or None for answers without a page)
    "range": (10, None),
    "river": (30, "r"),
    "town": (80, "t"),
    "person": (1150, "p"),
    "sea": (8, None),
    "island": (16, "i"),
    "port": (40, "h"),
    "company": (30, "c"),
    "worker": (100, "w"),
    "ship": (100, "s"),
}
_JOBS = ("baker", "weaver", "pilot", "miller", "potter", "teacher", "smith", "clerk")
_GOODS = ("bridges", "markets", "wool", "bells", "orchards", "glass", "salt", "ferries")
_ROLES = ("clerk", "sailor", "buyer", "cooper", "navigator", "bookkeeper", "rope maker", "chart maker")
_WARES = ("timber", "spices", "tea", "copper", "linen", "pearls", "whale oil", "tobacco")
_VESSELS = ("schooner", "brig", "ketch", "barque", "sloop", "cutter")


@dataclass(frozen=True)
class Fact:
    """What one document states: ``subject`` (its title's entity) ``relation`` ``object``."""

    subject: str
    relation: str
    object: str


@dataclass(frozen=True)
class Corpus:
    """The documents (id -> text), their titles (id -> the entity's name as searched), the fact each states,
    each entity's page (entity -> document id) and the entities of each kind (kind -> names, in order)."""

    documents: dict[str, str]
    titles: dict[str, str]
    facts: dict[str, Fact]
    pages: dict[str, str]
    entities: dict[str, tuple[str, ...]]

    def fact_of(self, entity: str) -> Fact:
        """The fact on ``entity``'s page; a ``KeyError`` naming it where it has none."""
        if entity not in self.pages:
            raise KeyError(f"no document is about {entity!r}")
        return self.facts[self.pages[entity]]


def _namer(r: random.Random) -> Callable[[int], str]:
    used: set[str] = set()

    def name(syllables: int) -> str:
        while True:
            word = "".join(r.choice(ONSETS) + r.choice(VOWELS) for _ in range(syllables)).capitalize()
            if word not in used:
                used.add(word)
                return word

    return name


def _names(r: random.Random) -> dict[str, tuple[str, ...]]:
    """Each kind's entities as questions and answers write them (``the Zibrou River``, ``Tazoumi``)."""
    name = _namer(r)
    forms: dict[str, Callable[[], str]] = {
        "range": lambda: f"the {name(2)} Mountains",
        "river": lambda: f"the {name(2)} River",
        "town": lambda: name(3),
        "person": lambda: f"{name(2)} {name(3)}",
        "sea": lambda: f"the {name(2)} Sea",
        "island": lambda: f"{name(2)} Island",
        "port": lambda: name(3),
        "company": lambda: f"the {name(2)} Company",
        "worker": lambda: f"{name(2)} {name(3)}",
        "ship": lambda: name(3),
    }
    return {kind: tuple(forms[kind]() for _ in range(count)) for kind, (count, _) in KINDS.items()}


def _spread(r: random.Random, subjects: Sequence[str], objects: Sequence[str]) -> dict[str, str]:
    """Each subject's object, every object used ``len(subjects) // len(objects)`` or one more times."""
    order = list(objects)
    r.shuffle(order)
    return {subject: order[i % len(order)] for i, subject in enumerate(subjects)}


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


# relation -> (subject kind, object kind, the page's text from subject, object and a random number generator)
RELATIONS: dict[str, tuple[str, str, Callable[[str, str, random.Random], str]]] = {
    "born_in": ("person", "town", lambda s, o, r: f"{s} was born in {o} and works as a {r.choice(_JOBS)}."),
    "on_river": ("town", "river", lambda s, o, r: f"{s} is a town on {o}, known for its {r.choice(_GOODS)}."),
    "rises_in": ("river", "range", lambda s, o, r: f"{s} rises in {o} and is {r.randint(40, 900)} km long."),
    "works_for": ("worker", "company", lambda s, o, r: f"{s} works for {o} as a {r.choice(_ROLES)}."),
    "headquartered_in": (
        "company",
        "port",
        lambda s, o, r: f"{s} is headquartered in {o} and trades in {r.choice(_WARES)}.",
    ),
    "on_island": ("port", "island", lambda s, o, r: f"{s} is a harbour on {o} with {r.randint(2, 30)} quays."),
    "in_sea": ("island", "sea", lambda s, o, r: f"{s} lies in {o}; {r.randint(300, 90000)} people live on it."),
    "home_port": ("ship", "port", lambda s, o, r: f"{s} is a {r.choice(_VESSELS)} whose home port is {o}."),
}


@functools.cache
def corpus() -> Corpus:
    """The corpus (built once per process: about 1,500 documents, a few milliseconds)."""
    r = random.Random(SEED)
    entities = _names(r)
    documents: dict[str, str] = {}
    titles: dict[str, str] = {}
    facts: dict[str, Fact] = {}
    pages: dict[str, str] = {}
    for relation, (subject_kind, object_kind, text) in RELATIONS.items():
        objects = _spread(r, entities[subject_kind], entities[object_kind])
        prefix = KINDS[subject_kind][1]
        for i, subject in enumerate(entities[subject_kind]):
            doc_id = f"{prefix}{i}"
            documents[doc_id] = _sentence(text(subject, objects[subject], r))
            titles[doc_id] = subject.removeprefix("the ")
            facts[doc_id] = Fact(subject, relation, objects[subject])
            pages[subject] = doc_id
    return Corpus(documents, titles, facts, pages, entities)
