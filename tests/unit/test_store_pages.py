"""Which mappings the store releases after opening the engine: clean read-only pages of its library only."""

from __future__ import annotations

from fulmen.infra.store.store import _clean_mappings

SMAPS = """\
00400000-00500000 r--p 00000000 08:01 11 /venv/chdb/_chdb.abi3.so
Size:               1024 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
00500000-00600000 r-xp 00100000 08:01 11 /venv/chdb/_chdb.abi3.so
Size:               1024 kB
Shared_Dirty:          0 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
VmFlags: rd ex mr mw me
00600000-00700000 r--p 00200000 08:01 11 /venv/chdb/_chdb.abi3.so
Private_Dirty:        12 kB
Anonymous:            12 kB
00700000-00800000 rw-p 00300000 08:01 11 /venv/chdb/_chdb.abi3.so
Anonymous:             0 kB
00800000-00900000 r-xp 00000000 08:01 12 /venv/pyarrow/libarrow.so
Anonymous:             0 kB
00900000-00a00000 rw-p 00000000 00:00 0
Anonymous:           100 kB
"""


def test_only_unwritten_read_only_mappings_of_the_library_are_released() -> None:
    assert _clean_mappings(SMAPS, "_chdb.") == [(0x400000, 0x500000), (0x500000, 0x600000)]
    assert _clean_mappings("", "_chdb.") == []
