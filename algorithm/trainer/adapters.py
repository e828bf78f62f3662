"""One LoRA adapter per trained agent on one frozen base model (``FULMEN_TRAIN_ADAPTERS=per_agent``).

:class:`PerAgentTrainer` is a :class:`~fulmen.algorithm.trainer.torch_backend.TorchTrainer` whose model is a PEFT
model holding one adapter per agent name (the base weights never change). A step's samples are split by
``Sample.agent``; for each agent, its adapter alone is made active and trainable (PEFT's ``set_adapter``) and the
torch trainer's step runs on that agent's samples only, so each adapter's gradient comes from its own calls,
normalised over its own tokens. One AdamW holds every adapter's parameters: an adapter without a gradient in a
step (``None``) is not moved by it. The step's metrics add up the agents' (token-weighted means; sums of tokens and
time); :attr:`PerAgentTrainer.agent_metrics` keeps each agent's.

A checkpoint (:meth:`PerAgentTrainer.save`) is a directory with one PEFT adapter directory per agent
(``<dir>/<agent>/adapter_config.json``, ``adapter_model.safetensors``: what the LLM gateway and vLLM load as a LoRA
adapter for the base model) and ``adapters.json`` naming the agents and the base model; :meth:`PerAgentTrainer`
resumes from one (``resume_from``). An agent's adapter starts as PEFT initialises one (B = 0: the base model's
outputs exactly).

Imports torch, transformers and peft only (no pydantic): it runs where the torch trainer runs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from fulmen.algorithm.batch import Sample, TrainBatch
from fulmen.algorithm.trainer.base import ADAPTERS_FILE, StepMetrics, atomic_directory
from fulmen.algorithm.trainer.torch_backend import LoraSettings, TorchTrainer, TorchTrainerConfig
from fulmen.schemas.errors import ConfigurationError, PoisonInputError

__all__ = ["DEFAULT_RANK", "PerAgentTrainer", "combine_metrics", "is_adapter_checkpoint"]

log = logging.getLogger(__name__)

DEFAULT_RANK = 16
"""The adapters' LoRA rank when ``lora_r`` is not set."""


def is_adapter_checkpoint(directory: Path) -> bool:
    return (Path(directory) / ADAPTERS_FILE).is_file()


class PerAgentTrainer(TorchTrainer):
    """See the module docstring. ``config.model_path`` is the base model; ``agents`` the adapters' names."""

    def __init__(self, config: TorchTrainerConfig, agents: Sequence[str], resume_from: Path | None = None) -> None:
        if not agents:
            raise ConfigurationError("per-agent adapters need at least one agent name")
        if len(set(agents)) < len(agents):
            raise ConfigurationError(f"per-agent adapters: an agent is named twice ({', '.join(agents)})")
        if config.lora is None:
            config = dataclasses.replace(config, lora=LoraSettings(r=DEFAULT_RANK, alpha=2.0 * DEFAULT_RANK))
        super().__init__(config)  # a PEFT model with one adapter, "default"
        self.agents = list(agents)
        # PEFT adapter names may not hold '.', agent names may: the adapters are named by position
        self.names = {agent: f"agent{index}" for index, agent in enumerate(self.agents)}
        peft_config = self.model.peft_config["default"]
        for agent in self.agents:
            name = self.names[agent]
            if resume_from is not None:
                self.model.load_adapter(str(Path(resume_from) / agent), adapter_name=name, is_trainable=True)
            else:
                self.model.add_adapter(name, peft_config)
        self.model.set_adapter(self.names[self.agents[0]])
        self.model.delete_adapter("default")
        self.trainable = [p for name, p in self.model.named_parameters() if _adapter_of(name, self.names.values())]
        self.optimizer = torch.optim.AdamW(
            self.trainable, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        self.agent_metrics: dict[str, StepMetrics] = {}
        log.info(
            "per-agent LoRA adapters (rank %d) for %s on %s%s",
            config.lora.r,
            ", ".join(self.agents),
            config.model_path,
            f", resumed from {resume_from}" if resume_from else "",
        )

    def step(self, batch: TrainBatch | Sequence[Sample]) -> StepMetrics:
        """One update of each adapter whose agent has samples in ``batch`` (a list of samples: a collated batch
        does not say whose rows are whose)."""
        return self._per_agent(batch, super().step)

    def sft_step(self, batch: TrainBatch | Sequence[Sample]) -> StepMetrics:
        """One supervised update of each adapter whose agent has samples in ``batch``."""
        return self._per_agent(batch, super().sft_step)

    def _per_agent(self, batch: TrainBatch | Sequence[Sample], update) -> StepMetrics:
        if isinstance(batch, TrainBatch):
            raise ValueError("per-agent adapters train from samples (Sample.agent says whose); got a collated batch")
        by_agent: dict[str, list[Sample]] = {}
        for sample in batch:
            by_agent.setdefault(sample.agent, []).append(sample)
        unknown = sorted(set(by_agent) - set(self.names))
        if unknown:
            raise PoisonInputError(
                f"samples of agents without an adapter: {', '.join(map(repr, unknown))} "
                f"(the adapters are {', '.join(self.agents)})"
            )
        if not by_agent:
            raise PoisonInputError("an empty batch")
        number = self.steps + 1
        self.agent_metrics = {}
        for agent in self.agents:
            if agent in by_agent:
                self.model.set_adapter(self.names[agent])  # only this adapter is active and requires grad
                self.agent_metrics[agent] = update(by_agent[agent])
        self.steps = number
        return combine_metrics(number, list(self.agent_metrics.values()))

    def save(self, directory: Path | str) -> Path:
        """Each agent's adapter in ``<directory>/<agent>`` and ``adapters.json``; atomic (see ``TorchTrainer.save``)."""
        directory = Path(directory)
        with atomic_directory(directory) as staging:
            for agent in self.agents:
                name = self.names[agent]
                self.model.save_pretrained(staging, selected_adapters=[name])
                os.replace(staging / name, staging / agent)  # PEFT writes a named adapter to <dir>/<name>
            manifest = {"agents": self.agents, "base_model": str(self.config.model_path)}
            (staging / ADAPTERS_FILE).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        log.info("saved the adapters of %s after step %d to %s", ", ".join(self.agents), self.steps, directory)
        return directory


def _adapter_of(parameter: str, names) -> bool:
    return any(f".{name}." in parameter for name in names)


def combine_metrics(step: int, parts: list[StepMetrics]) -> StepMetrics:
    """One step's metrics from the agents' updates: tokens, time and skipped updates add up; the loss, the ratios
    and the KLs are means weighted by response tokens; the gradient norm is the mean; importance-weight maxima
    are maxima."""
    tokens = sum(p.tokens for p in parts)
    weight = [p.tokens / tokens if tokens else 1.0 / len(parts) for p in parts]

    def mean(name: str) -> float:
        return sum(getattr(p, name) * w for p, w in zip(parts, weight, strict=True))

    def optional(name: str, how) -> float | None:
        values = [(getattr(p, name), w) for p, w in zip(parts, weight, strict=True) if getattr(p, name) is not None]
        return how(values) if values else None

    def weighted(values: list[tuple[float, float]]) -> float:
        total = sum(w for _, w in values)
        return sum(v * w for v, w in values) / total if total else 0.0

    train_s = sum(p.train_s for p in parts)
    input_tokens = sum(p.input_tokens for p in parts)
    epochs = max(p.epochs for p in parts)
    norms = [p.grad_norm for p in parts if math.isfinite(p.grad_norm)]
    return StepMetrics(
        step=step,
        loss=mean("loss"),
        grad_norm=sum(norms) / len(norms) if norms else math.nan,
        tokens=tokens,
        input_tokens=input_tokens,
        tokens_per_s=input_tokens * epochs / train_s if train_s > 0 else 0.0,
        train_s=train_s,
        epochs=epochs,
        clip_fraction=mean("clip_fraction"),
        kl=mean("kl"),
        approx_kl=mean("approx_kl"),
        ratio_mean=mean("ratio_mean"),
        skipped_updates=sum(p.skipped_updates for p in parts),
        is_weight_mean=optional("is_weight_mean", weighted),
        is_weight_max=optional("is_weight_max", lambda v: max(x for x, _ in v)),
        is_ratio_max=optional("is_ratio_max", lambda v: max(x for x, _ in v)),
        is_truncated_fraction=optional("is_truncated_fraction", weighted),
        is_masked_fraction=optional("is_masked_fraction", weighted),
    )
