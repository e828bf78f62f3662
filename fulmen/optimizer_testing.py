"""A scripted prompt optimiser: an OpenAI-compatible server that answers reflection prompts from a fixed script.

No model on a CPU machine is strong enough to be the optimiser, so tests and ``bench/apo.py`` run the real URL
path of :class:`fulmen.algorithm.prompts.reflect.ReflectiveProposer` against this instead. It reads the
reflection prompt (the slots to rewrite, the texts already refused) and proposes the script's texts in order,
skipping those the prompt says were refused; the known good instruction sits among distractors, so the search
has to find it::

    with scripted_optimizer(["Be brief.", "Think step by step.", GOOD]) as server:
        proposer = ReflectiveProposer(server.url())
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence

from fulmen.testing import RecordedRequest, Reply, ScriptedOpenAI

__all__ = ["OptimizerScript", "scripted_optimizer"]

_REWRITE = re.compile(r"^# Rewrite these slots: (.+)$", re.M)
_REFUSED = re.compile(r'<refused slot="[^"]+">\n(.*?)\n</refused>', re.S)


class OptimizerScript:
    """The script: the next text of ``texts`` not yet proposed and not refused, for every slot asked; then none."""

    def __init__(self, texts: Sequence[str]) -> None:
        self.texts = list(texts)
        self.proposed: list[str] = []
        self.prompts: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, request: RecordedRequest) -> Reply:
        prompt = next((m.get("content") or "" for m in request.body.get("messages", []) if m.get("role") == "user"), "")
        wanted = _REWRITE.search(prompt)
        if wanted is None:
            return Reply(content="I do not see which slot to rewrite.")
        slots = [s.strip() for s in wanted.group(1).split(",")]
        refused = set(_REFUSED.findall(prompt))
        with self._lock:
            self.prompts.append(prompt)
            text = next((t for t in self.texts if t not in refused and t not in self.proposed), None)
            if text is None:
                return Reply(content="I have no further ideas.")
            self.proposed.append(text)
        marked = "\n".join(f'<prompt slot="{s}">\n{text}\n</prompt>' for s in slots)
        return Reply(content=f"The failures suggest a clearer instruction.\n{marked}\nThat is all.")


def scripted_optimizer(texts: Sequence[str]) -> ScriptedOpenAI:
    """A server (use it as a context manager) whose ``script`` is an :class:`OptimizerScript` over ``texts``."""
    return ScriptedOpenAI(OptimizerScript(texts))
