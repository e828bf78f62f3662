"""``fulmen models list | promote VERSION | rollback``: which version serves, each version's score (the store,
:mod:`fulmen.versions`), and deciding by hand.

``promote`` and ``rollback`` publish a ``ModelPromotion`` on the promotions topic
(:mod:`fulmen.algorithm.service.promotion`), read first to its end: that topic, not the store, says what serves; the
gateways that follow promotions (``FULMEN_LLM_FOLLOW=promoted``) load the version in force without failing a call.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from fulmen.cli.base import console, friendly, load_settings
from fulmen.schemas.events import PromotionAction

if TYPE_CHECKING:
    from fulmen.infra.settings import FulmenSettings
    from fulmen.schemas.events import ModelPromotion, ModelVersion

__all__ = ["decide_by_hand", "models_app"]

models_app = typer.Typer(no_args_is_help=True, help="Model versions: which serves, their scores, promote, roll back.")


def decide_by_hand(
    settings: FulmenSettings,
    model_name: str,
    action: PromotionAction,
    version: int | None,
    run_id: str | None,
    reason: str,
) -> ModelPromotion:
    """Publish a promote (``version``, of run ``run_id`` when two runs have it) or a rollback (to the version that
    served before the one in force); the event, once Kafka acknowledged it."""
    from fulmen.algorithm.service.promotion import MODELS_SENDER, in_force, manual, previous_promoted
    from fulmen.infra.kafka.broker import kafka_broker
    from fulmen.infra.kafka.clients import close_quietly, start_or_raise
    from fulmen.infra.kafka.publish import EventPublisher
    from fulmen.infra.kafka.read_all import read_to_end
    from fulmen.infra.services import ensure_kafka
    from fulmen.schemas.events import ModelPromotion, ModelVersion
    from fulmen.schemas.topics import TopicKey

    ensure_kafka(settings, start=False)

    async def decide() -> ModelPromotion:
        promotions = await read_to_end(settings, TopicKey.PROMOTIONS, ModelPromotion)
        current = in_force(promotions, model_name)
        if action is PromotionAction.ROLLBACK:
            target = previous_promoted(promotions, model_name).model
        else:
            assert version is not None
            known = [p.model for p in promotions] + await read_to_end(settings, TopicKey.MODELS, ModelVersion)
            target = _the_version(known, model_name, version, run_id)
        event = manual(action, target, current, reason)
        broker = kafka_broker(settings)
        try:
            await start_or_raise(broker, settings, "fulmen models")
            await EventPublisher(broker, MODELS_SENDER).publish(TopicKey.PROMOTIONS, event)
        finally:
            await close_quietly([broker])
        return event

    return asyncio.run(decide())


def _the_version(known: list[ModelVersion], model_name: str, version: int, run_id: str | None) -> ModelVersion:
    from fulmen.schemas.errors import ConfigurationError

    found = {
        (m.run_id, m.version): m
        for m in known
        if m.model_name == model_name
        and not m.adapter
        and m.version == version
        and (run_id is None or m.run_id == run_id)
    }
    if not found:
        where = f" of run {run_id}" if run_id else ""
        raise ConfigurationError(
            f"no version {version}{where} of {model_name} on the models or promotions topics "
            "(`fulmen models list` shows the stored ones)"
        )
    if len(found) > 1:
        runs = ", ".join(sorted(run for run, _ in found))
        raise ConfigurationError(
            f"version {version} of {model_name} exists in several runs ({runs}): say which with --run"
        )
    return next(iter(found.values()))


@models_app.command("list")
@friendly
def models_list(
    model: Annotated[str, typer.Option(help="the model's name (FULMEN_TRAIN_MODEL_NAME's)")] = "fulmen",
) -> None:
    """Every stored version of the model: its run, parent, held-out score, the promotion decision, and which serves
    (*) the gateways that follow promotions."""
    from fulmen.infra.store import open_reader
    from fulmen.versions import version_rows

    settings = load_settings()
    rows = version_rows(open_reader(settings), model, settings.clickhouse.database)
    if not rows:
        console.print(f"no version of {model} is stored yet")
        return
    table = Table("", "version", "run", "parent", "held-out", "decision", "gain vs serving (points)", "checkpoint")
    for row in rows:
        score = "-" if row.score is None else f"{row.score:.3f}"
        table.add_row(
            "*" if row.serving else "",
            str(row.version),
            row.run_id,
            row.parent,
            score,
            row.decision,
            row.test,
            row.uri,
        )
    console.print(table)
    if not any(row.serving for row in rows):
        console.print("nothing promoted: gateways that follow promotions serve the model they started with")


@models_app.command("promote")
@friendly
def models_promote(
    version: Annotated[int, typer.Argument(help="the version to serve", min=0)],
    run: Annotated[str | None, typer.Option(help="the run it comes from, when several runs have this version")] = None,
    model: Annotated[str, typer.Option(help="the model's name")] = "fulmen",
    reason: Annotated[str, typer.Option(help="why, kept with the decision")] = "promoted by hand",
) -> None:
    """Serve VERSION from now on (gateways with FULMEN_LLM_FOLLOW=promoted load it)."""

    event = decide_by_hand(load_settings(), model, PromotionAction.PROMOTE, version, run, reason)
    console.print(f"promoted {model} version {event.model.version} (run {event.model.run_id or '-'})")


@models_app.command("rollback")
@friendly
def models_rollback(
    model: Annotated[str, typer.Option(help="the model's name")] = "fulmen",
    reason: Annotated[str, typer.Option(help="why, kept with the decision")] = "rolled back by hand",
) -> None:
    """Serve again the version that served before the one in force (an event like any other)."""

    event = decide_by_hand(load_settings(), model, PromotionAction.ROLLBACK, None, None, reason)
    console.print(f"rolled {model} back to version {event.model.version} (run {event.model.run_id or '-'})")
