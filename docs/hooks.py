"""mkdocs hook: the Reference pages, generated at build time from the code, never kept by hand.

``on_files`` adds four pages and one file to the site (they exist only in the build):

* ``reference/cli.md``: every ``fulmen`` command, from the Typer app (``fulmen.cli.main.app``): its usage, its help
  and each option's help as ``--help`` prints them;
* ``reference/settings.md``: every ``FULMEN_*`` variable, from the pydantic settings classes each process loads
  (the shared sections of ``fulmen.infra.settings`` and every component's own section);
* ``reference/events.md``: every event on a topic, from its pydantic model (``fulmen.schemas``), with the topic
  that carries it and its JSON Schema;
* ``reference/asyncapi.md`` and ``reference/asyncapi.json``: the AsyncAPI 3.0 document ``fulmen schemas export``
  writes (``fulmen.asyncapi``), for a deployment with the default settings.

A command, a setting or an event added to the code shows up in the next build; ``mkdocs build --strict`` fails on a
link to a page that does not exist.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mkdocs.structure.files import File, Files

GENERATED = ("reference/cli.md", "reference/settings.md", "reference/events.md", "reference/asyncapi.md")


def on_files(files: Files, config: Any) -> Files:
    # The defaults shown must be the code's, not this machine's: no FULMEN_* variable or .env file is read.
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("FULMEN_")}
    try:
        pages = {
            "reference/cli.md": cli_page(),
            "reference/settings.md": settings_page(),
            "reference/events.md": events_page(),
            "reference/asyncapi.md": asyncapi_page(),
        }
        document = asyncapi_json()
    finally:
        os.environ.update(saved)
    for uri, text in pages.items():
        files.append(File.generated(config, uri, content=text))
    files.append(File.generated(config, "reference/asyncapi.json", content=document))
    return files


def _cell(text: object) -> str:
    """``text`` fit for one Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


# --- the command line ----------------------------------------------------------------------------------------
def cli_page() -> str:
    import click
    import typer

    from fulmen.cli.main import app

    root = typer.main.get_command(app)
    lines = [
        "# Command line",
        "",
        "Every `fulmen` command and option, generated from the Typer app (`fulmen/cli/main.py`) when the site is "
        "built: what `fulmen COMMAND --help` prints.",
        "",
    ]
    ctx = click.Context(root, info_name="fulmen")
    for name, command in sorted(_commands(root, ctx)):
        lines += _command_section(name, command)
    return "\n".join(lines) + "\n"


def _commands(group: Any, ctx: Any, prefix: str = "fulmen") -> list[tuple[str, Any]]:
    import click

    found: list[tuple[str, Any]] = []
    for name, command in group.commands.items():
        if command.hidden:
            continue
        full = f"{prefix} {name}"
        if hasattr(command, "commands"):  # a sub-app (Typer's groups are not click.Group subclasses)
            found += _commands(command, click.Context(command, info_name=name, parent=ctx), full)
        else:
            found.append((full, command))
    return found


def _command_section(name: str, command: Any) -> list[str]:
    import click

    ctx = click.Context(command, info_name=name)
    usage = " ".join([name, *command.collect_usage_pieces(ctx)])
    lines = [f"## `{name}`", "", "```", usage, "```", "", (command.help or "").strip(), ""]
    rows = []
    for param in command.params:
        record = param.get_help_record(ctx)
        if record is None:
            if param.param_type_name == "argument":
                rows.append((param.human_readable_name, "argument"))
            continue
        rows.append(record)
    if rows:
        lines += ["| option | meaning |", "|---|---|"]
        lines += [f"| `{_cell(opts)}` | {_cell(meaning)} |" for opts, meaning in rows]
        lines.append("")
    return lines


# --- settings ------------------------------------------------------------------------------------------------
def settings_page() -> str:
    from pydantic import BaseModel

    from fulmen.algorithm.settings import TrainSettings
    from fulmen.consumers.settings import ConsumersSettings
    from fulmen.infra.settings import CliProcessSettings, DashboardProcessSettings, FulmenSettings
    from fulmen.producers.llm_gateway.settings import LlmGatewaySettings
    from fulmen.producers.otlp_gateway.settings import OtlpGatewaySettings
    from fulmen.producers.runner.settings import RunnerSettings

    processes = [
        (FulmenSettings, "every process"),
        (RunnerSettings, "`fulmen runner`"),
        (OtlpGatewaySettings, "`fulmen otlp-gateway`"),
        (LlmGatewaySettings, "`fulmen llm-gateway`"),
        (ConsumersSettings, "`fulmen consume`"),
        (TrainSettings, "`fulmen train`"),
        (DashboardProcessSettings, "`fulmen dashboard`"),
        (CliProcessSettings, "`fulmen sql`, `fulmen rollouts`, `fulmen status`"),
    ]
    lines = [
        "# Settings",
        "",
        "Every setting, generated from the pydantic settings classes when the site is built. Each is an "
        "environment variable `FULMEN_<SECTION>_<FIELD>` (or a line of a `.env` file in the working directory); "
        "`fulmen config show` prints those in force, secrets masked. A process reads the shared sections and its "
        "own.",
        "",
    ]
    seen: set[str] = set()
    for cls, who in processes:
        for name, field in cls.model_fields.items():
            section = field.annotation
            if name in seen:
                continue
            seen.add(name)
            if isinstance(section, type) and issubclass(section, BaseModel):
                lines += _section(f"FULMEN_{name.upper()}_", section, who)
            else:
                lines += [
                    f"## `FULMEN_{name.upper()}` ({who})",
                    "",
                    _cell(field.description or ""),
                    "",
                ]
    from fulmen.algorithm.prompts.reflect import API_KEY_ENV

    lines += [
        f"## `{API_KEY_ENV}` (`fulmen optimize-prompt`)",
        "",
        "the key of the optimiser LLM at `--optimizer-url`, sent as a bearer token (a secret: read from the "
        "environment only, never printed)",
        "",
    ]
    return "\n".join(lines) + "\n"


def _section(prefix: str, section: Any, who: str) -> list[str]:
    doc = " ".join((section.__doc__ or "").split())
    lines = [f"## `{prefix}*` ({who})", "", doc, "", "| variable | type | default | meaning |", "|---|---|---|---|"]
    for name, field in section.model_fields.items():
        lines.append(
            f"| `{prefix}{name.upper()}` | {_cell(_type_name(field.annotation))} | {_cell(_default(field))} | "
            f"{_cell(field.description or '')} |"
        )
    return [*lines, ""]


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation)
    for noise in ("typing.", "pathlib.", "pydantic.types.", "fulmen.", "<class '", "'>"):
        text = text.replace(noise, "")
    return f"`{text}`"


def _default(field: Any) -> str:
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:  # a factory that takes the validated data
            return "derived"
        if value != field.default_factory():  # a run id: the page must not change between builds
            return "a new one each time"
    else:
        value = field.default
    if value is None:
        return "unset"
    if hasattr(value, "get_secret_value"):
        return "unset" if not value.get_secret_value() else "***"
    if hasattr(value, "value") and not isinstance(value, (int, float, str)):
        value = value.value
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str) and value.startswith(os.path.expanduser("~")):
        value = "~" + value[len(os.path.expanduser("~")) :]
    return f"`{value!s}`" if value != "" else "empty"


# --- events --------------------------------------------------------------------------------------------------
def events_page() -> str:
    from fulmen.schemas.export import json_schemas
    from fulmen.schemas.topics import TOPICS

    carried = {t.value.__name__: t for t in TOPICS.values() if t.value is not None}
    lines = [
        "# Event contracts",
        "",
        "The topics and every event Fulmen's components exchange, generated from `fulmen.schemas` (the topic "
        "registry and the pydantic models) when the site is built: the same JSON Schemas `fulmen schemas export` "
        "writes. Each event carries `schema_version`. Topic names take `FULMEN_KAFKA_TOPIC_PREFIX` in front.",
        "",
        "## Topics",
        "",
        "| topic | key | value | partitions | written by | read by | what |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in TOPICS.values():
        value = f"`{t.value.__name__}` ({t.value_format})" if t.value is not None else t.value_format
        lines.append(
            f"| `{t.name}` | `{t.record_key}` | {value} | {t.partitions} | "
            f"{_cell(', '.join(t.producers))} | {_cell(', '.join(t.consumers))} | {_cell(t.description)} |"
        )
    lines.append("")
    for name, schema in sorted(json_schemas().items()):
        lines += [f"## `{name}`", ""]
        t = carried.get(name)
        if t is not None:
            lines += [f"On the topic `{t.name}`, keyed by `{t.record_key}`.", ""]
        if schema.get("description"):
            lines += [" ".join(schema["description"].split()), ""]
        lines += ["| field | type | meaning |", "|---|---|---|"]
        required = set(schema.get("required", []))
        for field, prop in schema.get("properties", {}).items():
            mark = "" if field in required else " (optional)"
            lines.append(f"| `{field}`{mark} | {_cell(_json_type(prop))} | {_cell(prop.get('description', ''))} |")
        lines += [
            "",
            f'??? note "JSON Schema of {name}"',
            "",
            "    ```json",
            *("    " + line for line in json.dumps(schema, indent=2).splitlines()),
            "    ```",
            "",
        ]
    return "\n".join(lines) + "\n"


def _json_type(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in prop:
        return " or ".join(_json_type(p) for p in prop["anyOf"])
    if prop.get("type") == "array":
        return f"array of {_json_type(prop.get('items', {}))}"
    if "enum" in prop:
        return " / ".join(repr(v) for v in prop["enum"])
    return str(prop.get("type", "any"))


# --- AsyncAPI ------------------------------------------------------------------------------------------------
def asyncapi_json() -> str:
    from fulmen.asyncapi import asyncapi_document
    from fulmen.infra.settings import FulmenSettings

    return json.dumps(asyncapi_document(FulmenSettings()), indent=2) + "\n"


def asyncapi_page() -> str:
    document = json.loads(asyncapi_json())
    lines = [
        "# AsyncAPI",
        "",
        "The AsyncAPI 3.0 document of Fulmen's topics, generated when the site is built by the code that "
        "`fulmen schemas export` runs (`fulmen/asyncapi.py`: faststream's document of the publishers and "
        "subscribers the components declare, one channel per topic), for a deployment with the default settings "
        "(no topic prefix, the local broker). Download it: [asyncapi.json](asyncapi.json); "
        "`fulmen schemas export` writes the one of your deployment.",
        "",
        "| channel (topic) | description | operations |",
        "|---|---|---|",
    ]
    operations: dict[str, list[str]] = {}
    for op_name, op in document.get("operations", {}).items():
        ref = op.get("channel", {}).get("$ref", "")
        operations.setdefault(ref.rsplit("/", 1)[-1], []).append(op_name)
    for name, channel in document.get("channels", {}).items():
        ops = ", ".join(f"`{o}`" for o in sorted(operations.get(name, [])))
        lines.append(f"| `{channel.get('address', name)}` | {_cell(channel.get('description', ''))} | {ops} |")
    return "\n".join(lines) + "\n"
