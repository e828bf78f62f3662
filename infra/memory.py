"""Keeping a long-running training process's memory bounded on glibc.

Each training step runs on an ``asyncio.to_thread`` worker, and glibc gives each thread that allocates its own
arena (up to eight per core): the activations and gradients freed after a step on one thread are not reused by the
next step on another, so a process grows step after step. Measured with SmolLM2-135M, two steps a round, three
rounds as ``fulmen improve`` runs them (2026-12-07): 10.4 GB after the third round with the default arenas, 6.6 GB
at its peak and flat with two arenas, and 0.8 GB between rounds once the free memory is handed back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["limit_malloc_arenas", "release_free_memory"]

log = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """At most ``arenas`` malloc arenas from now on (call it before the threads that allocate start); False where
    the C library is not glibc."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(_M_ARENA_MAX, arenas))


def release_free_memory() -> bool:
    """Hand the memory malloc holds free back to the system (glibc's ``malloc_trim``); False where it cannot."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))
