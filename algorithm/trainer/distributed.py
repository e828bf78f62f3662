"""The torch trainer sharded with FSDP2 over the ranks of a torchrun job: rank 0's backend, the other ranks' loop.

A run of N ranks (``fulmen train --nproc N``, or ``torchrun ... -m fulmen.cli.main train`` on each machine):

- rank 0 runs ``fulmen train`` as one process would (dispatcher, collector, publisher: all of Kafka) with
  :class:`RankZeroBackend` as its :class:`~fulmen.algorithm.trainer.base.TrainerBackend`;
- ranks 1..N-1 run :func:`serve`: no Kafka, no settings beyond the device; they build the same
  :class:`ShardedTrainer` and do what rank 0 tells them: ``build`` (the trainer config), ``step`` / ``sft_step``
  (their shard of the batch), ``save`` (take part in gathering the weights), ``stop``.

Commands travel as Python objects (``scatter_object_list``) over a gloo group of their own with a long timeout:
waiting for the next step's rollouts may take hours, which must not time a worker out. Training itself runs
on the default group (gloo on CPU; NCCL on CUDA) whose timeout is ``timeout_s``.

One step (``ShardedTrainer.step`` on every rank, its shard chosen by :func:`shard_by_tokens`: about equal
tokens, not rows): the loss of every micro-batch is reduced relative to the normaliser of the WHOLE batch, all
ranks (:meth:`ShardedTrainer._normalizer`: an all-reduce), and FSDP sums the ranks' gradients instead of
averaging them (gradient divide factor 1), so the gradient is the one-process gradient of the whole batch;
every rank runs as many micro-batches (an all-gather is inside each forward, so a rank short of them runs
empty ones, which add nothing); old logprobs are computed on every rank when any rank lacks them; clipping
uses the global norm (``clip_grad_norm_`` over the DTensor shards); AdamW steps its own shards. The step's
metrics are gathered to every rank and combined (:func:`combine_metrics`): the reported loss is the whole
batch's. A checkpoint is gathered to rank 0 (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``)
and written there once, as a Hugging Face directory, atomically; with LoRA the merged model.

Failure: a rank that dies ends the collective rank 0 waits in; :class:`RankZeroBackend` raises
:class:`DistributedTrainingError` saying which step was lost and how to resume, and the training loop publishes
no model version for it (its metrics are gathered only after every rank's optimizer step). torchrun's agent
stops the remaining ranks and names the one that failed. A rank that hangs is given up on after ``timeout_s``.

Imports torch, transformers and peft only (no pydantic): it runs on a GPU machine with nothing else installed.
"""

from __future__ import annotations

import dataclasses
import datetime
import heapq
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import FSDPModule, fully_shard

from fulmen.algorithm.batch import Sample, TrainBatch, collate
from fulmen.algorithm.trainer.base import StepMetrics, atomic_directory
from fulmen.algorithm.trainer.logprobs import token_logprobs
from fulmen.algorithm.trainer.torch_backend import TorchTrainer, TorchTrainerConfig, no_progress_bars
from fulmen.infra.torch_cuda import trusted_attention
from fulmen.schemas.errors import ConfigurationError, FulmenError

__all__ = [
    "COMMAND_TIMEOUT",
    "DistributedTrainingError",
    "RankZeroBackend",
    "ShardedTrainer",
    "World",
    "combine_metrics",
    "join",
    "launched",
    "model_here",
    "rank",
    "relaunch_command",
    "serve",
    "several_machines",
    "shard_by_tokens",
]

logger = logging.getLogger(__name__)

COMMAND_TIMEOUT = datetime.timedelta(days=7)
"""How long a worker waits for rank 0's next command (the rollouts of a step may take that long); a rank 0 that
dies ends the wait at once (its connections close), and torchrun's agent stops the workers anyway."""

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class DistributedTrainingError(FulmenError):
    """A rank failed or stopped answering during a collective: the step it was part of is lost."""


def launched() -> bool:
    """Whether this process is one rank of a torchrun job (torchrun's ``RANK`` and ``WORLD_SIZE`` are set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank() -> int:
    """This process's rank in its torchrun job (0 outside one)."""
    return int(os.environ.get("RANK", "0"))


def several_machines() -> bool:
    """Whether this torchrun job spans more than this machine (torchrun's ``LOCAL_WORLD_SIZE`` below its
    ``WORLD_SIZE``): ranks elsewhere may lack what rank 0 has on its disk."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(world))) < world


MULTI_MACHINE_VARIABLES = ("PET_NNODES", "PET_RDZV_ENDPOINT", "PET_MASTER_ADDR")
"""torchrun's own environment variables (``PET_<OPTION>``) that describe a job of several machines."""


def relaunch_command(nproc: int, args: Sequence[str]) -> list[str]:
    """The torchrun command running ``python <args>`` as ``nproc`` ranks on this machine: ``--standalone`` (a
    rendezvous on a free local port) unless torchrun's PET_* variables describe a job of several machines, which
    torchrun then reads (``PET_NNODES=2 PET_RDZV_BACKEND=c10d PET_RDZV_ENDPOINT=host:29400``)."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if not any(name in os.environ for name in MULTI_MACHINE_VARIABLES):
        command.append("--standalone")
    return [*command, *args]


@dataclass(frozen=True)
class World:
    """This process's place in the job and the groups it talks on (``control``: rank 0's commands, gloo)."""

    rank: int
    size: int
    local_rank: int
    device: torch.device
    control: dist.ProcessGroup

    @property
    def main(self) -> bool:
        return self.rank == 0


def join(device: str, timeout_s: float) -> World:
    """Join the job from torchrun's variables: the default group (gloo on CPU; NCCL for CUDA tensors, gloo for
    CPU ones, on CUDA) with ``timeout_s`` per collective, and a gloo group for the commands. Idempotent.

    ``device``: the trainer's device setting; on CUDA each rank takes ``cuda:<LOCAL_RANK>``. Raises
    ConfigurationError when torchrun's variables are missing or CUDA is asked for but absent.
    """
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise ConfigurationError(
            f"not a torchrun rank: {', '.join(missing)} unset; start with `fulmen train --nproc N` or under torchrun"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    resolved = rank_device(device, local_rank)
    trusted_attention(resolved)
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if resolved.type == "cuda" else "gloo"
        if resolved.type == "cuda":
            torch.cuda.set_device(resolved)
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    world = World(dist.get_rank(), dist.get_world_size(), local_rank, resolved, control)
    logger.info(
        "rank %d of %d (local rank %d, pid %d, %s) joined; device %s",
        world.rank,
        world.size,
        local_rank,
        os.getpid(),
        socket.gethostname(),
        resolved,
    )
    return world


def rank_device(name: str, local_rank: int) -> torch.device:
    """The device of the rank with ``local_rank``: the CPU, or ``cuda:<local_rank>`` for auto/cuda settings."""
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigurationError(f"device {name!r} asked for, but torch sees no CUDA GPU; set device cpu")
    if local_rank >= torch.cuda.device_count():
        raise ConfigurationError(
            f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible): run "
            "at most one rank per GPU (--nproc)"
        )
    return torch.device("cuda", local_rank)


def shard_by_tokens(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """Split row indices into ``ranks`` shards of about equal tokens (longest rows first, each to the shard with
    the fewest tokens so far; ties to the one with fewer rows, then the lower rank). Each shard keeps the rows'
    order; a shard may be empty when there are fewer rows than ranks."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1; got {ranks}")
    heap = [(0, 0, rank) for rank in range(ranks)]
    shards: list[list[int]] = [[] for _ in range(ranks)]
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        tokens, rows, rank = heapq.heappop(heap)
        shards[rank].append(index)
        heapq.heappush(heap, (tokens + lengths[index], rows + 1, rank))
    return [sorted(shard) for shard in shards]


def combine_metrics(parts: Sequence[StepMetrics]) -> StepMetrics:
    """The whole batch's metrics from each rank's: losses and token counts add up (each rank's loss is already
    relative to the whole batch), token-weighted means are re-weighted by the ranks' response tokens, the step
    took as long as the slowest rank; the gradient norm is global (the same on every rank)."""
    first = parts[0]
    tokens = sum(p.tokens for p in parts)
    input_tokens = sum(p.input_tokens for p in parts)
    train_s = max(p.train_s for p in parts)

    def mean(name: str, empty: float) -> float:
        return sum(getattr(p, name) * p.tokens for p in parts) / tokens if tokens else empty

    return dataclasses.replace(
        first,
        loss=sum(p.loss for p in parts),
        tokens=tokens,
        input_tokens=input_tokens,
        train_s=train_s,
        tokens_per_s=input_tokens * first.epochs / train_s if train_s > 0 else 0.0,
        clip_fraction=mean("clip_fraction", 0.0),
        kl=mean("kl", 0.0),
        approx_kl=mean("approx_kl", 0.0),
        ratio_mean=mean("ratio_mean", 1.0),
    )


class ShardedTrainer(TorchTrainer):
    """:class:`TorchTrainer` with its model (and reference model) sharded by FSDP2 over the job's ranks.

    Every rank builds one from the same config; ``step`` / ``sft_step`` are collectives (every rank calls them,
    each with its shard; see the module docstring) and return the WHOLE batch's metrics on every rank; ``save``
    is a collective that writes on rank 0 only.
    """

    def __init__(self, config: TorchTrainerConfig, world: World) -> None:
        super().__init__(dataclasses.replace(config, device=str(world.device)))
        self.world = world
        self.response_only = False  # the root FSDP unit's forward gathers the head and embeddings: run it whole
        shard(self.model)
        if self.reference is not None and self.reference.model is not self.model:
            shard(self.reference.model)  # the frozen copy of a full-weight run; LoRA's reference is the model
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                sum_gradients(module)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]  # the sharded parameters
        self.optimizer = torch.optim.AdamW(
            self.trainable, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )

    def step(self, batch: TrainBatch | Sequence[Sample]) -> StepMetrics:
        """This rank's part of one policy update; the whole batch's metrics (every rank must call it)."""
        return self._whole(super().step, batch)

    def sft_step(self, batch: TrainBatch | Sequence[Sample]) -> StepMetrics:
        """This rank's part of one supervised update; the whole batch's metrics (every rank must call it)."""
        return self._whole(super().sft_step, batch)

    def save(self, directory: Path | str) -> Path:
        """Gather the full weights to rank 0 (every rank must call it) and write them there as a Hugging Face
        directory, atomically (with LoRA the merged model); returns ``directory`` on every rank."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        directory = Path(directory)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)  # on rank 0 only (cpu_offload)
        if self.world.main:
            with atomic_directory(directory) as staging, no_progress_bars():
                plain_model(self.model, state, lora=self.config.lora is not None).save_pretrained(staging)
                if self.tokenizer is not None:
                    self.tokenizer.save_pretrained(staging)
            logger.info("saved the gathered model after step %d to %s", self.steps, directory)
        dist.barrier(group=self.world.control)  # the directory exists before any rank goes on
        return directory

    # -- the hooks of TorchTrainer -------------------------------------------------------------------------------

    def _normalizer(self, mask: Tensor, mode: str) -> float:
        local = torch.tensor([super()._normalizer(mask, mode)], dtype=torch.float64, device=self.device)
        dist.all_reduce(local)
        return float(local)

    def _micro_batches(self, batch: TrainBatch) -> list[TrainBatch]:
        micro = super()._micro_batches(batch)
        count = torch.tensor([len(micro)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return micro + [self._empty_batch() for _ in range(int(count) - len(micro))]

    @torch.no_grad()
    def _with_old_logprobs(self, mb: TrainBatch) -> TrainBatch:
        """Fill missing old logprobs; the forward runs on every rank when any rank's micro-batch needs it."""
        needed = self.config.recompute_old_logprobs or not bool(mb.has_old_logprobs.all())
        flag = torch.tensor([int(needed)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if needed or not int(flag):
            return super()._with_old_logprobs(mb)
        self.model.eval()  # another rank needs them: take part in the forward's all-gathers, keep ours
        with self._autocast():
            token_logprobs(self.model, mb.input_ids, mb.attention_mask)
        return mb

    # -- internals -----------------------------------------------------------------------------------------------

    def _whole(self, local_step, batch: TrainBatch | Sequence[Sample]) -> StepMetrics:
        empty = not isinstance(batch, TrainBatch) and len(batch) == 0
        local = local_step(self._empty_batch() if empty else batch)
        if empty:
            local = dataclasses.replace(local, input_tokens=0)
        parts: list[StepMetrics | None] = [None] * self.world.size
        dist.all_gather_object(parts, local, group=self.world.control)
        return combine_metrics([part for part in parts if part is not None])

    def _empty_batch(self) -> TrainBatch:
        """One row of two padding tokens that carries no loss: a rank's share of a collective it has no rows for."""
        ones = torch.ones((1, 2), dtype=torch.long, device=self.device)
        zeros = torch.zeros((1, 2), dtype=torch.float32, device=self.device)
        return TrainBatch(
            input_ids=ones * self.pad_id,
            attention_mask=ones,
            response_mask=zeros,
            old_logprobs=zeros,
            has_old_logprobs=torch.ones(1, dtype=torch.bool, device=self.device),
            advantages=torch.zeros(1, dtype=torch.float32, device=self.device),
        )


def shard(model: torch.nn.Module) -> None:
    """``fully_shard`` each decoder layer (the classes the model names in ``_no_split_modules``), then the root
    (embeddings, final norm, head: tied weights stay in one group)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = set(getattr(base, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in layers:
            fully_shard(module)
    fully_shard(model)


def sum_gradients(module: FSDPModule) -> None:
    """Make FSDP sum the ranks' gradients instead of averaging them (the losses are whole-batch already): divide
    factor 1, with a plain SUM where the collective has no PREMUL_SUM (gloo). Older torch names the first
    ``set_reduce_scatter_divide_factor`` and has no second (NCCL needs none)."""
    set_factor = getattr(module, "set_gradient_divide_factor", None) or module.set_reduce_scatter_divide_factor
    set_factor(1.0)
    force_sum = getattr(module, "set_force_sum_reduction_for_comms", None)
    if force_sum is not None:
        force_sum(True)


def plain_model(model: torch.nn.Module, state: dict[str, Tensor], *, lora: bool) -> torch.nn.Module:
    """A plain (unsharded, CPU) Hugging Face model holding ``state``, the full state dict of ``model``; with
    ``lora``, the adapter merged into the base weights. Built on the meta device, so the weights are not copied."""
    from transformers import AutoModelForCausalLM

    base = model.get_base_model() if lora else model
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(base.config, dtype=torch.float32)
        if lora:
            from peft import get_peft_model

            skeleton = get_peft_model(skeleton, model.peft_config["default"])
    if lora:  # merging adds the adapter into the base weights IN PLACE: never into the live model's tensors (a
        # shard that is the whole tensor, as with one rank on the CPU, comes back from the gather uncopied)
        state = {name: value.clone() if ".base_layer." in name else value for name, value in state.items()}
    skeleton.load_state_dict(state, assign=True)
    # gathered separately, tied weights (embeddings and head) arrive as two equal tensors: tie them again first
    # (peft would take them for untied after the merge and save the head twice, with tie_word_embeddings=false)
    (skeleton.get_base_model() if lora else skeleton).tie_weights()
    return (skeleton.merge_and_unload() if lora else skeleton).eval()


# -- rank 0 and the workers ---------------------------------------------------------------------------------------

_STOP, _BUILD, _SAVE = "stop", "build", "save"
_STEPS = ("step", "sft_step")


class RankZeroBackend:
    """Rank 0's :class:`~fulmen.algorithm.trainer.base.TrainerBackend`: hands each rank its shard of a batch and
    the commands, takes its own part, returns the whole batch's metrics. :meth:`start` builds it (and the workers'
    trainers); :meth:`close` lets the workers end. Raises :class:`DistributedTrainingError` when a rank fails."""

    def __init__(self, trainer: ShardedTrainer, world: World) -> None:
        self.trainer = trainer
        self.world = world
        self.broken = False

    @classmethod
    def start(cls, config: TorchTrainerConfig, world: World, model_uri: str | None = None) -> RankZeroBackend:
        """Tell every rank to build a :class:`ShardedTrainer` from ``config``, build rank 0's; ConfigurationError
        naming the ranks that could not (their error). ``model_uri``: the object-store copy of
        ``config.model_path``, which a rank on a machine without that directory fetches (:func:`model_here`)."""
        _send(world, _BUILD, [(config, model_uri)] * world.size)
        trainer = error = None
        try:
            trainer = ShardedTrainer(config, world)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        failures = _gather_build_errors(world, error)
        if failures:
            raise ConfigurationError("building the sharded trainer failed on " + "; ".join(failures))
        logger.info("sharded trainer ready on %d ranks (%s)", world.size, world.device.type)
        return cls(trainer, world)

    def step(self, batch: TrainBatch | Sequence[Sample]) -> StepMetrics:
        return self._run("step", batch)

    def sft_step(self, batch: TrainBatch | Sequence[Sample]) -> StepMetrics:
        return self._run("sft_step", batch)

    def save(self, directory: Path | str) -> Path:
        what = f"saving the checkpoint after step {self.trainer.steps}"
        return self._command(what, _SAVE, [directory] * self.world.size, lambda: self.trainer.save(directory))

    def close(self) -> None:
        """Let the workers return from :func:`serve` (unless a rank failed: torchrun ends them) and leave."""
        if not self.broken:
            try:
                _send(self.world, _STOP, [None] * self.world.size)
            except (RuntimeError, dist.DistError) as exc:
                logger.warning("could not tell the workers to stop: %s", exc)
        _leave()

    def _run(self, kind: str, batch: TrainBatch | Sequence[Sample]) -> StepMetrics:
        if self.world.device.type == "cuda":
            torch.cuda.set_device(self.world.device)  # this may be a worker thread of the training loop
        if not isinstance(batch, TrainBatch):
            collate(batch, self.trainer.pad_id, self.trainer.config.max_len)  # PoisonInputError here, not on a rank
            lengths = [sample.length for sample in batch]
        else:
            lengths = batch.attention_mask.sum(dim=-1).tolist()
        shards = [_take(batch, rows) for rows in shard_by_tokens(lengths, self.world.size)]
        what = f"{kind.replace('_', ' ')} {self.trainer.steps + 1}"
        return self._command(what, kind, shards, lambda: getattr(self.trainer, kind)(shards[0]))

    def _command(self, what: str, kind: str, payloads: list[object], own_part):
        """Send ``kind`` with each rank's payload, then do rank 0's part (``own_part()``); its result. A collective
        that fails because another rank is gone or silent becomes a :class:`DistributedTrainingError`."""
        try:
            _send(self.world, kind, payloads)
            return own_part()
        except (RuntimeError, dist.DistError) as exc:
            if not _is_collective_failure(exc):
                raise
            self.broken = True
            raise DistributedTrainingError(
                f"{what} failed: another of the {self.world.size} ranks stopped answering ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); no model version is published for it. torchrun's "
                f"summary names the rank that failed; start `fulmen train` again to resume from the last checkpoint"
            ) from exc


def serve(world: World) -> None:
    """A worker rank (not rank 0): build the trainer when told, run each command rank 0 sends, return on stop.

    An error in a command ends the process with its traceback (torchrun names the rank); rank 0 then fails too.
    SIGINT and SIGTERM are ignored meanwhile: rank 0 decides when the run stops (torchrun's agent kills what is
    left 30 s after it forwarded a signal).
    """
    if world.main:
        raise ValueError("rank 0 drives the workers; serve() runs on the other ranks")
    trainer: ShardedTrainer | None = None
    # Ctrl-C and SIGTERM reach every rank (the terminal's process group; torchrun forwards them): rank 0 stops the
    # run after the step in progress and then tells this rank to stop; dying here would lose that step
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            kind, payload = _receive(world)
            if kind == _STOP:
                logger.info("rank %d: stopping, as rank 0 asked", world.rank)
                return
            if kind == _BUILD:
                trainer = _build_or_report(*payload, world=world)
            elif trainer is None:
                raise RuntimeError(f"rank 0 sent {kind!r} before {_BUILD!r}")
            elif kind == _SAVE:
                trainer.save(payload)
            elif kind in _STEPS:
                getattr(trainer, kind)(payload)
            else:
                raise RuntimeError(f"unknown command {kind!r} from rank 0")
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        _leave()


def _send(world: World, kind: str, payloads: list[object]) -> None:
    dist.scatter_object_list([None], [(kind, payload) for payload in payloads], src=0, group=world.control)


def _receive(world: World) -> tuple[str, object]:
    received: list[object] = [None]
    dist.scatter_object_list(received, None, src=0, group=world.control)
    kind, payload = received[0]  # type: ignore[misc]
    return kind, payload


def model_here(config: TorchTrainerConfig, model_uri: str | None) -> TorchTrainerConfig:
    """``config`` with a model this machine has: as it is when ``config.model_path`` is a directory here (or a
    name, not a path), else with the copy at ``model_uri`` fetched into ``$FULMEN_HOME/model-cache`` (a rank on
    another machine than rank 0's: a resumed version, or the base model, which rank 0 put in the object store).
    ConfigurationError when the path is missing here and there is no copy to fetch."""
    path = Path(config.model_path)
    if path.is_dir() or not path.is_absolute():
        return config
    if not model_uri:
        raise ConfigurationError(
            f"the model {path} is not on this machine ({socket.gethostname()}): put it at the same path on every "
            "machine, or set FULMEN_TRAIN_CHECKPOINT_URI (s3://...) so that the ranks fetch it from the object store"
        )
    from fulmen.infra.objectstore import download_dir  # obstore: only on a rank that fetches

    home = Path(os.environ.get("FULMEN_HOME") or Path.home() / ".local" / "share" / "fulmen").expanduser()
    local = download_dir(model_uri, home / "model-cache")
    logger.info("rank %s: the model %s is not on this machine; fetched %s into %s", rank(), path, model_uri, local)
    return dataclasses.replace(config, model_path=str(local))


def _build_or_report(config: TorchTrainerConfig, model_uri: str | None, *, world: World) -> ShardedTrainer:
    try:
        trainer, error = ShardedTrainer(model_here(config, model_uri), world), None
    except Exception as exc:
        trainer, error = None, f"{type(exc).__name__}: {exc}"
    if _gather_build_errors(world, error):
        raise SystemExit(f"rank {world.rank}: building the trainer failed: {error or 'on another rank'}")
    return trainer  # type: ignore[return-value]


def _gather_build_errors(world: World, error: str | None) -> list[str]:
    """Every rank's build error (None when it built), gathered on every rank; the failures, named by rank."""
    errors: list[object] = [None] * world.size
    dist.all_gather_object(errors, (socket.gethostname(), error), group=world.control)
    return [f"rank {rank} ({host}): {text}" for rank, (host, text) in enumerate(errors) if text]  # type: ignore[misc]


def _take(batch: TrainBatch | Sequence[Sample], rows: list[int]) -> TrainBatch | list[Sample]:
    """The given rows of a batch (a TrainBatch cut to its own longest row; samples as a list)."""
    if not isinstance(batch, TrainBatch):
        return [batch[i] for i in rows]
    index = torch.tensor(rows, dtype=torch.long, device=batch.input_ids.device)
    taken = TrainBatch(**{f.name: getattr(batch, f.name)[index] for f in dataclasses.fields(batch)})
    return taken.rows(0, taken.size) if rows else []  # type: ignore[return-value]


def _is_collective_failure(exc: BaseException) -> bool:
    """A peer gone or silent (gloo/NCCL errors, timeouts), not an error of this rank's own computation."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return any(mark in text for mark in ("gloo", "Gloo", "NCCL", "Connection closed", "Connection reset", "timed out"))


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
