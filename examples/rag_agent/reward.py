"""The RAG reward: token F1 of the answer against the gold answer (SQuAD's normalisation), in [0, 1]."""

from __future__ import annotations

import re
import string
from collections import Counter

__all__ = ["normalise", "token_f1"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalise(text: str) -> list[str]:
    """Lower case, no punctuation, no articles, split on white space."""
    text = "".join(ch for ch in (text or "").lower() if ch not in string.punctuation)
    return _ARTICLES.sub(" ", text).split()


def token_f1(answer: str, gold: str) -> float:
    got, want = normalise(answer), normalise(gold)
    common = sum((Counter(got) & Counter(want)).values())
    if not got or not want or common == 0:
        return 0.0
    precision, recall = common / len(got), common / len(want)
    return 2 * precision * recall / (precision + recall)
