"""What every inference backend offers the gateway, and what a call returns.

Lifecycle: ``start()`` (load or connect; raises :class:`~fulmen.schemas.errors.ConfigurationError` when the model or
upstream cannot be used), then any number of concurrent ``chat``/``complete`` calls, then ``close()``.
``load_version`` swaps the weights while calls run: a call is served entirely by one version, which it reports.

Calls raise :class:`~fulmen.producers.llm_gateway.protocol.ApiError`: 400 for a request the model cannot serve (a
prompt longer than the context), 502 when the upstream answered with an error, 503 when it cannot be reached.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from fulmen.producers.llm_gateway.protocol import ChatRequest, CompletionRequest

__all__ = ["Backend", "CallResult", "Choice", "TokenLogprob"]


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token as OpenAI's logprobs report it (``top`` holds the most likely alternatives)."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class Choice:
    index: int
    text: str  # the assistant's text; for chat with tool calls, what is left outside them
    finish_reason: str  # stop, length, tool_calls
    token_ids: list[int] | None  # exactly what the model sampled (None: the backend cannot tell)
    logprobs: list[float] | None  # one per token id, of the raw model distribution (before temperature)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool_calls objects
    token_logprobs: list[TokenLogprob] | None = None  # for the response, when the client asked for logprobs
    pieces: list[str] | None = None  # the text each token added (for streaming); joined, they equal ``text``


@dataclass
class CallResult:
    id: str
    model: str  # the model that served the call, as the response reports it
    choices: list[Choice]
    prompt_token_ids: list[int] | None
    prompt_tokens: int
    completion_tokens: int
    model_version: int | None = None
    prompt_text: str | None = None  # the rendered prompt (chat template applied), when known
    token_ids_absent: str | None = None  # why the token ids are missing, when they are


class Backend(Protocol):
    name: str

    @property
    def model_version(self) -> int | None: ...

    @property
    def context_length(self) -> int | None: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def chat(self, request: ChatRequest) -> CallResult: ...

    async def complete(self, request: CompletionRequest) -> CallResult: ...

    async def load_version(self, uri: str, version: int) -> None:
        """Load the weights at ``uri`` (a checkpoint directory) and serve new calls with them as ``version``."""
        ...
