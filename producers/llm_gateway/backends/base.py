"""What the gateway's backend offers it, what each replica behind it offers the router, and what a call returns.

The gateway talks to one :class:`Backend`: the router (:mod:`.router`) over one or more :class:`Replica`
objects of one kind (in-process models, or upstream servers, one per URL).

Lifecycle (both): ``start()`` (load or connect; raises :class:`~fulmen.schemas.errors.ConfigurationError` when the
model or upstream cannot be used), then any number of concurrent ``chat``/``complete`` calls, then ``close()``.
``load_version`` swaps the weights while calls run: a call is served entirely by one version, which it reports.

Calls raise :class:`~fulmen.producers.llm_gateway.protocol.ApiError`: 400 for a request the model cannot serve (a
prompt longer than the context), 502 when the upstream answered with an error, 503 when it cannot be reached.
A replica's 502 and 503 (kinds in :data:`REPLICA_FAILURE_KINDS`) say the replica failed, not the request: the
router takes the replica out and sends the call to another.

A replica's ``load_version`` returns once the new version serves (the upstream confirmed it), or raises
:class:`VersionRefusedError` (the replica said no and still serves its previous version) or
:class:`ReplicaUnavailableError` (it could not be reached, or its state is unknown: it must not serve until a
load succeeds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from fulmen.producers.llm_gateway.protocol import ChatRequest, CompletionRequest
from fulmen.schemas import ModelVersion
from fulmen.schemas.errors import FulmenError, RetryableError

__all__ = [
    "REPLICA_FAILURE_KINDS",
    "Backend",
    "CallResult",
    "Choice",
    "Replica",
    "ReplicaUnavailableError",
    "TokenLogprob",
    "VersionRefusedError",
]

# ApiError kinds that blame the replica (unreachable, too slow, or a 5xx of its own), not the request.
REPLICA_FAILURE_KINDS = frozenset({"upstream_unavailable", "upstream_error"})


class ReplicaUnavailableError(RetryableError):
    """A replica could not be reached or answered in a state that cannot serve (probe it again later)."""


class VersionRefusedError(FulmenError):
    """A replica refused a model version (a bad checkpoint, an endpoint it lacks); it serves its previous one."""


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
    replica: str | None = None  # the replica that served the call (set by the router)
    adapter: str | None = None  # the agent whose LoRA adapter served the call (None: the model's own weights)


class Backend(Protocol):
    """What the gateway calls: the router over the replicas."""

    name: str

    @property
    def model_version(self) -> int | None:
        """The version every live replica has confirmed (None: unknown, or no replica is live)."""
        ...

    @property
    def context_length(self) -> int | None: ...

    def adapter_version(self, agent: str) -> int | None:
        """The version of ``agent``'s adapter every live replica has confirmed (None: it has none)."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def chat(self, request: ChatRequest, affinity: str | None = None) -> CallResult:
        """Serve the call; calls with the same ``affinity`` (the rollout id) go to the same replica when it is up."""
        ...

    async def complete(self, request: CompletionRequest, affinity: str | None = None) -> CallResult: ...

    async def load_version(self, event: ModelVersion) -> None:
        """Serve ``event``'s weights (full weights, or a LoRA adapter; with ``event.adapter``, that agent's adapter,
        beside the model) on every live replica; raises :class:`VersionRefusedError` when some could not (they
        serve their previous version)."""
        ...


class Replica(Protocol):
    """One copy of the model: an in-process model with its batcher, or one upstream server."""

    name: str  # the backend kind
    label: str  # how logs and spans name this replica (an upstream's URL without its secrets)

    @property
    def model_version(self) -> int | None: ...

    @property
    def context_length(self) -> int | None: ...

    def adapter_version(self, agent: str) -> int | None:
        """The version of ``agent``'s adapter this replica serves (None: none; its calls get the model)."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def chat(self, request: ChatRequest) -> CallResult:
        """Serve the call; a ``request.agent`` with an adapter here gets the adapter (``CallResult.adapter``)."""
        ...

    async def complete(self, request: CompletionRequest) -> CallResult: ...

    async def probe(self) -> None:
        """Raise :class:`ReplicaUnavailableError` unless the replica can serve; refresh what it serves when it
        can tell (``model_version`` None: unknown, so the router loads the version it wants)."""
        ...

    def swaps_in_place(self, event: ModelVersion) -> bool:
        """Whether loading ``event`` replaces the weights calls run on (the router first drains the replica) or
        loads beside them (an agent's adapter always does). Raises :class:`~fulmen.schemas.errors.ConfigurationError`
        when this kind of replica cannot load it at all."""
        ...

    async def load_version(self, event: ModelVersion) -> None:
        """Load ``event`` and serve new calls with it once confirmed; see the module docstring for errors."""
        ...
