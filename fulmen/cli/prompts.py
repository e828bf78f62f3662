"""``fulmen prompts scan | list | show ID | create | promote ID | rollback``: the prompts agents send, the stored
prompt bundles, publishing one by hand, and which one serves the calls that name none.

``create``, ``promote`` and ``rollback`` publish events (:mod:`fulmen.algorithm.prompts.bundles`), acknowledged by Kafka
before they return; every LLM gateway follows them. ``scan``, ``list`` and ``show`` read the store
(:mod:`fulmen.prompt_queries`), filled by ``fulmen consume``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from fulmen.cli.base import console, friendly, load_settings
from fulmen.schemas.events import PromotionAction

__all__ = ["prompts_app"]

prompts_app = typer.Typer(no_args_is_help=True, help="Prompt bundles: scan, list, show, create, promote, roll back.")

_AGENT = typer.Option(help="the agent scope (its name in /agent/{name}); default: every agent")


def _short(text: str, width: int = 70) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


@prompts_app.command("scan")
@friendly
def prompts_scan(
    role: Annotated[list[str] | None, typer.Option(help="roles to list (repeat); default system and user")] = None,
    limit: Annotated[int, typer.Option(help="at most this many prompts", min=1)] = 20,
    min_calls: Annotated[int, typer.Option(help="only prompts sent by at least this many calls", min=1)] = 1,
) -> None:
    """The prompts agents already send (from the stored LLM spans), each with the slot name that replaces it."""
    from fulmen.infra.store import open_reader
    from fulmen.prompt_queries import scan_prompts

    settings = load_settings()
    prompts = scan_prompts(open_reader(settings), settings.clickhouse.database, tuple(role or ("system", "user")))
    shown = [p for p in prompts if p.calls >= min_calls][:limit]
    if not shown:
        console.print("no prompts in the stored spans yet (calls through the LLM gateway, with `fulmen consume` on)")
        return
    table = Table("slot", "role", "calls", "agents", "text")
    for p in shown:
        table.add_row(p.slot, p.role, str(p.calls), ", ".join(p.agents) or "-", _short(p.text))
    console.print(table)
    console.print("replace one with: fulmen prompts create --slot SLOT='new text'")


@prompts_app.command("list")
@friendly
def prompts_list() -> None:
    """Every stored bundle: its parents, source, mean score over the tasks that chose it, and where it serves (*)."""
    from fulmen.infra.store import open_reader
    from fulmen.prompt_queries import bundle_rows, serving_by_scope

    settings = load_settings()
    reader = open_reader(settings)
    rows = bundle_rows(reader, settings.clickhouse.database)
    if not rows:
        console.print("no prompt bundle is stored yet (`fulmen prompts create`, `fulmen optimize-prompt`)")
        return
    serving: dict[str, list[str]] = {}
    for scope, bundle in serving_by_scope(reader, settings.clickhouse.database).items():
        serving.setdefault(bundle, []).append(scope or "every agent")
    table = Table("", "bundle", "parents", "source", "run", "agent", "slots", "score", "tasks")
    for row in rows:
        score = "-" if row.mean is None else f"{row.mean:.3f}"
        where = serving.get(row.bundle_id)
        table.add_row(
            "*" if where else "",
            row.bundle_id,
            ", ".join(row.parents) or "-",
            row.source,
            row.run_id or "-",
            row.agent or "any",
            str(len(row.slots)),
            score,
            str(len(row.scores)),
        )
    console.print(table)
    for bundle, scopes in serving.items():
        console.print(f"serving {bundle or 'the agents own prompts'} for {', '.join(scopes)}")


@prompts_app.command("show")
@friendly
def prompts_show(bundle_id: Annotated[str, typer.Argument(help="the bundle (pb-...)")]) -> None:
    """One stored bundle in full: its slots' texts, templates, lineage and scores."""
    from fulmen.infra.store import open_reader
    from fulmen.prompt_queries import bundle_rows
    from fulmen.schemas.errors import ConfigurationError

    settings = load_settings()
    rows = bundle_rows(open_reader(settings), settings.clickhouse.database, bundle_id)
    if not rows:
        raise ConfigurationError(f"no stored bundle {bundle_id} (`fulmen prompts list` shows them)")
    row = rows[-1]
    parents = ", ".join(row.parents) or "-"
    console.print(
        f"[bold]{row.bundle_id}[/bold]  source {row.source}  run {row.run_id or '-'}  agent "
        f"{row.agent or 'any'}  parents {parents}  created {row.created_at}"
    )
    for slot, text in sorted(row.slots.items()):
        console.print(f"\n[bold]{slot}[/bold]", highlight=False)
        if slot.startswith("tpl:"):
            console.print(f"(original template) {row.templates.get(slot[4:], '')}", highlight=False, markup=False)
        console.print(text, highlight=False, markup=False)
    if row.scores:
        console.print("\nscores: " + ", ".join(f"{task}={score:.3f}" for task, score in sorted(row.scores.items())))


def _pairs(values: list[str] | None, option: str) -> dict[str, str]:
    from fulmen.schemas.errors import ConfigurationError

    found = {}
    for value in values or []:
        name, sep, text = value.partition("=")
        if not sep or not name.strip():
            raise ConfigurationError(f"{option} takes NAME=TEXT, not {value!r}")
        found[name.strip()] = text
    return found


@prompts_app.command("create")
@friendly
def prompts_create(
    slot: Annotated[list[str] | None, typer.Option(help="SLOT=TEXT (repeat): fp-... from `scan`, or tpl:NAME")] = None,
    template: Annotated[list[str] | None, typer.Option(help="NAME=ORIGINAL TEMPLATE for each tpl:NAME slot")] = None,
    file: Annotated[Path | None, typer.Option(help='a JSON file: {"slots": {...}, "templates": {...}}')] = None,
    parent: Annotated[list[str] | None, typer.Option(help="the bundle(s) this one derives from")] = None,
    agent: Annotated[str | None, _AGENT] = None,
) -> None:
    """Publish a bundle written by hand; prints its id (the same texts always give the same id)."""
    from fulmen.algorithm.prompts.bundles import publish_bundles
    from fulmen.infra.services import ensure_kafka
    from fulmen.schemas.errors import ConfigurationError
    from fulmen.schemas.prompts import PromptBundle

    slots, templates = _pairs(slot, "--slot"), _pairs(template, "--template")
    if file is not None:
        data = json.loads(file.read_text())
        slots, templates = {**data.get("slots", {}), **slots}, {**data.get("templates", {}), **templates}
    if not slots:
        raise ConfigurationError("name at least one slot: --slot SLOT=TEXT or --file bundle.json")
    try:
        bundle = PromptBundle.create(slots, templates=templates, parents=parent or (), agent=agent)
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None
    settings = load_settings()
    ensure_kafka(settings, start=False)
    asyncio.run(publish_bundles(settings, [bundle]))
    console.print(f"published {bundle.bundle_id} ({len(bundle.slots)} slot(s))")


def _decide(action: PromotionAction, bundle_id: str | None, agent: str | None, reason: str) -> str:
    from fulmen.algorithm.prompts.bundles import decide_prompt
    from fulmen.infra.services import ensure_kafka

    settings = load_settings()
    ensure_kafka(settings, start=False)
    event = asyncio.run(decide_prompt(settings, action, bundle_id, agent, reason))
    return event.bundle_id or "the agents' own prompts"


@prompts_app.command("promote")
@friendly
def prompts_promote(
    bundle_id: Annotated[str, typer.Argument(help="the bundle to serve (pb-...)")],
    agent: Annotated[str | None, _AGENT] = None,
    reason: Annotated[str, typer.Option(help="why, kept with the decision")] = "promoted by hand",
) -> None:
    """Serve BUNDLE_ID to the calls that name no bundle (of one agent, or of every agent)."""
    served = _decide(PromotionAction.PROMOTE, bundle_id, agent, reason)
    console.print(f"promoted {served} for {agent or 'every agent'}")


@prompts_app.command("rollback")
@friendly
def prompts_rollback(
    agent: Annotated[str | None, _AGENT] = None,
    reason: Annotated[str, typer.Option(help="why, kept with the decision")] = "rolled back by hand",
) -> None:
    """Serve again what served before the bundle in force (the agents' own prompts when nothing else did)."""
    served = _decide(PromotionAction.ROLLBACK, None, agent, reason)
    console.print(f"rolled {agent or 'every agent'} back to {served}")
