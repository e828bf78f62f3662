"""How the CLI prints query results: a Rich table, CSV or JSON."""

from __future__ import annotations

import csv
import io
import json
from datetime import date, datetime
from decimal import Decimal
from typing import Any
from uuid import UUID

from rich.console import Console
from rich.table import Table

from fulmen.infra.store import QueryResult

__all__ = ["FORMATS", "render"]

FORMATS = ("table", "csv", "json", "jsonl")


def _plain(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal | UUID):
        return str(value)
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def render(result: QueryResult, fmt: str, console: Console) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
    if fmt == "table":
        table = Table(show_lines=False)
        for column in result.columns:
            table.add_column(column, overflow="fold")  # long values wrap inside their cell, never cut
        for row in result.rows:
            table.add_row(*(_cell(v) for v in row))
        console.print(table)
        console.print(f"{len(result.rows)} row{'s' if len(result.rows) != 1 else ''}", style="dim")
        return
    out = io.StringIO()
    if fmt == "csv":
        writer = csv.writer(out, lineterminator="\n")  # Unix lines, for shell pipelines
        writer.writerow(result.columns)
        for row in result.rows:
            writer.writerow([_csv_cell(v) for v in row])
    elif fmt == "json":
        json.dump([dict(zip(result.columns, map(_plain, row), strict=True)) for row in result.rows], out, indent=2)
        out.write("\n")
    else:
        for row in result.rows:
            out.write(json.dumps(dict(zip(result.columns, map(_plain, row), strict=True))) + "\n")
    console.file.write(out.getvalue())


def _cell(value: Any) -> str:
    plain = _plain(value)
    if isinstance(plain, dict | list):
        return json.dumps(plain)
    return "NULL" if plain is None else str(plain)


def _csv_cell(value: Any) -> str:
    plain = _plain(value)
    if isinstance(plain, dict | list):
        return json.dumps(plain)
    return "" if plain is None else str(plain)
