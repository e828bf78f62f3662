"""The gateway's prompt bundles: follows the prompts and prompt promotions topics and says which bundle a call gets.

Both topics are followed as the models topic is (:class:`~fulmen.producers.llm_gateway.models_follower.TopicFollower`:
from the beginning, no consumer group, no commits), into one :class:`PromptRegistry` held in memory. A call whose
rollout names a bundle (``/rollout/{id}/attempt/{n}/bundle/{bundle_id}/v1``) gets that bundle; a call naming none
gets the bundle in force for its agent (``/agent/{name}``), else the global one, else nothing (its messages are
unchanged). A named bundle the registry has not seen yet may be in flight (published a moment ago): the registry waits
up to ``wait_s`` for it before the call is refused (404). A promoted bundle it has not seen is skipped (logged once):
a call that names none is never refused for a promotion.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiokafka.structs import ConsumerRecord

from fulmen.infra.settings import FulmenSettings
from fulmen.producers.llm_gateway.models_follower import TopicFollower, decode_or_skip
from fulmen.schemas import Event, TopicKey
from fulmen.schemas.errors import FulmenError
from fulmen.schemas.prompts import PromptBundle, PromptPromotion, serving_bundle

__all__ = ["BUNDLE_WAIT_S", "PromptRegistry", "UnknownBundleError", "prompt_followers"]

log = logging.getLogger(__name__)

BUNDLE_WAIT_S = 5.0
"""How long a call naming a bundle the gateway has not seen waits for it to arrive on the prompts topic."""


class UnknownBundleError(FulmenError):
    """A call names (or the promotion in force names) a bundle that did not arrive within the wait."""


class PromptRegistry:
    """The bundles and the promotions in force (latest per agent scope) a gateway knows; safe on one event loop."""

    def __init__(self, wait_s: float = BUNDLE_WAIT_S) -> None:
        self.wait_s = wait_s
        self.bundles: dict[str, PromptBundle] = {}
        self.in_force: dict[str | None, PromptPromotion] = {}  # agent scope (None: every agent) -> latest promotion
        self._arrived = asyncio.Condition()
        self._missing: set[str] = set()  # promoted bundles not seen, warned about once

    async def add_bundles(self, bundles: Sequence[PromptBundle]) -> None:
        async with self._arrived:
            for bundle in bundles:
                self.bundles[bundle.bundle_id] = bundle
            self._arrived.notify_all()

    async def add_promotions(self, promotions: Sequence[PromptPromotion]) -> None:
        for event in promotions:
            self.in_force[event.agent] = event
            scope = f"agent {event.agent}" if event.agent else "every agent"
            log.info(
                "prompt bundle in force for %s: %s (%s)",
                scope,
                event.bundle_id or "the agent's own prompts",
                event.action.value,
            )

    def serving(self, agent: str | None) -> str:
        """The bundle id a call of ``agent`` naming none gets (``""``: none)."""
        return serving_bundle(list(self.in_force.values()), agent) if self.in_force else ""

    async def resolve(self, named: str | None, agent: str | None) -> PromptBundle | None:
        """The bundle to apply to a call: the one it names, else the one in force; None when there is none (or the
        one in force has not arrived: logged once, the call goes on unchanged).

        Raises :class:`UnknownBundleError` when a named bundle does not arrive within ``wait_s``."""
        bundle_id = named or self.serving(agent)
        if not bundle_id:
            return None
        found = self.bundles.get(bundle_id)
        if found is not None:
            return found
        if not named:  # a promotion whose bundle is not here (yet): calls go on unchanged rather than fail
            if bundle_id not in self._missing:
                self._missing.add(bundle_id)
                log.warning(
                    "the promoted prompt bundle %s is not on the prompts topic; calls are served unchanged "
                    "until it arrives",
                    bundle_id,
                )
            return None
        try:
            async with asyncio.timeout(self.wait_s), self._arrived:
                await self._arrived.wait_for(lambda: bundle_id in self.bundles)
        except TimeoutError:
            how = "named by the call" if named else "promoted"
            raise UnknownBundleError(
                f"prompt bundle {bundle_id} ({how}) is not on the prompts topic (waited {self.wait_s:g}s); publish it "
                "first (`fulmen prompts create`)"
            ) from None
        return self.bundles[bundle_id]


class _RegistryFollower(TopicFollower):
    """Feeds every readable event of one topic (``key``, carrying ``event_type``) into ``feed``, batch by batch."""

    def __init__(
        self,
        settings: FulmenSettings,
        key: TopicKey,
        event_type: type[Event],
        feed: Callable[[list[Any]], Awaitable[None]],
    ) -> None:
        self.key = key
        self.what = f"{key.value} follower"
        self.event_type = event_type
        self.feed = feed
        super().__init__(settings)

    async def handle(self, records: Sequence[ConsumerRecord]) -> None:
        events = []
        for record in records:
            event = decode_or_skip(self.event_type, record)
            if event is not None:
                events.append(event)
            self._mark_read(record)
        await self.feed(events)


def prompt_followers(settings: FulmenSettings, registry: PromptRegistry) -> list[TopicFollower]:
    """The two followers that keep ``registry`` current (bundles first: a promotion names a bundle)."""
    return [
        _RegistryFollower(settings, TopicKey.PROMPTS, PromptBundle, registry.add_bundles),
        _RegistryFollower(settings, TopicKey.PROMPT_PROMOTIONS, PromptPromotion, registry.add_promotions),
    ]
