"""The anchor's LLM proxy (Agent Lightning 0.3.0's LiteLLM-based LLMProxy) in front of an OpenAI upstream.

Runs only inside the anchor's virtualenv (``bench/anchor.py`` starts it there), never under the project's:

    anchor-venv/bin/python bench/anchor_llm_proxy.py PORT UPSTREAM_URL STORE_URL

Serves ``/rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions`` (model ``fulmen``) on ``PORT``,
forwards to ``UPSTREAM_URL`` and records each call's span in the anchor's store at ``STORE_URL``, until SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import sys


async def serve(port: int, upstream: str, store_url: str) -> None:
    from agentlightning import LLMProxy
    from agentlightning.store.client_server import LightningStoreClient

    store = LightningStoreClient(store_url)
    model = {"model_name": "fulmen", "litellm_params": {"model": "hosted_vllm/stub", "api_base": upstream}}
    proxy = LLMProxy(port=port, host="127.0.0.1", model_list=[model], store=store)
    await proxy.start()
    stopped = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopped.set)
    await stopped.wait()
    await proxy.stop()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
