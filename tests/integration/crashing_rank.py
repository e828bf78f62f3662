"""``fulmen train`` as one rank of a torchrun job whose rank 1 dies in its second training step (``os._exit(3)``,
as a killed or crashed process ends: no exception, no goodbye). Run by ``test_distributed_train.py``:

    torchrun --standalone --nproc-per-node 2 tests/integration/crashing_rank.py train --dataset ... --model tiny
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fulmen.algorithm.trainer.distributed import ShardedTrainer
from fulmen.cli.main import main

CRASH_RANK, CRASH_STEP = 1, 2

if int(os.environ["RANK"]) == CRASH_RANK:
    step = ShardedTrainer.step

    def dying_step(self, batch):
        if self.steps + 1 == CRASH_STEP:
            os._exit(3)
        return step(self, batch)

    ShardedTrainer.step = dying_step

if __name__ == "__main__":
    sys.argv = ["fulmen", *sys.argv[1:]]
    main()
