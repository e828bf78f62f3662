"""The SQL example's database: a small shop (customers, products, orders, order items) generated with a fixed seed.

:func:`database_path` builds it once into ``~/.cache/fulmen/examples/sql_agent/shop-<hash>.sqlite`` (the hash
covers the generator's code, so a change rebuilds it; written to a temporary file, then renamed) and returns the
path. :func:`run_query` executes a model's SQL read-only (``mode=ro`` URI, ``PRAGMA query_only`` and an
authorizer that allows reads only: no ``ATTACH``, no ``PRAGMA``), stops it
after ``time_limit_s`` (a progress handler) and caps the rows; it never raises for bad SQL: the error is returned.
"""

from __future__ import annotations

import hashlib
import os
import random
import sqlite3
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SCHEMA", "QueryResult", "database_path", "run_query"]

SEED = 20261201
CITIES = ("Arden", "Belmoor", "Corvel", "Dunmere", "Eskar", "Falloway")
FIRST = ("Ada", "Bram", "Cleo", "Dov", "Elin", "Finn", "Gala", "Hugo", "Iris", "Jon", "Kira", "Liam", "Mira", "Nils")
LAST = ("Ashby", "Brook", "Crane", "Dale", "Ember", "Frost", "Grove", "Hale", "Irwin", "Jory")
PRODUCTS = (("lamp", "home"), ("chair", "home"), ("desk", "home"), ("kettle", "kitchen"), ("pan", "kitchen"),
            ("knife", "kitchen"), ("tent", "outdoor"), ("rope", "outdoor"), ("lantern", "outdoor"),
            ("pen", "office"), ("stapler", "office"), ("notebook", "office"))  # fmt: skip
SCHEMA = """\
customers(id, name, city)
products(id, name, category, price)
orders(id, customer_id, day, status)  -- day 1..365, status 'paid' or 'refunded'
order_items(order_id, product_id, quantity)"""
DDL = """
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL, price INTEGER NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id),
                     day INTEGER NOT NULL, status TEXT NOT NULL);
CREATE TABLE order_items (order_id INTEGER NOT NULL REFERENCES orders(id),
                          product_id INTEGER NOT NULL REFERENCES products(id), quantity INTEGER NOT NULL);
"""
MAX_ROWS = 200


@dataclass(frozen=True)
class QueryResult:
    """Rows (at most ``MAX_ROWS`` + 1, so a caller can tell there were more) or the error text."""

    rows: list[tuple] | None
    error: str | None = None


def _build(path: Path) -> None:
    r = random.Random(SEED)
    db = sqlite3.connect(path)
    db.executescript(DDL)
    customers = [(i, f"{FIRST[i % len(FIRST)]} {LAST[(i * 7) % len(LAST)]}", r.choice(CITIES)) for i in range(1, 61)]
    db.executemany("INSERT INTO customers VALUES (?, ?, ?)", customers)
    products = [(i + 1, name, category, r.randint(3, 120)) for i, (name, category) in enumerate(PRODUCTS)]
    db.executemany("INSERT INTO products VALUES (?, ?, ?, ?)", products)
    orders, items = [], []
    for order_id in range(1, 301):
        orders.append((order_id, r.randint(1, 60), r.randint(1, 365), "refunded" if r.random() < 0.1 else "paid"))
        for product_id in r.sample(range(1, len(PRODUCTS) + 1), r.randint(1, 3)):
            items.append((order_id, product_id, r.randint(1, 5)))
    db.executemany("INSERT INTO orders VALUES (?, ?, ?, ?)", orders)
    db.executemany("INSERT INTO order_items VALUES (?, ?, ?)", items)
    db.commit()
    db.close()


def database_path(cache: Path | None = None) -> Path:
    """The shop database, built on first use (module docstring)."""
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    folder = cache or Path(os.environ.get("FULMEN_EXAMPLES_CACHE", Path.home() / ".cache" / "fulmen" / "examples"))
    path = folder / "sql_agent" / f"shop-{digest}.sqlite"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(handle)
        os.unlink(staging)
        _build(Path(staging))
        os.replace(staging, path)
    return path


_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}


def _reads_only(action: int, *_: object) -> int:
    """The authorizer: reading tables and calling functions only (no ATTACH, PRAGMA, writes, schema changes)."""
    return sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY


def run_query(path: Path, sql: str, time_limit_s: float = 1.0) -> QueryResult:
    """Execute ``sql`` read-only with a time limit and a row cap; errors are returned, never raised."""
    if not sql or not sql.strip():
        return QueryResult(None, "empty query")
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1.0)
    except sqlite3.Error as exc:
        return QueryResult(None, f"cannot open the database: {exc}")
    deadline = time.monotonic() + time_limit_s
    db.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
    try:
        db.execute("PRAGMA query_only = ON")
        db.set_authorizer(_reads_only)
        cursor = db.execute(sql)
        return QueryResult(cursor.fetchmany(MAX_ROWS + 1))
    except sqlite3.Warning:
        return QueryResult(None, "only one statement at a time")
    except (sqlite3.Error, ValueError, OverflowError) as exc:
        message = "query took too long" if "interrupted" in str(exc) else str(exc)
        return QueryResult(None, message)
    finally:
        db.close()
