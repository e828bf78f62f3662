"""The ClickHouse store: one class over clickhouse-connect for the embedded engine and for a server.

Embedded (default): the in-process engine chdb, opened with clickhouse-connect's ``chdb://PATH`` DSN. One
process owns a chdb directory (a second process cannot open it, not even read-only) and one process can open
only one directory; :meth:`Store.open` turns both cases into a :class:`ConfigurationError` that says what to do.
Server: ``FULMEN_CLICKHOUSE_URL=http(s)://user:password@host:8123/db``.

Writes go in batches as Arrow tables, never row by row. Reads that the system runs deduplicate at query time
(the ``final`` setting), because tables are ReplacingMergeTrees that Kafka redelivery may write twice.
"""

from __future__ import annotations

import fcntl
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import clickhouse_connect
import pyarrow as pa
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import ClickHouseError

from infra.errors import ConfigurationError, PoisonInputError, RetryableError
from infra.settings import FulmenSettings
from schemas.ddl import MIGRATIONS, MIGRATIONS_TABLE, Migration

__all__ = ["QueryResult", "ReadOnlyError", "RowBinary", "Store"]

log = logging.getLogger(__name__)

# chdb allows one directory per process: remember which one this process opened.
_embedded_lock = threading.Lock()
_embedded: dict[Path, Client] = {}

READ_ONLY_SETTINGS = {"readonly": 2}  # 2: SELECTs and query-level settings, no writes, no DDL
_READ_STATEMENTS = ("SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXPLAIN", "EXISTS")
_LEADING_NOISE = re.compile(r"^(\s+|--[^\n]*\n?|/\*.*?\*/|\()+", re.DOTALL)


class ReadOnlyError(PoisonInputError):
    """A write or DDL statement sent where only reads are allowed."""


@dataclass(frozen=True)
class RowBinary:
    """Rows already encoded in ClickHouse's RowBinary format, for ``columns`` in that order."""

    columns: tuple[str, ...]
    data: bytes
    num_rows: int


class QueryResult:
    """Column names and rows of a query (what ``fulmen sql`` prints)."""

    def __init__(self, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.columns = list(columns)
        self.rows = [list(row) for row in rows]


class Store:
    """Read and write Fulmen's tables; see the module docstring for the two modes."""

    def __init__(self, client: Client, database: str, *, location: str) -> None:
        self.client = client
        self.database = database
        self.location = location  # for messages: the chdb path or the server URL without credentials

    # --- opening --------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, settings: FulmenSettings) -> Store:
        """Connect to the configured store (does not create tables: call :meth:`migrate`)."""
        database = settings.clickhouse.database
        if settings.clickhouse.url is not None:
            return cls(_server_client(settings), database, location=_safe_url(settings))
        path = settings.store_path.resolve()
        return cls(_embedded_client(path), database, location=f"chdb://{path}")

    @property
    def embedded(self) -> bool:
        return self.location.startswith("chdb://")

    def close(self) -> None:
        """Close a server connection; the embedded engine stays open for the life of the process."""
        if not self.embedded:
            self.client.close()

    # --- schema ---------------------------------------------------------------------------------------------
    def migrate(self, migrations: Sequence[Migration] = MIGRATIONS) -> list[Migration]:
        """Apply the migrations not yet recorded, in order; return those applied now. Idempotent."""
        self.command(f"CREATE DATABASE IF NOT EXISTS {self.database}")
        self.command(
            f"CREATE TABLE IF NOT EXISTS {self.database}.{MIGRATIONS_TABLE} "
            "(Version UInt32, Name String, AppliedAt DateTime64(3, 'UTC') DEFAULT now64(3)) "
            "ENGINE = ReplacingMergeTree ORDER BY Version"
        )
        done = self.applied_versions()
        applied = []
        for migration in sorted(migrations, key=lambda m: m.version):
            if migration.version in done:
                continue
            for statement in migration.render(self.database):
                self.command(statement)
            self.client.insert(
                f"{self.database}.{MIGRATIONS_TABLE}", [[migration.version, migration.name]],
                column_names=["Version", "Name"],
            )  # fmt: skip
            log.info("store migration %d applied: %s", migration.version, migration.name)
            applied.append(migration)
        return applied

    def applied_versions(self) -> set[int]:
        rows = self.query(f"SELECT Version FROM {self.database}.{MIGRATIONS_TABLE}").rows
        return {int(row[0]) for row in rows}

    def table(self, name: str) -> str:
        """The fully qualified name of one of our tables."""
        return f"{self.database}.{name}"

    # --- writing --------------------------------------------------------------------------------------------
    def insert_arrow(self, table: str, data: pa.Table, *, settings: Mapping[str, Any] | None = None) -> int:
        """Insert one Arrow table as one batch; return the number of rows."""
        if data.num_rows == 0:
            return 0
        try:
            self.client.insert_arrow(self.table(table), data, settings=dict(settings or {}))
        except ClickHouseError as exc:
            raise RetryableError(f"insert into {self.table(table)} ({data.num_rows} rows) failed: {exc}") from exc
        return data.num_rows

    def insert_batch(self, table: str, batch: pa.Table | RowBinary) -> int:
        """Insert an Arrow table or pre-encoded RowBinary rows as one batch; return the number of rows."""
        if isinstance(batch, pa.Table):
            return self.insert_arrow(table, batch)
        if batch.num_rows == 0:
            return 0
        try:
            self.client.raw_insert(self.table(table), list(batch.columns), batch.data, fmt="RowBinary")
        except ClickHouseError as exc:
            raise RetryableError(f"insert into {self.table(table)} ({batch.num_rows} rows) failed: {exc}") from exc
        return batch.num_rows

    def command(self, sql: str, *, settings: Mapping[str, Any] | None = None) -> Any:
        return self.client.command(sql, settings=dict(settings or {}))

    # --- reading --------------------------------------------------------------------------------------------
    def query(
        self,
        sql: str,
        parameters: Mapping[str, Any] | None = None,
        *,
        final: bool = True,
        read_only: bool = False,
    ) -> QueryResult:
        """Run a SELECT; ``final`` deduplicates ReplacingMergeTree tables, ``read_only`` refuses writes and DDL."""
        if read_only:
            _require_read(sql)
        result = self.client.query(
            sql, parameters=dict(parameters or {}), settings=self._read_settings(final, read_only)
        )
        return QueryResult(result.column_names, result.result_rows)

    def query_arrow(
        self, sql: str, parameters: Mapping[str, Any] | None = None, *, final: bool = True, read_only: bool = False
    ) -> pa.Table:
        if read_only:
            _require_read(sql)
        return self.client.query_arrow(
            sql, parameters=dict(parameters or {}), settings=self._read_settings(final, read_only)
        )

    def query_raw(self, sql: str, fmt: str, *, final: bool = True, read_only: bool = True) -> bytes:
        """Run a read and return the engine's own output in format ``fmt`` (ArrowStream, CSV, JSONEachRow...)."""
        if read_only:
            _require_read(sql)
        return self.client.raw_query(sql, settings=self._read_settings(final, read_only), fmt=fmt)

    def _read_settings(self, final: bool, read_only: bool) -> dict[str, Any]:
        settings: dict[str, Any] = {"final": 1} if final else {}
        # A server takes settings per request. The embedded engine applies some per-call settings with SET and
        # restores them afterwards, but a process in readonly mode cannot switch it off again: the whole
        # process (the consumers' inserts included) would stay read-only. There the statement check of
        # _require_read is the guard.
        if read_only and not self.embedded:
            settings.update(READ_ONLY_SETTINGS)
        return settings


def _require_read(sql: str) -> None:
    """Refuse anything but a read before it reaches the engine.

    The ``readonly`` setting alone is not enough in embedded mode: chdb applies per-call settings with SET
    for statements it cannot suffix with a SETTINGS clause, and once ``readonly`` is on it cannot be
    switched off again, which would leave the whole process read-only.
    """
    head = _LEADING_NOISE.sub("", sql, count=1).split(None, 1)
    keyword = head[0].upper() if head else ""
    if keyword not in _READ_STATEMENTS:
        raise ReadOnlyError(
            f"only reads are allowed here ({', '.join(_READ_STATEMENTS)}), not {keyword or 'an empty statement'}"
        )


def _embedded_client(path: Path) -> Client:
    with _embedded_lock:
        if path in _embedded:
            return _embedded[path]
        if _embedded:
            other = next(iter(_embedded))
            raise ConfigurationError(
                f"this process already opened the embedded store at {other}; chdb allows one store directory "
                f"per process, so {path} cannot be opened too (use one FULMEN_CLICKHOUSE_PATH per process)"
            )
        path.mkdir(parents=True, exist_ok=True)
        owner = _other_owner(path)
        if owner is not None:
            raise ConfigurationError(
                f"the embedded store at {path} is open in another process ({owner}; in local mode the consumers "
                "process owns it): read it through that process with `fulmen sql`, stop that process, or use "
                "another FULMEN_CLICKHOUSE_PATH"
            )
        try:
            client = clickhouse_connect.get_client(dsn=f"chdb://{path}")
        except ClickHouseError as exc:
            raise ConfigurationError(f"cannot open the embedded store at {path}: {exc}") from exc
        _embedded[path] = client
        return client


def _other_owner(path: Path) -> str | None:
    """Who holds the engine's lock on ``path`` (its ``status`` file), or None if nobody does.

    chdb reports a held lock only on stderr and then fails with a generic message, so look first.
    """
    status = path / "status"
    if not status.exists():
        return None
    with open(status, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            first = handle.readline().strip()
            return first.replace("PID:", "pid").strip() or "pid unknown"
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


def _server_client(settings: FulmenSettings) -> Client:
    url = settings.clickhouse.url.get_secret_value()  # type: ignore[union-attr]  # checked by the caller
    try:
        return clickhouse_connect.get_client(dsn=url, connect_timeout=10, send_receive_timeout=300)
    except ClickHouseError as exc:
        raise RetryableError(f"cannot reach ClickHouse at {_safe_url(settings)}: {exc}") from exc
    except Exception as exc:  # urllib3/socket errors from the first ping
        raise RetryableError(f"cannot reach ClickHouse at {_safe_url(settings)}: {exc}") from exc


def _safe_url(settings: FulmenSettings) -> str:
    parts = urlsplit(settings.clickhouse.url.get_secret_value())  # type: ignore[union-attr]
    netloc = parts.hostname or ""
    if parts.port:
        netloc = f"{netloc}:{parts.port}"
    return parts._replace(netloc=netloc).geturl()
