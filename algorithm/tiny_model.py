"""A tiny chat model built offline: a Qwen2 causal LM from a config and a character-level tokenizer.

Nothing can be downloaded from a model hub on the machines this project is tested on, so the demo, the tests
and the benchmarks make their model here: :func:`build_tiny_model` writes a directory that
``AutoTokenizer.from_pretrained`` and ``AutoModelForCausalLM.from_pretrained`` load like any Hugging Face
model, with a chat template in the style of Qwen2.5 / Hermes (ChatML turns; tools listed in the system turn;
a tool call written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``).

Tokenizer: byte-level with no merges, so one token per byte (one per character for ASCII text); any text
round-trips. Given a corpus (``build_tiny_model(..., corpus=texts)``), byte-level BPE merges are learnt from
it first, with Qwen2's own pre-tokenizer (so digits stay one token each): the demo's prompts then shrink ~4x,
which a model this small needs to learn to copy numbers across a prompt at all (measured: with 150-250 byte
tokens per prompt, 5,000-10,000 supervised examples taught it no copying; short prompts, a few thousand).
The ChatML markers are special tokens (skipped when decoding a reply); ``<tool_call>`` and
``</tool_call>`` are ordinary added tokens, so they survive decoding and the gateway can parse a tool call out
of the text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fulmen.schemas.chat_template import CHAT_TEMPLATE

__all__ = ["CHAT_TEMPLATE", "TinyModelConfig", "build_tiny_model", "build_tiny_tokenizer"]

PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of the model; the defaults (~1M parameters) learn 2-digit arithmetic on 2 CPU cores."""

    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 2048
    bpe_vocab_size: int = 512  # the vocabulary's size when merges are learnt from a corpus
    seed: int = 0


def build_tiny_tokenizer(corpus: Iterable[str] | None = None, vocab_size: int = 512):
    """The byte-level tokenizer with the chat template, built in memory (a ``PreTrainedTokenizerBase``).

    It is a ``Qwen2Tokenizer`` whose vocabulary is the 256 byte symbols and no merges: saved and loaded again
    (``AutoTokenizer`` picks the Qwen2 class from the model's config), it splits text the same way. With a
    ``corpus``, BPE merges up to ``vocab_size`` tokens are learnt from it (``train_new_from_iterator``, which
    keeps Qwen2's pre-tokenizer and byte-level alphabet, so the reload still splits identically).
    """
    from transformers import Qwen2Tokenizer

    vocab = {token: index for index, token in enumerate([PAD, IM_START, IM_END])}
    for symbol in _byte_symbols():
        vocab[symbol] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=None,
        eos_token=IM_END,
        pad_token=PAD,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
    )
    if corpus is not None:
        tokenizer = tokenizer.train_new_from_iterator(corpus, vocab_size=vocab_size)
    tokenizer.add_tokens([TOOL_CALL_OPEN, TOOL_CALL_CLOSE])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def _byte_symbols() -> list[str]:
    """The printable stand-in of each byte value, as byte-level BPE tokenizers (GPT-2, Qwen) spell them:
    printable Latin-1 bytes stand for themselves, the others are shifted to code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + shifted)
            shifted += 1
    return [symbols[byte] for byte in range(256)]


def build_tiny_model(
    directory: Path | str, config: TinyModelConfig | None = None, corpus: Sequence[str] | None = None
) -> Path:
    """Write a tiny randomly initialised chat model and its tokenizer to ``directory``; returns the directory.

    The result loads with ``from_pretrained(directory)``. Deterministic for a given ``config.seed`` (and
    ``corpus``, from which the tokenizer's merges are learnt when given).
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = config or TinyModelConfig()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(corpus, config.bpe_vocab_size)
    vocab_size = _round_up(len(tokenizer), 64)
    model_config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(config.seed)
    model = Qwen2ForCausalLM(model_config)
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id], pad_token_id=tokenizer.pad_token_id
    )
    from fulmen.algorithm.trainer.torch_backend import no_progress_bars

    with no_progress_bars():  # `make demo` builds it first: no stray "Writing model shards" bar
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    (directory / "fulmen_tiny_model.json").write_text(json.dumps(config.__dict__, indent=2) + "\n")
    return directory


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple
