"""Help that reads as paragraphs: a command's docstring is wrapped to the terminal, not at the docstring's own line
ends, and a flag shows no type tag.

Typer's rich help keeps every line break of a docstring, so a description written at the source's width broke
mid-sentence in a wider or narrower terminal. :func:`flow_help` gives each command of an app (and of its
sub-apps) its docstring with the lines of a paragraph joined; a paragraph's list items (lines starting with
``-``, ``*`` or ``1.``) and indented lines keep their own lines. A flag (``--json``, ``--help``) takes no value,
so :func:`flow_help` also drops its ``<bool>`` tag.
"""

from __future__ import annotations

import inspect
import re

import typer
from typer.core import TyperOption

__all__ = ["flow_help", "flowed"]

_OWN_LINE = re.compile(r"(\s*([-*•]|\d+\.)\s)|(\s{2,}\S)")
_typed = TyperOption.display_type_rich


def flowed(text: str) -> str:
    """``text`` with the lines of each paragraph joined (list items and indented lines kept on their own)."""
    paragraphs = []
    for paragraph in inspect.cleandoc(text).split("\n\n"):
        lines = paragraph.split("\n")
        joined = [lines[0]]
        for line in lines[1:]:
            if _OWN_LINE.match(line):
                joined.append(line)
            else:
                joined[-1] = f"{joined[-1].rstrip()} {line.strip()}"
        paragraphs.append("\n".join(joined))
    return "\n\n".join(paragraphs)


def flow_help(app: typer.Typer) -> None:
    """Every command of ``app`` and of its sub-apps gets its docstring flowed as its help (an explicit ``help=``
    is flowed too)."""
    for command in app.registered_commands:
        text = command.help or inspect.getdoc(command.callback)
        if text:
            command.help = flowed(text)
    for group in app.registered_groups:
        if group.typer_instance is not None:
            flow_help(group.typer_instance)
    TyperOption.display_type_rich = _untyped_flags  # type: ignore[method-assign]


def _untyped_flags(self: TyperOption, ctx: typer.Context) -> str | None:
    return None if self.is_flag else _typed(self, ctx)
