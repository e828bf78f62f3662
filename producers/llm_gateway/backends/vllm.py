"""The ``vllm`` backend's replica: one upstream vLLM OpenAI server that returns token ids and loads new versions.

Written against vLLM 0.33.0 (``vllm/entrypoints/...`` of its wheel; the routes named here exist since the 0.1x
releases that added ``return_token_ids``, the dev-mode weight routes and runtime LoRA loading). Every call asks for
``return_token_ids``, ``logprobs`` and ``return_weight_versions`` (vLLM ignores fields it does not know, so older
servers still answer; their spans carry the version the gateway believed served them).

Full weights (``ModelVersion.format == "hf"``: a Hugging Face checkpoint directory the vLLM server can read). vLLM
started with ``VLLM_SERVER_DEV_MODE=1`` serves, at its root:

1. ``POST /pause?mode=wait&clear_cache=true``: wait for the requests in flight (whoever sent them), refuse new
   ones with 503, then drop the KV and prefix caches (computed with the old weights);
2. ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``: every worker reloads
   its weights in place from DIR (``GPUWorker.reload_weights`` -> ``model_loader.reload.inplace``); 200 with
   ``{"results": [...]}`` once all workers are done, an error status when a worker failed;
3. ``POST /update_weight_version {"new_version": "N"}``: the label vLLM attaches to every token sampled from then
   on (``choices[].weight_versions`` when a call asks ``return_weight_versions``);
4. ``POST /resume``, then ``GET /weight_info`` -> ``{"weight_version": "N"}``: the confirmation.

The router drains this replica before step 1, so its own calls finish on the old weights; ``mode=wait`` covers
other clients of the same server. A reload that fails (the server answers an error) may have overwritten some
weights: the previous checkpoint (the last one loaded, or the ``root`` ``/v1/models`` gives for the model the
server started with) is reloaded before resuming, and the version is refused. If that fails too, the server is
left paused (its weights are unknown) and the replica is out until a load succeeds. A server that already
reports the version (another gateway loaded it) is not reloaded.

LoRA adapters (``format == "hf_lora_adapter"``: a PEFT adapter directory for the model the server runs). vLLM
started with ``--enable-lora`` (and ``--max-lora-rank``) and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` serves
``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` (200, a text body) and ``POST /v1/unload_lora_adapter
{"lora_name"}``; a loaded adapter is listed by ``GET /v1/models`` (``id`` its name, ``parent`` the base model),
which is the confirmation, and a call uses it by naming it as its ``model``. Version N of model M is the adapter
``M-vN``: it loads beside the one serving (no drain), new calls name it, and the previous adapter is unloaded once
the calls that use it have finished. An agent's adapter (``ModelVersion.adapter``, ``FULMEN_TRAIN_ADAPTERS=per_agent``)
is ``M-<agent>-vN``: the calls that name that agent name it, every other call the model; a new version of it
replaces the agent's previous one the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from fulmen.producers.llm_gateway.backends.base import ReplicaUnavailableError, VersionRefusedError
from fulmen.producers.llm_gateway.backends.upstream import OpenAIUpstreamBackend, Serving
from fulmen.producers.llm_gateway.settings import LlmSection
from fulmen.schemas import ModelVersion

__all__ = ["VllmBackend", "adapter_name"]

log = logging.getLogger(__name__)

_ADMIN_TIMEOUT_S = 30.0
_UNUSED_POLL_S = 0.05
_DEFAULT_LABEL = "default"  # vLLM's weight version until one is set (EngineCore._weight_version)


def adapter_name(event: ModelVersion) -> str:
    """The name a LoRA version is loaded under, and which calls name as their ``model``."""
    if event.adapter:
        return f"{event.model_name}-{event.adapter}-v{event.version}"
    return f"{event.model_name}-v{event.version}"


class VllmBackend(OpenAIUpstreamBackend):
    name = "vllm"
    asks_token_ids = True
    absent_reason = "the vLLM upstream returned no token ids (is it older than v0.10.2, without return_token_ids?)"

    def __init__(self, options: LlmSection, url: str | None = None) -> None:
        super().__init__(options, url)
        self.root_url = self.base_url.removesuffix("/v1")
        self.weights_uri: str | None = None  # where the served full weights came from (to go back to)
        self._tasks: set[asyncio.Task[None]] = set()
        self._unexpected_labels: set[str] = set()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await super().close()

    def _body(self, raw: dict[str, Any], chat: bool, model: str) -> dict[str, Any]:
        body = super()._body(raw, chat, model)
        body["return_token_ids"] = True
        body["return_weight_versions"] = True
        if chat:
            body["logprobs"] = True
        elif not isinstance(body.get("logprobs"), int):
            body["logprobs"] = 0  # the sampled token's logprob only
        return body

    # --- which version served a call ------------------------------------------------------------------------
    def _call_version(self, data: dict[str, Any], serving: Serving) -> int | None:
        """An adapter's calls: its version. Otherwise what vLLM says sampled the tokens (``weight_versions``);
        tokens sampled by two versions (another client swapped weights mid-call) count as the older one."""
        if serving.adapter is not None:
            return serving.version
        labels = {
            span.get("version")
            for choice in data.get("choices") or []
            for span in (choice.get("weight_versions") or [] if isinstance(choice, dict) else [])
            if isinstance(span, dict)
        }
        if not labels:
            return serving.version  # a vLLM without weight versions: the one the call started with
        versions = [self._label_version(label) for label in labels]
        known = [v for v in versions if v is not None]
        if len(known) < len(versions):
            return serving.version
        observed = min(known)
        if observed != serving.version and self.serving is serving:  # not a swap of ours: the server changed
            log.warning(
                "upstream %s serves version %s, not %s (restarted, or reloaded by someone else)",
                self.shown_url,
                observed,
                serving.version,
            )
            self.serving = Serving(observed, serving.model)
        return observed

    def _label_version(self, label: Any) -> int | None:
        if label == _DEFAULT_LABEL:
            return self.options.model_version  # the weights the server started with
        if isinstance(label, str) and label.isascii() and label.isdigit():
            return int(label)
        if label not in self._unexpected_labels:
            self._unexpected_labels.add(str(label))
            log.warning("upstream %s labels its weights %r, not a Fulmen version", self.shown_url, label)
        return None

    # --- health ---------------------------------------------------------------------------------------------
    async def probe(self) -> None:
        """Reachable (``/v1/models``); what it serves: the adapter still listed, the label ``/weight_info``
        reports (dev mode). A paused server's weights are unknown: its version is None until a load."""
        models = await self.upstream_models()
        card = models.get(self.upstream_model) or {}
        if self._context is None and isinstance(card.get("max_model_len"), int):
            self._context = card["max_model_len"]
        if self.weights_uri is None and isinstance(card.get("root"), str):
            self.weights_uri = card["root"]
        if self.serving.adapter is not None and self.serving.adapter not in models:  # the server restarted
            self.serving = Serving(self.options.model_version, self.upstream_model)
        for agent, serving in list(self.agents.items()):  # the same for the agents' adapters
            if serving.adapter not in models:
                del self.agents[agent]
        status, info = await self._admin("GET", "/weight_info")
        if status != 200 or not isinstance(info, dict):
            return  # not in dev mode: it cannot tell
        paused_status, paused = await self._admin("GET", "/is_paused")
        if paused_status == 200 and isinstance(paused, dict) and paused.get("is_paused"):
            self.serving = Serving(None, self.serving.model, self.serving.adapter)
        elif self.serving.adapter is None:
            self.serving = Serving(self._label_version(info.get("weight_version")), self.upstream_model)

    # --- loading --------------------------------------------------------------------------------------------
    def swaps_in_place(self, event: ModelVersion) -> bool:
        return event.format != "hf_lora_adapter"

    async def load_version(self, event: ModelVersion) -> None:
        if event.format == "hf_lora_adapter":
            await self._load_adapter(event)
        else:
            await self._load_weights(event)

    async def _load_weights(self, event: ModelVersion) -> None:
        label = str(event.version)
        status, info = await self._admin("GET", "/weight_info")
        if status == 404:
            raise VersionRefusedError(
                f"upstream {self.shown_url} has no weight-update routes: start vLLM with VLLM_SERVER_DEV_MODE=1 "
                "(it then serves /pause, /collective_rpc, /update_weight_version, /resume, /weight_info)"
            )
        if status == 200 and isinstance(info, dict) and info.get("weight_version") == label:
            _, paused = await self._admin("GET", "/is_paused")
            if isinstance(paused, dict) and paused.get("is_paused") is False:
                self._serve_weights(event)  # another gateway loaded it already
                return
        await self._expect("POST", "/pause", params={"mode": "wait", "clear_cache": "true"})
        reload_status, body = await self._reload(event.uri)
        if reload_status != 200:
            await self._restore()
            await self._expect("POST", "/resume")
            raise VersionRefusedError(f"vLLM could not load {event.uri}: {_error_text(body)}")
        await self._expect("POST", "/update_weight_version", json_body={"new_version": label})
        await self._expect("POST", "/resume")
        confirmed = await self._expect("GET", "/weight_info")
        if not isinstance(confirmed, dict) or confirmed.get("weight_version") != label:
            raise ReplicaUnavailableError(f"upstream {self.shown_url} reports weights {confirmed!r}, not {label}")
        self._serve_weights(event)

    def _serve_weights(self, event: ModelVersion) -> None:
        previous = self.serving.adapter
        self.serving = Serving(event.version, self.upstream_model)
        self.weights_uri = event.uri
        if previous is not None:
            self._spawn(self._unload_when_unused(previous))
        log.info("upstream %s serves version %d (weights from %s)", self.shown_url, event.version, event.uri)

    async def _reload(self, uri: str) -> tuple[int, Any]:
        body = {"method": "reload_weights", "kwargs": {"weights_path": uri}}
        return await self._admin("POST", "/collective_rpc", json_body=body, timeout_s=self.options.upstream_timeout_s)

    async def _restore(self) -> None:
        """Reload the weights served before a failed reload; out of service (left paused) when that fails."""
        if self.weights_uri is None:
            raise ReplicaUnavailableError(
                f"upstream {self.shown_url}: a reload failed and the previous weights' location is unknown"
            )
        status, body = await self._reload(self.weights_uri)
        if status != 200:
            raise ReplicaUnavailableError(
                f"upstream {self.shown_url}: a reload failed and reloading {self.weights_uri} failed too "
                f"({_error_text(body)}); it stays paused"
            )

    async def _load_adapter(self, event: ModelVersion) -> None:
        name = adapter_name(event)
        if name not in await self.upstream_models():
            request = {"lora_name": name, "lora_path": event.uri}
            status, body = await self.request(
                "POST",
                f"{self.base_url}/load_lora_adapter",
                json_body=request,
                timeout_s=self.options.upstream_timeout_s,
            )
            if status in (404, 405) and not _is_vllm_error(body):
                raise VersionRefusedError(
                    f"upstream {self.shown_url} cannot load LoRA adapters at run time: start vLLM with --enable-lora "
                    "and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
                )
            if status != 200:
                raise VersionRefusedError(f"vLLM could not load the LoRA adapter {event.uri}: {_error_text(body)}")
            if name not in await self.upstream_models():
                raise ReplicaUnavailableError(f"upstream {self.shown_url} loaded {name} but does not list it")
        if event.adapter:
            previous = self.agents[event.adapter].adapter if event.adapter in self.agents else None
            self.agents[event.adapter] = Serving(event.version, name, name)
        else:
            previous = self.serving.adapter
            self.serving = Serving(event.version, name, name)
        if previous is not None and previous != name:
            self._spawn(self._unload_when_unused(previous))
        log.info(
            "upstream %s serves version %d (LoRA adapter %s from %s)", self.shown_url, event.version, name, event.uri
        )

    async def _unload_when_unused(self, name: str) -> None:
        while self.calls[name] > 0:  # calls that started with it finish with it
            await asyncio.sleep(_UNUSED_POLL_S)
        with contextlib.suppress(ReplicaUnavailableError):
            status, body = await self.request(
                "POST",
                f"{self.base_url}/unload_lora_adapter",
                json_body={"lora_name": name},
                timeout_s=_ADMIN_TIMEOUT_S,
            )
            if status not in (200, 404):
                log.warning("upstream %s did not unload LoRA adapter %s: %s", self.shown_url, name, _error_text(body))

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- the server's root routes ---------------------------------------------------------------------------
    async def _admin(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: dict[str, str] | None = None,
        timeout_s: float = _ADMIN_TIMEOUT_S,
    ) -> tuple[int, Any]:
        return await self.request(
            method, f"{self.root_url}{path}", json_body=json_body, params=params, timeout_s=timeout_s
        )

    async def _expect(self, method: str, path: str, **kwargs: Any) -> Any:
        """The body of a 200; any other answer leaves the server in a state to check again (out of service)."""
        status, body = await self._admin(method, path, **kwargs)
        if status != 200:
            raise ReplicaUnavailableError(
                f"upstream {self.shown_url}: {method} {path} answered {status}: {_error_text(body)}"
            )
        return body


def _is_vllm_error(body: Any) -> bool:
    """vLLM's own error shape (``{"error": {...}}``), not the framework's ``{"detail": "Not Found"}``."""
    return isinstance(body, dict) and isinstance(body.get("error"), dict)


def _error_text(body: Any) -> str:
    if _is_vllm_error(body):
        return str(body["error"].get("message", ""))[:500]
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])[:500]
    return str(body)[:500]
