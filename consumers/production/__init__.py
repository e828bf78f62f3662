"""Production episodes: the calls of agents that Fulmen does not run, grouped by trace into rollouts of mode
``production``.

An agent in production points its OpenAI ``base_url`` at the LLM gateway's plain ``/v1`` (no runner, no rollout id
in the path). Its calls' spans carry token ids and no rollout id. This consumer groups them by trace id, ends a
trace's episode once no span of it has arrived for ``FULMEN_PRODUCTION_IDLE_S``, and publishes the end as a
:class:`~fulmen.schemas.events.RolloutEvent` (rollout ``trace-<trace id>``); the transitions consumer builds it like
any other rollout, and feedback on the trace or on one of its calls resolves to that rollout, so replay can train on it.

``scan`` (production calls in a spans record), ``episodes`` (open episodes and the idle rule, pure), ``worker`` (the
consume loop), ``app`` (its entry in ``fulmen consume``), ``settings`` (``FULMEN_PRODUCTION_*``).
"""

from fulmen.consumers.production.app import ProductionEpisodesSink
from fulmen.consumers.production.episodes import Episode, OpenEpisodes
from fulmen.consumers.production.scan import Scan, scan_record
from fulmen.consumers.production.settings import ProductionSection
from fulmen.consumers.production.worker import ProductionStats, ProductionWorker, production_end

__all__ = [
    "Episode",
    "OpenEpisodes",
    "ProductionEpisodesSink",
    "ProductionSection",
    "ProductionStats",
    "ProductionWorker",
    "Scan",
    "production_end",
    "scan_record",
]
