"""The RAG reward: token F1 of the answer against the gold answer, in [0, 1].

Both are normalised as SQuAD does (lower case, no punctuation, no articles, split on white space), and the
category words the question already names (``river``, ``mountains``) are dropped from both: the gold answer
``the Zibrou River`` is the name ``zibrou``, so an answer that only repeats the question's category ("a river")
earns nothing, and ``Zibrou`` alone earns everything.
"""

from __future__ import annotations

import re
import string
from collections import Counter

__all__ = ["CATEGORY_WORDS", "normalise", "token_f1"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
CATEGORY_WORDS = frozenset({"river", "mountains", "mountain"})


def normalise(text: str) -> list[str]:
    """Lower case, no punctuation, no articles, no category words, split on white space."""
    text = "".join(ch for ch in (text or "").lower() if ch not in string.punctuation)
    return [word for word in _ARTICLES.sub(" ", text).split() if word not in CATEGORY_WORDS]


def token_f1(answer: str, gold: str) -> float:
    got, want = normalise(answer), normalise(gold)
    common = sum((Counter(got) & Counter(want)).values())
    if not got or not want or common == 0:
        return 0.0
    precision, recall = common / len(got), common / len(want)
    return 2 * precision * recall / (precision + recall)
