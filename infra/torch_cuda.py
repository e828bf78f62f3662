"""Attention kernels Fulmen trusts on a CUDA GPU: torch's cuDNN backend of ``scaled_dot_product_attention`` is off.

On Hopper (H100, H200) torch prefers the cuDNN SDPA backend for half-precision inputs, and that backend has
silently wrong results exactly where Fulmen's trainer and sampler live: an explicit attention mask (the trainer's
prefix tree and packed rows, the sampler's padded batches) and grouped-query attention with few key/value heads
(SmolLM2-135M has 3). Reported upstream: pytorch/pytorch#196678 (NaN query gradients with a mask when the length
is 64 past a multiple of 128, torch 2.11 on), #193893 (corrupted greedy generation with fewer than 8 key/value
heads), #191612 (a float mask reinterpreted in the query's dtype). Seen on a lent H100 before this module existed
(torch 2.11.0, transformers 5.17.0, SmolLM2-135M under bf16 autocast): the trainer's prefix-tree logprobs differed
from the padded rows' by up to 8.0 nats and their gradients by 308%, where float32 (which cuDNN does not serve)
agreed to 0.001 and 0.01%; and the sampler, on the tiny test model, made 289 tokens/s in bf16 against 1,645 in
float32. That cuDNN is the cause is inferred from the upstream reports: ``bench/gpu_check.py`` measures bf16 with
it off and on. Flash, memory-efficient and math kernels remain.

``trusted_attention(device)`` is called wherever a model is put on a device (the trainer, the FSDP ranks, the
gateway's transformers backend); it is a no-op on the CPU and idempotent. ``FULMEN_CUDNN_SDPA=1`` turns cuDNN
back on (to measure it, or once a fixed torch is pinned).
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["trusted_attention"]

logger = logging.getLogger(__name__)

_ALLOW_CUDNN = "FULMEN_CUDNN_SDPA"


def trusted_attention(device: Any) -> bool:
    """Turn torch's cuDNN SDPA backend off for this process when ``device`` is a CUDA device; True when it is off
    after the call (False on the CPU, or where ``FULMEN_CUDNN_SDPA=1`` keeps it)."""
    import torch

    if torch.device(device).type != "cuda":
        return False
    if os.environ.get(_ALLOW_CUDNN) == "1":
        logger.info("cuDNN attention kept on (%s=1)", _ALLOW_CUDNN)
        return False
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        logger.info("cuDNN attention turned off on %s (see fulmen.infra.torch_cuda)", device)
    return True
