"""A stand-in for a vLLM 0.33.0 OpenAI server: the routes the gateway uses, in vLLM's shapes, and nothing else.

Read from vLLM 0.33.0's wheel (``vllm/entrypoints/...``): ``launchers/api_server/routers.py`` (which routers a
server has), ``openai/chat_completion/protocol.py`` and ``openai/completion/protocol.py`` (``return_token_ids``,
``return_weight_versions``; ``prompt_token_ids`` top level for chat, per choice for completions;
``choices[].token_ids``, ``choices[].weight_versions``), ``serve/lora/api_router.py`` with
``openai/models/serving.py`` (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``: only with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; 200 with a text body, errors as ``{"error": {...}}``), ``rl/online/api_router.py``
(``/pause``, ``/resume``, ``/is_paused``, ``/update_weight_version``, ``/weight_info``) and
``serve/dev/rpc/api_router.py`` (``/collective_rpc``), both only with ``VLLM_SERVER_DEV_MODE=1``, and
``serve/instrumentator/health.py`` (``/health``). A path it does not serve is a 404 and a known path with another
method a 405, as FastAPI answers them (``{"detail": "Not Found"}``).

It serves "weights" that are only a name: an answer says which weights (the version label, or the LoRA adapter)
produced it, so a test can check the version each span records against what really served the call. It can be
told to be slow (``delay_s``: each generation, ``load_delay_s``: each load; ``max_num_seqs`` generations at once),
to fail loads (``fail_loads``), and be
killed (every connection cut, nothing listening) and started again on its port with its start-up weights, as a
restarted vLLM process would be.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

BASE_MODEL = "Qwen/Qwen2.5-0.5B"


def vllm_error(message: str, kind: str, status: int, param: str | None = None) -> web.Response:
    """vLLM's ``ErrorResponse``: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


@web.middleware
async def _framework_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Unknown paths and methods answered as FastAPI does (vLLM registers no handler of its own for them)."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        return web.json_response({"detail": "Method Not Allowed"}, status=405, headers={"Allow": exc.headers["Allow"]})
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)


class VllmStandIn:
    """One stand-in server. ``await start()`` gives its ``/v1`` URL; ``kill()`` and ``start()`` again."""

    def __init__(
        self,
        *,
        dev_mode: bool = True,
        runtime_lora: bool = True,
        delay_s: float = 0.0,
        load_delay_s: float = 0.0,
        root: str = "/models/qwen2.5-0.5b",
        max_model_len: int = 4096,
        max_num_seqs: int = 256,
    ) -> None:
        self.dev_mode = dev_mode
        self.runtime_lora = runtime_lora
        self.delay_s = delay_s
        self.load_delay_s = load_delay_s
        self.root = root
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs  # as vLLM's --max-num-seqs: more calls wait for a place in the batch
        self.fail_loads = 0  # the next N weight or adapter loads fail with a 500
        self.requests: list[tuple[str, str, Any]] = []  # (method, path with query, JSON body) of every request
        self.answered: list[dict[str, Any]] = []  # per generation answered: marker, model, label
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._handlers: set[asyncio.Task[Any]] = set()
        self._transports: set[Any] = set()
        self._reset()

    def _reset(self) -> None:
        """The state of a freshly started server."""
        self.label = "default"
        self.weights: str | None = self.root  # None: a reload failed half-way (the weights are garbage)
        self.adapters: dict[str, str] = {}
        self.paused = False
        self.generating = 0
        self._seats = asyncio.Semaphore(self.max_num_seqs)

    # --- lifecycle ------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> str:
        self._reset()
        app = web.Application(middlewares=[self._track, _framework_errors])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        if self.runtime_lora:
            app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
            app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        if self.dev_mode:
            app.router.add_post("/pause", self.pause)
            app.router.add_post("/resume", self.resume)
            app.router.add_get("/is_paused", self.is_paused)
            app.router.add_post("/collective_rpc", self.collective_rpc)
            app.router.add_post("/update_weight_version", self.update_weight_version)
            app.router.add_get("/weight_info", self.weight_info)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.url

    async def kill(self) -> None:
        """As ``kill -9``: nothing listens any more, open connections are cut, answers in progress never come."""
        if self._runner is None:
            return
        for site in list(self._runner.sites):
            await site.stop()
        for transport in list(self._transports):
            transport.abort()
        for task in list(self._handlers):
            task.cancel()
        await self._runner.cleanup()
        self._runner = None

    async def stop(self) -> None:
        await self.kill()

    @web.middleware
    async def _track(self, request: web.Request, handler: Any) -> web.StreamResponse:
        body = None
        if request.can_read_body and request.content_type == "application/json":
            body = await request.json()
        self.requests.append((request.method, request.path_qs, body))
        task = asyncio.current_task()
        self._handlers.add(task)  # type: ignore[arg-type]
        self._transports.add(request.transport)
        try:
            return await handler(request)
        finally:
            self._handlers.discard(task)  # type: ignore[arg-type]

    # --- serving --------------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        cards = [
            {
                "id": BASE_MODEL,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "vllm",
                "root": self.root,
                "parent": None,
                "max_model_len": self.max_model_len,
            }
        ]
        cards += [
            {
                "id": name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "vllm",
                "root": path,
                "parent": BASE_MODEL,
                "max_model_len": None,
            }
            for name, path in self.adapters.items()
        ]
        return web.json_response({"object": "list", "data": cards})

    async def chat(self, request: web.Request) -> web.Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.Response:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.Response:
        body = await request.json()
        model = body.get("model")
        if model != BASE_MODEL and model not in self.adapters:
            return vllm_error(f"The model `{model}` does not exist.", "NotFoundError", 404, "model")
        if self.paused:
            return vllm_error("The engine is paused; retry later.", "ServiceUnavailableError", 503)
        label = self.label
        served_by = model if model in self.adapters else f"weights {label}" if self.weights else "garbage"
        self.generating += 1
        try:
            async with self._seats:
                await asyncio.sleep(self.delay_s)
        finally:
            self.generating -= 1
        marker = _marker(body, chat)
        text = f"{marker} | {served_by}"
        token_ids = [1000 + byte for byte in text.encode()]
        prompt_ids = [1000 + byte for byte in marker.encode()]
        self.answered.append({"marker": marker, "model": model, "label": label, "served_by": served_by})
        choice = _choice(body, chat, text, token_ids)
        if body.get("return_token_ids"):
            choice["token_ids"] = token_ids
        if body.get("return_weight_versions"):
            choice["weight_versions"] = [{"version": label, "start": 0, "end": len(token_ids)}]
        data: dict[str, Any] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(token_ids),
                "total_tokens": len(prompt_ids) + len(token_ids),
            },
            "system_fingerprint": "vllm-0.33.0-0123abcd",
        }
        if body.get("return_token_ids"):
            if chat:
                data["prompt_token_ids"] = prompt_ids
            else:
                choice["prompt_token_ids"] = prompt_ids
        return web.json_response(data)

    # --- runtime LoRA (VLLM_ALLOW_RUNTIME_LORA_UPDATING) ----------------------------------------------------
    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return body
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            return vllm_error("lora_name and lora_path: Field required", "BadRequestError", 400)
        if not name or not path:
            return vllm_error("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
        if name == BASE_MODEL:
            return vllm_error(f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput", 400)
        if name in self.adapters and not body.get("load_inplace"):
            return vllm_error(
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                "in place, set 'load_inplace' to True.",
                "InvalidUserInput",
                400,
            )
        await asyncio.sleep(self.load_delay_s)
        if self.fail_loads:
            self.fail_loads -= 1
            return vllm_error("CUDA out of memory while loading the adapter", "InternalServerError", 500)
        if not Path(path).is_dir():
            return vllm_error(f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError", 404)
        self.adapters[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return body
        name = body.get("lora_name")
        if not name:
            return vllm_error("'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput", 400)
        if name not in self.adapters:
            return vllm_error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
        del self.adapters[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    # --- dev mode (VLLM_SERVER_DEV_MODE=1) ------------------------------------------------------------------
    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return vllm_error(f"mode: Input should be 'abort', 'wait' or 'keep', not {mode!r}", "Bad Request", 400)
        self.paused = True  # new requests get 503 from now on
        while mode == "wait" and self.generating:
            await asyncio.sleep(0.01)
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self.paused = False
        return web.json_response({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.text())
        except ValueError as exc:
            return vllm_error(f"JSON decode error: {exc}", "Bad Request", 400)
        if not isinstance(body, dict):
            return vllm_error("Request body must be a JSON object", "Bad Request", 400)
        if body.get("method") is None:
            return vllm_error("Missing 'method' in request body", "Bad Request", 400)
        if body["method"] != "reload_weights":  # other worker methods exist; the gateway calls no other
            return vllm_error(f"'GPUWorker' object has no attribute {body['method']!r}", "InternalServerError", 500)
        path = (body.get("kwargs") or {}).get("weights_path")
        await asyncio.sleep(self.load_delay_s)
        if self.fail_loads or not isinstance(path, str) or not Path(path).is_dir():
            self.fail_loads = max(0, self.fail_loads - 1)
            self.weights = None  # the reload got part of the way
            return vllm_error(
                f"Error reloading weights from {path}: no safetensors or bin files found", "InternalServerError", 500
            )
        self.weights = path
        return web.json_response({"results": [None]})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return body
        version = body.get("new_version")
        if not isinstance(version, str):
            return vllm_error("new_version: Field required", "BadRequestError", 400)
        self.label = version
        return web.json_response({"success": True, "new_version": version})

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.label})


async def _json_object(request: web.Request) -> dict[str, Any] | web.Response:
    if request.content_type != "application/json":
        return vllm_error("Unsupported Media Type: Only 'application/json' is allowed", "BadRequestError", 400)
    body = await request.json()
    if not isinstance(body, dict):
        return vllm_error("Input should be a valid dictionary", "BadRequestError", 400)
    return body


def _marker(body: dict[str, Any], chat: bool) -> str:
    """The call's own text: the last user message (chat) or the prompt, so a test knows which call an answer is."""
    if not chat:
        prompt = body.get("prompt")
        return prompt if isinstance(prompt, str) else json.dumps(prompt)
    users = [m.get("content") for m in body.get("messages") or [] if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1]) if users else ""


def _choice(body: dict[str, Any], chat: bool, text: str, token_ids: list[int]) -> dict[str, Any]:
    """One choice of an answer, with the logprobs the request asked for in the shape of its endpoint."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "stop_reason": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [
                    {"token": chr(t - 1000), "logprob": -0.5, "bytes": [t - 1000], "top_logprobs": []}
                    for t in token_ids
                ]
            }
        return choice
    choice["text"] = text
    if body.get("logprobs") is not None:
        choice["logprobs"] = {
            "tokens": [chr(t - 1000) for t in token_ids],
            "token_logprobs": [-0.5] * len(token_ids),
            "top_logprobs": None,
            "text_offset": list(range(len(token_ids))),
        }
    return choice
