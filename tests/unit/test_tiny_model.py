"""The offline tiny model: loads like any Hugging Face model, and its tokenizer round-trips chat text exactly."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from fulmen.algorithm.tiny_model import TinyModelConfig, build_tiny_model, build_tiny_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {"name": "calc", "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}},
    }
]


def test_model_directory_loads_with_auto_classes(tmp_path: Path) -> None:
    directory = build_tiny_model(tmp_path / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert model.config.vocab_size >= len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>"
    assert 500_000 < sum(p.numel() for p in model.parameters()) < 2_000_000


def test_chat_template_renders_tools_and_tool_calls_and_round_trips() -> None:
    tokenizer = build_tiny_tokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "2+3"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith('<|im_start|>system\nBe brief.\nTools:\n{"name": "calc"')
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "calc", "arguments": {"expr": "2+3"}}</tool_call><|im_end|>\n'
        in text
    )
    assert text.endswith("<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_reply_decoding_keeps_tool_call_markers_and_drops_chat_markers() -> None:
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer('<tool_call>{"name": "f"}</tool_call> ok<|im_end|>', add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == '<tool_call>{"name": "f"}</tool_call> ok'
    assert tokenizer.decode(tokenizer("a é ✓", add_special_tokens=False)["input_ids"]) == "a é ✓"


def test_saved_tokenizer_loads_back_identical(tmp_path: Path) -> None:
    directory = build_tiny_model(tmp_path / "tiny")
    loaded = AutoTokenizer.from_pretrained(directory)
    built = build_tiny_tokenizer()
    text = 'a b\n\t{"x": 1}  é ✓ <tool_call>z</tool_call><|im_end|>'
    assert loaded(text, add_special_tokens=False)["input_ids"] == built(text, add_special_tokens=False)["input_ids"]
    assert loaded.decode(loaded(text, add_special_tokens=False)["input_ids"]) == text
    assert loaded.chat_template == built.chat_template


def test_merges_learnt_from_a_corpus_shorten_text_and_reload_identical(tmp_path: Path) -> None:
    corpus = [
        f'<|im_start|>user\nAnn has {n} pears and finds {n % 7} more.<|im_end|>\n{{"expr": "{n}+1"}}'
        for n in range(10, 400)
    ]
    directory = build_tiny_model(tmp_path / "bpe", TinyModelConfig(bpe_vocab_size=400), corpus=corpus)
    loaded = AutoTokenizer.from_pretrained(directory)
    plain = build_tiny_tokenizer()
    text = 'Bob has 23 pears and finds 4 more. <tool_call>{"expr": "23+4"}</tool_call> é ✓<|im_end|>'
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert loaded.decode(ids) == text and len(ids) < len(plain(text, add_special_tokens=False)["input_ids"]) * 0.7
    tokens = loaded.convert_ids_to_tokens(ids)
    assert "<tool_call>" in tokens and {"2", "3", "4"} <= set(tokens)  # digits stay one token each
    assert all(not any(ch.isdigit() for ch in t) or len(t) == 1 for t in tokens)
    assert len(loaded) <= 400 + 2 and loaded.chat_template == plain.chat_template
