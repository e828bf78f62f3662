"""GPU check of sharded training: FSDP2 (world size 1) on CUDA with SmolLM2-135M's architecture, bf16, full and LoRA.

For each of the two runs (every weight; LoRA r=16): join a process group of one (NCCL on CUDA, gloo on the CPU),
build the sharded trainer through :class:`RankZeroBackend` as ``fulmen train`` does (``fully_shard`` per decoder
layer, then the root), take one warm-up GRPO step and ``--steps`` timed steps (two epochs a step, KL to the
reference on, bf16 compute with float32 weights), gather and save the checkpoint, reload it with
``AutoModelForCausalLM`` and compare its logits with the sharded model's. Checks: losses and gradient norms finite,
no skipped update, every trainable weight changed (LoRA: every adapter weight, no base weight), KL positive after
the first step, reloaded logits equal. Reports tokens/s (median), peak memory (``torch.cuda.max_memory_allocated``
from the warm-up on; on the CPU the RSS high-water mark), the checkpoint's gather-and-save time.

The model: SmolLM2-135M's architecture built from its config (LlamaForCausalLM: 30 layers, hidden 576, 9 heads, 3
KV heads, vocabulary 49152, tied embeddings) with RANDOM weights. Its trained weights (540 MB in float32, 93 MB as
GGUF) cannot travel to the GPU machine (64 MiB per call) and nothing there can download them; throughput and memory
depend on the shapes only. ``--tiny`` uses a 2-layer model of the same family (for a CPU run of the script).

Needs only torch, transformers and peft: no Kafka, Java, pydantic or Fulmen install. The repository's folders are
imported from their paths (``fulmen.algorithm`` is ``algorithm/``), as the installed package maps them.
Prints ONE JSON line and exits 1 if a check failed.

    python bench/gpu_scale_check.py [--device cuda|cpu] [--tiny] [--steps 3] [--samples 64]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from uninstalled import map_fulmen  # noqa: E402

map_fulmen(ROOT)  # the repository's fulmen/ without its install (the GPU machine has none)

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from fulmen.algorithm.batch import Sample, collate  # noqa: E402
from fulmen.algorithm.rl.advantages import compute_advantages, encode_group_ids  # noqa: E402
from fulmen.algorithm.trainer import distributed  # noqa: E402
from fulmen.algorithm.trainer.torch_backend import LoraSettings, TorchTrainerConfig  # noqa: E402

SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
TINY = {
    **SMOLLM2_135M,
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 1024,
}


def build_model(shape: dict, directory: Path) -> Path:
    """A LlamaForCausalLM of ``shape`` with random weights (seeded), saved as a Hugging Face directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(directory)
    return directory


def grpo_samples(seed: int, count: int, vocab: int, max_response: int) -> list[Sample]:
    """Groups of 8 sharing a prompt, responses of 1..max_response random tokens, both outcomes in every group."""
    rng = random.Random(seed)
    rows, rewards, groups = [], [], []
    for index in range(count):
        if index % 8 == 0:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))]
        rows.append((prompt, [rng.randrange(3, vocab) for _ in range(rng.randint(1, max_response))]))
        rewards.append(float(index % 2))
        groups.append(index // 8)
    advantages = compute_advantages("grpo", torch.tensor(rewards), encode_group_ids(groups)).tolist()
    return [Sample(p, r, a, group_id=str(g)) for (p, r), a, g in zip(rows, advantages, groups, strict=True)]


def full_weights(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, bool]]:
    """Every parameter, gathered (a DTensor's full tensor), on the CPU, with whether it trains."""
    out = {}
    for name, param in model.named_parameters():
        value = param.detach()
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = (value.float().cpu().clone(), param.requires_grad)
    return out


def run_one(model_dir: Path, vocab: int, out: Path, args: argparse.Namespace, lora: bool) -> dict:
    device = torch.device(args.device)
    config = TorchTrainerConfig(
        model_dir,
        device=args.device,
        dtype=args.dtype,
        lr=1e-4 if lora else 1e-5,
        micro_batch_size=args.micro_batch,
        epochs_per_batch=2,
        kl_coef=0.05,
        lora=LoraSettings(r=16, alpha=32) if lora else None,
        seed=0,
    )
    world = distributed.join(args.device, timeout_s=600)
    backend = distributed.RankZeroBackend.start(config, world)
    model = backend.trainer.model
    before = full_weights(model)
    warmup = backend.step(grpo_samples(0, args.samples, vocab, args.max_response))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    steps = [backend.step(grpo_samples(s, args.samples, vocab, args.max_response)) for s in range(1, args.steps + 1)]
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else rss_peak_mib()
    after = full_weights(model)
    started = time.perf_counter()
    saved = backend.save(out / ("lora" if lora else "full"))
    checkpoint_s = time.perf_counter() - started
    changed = {n: not torch.equal(after[n][0], before[n][0]) for n in before}
    trainable = {n for n, (_, grad) in before.items() if grad}
    metrics = [warmup, *steps]
    checks = {
        "finite": all(math.isfinite(m.loss) and math.isfinite(m.grad_norm) for m in metrics),
        "no_skipped_update": all(m.skipped_updates == 0 for m in metrics),
        "every_trainable_weight_changed": bool(trainable) and all(changed[n] for n in trainable),
        "frozen_weights_unchanged": not any(changed[n] for n in changed if n not in trainable),
        "kl_positive_after_first_step": all(m.kl > 0 for m in steps),
        "reload_logits_equal": reload_matches(backend, saved, vocab, device),
    }
    backend.close()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "lora": lora,
        "dtype": args.dtype,
        "trainable_params": sum(before[n][0].numel() for n in trainable),
        "tokens_per_s": round(statistics.median(m.tokens_per_s for m in steps), 1),
        "step_s": [round(m.train_s, 3) for m in steps],
        "input_tokens_per_step": steps[0].input_tokens,
        "loss": [round(m.loss, 5) for m in metrics],
        "kl": [round(m.kl, 6) for m in metrics],
        "peak_memory_mib": round(peak, 1),
        "checkpoint_s": round(checkpoint_s, 3),
        "checks": checks,
    }


def reload_matches(backend: distributed.RankZeroBackend, saved: Path, vocab: int, device: torch.device) -> bool:
    """The checkpoint reloads as a plain causal LM whose float32 logits equal the sharded model's."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).to(device).eval()
    ids = collate(grpo_samples(99, 8, vocab, 16), backend.trainer.pad_id).input_ids.to(device)
    model = backend.trainer.model.eval()
    with torch.no_grad():
        ours, theirs = model(input_ids=ids).logits.float(), reloaded(input_ids=ids).logits.float()
    return bool(torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4))


def rss_peak_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return math.nan


def one_rank_job() -> None:
    """Make this process the only rank of a job (torchrun's variables), unless torchrun started it."""
    if distributed.launched():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--dtype", default=None, help="compute dtype: bfloat16 (default on cuda) or float32")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of the same family (CPU runs)")
    parser.add_argument("--steps", type=int, default=3, help="timed GRPO steps per run")
    parser.add_argument("--samples", type=int, default=64, help="samples per step (groups of 8)")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--max-response", type=int, default=128, help="longest response, in tokens")
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"passed": False, "error": "torch sees no CUDA GPU; run with --device cpu --tiny"}))
        return 1
    import peft
    import transformers

    one_rank_job()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        shape = TINY if args.tiny else SMOLLM2_135M
        model_dir = build_model(shape, Path(tmp) / "model")
        runs = [run_one(model_dir, shape["vocab_size"], Path(tmp), args, lora) for lora in (False, True)]
    failed = [f"{'lora' if r['lora'] else 'full'}:{name}" for r in runs for name, ok in r["checks"].items() if not ok]
    print(
        json.dumps(
            {
                "passed": not failed,
                "failed": failed,
                "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                "fsdp": {"world_size": 1, "backend": "nccl" if args.device.startswith("cuda") else "gloo"},
                "versions": {
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "peft": peft.__version__,
                },
                "model": {
                    "architecture": "tiny llama" if args.tiny else "SmolLM2-135M (LlamaForCausalLM from its config)",
                    "weights": "random: the trained ones cannot travel to the GPU machine; shapes set speed and memory",
                    "samples_per_step": args.samples,
                    "max_response": args.max_response,
                },
                "runs": runs,
                "total_s": round(time.perf_counter() - started, 1),
            }
        )
    )
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
