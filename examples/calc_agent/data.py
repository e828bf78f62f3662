"""Arithmetic word problems from templates, one to three operations, generated with fixed seeds.

Each template draws its numbers and writes the question and the expression that solves it (``"3*5-2"``); the
answer is that expression's value, computed by the calculator the agent uses (always a whole number). Levels:
``1`` one operation ("Ann has 12 pens and buys 7 more..."), ``2`` two operations, ``3`` three. The training and
held-out splits come from different seeds and share no question (held-out questions that also occur in training
are dropped and redrawn). A task input: ``{"question": str, "answer": int, "expression": str, "level": int}``
(the expression is for the teacher's demonstrations, :mod:`examples.calc_agent.teacher`; the agent never sees
it), plus ``"greedy": true`` on held-out tasks.

    python -m examples.calc_agent.data OUT_DIR [--train 256] [--val 64]   # OUT_DIR/train.jsonl, val.jsonl
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from examples.calc_agent.calculator import calculate
from examples.spec import write_splits_command

__all__ = ["heldout_tasks", "problem", "train_tasks"]

TRAIN_SEED = 31
HELDOUT_SEED = 7919
NAMES = ("Ann", "Bob", "Eve", "Max", "Kim", "Sam", "Lea", "Tom", "Zoe", "Ben")
ITEMS = ("pens", "apples", "cards", "books", "stamps", "marbles", "cups", "shells")

Template = Callable[[random.Random, str, str], tuple[str, str]]


def _buy(r: random.Random, n: str, i: str) -> tuple[str, int]:
    a, b = r.randint(5, 40), r.randint(2, 30)
    return f"{n} has {a} {i} and buys {b} more. How many {i} does {n} have now?", f"{a}+{b}"


def _give(r: random.Random, n: str, i: str) -> tuple[str, int]:
    a = r.randint(20, 60)
    b = r.randint(2, a - 1)
    return f"{n} has {a} {i} and gives away {b}. How many {i} are left?", f"{a}-{b}"


def _boxes(r: random.Random, n: str, i: str) -> tuple[str, int]:
    a, b = r.randint(2, 12), r.randint(2, 12)
    return f"{n} has {a} boxes with {b} {i} in each. How many {i} is that?", f"{a}*{b}"


def _boxes_sold(r: random.Random, n: str, i: str) -> tuple[str, int]:
    a, b = r.randint(3, 12), r.randint(3, 12)
    c = r.randint(1, a * b - 1)
    return f"A shop has {a} boxes of {b} {i} and sells {c} {i}. How many {i} are left?", f"{a}*{b}-{c}"


def _share(r: random.Random, n: str, i: str) -> tuple[str, int]:
    k, each, kept = r.randint(2, 6), r.randint(2, 9), r.randint(1, 20)
    return (f"{n} has {k * each + kept} {i}, keeps {kept} and shares the rest equally among {k} friends. "
            f"How many {i} does each friend get?", f"({k * each + kept}-{kept})/{k}")  # fmt: skip


def _weekly(r: random.Random, n: str, i: str) -> tuple[str, int]:
    a, days, lost = r.randint(2, 9), r.randint(3, 7), r.randint(1, 5)
    return (f"{n} collects {a} {i} a day for {days} days, loses {lost}, then doubles the rest. "
            f"How many {i} does {n} have?", f"({a}*{days}-{lost})*2")  # fmt: skip


def _three_steps(r: random.Random, n: str, i: str) -> tuple[str, int]:
    a, b, c, d = r.randint(2, 9), r.randint(2, 9), r.randint(1, 20), r.randint(1, 4)
    return (f"{n} has {a} bags of {b} {i}, finds {c} more and gives {d} to a friend. How many {i} does {n} "
            f"have now?", f"{a}*{b}+{c}-{d}")  # fmt: skip


LEVELS: dict[int, tuple[Template, ...]] = {1: (_buy, _give, _boxes), 2: (_boxes_sold, _share),
                                           3: (_weekly, _three_steps)}  # fmt: skip


def problem(r: random.Random, level: int) -> dict[str, Any]:
    template = r.choice(LEVELS[level])
    question, expression = template(r, r.choice(NAMES), r.choice(ITEMS))
    answer = calculate(expression)
    if answer.denominator != 1:
        raise ValueError(f"template {template.__name__} made {expression} = {answer}, not a whole number")
    return {"question": question, "answer": int(answer), "expression": expression, "level": level}


def _draw(seed: int, count: int, exclude: set[str]) -> list[dict[str, Any]]:
    r, tasks, seen = random.Random(seed), [], set(exclude)
    levels = sorted(LEVELS)
    while len(tasks) < count:
        task = problem(r, levels[len(tasks) % len(levels)])
        if task["question"] not in seen:
            seen.add(task["question"])
            tasks.append(task)
    return tasks


def train_tasks(count: int) -> list[dict[str, Any]]:
    """The first ``count`` training problems (levels in turn)."""
    return _draw(TRAIN_SEED, count, set())


def heldout_tasks(count: int) -> list[dict[str, Any]]:
    """``count`` held-out problems, none of them in the first 10,000 training problems; greedy."""
    exclude = {t["question"] for t in train_tasks(max(count, 10_000))}
    return [t | {"greedy": True} for t in _draw(HELDOUT_SEED, count, exclude)]


def main(argv: list[str] | None = None) -> None:
    write_splits_command("calc", train_tasks, heldout_tasks, argv)


if __name__ == "__main__":
    main()
