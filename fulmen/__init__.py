"""Fulmen: reinforcement learning for AI agents that already exist.

The public API, for agent authors and for code that reads Fulmen's events::

    import fulmen

    fulmen.emit_reward(1.0)                    # from inside an agent run by `fulmen runner`
    fulmen.emit_annotation("retrieval", hits=3)
    async def solve(task: dict, llm: fulmen.LLMEndpoint) -> float: ...

    report = fulmen.train(agent="my_agents.solver:solve", dataset="train.jsonl", val="val.jsonl", model="tiny")
    report = fulmen.optimize_prompt(agent="my_agents.solver:solve", dataset="train.jsonl", val="val.jsonl",
                                    test="test.jsonl", optimizer_url="https://.../v1", max_rollouts=200)

Everything else lives in the subpackages, whose imports flow one way: ``fulmen.schemas`` (the contracts) <-
``fulmen.infra`` (settings, Kafka, the store) <- ``fulmen.producers`` / ``fulmen.consumers`` /
``fulmen.algorithm`` <- ``fulmen`` itself (this API and ``fulmen.cli``, the composition root).

The names below are resolved on first use, so ``import fulmen.schemas`` (which runs this file first) pulls in
nothing of the layers above it.
"""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING

from fulmen.schemas.lazy import lazy_exports

__all__ = [
    "DeadLetterHeaders",
    "ExportReport",
    "Feedback",
    "FeedbackTarget",
    "LLMEndpoint",
    "ModelPromotion",
    "ModelVersion",
    "PromotionAction",
    "PromptReport",
    "RolloutEvent",
    "RolloutMode",
    "RolloutRequest",
    "RolloutStatus",
    "TrainReport",
    "TrainStep",
    "Transition",
    "TransitionBatch",
    "__version__",
    "emit_annotation",
    "emit_reward",
    "export_model",
    "optimize_prompt",
    "train",
]

try:
    __version__ = metadata.version("fulmen")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0+unknown"

# public name -> the module that defines it
_HOMES = {
    "emit_reward": "fulmen.producers.agent_helpers",
    "emit_annotation": "fulmen.producers.agent_helpers",
    "LLMEndpoint": "fulmen.producers.runner.agent",
    "train": "fulmen.training",
    "optimize_prompt": "fulmen.prompt_optimization",
    "export_model": "fulmen.export",
    "ExportReport": "fulmen.export",
    "PromptReport": "fulmen.prompt_optimization",
    "TrainReport": "fulmen.algorithm.local",
    **dict.fromkeys(
        (
            "DeadLetterHeaders",
            "Feedback",
            "FeedbackTarget",
            "ModelPromotion",
            "ModelVersion",
            "PromotionAction",
            "RolloutEvent",
            "RolloutMode",
            "RolloutRequest",
            "RolloutStatus",
            "TrainStep",
            "Transition",
            "TransitionBatch",
        ),
        "fulmen.schemas.events",
    ),
}

if TYPE_CHECKING:
    from fulmen.algorithm.local import TrainReport
    from fulmen.export import ExportReport, export_model
    from fulmen.producers.agent_helpers import emit_annotation, emit_reward
    from fulmen.producers.runner.agent import LLMEndpoint
    from fulmen.prompt_optimization import PromptReport, optimize_prompt
    from fulmen.schemas.events import (
        DeadLetterHeaders,
        Feedback,
        FeedbackTarget,
        ModelPromotion,
        ModelVersion,
        PromotionAction,
        RolloutEvent,
        RolloutMode,
        RolloutRequest,
        RolloutStatus,
        TrainStep,
        Transition,
        TransitionBatch,
    )
    from fulmen.training import train

__getattr__, __dir__ = lazy_exports(globals(), _HOMES)
