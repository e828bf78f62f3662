"""The trainer's Prometheus metrics, observed from each step's :class:`~fulmen.schemas.events.TrainStep` (the same
event the run's report, the store and the dashboard get), served on ``FULMEN_METRICS_PORT`` by ``fulmen train``.

One trainer process runs one run, so no metric carries the run id: a scrape target is a run.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram

from fulmen.schemas.events import TrainStep

__all__ = ["observe_step"]

STEPS = Counter("fulmen_train_steps_total", "policy updates done (each publishes a model version)")
PHASE_SECONDS = Histogram(
    "fulmen_train_step_phase_seconds",
    "time of a step's phases: generation (waiting for its rollouts), update (the policy update), publish",
    ["phase"],
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
)
TOKENS = Counter("fulmen_train_tokens_total", "tokens the updates trained on (non-padding, prompts included)")
TRANSITIONS = Counter("fulmen_train_transitions_total", "transitions (LLM calls) the updates trained on")
REWARD = Gauge("fulmen_train_reward_mean", "mean reward of the last step's rollouts")
HELDOUT = Gauge(
    "fulmen_train_heldout_accuracy", "the last held-out accuracy measured (share of validation tasks solved)"
)
VERSION = Gauge("fulmen_train_model_version", "the last model version published")
PUBLISHED_AT = Gauge("fulmen_train_last_publish_timestamp_seconds", "when the last model version was published (Unix)")
PROMOTIONS = Counter("fulmen_train_promotions_total", "promotion gate decisions, by decision", ["decision"])


def observe_step(event: TrainStep) -> None:
    """Count and time one step from its event."""
    STEPS.inc()
    for phase, seconds in (
        ("generation", event.rollout_wait_s),
        ("update", event.train_s),
        ("publish", event.publish_s),
    ):
        PHASE_SECONDS.labels(phase).observe(seconds)
    TOKENS.inc(event.extra.get("input_tokens", 0.0))
    TRANSITIONS.inc(event.num_transitions)
    REWARD.set(event.reward_mean)
    accuracy = event.extra.get("val_accuracy")
    if accuracy is not None:
        HELDOUT.set(accuracy)
    VERSION.set(event.model_version)
    PUBLISHED_AT.set(time.time())
    promoted = event.extra.get("promoted")
    if promoted is not None:
        PROMOTIONS.labels("promote" if promoted else "refuse").inc()
