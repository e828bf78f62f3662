"""Tiny models for the tests: the offline model, and a copy taught a few fixed replies by supervised steps.

A randomly initialised model writes noise; tests that need a specific answer (a tool call) teach it that
answer first: a few hundred plain cross-entropy steps on the reply tokens, after which greedy decoding
reproduces it exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
WEATHER_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER_ANSWER = "Sunny in Paris."

# (messages, tools, reply): the conversation the tool test has, turn by turn.
TOOL_LESSONS: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str]] = [
    ([{"role": "user", "content": "Weather in Paris?"}], [WEATHER_TOOL], WEATHER_CALL),
    (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": "sunny"},
        ],
        [WEATHER_TOOL],
        WEATHER_ANSWER,
    ),
]


def taught_copy(model_dir: Path, out_dir: Path, steps: int = 150, lr: float = 3e-3) -> Path:
    """:func:`teach` with the result cached in ``~/.cache/fulmen/test-models`` (keyed by the lessons, the
    base model's files and the library versions): teaching costs 40 s to minutes on two busy cores."""
    import transformers

    digest = hashlib.sha256(
        json.dumps(
            [TOOL_LESSONS, steps, lr, torch.__version__, transformers.__version__], sort_keys=True, default=str
        ).encode()
    )
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        digest.update((model_dir / name).read_bytes())
    cache = Path(os.environ.get("FULMEN_TEST_MODEL_CACHE", Path.home() / ".cache" / "fulmen" / "test-models"))
    cached = cache / f"tool-{digest.hexdigest()[:16]}"
    if not (cached / "config.json").is_file():
        staging = cache / f".{cached.name}.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        teach(model_dir, staging, steps=steps, lr=lr)
        if cached.exists():  # another session taught it meanwhile
            shutil.rmtree(staging)
        else:
            staging.replace(cached)
    shutil.copytree(cached, out_dir, dirs_exist_ok=True)
    return out_dir


def teach(model_dir: Path, out_dir: Path, lessons=TOOL_LESSONS, steps: int = 150, lr: float = 3e-3) -> Path:
    """Fine-tune ``model_dir`` on ``lessons`` until greedy decoding repeats the replies; save to ``out_dir``."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(0)
    rows = []
    for messages, tools, reply in lessons:
        prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        reply_ids = tokenizer(reply + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        rows.append((torch.tensor([prompt_ids + reply_ids]), len(prompt_ids)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        for ids, prompt_len in rows:
            labels = ids.clone()
            labels[:, :prompt_len] = -100
            model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
