"""The OpenAI-compatible LLM gateway (``fulmen llm-gateway``): token-in, token-out, one span per call."""

from fulmen.producers.llm_gateway.app import LlmGateway
from fulmen.producers.llm_gateway.settings import BackendKind, LlmGatewaySettings

__all__ = ["BackendKind", "LlmGateway", "LlmGatewaySettings"]
