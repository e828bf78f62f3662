"""``fulmen init NAME``: scaffold an agent project to fill in (agent, reward, teacher, task files, README).

The files are the templates ``fulmen/cli/scaffold/<file>.tmpl`` (package data; not ``.py``, so neither the
package nor its import checks see them as modules), copied unchanged but for the README's
title. A directory that exists and is not empty is refused, so nothing of the user's is ever overwritten.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated

import typer

from fulmen.cli.base import console, friendly
from fulmen.schemas.errors import ConfigurationError

__all__ = ["FILES", "init_command", "scaffold"]

FILES = ("agent.py", "reward.py", "teacher.py", "tasks.py", "train.jsonl", "val.jsonl", "README.md")


def scaffold(target: Path) -> list[Path]:
    """Write the project into ``target`` (created); raises ConfigurationError when it exists and is not empty."""
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigurationError(
            f"{target} exists and is not empty: fulmen init writes only into a new or empty directory "
            "(choose another NAME, or move what is there)"
        )
    target.mkdir(parents=True, exist_ok=True)
    templates = resources.files("fulmen.cli") / "scaffold"
    written = []
    for name in FILES:
        text = (templates / f"{name}.tmpl").read_text(encoding="utf-8")
        if name == "README.md":
            text = text.replace("{name}", target.name)
        (target / name).write_text(text, encoding="utf-8")
        written.append(target / name)
    return written


@friendly
def init_command(
    name: Annotated[Path, typer.Argument(help="directory of the new project (must not exist, or be empty)")],
) -> None:
    """Scaffold an agent project to fill in: agent.py (run(task, llm) with the plain OpenAI client), reward.py,
    teacher.py, tasks.py with the task files it wrote (train.jsonl, val.jsonl) and a README with the commands that
    train it."""
    scaffold(name)
    # soft_wrap: the terminal wraps a long line; Rich would break it with a newline, and a command pasted back
    # from the screen would run in two halves
    console.print(f"wrote {', '.join(FILES)} to {name}/", soft_wrap=True, highlight=False)
    command = "fulmen train --local --agent agent:run --dataset train.jsonl --val val.jsonl --model tiny --steps 1"
    console.print(f"next: cd {name} && python teacher.py && {command}", soft_wrap=True, highlight=False)
    console.print(f"then a real model, with a warm-up: see {name}/README.md", soft_wrap=True, highlight=False)
