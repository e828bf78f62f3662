"""Each sampled call of a seeded rollout gets its own seed: (rollout seed, attempt, call number) -> a seed.

A rollout dispatched with a seed reaches the gateway at ``/rollout/{id}/attempt/{n}/seed/{seed}/v1``. The gateway
numbers the rollout's calls in the order they arrive (per rollout and attempt) and derives each call's seed with
:func:`fulmen.infra.seeds.derive_seed`; a call that names its own ``seed`` keeps it. The numbering lives in this
gateway's memory, bounded (the least recently used rollouts are forgotten first), so a rerun samples the same
tokens when its calls come in the same order to the same gateway: one agent calling sequentially, as the examples
do. Calls an agent makes in parallel, or spread over gateway replicas, are numbered by arrival and may differ.
"""

from __future__ import annotations

from collections import OrderedDict

from fulmen.infra.seeds import derive_seed

__all__ = ["CallSeeds"]


class CallSeeds:
    """Numbers the calls of each (rollout, attempt) and derives their seeds; remembers ``capacity`` rollouts."""

    def __init__(self, capacity: int = 65_536) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, not {capacity}")
        self.capacity = capacity
        self._calls: OrderedDict[tuple[str, int], int] = OrderedDict()

    def next(self, rollout_id: str, attempt: int, rollout_seed: int) -> int:
        """The seed of this rollout attempt's next call."""
        key = (rollout_id, attempt)
        number = self._calls.pop(key, 0)
        self._calls[key] = number + 1
        while len(self._calls) > self.capacity:
            self._calls.popitem(last=False)
        return derive_seed(rollout_seed, attempt, number)
