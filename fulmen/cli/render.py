"""How the CLI prints results: a table that fits the terminal (short ids, times to the second), CSV or JSON.

One mechanism for every table a command prints (``fulmen sql``, ``fulmen rollouts``, ``fulmen status``): a
column whose name says it holds ids (``RolloutId``, ``trace_id``, ``id``) or whose every value looks like one (32
or 16 hex digits, after an optional ``word-`` prefix) is shown as the shortest prefix, 8 characters or more,
that tells its values apart, and never wraps; a time is shown to the second in the zone the user set
(``FULMEN_CLI_TIMEZONE``, ``--utc``) and never wraps; any other value wraps inside its cell and is never cut.
A result with more columns than the terminal can hold (ids and times at their width, every other column at least
8 characters) is printed a row after the other, a line per column, like psql's expanded display, values whole.
``--wide`` (:attr:`TableStyle.wide`) shows every value whole, times to the microsecond, at the table's natural
width. CSV and JSON always carry every value whole, times in ISO 8601 as stored.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, tzinfo
from decimal import Decimal
from typing import Any
from uuid import UUID

from rich.console import Console
from rich.table import Table
from rich.text import Text

from fulmen.infra.settings import CliSettings
from fulmen.infra.store import QueryResult

__all__ = ["FORMATS", "TableStyle", "render", "short_ids", "table_style"]

FORMATS = ("table", "csv", "json", "jsonl")
MIN_ID_CHARS = 8  # a shortened id is at least this long (git shows 7)
_WHOLE_ID_CHARS = 16
_ID_NAME = re.compile(r"(^|_)(id|Id|ID)$|[a-z0-9]Id$")  # RolloutId, trace_id, id; not "valid" or "pid"
_ID_VALUE = re.compile(r"^([a-z]+-)?([0-9a-f]{32}|[0-9a-f]{16})$")  # Fulmen's ids, OTel trace and span ids


@dataclass(frozen=True)
class TableStyle:
    """How a table prints. ``wide``: every value whole (full ids, times to the microsecond), at the table's
    natural width even past the terminal's; otherwise it fits the terminal. ``tz``: the zone times are shown in
    (None: this machine's local zone)."""

    wide: bool = False
    tz: tzinfo | None = None

    def zone_name(self) -> str:
        return _zone_name(self.tz)


CellStyle = Callable[[Any], str | None]


def table_style(cli: CliSettings, *, wide: bool = False, utc: bool = False) -> TableStyle:
    """The style the settings and a command's ``--wide`` / ``--utc`` ask for."""
    return TableStyle(wide=wide or cli.wide, tz=cli.zone(utc=utc))


def render(
    result: QueryResult,
    fmt: str,
    console: Console,
    style: TableStyle | None = None,
    *,
    cell_styles: Mapping[str, CellStyle] | None = None,
    count: bool = True,
) -> None:
    """Print ``result`` as ``fmt``; ``style``, ``cell_styles`` (a Rich style per value, by column name) and
    ``count`` (a line under the table: how many rows, the zone of its times) only change tables."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
    if fmt == "table":
        _print_table(result, console, style or TableStyle(), cell_styles or {}, count)
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


def _print_table(
    result: QueryResult, console: Console, style: TableStyle, cell_styles: Mapping[str, CellStyle], count: bool
) -> None:
    columns = [[row[i] for row in result.rows] for i in range(len(result.columns))]
    kinds = [_kind(name, values) for name, values in zip(result.columns, columns, strict=True)]
    shown = [
        short_ids([v for v in values if isinstance(v, str)]) if kind == "id" and not style.wide else {}
        for kind, values in zip(kinds, columns, strict=True)
    ]
    full = [[_cell(value, style) for value in row] for row in result.rows]
    short = [
        [
            ids.get(value, text) if isinstance(value, str) else text
            for value, text, ids in zip(row, texts, shown, strict=True)
        ]
        for row, texts in zip(result.rows, full, strict=True)
    ]
    styles = [
        [
            (cell_styles[name](value) or "") if name in cell_styles else ""
            for name, value in zip(result.columns, row, strict=True)
        ]
        for row in result.rows
    ]
    down = not style.wide and _too_wide(result.columns, kinds, short, console.width)
    if down:  # too many columns for the terminal: one row after the other, a line per column, values whole
        _print_down(result.columns, full, styles, console)
    else:
        _print_across(result.columns, kinds, short, styles, console, style.wide)
    notes = [f"{len(result.rows)} row{'s' if len(result.rows) != 1 else ''}"] if count else []
    if any(isinstance(value, datetime) for row in result.rows for value in row):
        notes.append(f"times in {style.zone_name()}")
    if not down and short != full:
        notes.append("ids are unique prefixes; --wide shows them whole")
    if notes:
        console.print(" · ".join(notes), style="dim", highlight=False)


_FOLDED_MIN = 8  # the narrowest a wrapping column is worth; below it the rows are printed one after the other


def _too_wide(names: list[str], kinds: list[str], cells: list[list[str]], width: int) -> bool:
    """Whether the columns cannot fit ``width``: ids and times at their width (they never wrap), every other
    column at least :data:`_FOLDED_MIN` characters (or its widest value, when narrower), plus the borders."""
    needed = 1 + 3 * len(names)
    for index, kind in enumerate(kinds):
        widest = max([len(row[index]) for row in cells] + [0])
        needed += max(widest, len(names[index])) if kind in ("id", "time") else min(widest, _FOLDED_MIN) or 1
    return needed > width


def _print_across(
    names: list[str], kinds: list[str], cells: list[list[str]], styles: list[list[str]], console: Console, wide: bool
) -> None:
    table = Table(show_lines=False)
    for name, kind in zip(names, kinds, strict=True):
        if wide or kind in ("id", "time"):
            table.add_column(name, no_wrap=True)  # ids and times never wrap
        else:
            table.add_column(name, overflow="fold")  # long values wrap inside their cell, never cut
    for row, row_styles in zip(cells, styles, strict=True):
        table.add_row(*(Text(text, style=cell_style) for text, cell_style in zip(row, row_styles, strict=True)))
    if not wide:
        console.print(table)
        return
    # at its natural width, past the terminal's (Console.print caps its width at the console's)
    natural = console.measure(table, options=console.options.update(width=10**6)).maximum
    Console(
        file=console.file,
        width=max(console.width, natural),
        color_system=console.color_system,
        force_terminal=console.is_terminal,
        no_color=console.no_color,
    ).print(table, crop=False)


def _print_down(names: list[str], cells: list[list[str]], styles: list[list[str]], console: Console) -> None:
    """psql's expanded display: a section per row, a line per column (``row``, ``column``, ``value``)."""
    table = Table("row", "column", "value", show_lines=False)
    table.columns[1].no_wrap = True
    table.columns[2].overflow = "fold"
    for number, (row, row_styles) in enumerate(zip(cells, styles, strict=True), start=1):
        if number > 1:
            table.add_section()
        for index, (name, text, cell_style) in enumerate(zip(names, row, row_styles, strict=True)):
            table.add_row(str(number) if index == 0 else "", name, Text(text, style=cell_style))
    console.print(table)


def _kind(name: str, values: Sequence[Any]) -> str:
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, datetime) for v in present):
        return "time"
    if _ID_NAME.search(name) or (present and all(isinstance(v, str) and _ID_VALUE.match(v) for v in present)):
        return "id"
    return "other"


def short_ids(values: Sequence[str]) -> dict[str, str]:
    """Each distinct value's shortest prefix of :data:`MIN_ID_CHARS` or more characters that no other value
    shares; a value of 16 characters or fewer, or at most 3 longer than its prefix, is shown whole (a name such
    as ``task-17`` or a span id; cutting it saves little)."""
    distinct = sorted(set(values))
    longest = max((len(v) for v in distinct), default=0)
    for length in range(MIN_ID_CHARS, longest + 1):
        shown = {v: v if len(v) <= max(length + 3, _WHOLE_ID_CHARS) else v[:length] for v in distinct}
        if len(set(shown.values())) == len(distinct):
            return shown
    return {v: v for v in distinct}


def _zone_name(tz: tzinfo | None) -> str:
    if tz is None:
        local = datetime.now().astimezone()
        return f"local time ({local.tzname()})"
    return str(getattr(tz, "key", None) or tz.tzname(None) or tz)


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


def _time(value: datetime, style: TableStyle) -> str:
    aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)  # the store's times are UTC
    local = aware.astimezone(style.tz)
    if style.wide:
        return local.isoformat(sep=" ")
    return local.strftime("%Y-%m-%d %H:%M:%S")


def _cell(value: Any, style: TableStyle) -> str:
    if isinstance(value, datetime):
        return _time(value, style)
    if isinstance(value, float) and not style.wide:
        return f"{value:.6g}"
    plain = _plain(value)
    if isinstance(plain, dict | list):
        return json.dumps(plain)
    return "NULL" if plain is None else str(plain)


def _csv_cell(value: Any) -> str:
    plain = _plain(value)
    if isinstance(plain, dict | list):
        return json.dumps(plain)
    return "" if plain is None else str(plain)
