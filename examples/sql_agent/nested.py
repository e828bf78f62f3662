"""The ``nested`` question template's variants: a subquery (above an average, IN / NOT IN another table).

Written like the other templates (:mod:`examples.sql_agent.questions`) from a domain's tables, columns and nouns.
"""

from __future__ import annotations

import random

from examples.sql_agent.questions import COMPARE, Draft, Variant, an, child_threshold, links, pick, tables, value

__all__ = ["NESTED"]


def nested_above_average(r: random.Random, db: str) -> Draft | None:
    t = pick(r, tables(db, "label", "num"))
    if t is None:
        return None
    n, word = r.choice(t.of("num")), r.choice(("above", "below"))
    return Draft(
        f"Which {t.name} have {an(n.phrase)} {word} the average {n.phrase} of all {t.name}? Give their "
        f"{t.label.phrase}s.",
        f"SELECT {t.label.name} FROM {t.name} WHERE {n.name} {COMPARE[word]} (SELECT AVG({n.name}) FROM {t.name})",
    )


def nested_average_of_group(r: random.Random, db: str) -> Draft | None:
    t = pick(r, tables(db, "cat", "num"))
    if t is None:
        return None
    c, n, word = r.choice(t.of("cat")), r.choice(t.of("num")), r.choice(("above", "below"))
    v = value(r, db, t, c)
    return Draft(
        f"How many {t.name} have {an(n.phrase)} {word} the average {n.phrase} of the {t.name} whose {c.phrase} is {v}?",
        f"SELECT COUNT(*) FROM {t.name} WHERE {n.name} {COMPARE[word]} "
        f"(SELECT AVG({n.name}) FROM {t.name} WHERE {c.name} = '{v}')",
    )


def nested_without(r: random.Random, db: str) -> Draft | None:
    link = pick(r, links(db, parent=("label",)))
    if link is None:
        return None
    child, fk, parent = link
    return Draft(
        f"List the {parent.label.phrase}s of the {parent.name} that have no {child.name}.",
        f"SELECT {parent.label.name} FROM {parent.name} WHERE id NOT IN (SELECT {fk.name} FROM {child.name})",
    )


def nested_with(r: random.Random, db: str) -> Draft | None:
    link = pick(r, links(db, child=("cat",), parent=("label",)))
    if link is None:
        return None
    child, fk, parent = link
    c = r.choice(child.of("cat"))
    v = value(r, db, child, c)
    return Draft(
        f"List the {parent.label.phrase}s of the {parent.name} that have {an(child.singular)} whose {c.phrase} is {v}.",
        f"SELECT {parent.label.name} FROM {parent.name} WHERE id IN "
        f"(SELECT {fk.name} FROM {child.name} WHERE {c.name} = '{v}')",
        baseline=f"SELECT {parent.label.name} FROM {parent.name}",
    )


def nested_maximum(r: random.Random, db: str) -> Draft | None:
    t = pick(r, tables(db, "label", "num", "cat"))
    if t is None:
        return None
    n, c = r.choice(t.of("num")), r.choice(t.of("cat"))
    v = value(r, db, t, c)
    return Draft(
        f"Which {t.name} have {an(n.phrase)} higher than every {t.singular} whose {c.phrase} is {v}? Give "
        f"their {t.label.phrase}s.",
        f"SELECT {t.label.name} FROM {t.name} WHERE {n.name} > "
        f"(SELECT MAX({n.name}) FROM {t.name} WHERE {c.name} = '{v}')",
    )


def nested_more_than(r: random.Random, db: str) -> Draft | None:
    link = pick(r, links(db, parent=("label",)))
    if link is None:
        return None
    child, fk, parent = link
    x = r.randint(1, 4)
    return Draft(
        f"List the {parent.label.phrase}s of the {parent.name} that have more than {x} {child.name}.",
        f"SELECT {parent.label.name} FROM {parent.name} WHERE id IN (SELECT {fk.name} FROM {child.name} "
        f"GROUP BY {fk.name} HAVING COUNT(*) > {x})",
        baseline=f"SELECT {parent.label.name} FROM {parent.name}",
    )


def nested_none_beyond(r: random.Random, db: str) -> Draft | None:
    drawn = child_threshold(r, db)
    if drawn is None:
        return None
    child, fk, parent, n, word, x = drawn
    return Draft(
        f"List the {parent.label.phrase}s of the {parent.name} that have no {child.singular} with "
        f"{an(n.phrase)} {word} {x}.",
        f"SELECT {parent.label.name} FROM {parent.name} WHERE id NOT IN "
        f"(SELECT {fk.name} FROM {child.name} WHERE {n.name} {COMPARE[word]} {x})",
        baseline=f"SELECT {parent.label.name} FROM {parent.name}",
    )


def nested_above_group_average(r: random.Random, db: str) -> Draft | None:
    t = pick(r, tables(db, "label", "cat", "num"))
    if t is None:
        return None
    c, n, word = r.choice(t.of("cat")), r.choice(t.of("num")), r.choice(("above", "below"))
    v = value(r, db, t, c)
    return Draft(
        f"Which {t.name} have {an(n.phrase)} {word} the average {n.phrase} of the {t.name} whose "
        f"{c.phrase} is {v}? Give their {t.label.phrase}s.",
        f"SELECT {t.label.name} FROM {t.name} WHERE "
        f"{n.name} {COMPARE[word]} (SELECT AVG({n.name}) FROM {t.name} WHERE {c.name} = '{v}')",
    )


NESTED: tuple[Variant, ...] = (
    nested_above_average,
    nested_average_of_group,
    nested_without,
    nested_with,
    nested_maximum,
    nested_more_than,
    nested_none_beyond,
    nested_above_group_average,
)
