"""What went wrong in an episode, read from the store: the messages each LLM call saw, its answer, the reward.

The evaluator knows the rollout ids it ran; :func:`episode_evidence` turns them into the text the reflective
proposer shows the optimiser, with one read-only query over the spans table (the gen_ai input and output
messages of every ``chat`` / ``text_completion`` span of those rollouts, in time order).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fulmen.algorithm.service.replay import StoreReader
from fulmen.schemas import semconv
from fulmen.schemas.ddl import TABLES

__all__ = ["episode_evidence", "format_messages"]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # gen_ai parts or OpenAI content parts
        return " ".join(str(p.get("content") or p.get("text") or "") for p in content if isinstance(p, dict))
    return "" if content is None else json.dumps(content)


def format_messages(raw: str) -> str:
    """``role: text`` lines (tool calls as ``tool_call name(arguments)``) from a stored gen_ai messages attribute."""
    try:
        messages = json.loads(raw) if raw else []
    except json.JSONDecodeError:
        return raw
    lines = []
    for m in messages if isinstance(messages, list) else []:
        if not isinstance(m, dict):
            continue
        role = m.get("role", "?")
        text = _text(m.get("content") if "content" in m else m.get("parts"))
        if text:
            lines.append(f"{role}: {text}")
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call) if isinstance(call, dict) else {}
            lines.append(f"{role}: tool_call {fn.get('name', '?')}({fn.get('arguments', '')})")
    return "\n".join(lines)


def episode_evidence(
    reader: StoreReader, database: str, rollout_ids: Sequence[str], max_calls: int = 8
) -> dict[str, str]:
    """Rollout id -> its LLM calls as text (what the model saw, what it answered), up to ``max_calls`` each."""
    if not rollout_ids:
        return {}
    sql = (
        f"SELECT RolloutId, SpanAttributes[%(inp)s], SpanAttributes[%(out)s] FROM {database}.{TABLES['spans']} "
        "WHERE RolloutId IN %(ids)s AND SpanAttributes[%(op)s] IN %(ops)s ORDER BY RolloutId, Timestamp"
    )
    params = {
        "ids": list(rollout_ids),
        "inp": semconv.GEN_AI_INPUT_MESSAGES,
        "out": semconv.GEN_AI_OUTPUT_MESSAGES,
        "op": semconv.GEN_AI_OPERATION_NAME,
        "ops": [semconv.OPERATION_CHAT, semconv.OPERATION_TEXT_COMPLETION],
    }
    result = reader.query(sql, params, final=True, read_only=True)
    calls: dict[str, list[str]] = {}
    for rollout_id, seen, answered in result.rows:
        kept = calls.setdefault(str(rollout_id), [])
        if len(kept) < max_calls:
            kept.append(f"### call {len(kept) + 1}\n{format_messages(seen)}\n--- answer\n{format_messages(answered)}")
    return {rid: "\n".join(parts) for rid, parts in calls.items()}
