"""The OTLP/HTTP gateway: agents' spans in, the spans topic out."""

from fulmen.producers.otlp_gateway.app import GatewayStats, OtlpGateway
from fulmen.producers.otlp_gateway.settings import OtlpGatewaySettings, OtlpSection

__all__ = ["GatewayStats", "OtlpGateway", "OtlpGatewaySettings", "OtlpSection"]
