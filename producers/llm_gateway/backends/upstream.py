"""The ``openai`` backend's replica: one upstream OpenAI-compatible server (``vllm.py`` extends it for vLLM).

Each URL of ``FULMEN_LLM_UPSTREAM_URL`` is one replica; the router spreads calls over them. The request goes
upstream as the agent sent it (non-streaming: the gateway streams the answer back itself,
after recording it), with the model renamed to the upstream's. The ``vllm`` backend also asks for
``return_token_ids`` and ``logprobs`` and maps vLLM's answer: ``prompt_token_ids`` (chat: top level;
completions: per choice), ``choices[].token_ids``, and the sampled tokens' logprobs
(``choices[].logprobs.content[].logprob`` for chat, ``choices[].logprobs.token_logprobs`` for completions).
Logprobs the agent did not ask for are removed from its answer. The ``openai`` backend records what any
upstream returns; the span says why token ids are absent.

Upstream errors: its 4xx comes back to the agent as is; 5xx is a 502; unreachable or too slow is a 503.
The upstream URL may carry credentials (``user:password@``, ``?api_key=``): it is logged and put in messages
only through :func:`fulmen.infra.http.mask_url`, and error texts are scrubbed of it.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp

from fulmen.infra.http import mask_url, url_secrets
from fulmen.producers.llm_gateway.backends.base import CallResult, Choice, ReplicaUnavailableError, TokenLogprob
from fulmen.producers.llm_gateway.protocol import ApiError, ChatRequest, CompletionRequest
from fulmen.producers.llm_gateway.settings import LlmSection
from fulmen.schemas import ModelVersion
from fulmen.schemas.errors import ConfigurationError

__all__ = ["OpenAIUpstreamBackend", "Serving"]

_PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Serving:
    """What new calls are served with: the version, and the model name the upstream knows it by (the base
    model's, or a LoRA adapter's). A call takes it once, when it starts, and reports that version."""

    version: int | None
    model: str
    adapter: str | None = None  # the LoRA adapter's name, when a LoRA version is served


log = logging.getLogger(__name__)


class OpenAIUpstreamBackend:
    name = "openai"
    asks_token_ids = False
    absent_reason = "the openai backend's upstream does not return token ids"

    def __init__(self, options: LlmSection, url: str | None = None) -> None:
        url = url if url is not None else next(iter(options.upstream_urls), "")
        if not url:
            raise ConfigurationError(f"FULMEN_LLM_UPSTREAM_URL: the {self.name} backend needs the upstream's /v1 URL")
        self.options = options
        self.base_url = url.rstrip("/")
        self.shown_url = self.label = mask_url(self.base_url)
        self.headers = {}
        if options.upstream_api_key is not None:
            self.headers["Authorization"] = f"Bearer {options.upstream_api_key.get_secret_value()}"
        self.session: aiohttp.ClientSession | None = None
        self.serving = Serving(options.model_version, self.upstream_model)
        self.agents: dict[str, Serving] = {}  # per agent, its adapter (the vllm backend loads them)
        self.calls: Counter[str] = Counter()  # calls in flight per upstream model name
        self._context: int | None = options.max_model_len

    @property
    def model_version(self) -> int | None:
        return self.serving.version

    @property
    def context_length(self) -> int | None:
        return self._context

    def adapter_version(self, agent: str) -> int | None:
        serving = self.agents.get(agent)
        return serving.version if serving is not None else None

    def _serving(self, agent: str | None) -> tuple[Serving, str | None]:
        """What a call of ``agent`` is served with (its adapter, else the model), and the adapter's agent."""
        serving = self.agents.get(agent) if agent else None
        return (serving, agent) if serving is not None else (self.serving, None)

    async def start(self) -> None:
        # aiohttp rather than httpx: the gateway's own cost per call is what its overhead is made of.
        self.session = aiohttp.ClientSession(
            headers=self.headers,
            timeout=aiohttp.ClientTimeout(total=self.options.upstream_timeout_s, connect=10.0),
            connector=aiohttp.TCPConnector(limit=256, keepalive_timeout=30),
        )
        try:
            await self.probe()
        except ReplicaUnavailableError as exc:
            log.warning("upstream %s not reachable yet (%s); calls answer 503 until it is", self.shown_url, exc)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def probe(self) -> None:
        """Reachable when ``GET /models`` answers 200; the upstream model's ``max_model_len`` is noted."""
        found = await self.upstream_models()
        card = found.get(self.upstream_model) or {}
        if self._context is None and isinstance(card.get("max_model_len"), int):
            self._context = card["max_model_len"]

    async def upstream_models(self) -> dict[str, dict[str, Any]]:
        """The upstream's ``/models`` list by id; :class:`ReplicaUnavailableError` unless it answers 200."""
        status, data = await self.request("GET", f"{self.base_url}/models", timeout_s=_PROBE_TIMEOUT_S)
        if status != 200 or not isinstance(data, dict):
            raise ReplicaUnavailableError(f"upstream {self.shown_url}: GET /models answered {status}")
        return {m["id"]: m for m in data.get("data") or [] if isinstance(m, dict) and isinstance(m.get("id"), str)}

    async def request(
        self, method: str, url: str, *, json_body: Any = None, params: dict[str, str] | None = None, timeout_s: float
    ) -> tuple[int, Any]:
        """One request to the upstream: its status and body (JSON when it is JSON, else text);
        :class:`ReplicaUnavailableError` when it cannot be reached or does not answer within ``timeout_s``."""
        if self.session is None:
            raise ReplicaUnavailableError(f"upstream {self.shown_url}: the gateway is starting")
        try:
            async with self.session.request(
                method, url, json=json_body, params=params, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as reply:
                status, text = reply.status, await reply.text()
        except TimeoutError:
            raise ReplicaUnavailableError(f"upstream {self.shown_url}: no answer within {timeout_s:g}s") from None
        except aiohttp.ClientError as exc:
            raise ReplicaUnavailableError(
                f"upstream {self.shown_url}: {type(exc).__name__}: {self._scrub(exc)}"
            ) from None
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def swaps_in_place(self, event: ModelVersion) -> bool:
        raise ConfigurationError(
            f"the {self.name} backend cannot load weights: the upstream serves its own model "
            "(set FULMEN_LLM_FOLLOW_MODELS=false)"
        )

    async def load_version(self, event: ModelVersion) -> None:
        self.swaps_in_place(event)

    @property
    def upstream_model(self) -> str:
        return self.options.model or self.options.served_model_name

    async def chat(self, request: ChatRequest) -> CallResult:
        serving, agent = self._serving(request.agent)
        data = await self._post("/chat/completions", request.raw, serving)
        prompt_ids = data.get("prompt_token_ids")
        choices = [self._chat_choice(c, request.sampling.logprobs) for c in data.get("choices", [])]
        return self._result(data, choices, prompt_ids, serving, agent)

    async def complete(self, request: CompletionRequest) -> CallResult:
        serving, agent = self._serving(request.agent)
        data = await self._post("/completions", request.raw, serving)
        raw_choices = data.get("choices", [])
        prompt_ids = raw_choices[0].get("prompt_token_ids") if raw_choices else None
        choices = [self._text_choice(c, request.sampling.logprobs) for c in raw_choices]
        return self._result(data, choices, prompt_ids, serving, agent)

    # --- upstream call --------------------------------------------------------------------------------------
    def _body(self, raw: dict[str, Any], chat: bool, model: str) -> dict[str, Any]:
        body = {k: v for k, v in raw.items() if k not in ("stream", "stream_options")}
        body["model"] = model
        return body

    async def _post(self, path: str, raw: dict[str, Any], serving: Serving) -> dict[str, Any]:
        if self.session is None:
            raise ApiError(503, "the gateway is starting")
        body = self._body(raw, chat=path.startswith("/chat"), model=serving.model)
        self.calls[serving.model] += 1
        try:
            async with self.session.post(f"{self.base_url}{path}", json=body) as response:
                status, text = response.status, await response.text()
        except TimeoutError:
            raise _unavailable(f"the upstream did not answer within {self.options.upstream_timeout_s:g}s") from None
        except aiohttp.ClientError as exc:
            raise _unavailable(f"the upstream cannot be reached: {type(exc).__name__}: {self._scrub(exc)}") from None
        finally:
            self.calls[serving.model] -= 1
        if status >= 500:
            raise ApiError(502, f"the upstream failed with {status}: {self._scrub(text[:500])}", kind="upstream_error")
        try:
            data = json.loads(text)
        except ValueError:
            raise ApiError(502, f"the upstream answered {status} without JSON", kind="upstream_error") from None
        if status >= 400:
            error = data.get("error") if isinstance(data, dict) else None
            message = error.get("message") if isinstance(error, dict) else str(data)[:500]
            raise ApiError(status, f"upstream: {message}", param=(error or {}).get("param"))
        return data

    def _scrub(self, error: object) -> str:
        """``error`` as text without the upstream URL's secrets (aiohttp's errors quote the URL they tried)."""
        text = str(error).replace(self.base_url, self.shown_url)
        for secret in url_secrets(self.base_url):
            text = text.replace(secret, "***")
        return text

    # --- mapping --------------------------------------------------------------------------------------------
    def _chat_choice(self, raw: dict[str, Any], keep_logprobs: bool) -> Choice:
        message = raw.get("message") or {}
        content = (raw.get("logprobs") or {}).get("content") or []
        logprobs = [float(t["logprob"]) for t in content] if content else None
        tokens = [
            TokenLogprob(
                t.get("token", ""),
                float(t["logprob"]),
                [(a.get("token", ""), float(a["logprob"])) for a in t.get("top_logprobs") or []],
            )
            for t in content
        ]
        return Choice(
            index=int(raw.get("index", 0)),
            text=message.get("content") or "",
            finish_reason=raw.get("finish_reason") or "stop",
            token_ids=raw.get("token_ids"),
            logprobs=logprobs if self.asks_token_ids else None,
            tool_calls=message.get("tool_calls") or [],
            token_logprobs=tokens if keep_logprobs and content else None,
        )

    def _text_choice(self, raw: dict[str, Any], keep_logprobs: bool) -> Choice:
        detail = raw.get("logprobs") or {}
        values = detail.get("token_logprobs")
        logprobs = [float(v) for v in values] if values else None
        tokens = None
        if keep_logprobs and values:
            tops = detail.get("top_logprobs") or [{}] * len(values)
            tokens = [
                TokenLogprob(t, float(v), list((top or {}).items()))
                for t, v, top in zip(detail.get("tokens") or [""] * len(values), values, tops, strict=False)
            ]
        return Choice(
            index=int(raw.get("index", 0)),
            text=raw.get("text") or "",
            finish_reason=raw.get("finish_reason") or "stop",
            token_ids=raw.get("token_ids"),
            logprobs=logprobs if self.asks_token_ids else None,
            token_logprobs=tokens,
        )

    def _result(
        self,
        data: dict[str, Any],
        choices: list[Choice],
        prompt_ids: list[int] | None,
        serving: Serving,
        agent: str | None = None,
    ) -> CallResult:
        usage = data.get("usage") or {}
        complete = prompt_ids is not None and all(c.token_ids is not None for c in choices)
        return CallResult(
            id=str(data.get("id", "")),
            model=self.options.served_model_name,
            choices=choices,
            prompt_token_ids=prompt_ids if complete else None,
            prompt_tokens=int(usage.get("prompt_tokens") or len(prompt_ids or ())),
            completion_tokens=int(usage.get("completion_tokens") or sum(len(c.token_ids or ()) for c in choices)),
            model_version=self._call_version(data, serving),
            token_ids_absent=None if complete else self.absent_reason,
            adapter=agent,
        )

    def _call_version(self, data: dict[str, Any], serving: Serving) -> int | None:
        """The version that served the call: the one it started with (an upstream that tells does better)."""
        return serving.version


def _unavailable(message: str) -> ApiError:
    error = ApiError(503, message, kind="upstream_unavailable")
    error.headers["Retry-After"] = "1"
    return error
