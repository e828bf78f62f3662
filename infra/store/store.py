"""The ClickHouse store: one class over clickhouse-connect for the embedded engine and for a server.

Embedded (default): the in-process engine chdb, opened with clickhouse-connect's ``chdb://PATH`` DSN. One
process owns a chdb directory (a second process cannot open it, not even read-only) and one process can open
only one directory; :meth:`Store.open` turns both cases into a :class:`ConfigurationError` that says what to do.
Server: ``FULMEN_CLICKHOUSE_URL=http(s)://user:password@host:8123/db``.

Writes go in batches as Arrow tables, never row by row. Reads that the system runs deduplicate at query time
(the ``final`` setting), because tables are ReplacingMergeTrees that Kafka redelivery may write twice.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import clickhouse_connect
import pyarrow as pa
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import ClickHouseError

from fulmen.infra.settings import ClickHouseSettings, FulmenSettings
from fulmen.infra.store.params import bind_fast
from fulmen.infra.store.reads import QueryResult, SqlReader, connect_embedded, connect_server, read_limits
from fulmen.infra.store.sql_guard import ReadOnlyError
from fulmen.schemas.ddl import MIGRATIONS, MIGRATIONS_TABLE, TABLES, Migration
from fulmen.schemas.errors import ConfigurationError, RetryableError

__all__ = ["EncodedRows", "QueryResult", "ReadOnlyError", "Store"]

log = logging.getLogger(__name__)

# A Native block may declare plainer types than the table's (String for LowCardinality(String)): the engine converts
# them where this is on (the default, said explicitly so that a server profile turning it off cannot refuse inserts).
_INPUT_SETTINGS = {"Native": {"input_format_native_allow_types_conversion": 1}}

# chdb allows one directory per process: remember which one this process opened.
_embedded_lock = threading.Lock()
_embedded: dict[Path, Client] = {}


@dataclass(frozen=True)
class EncodedRows:
    """Rows already encoded in a ClickHouse input format (``fmt``: Native, RowBinary, ...) for ``columns``."""

    columns: tuple[str, ...]
    data: bytes
    num_rows: int
    fmt: str = "Native"


class Store:
    """Read and write Fulmen's tables; see the module docstring for the two modes."""

    def __init__(
        self, client: Client, database: str, *, location: str, settings: ClickHouseSettings | None = None
    ) -> None:
        self.client = client
        self.database = database
        self.location = location  # for messages: the chdb path or the server URL without credentials
        self.settings = settings or ClickHouseSettings(database=database)
        self._reader: SqlReader | None = None
        self._reader_lock = threading.Lock()

    # --- opening --------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, settings: FulmenSettings) -> Store:
        """Connect to the configured store (does not create tables: call :meth:`migrate`)."""
        database = settings.clickhouse.database
        if settings.clickhouse.url is not None:
            return cls(_server_client(settings), database, location=_safe_url(settings), settings=settings.clickhouse)
        path = settings.store_path.resolve()
        client = _embedded_client(path, settings.clickhouse)
        return cls(client, database, location=f"chdb://{path}", settings=settings.clickhouse)

    @property
    def embedded(self) -> bool:
        return self.location.startswith("chdb://")

    def close(self) -> None:
        """Close the read handles and a server connection; the embedded engine stays open for the process."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if not self.embedded:
            self.client.close()

    def reader(self) -> SqlReader:
        """Read-only SQL with limits on handles of its own (what ``fulmen sql`` and the read endpoint use)."""
        with self._reader_lock:
            if self._reader is None:
                if self.embedded:
                    connect = connect_embedded(self.location.removeprefix("chdb://"), self.database)
                else:
                    url = self.settings.read_url or self.settings.url
                    connect = connect_server(url.get_secret_value())  # type: ignore[union-attr]
                self._reader = SqlReader(
                    connect,
                    self.client,
                    self.database,
                    read_limits(self.settings),
                    embedded=self.embedded,
                    concurrency=self.settings.read_concurrency,
                )
            return self._reader

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
                f"{self.database}.{MIGRATIONS_TABLE}",
                [[migration.version, migration.name]],
                column_names=["Version", "Name"],
            )
            log.info("store migration %d applied: %s", migration.version, migration.name)
            applied.append(migration)
        if self.embedded:
            self._bound_spans_table()
        return applied

    def _bound_spans_table(self) -> None:
        """Bound the memory of the spans table's writers (embedded): the widest table (some 70 column streams,
        each with a compression buffer in every insert and merge), merged column by column (vertical merges)
        instead of all columns at once. Table settings: they change no data, and stay until changed again."""
        self.command(
            f"ALTER TABLE {self.table(TABLES['spans'])} MODIFY SETTING "
            f"max_compress_block_size = {self.settings.engine_compress_block_bytes}, "
            "vertical_merge_algorithm_min_rows_to_activate = 1, vertical_merge_algorithm_min_bytes_to_activate = 0"
        )

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

    def insert_batch(self, table: str, batch: pa.Table | EncodedRows) -> int:
        """Insert an Arrow table or pre-encoded rows as one batch; return the number of rows."""
        if isinstance(batch, pa.Table):
            return self.insert_arrow(table, batch)
        if batch.num_rows == 0:
            return 0
        try:
            self.client.raw_insert(
                self.table(table),
                list(batch.columns),
                batch.data,
                fmt=batch.fmt,
                settings=_INPUT_SETTINGS.get(batch.fmt),
            )
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
        """Run a SELECT; ``final`` deduplicates ReplacingMergeTree tables.

        ``read_only`` is for SQL from outside (a user, a script): it goes through :meth:`reader`, which refuses
        anything but a read and bounds it. Fulmen's own queries pass ``parameters`` instead of text they built
        (``{name:Type}`` placeholders here; ``%(name)s`` ones with ``read_only``, bound before the check).
        """
        if read_only:
            return self.reader().query(sql, parameters, final=final)
        result = self.client.query(sql, parameters=bind_fast(parameters or {}), settings=_final(final))
        return QueryResult(result.column_names, result.result_rows)

    def query_arrow(
        self, sql: str, parameters: Mapping[str, Any] | None = None, *, final: bool = True, read_only: bool = False
    ) -> pa.Table:
        if read_only:
            return self.reader().arrow(sql, parameters, final=final)
        return self.client.query_arrow(sql, parameters=bind_fast(parameters or {}), settings=_final(final))


def _final(final: bool) -> dict[str, Any]:
    return {"final": 1} if final else {}


def _embedded_client(path: Path, settings: ClickHouseSettings) -> Client:
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
        _bound_allocator()
        try:
            client = clickhouse_connect.get_client(dsn=f"chdb://{path}", chdb_options=engine_options(settings))
        except ClickHouseError as exc:
            raise ConfigurationError(f"cannot open the embedded store at {path}: {exc}") from exc
        _embedded[path] = client
        return client


def engine_options(settings: ClickHouseSettings) -> dict[str, int]:
    """Server settings of the embedded engine (the connection string of the first handle: they hold for the
    process). The caches fill only as reads use them; bounding them keeps a long-lived owner from growing into
    gigabytes of marks."""
    options = {}
    if settings.engine_max_memory_bytes:
        options["max_server_memory_usage"] = settings.engine_max_memory_bytes
    for cache in _ENGINE_CACHES:
        options[cache] = settings.engine_cache_bytes
    if settings.engine_merge_threads:
        options["background_pool_size"] = settings.engine_merge_threads
    return options


_ENGINE_CACHES = (
    "mark_cache_size",
    "index_mark_cache_size",
    "primary_index_cache_size",
    "vector_similarity_index_cache_size",
    "text_index_header_cache_size",
    "text_index_postings_cache_size",
)

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def _bound_allocator() -> None:
    """The engine allocates through glibc malloc from dozens of threads: by default each may get an arena of its
    own that keeps what it freed, and blocks under 32 MiB come from those arenas. Two arenas, blocks of 1 MiB and
    more mapped and unmapped on their own, and free memory over 1 MiB handed back hold the process near what it
    uses (measured: 40-100 MB less peak RSS under the span bench, the same CPU a row). Not glibc: nothing done."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    for param, value in ((_M_ARENA_MAX, 2), (_M_MMAP_THRESHOLD, 1024**2), (_M_TRIM_THRESHOLD, 1024**2)):
        mallopt(param, value)


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
    from fulmen.infra.http import mask_url

    return mask_url(settings.clickhouse.url.get_secret_value())  # type: ignore[union-attr]
