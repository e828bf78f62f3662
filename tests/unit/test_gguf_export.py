"""Hugging Face checkpoints written as GGUF and read back with gguf's own reader: names, shapes, types, metadata,
and the weights themselves (the Llama Q/K permutation undone gives the checkpoint's rows back)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fulmen.algorithm.tiny_model import build_tiny_model
from fulmen.producers.llm_gateway.backends.gguf_cache import GgufCache
from fulmen.producers.llm_gateway.backends.gguf_export import export_gguf, gguf_tensor_name
from fulmen.producers.llm_gateway.backends.gguf_tensors import permute_qk
from fulmen.schemas.errors import ConfigurationError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_llama(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama (rotate-half RoPE: its q/k rows are permuted) with grouped KV heads and an untied head."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
    )
    directory = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def read(path: Path) -> tuple[dict[str, object], dict[str, gguf.ReaderTensor]]:
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return fields, {tensor.name: tensor for tensor in reader.tensors}


def test_the_tiny_qwen2_round_trips_in_float32(tiny: Path, tmp_path: Path) -> None:
    target = export_gguf(tiny, tmp_path / "tiny.gguf")
    fields, tensors = read(target)
    config = json.loads((tiny / "config.json").read_text())
    weights = load_file(tiny / "model.safetensors")
    assert fields["general.architecture"] == "qwen2"
    assert fields["qwen2.block_count"] == config["num_hidden_layers"]
    assert fields["qwen2.attention.head_count"] == config["num_attention_heads"]
    assert fields["qwen2.rope.dimension_count"] == config["hidden_size"] // config["num_attention_heads"]
    assert fields["qwen2.rope.freq_base"] == pytest.approx(config["rope_parameters"]["rope_theta"])
    assert fields["qwen2.attention.layer_norm_rms_epsilon"] == pytest.approx(config["rms_norm_eps"])
    expected = {gguf_tensor_name(name) for name in weights if name != "lm_head.weight"}  # tied: no output tensor
    assert set(tensors) == expected and "output.weight" not in tensors
    assert "blk.0.attn_q.bias" in tensors and "blk.3.ffn_down.weight" in tensors
    for name, weight in weights.items():
        if name == "lm_head.weight":
            continue
        tensor = tensors[gguf_tensor_name(name)]
        assert tensor.tensor_type == gguf.GGMLQuantizationType.F32
        assert list(tensor.shape) == list(reversed(weight.shape))  # GGML lists dimensions fastest first
        np.testing.assert_array_equal(tensor.data.reshape(weight.shape), weight.numpy())  # Qwen2: not permuted


def test_the_tokenizer_goes_in_with_its_special_tokens(tiny: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    fields, _ = read(export_gguf(tiny, tmp_path / "tiny.gguf"))
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "qwen2"
    assert len(tokens) == json.loads((tiny / "config.json").read_text())["vocab_size"]  # padded to the model's
    for token, index in tokenizer.get_vocab().items():
        assert tokens[index] == token
    assert types[tokenizer.convert_tokens_to_ids("<|im_end|>")] == gguf.TokenType.CONTROL
    assert types[tokenizer.convert_tokens_to_ids("<tool_call>")] == gguf.TokenType.USER_DEFINED
    assert types[ord("a") - 33 + 3] == gguf.TokenType.NORMAL and types[-1] == gguf.TokenType.UNUSED
    assert fields["tokenizer.ggml.eos_token_id"] == tokenizer.eos_token_id
    assert fields["tokenizer.ggml.padding_token_id"] == tokenizer.pad_token_id
    assert fields["tokenizer.ggml.add_bos_token"] is False
    assert len(fields["tokenizer.ggml.merges"]) == 1  # no merges: one that never applies (llama.cpp needs one)


def test_llama_query_and_key_rows_are_permuted_for_llama_cpp_rope(tiny_llama: Path, tmp_path: Path) -> None:
    fields, tensors = read(export_gguf(tiny_llama, tmp_path / "llama.gguf"))
    weights = load_file(tiny_llama / "model.safetensors")
    assert fields["general.architecture"] == "llama" and fields["llama.attention.head_count_kv"] == 2
    assert "output.weight" in tensors  # untied head
    for layer in range(2):
        for projection, heads in (("q_proj", 4), ("k_proj", 2)):
            hf = weights[f"model.layers.{layer}.self_attn.{projection}.weight"]
            written = torch.from_numpy(np.array(tensors[f"blk.{layer}.attn_{projection[0]}.weight"].data))
            written = written.reshape(hf.shape)
            assert not torch.equal(written, hf)
            undone = written.reshape(heads, hf.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(hf.shape)
            torch.testing.assert_close(undone, hf, rtol=0, atol=0)
        value = tensors[f"blk.{layer}.attn_v.weight"].data.reshape(-1)
        np.testing.assert_array_equal(value, weights[f"model.layers.{layer}.self_attn.v_proj.weight"].numpy().ravel())


def test_permute_qk_pairs_each_heads_halves() -> None:
    rows = torch.arange(8).float().reshape(8, 1)  # 2 heads of 4 rows: halves (0,1 | 2,3) and (4,5 | 6,7)
    assert permute_qk(rows, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.parametrize(
    ("kind", "ggml"), [("f16", gguf.GGMLQuantizationType.F16), ("bf16", gguf.GGMLQuantizationType.BF16)]
)
def test_half_types_keep_norms_and_biases_in_float32(tiny: Path, tmp_path: Path, kind: str, ggml: object) -> None:
    fields, tensors = read(export_gguf(tiny, tmp_path / f"{kind}.gguf", kind))
    weights = load_file(tiny / "model.safetensors")
    assert fields["general.file_type"] == {"f16": 1, "bf16": 32}[kind]
    assert tensors["blk.0.attn_q.weight"].tensor_type == ggml
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["blk.0.attn_q.bias"].tensor_type == gguf.GGMLQuantizationType.F32
    written = np.array(tensors["blk.0.attn_q.weight"].data)
    expected = weights["model.layers.0.self_attn.q_proj.weight"]
    if kind == "bf16":
        restored = torch.from_numpy(written.view(np.int16).reshape(expected.shape)).view(torch.bfloat16).float()
        torch.testing.assert_close(restored, expected.to(torch.bfloat16).float(), rtol=0, atol=0)
    else:
        np.testing.assert_array_equal(written.reshape(expected.shape), expected.half().numpy())


def test_what_cannot_be_converted_is_refused_and_nothing_is_left_behind(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConfigurationError, match="valid types are f32, f16, bf16"):
        export_gguf(tiny, out / "x.gguf", "q4")
    odd = tmp_path / "odd"
    shutil.copytree(tiny, odd)
    config = json.loads((tiny / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigurationError, match="converts LlamaForCausalLM, Qwen2ForCausalLM"):
        export_gguf(odd, out / "y.gguf")
    (odd / "config.json").write_text(json.dumps(config))
    spec = json.loads((tiny / "tokenizer.json").read_text())
    (odd / "tokenizer.json").write_text(json.dumps({**spec, "model": {**spec["model"], "type": "Unigram"}}))
    with pytest.raises(ConfigurationError, match="needs a byte-level BPE tokenizer"):
        export_gguf(odd, out / "z.gguf")  # fails once the file is being written
    with pytest.raises(ConfigurationError, match="no place for it"):
        gguf_tensor_name("model.layers.0.self_attn.rotary.weight")
    assert list(out.iterdir()) == []  # no staging file left


def test_the_cache_converts_once_and_deletes_what_nothing_serves(tiny: Path, tmp_path: Path) -> None:
    cache = GgufCache(tmp_path / "cache", "f32")
    first = cache.acquire(tiny)
    stamp = first.stat().st_mtime_ns
    assert cache.acquire(tiny) == first and first.stat().st_mtime_ns == stamp  # the same checkpoint: not again
    assert cache.path_for(tiny) != GgufCache(tmp_path / "cache", "bf16").path_for(tiny)
    cache.release(first)
    assert first.is_file()  # one user left
    cache.release(first)
    assert not first.exists()
    with pytest.raises(ConfigurationError, match="does not exist"):
        cache.acquire(tmp_path / "missing")


def test_a_lora_version_is_written_merged_into_its_base(tiny: Path, tmp_path: Path) -> None:
    """llama-server takes adapters only at start-up: a LoRA version is served as full weights, merged with peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapted = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    adapted.save_pretrained(tmp_path / "adapter")
    merged = adapted.merge_and_unload().state_dict()
    cache = GgufCache(tmp_path / "cache", "f32")
    path = cache.acquire(tiny, tmp_path / "adapter")
    assert path != cache.path_for(tiny)  # not the base's file
    _, tensors = read(path)
    for hf_name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight"):
        written = torch.from_numpy(np.array(tensors[gguf_tensor_name(hf_name)].data)).reshape(merged[hf_name].shape)
        torch.testing.assert_close(written, merged[hf_name])
        assert not torch.equal(written, load_file(tiny / "model.safetensors")[hf_name])


def test_q8_0_blocks_dequantise_to_the_checkpoints_weights(tiny: Path, tmp_path: Path) -> None:
    target = export_gguf(tiny, tmp_path / "tiny-q8_0.gguf", "q8_0")
    fields, tensors = read(target)
    weights = load_file(tiny / "model.safetensors")
    assert fields["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    matrix = tensors[gguf_tensor_name("model.layers.0.mlp.up_proj.weight")]
    assert matrix.tensor_type == gguf.GGMLQuantizationType.Q8_0
    expected = weights["model.layers.0.mlp.up_proj.weight"].numpy()
    got = gguf.quants.dequantize(matrix.data, matrix.tensor_type).reshape(expected.shape)
    step = np.abs(expected).reshape(-1, 32).max(axis=1, keepdims=True) / 127  # a block's step (its fp16 scale)
    assert (np.abs(got - expected).reshape(-1, 32) <= 0.6 * step + 1e-7).all()  # half a step, and the scale's fp16
    norm = tensors[gguf_tensor_name("model.norm.weight")]
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32  # vectors stay float32
