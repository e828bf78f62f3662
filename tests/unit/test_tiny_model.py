"""The offline tiny model: loads like any Hugging Face model, and its tokenizer round-trips chat text exactly."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from algorithm.tiny_model import build_tiny_model, build_tiny_tokenizer

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
