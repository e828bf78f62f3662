"""The SQL example's question templates by name, and :func:`draft`, one question of a template on a database.

``filter``, ``order``, ``join`` and ``group`` are in :mod:`examples.sql_agent.questions`, ``nested`` in
:mod:`examples.sql_agent.nested`; each is a few variants, one drawn at random per question.
"""

from __future__ import annotations

import random

from examples.sql_agent.nested import NESTED
from examples.sql_agent.questions import FILTER, GROUP, JOIN, ORDER, Draft, Variant

__all__ = ["TEMPLATES", "draft"]

TEMPLATES: dict[str, tuple[Variant, ...]] = {
    "filter": FILTER,
    "order": ORDER,
    "join": JOIN,
    "group": GROUP,
    "nested": NESTED,
}


def draft(template: str, r: random.Random, db: str) -> Draft | None:
    """One draft of ``template`` on ``db`` from a variant drawn at random (None where the variant does not fit)."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown SQL question template {template!r}: one of {', '.join(TEMPLATES)}")
    return r.choice(TEMPLATES[template])(r, db)
