"""The OpenAI wire format: requests parsed and checked into typed requests, errors in OpenAI's error shape.

Only what the gateway serves is parsed; fields it does not act on (``user``, ``metadata``, ``store``,
``parallel_tool_calls``, penalties...) are accepted and ignored, as vLLM does, so that agent frameworks that
send them keep working. Everything it does act on is checked, and a bad value is a 400 naming the field.

Parsing is total: :func:`load_body` refuses, with a 400 naming the field, what no field may hold anywhere in
the body (nesting deeper than :data:`MAX_JSON_DEPTH`, a string with a lone surrogate that cannot be encoded,
an integer outside 64 bits, NaN or infinity), and the parsers type-check every field they read, so no
request reaches a backend that a backend cannot take. Unknown fields are ignored but bounded by these rules
and by the body size limit. Parsing a large body is CPU work: the gateway runs it off the event loop.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MAX_JSON_DEPTH",
    "ApiError",
    "ChatRequest",
    "CompletionRequest",
    "SamplingParams",
    "load_body",
    "parse_chat",
    "parse_completion",
]

_ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_JSON_DEPTH = 64  # objects and arrays nested in each other; OpenAI's own bodies stay under 10
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None, kind: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or _KINDS.get(status, "api_error")
        self.headers: dict[str, str] = {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` is greedy. ``seed`` makes sampling reproducible per choice."""

    max_tokens: int | None = None  # None: whatever fits in the context
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]  # normalised: content is a string or None; tool-call arguments are dicts
    sampling: SamplingParams
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    stream: bool = False
    include_usage: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False)  # the body as sent (upstream backends forward it)
    agent: str | None = None  # the agent the call names (``.../agent/{name}/v1``): its adapter serves it, if any

    @property
    def parse_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | None  # text, or None when prompt_token_ids is given
    prompt_token_ids: list[int] | None
    sampling: SamplingParams
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    agent: str | None = None  # as ChatRequest.agent


def load_body(body: bytes) -> dict[str, Any]:
    """The body as a JSON object whose every value can be served and recorded; :class:`ApiError` (400) if not."""
    data = _loads(body, "body")
    if not isinstance(data, dict):
        raise invalid("the body must be a JSON object")
    return data


class _NotJson(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NotJson(f"{name} is not a JSON number")


def _loads(text: str | bytes, where: str) -> Any:
    """JSON decoded and checked by :func:`check_values` (``where`` names it in errors)."""
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise invalid(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels", where) from None
    except ValueError as exc:  # not JSON, not UTF-8, a NaN/Infinity, an integer of over 4,300 digits
        raise invalid(f"{where} is not valid JSON: {_show(str(exc), 200, quote=False)}", where) from None
    check_values(data, "" if where == "body" else where)
    return data


def check_values(data: Any, root: str = "") -> None:
    """Walk ``data`` (decoded JSON) without recursion; 400 naming the first value no field may hold."""
    stack: list[tuple[str, Any, int]] = [(root, data, 0)]
    while stack:
        path, value, depth = stack.pop()
        where = path or "body"
        if isinstance(value, dict):
            if depth >= MAX_JSON_DEPTH:
                raise invalid(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels", where)
            for key, item in value.items():
                _check_text(key, where, "a key")
                stack.append((f"{path}.{_printable(key)}" if path else _printable(key), item, depth + 1))
        elif isinstance(value, list):
            if depth >= MAX_JSON_DEPTH:
                raise invalid(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels", where)
            stack.extend(
                (f"{path}.{index}" if path else str(index), item, depth + 1) for index, item in enumerate(value)
            )
        elif isinstance(value, str):
            _check_text(value, where)
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            if not _INT64_MIN <= value <= _INT64_MAX:
                raise invalid(f"{where}: the integer is outside the 64-bit range", where)
        elif isinstance(value, float) and not math.isfinite(value):
            raise invalid(f"{where}: the number is too large", where)


def _check_text(text: str, where: str, what: str = "a string") -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"{where}: {what} with a lone surrogate (\\ud800-\\udfff) is not valid text", where) from None


def _printable(text: str) -> str:
    """``text`` safe to put in a message: at most 80 characters, lone surrogates escaped."""
    return _show(text, 80, quote=False)


def _show(value: Any, limit: int = 80, *, quote: bool = True) -> str:
    text = repr(value) if quote else str(value)
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_chat(data: dict[str, Any], max_n: int) -> ChatRequest:
    """A checked chat completions request; :class:`ApiError` (400) naming the field otherwise."""
    model = _model(data)
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages: a non-empty list of messages is required", "messages")
    normalised = [_message(message, f"messages.{index}") for index, message in enumerate(messages)]
    tools = _tools(data.get("tools"))
    tool_choice = _tool_choice(data.get("tool_choice"), tools)
    logprobs = _bool(data, "logprobs")
    top_logprobs = _int(data, "top_logprobs", 0, 0, 20)
    if top_logprobs and not logprobs:
        raise invalid("top_logprobs: requires logprobs to be true", "top_logprobs")
    sampling = _sampling(data, max_n, logprobs=logprobs, top_logprobs=top_logprobs)
    stream, include_usage = _stream(data)
    return ChatRequest(model, normalised, sampling, tools, tool_choice, stream, include_usage, data)


def parse_completion(data: dict[str, Any], max_n: int) -> CompletionRequest:
    """A checked (legacy) completions request with one prompt: text or a list of token ids."""
    model = _model(data)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    text: str | None = None
    token_ids: list[int] | None = None
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        token_ids = list(prompt)
    elif isinstance(prompt, list):
        raise invalid(
            "prompt: one prompt per request (a string or a list of token ids); the gateway records each call as "
            "one transition, so send several prompts as several requests",
            "prompt",
        )
    else:
        raise invalid("prompt: a string or a list of token ids is required", "prompt")
    logprobs_value = data.get("logprobs")
    if logprobs_value is not None and (not _is_int(logprobs_value) or not 0 <= logprobs_value <= 20):
        raise invalid("logprobs: an integer from 0 to 20", "logprobs")
    if data.get("suffix"):
        raise invalid("suffix: not supported", "suffix")
    sampling = _sampling(
        data, max_n, logprobs=logprobs_value is not None, top_logprobs=logprobs_value or 0, default_max=16
    )
    stream, include_usage = _stream(data)
    return CompletionRequest(model, text, token_ids, sampling, _bool(data, "echo"), stream, include_usage, data)


# --- fields --------------------------------------------------------------------------------------------------
def _model(data: dict[str, Any]) -> str:
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model: a model name is required", "model")
    return model


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise invalid(f"{where}: a message must be an object", where)
    role = message.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise invalid(f"{where}.role: must be one of {sorted(_ROLES)}, not {_show(role)}", f"{where}.role")
    result: dict[str, Any] = {"role": "system" if role == "developer" else role}
    result["content"] = _content(message.get("content"), f"{where}.content")
    calls = message.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise invalid(f"{where}.tool_calls: a list of tool calls", f"{where}.tool_calls")
    if role == "assistant" and calls:
        result["tool_calls"] = [_tool_call(c, f"{where}.tool_calls.{i}") for i, c in enumerate(calls)]
    elif result["content"] is None and role != "assistant":
        raise invalid(f"{where}.content: required for a {role} message", f"{where}.content")
    for key in ("name", "tool_call_id"):
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise invalid(f"{where}.{key}: a string", f"{where}.{key}")
        if value is not None:
            result[key] = value
    return result


def _content(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if not isinstance(kind, str) or kind not in ("text", "input_text"):
                raise invalid(f"{where}.{index}: only text parts are supported, not {_show(kind)}", where)
            text = part.get("text", "")
            if not isinstance(text, str):
                raise invalid(f"{where}.{index}.text: a string", f"{where}.{index}.text")
            texts.append(text)
        return "".join(texts)
    raise invalid(f"{where}: a string or a list of text parts", where)


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid(f"{where}.function: an object with a name is required", where)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        # Arguments that are not JSON (or not servable JSON) are kept as the text the model wrote; templates
        # render it as is.
        with contextlib.suppress(ApiError):
            arguments = _loads(arguments, f"{where}.function.arguments") if arguments.strip() else {}
    call_id = call.get("id", "")
    if not isinstance(call_id, str):
        raise invalid(f"{where}.id: a string", f"{where}.id")
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("tools: a list of tools", "tools")
    for index, tool in enumerate(tools):
        ok = isinstance(tool, dict) and tool.get("type", "function") == "function"
        if not ok or not isinstance(tool.get("function"), dict) or not isinstance(tool["function"].get("name"), str):
            raise invalid(f"tools.{index}: a function tool with function.name is required", f"tools.{index}")
    return tools or None


def _tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> str | dict[str, Any]:
    if choice is None:
        return "auto"
    if isinstance(choice, str) and choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or not any(tool["function"]["name"] == name for tool in tools or []):
            raise invalid(f"tool_choice: no tool named {_show(name)} in tools", "tool_choice")
        return choice
    raise invalid("tool_choice: none, auto, required or {'type': 'function', 'function': {'name': ...}}", "tool_choice")


def _sampling(
    data: dict[str, Any], max_n: int, *, logprobs: bool, top_logprobs: int, default_max: int | None = None
) -> SamplingParams:
    max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise invalid("max_tokens: a positive integer", "max_tokens")
    stop = data.get("stop")
    stops = (
        () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else None
    )
    if stops is None or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop: a non-empty string or a list of up to 4 of them", "stop")
    seed = data.get("seed")
    if seed is not None and not _is_int(seed):
        raise invalid("seed: an integer", "seed")
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else default_max,
        temperature=_float(data, "temperature", 1.0, 0.0, 2.0),
        top_p=_float(data, "top_p", 1.0, 0.0, 1.0, exclusive_low=True),
        n=_int(data, "n", 1, 1, max_n),
        stop=stops,
        seed=seed,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


def _stream(data: dict[str, Any]) -> tuple[bool, bool]:
    stream = _bool(data, "stream")
    options = data.get("stream_options") or {}
    if not isinstance(options, dict):
        raise invalid("stream_options: an object", "stream_options")
    return stream, bool(options.get("include_usage")) and stream


def _bool(data: dict[str, Any], name: str) -> bool:
    value = data.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"{name}: true or false", name)
    return value


def _int(data: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = data.get(name)
    if value is None:
        return default
    if not _is_int(value) or not low <= value <= high:
        raise invalid(f"{name}: an integer from {low} to {high}", name)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _float(
    data: dict[str, Any], name: str, default: float, low: float, high: float, exclusive_low: bool = False
) -> float:
    value = data.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (exclusive_low and value == low):
        bound = f"({low:g}" if exclusive_low else f"[{low:g}"
        raise invalid(f"{name}: a number in {bound}, {high:g}]", name)
    return float(value)
