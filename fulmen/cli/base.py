"""What every ``fulmen`` command shares: the consoles, loading the settings (and logging), and the decorator that
turns a Fulmen error into one readable line and exit code 1."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import wraps
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from fulmen.infra.logging import setup_logging
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas.errors import FulmenError

__all__ = ["UtcOption", "WideOption", "console", "err", "friendly", "load_settings", "read_query"]

console = Console()
err = Console(stderr=True)
F = TypeVar("F", bound=Callable[..., Any])
# The options of every command that prints a table (fulmen/cli/render.py; FULMEN_CLI_* set their defaults).
WideOption = Annotated[
    bool,
    typer.Option(
        "--wide", help="print every value whole: full ids, times to the microsecond (FULMEN_CLI_WIDE=true: always)"
    ),
]
UtcOption = Annotated[bool, typer.Option("--utc", help="times in UTC (otherwise FULMEN_CLI_TIMEZONE, default local)")]


S = TypeVar("S", bound=FulmenSettings)


def load_settings(
    cls: type[S] = FulmenSettings,  # type: ignore[assignment]
    *,
    service: bool = False,
    overrides: dict[str, Any] | None = None,
) -> S:
    """Load settings and set up logging: INFO for long-running services, WARNING for one-shot commands
    (their output is the answer), unless FULMEN_LOG_LEVEL says otherwise. ``overrides``: the command's options
    (``fulmen.cli.settings_options``), merged over the environment and ``.env``."""
    try:
        settings = cls(**(overrides or {}))
    except Exception as exc:  # pydantic ValidationError: name the variable to fix
        where = (
            "options, FULMEN_* environment variables or .env" if overrides else "FULMEN_* environment variables or .env"
        )
        raise FulmenError(f"invalid settings ({where}): {exc}") from exc
    log_settings = settings.log
    if not service and "log" not in settings.model_fields_set and not _log_level_in_env():
        log_settings = log_settings.model_copy(update={"level": "WARNING"})
    setup_logging(log_settings)
    return settings


def _log_level_in_env() -> bool:
    return any(name.upper() == "FULMEN_LOG_LEVEL" for name in os.environ)


def friendly(fn: F) -> F:
    """Print Fulmen errors as one readable message and exit 1, instead of a traceback."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FulmenError as exc:
            # the message is text, not markup: a "[/path/file.cc:545]" in it (gloo's errors) made rich fail
            err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, markup=True, soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def read_query(reader: Any, sql: str, parameters: dict[str, Any] | None = None, *, final: bool = True) -> Any:
    """A read-only query (``%(name)s`` placeholders bound from ``parameters``) whose engine error becomes one
    readable message."""
    try:
        return reader.query(sql, parameters or None, final=final, read_only=True)
    except FulmenError:
        raise
    except Exception as exc:
        raise FulmenError(f"query failed: {exc}") from exc
