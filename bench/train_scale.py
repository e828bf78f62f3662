"""Sharded training on the CPU: the same GRPO steps with 1 and with 2 gloo ranks (FSDP2 under torchrun).

For each rank count, one torchrun job (``relaunch_command``, ``--standalone``) runs the ranks of
``fulmen.algorithm.trainer.distributed``: rank 0 drives :class:`RankZeroBackend` (as ``fulmen train`` does), the
others :func:`serve`. The job builds the sharded trainer, takes one warm-up step and ``--steps`` timed steps on the
SAME batch (``bench.train_step``'s workload: GRPO groups of random token ids, binary rewards; old logprobs
computed in the step), then gathers and saves the checkpoint (``checkpoint_s``: ``save``, i.e. the all-gather of
the full state dict to rank 0 plus writing the Hugging Face directory).

``tokens_per_s_1`` and ``tokens_per_s_2``: one thread per rank (``OMP_NUM_THREADS=1``, torchrun's default), so the
ratio is what a second rank adds (on 2 cores: not a target); ``tokens_per_s_1_all_cores``: one rank with every
core's thread. Tokens/s = non-padding tokens of the batch / step wall time (the slowest rank), median of the steps.

``same_weights``: the two checkpoints (after the same steps) agree within ``tolerance`` (absolute, every weight;
float32 sums over the ranks' shards run in another order). Peak RSS per rank: the VmHWM of each rank's process.

    .venv/bin/python bench/train_scale.py [--model tiny|smollm2] [--steps 3]

Progress goes to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import json
import logging
import os
import statistics
import subprocess
import tempfile
import time

import torch

from bench.train_step import WORKLOADS, make_samples, peak_mib
from fulmen.algorithm.trainer import distributed
from fulmen.algorithm.trainer.torch_backend import TorchTrainerConfig

logger = logging.getLogger("bench.train_scale")

TOLERANCE = 1e-6
LR = 1e-5


def worker(args: argparse.Namespace) -> int:
    """One rank of the job: rank 0 times the steps and the save, every rank records its peak RSS."""
    out = Path(args.out)
    world = distributed.join("cpu", timeout_s=1800)
    try:
        if not world.main:
            distributed.serve(world)
            return 0
        work = WORKLOADS[args.model]
        config = TorchTrainerConfig(
            args.model_dir, device="cpu", dtype="float32", lr=LR, micro_batch_size=work.micro_batch, seed=0
        )
        backend = distributed.RankZeroBackend.start(config, world)
        samples = make_samples(work)
        warmup = backend.step(samples)
        steps = [backend.step(samples) for _ in range(args.steps)]
        started = time.perf_counter()
        backend.save(out / "checkpoint")
        checkpoint_s = time.perf_counter() - started
        backend.close()
        result = {
            "tokens_per_s": statistics.median(m.tokens_per_s for m in steps),
            "step_s": [round(m.train_s, 3) for m in steps],
            "loss": [round(m.loss, 7) for m in [warmup, *steps]],
            "input_tokens": steps[0].input_tokens,
            "response_tokens": steps[0].tokens,
            "checkpoint_s": checkpoint_s,
        }
        (out / "rank0.json").write_text(json.dumps(result))
        return 0
    finally:
        (out / f"rss-{world.rank}.json").write_text(json.dumps(round(peak_mib(torch.device("cpu")), 1)))


def run(ranks: int, threads: int, model_dir: Path, out: Path, args: argparse.Namespace) -> dict:
    """The torchrun job of ``ranks`` ranks of ``threads`` threads; its measurements (rank 0's, plus every rank's
    peak RSS)."""
    out.mkdir(parents=True)
    job = [__file__, "--worker", "--model", args.model, "--model-dir", str(model_dir), "--out", str(out)]
    command = distributed.relaunch_command(ranks, [*job, "--steps", str(args.steps)])
    logger.info("%d rank(s), %d thread(s) each: %s", ranks, threads, " ".join(command))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(command, env=env, capture_output=not args.verbose, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{ranks} rank(s) failed (exit {done.returncode}): {(done.stderr or '')[-3000:]}")
    result = json.loads((out / "rank0.json").read_text())
    result["peak_rss_mib_per_rank"] = [json.loads((out / f"rss-{r}.json").read_text()) for r in range(ranks)]
    result["threads_per_rank"] = threads
    return result


def weight_difference(a: Path, b: Path) -> float:
    """The largest absolute difference between two checkpoints' weights (inf when their names differ)."""
    from safetensors.torch import load_file

    left, right = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    if sorted(left) != sorted(right):
        return float("inf")
    return max(float((left[name] - right[name]).abs().max()) for name in left)


def model_directory(name: str, tmp: Path) -> Path:
    if name == "smollm2":
        from bench.smollm2 import ensure_smollm2

        return ensure_smollm2()
    from fulmen.algorithm.tiny_model import build_tiny_model

    return build_tiny_model(tmp / "tiny")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(WORKLOADS), default="tiny", help="tiny (default) or smollm2")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up (median reported)")
    parser.add_argument("--verbose", action="store_true", help="pass the ranks' output through")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_directory(args.model, Path(tmp))
        one = run(1, 1, model_dir, Path(tmp) / "ranks1", args)
        two = run(2, 1, model_dir, Path(tmp) / "ranks2", args)
        cores = os.cpu_count() or 1
        whole = run(1, cores, model_dir, Path(tmp) / "ranks1-all", args) if cores > 1 else one
        difference = weight_difference(Path(tmp) / "ranks1" / "checkpoint", Path(tmp) / "ranks2" / "checkpoint")
    work = WORKLOADS[args.model]
    print(
        json.dumps(
            {
                "model": args.model,
                "device": "cpu",
                "backend": "gloo",
                "cores": os.cpu_count(),
                "batch": {
                    "samples": work.samples,
                    "group": work.group,
                    "micro_batch": work.micro_batch,
                    "input_tokens": one["input_tokens"],
                    "response_tokens": one["response_tokens"],
                },
                "steps": args.steps,
                "lr": LR,
                "tokens_per_s_1": round(one["tokens_per_s"], 1),
                "tokens_per_s_2": round(two["tokens_per_s"], 1),
                "ratio_2_to_1": round(two["tokens_per_s"] / one["tokens_per_s"], 3),
                "tokens_per_s_1_all_cores": round(whole["tokens_per_s"], 1),
                "threads_1_all_cores": whole["threads_per_rank"],
                "checkpoint_s": round(two["checkpoint_s"], 3),
                "checkpoint_s_1": round(one["checkpoint_s"], 3),
                "same_weights": difference <= TOLERANCE,
                "max_weight_difference": difference,
                "tolerance": TOLERANCE,
                "same_loss": one["loss"] == two["loss"]
                or all(abs(a - b) <= 1e-5 * max(abs(a), 1e-7) for a, b in zip(one["loss"], two["loss"], strict=True)),
                "loss_1": one["loss"],
                "loss_2": two["loss"],
                "step_s_1": one["step_s"],
                "step_s_2": two["step_s"],
                "peak_rss_mib_1": one["peak_rss_mib_per_rank"],
                "peak_rss_mib_2": two["peak_rss_mib_per_rank"],
                "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                "torch": torch.__version__,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
