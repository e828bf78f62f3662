"""Trainer backends behind one interface (:class:`TrainerBackend`): ``torch_backend`` now, verl later.

``fulmen.algorithm.trainer.torch_backend`` (transformers, peft) is imported on demand, not from here.
"""

from fulmen.algorithm.trainer.base import StepMetrics, TrainerBackend
from fulmen.algorithm.trainer.logprobs import token_logprobs

__all__ = ["StepMetrics", "TrainerBackend", "token_logprobs"]
