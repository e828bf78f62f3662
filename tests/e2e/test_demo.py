"""``fulmen demo`` end to end, shortened: the agent learns through the whole system, and the control does not.

Both runs are the real command in its own process (Kafka from the session's broker, everything else started
by the demo: ``fulmen consume``, both gateways, a runner, the trainer) and share one FULMEN_HOME, so the
warmed-up model is built once (and kept: see ``demo_home``). Held-out accuracy is the trainer's greedy
validation through the system.

- learning: held-out accuracy starts below 45% and after at most ``LEARN_STEPS`` GRPO steps is above where it
  started by ``GAIN`` (the run stops early, ``--stop-at-accuracy``, at the first validation, every 5 steps, that
  reaches 45% + ``GAIN``: most runs get there by step 10 or 15, and every step saved is ~12 s of the suite). How many steps that takes depends on the warmed-up model, which differs between machines (float
  kernels): on the first machines three 20-step runs went 0.33 -> 0.96-1.0 at step 15; on this one (2 cores,
  the warm-up starts at 0.375 and gives the three untaught wordings the same operator distribution) the reward
  stays flat until GRPO has learnt to tell them apart, then rises. With one PPO pass a step that took 6 to over
  25 steps (one CI run: 0.54 at step 25); the demo now takes two passes a step (``epochs_per_batch=2``): 0.60 at
  step 5, 0.90 at 15, 1.0 at 20. ``bench/demo_learning.py`` (the operator choice replayed in one process, same
  trainer), mean of three seeds at steps 5/10/15: one pass 0.40/0.57/0.70, two passes 0.64/0.85/0.94. The system
  learns more slowly than that replay (rollouts up to one version old, call 2 trained too): 25 steps keep a margin;
- control (``--shuffle-rewards``: rewards permuted within each step, so they no longer belong to the answers
  they scored), ``CONTROL_STEPS``: its training reward (the sampled policy on questions it has not seen, 96
  episodes a step) does not improve by more than ``MARGIN`` from the first five steps to the last five, and its
  held-out accuracy gains at most one wording's worth (``FLIP``). Greedy held-out accuracy alone is a knife
  edge here: the warmed-up model picks an untaught wording's operator almost uniformly (greedy `+` at ~0.4
  against ~0.3), so a small random drift flips a wording's greedy choice (a third of the held-out set); one CI
  control run ended at 0.44 from 0.33, while a 20-step control's training reward stayed at 0.16-0.43 with no
  trend.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fulmen.infra.kafka.local import LocalKafka

# A step is ~20 s on 2 cores (the learning run ~9 min, the control ~6), plus the ~3 min warm-up the first time.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

FULMEN = [sys.executable, "-m", "fulmen.cli.main"]
LEARN_STEPS = 25
CONTROL_STEPS = 15
MARGIN = 0.10  # the control's training reward may drift by this much
FLIP = 1 / 3 + 1 / 48  # one untaught wording's greedy choice flipping by chance (16 of the 48 held-out tasks)
GAIN = 0.25  # the learning run must gain at least this much


@pytest.fixture(scope="module")
def demo_home() -> Path:
    """A FULMEN_HOME kept between test sessions (next to the test models), so the ~2.5 min warm-up is built once
    per machine and recipe; each run's own directory is removed after it."""
    cache = Path(os.environ.get("FULMEN_TEST_MODEL_CACHE", Path.home() / ".cache" / "fulmen" / "test-models"))
    home = cache / "demo-home"
    home.mkdir(parents=True, exist_ok=True)
    return home


def run_demo(home: Path, broker: LocalKafka, steps: int, *extra: str, early_stop: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {
        "FULMEN_KAFKA_BOOTSTRAP": broker.bootstrap,
        "FULMEN_HOME": str(home),
        "COLUMNS": "160",
    }
    done = subprocess.run(
        [*FULMEN, "demo", "--json", "--steps", str(steps), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["steps"] <= steps if early_stop else report["steps"] == steps, report
    assert Path(report["final_model"], "config.json").is_file()
    assert Path(report["plot"]).is_file() and "fulmen sql" in done.stdout
    shutil.rmtree(report["run_dir"], ignore_errors=True)
    return report


def test_demo_learns_through_the_system(demo_home: Path, kafka_broker: LocalKafka) -> None:
    target = str(0.45 + GAIN)  # reaching it is a gain of GAIN at least: the run may stop there (a validation step)
    report = run_demo(demo_home, kafka_broker, LEARN_STEPS, "--stop-at-accuracy", target, early_stop=True)
    assert report["accuracy_before"] < 0.45, report  # the untaught wordings: about one in three
    assert report["accuracy_after"] >= report["accuracy_before"] + GAIN, report
    assert report["steps"] == LEARN_STEPS or report["accuracy_after"] >= float(target), report  # stopped: reached


def test_shuffled_rewards_control_does_not_learn(demo_home: Path, kafka_broker: LocalKafka) -> None:
    report = run_demo(demo_home, kafka_broker, CONTROL_STEPS, "--shuffle-rewards")
    assert report["shuffle_rewards"]
    rewards = [reward for _, reward in report["reward_curve"]]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last <= first + MARGIN, report
    assert report["accuracy_after"] <= report["accuracy_before"] + FLIP, report
