"""Token logprobs of a causal LM: ``token_logprobs(model, input_ids, attention_mask) -> [B, T]``.

Alignment: position t holds ``log p(input_ids[t] | input_ids[:t])``; position 0 (predicted by nothing) and
padding positions hold 0. This is the layout of :class:`fulmen.algorithm.batch.TrainBatch` (``old_logprobs``).

Memory: the model's logits ``[B, T, V]`` are the big tensor (V is 150k for Qwen). A plain
``log_softmax(logits.float()).gather(...)`` would materialise a float32 ``[B, T, V]`` copy and keep it for the
backward pass. :func:`gather_logprobs` instead computes, in float32 and a chunk of rows at a time, only the
per-row ``logsumexp`` and the target logit; its backward recomputes the softmax chunk by chunk. So beyond the
logits themselves (which the model produces anyway) it holds ``[B, T]`` floats plus one float32 chunk.

Only the response (``response_mask``): the loss reads no other position, so for a model whose logits are exactly
``lm_head(decoder(...))`` (:data:`PLAIN_HEAD_ARCHITECTURES`: Llama, Qwen2/3, Mistral; :func:`plain_head`) the
output projection and the softmax run on the positions that predict a response token and nowhere else: the
prompt's and the padding's ``[., V]`` logits (a vocabulary of 49k-150k per position, most of an agent's tokens
being prompt) are never made. Other positions then hold 0, and the values on the response are the same.

Packing (same models, same path): a right-padded ``[B, T]`` batch whose rows differ in length is run as ONE row
of its ``N`` real tokens, each sequence's positions starting again at 0 and no attention mask: transformers then
builds the block-diagonal causal mask from the position ids (``find_packed_sequence_indices``), so no token sees
another sequence's and the padding is never computed. Attention over the packed row costs ``N^2`` query-key
pairs against ``B T^2`` padded, so :func:`worth_packing` packs only when the tokens saved outweigh that (a cost
model of one decoder layer) and the packed mask stays small; long rollouts keep their padded rows.

Shared prefixes (same models; sdpa or eager attention): rows that start alike (a GRPO group's calls share their
prompt; an episode's later call repeats its earlier turns) run as their prefix tree (:mod:`.prefix_tree`): one
packed row of the tree's nodes, each at its depth, under a mask that lets a node see its ancestors only. Every
shared token is computed once, and values and gradients are those of the separate rows. Chosen by the same cost
model when the tree is smaller than the rows' tokens (:func:`shared_prefix_tree`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fulmen.algorithm.trainer.prefix_tree import PrefixTree, build_prefix_tree

__all__ = [
    "CHUNK_ELEMENTS",
    "PACKED_MASK_ELEMENTS",
    "PLAIN_HEAD_ARCHITECTURES",
    "TREE_ATTENTION",
    "Work",
    "gather_logprobs",
    "plain_head",
    "shared_prefix_tree",
    "token_logprobs",
    "worth_packing",
]

CHUNK_ELEMENTS = 1 << 25  # float32 elements per chunk (128 MiB): rows per chunk = CHUNK_ELEMENTS // vocab
# Causal LMs whose forward is ``logits = lm_head(model(...).last_hidden_state)``: no logit scaling or softcapping.
PLAIN_HEAD_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"})
PACKED_MASK_ELEMENTS = 1 << 24  # the packed row's [N, N] mask at most (16M: N <= 4096); longer batches stay padded
TREE_ATTENTION = frozenset({"sdpa", "eager"})  # attention implementations that take a custom [B, 1, Q, K] mask


class _GatherLogprobs(torch.autograd.Function):
    """``out[n] = logits[n, target[n]] - logsumexp(logits[n])`` over rows n of a ``[N, V]`` view, chunked."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor) -> Tensor:  # type: ignore[override]
        rows = max(1, CHUNK_ELEMENTS // logits.shape[-1])
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for start in range(0, logits.shape[0], rows):
            chunk = logits[start : start + rows].float()
            lse[start : start + rows] = torch.logsumexp(chunk, dim=-1)
            picked = chunk.gather(1, targets[start : start + rows, None]).squeeze(1)
            out[start : start + rows] = picked - lse[start : start + rows]
        ctx.save_for_backward(logits, targets, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        logits, targets, lse = ctx.saved_tensors
        rows = max(1, CHUNK_ELEMENTS // logits.shape[-1])
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], rows):
            stop = start + rows
            g = grad_out[start:stop, None].float()
            # float32 logits: computed in place in ``grad`` (no [rows, V] temporaries); else in one float32 chunk.
            chunk_grad = grad[start:stop] if grad.dtype == torch.float32 else None
            chunk_grad = torch.sub(logits[start:stop].float(), lse[start:stop, None], out=chunk_grad)
            chunk_grad.exp_().mul_(-g)  # -softmax * g
            chunk_grad.scatter_add_(1, targets[start:stop, None], g)  # + onehot(target) * g
            if grad.dtype != torch.float32:
                grad[start:stop] = chunk_grad.to(grad.dtype)
        return grad, None


def gather_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """``log_softmax(logits)[..., target]`` as float32 ``[...]`` for logits ``[..., V]``, targets ``[...]`` long.

    Equal to ``torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]`` (values and
    gradients) without materialising the float32 ``log_softmax``.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits [..., V] and targets [...] disagree: {list(logits.shape)}, {list(targets.shape)}")
    flat = _GatherLogprobs.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return flat.view(targets.shape)


def plain_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """``(decoder, lm_head)`` of a Hugging Face causal LM (or a PEFT model around one, its adapters applied in
    place) whose logits are exactly ``lm_head(decoder(...).last_hidden_state)``; None for any other model (which
    then runs whole). A caller whose model is wrapped (FSDP: the root's forward gathers the weights) must not
    reach past the wrapper."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    kind = type(inner)
    if kind.__name__ not in PLAIN_HEAD_ARCHITECTURES or not kind.__module__.startswith("transformers.models."):
        return None  # another head, or remote code under a known name
    decoder, head = inner.get_decoder(), inner.get_output_embeddings()
    return (decoder, head) if decoder is not None and head is not None else None


@dataclass
class Work:
    """What :func:`token_logprobs` computed, summed over calls: ``tokens`` through the decoder (tree nodes, packed
    tokens, or padded rows x width) and ``head_rows`` through the output projection."""

    tokens: int = 0
    head_rows: int = 0

    def add(self, tokens: int, head_rows: int) -> None:
        self.tokens += tokens
        self.head_rows += head_rows


def token_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_mask: Tensor | None = None,
    work: Work | None = None,
) -> Tensor:
    """Logprob of every token under ``model``: float32 ``[B, T]``, 0 at position 0 and on padding.

    ``input_ids``, ``attention_mask``: ``[B, T]``, right-padded. ``response_mask`` (``[B, T]``, optional): the
    tokens wanted; with it, and a model :func:`plain_head` knows, only those positions are computed (the others
    hold 0). Gradient flows to the model unless called under ``torch.no_grad()``. Runs the model in whatever
    autocast context the caller set up. ``work``, when given, counts what was computed.
    """
    work = work if work is not None else Work()
    parts = plain_head(model) if response_mask is not None else None
    if parts is not None:
        hidden_size = getattr(getattr(model, "config", None), "hidden_size", None)
        wanted = response_mask.bool()
        tree = shared_prefix_tree(model, input_ids, attention_mask)
        if tree is not None:
            work.add(tree.size, int(wanted[:, 1:].sum()))
            return _tree_logprobs(*parts, tree, input_ids, wanted, _tree_mask(model, tree))
        pack = hidden_size is not None and worth_packing(attention_mask.sum(dim=-1), input_ids.shape[1], hidden_size)
        work.add(int(attention_mask.sum()) if pack else input_ids.numel(), int(wanted[:, 1:].sum()))
        return _response_logprobs(*parts, input_ids, attention_mask, wanted, pack=pack)
    work.add(input_ids.numel(), input_ids.numel())
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    # logits[:, t] predicts token t + 1; the last position predicts nothing we keep (its target is a dummy).
    next_tokens = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)
    with torch.autocast(device_type=logits.device.type, enabled=False):
        predicted = gather_logprobs(logits, next_tokens)
    shifted = torch.cat([predicted.new_zeros(predicted.shape[0], 1), predicted[:, :-1]], dim=1)
    return shifted * attention_mask.to(shifted.dtype)


def worth_packing(lengths: Tensor, width: int, hidden_size: int) -> bool:
    """Whether rows of these ``lengths`` (right-padded to ``width``) run faster packed into one row.

    Per decoder layer and token the projections cost ~``24 d^2`` multiply-adds (attention 4 d^2, an MLP of ~4 d
    width 8 d^2, both ways); attention scores and values ~``4 d`` per query-key pair. Packed: ``N`` tokens and
    ``N^2`` pairs (the block mask is applied to a full square); padded: ``B T`` tokens and ``B T^2`` pairs. Pack
    when ``6 d N + N^2 < 6 d B T + B T^2``, ``N > 0`` and the packed mask holds at most
    :data:`PACKED_MASK_ELEMENTS`.
    """
    rows, tokens = lengths.numel(), int(lengths.sum())
    if rows < 2 or tokens == rows * width or tokens * tokens > PACKED_MASK_ELEMENTS:
        return False
    return 6 * hidden_size * tokens + tokens * tokens < 6 * hidden_size * rows * width + rows * width * width


def shared_prefix_tree(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor) -> PrefixTree | None:
    """The rows' prefix tree (:mod:`.prefix_tree`) when running it saves work over both the padded rows and the
    packed row (the cost model of :func:`worth_packing`, with the tree's ``N`` nodes as its tokens), its mask stays
    within :data:`PACKED_MASK_ELEMENTS`, and the model's attention takes a custom mask (sdpa, eager); else None."""
    config = getattr(model, "config", None)
    hidden_size = getattr(config, "hidden_size", None)
    if hidden_size is None or getattr(config, "_attn_implementation", None) not in TREE_ATTENTION or len(input_ids) < 2:
        return None
    lengths = attention_mask.sum(dim=-1)
    rows, width, tokens = lengths.numel(), input_ids.shape[1], int(lengths.sum())
    tree = build_prefix_tree(input_ids, attention_mask)
    nodes = tree.size
    if nodes >= tokens or nodes * nodes > PACKED_MASK_ELEMENTS:
        return None  # nothing shared (plain packing does as well), or too large a mask

    def cost(n: int, pairs: int) -> int:
        return 6 * hidden_size * n + pairs

    best_other = min(cost(rows * width, rows * width * width), cost(tokens, tokens * tokens))
    return tree if cost(nodes, nodes * nodes) < best_other else None


def _tree_mask(model: torch.nn.Module, tree: PrefixTree) -> Tensor:
    """The tree's ``[1, 1, N, N]`` mask as the model's attention takes it: bool (sdpa), additive float (eager)."""
    allowed = tree.attention_mask()[None, None]
    if model.config._attn_implementation == "sdpa":
        return allowed
    dtype = (
        torch.get_autocast_dtype(allowed.device.type)
        if torch.is_autocast_enabled(allowed.device.type)
        else (next(model.parameters()).dtype)
    )
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def _tree_logprobs(
    decoder: torch.nn.Module, head: torch.nn.Module, tree: PrefixTree, input_ids: Tensor, wanted: Tensor, mask: Tensor
) -> Tensor:
    """The logprobs of the ``wanted`` tokens with the decoder run once over the rows' prefix tree: each row's
    token t is predicted by the state of its node at t - 1 (rows through one node share its state)."""
    predictors = torch.zeros_like(wanted)
    predictors[:, :-1] = wanted[:, 1:]
    wanted = wanted.clone()
    wanted[:, 0] = False
    states = decoder(
        input_ids=tree.token_ids[None], position_ids=tree.depth[None], attention_mask=mask, use_cache=False
    ).last_hidden_state[0]
    logits = head(states[tree.node_of[predictors]])  # [N, V]: predictors and wanted in the same row-major order
    with torch.autocast(device_type=logits.device.type, enabled=False):
        picked = gather_logprobs(logits, input_ids[wanted])
    return torch.zeros(wanted.shape, dtype=picked.dtype, device=picked.device).masked_scatter(wanted, picked)


def _response_logprobs(
    decoder: torch.nn.Module,
    head: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    wanted: Tensor,
    *,
    pack: bool,
) -> Tensor:
    """The logprobs of the ``wanted`` tokens, the output projection applied to their predecessors' states only;
    with ``pack``, the decoder runs on the real tokens as one packed row (see the module docstring)."""
    predictors = torch.zeros_like(wanted)
    predictors[:, :-1] = wanted[:, 1:]  # the state at t - 1 predicts token t (position 0 is never wanted)
    wanted = wanted.clone()
    wanted[:, 0] = False
    if pack:
        real = attention_mask.bool()  # right-padded: each row's real tokens are a prefix, so row-major order holds
        positions = (torch.cumsum(attention_mask, dim=1) - 1)[real][None]
        states = decoder(
            input_ids=input_ids[real][None], position_ids=positions, attention_mask=None, use_cache=False
        ).last_hidden_state[0]
        picked_states = states[predictors[real]]  # a predictor of a response token is a real token of its row
    else:
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        picked_states = hidden[predictors]
    logits = head(picked_states)  # [N, V]: both masks list the same tokens in the same (row-major) order
    with torch.autocast(device_type=logits.device.type, enabled=False):
        picked = gather_logprobs(logits, input_ids[wanted])
    return torch.zeros(wanted.shape, dtype=picked.dtype, device=picked.device).masked_scatter(wanted, picked)
