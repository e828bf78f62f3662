"""GPU check of the torch trainer: GRPO and SFT steps on a tiny Qwen2, bf16 and fp32, with and without LoRA.

For each of the four runs: build the trainer on a freshly written tiny model (``fulmen.algorithm.tiny_model``),
take ``--steps`` GRPO steps (KL to the reference on, two epochs per batch) and one SFT step, save, reload the
checkpoint with ``AutoModelForCausalLM`` and compare logits. Checks: losses and gradient norms finite, no
skipped update, every trainable weight changed (LoRA: every adapter weight changed, no base weight did),
KL to the reference positive after the first step, clip fraction in [0, 1], reloaded logits equal.

Needs only torch, transformers and peft (no pydantic, no Fulmen services). Prints ONE JSON line (tokens/s,
peak memory via ``torch.cuda.max_memory_allocated``, checks) and exits 1 if a check failed.

    python bench/gpu_trainer_check.py [--device cuda|cpu] [--steps 3] [--samples 64] [--hidden 256]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import json
import math
import random
import tempfile
import time

import torch

from fulmen.algorithm.batch import Sample, collate
from fulmen.algorithm.rl.advantages import compute_advantages, encode_group_ids
from fulmen.algorithm.tiny_model import TinyModelConfig, build_tiny_model
from fulmen.algorithm.trainer.torch_backend import LoraSettings, TorchTrainer, TorchTrainerConfig


def make_samples(seed: int, count: int, group_size: int, max_response: int) -> list[Sample]:
    """GRPO groups of random token ids (ids 5..100 of the character vocabulary) with binary rewards."""
    rng = random.Random(seed)
    samples, rewards, keys = [], [], []
    for index in range(count):
        group = index // group_size
        if index % group_size == 0:
            prompt = [rng.randrange(5, 100) for _ in range(rng.randint(8, 48))]
        response = [rng.randrange(5, 100) for _ in range(rng.randint(1, max_response))]
        samples.append(Sample(prompt, response, group_id=f"g{group}", old_logprobs=None))
        rewards.append(float(index % 2))  # each group holds both outcomes
        keys.append(f"g{group}")
    advantages = compute_advantages("grpo", torch.tensor(rewards), encode_group_ids(keys)).tolist()
    return [
        Sample(s.prompt_token_ids, s.response_token_ids, a, group_id=s.group_id)
        for s, a in zip(samples, advantages, strict=True)
    ]


def run_one(model_dir: Path, out_dir: Path, args: argparse.Namespace, dtype: str, lora: bool) -> dict:
    """One trainer configuration end to end; returns its measurements and checks."""
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    config = TorchTrainerConfig(
        model_dir,
        device=args.device,
        dtype=dtype,
        lr=1e-3 if lora else 3e-4,
        micro_batch_size=args.micro_batch,
        epochs_per_batch=2,
        kl_coef=0.05,
        lora=LoraSettings(r=8, alpha=16) if lora else None,
        seed=0,
    )
    trainer = TorchTrainer(config)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    steps = [trainer.step(make_samples(s, args.samples, 8, args.max_response)) for s in range(args.steps)]
    sft = trainer.sft_step(make_samples(99, args.samples, 8, args.max_response))
    changed = {n: not torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters()}
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    saved = trainer.save(out_dir / f"{dtype}-{'lora' if lora else 'full'}")
    checks = {
        "finite": all(math.isfinite(m.loss) and math.isfinite(m.grad_norm) for m in [*steps, sft]),
        "no_skipped_update": all(m.skipped_updates == 0 for m in [*steps, sft]),
        "every_trainable_weight_changed": all(changed[n] for n in trainable),
        "frozen_weights_unchanged": not any(changed[n] for n in changed if n not in trainable),
        "kl_positive_after_first_step": all(m.kl > 0 for m in steps[1:]),
        "clip_fraction_in_range": all(0.0 <= m.clip_fraction <= 1.0 for m in steps),
        "reload_logits_equal": reload_matches(trainer, saved),
    }
    peak = torch.cuda.max_memory_allocated() / 2**20 if args.device.startswith("cuda") else None
    return {
        "dtype": dtype,
        "lora": lora,
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "grpo_tokens_per_s": round(sum(m.tokens_per_s for m in steps) / len(steps), 1),
        "sft_tokens_per_s": round(sft.tokens_per_s, 1),
        "grpo_step_s": [round(m.train_s, 3) for m in steps],
        "loss": [round(m.loss, 5) for m in steps],
        "kl": [round(m.kl, 6) for m in steps],
        "clip_fraction": [round(m.clip_fraction, 4) for m in steps],
        "sft_loss": round(sft.loss, 4),
        "peak_memory_mib": None if peak is None else round(peak, 1),
        "checks": checks,
    }


def reload_matches(trainer: TorchTrainer, saved: Path) -> bool:
    """The checkpoint reloads as a plain causal LM whose float32 logits equal the trainer's model's."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).to(trainer.device).eval()
    ids = collate(make_samples(7, 8, 4, 16), trainer.pad_id).input_ids.to(trainer.device)
    with torch.no_grad():
        ours = trainer.model(input_ids=ids).logits.float()
        theirs = reloaded(input_ids=ids).logits.float()
    return bool(torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per configuration")
    parser.add_argument("--samples", type=int, default=64, help="samples per step (groups of 8)")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--max-response", type=int, default=96, help="longest response, in tokens")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the tiny Qwen2")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"passed": False, "error": "torch sees no CUDA GPU; run with --device cpu"}))
        return 1
    import peft
    import transformers

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        shape = TinyModelConfig(
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=max(4, args.hidden // 64),
            num_key_value_heads=max(2, args.hidden // 128),
            intermediate_size=4 * args.hidden,
        )
        model_dir = build_tiny_model(Path(tmp) / "model", shape)
        runs = [
            run_one(model_dir, Path(tmp), args, dtype, lora)
            for dtype in ("bfloat16", "float32")
            for lora in (False, True)
        ]
    failed = [
        f"{r['dtype']}/{'lora' if r['lora'] else 'full'}:{name}"
        for r in runs
        for name, ok in r["checks"].items()
        if not ok
    ]
    result = {
        "passed": not failed,
        "failed": failed,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
        "model": {"hidden": args.hidden, "layers": args.layers, "samples_per_step": args.samples},
        "runs": runs,
        "total_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(result))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
