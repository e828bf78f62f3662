"""Batched sampling with a KV cache: many sequences, each with its own temperature, top-p, length, seed and stop.

``generate`` runs one batch to completion. Rows are left-padded to the longest prompt; position ids follow
the attention mask, so a padded row computes exactly what it would alone (up to float rounding). Each step
samples one token per unfinished row from ``softmax(logits / temperature)`` restricted to the top-p nucleus
(greedy when the temperature is 0), and records the token's log-probability under the raw model distribution
(``log_softmax(logits)``, temperature 1): that is the behaviour policy's log-probability a PPO-style trainer
compares its own with. A row ends on an end-of-sequence token (kept: the model chose to stop), at its length
limit, or when its stop check says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["Row", "RowOutput", "generate"]


@dataclass
class Row:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    top_logprobs: int = 0
    stop_check: Callable[[list[int]], bool] | None = None  # True: stop after these response ids


@dataclass
class RowOutput:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, when top_logprobs > 0
    finish_reason: str = "length"  # stop, length


@torch.inference_mode()
def generate(
    model: torch.nn.Module, rows: list[Row], pad_id: int, eos_ids: set[int], adapter_names: list[str] | None = None
) -> list[RowOutput]:
    """Sample every row of the batch; see the module docstring. ``adapter_names``: for a PEFT model, each row's
    adapter (``"__base__"``: none), so one batch mixes adapters."""
    routed = {} if adapter_names is None else {"adapter_names": adapter_names}
    device = next(model.parameters()).device
    width = max(len(row.prompt_ids) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for index, row in enumerate(rows):
        input_ids[index, width - len(row.prompt_ids) :] = torch.tensor(row.prompt_ids, device=device)
        mask[index, width - len(row.prompt_ids) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    generators = [_generator(row.seed, device) for row in rows]
    outputs = [RowOutput() for _ in rows]
    active = [row.max_new_tokens > 0 for row in rows]
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **routed)
    past, logits = out.past_key_values, out.logits[:, -1, :]
    last_positions = positions[:, -1]
    while any(active):
        chosen = _choose(logits, rows, generators, active)
        raw = torch.log_softmax(logits.float(), dim=-1)
        for index in range(len(rows)):
            if active[index]:
                active[index] = _record(rows[index], outputs[index], raw[index], int(chosen[index]), eos_ids)
        if not any(active):
            break
        mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=device)], dim=1)
        last_positions = last_positions + 1
        out = model(
            input_ids=chosen.view(-1, 1),
            attention_mask=mask,
            position_ids=last_positions.view(-1, 1),
            past_key_values=past,
            use_cache=True,
            **routed,
        )
        past, logits = out.past_key_values, out.logits[:, -1, :]
    return outputs


def _record(row: Row, output: RowOutput, raw: torch.Tensor, token: int, eos_ids: set[int]) -> bool:
    """Append the token; False when the row is finished."""
    output.token_ids.append(token)
    output.logprobs.append(float(raw[token]))
    if row.top_logprobs:
        values, ids = torch.topk(raw, row.top_logprobs)
        output.top.append([(int(i), float(v)) for i, v in zip(ids, values, strict=True)])
    if token in eos_ids or (row.stop_check is not None and row.stop_check(output.token_ids)):
        output.finish_reason = "stop"
        return False
    return len(output.token_ids) < row.max_new_tokens


def _choose(logits: torch.Tensor, rows: list[Row], generators: list, active: list[bool]) -> torch.Tensor:
    chosen = torch.argmax(logits, dim=-1)
    for index, row in enumerate(rows):
        if not active[index] or row.temperature == 0:
            continue
        probs = torch.softmax(logits[index].float() / row.temperature, dim=-1)
        if row.top_p < 1.0:
            probs = _nucleus(probs, row.top_p)
        chosen[index] = torch.multinomial(probs, 1, generator=generators[index])[0]
    return chosen


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p`` (at least one), renormalised."""
    sorted_probs, order = torch.sort(probs, descending=True)
    outside = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
    sorted_probs[outside] = 0.0
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return kept / kept.sum()


def _generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed % (2**63))
    return generator
