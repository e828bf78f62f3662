"""The prompt-search task (issue 29): short general questions, rewarded only for an answer in French.

The agent's own system prompt (``SYSTEM``) does not ask for French, so the base prompt scores about 0; the
instruction a search has to find ("Always reply in French.") is one SmolLM2-135M-Instruct follows. Probed with
greedy decoding on six of these questions: with it, 6/6 replies were French; with the base prompt, and with
instructions the model ignores ("Answer with one word in UPPERCASE.", "Start your reply with 'ANSWER:'."), 0/6.
The agent imports nothing of Fulmen's: ``solve(task, llm)`` with the official ``openai`` client, greedy.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

__all__ = ["QUESTIONS", "SYSTEM", "is_french", "solve", "write_splits"]

SYSTEM = "You are a helpful assistant."
MAX_TOKENS = 20

QUESTIONS = [
    "What is the capital of France?",
    "What color is the sky on a clear day?",
    "What animal says moo?",
    "What is the opposite of hot?",
    "Which planet do we live on?",
    "What do bees make?",
    "What is frozen water called?",
    "What fruit is yellow and long?",
    "How many legs does a spider have?",
    "What do cows drink?",
    "What is the largest ocean?",
    "What season comes after winter?",
    "What do you use to write on paper?",
    "Where do fish live?",
    "What gas do plants breathe in?",
    "What is the color of grass?",
    "Which animal is known as the king of the jungle?",
    "What do birds have to fly?",
    "What is the sun?",
    "How many days are in a week?",
    "What is the opposite of up?",
    "What falls from clouds?",
    "What do we call a baby cat?",
    "What shape is a ball?",
]

# Words that are common in French sentences and rare or absent in English ones.
_FRENCH = re.compile(r"\b(le|la|les|est|une?|des|du|c'est|dans|avec|pour|qui|sont|il|elle|et)\b", re.I)
_ACCENTED = re.compile(r"[éèêàçùôîû]", re.I)


def is_french(text: str) -> bool:
    """True when ``text`` reads as French: two or more French function words, or one and an accented letter."""
    words = len(_FRENCH.findall(text or ""))
    return words >= 2 or (words >= 1 and bool(_ACCENTED.search(text or "")))


async def solve(task: dict[str, Any], llm: Any) -> float:
    """One question, one greedy call; reward 1.0 when the answer is in French, else 0.0."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
    async with AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=2) as client:
        answer = await client.chat.completions.create(
            model=llm.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0
        )
    return 1.0 if is_french(answer.choices[0].message.content or "") else 0.0


def write_splits(directory: Path, sizes: tuple[int, int, int] = (8, 8, 8)) -> dict[str, Path]:
    """``train.jsonl``, ``val.jsonl``, ``test.jsonl`` in ``directory`` (disjoint questions, in order)."""
    directory.mkdir(parents=True, exist_ok=True)
    if sum(sizes) > len(QUESTIONS):
        raise ValueError(f"only {len(QUESTIONS)} questions for splits of {sizes}")
    paths, start = {}, 0
    for name, size in zip(("train", "val", "test"), sizes, strict=True):
        rows = [{"task_id": f"{name}-{i}", "question": q} for i, q in enumerate(QUESTIONS[start : start + size])]
        paths[name] = directory / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
        start += size
    return paths
