"""The interface every trainer backend implements (torch in one process, torch sharded over ranks with FSDP2,
verl), and one step's metrics.

Lifecycle of a backend: build it from its config (loads the model, optimizer and, with ``kl_coef > 0``, the
reference policy); optionally warm it up with :meth:`TrainerBackend.sft_step`; then for each batch of samples
call :meth:`TrainerBackend.step` (one GRPO/PPO update, possibly several epochs over the batch) and
:meth:`TrainerBackend.save` (a checkpoint the LLM gateway can load as a new model version). A save is atomic:
a process killed during it leaves no directory at the checkpoint's path (:func:`atomic_directory`).

Errors: ``ConfigurationError`` from the constructor for a bad setting (the message says what to set);
``PoisonInputError`` from ``step``/``sft_step`` for a sample that can never be trained on (too long, empty);
``ValueError`` for tensors of the wrong shape (a bug in the caller).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from fulmen.algorithm.batch import Sample, TrainBatch

__all__ = ["ADAPTERS_FILE", "TEMPORARY_MARK", "StepMetrics", "TrainerBackend", "atomic_directory"]


TRAINING_STATE = "training_state.pt"
"""Beside a checkpoint's weights (the latest checkpoint only: the loop removes the one before): the optimizer's
state, the step count and the RNG, so a resumed run continues the same optimisation (the torch trainer, every
weight trained; a LoRA or sharded run resumes its weights with a fresh optimizer)."""

ADAPTERS_FILE = "adapters.json"
"""A per-agent checkpoint (``fulmen.algorithm.trainer.adapters``) holds this file: ``{"agents": [...],
"base_model": ...}``."""

TEMPORARY_MARK = ".tmp-"
"""A directory still being written is named ``<final name>.tmp-<pid>`` (the pid of the writing process)."""


@contextlib.contextmanager
def atomic_directory(directory: Path) -> Iterator[Path]:
    """Write a directory so that ``directory`` appears whole or not at all.

    Yields a temporary sibling, ``<name>.tmp-<pid>`` (same filesystem, so the final rename is atomic), to write
    into; when the block ends without an exception the sibling is renamed to ``directory`` (an existing
    ``directory`` is replaced: moved aside, then removed). On an exception the sibling is removed and nothing
    changes. A kill -9 during the block leaves only the sibling, which readers skip by its name.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.with_name(f"{directory.name}{TEMPORARY_MARK}{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)  # left by an earlier process that had this pid
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if directory.exists():  # os.replace cannot replace a non-empty directory: move the old one aside first
        retired = directory.with_name(f"{directory.name}{TEMPORARY_MARK}{os.getpid()}-old")
        shutil.rmtree(retired, ignore_errors=True)
        os.replace(directory, retired)
        os.replace(staging, directory)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, directory)


@dataclass(frozen=True)
class StepMetrics:
    """What one ``step`` or ``sft_step`` did. Means are token-weighted over every micro-batch and epoch.

    ``loss``: the full-batch loss, averaged over epochs (SFT: mean cross-entropy of the response tokens);
    ``clip_fraction``: share of response tokens whose PPO ratio was clipped; ``kl``: k3 KL(policy || reference)
    per token (0 without a reference); ``approx_kl``: k1 KL(old || policy), how far the epochs moved the policy;
    ``ratio_mean``: mean importance ratio; ``grad_norm``: gradient norm before clipping, averaged over epochs;
    ``tokens``: response tokens in the batch (those with loss); ``input_tokens``: non-padding tokens;
    ``tokens_per_s``: ``input_tokens * epochs / train_s`` (each goes through a forward and a backward pass);
    ``train_s``: wall time of the whole step, logprob passes included; ``skipped_updates``: epochs whose
    update was skipped because the gradient was not finite. ``computed_tokens``: tokens the decoder computed in one
    training pass over the batch (fewer than ``input_tokens`` where rows share prefixes, more with padding);
    ``flops``: the step's matrix-multiply FLOPs (2 per weight and token forward, 3 forwards' worth with the backward
    of full weights, 2 with LoRA; attention scores left out), 0 when the backend does not count them.

    With an off-policy correction (``fulmen.algorithm.rl.corrections``; None without one), over the response tokens
    whose behaviour logprobs were recorded: ``is_weight_mean`` / ``is_weight_max`` of the importance weights
    applied, ``is_ratio_max`` of the raw ratio proximal / behaviour, ``is_truncated_fraction`` /
    ``is_masked_fraction``: share of those tokens whose weight was truncated / set to 0.
    """

    step: int
    loss: float
    grad_norm: float
    tokens: int
    input_tokens: int
    tokens_per_s: float
    train_s: float
    epochs: int = 1
    clip_fraction: float = 0.0
    kl: float = 0.0
    approx_kl: float = 0.0
    ratio_mean: float = 1.0
    skipped_updates: int = 0
    computed_tokens: int = 0
    flops: float = 0.0
    is_weight_mean: float | None = None
    is_weight_max: float | None = None
    is_ratio_max: float | None = None
    is_truncated_fraction: float | None = None
    is_masked_fraction: float | None = None

    def as_dict(self) -> dict[str, float]:
        """All fields that have a value, by name (for logs and the ``TrainStep`` event's fields and ``extra``)."""
        return {name: float(value) for name, value in asdict(self).items() if value is not None}


@runtime_checkable
class TrainerBackend(Protocol):
    """A policy being trained: RL steps, supervised steps, checkpoints."""

    def step(self, batch: TrainBatch | Sequence[Sample]) -> StepMetrics:
        """One policy-gradient update on ``batch`` (samples are collated first; their advantages are final).

        Rows without recorded old logprobs get them from the current model before the update.
        """
        ...

    def sft_step(self, batch: TrainBatch | Sequence[Sample]) -> StepMetrics:
        """One supervised update: cross-entropy on the response tokens only (token mean); advantages ignored."""
        ...

    def save(self, directory: Path | str) -> Path:
        """Write the current policy as a full Hugging Face model directory (safetensors weights, config,
        tokenizer) that ``AutoModelForCausalLM.from_pretrained`` loads (the gateway's format "hf"); returns it.
        A LoRA backend writes the MERGED model (base weights + adapter), not an adapter directory. The save is
        atomic (:func:`atomic_directory`): killed midway, it leaves no ``directory`` behind.
        """
        ...
