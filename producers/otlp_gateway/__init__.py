"""The OTLP/HTTP gateway: agents' spans in, the spans topic out."""

from fulmen.producers.otlp_gateway.settings import OtlpGatewaySettings, OtlpSection
from fulmen.schemas.lazy import lazy_exports

__all__ = ["OtlpGateway", "OtlpGatewaySettings", "OtlpGatewayStats", "OtlpSection"]

# The server on first use: its settings alone (what `fulmen --help` reads) import no server.
__getattr__, __dir__ = lazy_exports(
    globals(), {name: "fulmen.producers.otlp_gateway.app" for name in ("OtlpGateway", "OtlpGatewayStats")}
)
