"""The transitions consumer: finished rollouts → per-call transitions with the rewards observed (LightningRL).

Credit is not assigned here: the run that trains chooses it (``FULMEN_TRAIN_CREDIT``, ``fulmen.algorithm.credit``)
from the episode reward and the per-call intermediate rewards each batch carries.

``tree`` (trace tree, repaired), ``selection`` (LLM calls, agents), ``rewards`` (intermediate rewards matched
to calls), ``builder`` (rollout → TransitionBatch, pure), ``reader`` (spans from the store), ``barrier`` (wait
for the spans consumer), ``window`` (commits, attempts, what is watched), ``late`` (late spans), ``worker`` (the
consume loop), ``app`` (its entry in ``fulmen consume``), ``settings`` (``FULMEN_TRANSITIONS_*``).
"""

from fulmen.consumers.transitions.app import TransitionBuilderSink
from fulmen.consumers.transitions.builder import BuildOptions, BuildResult, build_batch
from fulmen.consumers.transitions.settings import ConsumersSettings, TransitionsSection
from fulmen.consumers.transitions.tree import SpanRecord, TraceTree
from fulmen.consumers.transitions.worker import TransitionStats, TransitionWorker

__all__ = [
    "BuildOptions",
    "BuildResult",
    "ConsumersSettings",
    "SpanRecord",
    "TraceTree",
    "TransitionBuilderSink",
    "TransitionStats",
    "TransitionWorker",
    "TransitionsSection",
    "build_batch",
]
