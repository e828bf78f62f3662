"""Question templates over any domain: a question in words and its gold SQL, drawn from a database's rows.

The variants of four of the five templates (``nested`` is in :mod:`examples.sql_agent.nested`; the registry in
:mod:`examples.sql_agent.templates`), all written from a :class:`~examples.sql_agent.domains.Domain`'s tables,
columns and nouns, so they work on a schema never seen before: ``filter`` (a WHERE on one table), ``order``
(ORDER BY ... LIMIT, the most or fewest), ``join`` (two tables over a foreign key) and ``group`` (GROUP BY with
COUNT / SUM / AVG / MIN / MAX, a HAVING). Values and thresholds come from the database's rows. A variant returns
None where the schema lacks what it needs; a :class:`Draft` also names the queries that would make it ambiguous
(``probe``: the ordering key of a top-k question, which must not tie at the cut) or trivial (``baseline``: a
filter that keeps every row).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from examples.sql_agent.database import domain_of, rows_of
from examples.sql_agent.domains import Column, Table

__all__ = [
    "COMPARE",
    "FILTER",
    "GROUP",
    "JOIN",
    "ORDER",
    "Draft",
    "Variant",
    "an",
    "child_threshold",
    "join_on",
    "links",
    "pick",
    "tables",
    "value",
]


@dataclass(frozen=True)
class Draft:
    """A question, its gold SQL, and the checks that may reject it (module docstring)."""

    question: str
    gold: str
    probe: str | None = None  # the ordering key of the first k + 1 rows: the k-th and the next must differ
    k: int = 0
    baseline: str | None = None  # a query whose result must differ from the gold's


Variant = Callable[[random.Random, str], Draft | None]
COMPARE = {"above": ">", "below": "<", "at least": ">=", "at most": "<="}


def an(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def pick(r: random.Random, items: list[Any]) -> Any:
    return r.choice(items) if items else None


def value(r: random.Random, db: str, table: Table, column: Column) -> Any:
    return r.choice(rows_of(db)[table.name])[column.name]


def tables(db: str, *kinds: str) -> list[Table]:
    """The tables that have a column of every kind in ``kinds``."""
    return [t for t in domain_of(db).tables if all(t.of(kind) for kind in kinds)]


def links(db: str, child: tuple[str, ...] = (), parent: tuple[str, ...] = ()) -> list[tuple[Table, Column, Table]]:
    return [
        (c, fk, p) for c, fk, p in domain_of(db).links() if all(c.of(k) for k in child) and all(p.of(k) for k in parent)
    ]


def child_threshold(r: random.Random, db: str) -> tuple[Table, Column, Table, Column, str, Any] | None:
    """A link from a child table with a number to a parent with a label, and a threshold on the child's number:
    ``(child, foreign key, parent, number column, "above" or "below", a value from its rows)``; None where the
    schema has no such link."""
    link = pick(r, links(db, child=("num",), parent=("label",)))
    if link is None:
        return None
    child, fk, parent = link
    n, word = r.choice(child.of("num")), r.choice(("above", "below"))
    return child, fk, parent, n, word, value(r, db, child, n)


def which(k: int, t: Table) -> str:
    return f"Which {t.singular} has" if k == 1 else f"Which {k} {t.name} have"


def join_on(child: Table, fk: Column, parent: Table) -> str:
    return f"{child.name} JOIN {parent.name} ON {parent.name}.id = {child.name}.{fk.name}"


# --- filter ----------------------------------------------------------------------------------------------------


def filter_category(r: random.Random, db: str) -> Draft | None:
    t = pick(r, tables(db, "label", "cat"))
    if t is None:
        return None
    c = r.choice(t.of("cat"))
    v = value(r, db, t, c)
    return Draft(
        f"List the {t.label.phrase}s of the {t.name} whose {c.phrase} is {v}.",
        f"SELECT {t.label.name} FROM {t.name} WHERE {c.name} = '{v}'",
        baseline=f"SELECT {t.label.name} FROM {t.name}",
    )


def filter_number(r: random.Random, db: str) -> Draft | None:
    t = pick(r, tables(db, "label", "num"))
    if t is None:
        return None
    n, word = r.choice(t.of("num")), r.choice(list(COMPARE))
    v = value(r, db, t, n)
    return Draft(
        f"Which {t.name} have {an(n.phrase)} {word} {v}? Give their {t.label.phrase}s.",
        f"SELECT {t.label.name} FROM {t.name} WHERE {n.name} {COMPARE[word]} {v}",
        baseline=f"SELECT {t.label.name} FROM {t.name}",
    )


def filter_count(r: random.Random, db: str) -> Draft | None:
    t = pick(r, tables(db, "cat", "num"))
    if t is None:
        return None
    c, n, word = r.choice(t.of("cat")), r.choice(t.of("num")), r.choice(list(COMPARE))
    v, x = value(r, db, t, c), value(r, db, t, n)
    return Draft(
        f"How many {t.name} have {c.phrase} {v} and {an(n.phrase)} {word} {x}?",
        f"SELECT COUNT(*) FROM {t.name} WHERE {c.name} = '{v}' AND {n.name} {COMPARE[word]} {x}",
        baseline=f"SELECT COUNT(*) FROM {t.name} WHERE {c.name} = '{v}'",
    )


def filter_between(r: random.Random, db: str) -> Draft | None:
    t = pick(r, tables(db, "label", "num"))
    if t is None:
        return None
    n = r.choice(t.of("num"))
    low, high = sorted((value(r, db, t, n), value(r, db, t, n)))
    return Draft(
        f"List the {t.label.phrase}s of the {t.name} with {an(n.phrase)} between {low} and {high}.",
        f"SELECT {t.label.name} FROM {t.name} WHERE {n.name} BETWEEN {low} AND {high}",
        baseline=f"SELECT {t.label.name} FROM {t.name}",
    )


# --- order -----------------------------------------------------------------------------------------------------


def top(t: Table, n: Column, k: int, most: bool, where: str = "") -> tuple[str, str]:
    order = f"ORDER BY {n.name} {'DESC' if most else 'ASC'}"
    return (
        f"SELECT {t.label.name} FROM {t.name}{where} {order} LIMIT {k}",
        f"SELECT {n.name} FROM {t.name}{where} {order} LIMIT {k + 1}",
    )


def order_top(r: random.Random, db: str) -> Draft | None:
    t = pick(r, tables(db, "label", "num"))
    if t is None:
        return None
    n, k, most = r.choice(t.of("num")), r.randint(1, 5), r.random() < 0.5
    gold, probe = top(t, n, k, most)
    return Draft(
        f"{which(k, t)} the {'highest' if most else 'lowest'} {n.phrase}? Give the {t.label.phrase}"
        f"{'s' if k > 1 else ''}.",
        gold,
        probe,
        k,
    )


def order_one(r: random.Random, db: str) -> Draft | None:
    t = pick(r, tables(db, "label", "num"))
    if t is None:
        return None
    n, most = r.choice(t.of("num")), r.random() < 0.5
    gold, probe = top(t, n, 1, most)
    return Draft(
        f"What is the {t.label.phrase} of the {t.singular} with the {'highest' if most else 'lowest'} {n.phrase}?",
        gold,
        probe,
        1,
    )


def order_within(r: random.Random, db: str) -> Draft | None:
    t = pick(r, tables(db, "label", "num", "cat"))
    if t is None:
        return None
    n, c, k, most = r.choice(t.of("num")), r.choice(t.of("cat")), r.randint(1, 3), r.random() < 0.5
    v = value(r, db, t, c)
    gold, probe = top(t, n, k, most, f" WHERE {c.name} = '{v}'")
    return Draft(
        f"Among the {t.name} whose {c.phrase} is {v}, {which(k, t).lower()} the "
        f"{'highest' if most else 'lowest'} {n.phrase}? Give the {t.label.phrase}{'s' if k > 1 else ''}.",
        gold,
        probe,
        k,
    )


def order_most_children(r: random.Random, db: str) -> Draft | None:
    link = pick(r, links(db, parent=("label",)))
    if link is None:
        return None
    child, fk, parent = link
    k = r.randint(1, 3)
    ranked = f"FROM {join_on(child, fk, parent)} GROUP BY {parent.name}.id ORDER BY COUNT(*) DESC"
    return Draft(
        f"{which(k, parent)} the most {child.name}? Give the {parent.label.phrase}{'s' if k > 1 else ''}.",
        f"SELECT {parent.name}.{parent.label.name} {ranked} LIMIT {k}",
        f"SELECT COUNT(*) {ranked} LIMIT {k + 1}",
        k,
    )


# --- join ------------------------------------------------------------------------------------------------------


def join_count(r: random.Random, db: str) -> Draft | None:
    link = pick(r, links(db, parent=("label",)))
    if link is None:
        return None
    child, fk, parent = link
    x = value(r, db, parent, parent.label)
    return Draft(
        f"How many {child.name} are there for the {fk.phrase} {x}?",
        f"SELECT COUNT(*) FROM {join_on(child, fk, parent)} WHERE {parent.name}.{parent.label.name} = '{x}'",
    )


def join_list(r: random.Random, db: str) -> Draft | None:
    link = pick(r, links(db, child=("label",), parent=("cat",)))
    if link is None:
        return None
    child, fk, parent = link
    c = r.choice(parent.of("cat"))
    v = value(r, db, parent, c)
    return Draft(
        f"List the {child.label.phrase}s of the {child.name} whose {fk.phrase}'s {c.phrase} is {v}.",
        f"SELECT {child.name}.{child.label.name} FROM {join_on(child, fk, parent)} "
        f"WHERE {parent.name}.{c.name} = '{v}'",
        baseline=f"SELECT {child.label.name} FROM {child.name}",
    )


def join_total(r: random.Random, db: str) -> Draft | None:
    found = [(c, fk, p) for c, fk, p in links(db, parent=("label",)) if any(n.additive for n in c.of("num"))]
    link = pick(r, found)
    if link is None:
        return None
    child, fk, parent = link
    n = r.choice([n for n in child.of("num") if n.additive])
    x = value(r, db, parent, parent.label)
    return Draft(
        f"What is the total {n.phrase} of the {child.name} for the {fk.phrase} {x}?",
        f"SELECT SUM({child.name}.{n.name}) FROM {join_on(child, fk, parent)} "
        f"WHERE {parent.name}.{parent.label.name} = '{x}'",
    )


def join_parents(r: random.Random, db: str) -> Draft | None:
    drawn = child_threshold(r, db)
    if drawn is None:
        return None
    child, fk, parent, n, word, x = drawn
    return Draft(
        f"Which {parent.name} have {an(child.singular)} with {an(n.phrase)} {word} {x}? Give their "
        f"{parent.label.phrase}s.",
        f"SELECT DISTINCT {parent.name}.{parent.label.name} FROM "
        f"{join_on(child, fk, parent)} WHERE {child.name}.{n.name} {COMPARE[word]} {x}",
        baseline=f"SELECT {parent.label.name} FROM {parent.name}",
    )


# --- group -----------------------------------------------------------------------------------------------------


def group_count(r: random.Random, db: str) -> Draft | None:
    t = pick(r, tables(db, "cat"))
    if t is None:
        return None
    c = r.choice(t.of("cat"))
    return Draft(
        f"How many {t.name} are there for each {c.phrase}? Give each {c.phrase} and its count.",
        f"SELECT {c.name}, COUNT(*) FROM {t.name} GROUP BY {c.name}",
    )


def group_aggregate(r: random.Random, db: str) -> Draft | None:
    t = pick(r, tables(db, "cat", "num"))
    if t is None:
        return None
    c, n = r.choice(t.of("cat")), r.choice(t.of("num"))
    words = {"average": "AVG", "highest": "MAX", "lowest": "MIN"} | ({"total": "SUM"} if n.additive else {})
    word = r.choice(list(words))
    return Draft(
        f"What is the {word} {n.phrase} of the {t.name} for each {c.phrase}? Give each {c.phrase} and the {word}.",
        f"SELECT {c.name}, {words[word]}({n.name}) FROM {t.name} GROUP BY {c.name}",
    )


def group_per_parent(r: random.Random, db: str) -> Draft | None:
    link = pick(r, links(db, parent=("label",)))
    if link is None:
        return None
    child, fk, parent = link
    return Draft(
        f"How many {child.name} does each {fk.phrase} have (those with at least one)? Give the "
        f"{fk.phrase}'s {parent.label.phrase} and the count.",
        f"SELECT {parent.name}.{parent.label.name}, COUNT(*) FROM {join_on(child, fk, parent)} "
        f"GROUP BY {parent.name}.id",
    )


def group_having(r: random.Random, db: str) -> Draft | None:
    t = pick(r, tables(db, "cat"))
    if t is None:
        return None
    c = r.choice(t.of("cat"))
    counts = sorted({sum(row[c.name] == v for row in rows_of(db)[t.name]) for v in c.pool})
    x = r.choice(counts[:-1]) if len(counts) > 1 else 0
    return Draft(
        f"Which {c.phrase} values have more than {x} {t.name}?",
        f"SELECT {c.name} FROM {t.name} GROUP BY {c.name} HAVING COUNT(*) > {x}",
    )


def group_by_parent_category(r: random.Random, db: str) -> Draft | None:
    link = pick(r, links(db, child=("num",), parent=("cat",)))
    if link is None:
        return None
    child, fk, parent = link
    c, n = r.choice(parent.of("cat")), r.choice(child.of("num"))
    return Draft(
        f"What is the average {n.phrase} of the {child.name} for each {fk.phrase} {c.phrase}? Give each "
        f"{c.phrase} and the average.",
        f"SELECT {parent.name}.{c.name}, AVG({child.name}.{n.name}) FROM "
        f"{join_on(child, fk, parent)} GROUP BY {parent.name}.{c.name}",
    )


def group_filtered(r: random.Random, db: str) -> Draft | None:
    t = pick(r, tables(db, "cat", "num"))
    if t is None:
        return None
    c, n, word = r.choice(t.of("cat")), r.choice(t.of("num")), r.choice(("above", "below"))
    x = value(r, db, t, n)
    return Draft(
        f"How many {t.name} with {an(n.phrase)} {word} {x} are there for each {c.phrase}? Give each "
        f"{c.phrase} and its count.",
        f"SELECT {c.name}, COUNT(*) FROM {t.name} WHERE {n.name} {COMPARE[word]} {x} GROUP BY {c.name}",
        baseline=f"SELECT {c.name}, COUNT(*) FROM {t.name} GROUP BY {c.name}",
    )


def group_having_average(r: random.Random, db: str) -> Draft | None:
    t = pick(r, tables(db, "cat", "num"))
    if t is None:
        return None
    c, n, word = r.choice(t.of("cat")), r.choice(t.of("num")), r.choice(("above", "below"))
    x = value(r, db, t, n)
    return Draft(
        f"Which {c.phrase} values have an average {n.phrase} {word} {x} among their {t.name}?",
        f"SELECT {c.name} FROM {t.name} GROUP BY {c.name} HAVING AVG({n.name}) {COMPARE[word]} {x}",
        baseline=f"SELECT DISTINCT {c.name} FROM {t.name}",
    )


def group_per_parent_filtered(r: random.Random, db: str) -> Draft | None:
    drawn = child_threshold(r, db)
    if drawn is None:
        return None
    child, fk, parent, n, word, x = drawn
    return Draft(
        f"How many {child.name} with {an(n.phrase)} {word} {x} does each {fk.phrase} have (those with at "
        f"least one)? Give the {fk.phrase}'s {parent.label.phrase} and the count.",
        f"SELECT {parent.name}.{parent.label.name}, COUNT(*) FROM {join_on(child, fk, parent)} "
        f"WHERE {child.name}.{n.name} {COMPARE[word]} {x} GROUP BY {parent.name}.id",
    )


FILTER: tuple[Variant, ...] = (filter_category, filter_number, filter_count, filter_between)
ORDER: tuple[Variant, ...] = (order_top, order_one, order_within, order_most_children)
JOIN: tuple[Variant, ...] = (join_count, join_list, join_total, join_parents)
GROUP: tuple[Variant, ...] = (
    group_count,
    group_aggregate,
    group_per_parent,
    group_having,
    group_by_parent_category,
    group_filtered,
    group_having_average,
    group_per_parent_filtered,
)
