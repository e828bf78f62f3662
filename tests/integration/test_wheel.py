"""The wheel built from the repository: `fulmen` is its only import name, every source module is in it, and
`fulmen.emit_reward` works in a fresh virtualenv that has the wheel (and only what that function needs)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
UV = Path(sys.executable).with_name("uv")
LAYERS = ("schemas", "infra", "producers", "consumers", "algorithm")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not UV.is_file():
        pytest.skip(f"uv is not installed next to {sys.executable} (make install puts it there)")
    out = tmp_path_factory.mktemp("dist")
    # sdist first, then the wheel from it (nothing is written into the source tree; the sdist is checked too)
    done = subprocess.run(
        [str(UV), "build", "--out-dir", str(out), str(ROOT)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("fulmen-*.whl")
    return built


def test_the_wheel_holds_fulmen_only_and_every_module(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"fulmen"}, sorted(tops)
    expected = {f"fulmen/{p.relative_to(ROOT)}" for p in (ROOT / "fulmen").rglob("*.py")}
    expected = {name.replace("fulmen/fulmen/", "fulmen/") for name in expected}
    for layer in LAYERS:
        expected |= {f"fulmen/{layer}/{p.relative_to(ROOT / layer)}" for p in (ROOT / layer).rglob("*.py")}
    assert not {e for e in expected if "__pycache__" not in e} - set(names)
    assert {"fulmen/infra/kafka/pom.xml", "fulmen/infra/kafka/log4j2.yaml"} <= set(names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "fulmen = fulmen.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_emit_reward_from_the_wheel_in_a_fresh_virtualenv(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = lambda *args: subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)  # noqa: E731
    assert run(str(UV), "venv", "-q", "--python", sys.executable, str(venv)).returncode == 0
    python = venv / "bin" / "python"
    # the wheel without its heavy dependencies, plus what the public helpers import (pydantic, OpenTelemetry)
    done = run(str(UV), "pip", "install", "-q", "--python", str(python), "--no-deps", str(wheel))
    assert done.returncode == 0, done.stderr
    done = run(str(UV), "pip", "install", "-q", "--python", str(python), "pydantic>=2.10,<3", "opentelemetry-api")
    if done.returncode != 0:
        pytest.skip(f"cannot install pydantic and opentelemetry-api from the package index: {done.stderr[-500:]}")
    code = "import fulmen; fulmen.emit_reward(1.0); fulmen.emit_annotation('note', k=1); print(fulmen.__version__)"
    done = run(str(python), "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0.1.0"
    assert run(str(python), "-c", "import schemas").returncode != 0
