"""The torch trainer backend: a Hugging Face causal LM in one process (CPU or one GPU), optional LoRA.

:class:`TorchTrainer` implements :class:`fulmen.algorithm.trainer.base.TrainerBackend`. One ``step``:

1. collate the samples (right-padded :class:`TrainBatch`), move them to the device, split into micro-batches
   (rows by length first, so each micro-batch, cut to its longest row, holds little padding);
2. fill the old logprobs the inference backend did not record (all of them with ``recompute_old_logprobs`` or
   an off-policy ``correction``: then they are the proximal policy's, the weights at the start of the step)
   from the current model, without gradient, before any update; with ``kl_coef > 0`` compute the reference
   logprobs the same way (a frozen copy of the initial model; with LoRA the same model, adapter disabled);
   with a ``correction`` (``tis``, ``mis``, ``decoupled``: ``fulmen.algorithm.rl.corrections``) compute each
   token's importance weight from the proximal and the recorded behaviour logprobs, once;
3. ``epochs_per_batch`` times: zero the gradients, run every micro-batch forward and backward with the loss
   (``policy_loss``: ``ppo_clip``, ``dapo``, ``gspo``, ``cispo``; the weights multiplying its per-token term)
   reduced relative to the WHOLE batch (so the accumulated gradient is the full-batch gradient), clip the
   gradient norm, take one AdamW step (torch's fused kernel on CPU and CUDA).

Every forward computes the logprobs of the response tokens only where the model allows
(``token_logprobs(..., response_mask)``: the output projection and softmax skip the prompt and the padding, and
a micro-batch of rows of unequal length runs packed into one row when that saves work).

Precision: weights and optimizer state stay float32; ``dtype`` is the compute dtype of the forward pass
(autocast). bfloat16 weights would round away AdamW updates smaller than 1/256 of a weight.

Imports torch, transformers and peft only (no pydantic): it runs on a GPU machine with nothing else installed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from fulmen.algorithm.batch import Sample, TrainBatch, collate
from fulmen.algorithm.rl.corrections import CorrectionLevel, ImportanceStats, get_correction_fn, get_level
from fulmen.algorithm.rl.losses import (
    LossAggregation,
    PolicyLoss,
    PolicyLossMetrics,
    aggregate,
    batch_normalizer,
    get_aggregation,
    get_policy_loss_fn,
)
from fulmen.algorithm.trainer.base import TRAINING_STATE, StepMetrics, atomic_directory
from fulmen.algorithm.trainer.logprobs import Work, token_logprobs
from fulmen.infra.torch_cuda import trusted_attention
from fulmen.schemas.errors import ConfigurationError

__all__ = ["LoraSettings", "TorchTrainer", "TorchTrainerConfig", "no_progress_bars"]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoraSettings:
    """A LoRA adapter (peft): rank ``r``, scale ``alpha / r``, dropout, and the modules it wraps."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = "all-linear"


@dataclass(frozen=True)
class TorchTrainerConfig:
    """Settings of :class:`TorchTrainer`; checked on creation (ConfigurationError says what to set).

    ``device``: "auto" (cuda when available), "cpu", "cuda" or "cuda:N". ``dtype``: compute dtype, "auto"
    (bfloat16 on a GPU that supports it, else float32), "float32" or "bfloat16". ``max_grad_norm``: None
    turns clipping off. ``kl_coef``: 0 loads no reference model. ``lora``: None trains every weight.
    ``max_len``: longest prompt + response accepted by ``collate`` (None: no limit). ``micro_batch_tokens``:
    micro-batches of rows in lexicographic order whose prefix tree holds at most this many tokens (the rows' shared
    prefixes computed once: :mod:`~fulmen.algorithm.trainer.prefix_tree`), instead of ``micro_batch_size`` rows by
    length. ``clip_eps`` /
    ``clip_eps_high``: the policy loss's clip range below / above 1 (``clip_eps_high`` None: the loss's own
    default, ``clip_eps`` for ppo_clip). ``correction``: None, or an off-policy correction by name, with its
    ``correction_level`` (token, sequence) and bounds ``correction_low`` / ``correction_high`` on the ratio.
    """

    model_path: Path | str
    device: str = "auto"
    dtype: str = "auto"
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = 1.0
    micro_batch_size: int = 8
    micro_batch_tokens: int | None = None
    epochs_per_batch: int = 1
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    policy_loss: str = PolicyLoss.PPO_CLIP
    aggregation: str = LossAggregation.TOKEN_MEAN
    kl_coef: float = 0.0
    lora: LoraSettings | None = None
    seed: int = 0
    max_len: int | None = None
    recompute_old_logprobs: bool = False
    correction: str | None = None
    correction_level: str = CorrectionLevel.TOKEN
    correction_low: float = 0.0
    correction_high: float = 2.0

    def __post_init__(self) -> None:
        problems = [
            text
            for broken, text in (
                (self.lr <= 0, f"lr must be > 0 (got {self.lr})"),
                (self.micro_batch_size < 1, f"micro_batch_size must be >= 1 (got {self.micro_batch_size})"),
                (
                    self.micro_batch_tokens is not None and self.micro_batch_tokens < 1,
                    f"micro_batch_tokens must be >= 1 or None (got {self.micro_batch_tokens})",
                ),
                (self.epochs_per_batch < 1, f"epochs_per_batch must be >= 1 (got {self.epochs_per_batch})"),
                (not 0 < self.clip_eps <= 1, f"clip_eps must be in (0, 1] (got {self.clip_eps})"),
                (self.clip_eps_high is not None and self.clip_eps_high <= 0, "clip_eps_high must be > 0 or None"),
                (
                    not 0 <= self.correction_low <= self.correction_high or self.correction_high <= 0,
                    f"need 0 <= correction_low <= correction_high and correction_high > 0 (got "
                    f"{self.correction_low}, {self.correction_high})",
                ),
                (self.kl_coef < 0, f"kl_coef must be >= 0 (got {self.kl_coef})"),
                (self.max_grad_norm is not None and self.max_grad_norm <= 0, "max_grad_norm must be > 0 or None"),
                (self.dtype not in ("auto", *_DTYPES), f"dtype must be auto, float32 or bfloat16 (got {self.dtype})"),
                (self.lora is not None and self.lora.r < 1, "lora.r must be >= 1"),
            )
            if broken
        ]
        if problems:
            raise ConfigurationError("TorchTrainerConfig: " + "; ".join(problems))
        get_policy_loss_fn(self.policy_loss)  # ConfigurationError listing the valid names
        get_aggregation(self.aggregation)
        get_level(self.correction_level)
        if self.correction is not None:
            get_correction_fn(self.correction)


class TorchTrainer:
    """GRPO/PPO-clip and supervised steps on a Hugging Face causal LM; see the module docstring."""

    def __init__(self, config: TorchTrainerConfig) -> None:
        self.config = config
        self.device = _resolve_device(config.device)
        trusted_attention(self.device)
        self.compute_dtype = _resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        self.tokenizer = _load_tokenizer(config.model_path)
        self.model = _load_model(config, self.device)
        self.reference = _Reference.build(self.model, config) if config.kl_coef > 0 else None
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(  # fused: one kernel for all tensors (a third of the for-loop's time)
            self.trainable,
            lr=config.lr,
            betas=config.betas,
            weight_decay=config.weight_decay,
            fused=self.device.type in ("cpu", "cuda"),
        )
        self.pad_id = _pad_id(self.tokenizer, self.model)
        self.policy_loss = get_policy_loss_fn(config.policy_loss)
        self.correction = get_correction_fn(config.correction) if config.correction is not None else None
        self.steps = 0
        self.body_weights, self.head_weights = _matmul_weights(self.model)
        self._work = (Work(), Work())  # this step's (training passes, passes without gradient)
        self.response_only = True  # logprobs of the response tokens only (sharded: the whole model's forward)

    # -- the TrainerBackend interface -------------------------------------------------------------------

    def step(self, batch: TrainBatch | Sequence[Sample]) -> StepMetrics:
        """One policy update on ``batch`` (see the module docstring); returns its metrics."""
        started = time.perf_counter()
        batch = self._prepare(batch)
        normalizer = self._normalizer(batch.response_mask, self.config.aggregation)
        micro = [self._with_old_logprobs(mb) for mb in self._micro_batches(batch)]
        refs = (
            [self.reference.logprobs(mb, self._autocast, self._logprobs) for mb in micro]
            if self.reference
            else [None] * len(micro)
        )
        weights, importance = self._importance_weights(micro)
        options = {
            "clip_eps": self.config.clip_eps,
            "aggregation": self.config.aggregation,
            "normalizer": normalizer,
            "kl_coef": self.config.kl_coef,
        }
        if self.config.clip_eps_high is not None:  # else the loss's own default
            options["clip_eps_high"] = self.config.clip_eps_high

        def loss_of(index: int, mb: TrainBatch, logprobs: Tensor) -> tuple[Tensor, PolicyLossMetrics]:
            return self.policy_loss(
                logprobs,
                mb.old_logprobs,
                mb.advantages,
                mb.response_mask,
                ref_logprobs=refs[index],
                weights=weights[index],
                **options,
            )

        metrics = self._train(batch, micro, loss_of, started)
        return metrics if importance is None else dataclasses.replace(metrics, **importance)

    def sft_step(self, batch: TrainBatch | Sequence[Sample]) -> StepMetrics:
        """One supervised update: mean negative log-likelihood of the response tokens of the whole batch."""
        started = time.perf_counter()
        batch = self._prepare(batch)
        normalizer = self._normalizer(batch.response_mask, LossAggregation.TOKEN_MEAN)

        def loss_of(index: int, mb: TrainBatch, logprobs: Tensor) -> tuple[Tensor, None]:
            return -aggregate(logprobs, mb.response_mask, LossAggregation.TOKEN_MEAN, normalizer), None

        return self._train(batch, self._micro_batches(batch), loss_of, started, epochs=1)

    def save(self, directory: Path | str) -> Path:
        """Write a full model directory (float32 safetensors, config, tokenizer); with LoRA, the merged model.

        Merging works on a copy (the adapter keeps training); it briefly needs a second copy of the weights.
        Written into ``<directory>.tmp-<pid>`` and renamed to ``directory`` when complete (atomic).
        """
        directory = Path(directory)
        with atomic_directory(directory) as staging, no_progress_bars():  # a kill midway leaves no half-written dir
            if self.config.lora is None:
                self.model.save_pretrained(staging)
                if type(self).save is TorchTrainer.save:  # one process holds the whole optimizer: resumable
                    state = {"optimizer": self.optimizer.state_dict(), "steps": self.steps}
                    torch.save(state | {"rng": torch.get_rng_state()}, staging / TRAINING_STATE)
            else:
                copy.deepcopy(self.model).merge_and_unload().save_pretrained(staging)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(staging)
        logger.info("saved model after step %d to %s", self.steps, directory)
        return directory

    def load_training_state(self, directory: Path | str) -> bool:
        """Continue the optimisation a checkpoint's :data:`TRAINING_STATE` describes (the optimizer's moments, the
        step count, the RNG); False when the checkpoint has none (an older one, LoRA, a sharded run)."""
        path = Path(directory) / TRAINING_STATE
        if self.config.lora is not None or not path.is_file() or type(self).save is not TorchTrainer.save:
            return False
        state = torch.load(path, map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        torch.set_rng_state(state["rng"])
        logger.info("resumed the optimizer state of step %d from %s", self.steps, path)
        return True

    # -- internals -----------------------------------------------------------------------------------------

    def _prepare(self, batch: TrainBatch | Sequence[Sample]) -> TrainBatch:
        if not isinstance(batch, TrainBatch):
            batch = collate(batch, self.pad_id, self.config.max_len)
        return batch.to(self.device)

    # The three places a sharded subclass (``fulmen.algorithm.trainer.distributed``) hooks into: the batch it is
    # handed is then its rank's shard of the step's batch.

    def _normalizer(self, mask: Tensor, mode: str) -> float:
        """The loss normaliser of the WHOLE batch (:func:`batch_normalizer`; sharded: summed over the ranks)."""
        return batch_normalizer(mask, mode)

    def _micro_batches(self, batch: TrainBatch) -> list[TrainBatch]:
        """The micro-batches of ``batch``: with ``micro_batch_tokens``, rows in lexicographic order cut by the size
        of their prefix tree (shared prefixes in one micro-batch); else its rows by length first, ``micro_batch_size``
        at a time (little padding). Sharded: as many on every rank, each forward being a collective."""
        if self.config.micro_batch_tokens is not None:
            return batch.by_prefix().split_by_tree(self.config.micro_batch_tokens)
        return batch.by_length().split(self.config.micro_batch_size)

    def _logprobs(self, model: torch.nn.Module, mb: TrainBatch) -> Tensor:
        """``[B, T]`` logprobs of ``mb``'s tokens under ``model``; where the model allows, the response's only (the
        loss reads nothing else; ``token_logprobs``)."""
        mask = mb.response_mask if self.response_only else None
        work = self._work[0] if torch.is_grad_enabled() else self._work[1]
        return token_logprobs(model, mb.input_ids, mb.attention_mask, mask, work)

    def _autocast(self) -> contextlib.AbstractContextManager:
        enabled = self.compute_dtype != torch.float32
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype, enabled=enabled)

    @torch.no_grad()
    def _with_old_logprobs(self, mb: TrainBatch) -> TrainBatch:
        """Fill the old logprobs the batch lacks (all, with recompute_old_logprobs or a correction: the proximal
        policy's) from the current model."""
        overwrite = self.config.recompute_old_logprobs or self.correction is not None
        if not overwrite and bool(mb.has_old_logprobs.all()):
            return mb
        self.model.eval()
        with self._autocast():
            computed = self._logprobs(self.model, mb)
        return mb.with_old_logprobs(computed, overwrite=overwrite)

    def _importance_weights(self, micro: list[TrainBatch]) -> tuple[list[Tensor | None], dict[str, float] | None]:
        """Per micro-batch, the correction's weights from the proximal (``old_logprobs``, recomputed) and the
        recorded behaviour logprobs, and the step's statistics as StepMetrics fields; no correction: Nones."""
        if self.correction is None:
            return [None] * len(micro), None
        config = self.config
        weights, parts = [], []
        for mb in micro:
            known = mb.response_mask * mb.has_behaviour_logprobs[:, None].to(mb.response_mask.dtype)
            w, stats = self.correction(
                mb.old_logprobs - mb.behaviour_logprobs,
                known,
                level=config.correction_level,
                low=config.correction_low,
                high=config.correction_high,
            )
            weights.append(w)
            parts.append(stats)
        stats = ImportanceStats.combine(parts).as_floats()
        logger.debug("step %d: importance weights %s", self.steps + 1, stats)
        return weights, {f"is_{name}": value for name, value in stats.items() if name != "tokens"}

    def _train(
        self,
        batch: TrainBatch,
        micro: list[TrainBatch],
        loss_of: Callable[[int, TrainBatch, Tensor], tuple[Tensor, PolicyLossMetrics | None]],
        started: float,
        epochs: int | None = None,
    ) -> StepMetrics:
        """Run ``epochs`` updates (each: accumulate over ``micro``, clip, AdamW step) and gather the metrics."""
        epochs = epochs or self.config.epochs_per_batch
        tally = _Tally()
        self._work = (Work(), self._work[1])  # the passes without gradient before (old logprobs, reference) count
        for _ in range(epochs):
            self.model.train()
            self.optimizer.zero_grad(set_to_none=True)
            for index, mb in enumerate(micro):
                with self._autocast():
                    logprobs = self._logprobs(self.model, mb)
                loss, metrics = loss_of(index, mb, logprobs)
                loss.backward()
                tally.add_micro(loss, metrics)
            tally.add_update(self._clip_and_step())
        self.model.eval()
        self.steps += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        train_s = time.perf_counter() - started
        trained, plain = self._work
        self._work = (Work(), Work())
        backward = 2 if self.config.lora is not None else 3  # forwards' worth of a training pass
        flops = self._flops(plain) + backward * self._flops(trained)
        result = dataclasses.replace(
            tally.metrics(self.steps, batch, epochs, train_s), computed_tokens=trained.tokens // epochs, flops=flops
        )
        logger.info(
            "trained step %d: loss=%.4f grad_norm=%.3f clip=%.3f kl=%.4f tokens=%d in %.2fs",
            result.step,
            result.loss,
            result.grad_norm,
            result.clip_fraction,
            result.kl,
            result.tokens,
            train_s,
        )
        return result

    def _flops(self, work: Work) -> float:
        """Forward matrix-multiply FLOPs of ``work``: 2 per weight and token (decoder weights on every token, the
        output projection on the rows it ran on)."""
        return 2.0 * (self.body_weights * work.tokens + self.head_weights * work.head_rows)

    def _clip_and_step(self) -> float | None:
        """Clip the gradient, take the optimizer step; the pre-clip norm, or None when it was skipped."""
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(self.trainable, max_norm))
        if not math.isfinite(norm):
            logger.warning("gradient norm is %s at step %d: update skipped", norm, self.steps + 1)
            self.optimizer.zero_grad(set_to_none=True)
            return None
        self.optimizer.step()
        return norm


class _Tally:
    """Sums of the per-micro-batch losses and token-weighted metrics over one step."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.weighted: dict[str, float] = {"clip_fraction": 0.0, "approx_kl": 0.0, "ref_kl": 0.0, "ratio_mean": 0.0}
        self.weight = 0.0
        self.norms: list[float] = []
        self.skipped = 0

    def add_micro(self, loss: Tensor, metrics: PolicyLossMetrics | None) -> None:
        self.loss += float(loss.detach())
        if metrics is not None:
            values = metrics.as_floats()
            for name in self.weighted:
                self.weighted[name] += values[name] * values["tokens"]
            self.weight += values["tokens"]

    def add_update(self, norm: float | None) -> None:
        if norm is None:
            self.skipped += 1
        else:
            self.norms.append(norm)

    def metrics(self, step: int, batch: TrainBatch, epochs: int, train_s: float) -> StepMetrics:
        mean = {name: total / self.weight if self.weight else 0.0 for name, total in self.weighted.items()}
        input_tokens = batch.input_tokens
        return StepMetrics(
            step=step,
            loss=self.loss / epochs,
            grad_norm=sum(self.norms) / len(self.norms) if self.norms else math.nan,
            tokens=batch.response_tokens,
            input_tokens=input_tokens,
            tokens_per_s=input_tokens * epochs / train_s if train_s > 0 else 0.0,
            train_s=train_s,
            epochs=epochs,
            clip_fraction=mean["clip_fraction"],
            kl=mean["ref_kl"],
            approx_kl=mean["approx_kl"],
            ratio_mean=mean["ratio_mean"] if self.weight else 1.0,
            skipped_updates=self.skipped,
        )


class _Reference:
    """The reference policy for the KL penalty: a frozen copy of the initial model, or (LoRA) the base model
    reached by disabling the adapter. ``logprobs(mb, autocast)`` -> ``[B, T]`` float32, no gradient."""

    def __init__(self, model: torch.nn.Module, disable: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.model = model
        self.disable = disable

    @classmethod
    def build(cls, model: torch.nn.Module, config: TorchTrainerConfig) -> _Reference:
        if config.lora is not None:
            return cls(model, model.disable_adapter)
        frozen = copy.deepcopy(model).eval()
        frozen.requires_grad_(False)
        return cls(frozen, contextlib.nullcontext)

    @torch.no_grad()
    def logprobs(
        self,
        mb: TrainBatch,
        autocast: Callable[[], contextlib.AbstractContextManager],
        compute: Callable[[torch.nn.Module, TrainBatch], Tensor],
    ) -> Tensor:
        was_training = self.model.training
        self.model.eval()
        try:
            with self.disable(), autocast():
                return compute(self.model, mb)
        finally:
            self.model.train(was_training)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ConfigurationError(f"device {name!r} is not a torch device; use auto, cpu, cuda or cuda:N") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigurationError(f"device {name!r} asked for, but torch sees no CUDA GPU; use device='cpu'")
    if device.type not in ("cpu", "cuda"):
        raise ConfigurationError(f"device {name!r} is not supported; use auto, cpu, cuda or cuda:N")
    return device


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.bfloat16 if bf16 else torch.float32


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' tqdm bars off inside the block (and huggingface_hub's, which it switches with them), as they
    were after it: a checkpoint each step printed "Writing model shards" and each load "Loading weights". The
    INFO lines say what was saved and loaded; warnings go through logging and still show."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _load_tokenizer(path: Path | str):  # -> transformers.PreTrainedTokenizerBase | None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        logger.warning("no tokenizer loadable from %s (%s): checkpoints will have none", path, error)
        return None


def _load_model(config: TorchTrainerConfig, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    # a local directory loads without a bar; a Hub download keeps huggingface_hub's (it may take minutes)
    quiet = no_progress_bars() if Path(config.model_path).is_dir() else contextlib.nullcontext()
    try:
        with quiet:
            model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=torch.float32)
    except OSError as error:
        raise ConfigurationError(f"cannot load a causal LM from model_path {config.model_path!s}: {error}") from error
    model.to(device)
    if config.lora is not None:
        from peft import LoraConfig, get_peft_model

        lora = config.lora
        model = get_peft_model(
            model,
            LoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=lora.target_modules
                if isinstance(lora.target_modules, str)
                else list(lora.target_modules),
                task_type="CAUSAL_LM",
            ),
        )
    return model.eval()


def _matmul_weights(model: torch.nn.Module) -> tuple[int, int]:
    """(weights a token meets in the decoder's matrix multiplies, weights of the output projection): every
    parameter but the input embedding table (a lookup) and the head, then the head's."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    embedding, head = inner.get_input_embeddings(), inner.get_output_embeddings()
    head_weights = head.weight.numel() if head is not None else 0
    skipped = {id(embedding.weight)} | ({id(head.weight)} if head is not None else set())
    body = sum(p.numel() for p in model.parameters() if id(p) not in skipped and p.ndim >= 2)
    return body, head_weights


def _pad_id(tokenizer, model: torch.nn.Module) -> int:
    """The tokenizer's pad id, else the model config's pad or eos id, else 0 (padding is masked anyway)."""
    config = model.config
    for candidate in (getattr(tokenizer, "pad_token_id", None), config.pad_token_id, config.eos_token_id):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0
