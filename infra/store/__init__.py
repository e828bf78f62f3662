"""The ClickHouse store (embedded chdb or a server), and read-only SQL over HTTP for the embedded one."""

from infra.store.read_endpoint import ReadEndpoint, RemoteReader
from infra.store.store import QueryResult, ReadOnlyError, RowBinary, Store

__all__ = ["QueryResult", "ReadEndpoint", "ReadOnlyError", "RemoteReader", "RowBinary", "Store", "open_reader"]


def open_reader(settings):
    """Where reads go: the ClickHouse server; else the embedded store's owner if one serves reads; else the
    embedded store itself (which fails with a clear message if another process holds it)."""
    if settings.clickhouse.url is None:
        remote = RemoteReader.find(settings.clickhouse.read_host, settings.clickhouse.read_port)
        if remote is not None:
            return remote
    return Store.open(settings)
