"""Arithmetic word problems from templates, one to three operations, generated with fixed seeds.

Each template draws its numbers and writes the question and the expression that solves it (``"3*5-2"``); the
answer is that expression's value, computed by the calculator the agent uses (always a whole number). Levels:
``1`` one operation ("Ann has 12 pens and buys 7 more..."), ``2`` two operations, ``3`` three. Three splits:

* training: the seven ``TEMPLATES``, taken in turn (so the first 32 tasks, the warm-up's, cover each of them 4-5
  times);
* held-out (in distribution): the same templates from another seed; a question that also occurs in the first
  10,000 training ones is dropped and redrawn;
* unseen shapes: six template families that neither training nor the warm-up ever use (``UNSEEN_TEMPLATES``:
  change from a note, a rectangle's area, earnings split equally, distance at a speed, ages, a discount), with
  the training templates' numbers, taken in turn with the training templates at three-digit numbers
  (``<name>-large``), which training never draws.

A task input: ``{"question": str, "answer": int, "expression": str, "level": int, "template": str}`` (the
expression is for the teacher's demonstrations, :mod:`examples.calc_agent.teacher`; the agent never sees it),
plus ``"greedy": true`` on both held-out splits.

    python -m examples.calc_agent.data OUT_DIR [--train 256] [--val 64] [--unseen 0]   # OUT_DIR/train.jsonl, ...
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from examples.calc_agent.calculator import calculate
from examples.spec import write_splits_command

__all__ = ["TEMPLATES", "UNSEEN_TEMPLATES", "heldout_tasks", "problem", "train_tasks", "unseen_tasks"]

TRAIN_SEED = 31
HELDOUT_SEED = 7919
UNSEEN_SEED = 104729
NAMES = ("Ann", "Bob", "Eve", "Max", "Kim", "Sam", "Lea", "Tom", "Zoe", "Ben")
ITEMS = ("pens", "apples", "cards", "books", "stamps", "marbles", "cups", "shells")

Template = Callable[[random.Random, str, str], tuple[str, str]]


class _Large(random.Random):
    """A generator whose ``randint`` draws about ten times larger numbers wherever a template's range reaches 9 (a
    count up to 9 becomes up to 99, up to 60 up to 609): the training templates' shapes with numbers training never
    draws; small counts (friends, days, a few lost) stay as they are."""

    def randint(self, a: int, b: int) -> int:
        value = super().randint(a, b)
        return value * 10 + super().randint(0, 9) if b >= 9 else value


def _buy(r: random.Random, n: str, i: str) -> tuple[str, str]:
    a, b = r.randint(5, 40), r.randint(2, 30)
    return f"{n} has {a} {i} and buys {b} more. How many {i} does {n} have now?", f"{a}+{b}"


def _give(r: random.Random, n: str, i: str) -> tuple[str, str]:
    a = r.randint(20, 60)
    b = r.randint(2, a - 1)
    return f"{n} has {a} {i} and gives away {b}. How many {i} are left?", f"{a}-{b}"


def _boxes(r: random.Random, n: str, i: str) -> tuple[str, str]:
    a, b = r.randint(2, 12), r.randint(2, 12)
    return f"{n} has {a} boxes with {b} {i} in each. How many {i} is that?", f"{a}*{b}"


def _boxes_sold(r: random.Random, n: str, i: str) -> tuple[str, str]:
    a, b = r.randint(3, 12), r.randint(3, 12)
    c = r.randint(1, a * b - 1)
    return f"A shop has {a} boxes of {b} {i} and sells {c} {i}. How many {i} are left?", f"{a}*{b}-{c}"


def _share(r: random.Random, n: str, i: str) -> tuple[str, str]:
    k, each, kept = r.randint(2, 6), r.randint(2, 9), r.randint(1, 20)
    return (
        f"{n} has {k * each + kept} {i}, keeps {kept} and shares the rest equally among {k} friends. "
        f"How many {i} does each friend get?",
        f"({k * each + kept}-{kept})/{k}",
    )


def _weekly(r: random.Random, n: str, i: str) -> tuple[str, str]:
    a, days, lost = r.randint(2, 9), r.randint(3, 7), r.randint(1, 5)
    return (
        f"{n} collects {a} {i} a day for {days} days, loses {lost}, then doubles the rest. How many {i} does {n} have?",
        f"({a}*{days}-{lost})*2",
    )


def _three_steps(r: random.Random, n: str, i: str) -> tuple[str, str]:
    a, b, c, d = r.randint(2, 9), r.randint(2, 9), r.randint(1, 20), r.randint(1, 4)
    return (
        f"{n} has {a} bags of {b} {i}, finds {c} more and gives {d} to a friend. How many {i} does {n} have now?",
        f"{a}*{b}+{c}-{d}",
    )


# --- shapes the training split never uses (the unseen split) ---------------------------------------------------
def _change(r: random.Random, n: str, i: str) -> tuple[str, str]:
    price, count = r.randint(2, 9), r.randint(2, 8)
    note = r.choice([note for note in (20, 50, 100) if note > price * count])
    return (
        f"One of the {i} costs {price} dollars. {n} buys {count} of them and pays with a {note}-dollar note. "
        f"How many dollars of change does {n} get back?",
        f"{note}-{count}*{price}",
    )


def _area(r: random.Random, n: str, i: str) -> tuple[str, str]:
    length, width = r.randint(4, 30), r.randint(3, 20)
    return (
        f"{n}'s garden is a rectangle {length} metres long and {width} metres wide. What is its area in square metres?",
        f"{length}*{width}",
    )


def _earnings(r: random.Random, n: str, i: str) -> tuple[str, str]:
    a, b = r.randint(10, 60), r.randint(10, 60)
    c = r.randint(10, 60)
    c += (-(a + b + c)) % 3
    return (
        f"{n} and two friends earned {a}, {b} and {c} dollars selling {i}. They put the money together and "
        f"split it equally. How many dollars does each get?",
        f"({a}+{b}+{c})/3",
    )


def _distance(r: random.Random, n: str, i: str) -> tuple[str, str]:
    speed, hours = r.randint(20, 90), r.randint(2, 9)
    return (
        f"A train carrying {i} runs at {speed} kilometres per hour for {hours} hours. "
        f"How many kilometres does it travel?",
        f"{speed}*{hours}",
    )


def _ages(r: random.Random, n: str, i: str) -> tuple[str, str]:
    younger, gap, years = r.randint(8, 40), r.randint(2, 15), r.randint(2, 10)
    return (
        f"{n} is {gap} years older than a cousin who is {younger}. How old will {n} be in {years} years?",
        f"{younger}+{gap}+{years}",
    )


def _discount(r: random.Random, n: str, i: str) -> tuple[str, str]:
    percent = r.choice((10, 20, 25, 50))
    price = r.randint(2, 20) * (100 // math.gcd(100, percent))
    return (
        f"A set of {i} costs {price} dollars and is sold at {percent}% off. How many dollars does {n} pay for it?",
        f"{price}-{price}*{percent}/100",
    )


LEVELS: dict[int, tuple[Template, ...]] = {
    1: (_buy, _give, _boxes),
    2: (_boxes_sold, _share),
    3: (_weekly, _three_steps),
}
TEMPLATES: dict[str, tuple[Template, int]] = {
    template.__name__.lstrip("_"): (template, level) for level, templates in LEVELS.items() for template in templates
}
UNSEEN_TEMPLATES: dict[str, tuple[Template, int]] = {
    "change": (_change, 2),
    "area": (_area, 1),
    "earnings": (_earnings, 2),
    "distance": (_distance, 1),
    "ages": (_ages, 2),
    "discount": (_discount, 2),
}


def problem(r: random.Random, name: str, *, large: bool = False) -> dict[str, Any]:
    """One problem of template ``name`` (training or unseen), drawn from ``r``; ``large``: three-digit numbers."""
    template, level = TEMPLATES.get(name) or UNSEEN_TEMPLATES[name]
    draw = _Large(r.random()) if large else r
    question, expression = template(draw, r.choice(NAMES), r.choice(ITEMS))
    answer = calculate(expression)
    if answer.denominator != 1 or answer < 0:
        raise ValueError(f"template {name} made {expression} = {answer}, not a whole number")
    label = f"{name}-large" if large else name
    return {"question": question, "answer": int(answer), "expression": expression, "level": level, "template": label}


def _draw(seed: int, count: int, exclude: set[str], shapes: list[tuple[str, bool]]) -> list[dict[str, Any]]:
    """``count`` distinct problems not in ``exclude``, the ``(template, large)`` shapes taken in turn."""
    r, tasks, seen = random.Random(seed), [], set(exclude)
    while len(tasks) < count:
        name, large = shapes[len(tasks) % len(shapes)]
        try:
            task = problem(r, name, large=large)
        except ValueError:  # larger numbers can take more away than there is: drawn again
            if not large:
                raise
            continue
        if task["question"] not in seen:
            seen.add(task["question"])
            tasks.append(task)
    return tasks


def train_tasks(count: int) -> list[dict[str, Any]]:
    """The first ``count`` training problems (the seven templates in turn)."""
    return _draw(TRAIN_SEED, count, set(), [(name, False) for name in TEMPLATES])


def heldout_tasks(count: int) -> list[dict[str, Any]]:
    """``count`` held-out problems of the training templates, none of them in the first 10,000 training problems;
    greedy."""
    exclude = {t["question"] for t in train_tasks(max(count, 10_000))}
    return [t | {"greedy": True} for t in _draw(HELDOUT_SEED, count, exclude, [(n, False) for n in TEMPLATES])]


def unseen_tasks(count: int) -> list[dict[str, Any]]:
    """``count`` problems of shapes training never sees: the unseen templates and the training ones at three-digit
    numbers, in turn; greedy."""
    shapes = [(name, False) for name in UNSEEN_TEMPLATES] + [(name, True) for name in TEMPLATES]
    return [t | {"greedy": True} for t in _draw(UNSEEN_SEED, count, set(), shapes)]


def main(argv: list[str] | None = None) -> None:
    write_splits_command("calc", train_tasks, heldout_tasks, argv, unseen_tasks)


if __name__ == "__main__":
    main()
