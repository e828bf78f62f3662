"""The ClickHouse store (embedded chdb or a server) and its Arrow batch writers."""

from infra.store.store import QueryResult, Store

__all__ = ["QueryResult", "Store"]
