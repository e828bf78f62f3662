"""The demo's task: small arithmetic word problems (add, subtract, multiply), generated with fixed seeds.

A problem is a question such as ``"Ann has 17 pears and finds 3 more. How many now?"``; its wording fixes the
operator (four verbs add, four subtract, four containers multiply: ``"Ann packs 17 pears in each of 3 bags.
How many in all?"``), which the model has to learn to read off; the expression is always ``a<op>b`` with the
numbers in the order the question gives them. ``a`` is 14..24 and ``b`` 2..4, so that every operator's result
has two digits: the answer is then copied from the tool's reply at a fixed distance, a pattern the tiny model
learns quickly, and the three operators always give three different results (only the right one is rewarded).

The task input the runners hand the agent: ``{"question": str, "expr": "17+3", "answer": 20}``, plus
``"greedy": true`` on held-out (validation) tasks so the agent samples greedily there. Train and held-out sets
come from different seeds and never share a question.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from algorithm.dispatcher import DatasetTask

__all__ = ["OPERATORS", "TEMPLATES", "Problem", "apply", "generate", "heldout_tasks", "train_tasks"]

TRAIN_SEED = 1234
HELDOUT_SEED = 98765

OPERATORS = ("+", "-", "*")
NAMES = ("Ann", "Bob", "Eve", "Max", "Kim", "Sam", "Lea", "Tom", "Zoe", "Ben", "Amy", "Leo")
ITEMS = ("pears", "coins", "cards", "books", "plums", "eggs", "nuts", "shells", "stamps", "beads")
# Each operator: its template, and the words one of which fills ``{v}`` in it.
TEMPLATES: dict[str, tuple[str, tuple[str, ...]]] = {
    "+": ("{n} has {a} {i} and {v} {b} more. How many now?", ("finds", "buys", "wins", "gets")),
    "-": ("{n} has {a} {i} and {v} {b} of them. How many now?", ("loses", "sells", "eats", "drops")),
    "*": ("{n} packs {a} {i} in each of {b} {v}. How many in all?", ("bags", "boxes", "jars", "cases")),
}
A_RANGE = (14, 24)
B_RANGE = (2, 4)


def apply(a: int, op: str, b: int) -> int:
    """``a <op> b`` for one of :data:`OPERATORS`."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r}; expected one of {', '.join(OPERATORS)}")


@dataclass(frozen=True)
class Problem:
    question: str
    a: int
    b: int
    op: str

    @property
    def expr(self) -> str:
        return f"{self.a}{self.op}{self.b}"

    @property
    def answer(self) -> int:
        return apply(self.a, self.op, self.b)


def generate(count: int, seed: int, exclude: frozenset[str] = frozenset()) -> list[Problem]:
    """``count`` distinct problems drawn with ``seed`` (none of whose questions is in ``exclude``)."""
    rng = random.Random(seed)
    problems: dict[str, Problem] = {}
    while len(problems) < count:
        op = rng.choice(OPERATORS)
        template, words = TEMPLATES[op]
        a, b = rng.randint(*A_RANGE), rng.randint(*B_RANGE)
        question = template.format(n=rng.choice(NAMES), a=a, b=b, i=rng.choice(ITEMS), v=rng.choice(words))
        if question not in exclude:
            problems.setdefault(question, Problem(question, a, b, op))
    return list(problems.values())


def _task(index: int, problem: Problem, greedy: bool) -> DatasetTask:
    data: dict = {"question": problem.question, "expr": problem.expr, "answer": problem.answer}
    if greedy:
        data["greedy"] = True
    return DatasetTask(task_id=f"{'val' if greedy else 'train'}-{index}", input=data)


def train_tasks(count: int = 2000) -> list[DatasetTask]:
    """The training set (seed ``TRAIN_SEED``)."""
    return [_task(k, p, greedy=False) for k, p in enumerate(generate(count, TRAIN_SEED))]


def heldout_tasks(count: int = 64, train_count: int = 2000) -> list[DatasetTask]:
    """The held-out set (seed ``HELDOUT_SEED``), disjoint from ``train_tasks(train_count)``; greedy."""
    exclude = frozenset(p.question for p in generate(train_count, TRAIN_SEED))
    return [_task(k, p, greedy=True) for k, p in enumerate(generate(count, HELDOUT_SEED, exclude))]
