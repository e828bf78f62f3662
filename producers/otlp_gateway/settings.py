"""Settings of the OTLP gateway process: the shared sections plus ``FULMEN_OTLP_*``."""

from __future__ import annotations

from pydantic import BaseModel, Field, SecretStr

from fulmen.infra.settings import FulmenSettings

__all__ = ["OtlpGatewaySettings", "OtlpSection"]


class OtlpSection(BaseModel):
    host: str = Field(default="127.0.0.1", description="listen address (0.0.0.0: every interface)")
    port: int = Field(default=4318, ge=0, le=65535, description="4318 is the OTLP/HTTP default; 0 = any free port")
    bearer_token: SecretStr | None = Field(default=None, description="when set, requests must carry it")
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024, description="after gzip inflation; 413 above")
    max_record_bytes: int = Field(default=1024 * 1024, ge=16 * 1024, description="one Kafka record at most")
    max_inflight_bytes: int = Field(default=64 * 1024 * 1024, ge=1024, description="waiting for Kafka; 503 above")
    publish_timeout_s: float = Field(default=10.0, gt=0, description="503 when Kafka has not acknowledged by then")
    retry_after_s: int = Field(default=1, ge=1, description="the Retry-After a 503 answer carries")
    read_timeout_s: float = Field(
        default=60.0, gt=0, description="a client must send its headers, and then its body, within this (408)"
    )
    decode_processes: int = Field(
        default=2,
        ge=0,
        description="worker processes that decode bodies of process_body_bytes and up (started on the first "
        "such body), so a large export never stalls the event loop; 0 = decode every body on a thread",
    )
    process_body_bytes: int = Field(
        default=2 * 1024 * 1024, ge=0, description="bodies this large and up (after inflation) go to a decoding process"
    )


class OtlpGatewaySettings(FulmenSettings):
    otlp: OtlpSection = Field(default_factory=OtlpSection)

    def masked(self) -> dict:
        data = super().masked()
        if self.otlp.bearer_token is not None:
            data["otlp"]["bearer_token"] = "***"
        return data
