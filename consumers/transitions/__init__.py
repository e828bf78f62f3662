"""The transitions consumer: finished rollouts → per-call transitions with the rewards observed (LightningRL).

Credit is not assigned here: the run that trains chooses it (``FULMEN_TRAIN_CREDIT``, ``fulmen.algorithm.rl.credit``)
from the episode reward and the per-call intermediate rewards each batch carries.

``tree`` (trace tree, repaired), ``selection`` (LLM calls, agents), ``rewards`` (intermediate rewards matched
to calls), ``builder`` (rollout → TransitionBatch, pure), ``reader`` (spans from the store), ``feed`` (spans from
the spans consumer of the same process, so most rollouts are not read back), ``window`` (commits,
attempts, what is watched), ``late`` (late spans), ``worker`` (what is its own of the consume loop: the rest is
``fulmen.consumers.tracked``; it waits for the spans consumer with ``fulmen.consumers.barrier``), ``app`` (its
entry in ``fulmen consume``), ``settings`` (``FULMEN_TRANSITIONS_*``).
"""

from fulmen.consumers.transitions.app import TransitionBuilderSink
from fulmen.consumers.transitions.builder import BuildOptions, BuildResult, build_batch
from fulmen.consumers.transitions.settings import TransitionsSection
from fulmen.consumers.transitions.tree import SpanRecord, TraceTree
from fulmen.consumers.transitions.worker import TransitionStats, TransitionWorker

__all__ = [
    "BuildOptions",
    "BuildResult",
    "SpanRecord",
    "TraceTree",
    "TransitionBuilderSink",
    "TransitionStats",
    "TransitionWorker",
    "TransitionsSection",
    "build_batch",
]
