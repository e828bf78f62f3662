"""Read-only SQL for people and tools: checked statements, run with limits, on engine handles of their own.

Every user query (``fulmen sql``, the read endpoint that ``fulmen consume`` serves) goes through
:class:`SqlReader`:

* the statement is checked by :mod:`fulmen.infra.store.sql_guard` (ClickHouse's own parser, allow-lists);
* it runs on a handle that is read-only for good (embedded: a separate chdb connection with ``readonly=1``
  and the limits set once, so neither the query nor a later one can lift them, and the consumers' own
  handle never changes mode; server: the ``read_url`` user if set, else ``url``'s, with ``readonly=2`` and
  the limits on every request);
* limits: execution time, memory, result rows and bytes, engine threads (settings ``FULMEN_CLICKHOUSE_READ_*``);
* reads never share a handle with inserts, so a long read does not hold ingestion back, and at most
  ``read_concurrency`` run at once (the rest wait, then get a :class:`RetryableError`);
* a statement that passed is remembered by its text (the last :data:`_CHECKED_STATEMENTS`, each of at most
  :data:`_CHECKED_TEXT_CHARS`), so a dashboard or a script polling the same query does not pay the engine's two
  parses each time; the check depends on the text and the database only;
* each read is tagged, so :meth:`SqlReader.cancel` stops it in the engine (``KILL QUERY``) when its client
  goes away or the process stops;
* values from outside (a dashboard's filters) travel as ``parameters`` for ``%(name)s`` placeholders: bound by
  :func:`bind_parameters` (clickhouse-connect's quoting) before the check, so the guard sees the final text.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import clickhouse_connect
import pyarrow as pa
from clickhouse_connect.driver.binding import finalize_query
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import ClickHouseError

from fulmen.infra.settings import ClickHouseSettings
from fulmen.infra.store.sql_guard import OUTPUT_FORMAT, ReadOnlyError, ReadStatement, check_read
from fulmen.schemas.errors import PoisonInputError, RetryableError

__all__ = ["Parameters", "QueryResult", "SqlReader", "bind_parameters", "read_limits"]

log = logging.getLogger(__name__)

_WAIT_FOR_HANDLE_S = 10.0
_CHECKED_STATEMENTS = 256
_CHECKED_TEXT_CHARS = 16_384  # a longer text (a long list bound into it) is checked each time, never kept
_SCALARS = (str, int, float, bool)

# Values for ``%(name)s`` placeholders: scalars, or lists of scalars (for ``IN %(names)s``).
Parameters = Mapping[str, Any]


class QueryResult:
    """Column names and rows of a query (what ``fulmen sql`` prints)."""

    def __init__(self, columns: list[str], rows: list[list[Any]]) -> None:
        self.columns = list(columns)
        self.rows = [list(row) for row in rows]

    @classmethod
    def from_arrow(cls, table: pa.Table) -> QueryResult:
        columns = [column.to_pylist() for column in table.columns]
        return cls(table.column_names, [list(row) for row in zip(*columns, strict=True)])


def bind_parameters(sql: str, parameters: Parameters | None) -> str:
    """``sql`` with each ``%(name)s`` replaced by its value as a ClickHouse literal (strings quoted and escaped
    by clickhouse-connect's binder). Without parameters the text is returned untouched (a ``%`` in a LIKE
    pattern stays as written). A value that is not a scalar or a list of scalars is a :class:`ReadOnlyError`.
    """
    if not parameters:
        return sql
    for name, value in parameters.items():
        items = value if isinstance(value, list | tuple) else [value]
        if not isinstance(name, str) or not all(isinstance(item, _SCALARS) for item in items):
            raise ReadOnlyError(f"parameter {name!r}: only strings, numbers, booleans and lists of them")
    try:
        return finalize_query(sql, {name: list(v) if isinstance(v, tuple) else v for name, v in parameters.items()})
    except (KeyError, ValueError, TypeError) as exc:
        raise ReadOnlyError(f"the parameters do not fit the query's placeholders: {exc}") from exc


def read_limits(settings: ClickHouseSettings) -> dict[str, Any]:
    """The engine settings that bound one read."""
    return {
        "max_execution_time": settings.read_max_execution_s,
        "timeout_overflow_mode": "throw",
        "max_memory_usage": settings.read_max_memory_bytes,
        "max_result_rows": settings.read_max_result_rows,
        "max_result_bytes": settings.read_max_result_bytes,
        "result_overflow_mode": "throw",
        "max_threads": settings.read_max_threads,
    }


class SqlReader:
    """Runs checked reads. ``connect(settings_for_handle)`` opens one read handle; ``admin`` runs KILL QUERY.

    Built by :meth:`fulmen.infra.store.Store.reader`; see the module docstring for the rules.
    """

    def __init__(
        self,
        connect: Callable[[dict[str, Any]], Client],
        admin: Client,
        database: str,
        limits: dict[str, Any],
        *,
        embedded: bool,
        concurrency: int,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self._connect = connect
        self._admin = admin
        self.database = database
        self.limits = limits
        self.embedded = embedded
        self._slots = threading.BoundedSemaphore(concurrency)
        self._idle: dict[bool, queue.SimpleQueue[Client]] = {True: queue.SimpleQueue(), False: queue.SimpleQueue()}
        self._all: list[Client] = []
        self._lock = threading.Lock()
        self._running: set[str] = set()
        self._checked: OrderedDict[str, ReadStatement] = OrderedDict()  # guarded by _lock

    # --- checking -------------------------------------------------------------------------------------------
    def check(self, sql: str) -> ReadStatement:
        """The statement as it will run, or :class:`ReadOnlyError` saying why it may not."""
        with self._lock:
            if (known := self._checked.get(sql)) is not None:
                self._checked.move_to_end(sql)
                return known
        with self._handle(final=False) as client:
            statement = check_read(
                sql,
                format_query=lambda text: _format_query(client, text),
                explain_ast=lambda text: _explain_ast(client, text),
                database=self.database,
            )
        if len(sql) <= _CHECKED_TEXT_CHARS:
            with self._lock:
                self._checked[sql] = statement
                if len(self._checked) > _CHECKED_STATEMENTS:
                    self._checked.popitem(last=False)
        return statement

    # --- running --------------------------------------------------------------------------------------------
    def raw(self, sql: str, fmt: str, *, final: bool = True, tag: str | None = None) -> tuple[bytes, str]:
        """Run a read; return the engine's output and its format (the query's own FORMAT wins over ``fmt``)."""
        if not OUTPUT_FORMAT.match(fmt):
            raise ReadOnlyError(f"unknown output format {fmt!r}")
        statement = self.check(sql)
        output = statement.output_format or fmt
        text = statement.sql if statement.output_format else f"{statement.sql} FORMAT {fmt}"
        return self._run(text, final=final, tag=tag), output

    def query(
        self, sql: str, parameters: Parameters | None = None, *, final: bool = True, tag: str | None = None
    ) -> QueryResult:
        """Run a read and return its rows (the query may not carry its own FORMAT here)."""
        return QueryResult.from_arrow(self.arrow(sql, parameters, final=final, tag=tag))

    def arrow(
        self, sql: str, parameters: Parameters | None = None, *, final: bool = True, tag: str | None = None
    ) -> pa.Table:
        data = self.arrow_ipc(sql, parameters, final=final, tag=tag)
        return pa.ipc.open_stream(data).read_all() if data else pa.table({})

    def arrow_ipc(
        self, sql: str, parameters: Parameters | None = None, *, final: bool = True, tag: str | None = None
    ) -> bytes:
        """Run a read and return an Arrow IPC stream (the query may not carry its own FORMAT here); the
        ``parameters`` are bound (:func:`bind_parameters`) before the statement is checked."""
        statement = self.check(bind_parameters(sql, parameters))
        if statement.output_format:
            raise ReadOnlyError(f"remove FORMAT {statement.output_format}: the format is chosen by the caller here")
        return self._run(f"{statement.sql} FORMAT ArrowStream", final=final, tag=tag)

    def new_tag(self) -> str:
        return uuid.uuid4().hex

    def cancel(self, tag: str) -> None:
        """Stop the read tagged ``tag`` if it still runs (the engine answers it with QUERY_WAS_CANCELLED)."""
        if tag not in self._running:
            return
        try:
            self._admin.command(f"KILL QUERY WHERE startsWith(query, '{_marker(tag)}') ASYNC")
            log.info("read %s cancelled", tag)
        except Exception as exc:  # the read may have ended meanwhile; nothing else to do
            log.warning("could not cancel read %s: %s", tag, exc)

    def cancel_all(self) -> None:
        for tag in list(self._running):
            self.cancel(tag)

    def close(self) -> None:
        self.cancel_all()
        with self._lock:
            clients, self._all = self._all, []
        for client in clients:
            try:
                client.close()
            except Exception:  # closing is best effort
                log.debug("closing a read handle failed", exc_info=True)

    def _run(self, text: str, *, final: bool, tag: str | None) -> bytes:
        tag = tag or self.new_tag()
        self._running.add(tag)
        try:
            with self._handle(final=final) as client:
                return client.raw_query(f"{_marker(tag)} {text}", fmt=None, settings=self._per_call(final))
        except ClickHouseError as exc:
            raise PoisonInputError(f"query failed: {_engine_message(exc)}") from exc
        finally:
            self._running.discard(tag)

    def _per_call(self, final: bool) -> dict[str, Any] | None:
        # Embedded handles carry their limits (and `final`) for good; a server takes them on every request.
        if self.embedded:
            return None
        return {**self.limits, "final": int(final), "readonly": 2}

    # --- handles --------------------------------------------------------------------------------------------
    def _handle(self, *, final: bool) -> _Borrowed:
        return _Borrowed(self, final)

    def _borrow(self, final: bool) -> Client:
        if not self._slots.acquire(timeout=_WAIT_FOR_HANDLE_S):
            raise RetryableError(f"too many reads at once (at most {len(self._all)} run together): try again")
        try:
            return self._idle[final].get_nowait()
        except queue.Empty:
            pass
        try:
            client = self._connect({**self.limits, "final": int(final)} if self.embedded else {})
        except Exception:
            self._slots.release()
            raise
        with self._lock:
            self._all.append(client)
        return client

    def _give_back(self, final: bool, client: Client, *, failed: bool) -> None:
        """Return a handle to the pool; one whose query failed is closed instead (chdb can leave the rest of a
        failed result on the handle, which the next query would read as its own)."""
        try:
            if not failed:
                self._idle[final].put(client)
                return
            with self._lock:
                if client in self._all:
                    self._all.remove(client)
            try:
                client.close()
            except Exception:  # closing is best effort
                log.debug("closing a failed read handle failed", exc_info=True)
        finally:
            self._slots.release()


class _Borrowed:
    def __init__(self, reader: SqlReader, final: bool) -> None:
        self.reader, self.final = reader, final

    def __enter__(self) -> Client:
        self.client = self.reader._borrow(self.final)
        return self.client

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        # A refusal by the guard ran nothing that could leave a result behind; an engine error may have.
        failed = exc_type is not None and not issubclass(exc_type, ReadOnlyError)
        self.reader._give_back(self.final, self.client, failed=failed)


def _marker(tag: str) -> str:
    return f"/* fulmen-read:{tag} */"


def _format_query(client: Client, sql: str) -> str:
    try:
        rows = client.query("SELECT formatQuerySingleLine({sql:String})", parameters={"sql": sql}).result_rows
    except ClickHouseError as exc:
        raise ReadOnlyError(f"not one valid statement: {_engine_message(exc)}") from exc
    return str(rows[0][0])


def _explain_ast(client: Client, sql: str) -> str:
    try:
        return client.raw_query(f"EXPLAIN AST {sql}", fmt="TabSeparatedRaw").decode()
    except ClickHouseError as exc:
        raise ReadOnlyError(f"cannot parse the statement: {_engine_message(exc)}") from exc


def _engine_message(exc: Exception) -> str:
    """The engine's message without the query text clickhouse-connect repeats after it."""
    text = str(exc).strip()
    return text.split("\n", 1)[0] if len(text) > 2000 else text


def connect_embedded(path: str, database: str | None) -> Callable[[dict[str, Any]], Client]:
    """Opens read handles on the engine this process hosts (``readonly=1`` applied last, so it sticks)."""

    def connect(limits: dict[str, Any]) -> Client:
        settings = {**limits, "readonly": 1}
        try:  # unqualified table names resolve in Fulmen's database when it exists
            return clickhouse_connect.get_client(dsn=f"chdb://{path}", database=database, settings=settings)
        except ClickHouseError:
            return clickhouse_connect.get_client(dsn=f"chdb://{path}", settings=settings)

    return connect


def connect_server(dsn: str) -> Callable[[dict[str, Any]], Client]:
    def connect(_: dict[str, Any]) -> Client:
        return clickhouse_connect.get_client(dsn=dsn, connect_timeout=10, send_receive_timeout=300)

    return connect
