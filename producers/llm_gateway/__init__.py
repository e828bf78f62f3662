"""The OpenAI-compatible LLM gateway (``fulmen llm-gateway``): token-in, token-out, one span per call."""

from typing import Any

from fulmen.producers.llm_gateway.settings import BackendKind, LlmGatewaySettings

__all__ = ["BackendKind", "LlmGateway", "LlmGatewaySettings"]


def __getattr__(name: str) -> Any:
    """The gateway itself on first use: its settings alone (what ``fulmen --help`` reads) import no server."""
    if name == "LlmGateway":
        from fulmen.producers.llm_gateway.app import LlmGateway

        return LlmGateway
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
