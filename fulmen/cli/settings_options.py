"""Command-line options made from a settings section: the pydantic field is the one declaration of an option.

A command that runs a service (``fulmen train``, the gateways, the runner, the dashboard) takes one option per
field of its settings section: ``--group-size`` for ``TrainSection.group_size``, with the field's type (a flag
pair ``--x/--no-x`` for a bool, the choices of an enum), its description as help, and its variable and default in
that help. An option left out changes nothing: the value comes from the environment, ``.env`` or the field's
default, as without the command line. A field added to the section is an option at once, and the same field is
what a relaunched process (``fulmen train --nproc N`` under torchrun) receives, since it receives the section.

    TRAIN_OPTIONS = SectionOptions(TrainSection, "train", aliases={"model_path": "--model"})

    @with_options(TRAIN_OPTIONS)                        # the command's own parameters, then the section's
    @friendly
    def train_command(dataset: ..., **options: Any) -> None:
        settings = load_settings(TrainSettings, overrides=TRAIN_OPTIONS.overrides(options))  # over FULMEN_TRAIN_*
"""

from __future__ import annotations

import enum
import inspect
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import typer
from pydantic import BaseModel, SecretBytes, SecretStr

__all__ = ["SectionOptions", "with_options"]

F = TypeVar("F", bound=Callable[..., Any])

_PLAIN = (str, int, float, bool, Path)


@dataclass(frozen=True)
class SectionOptions:
    """The options of one settings section (``attribute`` of the command's settings class)."""

    section: type[BaseModel]
    attribute: str
    aliases: Mapping[str, str] = field(default_factory=dict)  # field -> an older, shorter option name
    panel: str | None = None  # where --help lists them (default: "Settings (FULMEN_<ATTRIBUTE>_*)")
    variables: bool = True  # False: the fields are a command's options only, no FULMEN_<ATTRIBUTE>_* sets them

    @property
    def env_prefix(self) -> str:
        return f"FULMEN_{self.attribute.upper()}_"

    @property
    def names(self) -> list[str]:
        """The fields that are options: all but secrets (a command line is visible to every user of the machine:
        a secret comes from its variable or ``.env`` only)."""
        return [name for name, info in self.section.model_fields.items() if not _secret(info.annotation)]

    @property
    def secrets(self) -> list[str]:
        return [name for name, info in self.section.model_fields.items() if _secret(info.annotation)]

    def parameters(self) -> list[inspect.Parameter]:
        """One keyword parameter per field, default None (not given), annotated for Typer."""
        panel = self.panel or (f"Settings ({self.env_prefix}*)" if self.variables else "Options")
        return [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=self._option(name, panel))
            for name in self.names
        ]

    def signature(self, command: Callable[..., Any]) -> inspect.Signature:
        """``command``'s own parameters (its ``**settings`` catch-all dropped) followed by the section's."""
        parameters = inspect.signature(command, eval_str=True).parameters.values()  # Typer reads no string here
        own = [p for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD]
        clash = {p.name for p in own} & set(self.names)
        if clash:
            raise TypeError(f"{command.__name__}'s parameters {sorted(clash)} are also {self.section.__name__} fields")
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        return inspect.Signature([*own, *self.parameters()])

    def overrides(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The options among a command's arguments that were given (not None), as the settings' init arguments
        (``{"train": {"steps": 3}}``): pydantic-settings merges them over the environment before validating, so a
        recipe an option names (``--algorithm dapo``) fills what it prescribes, as its variable would. A repeatable
        option given no time is not given."""
        given = {name: _plain(values[name]) for name in self.names if values.get(name) not in (None, [], ())}
        return {self.attribute: given} if given else {}

    def _option(self, name: str, panel: str) -> Any:
        info = self.section.model_fields[name]
        kind = _option_type(info.annotation)
        flag = "--" + name.replace("_", "-")
        declarations = [f"{flag}/--no-{flag[2:]}"] if kind is bool else [flag]
        if name in self.aliases:
            declarations.append(self.aliases[name])
        default = info.get_default(call_default_factory=False) if info.default_factory is None else None
        shown = "" if default in (None, "", ()) else f"default {_shown(default)}"
        about = (info.description or name.replace("_", " ")).rstrip(".")
        repeat = "repeat for more" if kind == list[str] else ""
        variable = f"{self.env_prefix}{name.upper()}" if self.variables else ""
        where = "; ".join(part for part in (variable, repeat, shown) if part)
        help_text = f"{about} ({where})" if where else about
        return Annotated[kind | None, typer.Option(*declarations, help=help_text, rich_help_panel=panel)]


def with_options(options: SectionOptions) -> Callable[[F], F]:
    """A command (decorated with ``friendly`` or not) that takes ``options`` besides its own parameters; its
    ``**options`` catch-all receives them."""

    def decorate(command: F) -> F:
        command.__signature__ = options.signature(inspect.unwrap(command))  # type: ignore[attr-defined]
        if options.secrets:
            variables = ", ".join(f"{options.env_prefix}{name.upper()}" for name in options.secrets)
            command.__doc__ = f"{command.__doc__ or ''}\n\nSecrets are read from their variables only: {variables}."
        return command

    return decorate


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        kinds = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(kinds) == 1:
            return kinds[0]
    return annotation


def _secret(annotation: Any) -> bool:
    return _without_none(annotation) in (SecretStr, SecretBytes)


def _option_type(annotation: Any) -> type:
    """The type Typer parses an option as: the annotation without its None (``int | None`` -> int), a
    ``Literal`` of strings as the choices of an enum, a tuple or list of strings as a repeatable option."""
    annotation = _without_none(annotation)
    if get_origin(annotation) in (list, tuple) and set(get_args(annotation)) <= {str, Ellipsis}:
        return list[str]  # type: ignore[return-value]
    if get_origin(annotation) is Literal and all(isinstance(arg, str) for arg in get_args(annotation)):
        return enum.Enum("Choice", {value: value for value in get_args(annotation)}, type=str)  # type: ignore[return-value]
    if isinstance(annotation, type) and (issubclass(annotation, enum.Enum) or annotation in _PLAIN):
        return annotation
    raise TypeError(f"no command-line option for a field of type {annotation!r}")


def _plain(value: Any) -> Any:
    """A parsed option as the settings take it (an enum's value: a ``Literal`` field wants the string)."""
    return value.value if isinstance(value, enum.Enum) else value


def _shown(value: Any) -> str:
    if isinstance(value, tuple | list):
        return " ".join(_shown(item) for item in value)
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
