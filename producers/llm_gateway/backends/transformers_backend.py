"""The ``transformers`` backend: a Hugging Face causal LM in this process, on the CPU or a GPU.

Prompts are rendered with the tokenizer's chat template (tools included) and tokenized once; the token ids
the model was fed and the ids it sampled are what the call reports, never a re-tokenization of text.
Concurrent calls are batched: a scheduler task takes what is waiting (up to ``max_batch_rows`` sequences,
waiting at most ``batch_wait_ms`` for more), runs the batch on one worker thread, and answers each call.
A new model version is loaded on another thread while batches run and takes over at the next batch; a call
is served entirely by the version its batch started with. A version is full weights (a Hugging Face checkpoint
directory) or a LoRA adapter (a PEFT adapter directory), merged into its base model (``ModelVersion.base_model``,
else the model the gateway started with) once, at load time.

``FULMEN_LLM_REPLICAS`` > 1 makes several of these in one process (the router spreads calls over them): each
has its own copy of the weights, its own batcher and generation thread, on the device ``FULMEN_LLM_DEVICE``
lists for it (``cuda:0,cuda:1``: one replica per GPU). On one device they share its cores (torch releases the
GIL while it computes), which helps little on a CPU; the point there is to run what runs on several GPUs.

Rendering, tokenizing and decoding (:mod:`.tokenizing`, shared with the llamacpp backend) run on a small "prepare"
thread pool, never on the event loop (a 10 MB
prompt takes seconds to tokenize). A batch whose generation raises is retried call by call, so a request
that slipped past validation fails alone instead of failing every call it shared the batch with.

Agents' adapters (``ModelVersion.adapter``, ``FULMEN_TRAIN_ADAPTERS=per_agent``): each loads, unmerged, into the
model being served (a PEFT model with one adapter per agent on the frozen weights), on the generation thread
between two batches, so no batch sees a half-loaded adapter; a new version of an agent's adapter replaces its
previous one the same way. One batch mixes agents: each row runs with its call's adapter, or with none (the
model's own weights) for a call that names no agent or an agent without one (PEFT's per-row ``adapter_names``).
A new full-weight version starts without adapters (they were trained on the weights it replaces).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fulmen.infra.torch_cuda import trusted_attention
from fulmen.producers.llm_gateway.backends.base import CallResult, Choice, VersionRefusedError
from fulmen.producers.llm_gateway.backends.sampling import Row, RowOutput, generate
from fulmen.producers.llm_gateway.backends.tokenizing import (
    build_choice,
    call_result,
    chat_template_override,
    completion_budget,
    load_tokenizer,
    longest_token_bytes,
    no_progress_bars,
    render_chat,
    stop_check,
    tokenize_completion,
)
from fulmen.producers.llm_gateway.protocol import ApiError, ChatRequest, CompletionRequest, SamplingParams
from fulmen.producers.llm_gateway.settings import LlmSection
from fulmen.schemas import ModelVersion
from fulmen.schemas.errors import ConfigurationError

__all__ = ["TransformersBackend", "chat_template_override"]  # the template setting, as examples/train.py reads it

log = logging.getLogger(__name__)

# from_pretrained is not thread-safe: it builds the model on the meta device by patching torch's module
# constructors for the whole process while it loads, so two replicas loading at once on two threads got meta
# tensors ("Cannot copy out of meta tensor"). One load at a time per process; the replicas serve meanwhile.
_LOADING = threading.Lock()


@dataclass
class _Loaded:
    """One loaded version. ``model`` (wrapped in a PEFT model by the first agent's adapter) and ``adapters`` change
    on the generation thread only, between batches; the rest never changes."""

    model: Any
    tokenizer: Any
    version: int | None
    eos_ids: frozenset[int]
    pad_id: int
    max_token_bytes: int = 64  # the longest token's text in UTF-8 bytes: a prompt of B bytes has >= B / this tokens
    vocab_size: int = 0  # len(tokenizer), kept (counting it takes ~20 ms)
    # per agent, (the PEFT adapter's name in ``model``, its version); changed on the generation thread only
    adapters: dict[str, tuple[str, int]] = field(default_factory=dict)


_BASE = "__base__"  # PEFT's adapter name for "no adapter" in a mixed batch


@dataclass
class _Pending:
    rows: list[Row]
    future: asyncio.Future[tuple[list[RowOutput], _Loaded, tuple[str, int] | None]]
    agent: str | None = None


@dataclass(frozen=True)
class _Served:
    """What served one call: the model (with its tokenizer) and the agent's adapter with its version, if any."""

    loaded: _Loaded
    adapter: tuple[str, int] | None


class TransformersBackend:
    name = "transformers"

    def __init__(self, options: LlmSection, index: int = 0) -> None:
        if not options.model:
            raise ConfigurationError("FULMEN_LLM_MODEL: the transformers backend needs a model directory")
        self.options = options
        self.device = options.devices[index % len(options.devices)]
        self.label = f"transformers#{index}@{self.device}"
        self._loaded: _Loaded | None = None
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="llm-generate")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="llm-load")
        self._prepare = ThreadPoolExecutor(2, thread_name_prefix="llm-prepare")
        self._scheduler: asyncio.Task[None] | None = None
        self._adapter_count = 0  # names the PEFT adapters loaded (agents' names may hold '.', which PEFT cannot)

    # --- lifecycle ------------------------------------------------------------------------------------------
    @property
    def model_version(self) -> int | None:
        return self._loaded.version if self._loaded else None

    @property
    def context_length(self) -> int | None:
        if self._loaded is None:
            return None
        return self.options.max_model_len or int(getattr(self._loaded.model.config, "max_position_embeddings", 2048))

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._loaded = await loop.run_in_executor(
            self._loader, self._load, self.options.model, self.options.model_version
        )
        self._scheduler = asyncio.create_task(self._schedule(), name="llm-batch-scheduler")

    async def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.cancel()
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._prepare.shutdown(wait=False, cancel_futures=True)

    def adapter_version(self, agent: str) -> int | None:
        adapter = self._loaded.adapters.get(agent) if self._loaded else None
        return adapter[1] if adapter else None

    async def probe(self) -> None:
        """In process: up once started."""

    def swaps_in_place(self, event: ModelVersion) -> bool:
        return False  # the new copy loads beside the one serving

    async def load_version(self, event: ModelVersion) -> None:
        if event.adapter:
            await self._load_agent_adapter(event)
            return
        adapter = event.uri if event.format == "hf_lora_adapter" else None
        base = (event.base_model or self.options.model) if adapter else event.uri
        try:
            loaded = await asyncio.get_running_loop().run_in_executor(
                self._loader, self._load, base, event.version, adapter
            )
        except Exception as exc:  # a missing or broken checkpoint: the version serving goes on
            raise VersionRefusedError(f"{self.label} could not load {event.uri}: {type(exc).__name__}: {exc}") from exc
        self._loaded = loaded
        log.info("%s: model version %d loaded from %s; new calls use it", self.label, event.version, event.uri)

    async def _load_agent_adapter(self, event: ModelVersion) -> None:
        loaded = self._require_loaded()
        try:
            await asyncio.get_running_loop().run_in_executor(self._worker, self._add_adapter, loaded, event)
        except Exception as exc:
            raise VersionRefusedError(
                f"{self.label} could not load agent {event.adapter}'s adapter from {event.uri}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        log.info(
            "%s: version %d of agent %s's adapter loaded from %s; its calls use it",
            self.label,
            event.version,
            event.adapter,
            event.uri,
        )

    def _add_adapter(self, loaded: _Loaded, event: ModelVersion) -> None:
        """On the generation thread (no batch runs meanwhile): load the adapter beside the others, unmerged, and
        drop the agent's previous one."""
        from peft import PeftModel

        if not Path(event.uri).is_dir():
            raise ConfigurationError(f"adapter directory {event.uri} does not exist")
        self._adapter_count += 1
        name = f"agent{self._adapter_count}"
        with no_progress_bars():
            if isinstance(loaded.model, PeftModel):
                loaded.model.load_adapter(event.uri, adapter_name=name)
            else:  # the first adapter wraps the model (its layers gain the adapters; ``loaded`` keeps the wrapper)
                loaded.model = PeftModel.from_pretrained(loaded.model, event.uri, adapter_name=name)
            loaded.model.eval()
        previous = loaded.adapters.get(event.adapter)
        loaded.adapters[event.adapter] = (name, event.version)
        if previous is not None:
            loaded.model.set_adapter(name)  # (rows name theirs; PEFT wants an active one that is not being deleted)
            loaded.model.delete_adapter(previous[0])

    def _load(self, path: str, version: int | None, adapter: str | None = None) -> _Loaded:
        import torch
        from transformers import AutoModelForCausalLM

        for directory in (path, adapter):
            if directory is not None and not Path(directory).is_dir():
                raise ConfigurationError(
                    f"model directory {directory} does not exist (FULMEN_LLM_MODEL or a ModelVersion uri)"
                )
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        trusted_attention(device)
        dtype = "auto" if self.options.dtype == "auto" else getattr(torch, self.options.dtype)
        started = time.perf_counter()
        with _LOADING, no_progress_bars():
            tokenizer = load_tokenizer(path, self.options.chat_template)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            if adapter is not None:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
            model = model.to(device).eval()
        eos = set(_as_list(model.generation_config.eos_token_id)) | set(_as_list(tokenizer.eos_token_id))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
        log.info(
            "loaded %s%s on %s in %.1fs (version %s)",
            path,
            f" + LoRA {adapter}" if adapter else "",
            device,
            time.perf_counter() - started,
            version,
        )
        return _Loaded(model, tokenizer, version, frozenset(eos), pad, longest_token_bytes(tokenizer), len(tokenizer))

    # --- calls ----------------------------------------------------------------------------------------------
    async def chat(self, request: ChatRequest) -> CallResult:
        loaded = self._require_loaded()
        prompt, prompt_ids = await self._off_loop(render_chat, loaded, request, self.context_length or 2048)
        outputs, served = await self._run(prompt_ids, request.sampling, loaded.tokenizer, request.agent)
        choices = await self._off_loop(
            self._choices, outputs, served.loaded, request.sampling, request.parse_tool_calls
        )
        return self._result("chatcmpl", request.model, choices, prompt_ids, prompt, served)

    async def complete(self, request: CompletionRequest) -> CallResult:
        loaded = self._require_loaded()
        prompt, prompt_ids = await self._off_loop(tokenize_completion, loaded, request, self.context_length or 2048)
        outputs, served = await self._run(prompt_ids, request.sampling, loaded.tokenizer, request.agent)
        choices = await self._off_loop(self._choices, outputs, served.loaded, request.sampling, False)
        if request.echo:
            for choice in choices:
                choice.text = prompt + choice.text
        return self._result("cmpl", request.model, choices, prompt_ids, prompt, served)

    async def _off_loop(self, function: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._prepare, function, *args)

    def _choices(
        self, outputs: list[RowOutput], served: _Loaded, sampling: SamplingParams, tools: bool
    ) -> list[Choice]:
        return [self._choice(i, out, served, sampling, tools) for i, out in enumerate(outputs)]

    def _require_loaded(self) -> _Loaded:
        if self._loaded is None:
            raise ApiError(503, "the model is still loading")
        return self._loaded

    async def _run(
        self, prompt_ids: list[int], sampling: SamplingParams, tokenizer: Any, agent: str | None = None
    ) -> tuple[list[RowOutput], _Served]:
        limit = self.context_length or 2048
        wanted = completion_budget(len(prompt_ids), sampling, limit, self.options.default_max_tokens)
        check = stop_check(sampling.stop, tokenizer) if sampling.stop else None
        rows = [
            Row(
                prompt_ids,
                wanted,
                sampling.temperature,
                sampling.top_p,
                None if sampling.seed is None else sampling.seed + index,
                sampling.top_logprobs,
                check,
            )
            for index in range(sampling.n)
        ]
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(rows, future, agent))
        outputs, loaded, adapter = await future
        return outputs, _Served(loaded, adapter)

    def _choice(self, index: int, out: RowOutput, served: _Loaded, sampling: SamplingParams, tools: bool) -> Choice:
        return build_choice(
            index, served.tokenizer, out.token_ids, out.logprobs, out.top, out.finish_reason, sampling, tools
        )

    def _result(
        self, kind: str, model: str, choices: list[Choice], prompt_ids: list[int], prompt: str, served: _Served
    ) -> CallResult:
        version = served.adapter[1] if served.adapter else served.loaded.version
        adapter = served.adapter[0] if served.adapter else None
        return call_result(kind, model, choices, prompt_ids, prompt, version, adapter)

    # --- batching -------------------------------------------------------------------------------------------
    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            rows = len(batch[0].rows)
            deadline = loop.time() + self.options.batch_wait_ms / 1000
            while rows < self.options.max_batch_rows:
                try:
                    pending = await asyncio.wait_for(self._queue.get(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    break
                batch.append(pending)
                rows += len(pending.rows)
            await self._run_batch(loop, batch)

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, batch: list[_Pending]) -> None:
        served = self._require_loaded()
        rows = [row for pending in batch for row in pending.rows]
        try:
            outputs, adapters = await loop.run_in_executor(self._worker, _generate_batch, served, batch)
        except Exception as exc:
            if len(batch) > 1:  # find the call at fault: each call alone, so only that one fails
                log.warning("generation failed for a batch of %d calls (%s); retrying each alone", len(batch), exc)
                for pending in batch:
                    await self._run_batch(loop, [pending])
                return
            log.exception("generation failed for a call of %d sequences", len(rows))
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(ApiError(500, f"generation failed: {type(exc).__name__}: {exc}"))
            return
        position = 0
        for pending, adapter in zip(batch, adapters, strict=True):
            part = outputs[position : position + len(pending.rows)]
            position += len(pending.rows)
            if not pending.future.done():
                pending.future.set_result((part, served, adapter))


def _generate_batch(served: _Loaded, batch: list[_Pending]) -> tuple[list[RowOutput], list[tuple[str, int] | None]]:
    """On the generation thread: every row of the batch, each call's with its agent's adapter (looked up here, where
    adapters are loaded, so a call is served by one adapter version); which adapter served each call, as
    ``(agent, version)``."""
    used = [(p.agent, *served.adapters[p.agent]) if p.agent in served.adapters else None for p in batch]
    rows = [row for pending in batch for row in pending.rows]
    names = None
    if served.adapters:  # a PEFT model: every row says which adapter it runs with, or none
        names = [u[1] if u else _BASE for u, pending in zip(used, batch, strict=True) for _ in pending.rows]
    routed = {} if names is None else {"adapter_names": names}  # only a PEFT model takes them
    outputs = generate(served.model, rows, served.pad_id, set(served.eos_ids), **routed)
    return outputs, [(u[0], u[2]) if u else None for u in used]


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [int(value)]
