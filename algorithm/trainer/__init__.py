"""Trainer backends behind one interface (:class:`TrainerBackend`); one exists, ``torch_backend``.

``torch_backend`` trains a Hugging Face causal LM in one process, on the CPU or one GPU, with optional LoRA.
There is no verl backend (nor FSDP sharding): verl is used only as the reference the advantages and losses
are checked against (``tests/unit/test_verl_parity.py``, with the optional ``gpu`` extra).

``fulmen.algorithm.trainer.torch_backend`` (transformers, peft) is imported on demand, not from here.
"""

from fulmen.algorithm.trainer.base import StepMetrics, TrainerBackend
from fulmen.algorithm.trainer.logprobs import token_logprobs

__all__ = ["StepMetrics", "TrainerBackend", "token_logprobs"]
