"""The SQL example's three splits: training, in-distribution held-out, and held-out on databases never trained on.

Questions come from the templates of :mod:`examples.sql_agent.questions` (``filter``, ``order``, ``join``,
``group``, ``nested``) on the generated databases of :mod:`examples.sql_agent.database`, with fixed seeds:

* ``train_tasks(n)``: questions on the training domains' databases (``TRAIN_DATABASES``);
* ``heldout_tasks(n)``: in distribution: other questions on the same databases (``HELDOUT_SIZE`` of them);
* ``unseen_tasks(n)``: questions on the unseen domains' databases only (``UNSEEN_DATABASES``: schemas, tables
  and column names no training question touches; ``UNSEEN_SIZE`` of them), as Spider's dev set holds out whole
  databases.

Each split visits the templates in turn and the databases in an order that pairs every template with every
domain (the first 32 training tasks, the supervised warm-up's, cover each template 6 or 7 times). A question is
redrawn when its gold result is empty (no rows, or a single count of 0), when a top-k question ties at the cut,
when a filter keeps every row, or when its text was drawn before: no question text occurs twice in all three
splits, so none of a held-out split is in training. Both held-out splits are greedy (``"greedy": true``).

A task input: ``{"question", "gold_sql", "db", "template"}``; the agent runs on ``db`` (a task input without
``"db"`` runs on the original shop database).

    python -m examples.sql_agent.data OUT_DIR [--train 256] [--val 64] [--unseen 64]   # train/val[/unseen].jsonl
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Collection, Sequence
from typing import Any

from examples.spec import write_splits_command
from examples.sql_agent.database import TRAIN_DATABASES, UNSEEN_DATABASES, database_path, run_query
from examples.sql_agent.questions import Draft
from examples.sql_agent.templates import TEMPLATES, draft

__all__ = ["HELDOUT_SIZE", "TEMPLATES", "UNSEEN_SIZE", "heldout_tasks", "train_tasks", "unseen_tasks"]

TRAIN_SEED = 11
HELDOUT_SEED = 4242
UNSEEN_SEED = 777
HELDOUT_SIZE = 600
UNSEEN_SIZE = 600
ATTEMPTS = 25  # drafts per slot before the slot is skipped


def _domains(dbs: Sequence[str]) -> list[list[str]]:
    """The databases grouped by domain (``library_1``, ``library_2``, ... together), in order."""
    groups: dict[str, list[str]] = {}
    for db in dbs:
        groups.setdefault(db.rpartition("_")[0], []).append(db)
    return list(groups.values())


def _slot(i: int, templates: int, domains: int) -> tuple[int, int]:
    """The template and the domain of the ``i``-th slot: templates in turn, and over ``templates * domains``
    slots every (template, domain) pair once, even when the two counts share a factor."""
    return i % templates, (i + i // math.lcm(templates, domains)) % domains


def _acceptable(db: str, found: Draft) -> bool:
    path = database_path(db)
    rows = run_query(path, found.gold).rows
    if not rows or all(v in (None, 0) for row in rows for v in row):
        return False
    if found.probe is not None:
        keys = run_query(path, found.probe).rows or []
        if len(rows) < found.k or (len(keys) > found.k and keys[found.k - 1] == keys[found.k]):
            return False
    if found.baseline is not None:
        baseline = run_query(path, found.baseline).rows or []
        if sorted(map(repr, baseline)) == sorted(map(repr, rows)):
            return False
    return True


def _draw(seed: int, dbs: Sequence[str], count: int, exclude: Collection[str] = ()) -> list[dict[str, Any]]:
    """Up to ``count`` questions, slot by slot (module docstring); fewer only if the templates run dry."""
    r, tasks, seen = random.Random(seed), [], set(exclude)
    domains, templates = _domains(dbs), list(TEMPLATES)
    i = misses = 0
    while len(tasks) < count and misses < 2 * len(templates) * len(domains):
        t, d = _slot(i, len(templates), len(domains))
        i += 1
        db = r.choice(domains[d])
        for _ in range(ATTEMPTS):
            found = draft(templates[t], r, db)
            if found is not None and found.question not in seen and _acceptable(db, found):
                seen.add(found.question)
                tasks.append({"question": found.question, "gold_sql": found.gold, "db": db, "template": templates[t]})
                misses = 0
                break
        else:
            misses += 1
    return tasks


@functools.cache
def _heldout_pool() -> tuple[dict[str, Any], ...]:
    return tuple(_draw(HELDOUT_SEED, TRAIN_DATABASES, HELDOUT_SIZE))


@functools.cache
def _unseen_pool() -> tuple[dict[str, Any], ...]:
    return tuple(_draw(UNSEEN_SEED, UNSEEN_DATABASES, UNSEEN_SIZE))


def _greedy(pool: Sequence[dict[str, Any]], count: int, name: str) -> list[dict[str, Any]]:
    if count > len(pool):
        raise ValueError(f"the SQL example has {len(pool)} {name} questions, not {count}")
    return [t | {"greedy": True} for t in pool[:count]]


def heldout_tasks(count: int) -> list[dict[str, Any]]:
    """The first ``count`` (at most ``HELDOUT_SIZE``) in-distribution held-out questions, greedy."""
    return _greedy(_heldout_pool(), count, "held-out")


def unseen_tasks(count: int) -> list[dict[str, Any]]:
    """The first ``count`` (at most ``UNSEEN_SIZE``) questions on the unseen domains' databases, greedy."""
    return _greedy(_unseen_pool(), count, "unseen")


def train_tasks(count: int) -> list[dict[str, Any]]:
    """``count`` training tasks: distinct questions (none in a held-out split), repeated in turn when ``count``
    exceeds what the templates make (each is then seen again, as in a further epoch)."""
    held = {t["question"] for t in (*_heldout_pool(), *_unseen_pool())}
    pool = _draw(TRAIN_SEED, TRAIN_DATABASES, count, held)
    if not pool:
        raise ValueError("the SQL example's templates made no training question")
    return [pool[i % len(pool)] for i in range(count)]


def main(argv: list[str] | None = None) -> None:
    write_splits_command("sql", train_tasks, heldout_tasks, argv, unseen_tasks)


if __name__ == "__main__":
    main()
