"""The verl trainer backend: verl's own FSDP2 engine and PPO loss, fed Fulmen's samples (``FULMEN_TRAIN_BACKEND=verl``).

verl 0.9 trains through its engine API: ``FSDPEngineWithLMHead`` (``verl.workers.engine.fsdp``) wraps the Hugging
Face model in FSDP2 and runs ``train_batch(data, loss_function)`` (micro-batches, the token normaliser all-reduced
over the data-parallel group, gradient clipping, the optimizer step) with ``verl.workers.utils.losses.ppo_loss``
(``core_algos.compute_policy_loss_vanilla`` + ``agg_loss``, KL ``low_var_kl``). Its ``DataParallelPPOActor`` of
earlier releases is gone. :class:`VerlTrainer` turns each step's :class:`~fulmen.algorithm.batch.Sample` list into
the batch verl's trainer hands that engine (prompts left-padded, responses right-padded, ``position_ids``,
``response_mask``, ``old_log_probs``, ``advantages`` per token; then ``left_right_2_no_padding``), fills the old
logprobs the inference backend did not record with ``engine.infer_batch``, the reference logprobs (KL) with a
second, forward-only engine, and runs ``epochs_per_batch`` engine updates. ``save`` gathers the full weights
(``engine.get_per_tensor_param``) and writes a Hugging Face directory, atomically.

On the CPU: verl's platform layer knows NVIDIA, Huawei and AMD accelerators only (with none it falls back to
"nvidia", and ``init_device_mesh("cuda")`` fails: "Found no NVIDIA driver"), and its FSDP engine is registered for
cuda and npu. :func:`register_cpu` adds, through verl's own registries (``PlatformRegistry.register``,
``EngineRegistry.register``), a "cpu" platform (gloo, the ``torch.cpu`` module) and the same engine class for it;
it is made verl's platform with ``set_platform`` before verl's engines are imported. On a GPU nothing of that is
used.

Micro-batches: verl's engine needs their rows to divide the batch; :func:`micro_rows` takes the largest divisor of
the batch size up to ``micro_batch_size`` (the loss does not depend on the split). Limits (each a
ConfigurationError at start, saying what to set): one process (no torchrun ranks: use the torch
backend for FSDP over several ranks), no LoRA, the ``ppo_clip`` loss. verl's loss differs from ours in one
documented way: its dual clip bounds a negative-advantage token's loss at ratio 3 (``clip_ratio_c``).
Needs verl (``pip install verl==0.9.1``; the optional ``gpu`` extra), and uses SDPA attention (verl's default,
flash-attention 2, is not installed with it).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from fulmen.algorithm.batch import Sample, TrainBatch, collate
from fulmen.algorithm.rl.losses import LossAggregation, PolicyLoss
from fulmen.algorithm.trainer.base import StepMetrics, atomic_directory
from fulmen.algorithm.trainer.distributed import plain_model
from fulmen.algorithm.trainer.torch_backend import (
    TorchTrainerConfig,
    _load_tokenizer,
    _pad_id,
    _resolve_device,
    _resolve_dtype,
    no_progress_bars,
)
from fulmen.schemas.errors import ConfigurationError

__all__ = ["VerlTrainer", "micro_rows", "register_cpu", "verl_batch"]

VERL_AGGREGATION = {LossAggregation.TOKEN_MEAN: "token-mean", LossAggregation.SEQ_MEAN: "seq-mean-token-mean"}
CPU = "cpu"


def register_cpu() -> None:
    """Make verl run on the CPU: a "cpu" platform, made verl's current one (``set_platform``), and verl's FSDP
    engine registered for it (see the module docstring). Call it before verl's engines are imported."""
    from verl.plugin.platform.platform_manager import PlatformRegistry, get_platform, set_platform

    if PlatformRegistry.get(CPU) is None:
        from fulmen.algorithm.trainer.verl_cpu import PlatformCPU

        PlatformRegistry.register(platform=CPU)(PlatformCPU)
    if get_platform().device_name != CPU:
        set_platform(PlatformRegistry.get(CPU)())
    from verl.workers.engine import EngineRegistry, FSDPEngineWithLMHead

    registered = EngineRegistry._engines.get("language_model", {}).get("fsdp2", {})
    if CPU not in registered:
        EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device=CPU)(
            FSDPEngineWithLMHead
        )
    # verl patches trl's value-head model whenever trl is importable; trl 1.x no longer has that class (an
    # ImportError while building the engine). Fulmen trains no value model: skip that patch.
    import verl.models.transformers.monkey_patch as verl_patches

    verl_patches.is_trl_available = lambda: False


class VerlTrainer:
    """verl's FSDP engine behind :class:`~fulmen.algorithm.trainer.base.TrainerBackend` (module docstring).

    Metrics: ``loss`` is the sum of verl's micro-batch losses (each relative to the whole batch), ``clip_fraction``
    and ``approx_kl`` verl's ``pg_clipfrac`` and ``ppo_kl`` weighted by the micro-batches' tokens, ``kl`` its
    ``kl_loss`` (reduced as the loss is: a token mean with token_mean); verl reports no mean ratio, so
    ``ratio_mean`` is ``exp(-approx_kl)``.
    """

    def __init__(self, config: TorchTrainerConfig) -> None:
        _check_supported(config)
        self.config = config
        self.device = _resolve_device(config.device)
        if self.device.type == CPU:
            register_cpu()
        _join_world_of_one(self.device)
        torch.manual_seed(config.seed)
        self.tokenizer = _load_tokenizer(config.model_path)
        self.engine = _engine(config, forward_only=False)
        # verl's reference engine (forward_only) offloads its parameters to pinned CPU memory, which needs CUDA;
        # on the CPU the reference is a plain engine that is never stepped (AdamW makes no state until a step)
        reference_only = self.device.type == "cuda"
        self.reference = _engine(config, forward_only=reference_only) if config.kl_coef > 0 else None
        self.pad_id = _pad_id(self.tokenizer, self.engine.module)
        self.steps = 0
        self.micro_rows = config.micro_batch_size

    def step(self, batch: TrainBatch | Sequence[Sample]) -> StepMetrics:
        """``epochs_per_batch`` verl updates on the batch (old and reference logprobs first); its metrics."""
        from verl.workers.utils.losses import ppo_loss

        started = time.perf_counter()
        data, rows = self._data(batch)
        if not bool(rows.has_old_logprobs.all()) or self.config.recompute_old_logprobs:
            computed = self._logprobs(self.engine, data)
            keep = rows.has_old_logprobs[:, None] & (not self.config.recompute_old_logprobs)
            data["old_log_probs"] = torch.where(keep, data["old_log_probs"], computed)
        if self.reference is not None:
            data["ref_log_prob"] = self._logprobs(self.reference, data)
        loss = partial(ppo_loss, config=self._actor_config())
        return self._train(data, rows, loss, started, self.config.epochs_per_batch)

    def sft_step(self, batch: TrainBatch | Sequence[Sample]) -> StepMetrics:
        """One supervised update with verl's ``sft_loss`` (response tokens, token mean); its metrics."""
        from verl.workers.utils.losses import sft_loss

        started = time.perf_counter()
        data, rows = self._data(batch)
        data["loss_mask"] = _nested_response_mask(rows)  # sft_loss reads the mask over whole sequences
        return self._train(data, rows, partial(sft_loss, config=self._actor_config()), started, 1)

    def save(self, directory: Path | str) -> Path:
        """The gathered weights as a Hugging Face directory (float32 safetensors, config, tokenizer), atomically."""
        directory = Path(directory)
        params, _ = self.engine.get_per_tensor_param()
        state = {name: tensor.detach().to(CPU, torch.float32).clone() for name, tensor in params}
        with atomic_directory(directory) as staging, no_progress_bars():
            plain_model(self.engine.module, state, lora=False).save_pretrained(staging)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(staging)
        return directory

    # -- internals -----------------------------------------------------------------------------------------------

    def _actor_config(self):  # -> verl.workers.config.ActorConfig
        from verl.workers.config import ActorConfig

        config = self.config
        return ActorConfig(
            strategy="fsdp",
            rollout_n=1,
            ppo_micro_batch_size_per_gpu=config.micro_batch_size,
            loss_agg_mode=VERL_AGGREGATION[LossAggregation(config.aggregation)],
            clip_ratio=config.clip_eps,
            clip_ratio_low=config.clip_eps,
            clip_ratio_high=config.clip_eps_high or config.clip_eps,
            use_kl_loss=config.kl_coef > 0,
            kl_loss_coef=config.kl_coef,
            kl_loss_type="low_var_kl",
            entropy_coeff=0.0,
        )

    def _data(self, batch: TrainBatch | Sequence[Sample]):  # -> tuple[TensorDict, TrainBatch]
        rows = batch if isinstance(batch, TrainBatch) else collate(batch, self.pad_id, self.config.max_len)
        self.micro_rows = micro_rows(rows.size, self.config.micro_batch_size)
        return verl_batch(rows.to(CPU), self.micro_rows), rows.to(CPU)

    def _logprobs(self, engine, data) -> torch.Tensor:
        """Response-token logprobs ``[B, R]`` under ``engine`` (verl's forward, no gradient)."""
        from verl.workers.utils.padding import no_padding_2_padding

        with engine.eval_mode():
            output = engine.infer_batch(data)
        return no_padding_2_padding(output["model_output"]["log_probs"], data).float().cpu()

    def _train(self, data, rows: TrainBatch, loss, started: float, epochs: int) -> StepMetrics:
        losses, norms, skipped, weighted = [], [], 0, {"clip_fraction": 0.0, "approx_kl": 0.0, "kl": 0.0}
        tokens = _micro_tokens(rows, self.micro_rows)
        for _ in range(epochs):
            with self.engine.train_mode():
                output = self.engine.train_batch(data, loss_function=loss)
            losses.append(sum(output["loss"]))
            norm = float(output["metrics"]["grad_norm"])
            skipped += not math.isfinite(norm)
            norms += [norm] if math.isfinite(norm) else []
            for ours, theirs in (("clip_fraction", "actor/pg_clipfrac"), ("approx_kl", "actor/ppo_kl")):
                weighted[ours] += _token_weighted(output["metrics"].get(theirs), tokens)
            weighted["kl"] += _summed(output["metrics"].get("kl_loss"))
        self.steps += 1
        train_s = time.perf_counter() - started
        return StepMetrics(
            step=self.steps,
            loss=sum(losses) / epochs,
            grad_norm=sum(norms) / len(norms) if norms else math.nan,
            tokens=rows.response_tokens,
            input_tokens=rows.input_tokens,
            tokens_per_s=rows.input_tokens * epochs / train_s if train_s > 0 else 0.0,
            train_s=train_s,
            epochs=epochs,
            clip_fraction=weighted["clip_fraction"] / epochs,
            kl=weighted["kl"] / epochs,
            approx_kl=weighted["approx_kl"] / epochs,
            ratio_mean=math.exp(-weighted["approx_kl"] / epochs),
            skipped_updates=skipped,
        )


def verl_batch(rows: TrainBatch, micro_batch_size: int):  # -> tensordict.TensorDict
    """The batch as verl's PPO trainer hands it to the engine: ``prompts [B, P]`` left-padded, ``responses [B, R]``
    right-padded, ``input_ids``/``attention_mask``/``position_ids [B, P + R]``, ``response_mask``, ``old_log_probs``,
    ``advantages [B, R]``, converted with ``left_right_2_no_padding`` and the engine's settings attached."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    response = rows.response_mask.bool()
    prompt_lens = (rows.attention_mask.bool() & ~response).sum(-1)
    response_lens = response.sum(-1)
    width_p, width_r = int(prompt_lens.max()), int(response_lens.max())
    size = rows.size
    prompts = torch.zeros(size, width_p, dtype=torch.long)
    responses = torch.zeros(size, width_r, dtype=torch.long)
    mask = torch.zeros(size, width_p + width_r, dtype=torch.long)
    response_mask = torch.zeros(size, width_r)
    old = torch.zeros(size, width_r)
    for i in range(size):
        p, r = int(prompt_lens[i]), int(response_lens[i])
        prompts[i, width_p - p :] = rows.input_ids[i, :p]
        responses[i, :r] = rows.input_ids[i, p : p + r]
        old[i, :r] = rows.old_logprobs[i, p : p + r]
        mask[i, width_p - p : width_p + r] = 1
        response_mask[i, :r] = 1.0
    data = tu.get_tensordict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp_min(0),
            "response_mask": response_mask,
            "old_log_probs": old,
            "advantages": rows.advantages[:, None] * response_mask,
        }
    )
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(
        data,
        use_remove_padding=False,
        use_dynamic_bsz=False,
        use_fused_kernels=False,
        micro_batch_size_per_gpu=micro_batch_size,
        max_token_len_per_gpu=0,
        temperature=1.0,
        global_batch_size=size,
    )
    return data


def micro_rows(batch_size: int, wanted: int) -> int:
    """Rows per verl micro-batch: the largest divisor of ``batch_size`` up to ``wanted`` (verl's engine, with
    micro-batches by rows, needs them to divide the batch; a prime batch size goes one row at a time)."""
    return max(d for d in range(1, min(wanted, batch_size) + 1) if batch_size % d == 0)


def _nested_response_mask(rows: TrainBatch) -> torch.Tensor:
    """Per row, 1 on its response tokens over its unpadded prompt + response (verl's SFT ``loss_mask``)."""
    keep = rows.attention_mask.bool()
    return torch.nested.as_nested_tensor(
        [rows.response_mask[i][keep[i]] for i in range(rows.size)], layout=torch.jagged
    )


def _micro_tokens(rows: TrainBatch, micro_batch_size: int) -> list[float]:
    """Response tokens of each micro-batch verl makes (consecutive rows, as with ``use_dynamic_bsz`` off)."""
    return [float(mb.response_tokens) for mb in rows.split(micro_batch_size)]


def _values(metric) -> list[float]:
    """The values a verl metric collected, one per micro-batch (a ``Metric``, or a list of them)."""
    if metric is None:
        return []
    metrics = metric if isinstance(metric, list) else [metric]
    return [float(value) for m in metrics for value in (m.values if hasattr(m, "values") else [m])]


def _token_weighted(metric, tokens: list[float]) -> float:
    """verl's per-micro-batch means weighted by their tokens (0 when the counts do not line up)."""
    values = _values(metric)
    if len(values) != len(tokens) or not sum(tokens):
        return 0.0
    return sum(v * t for v, t in zip(values, tokens, strict=True)) / sum(tokens)


def _summed(metric) -> float:
    """A verl metric already relative to the whole batch (each micro-batch's share): the sum of its values."""
    return sum(_values(metric))


def _engine(config: TorchTrainerConfig, *, forward_only: bool):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    # verl's FSDP compute dtype (param_dtype; bf16 unless told) is our compute dtype; weights stay float32
    dtype = "bf16" if _resolve_dtype(config.dtype, _resolve_device(config.device)) == torch.bfloat16 else "fp32"
    precision = {"param_dtype": dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    model = HFModelConfig(
        path=str(config.model_path), use_remove_padding=False, override_config={"attn_implementation": "sdpa"}
    )
    model.model_type = "language_model"
    engine = EngineRegistry.new(
        model_type="language_model",
        backend="fsdp2",
        model_config=model,
        engine_config=FSDPEngineConfig(
            strategy="fsdp2",
            micro_batch_size_per_gpu=config.micro_batch_size,
            use_torch_compile=False,
            model_dtype="fp32",
            mixed_precision=precision,
            forward_only=forward_only,
            seed=config.seed,
        ),
        optimizer_config=FSDPOptimizerConfig(
            lr=config.lr,
            betas=config.betas,
            weight_decay=config.weight_decay,
            clip_grad=config.max_grad_norm or math.inf,
        ),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


def _join_world_of_one(device: torch.device) -> None:
    """verl's engine needs a process group: outside torchrun, one of this process alone (an in-memory store)."""
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            raise ConfigurationError(
                "FULMEN_TRAIN_BACKEND=verl runs as one process here; for several ranks use "
                "FULMEN_TRAIN_BACKEND=torch (FSDP2 under torchrun)"
            )
        return
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _check_supported(config: TorchTrainerConfig) -> None:
    problems = [
        text
        for broken, text in (
            (config.lora is not None, "LoRA (set FULMEN_TRAIN_LORA_R=0, or FULMEN_TRAIN_BACKEND=torch)"),
            (config.policy_loss != PolicyLoss.PPO_CLIP, f"the policy loss {config.policy_loss!r} (only ppo_clip)"),
            (
                "RANK" in os.environ and os.environ.get("WORLD_SIZE", "1") != "1",
                "several torchrun ranks (use FULMEN_TRAIN_BACKEND=torch for FSDP over ranks)",
            ),
        )
        if broken
    ]
    if problems:
        raise ConfigurationError("FULMEN_TRAIN_BACKEND=verl does not support " + "; ".join(problems))
    try:
        import verl  # noqa: F401
    except ImportError as error:
        raise ConfigurationError(
            "FULMEN_TRAIN_BACKEND=verl needs verl: pip install verl==0.9.1 (or the gpu "
            f"extra), or set FULMEN_TRAIN_BACKEND=torch ({error})"
        ) from None
