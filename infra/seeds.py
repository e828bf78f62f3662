"""Seeds derived from named parts, so that a rerun with the same run seed samples the same tokens.

A training run has one seed (``FULMEN_TRAIN_SEED``). The dispatcher gives each rollout request its own seed,
derived from (run seed, mode, group number, member), and the LLM gateway gives each sampled call of that rollout
a seed derived from (rollout seed, attempt, call number), passed to the engine (llama.cpp's per-request ``seed``,
the transformers backend's generator). The derivation is a hash (BLAKE2b), so nearby parts give unrelated seeds
and the same parts give the same seed on every machine and Python version (``hash()`` is salted per process).
"""

from __future__ import annotations

import hashlib

__all__ = ["SEED_LIMIT", "derive_seed"]

SEED_LIMIT = 2**63  # seeds are non-negative and below this: an int64 anywhere, a uint32 after llama.cpp's modulo


def derive_seed(*parts: int | str) -> int:
    """A seed in ``[0, SEED_LIMIT)`` that depends on every part and on their order."""
    text = "\x1f".join(f"{type(part).__name__}:{part}" for part in parts)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % SEED_LIMIT
