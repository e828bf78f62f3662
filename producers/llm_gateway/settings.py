"""Settings of the LLM gateway process: the shared sections plus ``FULMEN_LLM_*``."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, Field, SecretStr

from fulmen.infra.settings import FulmenSettings

__all__ = ["BackendKind", "LlmGatewaySettings", "LlmSection"]


class BackendKind(StrEnum):
    TRANSFORMERS = "transformers"  # a Hugging Face model in this process (CPU or GPU)
    VLLM = "vllm"  # an upstream vLLM OpenAI server, asked for token ids and logprobs
    OPENAI = "openai"  # any OpenAI-compatible upstream; no token ids
    LLAMACPP = "llamacpp"  # llama.cpp's llama-server as a child process, on a GGUF written from the checkpoint


class LlmSection(BaseModel):
    """The LLM gateway (``fulmen llm-gateway``): where it listens, its inference backend and model, its limits."""

    host: str = Field(default="127.0.0.1", description="listen address")
    port: int = Field(default=8000, ge=0, le=65535, description="0 = any free port")
    backend: BackendKind = Field(
        default=BackendKind.TRANSFORMERS, description="the inference backend: transformers, llamacpp, vllm or openai"
    )
    model: str = Field(
        default="", description="transformers/llamacpp: a model directory; vllm/openai: the upstream's name"
    )
    served_model_name: str = Field(default="fulmen", description="the name agents ask for (also /v1/models)")
    model_version: int | None = Field(default=None, ge=0, description="version of the initial model, if known")
    follow_models: bool = Field(default=True, description="load each new version published on fulmen.models")
    follow: Literal["newest", "promoted"] = Field(
        default="newest",
        description="newest: serve each new version "
        "(training); promoted: serve the version in force on "
        "fulmen.promotions, rollbacks included (agents in production; "
        "fulmen.algorithm.service.promotion)",
    )
    device: str = Field(
        default="auto",
        description="transformers: cpu, cuda, cuda:N or auto; a comma-separated list puts replica i on device i mod "
        "its length",
    )
    replicas: int = Field(
        default=1, ge=1, le=64, description="transformers: model copies in this process, each with its own batcher"
    )
    dtype: str = Field(default="auto", description="transformers: auto, float32, bfloat16 or float16")
    max_model_len: int | None = Field(default=None, ge=16, description="context limit; default: the model's")
    chat_template: str = Field(
        default="",
        description="transformers/llamacpp: a Jinja chat template file that "
        "replaces the tokenizer's (as vLLM's --chat-template), or 'chatml-tools' (built in: "
        "tools as <tool_call> blocks); default: the model's own",
    )
    max_batch_rows: int = Field(default=32, ge=1, le=1024, description="transformers: sequences per batch")
    batch_wait_ms: float = Field(default=2.0, ge=0, le=1000, description="transformers: wait to fill a batch")
    default_max_tokens: int | None = Field(
        default=None, ge=1, description="when a request sets none; unset = as many as fit in the context"
    )
    max_n: int = Field(default=16, ge=1, le=128, description="the most choices (n) one request may ask for; 400 above")
    llamacpp_server: str = Field(
        default="", description="llamacpp: the llama-server binary; default: the one `make install` built for this CPU"
    )
    llamacpp_slots: int = Field(
        default=16, ge=1, le=256, description="llamacpp: sequences llama-server decodes at once (-np), each its KV"
    )
    llamacpp_threads: int | None = Field(default=None, ge=1, description="llamacpp: CPU threads (-t); default: all")
    llamacpp_gguf_type: Literal["f32", "f16", "bf16"] = Field(
        default="f32", description="llamacpp: the weights' type in the GGUF (norms and biases stay f32)"
    )
    llamacpp_context: int | None = Field(
        default=None,
        ge=16,
        description="llamacpp: context of each slot in tokens; default: FULMEN_LLM_MAX_MODEL_LEN, else the model's, "
        "at most 4096 (the f32 KV of every slot is allocated at start)",
    )
    llamacpp_coalesce_ms: float = Field(
        default=10.0,
        ge=0,
        le=1000,
        description="llamacpp: concurrent calls with the same prompt and no seed wait "
        "this long for the next such call (at most 4 times this in all) to share one prefill (0: off)",
    )
    llamacpp_cache_ram_mb: int = Field(
        default=2048, ge=0, description="llamacpp: RAM for KV of prompts no slot holds any more (--cache-ram; 0: off)"
    )
    llamacpp_wait_policy: Literal["passive", "active"] = Field(
        default="passive",
        description="llamacpp: llama-server's threads sleep (passive) or spin (active) at each "
        "step's barriers; spinning threads on cores the trainer or agents also use slowed it 4x (OMP_WAIT_POLICY)",
    )
    llamacpp_start_timeout_s: float = Field(
        default=120.0, gt=0, description="llamacpp: how long llama-server may take to load a version"
    )
    upstream_url: str = Field(
        default="",
        description="vllm/openai: the upstream's base URL, ending in /v1; several, comma-separated, are replicas",
    )
    upstream_api_key: SecretStr | None = Field(
        default=None, description="vllm/openai: the bearer key the upstream requires (a secret: never printed)"
    )
    upstream_timeout_s: float = Field(default=600.0, gt=0, description="one upstream call (or weight load) at most")
    replica_attempts: int = Field(
        default=3, ge=1, le=64, description="replicas one call may try: a failed replica's call goes to another"
    )
    replica_retry_s: float = Field(
        default=1.0, gt=0, description="a failed replica is probed again after this, doubled per failure"
    )
    replica_retry_max_s: float = Field(default=30.0, gt=0, description="the longest wait between two probes")
    replica_wait_s: float = Field(
        default=120.0, gt=0, description="how long a call waits for a replica while every one is swapping weights"
    )
    publish_timeout_s: float = Field(default=10.0, gt=0, description="503 when a call's span is not acknowledged")
    bearer_token: SecretStr | None = Field(
        default=None, description="when set, every /v1 and /rollout call must carry Authorization: Bearer <it>"
    )
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, description="a larger body is refused (413), by Content-Length first"
    )
    read_timeout_s: float = Field(
        default=60.0, gt=0, description="a client must send its headers, and then its body, within this (408)"
    )

    @property
    def upstream_urls(self) -> list[str]:
        """``upstream_url`` as a list: one replica per URL."""
        return [url.strip().rstrip("/") for url in self.upstream_url.split(",") if url.strip()]

    @property
    def devices(self) -> list[str]:
        return [device.strip() for device in self.device.split(",") if device.strip()] or ["auto"]


class LlmGatewaySettings(FulmenSettings):
    llm: LlmSection = Field(default_factory=LlmSection)

    def masked(self) -> dict:
        data = super().masked()
        if self.llm.upstream_api_key is not None:
            data["llm"]["upstream_api_key"] = "***"
        return data
