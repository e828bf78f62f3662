"""The SQL reward: 1.0 when the query's result equals the gold query's result, else 0.0.

Results are compared as multisets of rows (order ignored: none of the gold queries orders its rows), with numbers
compared after rounding to 6 places (``AVG`` gives floats). Invalid SQL, a timeout, or more rows than the cap
score 0.0, never an exception.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from examples.sql_agent.database import MAX_ROWS, run_query

__all__ = ["reward"]


def _normal(rows: list[tuple]) -> Counter:
    return Counter(tuple(round(v, 6) if isinstance(v, float) else v for v in row) for row in rows)


def reward(database: Path, sql: str, gold_sql: str) -> float:
    got, gold = run_query(database, sql), run_query(database, gold_sql)
    if gold.rows is None:
        raise ValueError(f"the gold query fails: {gold.error}")
    if got.rows is None or len(got.rows) > MAX_ROWS:
        return 0.0
    return 1.0 if _normal(got.rows) == _normal(gold.rows) else 0.0
