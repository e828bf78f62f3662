"""Run under torchrun by ``test_sharded_trainer.py``: the same steps on the tiny model with however many ranks.

    torchrun --nproc-per-node N tests/unit/sharded_steps.py MODEL_DIR OUT_DIR

For each case of :data:`CASES` every rank builds a :class:`ShardedTrainer`; rank 0 hands the ranks their shards
through :class:`RankZeroBackend` (as ``fulmen train`` does), takes the steps, saves the checkpoint to
``OUT_DIR/<case>`` and takes an SFT step; ``OUT_DIR/metrics.json`` holds each case's step metrics. The samples are those of
``test_torch_trainer.make_samples``; half the rows carry recorded old logprobs (the rest are computed), so ranks
disagree on whether a micro-batch needs the old-logprob pass.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import json
import logging
from dataclasses import replace

from fulmen.algorithm.batch import Sample
from fulmen.algorithm.trainer import distributed
from fulmen.algorithm.trainer.torch_backend import LoraSettings, TorchTrainerConfig
from tests.unit.test_torch_trainer import make_samples

CASES = {
    # two epochs (the second off-policy: clipping), KL to a sharded frozen reference, ragged micro-batches
    "full": {"lr": 1e-4, "micro_batch_size": 3, "epochs_per_batch": 2, "kl_coef": 0.05},
    # LoRA under fully_shard: frozen base and trainable adapter in one group; its reference is the adapter off
    "lora": {"lr": 1e-3, "micro_batch_size": 4, "kl_coef": 0.05, "lora": LoraSettings(r=4, alpha=8)},
    "seq_mean": {"lr": 1e-4, "micro_batch_size": 5, "aggregation": "seq_mean", "max_grad_norm": 0.01},
}
STEPS = {"full": [(0, 12), (1, 12)], "lora": [(3, 12), (4, 12)], "seq_mean": [(5, 12), (6, 1)]}
"""The steps of each case: (seed of the samples, rows); a step of one row leaves a rank without any."""


def samples_of(seed: int, rows: int) -> list[Sample]:
    """The first ``rows`` of ``make_samples(seed)`` (12), with made-up recorded logprobs on every other row."""
    return [
        replace(s, old_logprobs=[-1.0 - 0.1 * t for t in range(len(s.response_token_ids))]) if i % 2 else s
        for i, s in enumerate(make_samples(seed)[:rows])
    ]


def config_of(model_dir: Path, case: str) -> TorchTrainerConfig:
    return TorchTrainerConfig(model_dir, device="cpu", dtype="float32", **CASES[case])


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    world = distributed.join("cpu", timeout_s=120)
    if not world.main:
        distributed.serve(world)  # one build per case, until rank 0's stop
        return 0
    metrics = {}
    for case in CASES:
        backend = distributed.RankZeroBackend.start(config_of(model_dir, case), world)
        metrics[case] = [backend.step(samples_of(*step)).as_dict() for step in STEPS[case]]
        backend.save(out / case)
        metrics[case].append(backend.sft_step(make_samples(9)).as_dict())  # the model trains on after a save
    (out / "metrics.json").write_text(json.dumps(metrics))
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
