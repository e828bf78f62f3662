"""One import name: the package list, the public API, one-way imports, and no module importable under two names."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import fulmen

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("schemas", "infra", "producers", "consumers", "algorithm")
# what each subpackage may import of Fulmen (besides itself): schemas <- infra <- producers/consumers/algorithm
ALLOWED = {
    "schemas": set(),
    "infra": {"schemas"},
    "producers": {"schemas", "infra"},
    "consumers": {"schemas", "infra"},
    "algorithm": {"schemas", "infra"},
}


def source_packages() -> dict[str, Path]:
    """``fulmen.x.y`` -> its folder, for every folder with an ``__init__.py`` under the mapped roots."""
    found = {}
    for name, root in [("fulmen", ROOT / "fulmen")] + [(f"fulmen.{layer}", ROOT / layer) for layer in LAYERS]:
        for init in sorted(root.rglob("__init__.py")):
            parts = init.parent.relative_to(root).parts
            if "__pycache__" not in parts:
                found[".".join((name, *parts))] = init.parent
    return found


def test_pyproject_lists_every_package_under_the_fulmen_name() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert sorted(config["packages"]) == sorted(source_packages())
    assert config["package-dir"] == {"fulmen": "fulmen", **{f"fulmen.{layer}": layer for layer in LAYERS}}
    assert not (fulmen.__file__ or "").startswith(str(ROOT / "schemas"))


def test_the_public_api_resolves_every_name_in_all() -> None:
    for name in fulmen.__all__:
        assert getattr(fulmen, name) is not None, name
    from fulmen.producers.agent_helpers import emit_reward
    from fulmen.producers.runner.agent import LLMEndpoint

    assert fulmen.emit_reward is emit_reward and fulmen.LLMEndpoint is LLMEndpoint
    assert set(fulmen.__all__) <= set(dir(fulmen))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fulmen.nope  # noqa: B018


def test_importing_a_lower_layer_pulls_in_nothing_above_it() -> None:
    code = (
        "import sys, fulmen.schemas, fulmen.infra.settings\n"
        "above = sorted(m for m in sys.modules if m.startswith(('fulmen.producers', 'fulmen.consumers', "
        "'fulmen.algorithm', 'fulmen.cli')))\n"
        "assert not above, above\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tests", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def fulmen_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of a ``fulmen.*`` module in ``path``, also inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "fulmen" else [f"fulmen.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, name) for name in names if name == "fulmen" or name.startswith("fulmen.")]
    return found


def test_imports_flow_one_way() -> None:
    upward = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            for line, module in fulmen_imports(path):
                target = module.split(".")[1] if module.count(".") >= 1 else "fulmen"
                if target != layer and target not in ALLOWED[layer]:
                    upward.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not upward, "imports that run upward or sideways:\n" + "\n".join(upward)


def test_no_module_is_importable_under_two_names(tmp_path: Path) -> None:
    """Outside the source tree (as a user's process is), only the ``fulmen.*`` names import."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    for layer in LAYERS:
        done = subprocess.run(
            [sys.executable, "-c", f"import fulmen.{layer}"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        done = subprocess.run(
            [sys.executable, "-c", f"import {layer}"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr, f"`import {layer}` worked"


def test_the_native_flattener_has_the_fulmen_name_only() -> None:
    import importlib.util

    from fulmen.consumers.spans import native_flattener

    assert importlib.util.find_spec("fulmen_otlp_rows") is None  # the old top-level name is gone
    if native_flattener() is None:
        pytest.skip("the native flattener is not built (needs cargo: make install)")
    assert importlib.util.find_spec("fulmen.infra._otlp_rows") is not None


# imported only where their optional extra or tool is installed (each import is guarded or lazy)
OPTIONAL_IMPORTS = {"verl", "vllm", "ray", "fulmen"}


def test_every_third_party_import_of_the_package_is_a_base_dependency() -> None:
    """`pip install fulmen && fulmen demo` works: what the package imports (the demo's agent uses openai) is in
    ``[project].dependencies``, not only in an extra."""
    from importlib.metadata import packages_distributions

    declared = {
        re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        for requirement in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    }
    owners = packages_distributions()
    missing = set()
    for folder in ("fulmen", *LAYERS):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for top in {name.split(".")[0] for name in names} - OPTIONAL_IMPORTS:
                    if top in sys.stdlib_module_names:
                        continue
                    distributions = {d.lower().replace("_", "-") for d in owners.get(top, [top])}
                    if not distributions & declared:
                        missing.add(f"{top} ({path.relative_to(ROOT)})")
    assert not missing, sorted(missing)
