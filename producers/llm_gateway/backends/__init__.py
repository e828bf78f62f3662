"""Inference backends behind one interface (:class:`Backend`), chosen by ``FULMEN_LLM_BACKEND``.

The gateway's backend is always the router (:class:`~.router.ReplicaRouter`) over the replicas of the chosen kind:
``FULMEN_LLM_REPLICAS`` in-process model copies (``transformers``) or llama-server child processes (``llamacpp``),
or one upstream per URL of ``FULMEN_LLM_UPSTREAM_URL`` (``vllm``, ``openai``). One replica is the common case, and is
routed the same way. A factory gets the settings and ``FULMEN_HOME`` (where a backend keeps files it makes).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fulmen.infra.settings import default_home
from fulmen.producers.llm_gateway.backends.base import Backend, CallResult, Choice, Replica, TokenLogprob
from fulmen.producers.llm_gateway.backends.router import ReplicaRouter
from fulmen.producers.llm_gateway.settings import BackendKind, LlmSection
from fulmen.schemas.errors import ConfigurationError

__all__ = ["BACKENDS", "Backend", "CallResult", "Choice", "Replica", "ReplicaRouter", "TokenLogprob", "build_backend"]


def _transformers(options: LlmSection, home: Path) -> list[Replica]:
    from fulmen.producers.llm_gateway.backends.transformers_backend import TransformersBackend  # imports torch: lazily

    return [TransformersBackend(options, index) for index in range(options.replicas)]


def _vllm(options: LlmSection, home: Path) -> list[Replica]:
    from fulmen.producers.llm_gateway.backends.vllm import VllmBackend

    return [VllmBackend(options, url) for url in _urls(options)]


def _openai(options: LlmSection, home: Path) -> list[Replica]:
    from fulmen.producers.llm_gateway.backends.upstream import OpenAIUpstreamBackend

    return [OpenAIUpstreamBackend(options, url) for url in _urls(options)]


def _llamacpp(options: LlmSection, home: Path) -> list[Replica]:
    from fulmen.producers.llm_gateway.backends.llamacpp import LlamaCppBackend  # imports torch: lazily

    return [LlamaCppBackend(options, index, home) for index in range(options.replicas)]


def _urls(options: LlmSection) -> list[str]:
    urls = options.upstream_urls
    if not urls:
        raise ConfigurationError(f"FULMEN_LLM_UPSTREAM_URL: the {options.backend} backend needs the upstream's /v1 URL")
    if len(set(urls)) < len(urls):
        raise ConfigurationError(f"FULMEN_LLM_UPSTREAM_URL: an upstream is listed twice ({len(urls)} URLs)")
    if options.replicas != 1:
        raise ConfigurationError(
            "FULMEN_LLM_REPLICAS is for the transformers backend; upstream replicas are the URLs of "
            "FULMEN_LLM_UPSTREAM_URL (comma-separated)"
        )
    return urls


BACKENDS: dict[BackendKind, Callable[[LlmSection, Path], list[Replica]]] = {
    BackendKind.TRANSFORMERS: _transformers,
    BackendKind.VLLM: _vllm,
    BackendKind.OPENAI: _openai,
    BackendKind.LLAMACPP: _llamacpp,
}


def build_backend(options: LlmSection, home: Path | None = None) -> Backend:
    """The router over the replicas ``options`` ask for; ``home``: ``FULMEN_HOME`` (default: its default)."""
    try:
        factory = BACKENDS[BackendKind(options.backend)]
    except (KeyError, ValueError):
        valid = ", ".join(kind.value for kind in BACKENDS)
        raise ConfigurationError(f"FULMEN_LLM_BACKEND={options.backend!r}: valid backends are {valid}") from None
    return ReplicaRouter(factory(options, home or default_home()), options)
