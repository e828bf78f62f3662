"""The ClickHouse store (embedded chdb or a server), read-only SQL with limits, and its HTTP endpoint."""

from fulmen.infra.store.read_endpoint import ReadEndpoint, RemoteReader
from fulmen.infra.store.reads import QueryResult, SqlReader
from fulmen.infra.store.sql_guard import ReadOnlyError
from fulmen.infra.store.store import EncodedRows, Store

__all__ = [
    "EncodedRows",
    "QueryResult",
    "ReadEndpoint",
    "ReadOnlyError",
    "RemoteReader",
    "SqlReader",
    "Store",
    "open_reader",
]


def open_reader(settings):
    """Where reads go: the ClickHouse server; else the embedded store's owner if one serves reads; else the
    embedded store itself (which fails with a clear message if another process holds it)."""
    if settings.clickhouse.url is None:
        token = settings.clickhouse.read_token.get_secret_value() if settings.clickhouse.read_token else None
        remote = RemoteReader.find(settings.clickhouse.read_host, settings.clickhouse.read_port, token)
        if remote is not None:
            return remote
    return Store.open(settings)
