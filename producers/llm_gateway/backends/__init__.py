"""Inference backends behind one interface (:class:`Backend`), chosen by ``FULMEN_LLM_BACKEND``."""

from __future__ import annotations

from collections.abc import Callable

from fulmen.producers.llm_gateway.backends.base import Backend, CallResult, Choice, TokenLogprob
from fulmen.producers.llm_gateway.settings import BackendKind, LlmSection
from fulmen.schemas.errors import ConfigurationError

__all__ = ["BACKENDS", "Backend", "CallResult", "Choice", "TokenLogprob", "build_backend"]


def _transformers(options: LlmSection) -> Backend:
    from fulmen.producers.llm_gateway.backends.transformers_backend import TransformersBackend  # imports torch: lazily

    return TransformersBackend(options)


def _vllm(options: LlmSection) -> Backend:
    from fulmen.producers.llm_gateway.backends.upstream import VllmBackend

    return VllmBackend(options)


def _openai(options: LlmSection) -> Backend:
    from fulmen.producers.llm_gateway.backends.upstream import OpenAIUpstreamBackend

    return OpenAIUpstreamBackend(options)


BACKENDS: dict[BackendKind, Callable[[LlmSection], Backend]] = {
    BackendKind.TRANSFORMERS: _transformers,
    BackendKind.VLLM: _vllm,
    BackendKind.OPENAI: _openai,
}


def build_backend(options: LlmSection) -> Backend:
    try:
        factory = BACKENDS[BackendKind(options.backend)]
    except (KeyError, ValueError):
        valid = ", ".join(kind.value for kind in BACKENDS)
        raise ConfigurationError(f"FULMEN_LLM_BACKEND={options.backend!r}: valid backends are {valid}") from None
    return factory(options)
