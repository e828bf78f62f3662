"""The OTLP/HTTP gateway: agents' spans in, the spans topic out."""

from fulmen.producers.otlp_gateway.app import OtlpGateway, OtlpGatewayStats
from fulmen.producers.otlp_gateway.settings import OtlpGatewaySettings, OtlpSection

__all__ = ["OtlpGateway", "OtlpGatewaySettings", "OtlpGatewayStats", "OtlpSection"]
