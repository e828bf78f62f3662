"""The OpenAI-compatible LLM gateway (``fulmen llm-gateway``): token-in, token-out, one span per call."""

from fulmen.producers.llm_gateway.settings import BackendKind, LlmGatewaySettings
from fulmen.schemas.lazy import lazy_exports

__all__ = ["BackendKind", "LlmGateway", "LlmGatewaySettings"]

# The server on first use: its settings alone (what `fulmen --help` reads) import no server.
__getattr__, __dir__ = lazy_exports(globals(), {"LlmGateway": "fulmen.producers.llm_gateway.app"})
