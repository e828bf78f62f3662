"""Trainer backends behind one interface (:class:`TrainerBackend`): ``torch_backend`` now, verl later.

``algorithm.trainer.torch_backend`` (transformers, peft) is imported on demand, not from here.
"""

from algorithm.trainer.base import StepMetrics, TrainerBackend
from algorithm.trainer.logprobs import token_logprobs

__all__ = ["StepMetrics", "TrainerBackend", "token_logprobs"]
