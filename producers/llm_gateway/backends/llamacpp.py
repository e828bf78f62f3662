"""The ``llamacpp`` backend: llama.cpp's ``llama-server`` as a managed child process of the gateway (CPU).

The model (``FULMEN_LLM_MODEL``, a Hugging Face checkpoint directory) is written as a GGUF file
(:mod:`.gguf_cache`, :mod:`.gguf_export`) and served by a ``llama-server`` (:mod:`.llamacpp_process`) that
``make install`` built for this CPU (:mod:`.llamacpp_build`), started with ``FULMEN_LLM_LLAMACPP_SLOTS`` slots
(sequences decoded together, each with its own KV cache of ``FULMEN_LLM_LLAMACPP_CONTEXT`` tokens), f32 KV and no
flash attention: what makes its logprobs match the trainer's (measured on SmolLM2-135M in float32: mean |diff|
3e-5, max 1.6e-4; with flash attention and f16 KV, 0.009).

Calls are rendered and tokenized here exactly as the transformers backend does (:mod:`.tokenizing`) and sent as
token ids (:mod:`.llamacpp_wire`); the ids llama.cpp sampled and their logprobs are what the call reports. Each slot
keeps its KV, and llama-server gives a prompt the slot whose cached tokens share the longest prefix with it, so an
episode's next call (its previous prompt and reply, then more) is not prefilled again. Concurrent calls with the
same prompt, the same sampling settings and no seed (a GRPO group's first calls) are coalesced: they wait up to
``FULMEN_LLM_LLAMACPP_COALESCE_MS`` for each other and go as one request for all their completions, which
llama-server prefills once; each call still gets its own completions.

Versions load beside the one serving (``swaps_in_place`` is False): the new checkpoint is converted on a thread, a
new llama-server starts on another port and, once its ``/health`` answers, takes the new calls; the old one
finishes the calls that started on it and is stopped, and its GGUF deleted. A call is served entirely by one
version and reports it. A LoRA version is merged into its base and served as full weights (llama-server loads
adapters only at start-up: a new adapter needs a new server either way). A checkpoint that does not convert, or a
server that does not start, is refused (:class:`VersionRefusedError`) and the old server serves on.

Failure: a call that cannot reach its server (it died) fails with 503 ``upstream_unavailable``; the router takes the
replica out and its :meth:`LlamaCppBackend.probe` starts a new server on the same GGUF.
Per-agent adapters (``ModelVersion.adapter``) are not served yet: the transformers and vllm backends serve them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from fulmen.producers.llm_gateway.backends.base import (
    CallResult,
    Choice,
    ReplicaUnavailableError,
    VersionRefusedError,
)
from fulmen.producers.llm_gateway.backends.gguf_cache import GgufCache
from fulmen.producers.llm_gateway.backends.llamacpp_build import find_server
from fulmen.producers.llm_gateway.backends.llamacpp_coalesce import Coalescer
from fulmen.producers.llm_gateway.backends.llamacpp_process import LlamaServer, ServerStartError
from fulmen.producers.llm_gateway.backends.llamacpp_wire import Sample, completion_body, parse_samples, server_error
from fulmen.producers.llm_gateway.backends.tokenizing import (
    build_choice,
    call_result,
    completion_budget,
    load_tokenizer,
    longest_token_bytes,
    render_chat,
    tokenize_completion,
)
from fulmen.producers.llm_gateway.protocol import ApiError, ChatRequest, CompletionRequest, SamplingParams
from fulmen.producers.llm_gateway.settings import LlmSection
from fulmen.schemas import ModelVersion
from fulmen.schemas.errors import ConfigurationError

__all__ = ["LlamaCppBackend"]

log = logging.getLogger(__name__)

_DEFAULT_CONTEXT = 4096  # per slot, when neither setting nor a smaller model limit says otherwise
_HEALTH_TIMEOUT_S = 5.0


@dataclass(eq=False)
class _Serving:
    """One version being served: its server, GGUF and tokenizer, and the calls running on it."""

    version: int | None
    server: LlamaServer
    gguf: Path
    tokenizer: Any
    max_token_bytes: int
    vocab_size: int
    context: int
    source: str
    coalescer: Coalescer | None = None
    calls: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)


class LlamaCppBackend:
    """One replica: one llama-server at a time, two while a version swap finishes (see the module docstring)."""

    name = "llamacpp"

    def __init__(
        self,
        options: LlmSection,
        index: int,
        home: Path,
        transport: httpx.AsyncBaseTransport | None = None,
        server: type[LlamaServer] = LlamaServer,
        body_options: dict[str, Any] | None = None,
    ) -> None:
        """``home``: FULMEN_HOME (the GGUF files go to its ``llamacpp`` folder); ``transport`` and ``server``: what
        talks to llama-server and what runs it (tests swap them for fakes); ``body_options``: fields added to every
        ``/completion`` request (benchmarks: ``{"ignore_eos": True}``)."""
        if not options.model:
            raise ConfigurationError("FULMEN_LLM_MODEL: the llamacpp backend needs a model directory (Hugging Face)")
        self.options = options
        self.label = f"llamacpp#{index}"
        self.cache = GgufCache(home / "llamacpp", options.llamacpp_gguf_type)
        self.binary: Path | None = None
        self._serving: _Serving | None = None
        self._transport = transport
        self._server_class = server
        self._body_options = dict(body_options or {})
        self._client: httpx.AsyncClient | None = None
        self._retiring: dict[_Serving, asyncio.Task[None]] = {}  # previous versions finishing their calls
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="llamacpp-load")
        self._prepare = ThreadPoolExecutor(2, thread_name_prefix="llamacpp-prepare")

    # --- lifecycle ------------------------------------------------------------------------------------------
    @property
    def model_version(self) -> int | None:
        return self._serving.version if self._serving else None

    @property
    def context_length(self) -> int | None:
        return self._serving.context if self._serving else None

    def adapter_version(self, agent: str) -> int | None:
        return None

    async def start(self) -> None:
        self.binary = find_server(self.options.llamacpp_server)
        self._client = httpx.AsyncClient(transport=self._transport, timeout=self.options.upstream_timeout_s)
        try:
            self._serving = await self._launch(Path(self.options.model), None, self.options.model_version)
        except ServerStartError as exc:
            raise ConfigurationError(f"{self.label}: llama-server did not start: {exc}") from exc

    async def close(self) -> None:
        for task in self._retiring.values():
            task.cancel()
        await asyncio.gather(*self._retiring.values(), return_exceptions=True)
        for serving in [*self._retiring, *([self._serving] if self._serving else [])]:
            await self._stop(serving)
        self._retiring.clear()
        self._serving = None
        if self._client is not None:
            await self._client.aclose()
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._prepare.shutdown(wait=False, cancel_futures=True)

    async def probe(self) -> None:
        """Up when the server answers ``/health``; a server that died is replaced by a new one on the same GGUF."""
        serving = self._serving
        if serving is None:
            raise ReplicaUnavailableError(f"{self.label} is not started")
        if serving.server.alive and await self._healthy(serving.server):
            return
        log.warning(
            "%s: llama-server is down (%s); starting another on %s",
            self.label,
            serving.server.exit_reason().splitlines()[0],
            serving.gguf.name,
        )
        await serving.server.stop()
        server = self._server(serving.gguf, serving.context, serving.version)
        try:
            await server.start(self.options.llamacpp_start_timeout_s)
        except ServerStartError as exc:
            raise ReplicaUnavailableError(f"{self.label}: {exc}") from exc
        serving.server = server

    def swaps_in_place(self, event: ModelVersion) -> bool:
        if event.adapter:
            raise ConfigurationError(
                f"agent {event.adapter}'s adapter: the llamacpp backend does not serve per-agent adapters yet; "
                "the transformers backend (FULMEN_LLM_BACKEND=transformers) and vllm do"
            )
        return False  # a new server starts beside the one serving

    async def load_version(self, event: ModelVersion) -> None:
        self.swaps_in_place(event)
        adapter = Path(event.uri) if event.format == "hf_lora_adapter" else None
        checkpoint = Path(event.base_model or self.options.model) if adapter else Path(event.uri)
        started = time.perf_counter()
        try:
            serving = await self._launch(checkpoint, adapter, event.version)
        except Exception as exc:  # a checkpoint that does not convert, a server that does not start
            raise VersionRefusedError(f"{self.label} could not serve {event.uri}: {type(exc).__name__}: {exc}") from exc
        previous, self._serving = self._serving, serving
        if previous is not None:
            self._retire(previous)
        log.info(
            "%s: model version %d from %s serves (converted and started in %.2f s); new calls use it",
            self.label,
            event.version,
            event.uri,
            time.perf_counter() - started,
        )

    async def _launch(self, checkpoint: Path, adapter: Path | None, version: int | None) -> _Serving:
        """Convert (on the loader thread), then start a server while the tokenizer loads; return once it serves."""
        loop = asyncio.get_running_loop()
        gguf = await loop.run_in_executor(self._loader, self.cache.acquire, checkpoint, adapter)
        server: LlamaServer | None = None
        try:
            context = self._context_for(checkpoint)
            server = self._server(gguf, context, version)
            tokenizer = loop.run_in_executor(self._prepare, load_tokenizer, str(checkpoint), self.options.chat_template)
            outcomes = await asyncio.gather(
                server.start(self.options.llamacpp_start_timeout_s), tokenizer, return_exceptions=True
            )
            failed = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
            if failed:
                raise failed[0]
        except BaseException:
            if server is not None:
                await server.stop()
            self.cache.release(gguf)
            raise
        loaded = outcomes[1]
        serving = _Serving(
            version, server, gguf, loaded, longest_token_bytes(loaded), len(loaded), context, str(adapter or checkpoint)
        )
        wait_s = self.options.llamacpp_coalesce_ms / 1000
        serving.coalescer = Coalescer(
            lambda body, n, top: self._post(serving, body, n, top), wait_s, self.options.llamacpp_slots
        )
        serving.idle.set()
        return serving

    def _context_for(self, checkpoint: Path) -> int:
        if self.options.llamacpp_context or self.options.max_model_len:
            return int(self.options.llamacpp_context or self.options.max_model_len)
        config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
        return min(int(config.get("max_position_embeddings") or _DEFAULT_CONTEXT), _DEFAULT_CONTEXT)

    def _server(self, gguf: Path, context: int, version: int | None) -> LlamaServer:
        if self.binary is None:
            raise ReplicaUnavailableError(f"{self.label} is not started")
        slots = self.options.llamacpp_slots
        threads = str(self.options.llamacpp_threads or os.cpu_count() or 1)
        arguments = [
            "-c",
            str(context * slots),
            "-np",
            str(slots),
            "--no-kv-unified",
            "-t",
            threads,
            "-tb",
            threads,
            "-ctk",
            "f32",
            "-ctv",
            "f32",
            "-fa",
            "off",
            "--cache-ram",
            str(self.options.llamacpp_cache_ram_mb),
            "--no-webui",
            "--no-warmup",
            "-fit",
            "off",
        ]
        environment = {"OMP_WAIT_POLICY": self.options.llamacpp_wait_policy.upper()}
        return self._server_class(self.binary, gguf, arguments, f"{self.label}/v{version}", environment)

    def _retire(self, serving: _Serving) -> None:
        async def retire() -> None:
            await serving.idle.wait()  # the calls that started on it finish on it
            del self._retiring[serving]
            await self._stop(serving)

        self._retiring[serving] = asyncio.get_running_loop().create_task(retire(), name=f"{self.label}-retire")

    async def _stop(self, serving: _Serving) -> None:
        await serving.server.stop()
        self.cache.release(serving.gguf)

    async def _healthy(self, server: LlamaServer) -> bool:
        try:
            response = await self._http().get(f"{server.url}/health", timeout=_HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            raise ReplicaUnavailableError(f"{self.label} is not started")
        return self._client

    # --- calls ----------------------------------------------------------------------------------------------
    async def chat(self, request: ChatRequest) -> CallResult:
        with self._using() as serving:
            prompt, prompt_ids = await self._off_loop(render_chat, serving, request, serving.context)
            samples = await self._generate(serving, prompt_ids, request.sampling)
            choices = await self._off_loop(_choices, serving, samples, request.sampling, request.parse_tool_calls)
            return call_result("chatcmpl", request.model, choices, prompt_ids, prompt, serving.version)

    async def complete(self, request: CompletionRequest) -> CallResult:
        with self._using() as serving:
            prompt, prompt_ids = await self._off_loop(tokenize_completion, serving, request, serving.context)
            samples = await self._generate(serving, prompt_ids, request.sampling)
            choices = await self._off_loop(_choices, serving, samples, request.sampling, False)
            if request.echo:
                for choice in choices:
                    choice.text = prompt + choice.text
            return call_result("cmpl", request.model, choices, prompt_ids, prompt, serving.version)

    @contextlib.contextmanager
    def _using(self) -> Iterator[_Serving]:
        """The version serving now, counted in use for the whole call."""
        serving = self._serving
        if serving is None:
            raise ApiError(503, "the model is still loading", kind="upstream_unavailable")
        serving.calls += 1
        serving.idle.clear()
        try:
            yield serving
        finally:
            serving.calls -= 1
            if serving.calls == 0:
                serving.idle.set()

    async def _off_loop(self, function: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._prepare, function, *args)

    async def _generate(self, serving: _Serving, prompt_ids: list[int], sampling: SamplingParams) -> list[Sample]:
        wanted = completion_budget(len(prompt_ids), sampling, serving.context, self.options.default_max_tokens)
        if not serving.server.alive:
            raise ApiError(503, serving.server.exit_reason(), kind="upstream_unavailable")
        top = sampling.top_logprobs
        if sampling.seed is None and serving.coalescer is not None and serving.coalescer.enabled:
            return await serving.coalescer.join(prompt_ids, sampling, wanted)
        samples: list[Sample] = []
        slots = self.options.llamacpp_slots
        for first in range(0, sampling.n, slots):  # llama-server prefills one prompt for at most `slots` at once
            count = min(slots, sampling.n - first)
            seeded = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + first)
            samples += await self._post(serving, completion_body(prompt_ids, seeded, wanted, count), count, top)
        return samples

    async def _post(self, serving: _Serving, body: dict[str, Any], n: int, top: int) -> list[Sample]:
        server = serving.server
        try:
            response = await self._http().post(f"{server.url}/completion", json={**body, **self._body_options})
        except httpx.TimeoutException:
            limit = self.options.upstream_timeout_s
            raise ApiError(
                503, f"llama-server {server.label} did not answer within {limit:.0f} s", kind="upstream_unavailable"
            ) from None
        except httpx.HTTPError as exc:
            reason = server.exit_reason() if not server.alive else f"{type(exc).__name__}: {exc}"
            raise ApiError(
                503, f"llama-server {server.label} cannot be reached: {reason}", kind="upstream_unavailable"
            ) from None
        try:
            data = response.json()
        except ValueError:
            data = response.text
        if response.status_code != 200:
            raise server_error(response.status_code, data)
        samples = parse_samples(data, n, top)
        log.debug(
            "%s: %d completion(s) of a %d-token prompt (%d cached)",
            server.label,
            n,
            len(body["prompt"]),
            samples[0].cached_tokens if samples else 0,
        )
        return samples


def _choices(serving: _Serving, samples: list[Sample], sampling: SamplingParams, tools: bool) -> list[Choice]:
    return [
        build_choice(i, serving.tokenizer, s.token_ids, s.logprobs, s.top, s.finish_reason, sampling, tools)
        for i, s in enumerate(samples)
    ]
