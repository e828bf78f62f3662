"""The reflective proposer: shows an OpenAI-compatible optimiser LLM the failing episodes and parses its new text.

Its calls go straight to ``optimizer_url`` (never through Fulmen's gateway), so they are never captured as
training data. It counts the optimiser's tokens (``usage.total_tokens``, else a length estimate) and raises
``OptimizerExhausted`` once ``max_tokens_total`` is spent. The answer carries each new text between fixed markers::

    <prompt slot="NAME">
    the new text
    </prompt>

A text that fails ``validate(slot, old, new)`` (e.g. a template that drops a placeholder) is refused, remembered,
and shown to the optimiser next time with the texts the search refused.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from fulmen.algorithm.prompts.base import Episode, OptimizerExhausted, Proposal, ProposalRequest
from fulmen.schemas.errors import ConfigurationError, FulmenError

__all__ = ["API_KEY_ENV", "ReflectiveProposer", "parse_proposal", "reflection_prompt"]

log = logging.getLogger(__name__)

API_KEY_ENV = "FULMEN_OPTIMIZER_API_KEY"
_MARKED = re.compile(r'<prompt slot="([^"]+)">\n?(.*?)\n?</prompt>', re.S)

SYSTEM = (
    "You improve the prompts of an AI agent. You see the current text of each prompt slot and episodes where the "
    "agent failed (what it was asked, what it answered, the reward). Write an improved text for each requested "
    "slot: keep every {placeholder} of the old text, state clearly what the rewards show is required. Answer "
    'with each new text between <prompt slot="NAME"> and </prompt>, nothing else inside the markers.'
)


def _episode_block(episode: Episode, max_chars: int) -> str:
    evidence = episode.evidence if len(episode.evidence) <= max_chars else episode.evidence[:max_chars] + " [...]"
    return f"## Episode (task {episode.task_id}, reward {episode.reward:g})\n{evidence}"


def reflection_prompt(request: ProposalRequest, max_episodes: int = 4, max_chars: int = 2000) -> str:
    """The user message: current slot texts, failing episodes, texts already refused, the slots to rewrite."""
    parts = ["# Current prompt slots"]
    parts += [f'<current slot="{s}">\n{t}\n</current>' for s, t in sorted(request.parent.items())]
    parts.append("# Failing episodes")
    parts += [_episode_block(e, max_chars) for e in list(request.failing)[:max_episodes]]
    refused = [(s, t) for s in request.slots for t in request.rejected.get(s, ())]
    if refused:
        parts.append("# Already tried and refused (do not propose these again)")
        parts += [f'<refused slot="{s}">\n{t}\n</refused>' for s, t in refused]
    parts.append("# Rewrite these slots: " + ", ".join(request.slots))
    return "\n\n".join(parts)


def parse_proposal(answer: str, slots: Sequence[str]) -> dict[str, str]:
    """The marked texts of the requested slots (the last one wins when a slot is marked twice); others are ignored."""
    found = {slot: text.strip() for slot, text in _MARKED.findall(answer or "")}
    return {s: found[s] for s in slots if found.get(s)}


class ReflectiveProposer:
    """A ``Proposer`` backed by any OpenAI-compatible ``/chat/completions`` endpoint.

    ``client`` may be injected (an ``httpx.Client`` with a mock transport in tests); otherwise one is built for
    ``optimizer_url`` with the key from ``api_key`` or the ``FULMEN_OPTIMIZER_API_KEY`` environment variable.
    """

    def __init__(
        self,
        optimizer_url: str,
        model: str = "optimizer",
        *,
        api_key: str | None = None,
        max_tokens_total: int = 200_000,
        max_tokens_call: int = 1024,
        temperature: float = 0.0,
        validate: Callable[[str, str, str], Any] | None = None,
        client: httpx.Client | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        if not optimizer_url.startswith(("http://", "https://")):
            raise ConfigurationError(f"--optimizer-url must be an http(s) URL ending in /v1, got {optimizer_url!r}")
        if max_tokens_total < 1:
            raise ConfigurationError("the optimiser token cap must be at least 1")
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV, "")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.url = optimizer_url.rstrip("/") + "/chat/completions"
        self.model, self.temperature = model, temperature
        self.max_tokens_total, self.max_tokens_call = max_tokens_total, max_tokens_call
        self.validate = validate
        self.client = client or httpx.Client(headers=headers, timeout=timeout_s)
        self.tokens_used = 0
        self.refused: dict[str, list[str]] = {}

    def _ask(self, prompt: str) -> str:
        if self.tokens_used >= self.max_tokens_total:
            raise OptimizerExhausted(f"optimiser token cap spent ({self.tokens_used} of {self.max_tokens_total})")
        body = {
            "model": self.model,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens_call,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
        }
        try:
            response = self.client.post(self.url, json=body)
            response.raise_for_status()
            answer = response.json()
            text = answer["choices"][0]["message"].get("content") or ""
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise FulmenError(f"the optimiser at {self.url} failed: {type(exc).__name__}: {exc}") from exc
        usage = answer.get("usage") or {}
        self.tokens_used += int(usage.get("total_tokens") or (len(prompt) + len(text)) // 4)
        return text

    def propose(self, request: ProposalRequest) -> Proposal:
        rejected = {s: [*request.rejected.get(s, ()), *self.refused.get(s, ())] for s in request.slots}
        asked = ProposalRequest(request.parent, request.slots, request.failing, rejected)
        before = self.tokens_used
        texts = parse_proposal(self._ask(reflection_prompt(asked)), request.slots)
        kept = {}
        for slot, text in texts.items():
            try:
                if self.validate is not None:
                    self.validate(slot, request.parent.get(slot, ""), text)
            except FulmenError as bad:
                log.info("optimiser proposal for slot %s refused: %s", slot, bad)
                self.refused.setdefault(slot, []).append(text)
                continue
            kept[slot] = text
        return Proposal(kept or None, tokens=self.tokens_used - before)

    def close(self) -> None:
        self.client.close()
