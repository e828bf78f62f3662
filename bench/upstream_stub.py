"""A trivial OpenAI-compatible upstream for benchmarks: answers every chat completion at once, as vLLM does
when asked for token ids (fixed 8-token answer, its token ids and logprobs). Run it as a process:

    .venv/bin/python -m bench.upstream_stub PORT
"""

from __future__ import annotations

import sys

from aiohttp import web

ANSWER_IDS = [9707, 11, 1246, 525, 498, 30, 151645, 0][:8]
CHOICE = {
    "index": 0,
    "message": {"role": "assistant", "content": "Hello, how are you?"},
    "finish_reason": "stop",
    "token_ids": ANSWER_IDS,
    "logprobs": {"content": [{"token": "x", "logprob": -0.5, "top_logprobs": []} for _ in ANSWER_IDS]},
}


async def chat(request: web.Request) -> web.Response:
    body = await request.json()
    prompt_ids = list(range(100, 100 + 4 * len(body.get("messages", []))))
    return web.json_response(
        {
            "id": "chatcmpl-stub",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", ""),
            "choices": [CHOICE],
            "prompt_token_ids": prompt_ids,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(ANSWER_IDS),
                "total_tokens": len(prompt_ids) + len(ANSWER_IDS),
            },
        }
    )


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "stub", "max_model_len": 4096}]})


def main() -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)


if __name__ == "__main__":
    main()
