"""Algorithms by name: one setting selects a recipe, each piece stays settable and wins when set, ``fulmen config
show`` prints the pieces in force, and the trainer refuses names its registries lack, saying what to set."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fulmen.algorithm.rl.advantages import get_advantage_fn
from fulmen.algorithm.rl.losses import get_aggregation, get_policy_loss_fn
from fulmen.algorithm.rl.recipes import ALGORITHMS, Algorithm
from fulmen.algorithm.service import run as train_module
from fulmen.algorithm.service.run import build_backend, check_training_settings
from fulmen.algorithm.settings import TrainSection, TrainSettings
from fulmen.cli.main import app
from fulmen.schemas.errors import ConfigurationError

PIECES = (
    "estimator",
    "policy_loss",
    "loss_aggregation",
    "clip_eps",
    "clip_eps_high",
    "dynamic_sampling",
    "overlong_shaping",
)
EXPECTED = {
    "grpo": ("grpo", "ppo_clip", "token_mean", 0.2, None, False, False),
    "dr_grpo": ("dr_grpo", "ppo_clip", "token_mean", 0.2, None, False, False),
    "rloo": ("rloo", "ppo_clip", "token_mean", 0.2, None, False, False),
    "dapo": ("grpo", "dapo", "token_mean", 0.2, 0.28, True, True),
    "gspo": ("grpo", "gspo", "seq_mean", 3e-4, 4e-4, False, False),
    "cispo": ("grpo", "cispo", "token_mean", 1.0, 3.0, False, False),
}


def pieces(section: TrainSection) -> tuple:
    return tuple(getattr(section, name) for name in PIECES)


def test_the_six_names_select_their_recipes_and_grpo_is_todays_default() -> None:
    assert ALGORITHMS.names() == list(Algorithm) == list(EXPECTED)
    for name, expected in EXPECTED.items():
        assert pieces(TrainSection(algorithm=name)) == expected, name
    default = TrainSection()
    assert default.algorithm == "grpo" and pieces(default) == EXPECTED["grpo"]
    assert (default.correction, default.recompute_old_logprobs) == ("", False)  # no correction unless asked


def test_every_recipe_names_registered_pieces() -> None:
    for name in ALGORITHMS.names():
        recipe = ALGORITHMS.get(name)
        get_advantage_fn(recipe.estimator)
        get_policy_loss_fn(recipe.policy_loss)
        get_aggregation(recipe.loss_aggregation)


def test_a_piece_set_explicitly_wins_over_the_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FULMEN_TRAIN_ALGORITHM", "dapo")
    monkeypatch.setenv("FULMEN_TRAIN_CLIP_EPS_HIGH", "0.3")
    monkeypatch.setenv("FULMEN_TRAIN_DYNAMIC_SAMPLING", "false")
    train = TrainSettings().train
    assert pieces(train) == ("grpo", "dapo", "token_mean", 0.2, 0.3, False, True)
    assert pieces(TrainSection(algorithm="gspo", loss_aggregation="token_mean"))[2] == "token_mean"


def test_unknown_algorithm_lists_the_valid_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FULMEN_TRAIN_ALGORITHM", "ppo")
    with pytest.raises(ValueError, match="unknown algorithm 'ppo'; valid: grpo, dr_grpo, rloo, dapo, gspo, cispo"):
        TrainSettings()
    with pytest.raises(ValueError, match="correction_low"):
        TrainSection(correction="mis", correction_low=3.0, correction_high=2.0)


def test_config_show_prints_the_pieces_in_force(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FULMEN_TRAIN_ALGORITHM", "gspo")
    monkeypatch.setenv("FULMEN_TRAIN_CORRECTION", "tis")
    result = CliRunner().invoke(app, ["config", "show"])
    assert result.exit_code == 0, result.output
    train = json.loads(result.output)["train"]
    assert {k: train[k] for k in ("algorithm", "correction", *PIECES)} == {
        "algorithm": "gspo",
        "correction": "tis",
        **dict(zip(PIECES, EXPECTED["gspo"], strict=True)),
    }
    for name in (
        "correction_level",
        "correction_low",
        "correction_high",
        "recompute_old_logprobs",
        "dynamic_sampling_max_skipped",
        "overlong_max_tokens",
        "overlong_buffer_tokens",
        "overlong_penalty",
    ):
        assert name in train, name


def test_config_show_with_an_algorithm_imports_no_torch() -> None:
    code = (
        "import sys\nfrom fulmen.algorithm.settings import TrainSection\n"
        "assert TrainSection(algorithm='cispo').policy_loss == 'cispo'\n"
        "assert 'torch' not in sys.modules, 'settings imported torch'\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"estimator": "dapo"},
            "FULMEN_TRAIN_ESTIMATOR: unknown advantage estimator 'dapo'; valid: grpo, dr_grpo, rloo "
            r"\(dapo is an algorithm: set FULMEN_TRAIN_ALGORITHM=dapo",
        ),
        (
            {"policy_loss": "grpo"},
            r"FULMEN_TRAIN_POLICY_LOSS: .*valid: ppo_clip, dapo, gspo, cispo \(grpo is an algorithm",
        ),
        ({"loss_aggregation": "sum"}, "FULMEN_TRAIN_LOSS_AGGREGATION: .*valid: token_mean, seq_mean$"),
        ({"correction": "ips"}, "FULMEN_TRAIN_CORRECTION: .*valid: tis, mis, decoupled"),
        ({"correction_level": "batch"}, "FULMEN_TRAIN_CORRECTION_LEVEL: .*valid: token, sequence"),
        ({"algorithm": "dapo"}, "needs the response length limit: set FULMEN_TRAIN_OVERLONG_MAX_TOKENS"),
    ],
)
def test_the_trainer_refuses_what_its_registries_lack(settings: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        check_training_settings(TrainSection(**settings))


def test_complete_settings_pass_the_check() -> None:
    for name in ALGORITHMS.names():
        check_training_settings(TrainSection(algorithm=name, overlong_max_tokens=512))
    check_training_settings(TrainSection(algorithm="dapo", overlong_shaping=False))
    check_training_settings(TrainSection(correction="mis", correction_level="sequence"))
    assert TrainSection(algorithm="dapo", overlong_max_tokens=500).overlong_limits == (500, 100, 1.0)


def test_build_backend_hands_every_piece_to_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    # build_backend may import the sharded trainer, whose class subclasses TorchTrainer: import it before the
    # stand-in replaces TorchTrainer (alone, this test failed with "function() argument 'code' must be code").
    importlib.import_module("fulmen.algorithm.trainer.distributed")
    monkeypatch.setattr("fulmen.algorithm.trainer.torch_backend.TorchTrainer", lambda config: config)
    assert train_module.build_backend is build_backend
    options = TrainSection(
        algorithm="gspo",
        correction="decoupled",
        correction_level="sequence",
        correction_low=0.1,
        correction_high=5.0,
        recompute_old_logprobs=True,
        kl_coef=0.01,
    )
    config = build_backend(options, "some/model")
    assert (config.policy_loss, config.aggregation, config.clip_eps, config.clip_eps_high) == (
        "gspo",
        "seq_mean",
        3e-4,
        4e-4,
    )
    assert (config.correction, config.correction_level, config.correction_low, config.correction_high) == (
        "decoupled",
        "sequence",
        0.1,
        5.0,
    )
    assert config.recompute_old_logprobs and config.kl_coef == 0.01
    assert build_backend(TrainSection(), "m").correction is None  # '' in the settings is no correction
