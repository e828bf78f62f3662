"""The demo's task: two-digit addition and subtraction word problems, generated with fixed seeds.

A problem is a question from one of a few templates, e.g. ``"Ann has 23 pears and finds 45. How many now?"``;
the verb fixes the operator (the model has to read it off the wording: four verbs add, four subtract) and the
two numbers are drawn from 10..99 (subtraction keeps the result non-negative). The task input the runners
hand the agent: ``{"question": str, "expr": "23+45", "answer": 68}``, plus ``"greedy": true`` on held-out
(validation) tasks so the agent samples greedily there. Train and held-out sets come from different seeds
and never share a question.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from algorithm.dispatcher import DatasetTask

__all__ = ["TEMPLATES", "VERBS", "Problem", "generate", "heldout_tasks", "train_tasks"]

TRAIN_SEED = 1234
HELDOUT_SEED = 98765

# Every word that varies has a fixed length (names 3 letters, items and verbs 5, the templates' words 3): the
# numbers always sit at the same distance from the end of the prompt, so copying them into the tool call is a
# positional pattern a tiny model can learn, and the operator is read off the verb.
NAMES = ("Ann", "Bob", "Eve", "Max", "Kim", "Sam")
ITEMS = ("pears", "coins", "cards", "books", "plums")
VERBS = {"+": ("finds", "earns", "grabs", "gains"), "-": ("loses", "drops", "sells", "gives")}
TEMPLATES: tuple[str, ...] = (
    "{n} has {a} {i} and {v} {b}. How many now?",
    "{n} had {a} {i} but {v} {b}. How many now?",
    "{n} got {a} {i} and {v} {b}. How many now?",
)


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
        return self.a + self.b if self.op == "+" else self.a - self.b


def generate(count: int, seed: int, exclude: frozenset[str] = frozenset()) -> list[Problem]:
    """``count`` distinct problems drawn with ``seed`` (none of whose questions is in ``exclude``)."""
    rng = random.Random(seed)
    problems: dict[str, Problem] = {}
    while len(problems) < count:
        op, template = rng.choice(("+", "-")), rng.choice(TEMPLATES)
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if op == "-" and b > a:
            a, b = b, a
        question = template.format(n=rng.choice(NAMES), a=a, b=b, i=rng.choice(ITEMS), v=rng.choice(VERBS[op]))
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
