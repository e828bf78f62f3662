"""Trainer backends behind one interface (:class:`TrainerBackend`), chosen by ``FULMEN_TRAIN_BACKEND``.

- ``torch_backend``: a Hugging Face causal LM in one process, on the CPU or one GPU, with optional LoRA;
- ``distributed``: the same, sharded with FSDP2 over the ranks of a torchrun job (``fulmen train --nproc N``):
  rank 0 keeps the Kafka side, the other ranks train their shards;
- ``verl_backend``: verl's own FSDP engine and PPO loss fed the same samples (one process; needs verl).

Those modules (transformers, peft, verl) are imported on demand, not from here.
"""

from fulmen.algorithm.trainer.base import StepMetrics, TrainerBackend
from fulmen.algorithm.trainer.logprobs import token_logprobs

__all__ = ["StepMetrics", "TrainerBackend", "token_logprobs"]
