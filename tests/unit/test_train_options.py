"""Every training setting is an option of ``fulmen train``: listed in its help, set by its option (over the
environment), and handed whole to the ranks a ``--nproc N`` run relaunches under torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from fulmen.algorithm.rl.recipes import ALGORITHMS
from fulmen.algorithm.settings import TrainSection, TrainSettings
from fulmen.cli.main import app
from fulmen.cli.train import TRAIN_OPTIONS, relaunch_environment

# A value for every field, none its default. A new field fails test_every_field_has_a_value until it gets one here.
VALUES = {
    "run_id": "run-options-1",
    "run_dir": Path("/tmp/fulmen-options-run"),
    "keep_checkpoints": 3,
    "checkpoint_uri": "s3://bucket/runs",
    "stop_at_val_accuracy": 0.9,
    "model_path": "tiny",
    "model_name": "m1",
    "agent": "agents:solve",
    "prompt_bundle": "pb-0123456789ab",
    "steps": 3,
    "group_size": 5,
    "groups_per_step": 2,
    "max_groups_in_flight": 8,
    "min_group_size": 3,
    "group_timeout_s": 12.5,
    "incomplete_policy": "drop",
    "max_staleness": 2,
    "mode": "async",
    "algorithm": "dapo",
    "estimator": "rloo",
    "advantage_scope": "transition",
    "credit": "discounted",
    "gamma": 0.9,
    "anchor_weight": 0.5,
    "missing_reward": -1.0,
    "rollout_timeout_s": 30.0,
    "max_attempts": 2,
    "shuffle": False,
    "seed": 7,
    "val_every": 2,
    "val_group_size": 2,
    "consumer_group": "g1",
    "lr": 3e-6,
    "micro_batch_size": 4,
    "micro_batch_tokens": 2048,
    "epochs_per_batch": 2,
    "policy_loss": "gspo",
    "loss_aggregation": "seq_mean_token_mean",
    "clip_eps": 0.1,
    "clip_eps_high": 0.3,
    "dynamic_sampling": True,
    "dynamic_sampling_max_skipped": 4,
    "overlong_shaping": True,
    "overlong_max_tokens": 256,
    "overlong_buffer_tokens": 32,
    "overlong_penalty": 0.5,
    "recompute_old_logprobs": True,
    "correction": "tis",
    "correction_level": "sequence",
    "correction_low": 0.5,
    "correction_high": 1.5,
    "kl_coef": 0.01,
    "max_len": 512,
    "lora_r": 8,
    "adapters": "per_agent",
    "adapter_agents": "writer,checker",
    "device": "cpu",
    "dtype": "float32",
    "backend": "verl",
    "nproc": 2,
    "dist_timeout_s": 60.0,
    "shuffle_rewards": True,
    "publish_initial_version": True,
    "report_to": "none",
    "warmup_teacher": "teacher:teach",
    "warmup_steps": 7,
    "warmup_tasks": 9,
    "warmup_lr": 3e-5,
    "warmup_sql": "SELECT RolloutId FROM rollouts WHERE Reward = 1",
    "replay_sql": "SELECT RolloutId FROM rollouts",
    "replay_fraction": 0.5,
    "promote_if_better": True,
    "promote_margin": 0.05,
    "promote_confidence": 0.9,
    "tasks_sql": "SELECT TaskId FROM tasks",
    "source_store": "/tmp/fulmen-options-store",
}
# What a field's value needs beside it to be valid (the section's own cross-field checks).
NEEDS = {"adapters": {"adapter_agents": "writer,checker"}}


def command_line(values: dict) -> list[str]:
    args = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else f"--no-{flag[2:]}")
        else:
            args.append(f"{flag}={value}")
    return args


def parsed(args: list[str]) -> dict:
    """``fulmen train``'s arguments as Typer parses them (nothing runs)."""
    command = typer.main.get_command(app).commands["train"]
    return command.make_context("train", args).params


def test_every_field_has_a_value():
    assert set(VALUES) == set(TrainSection.model_fields)
    defaults = TrainSection().model_dump()
    assert [name for name, value in VALUES.items() if defaults[name] == value] == []


def test_the_help_lists_every_field_with_its_variable():
    result = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    for name in TrainSection.model_fields:
        assert f"--{name.replace('_', '-')}" in result.output, name
        assert f"FULMEN_TRAIN_{name.upper()}" in result.output, name
    assert "--model" in result.output and "--replay" in result.output  # the older names still work


@pytest.mark.parametrize("name", list(VALUES))
def test_each_option_sets_its_field_over_the_environment(name, monkeypatch):
    monkeypatch.setenv("FULMEN_TRAIN_STEPS", "99")
    values = {**NEEDS.get(name, {}), name: VALUES[name]}
    settings = TrainSettings(**TRAIN_OPTIONS.overrides(parsed(command_line(values))))
    got = getattr(settings.train, name)
    assert (got.value if hasattr(got, "value") else got) == VALUES[name]
    if name != "steps":
        assert settings.train.steps == 99  # a variable no option names stays in force


def test_an_option_naming_an_algorithm_fills_its_recipe(monkeypatch):
    monkeypatch.setenv("FULMEN_TRAIN_ALGORITHM", "grpo")
    settings = TrainSettings(**TRAIN_OPTIONS.overrides(parsed(["--algorithm", "dapo", "--overlong-max-tokens", "64"])))
    for name, value in ALGORITHMS.get("dapo").settings().items():
        assert getattr(settings.train, name) == value, name


def test_the_older_option_names_still_work():
    settings = TrainSettings(**TRAIN_OPTIONS.overrides(parsed(["--model", "tiny", "--replay", "SELECT 1"])))
    assert settings.train.model_path == "tiny" and settings.train.replay_sql == "SELECT 1"


def test_options_left_out_change_nothing(monkeypatch):
    monkeypatch.setenv("FULMEN_TRAIN_GROUP_SIZE", "6")
    assert TRAIN_OPTIONS.overrides(parsed([])) == {}
    assert TrainSettings(**TRAIN_OPTIONS.overrides(parsed([]))).train.group_size == 6


def test_a_relaunched_rank_gets_the_whole_section(monkeypatch):
    values = {name: value for name, value in VALUES.items() if name not in ("adapters", "backend")}
    monkeypatch.setenv("FULMEN_TRAIN_SEED", "123")  # overridden by --seed: must not reach the rank
    parent = TrainSettings(**TRAIN_OPTIONS.overrides(parsed(command_line(values))))
    environ = relaunch_environment(parent, {"FULMEN_TRAIN_SEED": "123", "FULMEN_HOME": "/tmp/h", "PATH": "/bin"})
    assert not [name for name in environ if name.startswith("FULMEN_TRAIN_")]
    assert environ["FULMEN_HOME"] == "/tmp/h" and environ["PATH"] == "/bin"
    monkeypatch.delenv("FULMEN_TRAIN_SEED")
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    rank = TrainSettings()  # as the rank loads it, with no option on its command line
    assert rank.train.model_dump() == parent.train.model_dump()
    assert rank.train.seed == 7 and rank.train.run_id == "run-options-1"


def test_a_bad_value_is_refused_with_the_option_named():
    result = CliRunner().invoke(app, ["train", "--dataset", "x.jsonl", "--group-size", "0"])
    assert result.exit_code == 1
    assert "group_size" in result.output
