"""What an example declares so that one driver (``examples.train``) can train it: :class:`Example`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Example", "write_splits", "write_splits_command"]

TaskInputs = Callable[[int], list[dict[str, Any]]]
Teacher = Callable[[dict[str, Any], list[dict[str, Any]]], Any]  # (task, messages) -> fulmen.testing.Reply


@dataclass(frozen=True)
class Example:
    """One example: its agent, its data, and the settings that train it.

    ``train_tasks(n)`` / ``heldout_tasks(n)``: the first ``n`` task inputs of the training and of the held-out split
    (fixed seeds; no held-out question is in the training split; held-out inputs carry ``"greedy": true`` so the
    agent samples greedily there). ``unseen_tasks(n)``: a second held-out split whose problems differ in shape from
    everything training and the warm-up touch (template families, schemas or corpus regions never trained on), also
    greedy; None where an example has none. Every task input names its ``"template"`` (the family or question type
    it was drawn from), what the benchmarks break results down by. ``agent_pattern`` selects the calls that become
    transitions (``FULMEN_TRANSITIONS_AGENT_PATTERN``, ``re.fullmatch`` on the agent name; None keeps every call);
    ``trained_agents`` are the names it keeps. ``credit`` / ``gamma`` are the trainer's credit assignment.
    ``max_calls`` bounds the LLM calls of one episode. ``teacher(task, messages)`` is the reply a perfect model
    gives at that point of an episode (:mod:`fulmen.warmup` records its demonstrations for a warm-up).
    """

    name: str
    framework: str
    agent: str  # module:function the runners run
    train_tasks: TaskInputs
    heldout_tasks: TaskInputs
    trained_agents: tuple[str, ...]
    max_calls: int
    agent_pattern: str | None = None
    credit: str = "broadcast"
    gamma: float = 1.0
    teacher: Teacher | None = None
    unseen_tasks: TaskInputs | None = None
    failure_kind: Callable[[dict[str, Any], Any], str] | None = None  # (task, outcomes.Episode) -> a failure kind


def write_splits(
    out: Path, train: Sequence[dict[str, Any]], heldout: Sequence[dict[str, Any]], unseen: Sequence[dict[str, Any]] = ()
) -> None:
    """``out/train.jsonl`` and ``out/val.jsonl`` (and ``out/unseen.jsonl`` when there are unseen tasks), one task
    input a line: Fulmen's task-file format, what ``fulmen train --dataset out/train.jsonl --val out/val.jsonl``
    reads."""
    out.mkdir(parents=True, exist_ok=True)
    splits = (("train.jsonl", train), ("val.jsonl", heldout)) + ((("unseen.jsonl", unseen),) if unseen else ())
    for name, items in splits:
        (out / name).write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")


def write_splits_command(
    name: str,
    train_tasks: TaskInputs,
    heldout_tasks: TaskInputs,
    argv: list[str] | None = None,
    unseen_tasks: TaskInputs | None = None,
) -> None:
    """``python -m examples.<name>.data OUT_DIR [--train N] [--val N] [--unseen N]``."""
    parser = argparse.ArgumentParser(description=f"write the {name} example's task files (train.jsonl, val.jsonl)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--train", type=int, default=256)
    parser.add_argument("--val", type=int, default=64)
    parser.add_argument("--unseen", type=int, default=0, help="problems of the unseen-shapes split (unseen.jsonl)")
    args = parser.parse_args(argv)
    if args.unseen and unseen_tasks is None:
        parser.error(f"the {name} example has no unseen-shapes split")
    unseen = unseen_tasks(args.unseen) if unseen_tasks is not None and args.unseen else []
    write_splits(args.out, train_tasks(args.train), heldout_tasks(args.val), unseen)
    print(f"wrote {args.train} training, {args.val} held-out and {len(unseen)} unseen-shape tasks to {args.out}")
