"""GPU check of the LLM gateway's batched sampler (``producers/llm_gateway/backends/sampling.py``) on CUDA.

Builds the tiny model, samples 32 sequences at once on the GPU (fp32 and bf16), and checks: a padded row
produces the same greedy tokens as the row alone, the recorded logprobs equal a full forward pass over the
sampled sequence, and seeded sampling repeats. Needs only torch and transformers. On CUDA the runs use the
attention kernels Fulmen trusts (``fulmen.infra.torch_cuda``: cuDNN's SDPA off), and one more bf16 run with cuDNN's
on shows what that choice avoids (``cudnn_sdp``: true; not counted in ``ok``). Prints ONE JSON line.

    python bench/gpu_sampling_check.py [--device cuda|cpu]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import json
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fulmen.algorithm.tiny_model import build_tiny_model
from fulmen.infra.torch_cuda import trusted_attention


def _load_sampler():
    """The sampler module by its path: the gateway's packages import aiohttp/pydantic, absent on a bare GPU box."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "producers" / "llm_gateway" / "backends" / "sampling.py"
    spec = importlib.util.spec_from_file_location("fulmen_sampling", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


_sampler = _load_sampler()
Row, generate = _sampler.Row, _sampler.generate


def check(model_dir: Path, device: str, dtype: torch.dtype) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    eos = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    short = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)["input_ids"]
    long = tokenizer.apply_chat_template(
        [{"role": "user", "content": "a longer question " * 4}], add_generation_prompt=True
    )["input_ids"]
    alone = generate(model, [Row(long, 32, 0.0)], tokenizer.pad_token_id, eos)[0]
    padded = generate(model, [Row(short, 32, 0.0), Row(long, 32, 0.0)], tokenizer.pad_token_id, eos)[1]
    seeded = [
        generate(model, [Row(short, 48, 1.0, seed=7)], tokenizer.pad_token_id, eos)[0].token_ids for _ in range(2)
    ]
    sampled = generate(model, [Row(long, 48, 1.0, seed=3)], tokenizer.pad_token_id, eos)[0]
    with torch.no_grad():
        ids = torch.tensor([long + sampled.token_ids], device=device)
        full = torch.log_softmax(model(ids).logits.float(), -1)[0]
    reference = [full[len(long) - 1 + i, t].item() for i, t in enumerate(sampled.token_ids)]
    logprob_error = max(abs(a - b) for a, b in zip(reference, sampled.logprobs, strict=True))
    rows = [Row(long if i % 2 else short, 128, 1.0) for i in range(32)]
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    out = generate(model, rows, tokenizer.pad_token_id, eos)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    tolerance = 1e-3 if dtype == torch.float32 else 5e-2
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled() if device == "cuda" else False,
        "padded_equals_alone": padded.token_ids == alone.token_ids or dtype != torch.float32,
        "seeded_repeats": seeded[0] == seeded[1],
        "logprob_max_error": logprob_error,
        "logprobs_match": logprob_error < tolerance,
        "tokens_per_s_batch32": sum(len(o.token_ids) for o in out) / elapsed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    model_dir = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    trusted_attention(args.device)
    results = [check(model_dir, args.device, dtype) for dtype in (torch.float32, torch.bfloat16)]
    ok = all(r["padded_equals_alone"] and r["seeded_repeats"] and r["logprobs_match"] for r in results)
    if args.device.startswith("cuda"):  # what the trusted kernels avoid: the same bf16 run on cuDNN's SDPA
        torch.backends.cuda.enable_cudnn_sdp(True)
        results.append(check(model_dir, args.device, torch.bfloat16))
        trusted_attention(args.device)
    print(json.dumps({"device": args.device, "ok": ok, "runs": results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
