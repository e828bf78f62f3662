"""Questions about the shop database with gold SQL, from templates of rising difficulty, fixed seeds.

Levels: ``filter`` (one table, a WHERE), ``join`` (two or three tables), ``group`` (GROUP BY with an aggregate),
``nested`` (a subquery). Parameters are drawn from the data (cities, categories, products, thresholds), and a
question whose gold result is empty is redrawn. The training and held-out splits use different seeds and share no
question. A task input: ``{"question", "gold_sql", "level"}``, plus ``"greedy": true`` on held-out tasks; the
database is :func:`examples.sql_agent.database.database_path` (built on first use).

    python -m examples.sql_agent.data OUT_DIR [--train 256] [--val 64]
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

from examples.spec import write_splits_command
from examples.sql_agent.database import CITIES, PRODUCTS, database_path, run_query

__all__ = ["LEVELS", "heldout_tasks", "train_tasks"]

TRAIN_SEED = 11
HELDOUT_SEED = 4242
HELDOUT_SIZE = 24
CATEGORIES = sorted({category for _, category in PRODUCTS})
NAMES = [name for name, _ in PRODUCTS]

Template = Callable[[random.Random], tuple[str, str]]


def _filter(r: random.Random) -> tuple[str, str]:
    match r.randrange(3):
        case 0:
            city = r.choice(CITIES)
            return f"What are the names of the customers who live in {city}?", \
                f"SELECT name FROM customers WHERE city = '{city}'"  # fmt: skip
        case 1:
            price = r.randint(10, 90)
            return f"Which products cost more than {price}?", f"SELECT name FROM products WHERE price > {price}"
        case _:
            category = r.choice(CATEGORIES)
            return f"List the names of the products in the {category} category.", \
                f"SELECT name FROM products WHERE category = '{category}'"  # fmt: skip


def _join(r: random.Random) -> tuple[str, str]:
    match r.randrange(2):
        case 0:
            city = r.choice(CITIES)
            return f"How many orders were placed by customers from {city}?", \
                ("SELECT COUNT(*) FROM orders JOIN customers ON customers.id = orders.customer_id "
                 f"WHERE customers.city = '{city}'")  # fmt: skip
        case _:
            name = r.choice(NAMES)
            return f"How many units of {name} were sold in all?", \
                ("SELECT SUM(order_items.quantity) FROM order_items JOIN products ON products.id = "
                 f"order_items.product_id WHERE products.name = '{name}'")  # fmt: skip


def _group(r: random.Random) -> tuple[str, str]:
    match r.randrange(2):
        case 0:
            return "How many customers live in each city?", "SELECT city, COUNT(*) FROM customers GROUP BY city"
        case _:
            status = r.choice(("paid", "refunded"))
            return f"For each customer id, how many {status} orders are there?", \
                f"SELECT customer_id, COUNT(*) FROM orders WHERE status = '{status}' GROUP BY customer_id"  # fmt: skip


def _nested(r: random.Random) -> tuple[str, str]:
    match r.randrange(2):
        case 0:
            return "Which products cost more than the average product price?", \
                "SELECT name FROM products WHERE price > (SELECT AVG(price) FROM products)"  # fmt: skip
        case _:
            category = r.choice(CATEGORIES)
            return f"What are the names of the customers who bought a product in the {category} category?", \
                ("SELECT DISTINCT name FROM customers WHERE id IN (SELECT orders.customer_id FROM orders JOIN "
                 "order_items ON order_items.order_id = orders.id JOIN products ON products.id = "
                 f"order_items.product_id WHERE products.category = '{category}')")  # fmt: skip


LEVELS: dict[str, Template] = {"filter": _filter, "join": _join, "group": _group, "nested": _nested}


def _draw(seed: int, count: int, exclude: set[str]) -> list[dict[str, Any]]:
    """Up to ``count`` distinct questions with a non-empty gold result, the levels in turn (fewer when the
    templates run out: they make about a hundred distinct questions)."""
    r, tasks, seen, path = random.Random(seed), [], set(exclude), database_path()
    levels = list(LEVELS)
    for attempt in range(200 * count):
        if len(tasks) == count:
            break
        level = levels[attempt % len(levels)]
        question, gold = LEVELS[level](r)
        if question in seen or not run_query(path, gold).rows:
            continue
        seen.add(question)
        tasks.append({"question": question, "gold_sql": gold, "level": level})
    return tasks


@functools.cache
def _heldout_pool() -> tuple[dict[str, Any], ...]:
    return tuple(_draw(HELDOUT_SEED, HELDOUT_SIZE, set()))


def heldout_tasks(count: int) -> list[dict[str, Any]]:
    """The first ``count`` (at most ``HELDOUT_SIZE``) held-out questions, greedy."""
    if count > HELDOUT_SIZE:
        raise ValueError(f"the SQL example has {HELDOUT_SIZE} held-out questions, not {count}")
    return [t | {"greedy": True} for t in _heldout_pool()[:count]]


def train_tasks(count: int) -> list[dict[str, Any]]:
    """``count`` training tasks: the distinct training questions (none held out), repeated in turn when ``count``
    exceeds them (each is then seen again, as in a further epoch)."""
    pool = _draw(TRAIN_SEED, count, {t["question"] for t in _heldout_pool()})
    return [pool[i % len(pool)] for i in range(count)]


def main(argv: list[str] | None = None) -> None:
    write_splits_command("sql", train_tasks, heldout_tasks, argv)


if __name__ == "__main__":
    main()
