"""Prompts in, replies out, for the backends that hold the model's tokenizer (``transformers``, ``llamacpp``).

A chat call's messages are rendered with the tokenizer's chat template (tools included) and tokenized once; a
completion call's prompt is tokenized, or taken as the token ids it gives. The ids the model is fed are what the
call reports, never a re-tokenization of text. What the model sampled comes back as a :class:`Choice`: the text
decoded from the ids (cut at a stop string, tool calls parsed out), the text each token added (for streaming), and
the logprobs. The CPU work here (rendering, tokenizing, decoding) belongs off the event loop.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from fulmen.producers.llm_gateway.backends.base import CallResult, Choice, TokenLogprob
from fulmen.producers.llm_gateway.protocol import ApiError, ChatRequest, CompletionRequest, SamplingParams
from fulmen.producers.llm_gateway.tool_calls import extract_tool_calls
from fulmen.schemas.chat_template import CHAT_TEMPLATE
from fulmen.schemas.errors import ConfigurationError

__all__ = [
    "HoldsTokenizer",
    "build_choice",
    "call_result",
    "chat_template_override",
    "completion_budget",
    "cut_at_stop",
    "load_tokenizer",
    "longest_token_bytes",
    "no_progress_bars",
    "pieces",
    "refuse_surely_too_long",
    "render_chat",
    "stop_check",
    "tokenize_completion",
]

log = logging.getLogger(__name__)


class HoldsTokenizer(Protocol):
    """What the prompt functions need of a loaded model."""

    tokenizer: Any
    max_token_bytes: int  # the longest token's text in UTF-8 bytes: a prompt of B bytes has >= B / this tokens
    vocab_size: int  # len(tokenizer), kept: transformers 5 builds the whole vocabulary to count it (~20 ms)


def load_tokenizer(path: str, chat_template: str = "") -> Any:
    """The tokenizer of the model directory ``path``, its chat template replaced when ``chat_template``
    (``FULMEN_LLM_CHAT_TEMPLATE``) names one."""
    from transformers import AutoTokenizer

    with no_progress_bars():
        tokenizer = AutoTokenizer.from_pretrained(path)
    if chat_template:
        tokenizer.chat_template = chat_template_override(chat_template)
    if tokenizer.chat_template is None:
        log.warning("the tokenizer in %s has no chat template: /v1/chat/completions will answer 400", path)
    return tokenizer


def longest_token_bytes(tokenizer: Any) -> int:
    """The longest token's text in UTF-8 bytes (at least 1)."""
    return max(max((len(token.encode("utf-8", "replace")) for token in tokenizer.get_vocab()), default=64), 1)


def render_chat(loaded: HoldsTokenizer, request: ChatRequest, limit: int) -> tuple[str, list[int]]:
    """The prompt rendered with the chat template, and its token ids (CPU work: runs off the event loop)."""
    tokenizer = loaded.tokenizer
    if tokenizer.chat_template is None:
        raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
    try:
        prompt = tokenizer.apply_chat_template(
            request.messages, tools=request.tools, tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # a template error is the request's fault (roles in the wrong order...)
        raise ApiError(400, f"the chat template cannot render these messages: {exc}", param="messages") from None
    refuse_surely_too_long(prompt, loaded, limit)
    return prompt, tokenizer(prompt, add_special_tokens=False)["input_ids"]


def tokenize_completion(loaded: HoldsTokenizer, request: CompletionRequest, limit: int) -> tuple[str, list[int]]:
    """The prompt's text and token ids, whichever of the two the request gave (runs off the event loop)."""
    tokenizer = loaded.tokenizer
    if request.prompt_token_ids is not None:
        prompt_ids = request.prompt_token_ids
        vocab = loaded.vocab_size
        if max(prompt_ids) >= vocab:
            raise ApiError(
                400, f"prompt: token id {max(prompt_ids)} is outside the vocabulary ({vocab})", param="prompt"
            )
        return tokenizer.decode(prompt_ids), prompt_ids
    prompt = request.prompt or ""
    refuse_surely_too_long(prompt, loaded, limit)
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not prompt_ids:
        raise ApiError(400, "prompt: empty after tokenization", param="prompt")
    return prompt, prompt_ids


def refuse_surely_too_long(prompt: str, loaded: HoldsTokenizer, limit: int) -> None:
    """400 without tokenizing when the prompt cannot fit: each token covers at most ``max_token_bytes`` bytes
    (halved again for normalisers that shrink text), so tokenizing megabytes the context cannot hold is
    skipped; the exact check (:func:`completion_budget`) follows tokenizing."""
    size = len(prompt.encode("utf-8", "replace"))
    at_least = size // (2 * loaded.max_token_bytes)
    if at_least > limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your prompt of {size} bytes is at "
            f"least {at_least} tokens. Please reduce the length of the messages.",
            param="messages",
            code="context_length_exceeded",
        )


def completion_budget(prompt_tokens: int, sampling: SamplingParams, limit: int, default_max_tokens: int | None) -> int:
    """How many tokens the call may sample: its ``max_tokens``, else the default, else what fits; 400 (OpenAI's
    ``context_length_exceeded``) when the prompt and that do not fit in ``limit``."""
    room = limit - prompt_tokens
    default = min(room, default_max_tokens or room)
    wanted = sampling.max_tokens if sampling.max_tokens is not None else default
    if room < 1 or wanted > room:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + wanted} tokens ({prompt_tokens} in the messages, {wanted} in the completion). "
            "Please reduce the length of the messages or completion.",
            param="messages",
            code="context_length_exceeded",
        )
    return wanted


def build_choice(
    index: int,
    tokenizer: Any,
    token_ids: list[int],
    logprobs: list[float],
    top: Sequence[Sequence[tuple[int, float]]] | None,
    finish_reason: str,
    sampling: SamplingParams,
    tools: bool,
) -> Choice:
    """One choice from what the model sampled: ids, each one's logprob, per token the most likely alternatives
    (``top``, when the call asked for ``top_logprobs``), and why it ended (``stop`` or ``length``)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    finish = finish_reason
    if sampling.stop:
        text, cut = cut_at_stop(text, sampling.stop)
        finish = "stop" if cut else finish
    calls: list[dict[str, Any]] = []
    if tools:
        text, calls = extract_tool_calls(text)
        finish = "tool_calls" if calls else finish
    detail = None
    if sampling.logprobs:
        detail = [
            TokenLogprob(
                tokenizer.decode([token]),
                logprob,
                [(tokenizer.decode([alt]), value) for alt, value in (top[i] if top else [])],
            )
            for i, (token, logprob) in enumerate(zip(token_ids, logprobs, strict=True))
        ]
    texts = pieces(tokenizer, token_ids) if not calls else None
    return Choice(index, text, finish, token_ids, logprobs, calls, detail, texts)


def call_result(
    kind: str,
    model: str,
    choices: list[Choice],
    prompt_ids: list[int],
    prompt: str,
    version: int | None,
    adapter: str | None = None,
) -> CallResult:
    """A call's result: ``kind`` is the id's prefix (``chatcmpl``, ``cmpl``); ``version`` served it (with
    ``adapter``, that agent's adapter's version)."""
    return CallResult(
        id=f"{kind}-{secrets.token_hex(12)}",
        model=model,
        choices=choices,
        prompt_token_ids=list(prompt_ids),
        prompt_tokens=len(prompt_ids),
        completion_tokens=sum(len(c.token_ids or ()) for c in choices),
        model_version=version,
        prompt_text=prompt,
        adapter=adapter,
    )


def pieces(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """The text each token adds to the decoded reply. A token that ends inside a multi-byte character adds
    nothing until the character is complete."""
    out, emitted = [], ""
    for end in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:end], skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(emitted):
            out.append("")
            continue
        out.append(text[len(emitted) :])
        emitted = text
    return out


def stop_check(stops: tuple[str, ...], tokenizer: Any) -> Callable[[list[int]], bool]:
    """A check of the reply's ids so far: True once a stop string appears in its text."""
    longest = max(len(s) for s in stops)

    def check(token_ids: list[int]) -> bool:
        # Decoding the tail is enough: a stop string spans at most `longest` characters, each >= 1 token.
        tail = tokenizer.decode(token_ids[-(longest + 8) :], skip_special_tokens=True)
        return any(stop in tail for stop in stops)

    return check


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """The text before the first stop string (which OpenAI leaves out), and whether one was found."""
    positions = [text.find(stop) for stop in stops if stop in text]
    if not positions:
        return text, False
    return text[: min(positions)], True


def chat_template_override(choice: str) -> str:
    """The template ``FULMEN_LLM_CHAT_TEMPLATE`` names: ``chatml-tools`` (the built-in ChatML template that lists
    the tools in the system turn and writes calls as ``<tool_call>`` blocks, which the gateway parses back) or
    the path of a Jinja file. Models whose own template ignores ``tools`` (SmolLM2-135M-Instruct's) or cannot
    render an assistant turn without content need one, as with vLLM's ``--chat-template``."""
    if choice == "chatml-tools":
        return CHAT_TEMPLATE
    path = Path(choice)
    if not path.is_file():
        raise ConfigurationError(f"FULMEN_LLM_CHAT_TEMPLATE: {choice!r} is neither 'chatml-tools' nor a file")
    return path.read_text(encoding="utf-8")


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' tqdm bars off inside the block, as they were after it: every model version the gateway
    loads printed a "Loading weights" bar into the service's log (``_load`` logs each load at INFO; a local
    directory has nothing to download). Warnings go through logging and still show.

    The trainer has its own copy (``fulmen.algorithm.trainer.torch_backend``): neither may import the other's
    layer, and the trainer imports nothing of ``fulmen.infra`` (it runs without pydantic)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
