"""The ``search`` tool's index: SQLite FTS5 over the corpus, ranked by BM25 with titles weighted ``TITLE_WEIGHT``
times the body (searching an entity's name finds its own page first, then the pages that mention it).

Built once per process in memory (about 1,500 documents: milliseconds). The model's query is never passed to
FTS5's query language as is: it is cut into words (letters and digits), each word quoted, and the words joined
with OR, so quotes, brackets or operators in the model's text cannot make a syntax error.
"""

from __future__ import annotations

import functools
import re
import sqlite3
import threading

from examples.rag_agent.corpus import corpus

__all__ = ["search"]

TITLE_WEIGHT = 10.0
_WORD = re.compile(r"[^\W_]+", re.UNICODE)
_lock = threading.Lock()


@functools.cache
def _index() -> sqlite3.Connection:
    db = sqlite3.connect(":memory:", check_same_thread=False)
    db.execute("CREATE VIRTUAL TABLE docs USING fts5(id UNINDEXED, title, text)")
    facts = corpus()
    db.executemany(
        "INSERT INTO docs VALUES (?, ?, ?)",
        [(doc_id, facts.titles[doc_id], text) for doc_id, text in facts.documents.items()],
    )
    db.commit()
    return db


def search(query: str, k: int = 2) -> list[tuple[str, str]]:
    """The ``k`` best documents for ``query`` as ``(id, text)``, best first; none for a query without words."""
    words = _WORD.findall(query or "")[:16]
    if not words:
        return []
    match = " OR ".join(f'"{word}"' for word in words)
    with _lock:
        rows = (
            _index()
            .execute(
                "SELECT id, text FROM docs WHERE docs MATCH ? ORDER BY bm25(docs, 0.0, ?, 1.0) LIMIT ?",
                (match, TITLE_WEIGHT, k),
            )
            .fetchall()
        )
    return [(str(doc_id), str(text)) for doc_id, text in rows]
