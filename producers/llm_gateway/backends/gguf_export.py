"""Writes a Hugging Face checkpoint directory as a GGUF file that llama.cpp loads, with the same weights.

Supported: ``LlamaForCausalLM`` (SmolLM2) and ``Qwen2ForCausalLM`` (Fulmen's tiny model; q/k/v biases), plain RoPE,
tensors in ``f32`` (default), ``f16``, ``bf16`` or ``q8_0`` (8-bit blocks of 32 weights with a scale, quantised by
``gguf.quants``; a matrix whose rows are not whole blocks stays f32) (:data:`TENSOR_TYPES`; norms and biases stay
f32). Hugging Face's
Llama rotates query/key halves (``rotate_half``) where llama.cpp's ``llama`` architecture rotates interleaved
pairs, so the rows of ``q_proj`` and ``k_proj`` are permuted per head (:func:`.gguf_tensors.permute_qk`); llama.cpp
runs Qwen2 with NEOX RoPE (halves), so its weights go unchanged. The tokenizer goes in as a byte-level BPE (``gpt2``)
with its merges, special tokens as control tokens and the end-of-sequence id: the gateway sends prompts as token ids,
so the tokenizer serves llama.cpp's end-of-generation detection and its text only, but it must load.

The file is written under a temporary name beside ``target`` and renamed, so a reader never sees half of it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import torch

from fulmen.producers.llm_gateway.backends.gguf_tensors import F32, TensorType, plan_tensors, write_tensors
from fulmen.schemas.errors import ConfigurationError

__all__ = ["ARCHITECTURES", "TENSOR_TYPES", "Architecture", "export_gguf", "gguf_tensor_name"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Architecture:
    """How one Hugging Face architecture maps to a llama.cpp one."""

    gguf_name: str
    permute_qk: bool  # llama.cpp's RoPE for it is interleaved (Llama), not by halves (NEOX: Qwen2)
    attention_biases: bool  # q/k/v projections carry biases
    pre_tokenizer: str  # the llama.cpp pre-tokenizer name to use unless the tokenizer says otherwise


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama", permute_qk=True, attention_biases=False, pre_tokenizer="default"),
    "Qwen2ForCausalLM": Architecture("qwen2", permute_qk=False, attention_biases=True, pre_tokenizer="qwen2"),
}


TENSOR_TYPES: dict[str, TensorType] = {
    "f32": F32,
    "f16": TensorType(gguf.LlamaFileType.MOSTLY_F16, gguf.GGMLQuantizationType.F16, torch.float16, "F16"),
    "bf16": TensorType(gguf.LlamaFileType.MOSTLY_BF16, gguf.GGMLQuantizationType.BF16, torch.bfloat16, "BF16"),
    "q8_0": TensorType(gguf.LlamaFileType.MOSTLY_Q8_0, gguf.GGMLQuantizationType.Q8_0, torch.float32, ""),
}

_LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_NO_MERGE = "[no-merges] [fulmen]"
_TOP_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name of a Hugging Face tensor (``model.layers.3.self_attn.q_proj.weight``: ``blk.3.attn_q.weight``);
    :class:`ConfigurationError` for a tensor llama.cpp's Llama/Qwen2 have no place for."""
    stem, _, kind = hf_name.rpartition(".")
    if stem in _TOP_TENSORS and kind == "weight":
        return f"{_TOP_TENSORS[stem]}.weight"
    parts = stem.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and kind in ("weight", "bias"):
        module = _LAYER_TENSORS.get(".".join(parts[3:]))
        if module is not None:
            return f"blk.{parts[2]}.{module}.{kind}"
    raise ConfigurationError(f"tensor {hf_name}: llama.cpp's model has no place for it (not a plain Llama/Qwen2)")


def export_gguf(
    checkpoint: Path, target: Path, tensor_type: str = "f32", weights: Mapping[str, torch.Tensor] | None = None
) -> Path:
    """Write ``checkpoint`` (config.json, tokenizer, safetensors) as the GGUF file ``target``, atomically.
    ``weights``: the state dict to write instead of the checkpoint's safetensors (a LoRA merged into them).
    :class:`ConfigurationError` when the checkpoint is not one this module converts."""
    started = time.perf_counter()
    config = _read_json(checkpoint / "config.json")
    arch = _architecture(config)
    kind = TENSOR_TYPES.get(tensor_type)
    if kind is None:
        raise ConfigurationError(f"GGUF tensor type {tensor_type!r}: valid types are {', '.join(TENSOR_TYPES)}")
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{target.name}-", suffix=".tmp", dir=target.parent)
    os.close(handle)
    try:
        writer = gguf.GGUFWriter(staging, arch.gguf_name)
        writer.add_name(checkpoint.name)
        writer.add_file_type(int(kind.file_type))
        _add_hyperparameters(writer, arch.gguf_name, config)
        _add_tokenizer(writer, checkpoint, config, arch)
        plan = plan_tensors(checkpoint, kind, _renamer(config), _heads_to_permute(config, arch), weights)
        write_tensors(writer, plan)
        writer.close()
        os.replace(staging, target)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    log.info(
        "wrote %s (%d tensors, %s) from %s in %.2f s",
        target,
        len(plan),
        tensor_type,
        checkpoint,
        time.perf_counter() - started,
    )
    return target


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"{path}: cannot read it ({exc})") from None


def _architecture(config: Mapping[str, Any]) -> Architecture:
    names = config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ConfigurationError(f"architectures {names}: the llamacpp backend converts {', '.join(ARCHITECTURES)}")


def _head_dim(config: Mapping[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _add_hyperparameters(writer: gguf.GGUFWriter, arch: str, config: Mapping[str, Any]) -> None:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigurationError(f"rope_type {rope_type!r}: the llamacpp backend converts plain RoPE only")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    heads, head_dim = int(config["num_attention_heads"]), _head_dim(config)
    values = {
        "block_count": int(config["num_hidden_layers"]),
        "context_length": int(config["max_position_embeddings"]),
        "embedding_length": int(config["hidden_size"]),
        "feed_forward_length": int(config["intermediate_size"]),
        "attention.head_count": heads,
        "attention.head_count_kv": int(config.get("num_key_value_heads") or heads),
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "rope.dimension_count": head_dim,
        "vocab_size": int(config["vocab_size"]),
    }
    for key, value in values.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", float(theta))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(config["rms_norm_eps"]))


def _add_tokenizer(writer: gguf.GGUFWriter, checkpoint: Path, config: Mapping[str, Any], arch: Architecture) -> None:
    """The tokenizer (``tokenizer.json``, ``tokenizer_config.json``) as llama.cpp's ``gpt2`` (byte-level BPE)
    vocabulary: tokens by id (gaps up to the model's vocab_size padded as unused), types, merges, special ids."""
    spec = _read_json(checkpoint / "tokenizer.json")
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        raise ConfigurationError(f"{checkpoint}/tokenizer.json: the llamacpp backend needs a byte-level BPE tokenizer")
    by_id = {int(index): token for token, index in (model.get("vocab") or {}).items()}
    added = {int(t["id"]): t for t in spec.get("added_tokens") or []}
    by_id.update((index, t["content"]) for index, t in added.items())
    size = max(int(config["vocab_size"]), max(by_id) + 1)
    tokens, types = [], []
    for index in range(size):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[index])
            special = added.get(index, {}).get("special")
            types.append(
                gguf.TokenType.NORMAL
                if index not in added
                else gguf.TokenType.CONTROL
                if special
                else gguf.TokenType.USER_DEFINED
            )
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(spec, arch))
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    # llama.cpp refuses a BPE vocabulary without merges, gguf cannot write an empty array: a tokenizer without
    # merges (the tiny model's) gets one that never applies (BPE starts from single characters, and nothing merges
    # into these two).
    writer.add_token_merges(merges or [_NO_MERGE])
    settings_file = checkpoint / "tokenizer_config.json"
    settings = _read_json(settings_file) if settings_file.is_file() else {}
    ids = {token: index for index, token in by_id.items()}
    for role, add in (
        ("bos", writer.add_bos_token_id),
        ("eos", writer.add_eos_token_id),
        ("pad", writer.add_pad_token_id),
    ):
        index = _special_id(settings.get(f"{role}_token"), ids, config.get(f"{role}_token_id"))
        if index is not None:
            add(index)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)


def _special_id(token: Any, ids: Mapping[str, int], fallback: Any) -> int | None:
    """The id of a special token as tokenizer_config.json names it (a string, or ``{"content": ...}``), else the
    model config's id."""
    text = token.get("content") if isinstance(token, dict) else token
    if isinstance(text, str) and text in ids:
        return ids[text]
    return fallback if isinstance(fallback, int) and not isinstance(fallback, bool) else None


def _pre_tokenizer(spec: Mapping[str, Any], arch: Architecture) -> str:
    """The llama.cpp pre-tokenizer: SmolLM's (single digits, then byte-level) when the tokenizer is that, else the
    architecture's."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers") or []
    if [s.get("type") for s in steps] == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    return arch.pre_tokenizer


def _renamer(config: Mapping[str, Any]) -> Callable[[str], str | None]:
    tied = bool(config.get("tie_word_embeddings", False))

    def rename(hf_name: str) -> str | None:
        if hf_name.endswith("rotary_emb.inv_freq") or (tied and hf_name == "lm_head.weight"):
            return None  # a buffer, not a weight; the tied head is the embedding
        return gguf_tensor_name(hf_name)

    return rename


def _heads_to_permute(config: Mapping[str, Any], arch: Architecture) -> Callable[[str], int | None]:
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)

    def count(name: str) -> int | None:
        if not arch.permute_qk:
            return None
        return heads if ".attn_q." in name else kv_heads if ".attn_k." in name else None

    return count
