"""Typed training batches: :class:`Sample` (one transition with its advantage) -> :class:`TrainBatch` tensors.

Layout of a :class:`TrainBatch` of ``B`` rows, ``T`` positions (``T`` = the longest prompt + response)::

    input_ids       [B, T] long    prompt tokens, then response tokens, then pad_id (right padding)
    attention_mask  [B, T] long    1 on prompt and response tokens, 0 on padding
    response_mask   [B, T] float   1 on response tokens only: the tokens that carry the loss
    old_logprobs    [B, T] float   the PPO ratio's denominator (pi_old) for token t, at position t: as collated,
                                   the behaviour logprobs; the proximal ones once the trainer recomputes them
                                   (see below); 0 outside the response and on rows without any yet
    has_old_logprobs [B]   bool    whether the row's old logprobs are filled (recorded, or recomputed)
    behaviour_logprobs [B, T] float  logprob of token t under the policy that SAMPLED it (mu), as the inference
                                   backend recorded it; never overwritten; 0 where not recorded
    has_behaviour_logprobs [B] bool  whether the row's behaviour logprobs were recorded
    advantages      [B]    float   one advantage per row

Logprobs are aligned to tokens: position t holds log p(token_t | tokens_<t), so position 0 (which no token
predicts) is never part of a response; every prompt has at least one token.

Missing old logprobs: a sample whose backend did not record logprobs (``old_logprobs=None``) is collated with
zeros and ``has_old_logprobs=False``; the trainer computes them with the current model, without gradient,
BEFORE its first update on the batch (:meth:`TrainBatch.with_old_logprobs`), so the first epoch starts at
ratio 1 for those rows.

Behaviour and proximal logprobs (see ``fulmen.algorithm.rl.corrections``): with an off-policy correction (or
``recompute_old_logprobs``) the trainer overwrites EVERY row's ``old_logprobs`` with the proximal policy's (the
weights at the start of the step), and the correction weighs each token by ``pi_prox / mu`` from
``old_logprobs`` and ``behaviour_logprobs``. Without one, ``old_logprobs`` stay the behaviour logprobs (the
sampler is taken as the old policy) and ``behaviour_logprobs`` are not read. Imports only torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fulmen.schemas.errors import PoisonInputError

__all__ = ["Sample", "TrainBatch", "collate"]


@dataclass(frozen=True)
class Sample:
    """One LLM call to train on: the exact token ids, the logprobs recorded at sampling time, its advantage.

    ``old_logprobs``: one per response token (the logprob of that token when it was sampled: the behaviour
    policy's), or ``None`` when the inference backend did not record them. ``group_id``: the GRPO group (same
    prompt); kept for reports, the advantage already includes it. ``model_version``: the version that produced
    the response.
    """

    prompt_token_ids: Sequence[int]
    response_token_ids: Sequence[int]
    advantage: float = 0.0
    old_logprobs: Sequence[float] | None = None
    group_id: str = ""
    model_version: int | None = None
    agent: str = ""  # the agent that made the call (per-agent adapters train each agent's samples apart)

    @property
    def length(self) -> int:
        """Prompt plus response tokens."""
        return len(self.prompt_token_ids) + len(self.response_token_ids)


_ROW_FIELDS = ("input_ids", "attention_mask", "response_mask", "old_logprobs", "behaviour_logprobs")
_ROW_VALUES = ("has_old_logprobs", "has_behaviour_logprobs", "advantages")


@dataclass(frozen=True)
class TrainBatch:
    """The tensors of one training batch; shapes and dtypes in the module docstring, checked on creation."""

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    old_logprobs: Tensor
    has_old_logprobs: Tensor
    advantages: Tensor
    behaviour_logprobs: Tensor = None  # type: ignore[assignment]  # default: a copy of old_logprobs
    has_behaviour_logprobs: Tensor = None  # type: ignore[assignment]  # default: a copy of has_old_logprobs

    def __post_init__(self) -> None:
        if self.behaviour_logprobs is None:  # built from old logprobs alone: the sampler's are the old ones
            object.__setattr__(self, "behaviour_logprobs", self.old_logprobs.clone())
        if self.has_behaviour_logprobs is None:
            object.__setattr__(self, "has_behaviour_logprobs", self.has_old_logprobs.clone())
        if self.input_ids.ndim != 2 or self.input_ids.dtype != torch.long:
            raise ValueError(f"input_ids must be long [B, T]; got {self.input_ids.dtype} {list(self.input_ids.shape)}")
        shape = tuple(self.input_ids.shape)
        for name in _ROW_FIELDS[1:]:
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"{name} must be [B, T] = {list(shape)}; got {list(getattr(self, name).shape)}")
        for name in _ROW_VALUES:
            if tuple(getattr(self, name).shape) != shape[:1]:
                raise ValueError(f"{name} must be [B] = [{shape[0]}]; got {list(getattr(self, name).shape)}")
        if not all(
            getattr(self, name).is_floating_point() for name in ("old_logprobs", "behaviour_logprobs", "advantages")
        ):
            raise ValueError("old_logprobs, behaviour_logprobs and advantages must be float tensors")

    @property
    def size(self) -> int:
        """Rows (B)."""
        return int(self.input_ids.shape[0])

    @property
    def response_tokens(self) -> int:
        """Tokens that carry the loss (sum of response_mask)."""
        return int(self.response_mask.sum())

    @property
    def input_tokens(self) -> int:
        """Non-padding tokens (prompt + response), i.e. what a forward pass processes usefully."""
        return int(self.attention_mask.sum())

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch on ``device``."""
        return TrainBatch(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})

    def rows(self, start: int, stop: int) -> TrainBatch:
        """Rows ``start:stop``, cut to their own longest row (trailing all-padding columns dropped).

        Dropping right padding changes no logprob: a causal model's output at t depends only on tokens <= t.
        """
        width = int(self.attention_mask[start:stop].sum(dim=-1).max()) if stop > start else 0
        return TrainBatch(
            **{name: getattr(self, name)[start:stop, :width] for name in _ROW_FIELDS},
            **{name: getattr(self, name)[start:stop] for name in _ROW_VALUES},
        )

    def split(self, micro_batch_size: int) -> list[TrainBatch]:
        """Consecutive micro-batches of at most ``micro_batch_size`` rows, each cut to its longest row."""
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1; got {micro_batch_size}")
        return [self.rows(i, min(i + micro_batch_size, self.size)) for i in range(0, self.size, micro_batch_size)]

    def by_length(self) -> TrainBatch:
        """The same rows, shortest first (stable): consecutive micro-batches then hold rows of similar length, so
        cutting each to its longest row leaves little padding. A whole-batch loss is the same in any row order."""
        order = torch.argsort(self.attention_mask.sum(dim=-1), stable=True)
        return TrainBatch(**{f.name: getattr(self, f.name)[order] for f in dataclasses.fields(self)})

    def by_prefix(self) -> TrainBatch:
        """The same rows in lexicographic order of their tokens: rows that share a prefix become neighbours (a
        GRPO group's calls, an episode's later calls after its earlier ones), so consecutive micro-batches hold
        whole prefix trees (:mod:`fulmen.algorithm.trainer.prefix_tree`)."""
        lengths = self.attention_mask.sum(dim=-1).tolist()
        rows = [row[:length] for row, length in zip(self.input_ids.tolist(), lengths, strict=True)]
        order = torch.tensor(sorted(range(self.size), key=rows.__getitem__), dtype=torch.long)
        return TrainBatch(
            **{f.name: getattr(self, f.name)[order.to(self.input_ids.device)] for f in dataclasses.fields(self)}
        )

    def split_by_tree(self, max_nodes: int) -> list[TrainBatch]:
        """Consecutive micro-batches whose rows' prefix tree holds at most ``max_nodes`` tokens (a longer row is a
        micro-batch alone), each cut to its longest row. In lexicographic order (:meth:`by_prefix`) a row adds its
        length minus its common prefix with the row before it to the tree."""
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1; got {max_nodes}")
        lengths = self.attention_mask.sum(dim=-1).tolist()
        rows = [row[:length] for row, length in zip(self.input_ids.tolist(), lengths, strict=True)]
        parts, start, nodes = [], 0, 0
        for index, row in enumerate(rows):
            added = len(row) - (_common_prefix(rows[index - 1], row) if index > start else 0)
            if index > start and nodes + added > max_nodes:
                parts.append(self.rows(start, index))
                start, added = index, len(row)
                nodes = 0
            nodes += added
        parts.append(self.rows(start, self.size))
        return parts

    def with_old_logprobs(self, computed: Tensor, *, overwrite: bool = False) -> TrainBatch:
        """Fill the rows without recorded logprobs (all rows when ``overwrite``) from ``computed [B, T]``.

        ``computed`` is masked to the response tokens; afterwards every row counts as having old logprobs.
        """
        if computed.shape != self.old_logprobs.shape:
            raise ValueError(f"computed logprobs must be {list(self.old_logprobs.shape)}; got {list(computed.shape)}")
        take = torch.ones_like(self.has_old_logprobs) if overwrite else ~self.has_old_logprobs
        filled = computed.detach().to(self.old_logprobs.dtype) * self.response_mask
        old = torch.where(take[:, None], filled, self.old_logprobs)
        return dataclasses.replace(self, old_logprobs=old, has_old_logprobs=torch.ones_like(self.has_old_logprobs))


def _common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):  # the shorter one bounds it
        if x != y:
            break
        count += 1
    return count


def collate(samples: Sequence[Sample], pad_id: int, max_len: int | None = None) -> TrainBatch:
    """Build a right-padded :class:`TrainBatch` (on CPU) from ``samples``, in their order.

    Raises PoisonInputError naming the sample when one is longer than ``max_len``, has an empty prompt or
    response, or has a number of old logprobs different from its response tokens.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    for index, sample in enumerate(samples):
        _check_sample(index, sample, max_len)
    width = max(sample.length for sample in samples)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
    response_mask = torch.zeros((len(samples), width), dtype=torch.float32)
    old_logprobs = torch.zeros((len(samples), width), dtype=torch.float32)
    for row, sample in enumerate(samples):
        start, stop = len(sample.prompt_token_ids), sample.length
        input_ids[row, :stop] = torch.tensor([*sample.prompt_token_ids, *sample.response_token_ids])
        attention_mask[row, :stop] = 1
        response_mask[row, start:stop] = 1.0
        if sample.old_logprobs is not None:
            old_logprobs[row, start:stop] = torch.tensor(list(sample.old_logprobs), dtype=torch.float32)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        old_logprobs=old_logprobs,
        has_old_logprobs=torch.tensor([s.old_logprobs is not None for s in samples], dtype=torch.bool),
        advantages=torch.tensor([float(s.advantage) for s in samples], dtype=torch.float32),
    )


def _check_sample(index: int, sample: Sample, max_len: int | None) -> None:
    where = f"sample {index} (group {sample.group_id!r})"
    if not sample.prompt_token_ids or not sample.response_token_ids:
        raise PoisonInputError(
            f"{where}: empty prompt or response ({len(sample.prompt_token_ids)} prompt, "
            f"{len(sample.response_token_ids)} response tokens); drop it before training"
        )
    if max_len is not None and sample.length > max_len:
        raise PoisonInputError(
            f"{where}: {len(sample.prompt_token_ids)} prompt + {len(sample.response_token_ids)} response tokens "
            f"= {sample.length} > max_len {max_len}; drop or truncate it, or raise max_len"
        )
    if sample.old_logprobs is not None and len(sample.old_logprobs) != len(sample.response_token_ids):
        raise PoisonInputError(
            f"{where}: {len(sample.old_logprobs)} old logprobs for {len(sample.response_token_ids)} response tokens"
        )
