"""The llama-server build step of ``make install``: where it goes, what it patches, what it says when it cannot run.
(The build itself takes minutes: ``make install`` runs it; the llamacpp integration tests use what it built.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from fulmen.producers.llm_gateway.backends import llamacpp_build
from fulmen.producers.llm_gateway.backends.llamacpp_build import (
    EXIT_SKIPPED,
    PATCHES,
    BuildError,
    build,
    cached_server,
    find_server,
)
from fulmen.schemas.errors import ConfigurationError


def test_the_patches_apply_once_to_the_server_sources(tmp_path: Path) -> None:
    source = tmp_path / PATCHES[0].path
    source.parent.mkdir(parents=True)
    source.write_text("\n//\n".join(patch.old for patch in PATCHES))
    for patch in PATCHES:
        llamacpp_build._apply(tmp_path, patch)
    text = source.read_text()
    assert all(patch.new in text for patch in PATCHES) and "if (false && slot.stop == STOP_TYPE_WORD)" in text
    with pytest.raises(BuildError, match="found it 0 times"):
        llamacpp_build._apply(tmp_path, PATCHES[2])


def test_the_build_is_cached_per_cpu_and_patch_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = cached_server(tmp_path)
    assert path.parent.parent == tmp_path and path.parent.name.startswith(f"{llamacpp_build.VERSION}-")
    monkeypatch.setattr(llamacpp_build, "_cpu_flags", lambda: "avx2 fma")
    other_cpu = cached_server(tmp_path)
    monkeypatch.setattr(llamacpp_build, "PATCHES", PATCHES[:1])
    assert len({path, other_cpu, cached_server(tmp_path)}) == 3


def test_a_build_that_is_there_is_not_redone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = cached_server(tmp_path)
    target.parent.mkdir(parents=True)
    target.write_text("#!/bin/sh\n")
    target.chmod(0o755)
    monkeypatch.setattr(llamacpp_build, "_fetch_sources", lambda *a: pytest.fail("it downloaded again"))
    said: list[str] = []
    assert build(tmp_path, said.append) == target and "is built" in said[0]
    assert find_server(cache=tmp_path) == target


def test_without_a_toolchain_install_goes_on_with_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(llamacpp_build.shutil, "which", lambda tool: None if tool == "cmake" else f"/usr/bin/{tool}")
    monkeypatch.setattr(llamacpp_build, "CACHE", tmp_path)
    with pytest.raises(BuildError, match="cmake not found"):
        build(tmp_path)
    assert llamacpp_build.main() == EXIT_SKIPPED
    assert "note: cannot build llama-server: cmake not found" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing half-made


def test_the_backend_says_how_to_get_a_server(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="run `make install`") as missing:
        find_server(cache=tmp_path)
    assert "FULMEN_LLM_LLAMACPP_SERVER" in str(missing.value)
    with pytest.raises(ConfigurationError, match="is not an executable file"):
        find_server(str(tmp_path / "nope"))
    binary = tmp_path / "mine"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert find_server(str(binary)) == binary
