"""Every command the docs tell a reader to run names what exists: each ``fulmen`` command line in a shell block of
the README, the docs, the examples' READMEs and the scaffold's README names a real subcommand and only options that
subcommand has; each ``python -m MODULE`` names an importable module, each ``python FILE.py`` a file of the
repository (or of the scaffold, on a page that runs ``fulmen init``). A renamed option fails here, not in a reader's terminal."""

from __future__ import annotations

import functools
import importlib.util
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from fulmen.cli.init import FILES
from fulmen.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "examples").glob("**/README.md")),
    ROOT / "fulmen" / "cli" / "scaffold" / "README.md.tmpl",
]
BLOCK = re.compile(r"^```(?:bash|sh|console|shell)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def command_lines(page: Path) -> Iterator[list[str]]:
    """The words of each shell command of ``page``'s shell blocks: continuation lines joined, lines split at
    ``&&``, ``||``, ``;`` and ``|``; leading ``NAME=value`` assignments dropped, ``.venv/bin/fulmen`` read as
    ``fulmen``."""
    for block in BLOCK.findall(page.read_text()):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            try:
                tokens = list(lexer)
            except ValueError:  # a quote that closes on a later line: a SQL text, not a command to check
                continue
            command: list[str] = []
            for token in [*tokens, ";"]:
                if token in (";", "&&", "||", "|", "&"):
                    if words(command):
                        yield words(command)
                    command = []
                else:
                    command.append(token)


def words(parts: list[str]) -> list[str]:
    parts = list(parts)
    while parts and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", parts[0]):
        parts.pop(0)
    if parts:
        parts[0] = parts[0].rsplit("/", 1)[-1]
    return parts


def all_commands() -> list[list[str]]:
    return [argv for page in PAGES for argv in command_lines(page)]


@functools.cache
def fulmen_command() -> Any:
    return typer.main.get_command(app)


def check_fulmen(argv: list[str]) -> list[str]:
    """What is wrong with ``fulmen ARGV``: an unknown subcommand or options the subcommand does not have."""
    command: Any = fulmen_command()
    rest = list(argv)
    while isinstance(command, typer.core.TyperGroup) and rest and not rest[0].startswith("-"):
        found = command.get_command(None, rest[0])
        if found is None:
            return [f"no subcommand {rest[0]!r}"]
        command, rest = found, rest[1:]
    known = {name for param in command.params for name in (*param.opts, *param.secondary_opts)} | {"--help"}
    return [f"no option {w.split('=')[0]}" for w in rest if w.startswith("--") and w.split("=")[0] not in known]


def test_the_docs_have_commands_to_check() -> None:
    commands = all_commands()
    assert sum(1 for argv in commands if argv[0] == "fulmen") > 30  # the check reads the pages it means to


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_command_of_a_page_names_what_exists(page: Path) -> None:
    wrong = []
    for argv in command_lines(page):
        command = " ".join(argv)
        if argv[0] == "fulmen":
            wrong += [f"{command}: {problem}" for problem in check_fulmen(argv[1:])]
        elif argv[0].startswith("python") and len(argv) > 2 and argv[1] == "-m":
            if argv[2] not in ("pytest", "pip") and importlib.util.find_spec(argv[2]) is None:
                wrong.append(f"{command}: no module {argv[2]}")
        elif argv[0].startswith("python") and len(argv) > 1 and argv[1].endswith(".py"):
            scaffolded = argv[1] in FILES and ("fulmen init" in page.read_text() or page.name == "README.md.tmpl")
            if not scaffolded and not (ROOT / argv[1]).is_file():
                wrong.append(f"{command}: no file {argv[1]}")
    assert not wrong, "\n".join(wrong)
