"""The demo's task: small arithmetic word problems (add, subtract, multiply), generated with fixed seeds.

Each operator has two wordings (:data:`WORDINGS`), e.g. ``"Ann has 17 pears and finds 3 more. How many now?"``
and ``"Ann had 17 pears; a friend gave her 3. Count them."`` for ``17+3``; only the wording says which
operation it is. The expression is ``a<op>b`` with the numbers in the order the question gives them. ``a`` is
14..24 and ``b`` 2..4, so that every operator's result has two digits: the answer is then copied from the
tool's reply at a fixed distance, a pattern the tiny model learns quickly, and the three operators always give
three different results (only the right one is rewarded).

The warm-up explains the first wording of each operator (:data:`TAUGHT`); the training and held-out sets use
only the second ones (:data:`UNTAUGHT`), whose meaning the model has to learn from the reward. Measured: with
all six in training, the taught ones' groups were all right (advantage 0) and taught nothing, half of every
step's rollouts. Both sets take the wordings in turn: the demo's steps of 12 groups (dispatched in order) see
each wording four times, and the held-out set has as many of each. With wordings drawn at random, the untaught
ones moved together in training, towards whichever operator a step's groups happened to favour (the model had
learnt to treat them alike).

The task input the runners hand the agent: ``{"question": str, "expr": "17+3", "answer": 20}``, plus
``"greedy": true`` on held-out (validation) tasks so the agent samples greedily there. Train and held-out sets
come from different seeds; a held-out question is in neither the training set nor the warm-up.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from fulmen.algorithm.service.dispatcher import DatasetTask

__all__ = [
    "OPERATORS",
    "TAUGHT",
    "UNTAUGHT",
    "WORDINGS",
    "Problem",
    "apply",
    "generate",
    "heldout_tasks",
    "train_tasks",
    "warmup_problems",
]

TRAIN_SEED = 1234
HELDOUT_SEED = 98765
WARMUP_SEED = TRAIN_SEED + 1  # the warm-up's episodes (fulmen.algorithm.demo.warmup)
CORPUS_SEED = TRAIN_SEED + 2  # the conversations the tokenizer's merges are learnt from

OPERATORS = ("+", "-", "*")
NAMES = ("Ann", "Bob", "Eve", "Max", "Kim", "Sam", "Lea", "Tom", "Zoe", "Ben", "Amy", "Leo")
ITEMS = ("pears", "coins", "cards", "books", "plums", "eggs", "nuts", "shells", "stamps", "beads")
# name -> (operator, template); the name's letter says whether the warm-up explains it (a) or not (b). The
# b wordings share no word with each other (beyond names, items and numbers) nor any operator's cue with the a
# wordings: a shared cue ("gave" in an add and a subtract wording) made GRPO push both the same way.
WORDINGS: dict[str, tuple[str, str]] = {
    "add-a": ("+", "{n} has {a} {i} and finds {b} more. How many now?"),
    "sub-a": ("-", "{n} has {a} {i} and loses {b} of them. How many now?"),
    "mul-a": ("*", "{n} packs {a} {i} in each of {b} bags. How many in all?"),
    "add-b": ("+", "{n} had {a} {i}; a friend gave {n} {b}. Count them."),
    "sub-b": ("-", "{n} kept {a} {i} until {b} broke. What is left?"),
    "mul-b": ("*", "{n} sees {a} {i} on every one of {b} shelves. Total?"),
}
TAUGHT = frozenset(name for name in WORDINGS if name.endswith("-a"))  # what the warm-up explains
UNTAUGHT = frozenset(WORDINGS) - TAUGHT  # what GRPO learns: the training and held-out sets
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
    wording: str

    @property
    def expr(self) -> str:
        return f"{self.a}{self.op}{self.b}"

    @property
    def answer(self) -> int:
        return apply(self.a, self.op, self.b)


def generate(
    count: int,
    seed: int,
    exclude: frozenset[str] = frozenset(),
    wordings: frozenset[str] | None = None,
    cycle: bool = False,
) -> list[Problem]:
    """``count`` distinct problems drawn with ``seed``: none of whose questions is in ``exclude``, each in one of
    ``wordings`` (default: all of :data:`WORDINGS`), drawn at random or, with ``cycle``, taking the wordings in
    turn (so any ``len(wordings)`` consecutive problems have one of each)."""
    rng = random.Random(seed)
    names = sorted(wordings if wordings is not None else WORDINGS)
    problems: dict[str, Problem] = {}
    while len(problems) < count:
        wording = names[len(problems) % len(names)] if cycle else rng.choice(names)
        op, template = WORDINGS[wording]
        a, b = rng.randint(*A_RANGE), rng.randint(*B_RANGE)
        question = template.format(n=rng.choice(NAMES), a=a, b=b, i=rng.choice(ITEMS))
        if question not in exclude:
            problems.setdefault(question, Problem(question, a, b, op, wording))
    return list(problems.values())


def _task(index: int, problem: Problem, greedy: bool) -> DatasetTask:
    data: dict = {"question": problem.question, "expr": problem.expr, "answer": problem.answer}
    if greedy:
        data["greedy"] = True
    return DatasetTask(task_id=f"{'val' if greedy else 'train'}-{index}", input=data)


def train_tasks(count: int = 2000) -> list[DatasetTask]:
    """The training set (seed ``TRAIN_SEED``): the wordings the warm-up did not explain, in turn."""
    return [_task(k, p, greedy=False) for k, p in enumerate(_train_problems(count))]


def _train_problems(count: int) -> list[Problem]:
    return generate(count, TRAIN_SEED, wordings=UNTAUGHT, cycle=True)


def warmup_problems(count: int) -> list[Problem]:
    """The warm-up's ``count`` problems (seed ``WARMUP_SEED``, wordings at random)."""
    return generate(count, WARMUP_SEED)


def heldout_tasks(count: int = 64, train_count: int = 2000, warmup_count: int = 9600) -> list[DatasetTask]:
    """The held-out set (seed ``HELDOUT_SEED``): wordings the warm-up did not explain, no question of
    ``train_tasks(train_count)`` nor of ``warmup_problems(warmup_count)`` (the default is the default warm-up's
    600 steps of 16; the demo passes its plan's); greedy."""
    seen = _train_problems(train_count) + warmup_problems(warmup_count)
    problems = generate(count, HELDOUT_SEED, frozenset(p.question for p in seen), UNTAUGHT, cycle=True)
    return [_task(k, p, greedy=True) for k, p in enumerate(problems)]
