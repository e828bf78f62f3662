"""What the llamacpp backend sends to llama-server's ``POST /completion`` and what it reads back.

The request gives the prompt as token ids and asks for the sampled ids (``return_tokens``) and, per token, the
log-probability of the raw model distribution (``n_probs`` with ``post_sampling_probs: false``: log softmax of the
logits at temperature 1, computed before any sampler, as ``sampling.py`` records them). The sampler chain is set
in full so that nothing hides in llama.cpp's defaults (top-k 40, min-p 0.05, penalties, DRY, XTC...): temperature,
then top-p, then a draw (``dist``, which llama.cpp always appends), i.e. ``softmax(logits / T)`` restricted to the
top-p nucleus, greedy at temperature 0. ``n_cmpl`` asks for several completions of one prompt, which llama-server
prefills once; with a seed, completion ``i`` uses ``seed + i``, as the transformers backend does.

A response (one object, or a list of them for ``n_cmpl > 1``) becomes :class:`Sample`\\ s; one whose probabilities
do not name exactly the tokens it reports is refused (502): the gateway records nothing it cannot vouch for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fulmen.producers.llm_gateway.protocol import ApiError, SamplingParams

__all__ = ["Sample", "completion_body", "parse_samples", "server_error"]

_FINISH = {"eos": "stop", "word": "stop", "limit": "length"}  # llama-server's stop_type -> OpenAI's
_SEED_RANGE = 2**32 - 1  # llama.cpp's seed is a uint32, and 0xFFFFFFFF means "random"
_NEUTRAL = {  # every sampler that is not in the chain, at its "off" value too (belt and braces)
    "top_k": 0,
    "min_p": 0.0,
    "typical_p": 1.0,
    "top_n_sigma": -1.0,
    "xtc_probability": 0.0,
    "repeat_penalty": 1.0,
    "repeat_last_n": 0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "dry_multiplier": 0.0,
    "mirostat": 0,
    "dynatemp_range": 0.0,
}


@dataclass
class Sample:
    """One completion as llama-server sampled it."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None  # per token, the most likely ids with their logprobs (when asked)
    finish_reason: str  # stop, length
    cached_tokens: int = 0  # prompt tokens llama-server took from its cache instead of computing them
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # timings, for logs and benchmarks


def completion_body(
    prompt_ids: Sequence[int], sampling: SamplingParams, max_tokens: int, n: int, *, ignore_eos: bool = False
) -> dict[str, Any]:
    """The ``/completion`` request for ``n`` completions of ``prompt_ids`` (see the module docstring)."""
    body: dict[str, Any] = {
        "prompt": list(prompt_ids),
        "n_predict": max_tokens,
        "n_cmpl": n,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        **_NEUTRAL,
        "samplers": ["temperature", "top_p"],
        "n_probs": max(1, sampling.top_logprobs),
        "post_sampling_probs": False,
        "return_tokens": True,
        "cache_prompt": True,
        "seed": sampling.seed % _SEED_RANGE if sampling.seed is not None else -1,
    }
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if ignore_eos:  # benchmarks: every completion exactly max_tokens long
        body["ignore_eos"] = True
    return body


def parse_samples(data: Any, expected: int, top_logprobs: int) -> list[Sample]:
    """The ``expected`` completions of a ``/completion`` answer, in order; :class:`ApiError` 502 when the answer is
    not what was asked (a llama-server without Fulmen's patches loses probabilities: the message says so)."""
    items = data if isinstance(data, list) else [data]
    if len(items) != expected or not all(isinstance(item, dict) for item in items):
        raise _bad(f"{expected} completion(s) were asked, the answer holds {len(items)}")
    items = sorted(items, key=lambda item: item.get("index", 0) if isinstance(item.get("index"), int) else 0)
    return [_sample(item, top_logprobs) for item in items]


def _sample(item: dict[str, Any], top_logprobs: int) -> Sample:
    tokens = item.get("tokens")
    probs = item.get("completion_probabilities") or []
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise _bad("the answer has no token ids (return_tokens)")
    if len(probs) != len(tokens):
        raise _bad(
            f"{len(tokens)} tokens came with {len(probs)} probabilities: is this llama-server built by "
            "`python -m fulmen.producers.llm_gateway.backends.llamacpp_build` (with its patches)?"
        )
    logprobs, top = [], []
    for position, (token, entry) in enumerate(zip(tokens, probs, strict=True)):
        logprob = entry.get("logprob") if isinstance(entry, dict) else None
        if not (isinstance(entry, dict) and entry.get("id") == token and isinstance(logprob, (int, float))):
            raise _bad(f"the probability at position {position} is not the sampled token {token}'s: {entry!r:.200}")
        logprobs.append(float(logprob))
        if top_logprobs:
            alternatives = entry.get("top_logprobs") or []
            top.append([(int(a["id"]), float(a["logprob"])) for a in alternatives[:top_logprobs]])
    finish = _FINISH.get(str(item.get("stop_type")), "length")
    timings = item.get("timings") if isinstance(item.get("timings"), dict) else {}
    cached = timings.get("cache_n", 0) if isinstance(timings.get("cache_n", 0), int) else 0
    return Sample(tokens, logprobs, top if top_logprobs else None, finish, cached, {"timings": timings})


def server_error(status: int, body: Any) -> ApiError:
    """The gateway's answer to llama-server's error ``status``: its 4xx are the request's fault (a prompt longer
    than the context); anything else is the server's (502: the router tries another replica)."""
    message = body
    if isinstance(body, dict):
        error = body.get("error")
        message = error.get("message", error) if isinstance(error, dict) else error or body
    text = str(message)[:500]
    if status == 503:  # still loading the model, or shutting down
        return ApiError(503, f"llama-server is not serving: {text}", kind="upstream_unavailable")
    if 400 <= status < 500:
        code = "context_length_exceeded" if "context" in text else None
        return ApiError(400, f"llama-server refused the request: {text}", param="messages", code=code)
    return ApiError(502, f"llama-server answered {status}: {text}", kind="upstream_error")


def _bad(message: str) -> ApiError:
    return ApiError(502, f"llama-server's answer cannot be recorded: {message}", kind="upstream_error")
