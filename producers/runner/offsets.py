"""Which offsets may be committed when records finish out of order (rollouts run concurrently)."""

from __future__ import annotations

__all__ = ["PartitionProgress"]


class PartitionProgress:
    """Tracks the records of one partition: the committable offset is one past the longest finished prefix.

    Records are added in offset order as they are fetched; :meth:`done` marks one finished in any order.
    """

    def __init__(self) -> None:
        self._pending: dict[int, bool] = {}  # offset -> finished, in insertion (= offset) order
        self.committable: int | None = None

    def add(self, offset: int) -> None:
        if offset in self._pending:
            return
        self._pending[offset] = False

    def done(self, offset: int) -> int | None:
        """Mark ``offset`` finished; return the new committable offset if it moved, else None."""
        if offset not in self._pending:
            return None
        self._pending[offset] = True
        moved = None
        for pending_offset in list(self._pending):
            if not self._pending[pending_offset]:
                break
            del self._pending[pending_offset]
            moved = pending_offset + 1
        if moved is not None:
            self.committable = moved
        return moved

    @property
    def in_flight(self) -> int:
        return sum(1 for finished in self._pending.values() if not finished)
