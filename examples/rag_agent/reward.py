"""The RAG reward, token F1 of the answer against the gold answer in [0, 1], and exact match beside it.

Both are normalised as SQuAD does (lower case, no punctuation, no articles, split on white space), and the
category words a question already names (``river``, ``mountains``, ``port``, ``island``, ``sea``) are dropped
from both: the gold answer ``the Zibrou River`` is the name ``zibrou``, so an answer that only repeats the
question's category ("a river") earns nothing, and ``Zibrou`` alone earns everything. :func:`exact_match` uses the same
normalisation (as SQuAD's exact match does its F1's), so it is 1 exactly where the normalised words are the same
words in the same order: stricter than F1, never looser.
"""

from __future__ import annotations

import re
import string
from collections import Counter

__all__ = ["CATEGORY_WORDS", "exact_match", "normalise", "token_f1"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
CATEGORY_WORDS = frozenset({"river", "mountains", "mountain", "port", "island", "sea"})


def normalise(text: str) -> list[str]:
    """Lower case, no punctuation, no articles, no category words, split on white space."""
    text = "".join(ch for ch in (text or "").lower() if ch not in string.punctuation)
    return [word for word in _ARTICLES.sub(" ", text).split() if word not in CATEGORY_WORDS]


def token_f1(answer: str, gold: str) -> float:
    """The harmonic mean of the precision and recall of the answer's normalised words against the gold's."""
    got, want = normalise(answer), normalise(gold)
    common = sum((Counter(got) & Counter(want)).values())
    if not got or not want or common == 0:
        return 0.0
    precision, recall = common / len(got), common / len(want)
    return 2 * precision * recall / (precision + recall)


def exact_match(answer_text: str, answer: str) -> float:
    """1.0 when the answer's normalised words are the gold answer's (and there are some), else 0.0."""
    got, want = normalise(answer_text), normalise(answer)
    return 1.0 if want and got == want else 0.0
