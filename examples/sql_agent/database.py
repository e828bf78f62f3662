"""The SQL example's databases: many small generated SQLite databases over different domains, plus the original shop.

Each domain of :mod:`examples.sql_agent.domains` has ``INSTANCES`` databases (``<domain>_<k>``, ``k`` from 1):
the same schema, different rows (a few dozen per table, drawn with a seed fixed by the database id; foreign keys
lean towards the first parent rows, so some parents have many children and some none). ``shop`` is the original
hand-written shop (customers, products, orders, order items), what a task input without ``"db"`` runs on.
:func:`schema_text` is the compact schema the agent's prompts show (``table(id, column, fk_id -> table.id)``).

:func:`database_path` builds a database once into ``~/.cache/fulmen/examples/sql_agent/<db>-<hash>.sqlite`` (the
hash covers this module's and the domains' code, so a change rebuilds it; written to a temporary file, then
renamed) and returns the path. :func:`run_query` executes a model's SQL read-only (``mode=ro`` URI, ``PRAGMA
query_only`` and an authorizer that allows reads only: no ``ATTACH``, no ``PRAGMA``), stops it after
``time_limit_s`` (a progress handler) and caps the rows; it never raises for bad SQL: the error is returned. The
same guard runs on every database.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import sqlite3
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from examples.sql_agent import domains
from examples.sql_agent.domains import DOMAINS, TRAIN_DOMAINS, UNSEEN_DOMAINS, Domain, Table

__all__ = [
    "INSTANCES",
    "SCHEMA",
    "SHOP",
    "TRAIN_DATABASES",
    "UNSEEN_DATABASES",
    "QueryResult",
    "database_path",
    "domain_of",
    "rows_of",
    "run_query",
    "schema_text",
]

SEED = 20261201
GENERATED_SEED = 20261207
INSTANCES = 3
SHOP = "shop"
TRAIN_DATABASES = tuple(f"{d.name}_{k}" for d in TRAIN_DOMAINS for k in range(1, INSTANCES + 1))
UNSEEN_DATABASES = tuple(f"{d.name}_{k}" for d in UNSEEN_DOMAINS for k in range(1, INSTANCES + 1))
CITIES = ("Arden", "Belmoor", "Corvel", "Dunmere", "Eskar", "Falloway")
FIRST = ("Ada", "Bram", "Cleo", "Dov", "Elin", "Finn", "Gala", "Hugo", "Iris", "Jon", "Kira", "Liam", "Mira", "Nils")
LAST = ("Ashby", "Brook", "Crane", "Dale", "Ember", "Frost", "Grove", "Hale", "Irwin", "Jory")
PRODUCTS = (
    ("lamp", "home"),
    ("chair", "home"),
    ("desk", "home"),
    ("kettle", "kitchen"),
    ("pan", "kitchen"),
    ("knife", "kitchen"),
    ("tent", "outdoor"),
    ("rope", "outdoor"),
    ("lantern", "outdoor"),
    ("pen", "office"),
    ("stapler", "office"),
    ("notebook", "office"),
)
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


def domain_of(db: str) -> Domain:
    """The domain of a generated database id (``library_2`` -> the library domain)."""
    name, _, instance = db.rpartition("_")
    if name not in DOMAINS or not instance.isdigit() or not 1 <= int(instance) <= INSTANCES:
        raise ValueError(
            f"unknown SQL example database {db!r}: {SHOP!r} or <domain>_<1..{INSTANCES}> with a domain "
            f"among {', '.join(DOMAINS)}"
        )
    return DOMAINS[name]


def _labels(r: random.Random, table: Table, column: domains.Column) -> list[str]:
    combos = [f"{a} {b}" for a in column.pool for b in column.second]
    if len(combos) < table.rows:
        raise ValueError(f"{table.name}.{column.name}: {len(combos)} distinct labels for {table.rows} rows")
    return r.sample(combos, table.rows)


@functools.cache
def rows_of(db: str) -> dict[str, list[dict[str, Any]]]:
    """A generated database's rows, per table (each row a dict by column name, ``id`` first): what it holds."""
    domain = domain_of(db)
    r = random.Random(GENERATED_SEED ^ zlib.crc32(db.encode()))
    tables: dict[str, list[dict[str, Any]]] = {}
    for table in domain.tables:
        labels = {c.name: _labels(r, table, c) for c in table.of("label")}
        rows = []
        for i in range(table.rows):
            row: dict[str, Any] = {"id": i + 1}
            for c in table.columns:
                if c.kind == "label":
                    row[c.name] = labels[c.name][i]
                elif c.kind == "cat":
                    row[c.name] = r.choice(c.pool)
                elif c.kind == "num":
                    row[c.name] = r.randint(c.low, c.high)
                else:  # fk: skewed towards the first parents, so that some have many children and some none
                    row[c.name] = 1 + int(len(tables[c.ref]) * r.random() ** 1.6)
            rows.append(row)
        tables[table.name] = rows
    return tables


def _ddl(table: Table) -> str:
    types = {"label": "TEXT NOT NULL", "cat": "TEXT NOT NULL", "num": "INTEGER NOT NULL"}
    columns = ["id INTEGER PRIMARY KEY"] + [
        f"{c.name} {types[c.kind]}" if c.kind != "fk" else f"{c.name} INTEGER NOT NULL REFERENCES {c.ref}(id)"
        for c in table.columns
    ]
    return f"CREATE TABLE {table.name} ({', '.join(columns)})"


def _build_generated(db: str, path: Path) -> None:
    connection = sqlite3.connect(path)
    for table in domain_of(db).tables:
        connection.execute(_ddl(table))
        names = ["id"] + [c.name for c in table.columns]
        connection.executemany(
            f"INSERT INTO {table.name} VALUES ({', '.join('?' * len(names))})",
            [tuple(row[n] for n in names) for row in rows_of(db)[table.name]],
        )
    connection.commit()
    connection.close()


@functools.cache
def schema_text(db: str | None = None) -> str:
    """The schema the agent's prompts show: one ``table(columns)`` line per table (``None``: the shop's)."""
    if db is None or db == SHOP:
        return SCHEMA
    lines = []
    for table in domain_of(db).tables:
        columns = ["id"] + [c.name if c.kind != "fk" else f"{c.name} -> {c.ref}.id" for c in table.columns]
        lines.append(f"{table.name}({', '.join(columns)})")
    return "\n".join(lines)


@functools.cache
def _digest() -> str:
    code = Path(__file__).read_bytes() + Path(domains.__file__).read_bytes()
    return hashlib.sha256(code).hexdigest()[:12]


def _materialize(path: Path, build: Callable[[Path], None]) -> Path:
    """``path``, built by ``build`` into a temporary file and renamed there unless it exists already."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(handle)
        os.unlink(staging)
        try:
            build(Path(staging))
            os.replace(staging, path)
        finally:
            Path(staging).unlink(missing_ok=True)
    return path


def database_path(db: str | None = None, cache: Path | None = None) -> Path:
    """The database ``db`` (a generated database's id, or ``None`` / ``"shop"``: the shop), built on first use."""
    folder = cache or Path(os.environ.get("FULMEN_EXAMPLES_CACHE", Path.home() / ".cache" / "fulmen" / "examples"))
    if db is None or db == SHOP:
        return _materialize(folder / "sql_agent" / f"{SHOP}-{_digest()}.sqlite", _build)
    domain_of(db)  # a clear error for an unknown id
    return _materialize(folder / "sql_agent" / f"{db}-{_digest()}.sqlite", functools.partial(_build_generated, db))


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
