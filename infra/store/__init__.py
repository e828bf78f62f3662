"""The ClickHouse store (embedded chdb or a server) and its Arrow batch writers."""

from infra.store.store import QueryResult, ReadOnlyError, Store

__all__ = ["QueryResult", "ReadOnlyError", "Store"]
