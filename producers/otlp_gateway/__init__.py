"""The OTLP/HTTP gateway: agents' spans in, the spans topic out."""

from typing import Any

from fulmen.producers.otlp_gateway.settings import OtlpGatewaySettings, OtlpSection

__all__ = ["OtlpGateway", "OtlpGatewaySettings", "OtlpGatewayStats", "OtlpSection"]


def __getattr__(name: str) -> Any:
    """The gateway itself on first use: its settings alone (what ``fulmen --help`` reads) import no server."""
    if name in ("OtlpGateway", "OtlpGatewayStats"):
        from fulmen.producers.otlp_gateway import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
