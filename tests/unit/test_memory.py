"""``fulmen.infra.memory``: on this machine's glibc both calls take effect (elsewhere they say they did not)."""

from __future__ import annotations

import platform

import pytest

from fulmen.infra.memory import limit_malloc_arenas, release_free_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and malloc_trim are glibc's")
def test_arenas_are_limited_and_free_memory_handed_back() -> None:
    assert limit_malloc_arenas(8)  # eight per core is glibc's own bound: nothing else in this process changes
    release_free_memory()  # True only when it handed something back; it must not fail either way
