"""How fast the demo's model learns the untaught wordings, in one process: a study of the GRPO settings.

The demo (``fulmen demo``) learns one thing from the reward: which operator each untaught wording means. This
bench replays that decision without the system around it, so settings can be compared over several seeds in
minutes: it samples call 1 of the demo's agent (the ``calc`` tool call) from the warmed-up model with Hugging
Face ``generate`` (temperature 1, groups of 8 on 12 training questions a step, the demo's order), scores it 1
when the expression is the right one, takes group-normalised advantages (``compute_advantages("grpo")``) and
trains with the demo's trainer (:class:`TorchTrainer`: PPO-clip 0.2, k3 KL to the warmed-up model, lr 1e-3).
Every ``--every`` steps, greedy accuracy on the demo's 48 held-out questions.

What it leaves out: call 2 (copying the tool's result, already learnt by the warm-up), the asynchrony (the
system trains on rollouts up to one version old) and the LLM gateway's sampler. So it is faster than the demo
(~2-3 s a step here against ~20 s) and its curves run a little ahead of the demo's; use it to compare settings,
then check the winner with ``fulmen demo``.

    .venv/bin/python bench/demo_learning.py [--steps 25] [--seeds 1,2,3] [--epochs 1,2] [--shuffle]

The warmed-up model is built (``fulmen.algorithm.demo.warmup``, ~5 min on 2 cores) or reused from
``--home`` (default: the e2e tests' cache, ``~/.cache/fulmen/test-models/demo-home``). Last line: one JSON object,
per setting (``epochs=N``) and seed, the held-out accuracy curve, the training reward per step, seconds per step,
and per setting the mean held-out accuracy at each evaluation.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fulmen.algorithm.batch import Sample
from fulmen.algorithm.demo.agent import TOOLS
from fulmen.algorithm.demo.run import DemoOptions
from fulmen.algorithm.demo.tasks import Problem, heldout_tasks, train_tasks
from fulmen.algorithm.demo.warmup import warm_up
from fulmen.algorithm.rl.advantages import compute_advantages
from fulmen.algorithm.service.dispatcher import DatasetTask
from fulmen.algorithm.trainer.torch_backend import TorchTrainer, TorchTrainerConfig

EXPR = re.compile(r'"expr": "([^"]*)"')
CALL_TOKENS = 40


class Replay:
    """One training run of the operator choice."""

    def __init__(self, model: Path, seed: int, epochs: int, options: DemoOptions, shuffle: bool) -> None:
        torch.manual_seed(seed)
        self.options, self.shuffle = options, shuffle
        self.trainer = TorchTrainer(
            TorchTrainerConfig(
                model_path=model,
                device="cpu",
                dtype="float32",
                lr=options.lr,
                micro_batch_size=32,
                seed=seed,
                kl_coef=options.kl_coef,
                clip_eps=0.2,
                epochs_per_batch=epochs,
            )
        )
        self.tokenizer = self.trainer.tokenizer
        self.pad = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        )

    def _prompt(self, question: str) -> list[int]:
        messages = [{"role": "user", "content": question}]
        text = self.tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def sample(self, questions: list[str], greedy: bool, n: int = 1) -> list[tuple[list[int], list[int], str]]:
        """(prompt ids, response ids up to and with EOS, response text) for each question ``n`` times."""
        rows = [self._prompt(q) for q in questions for _ in range(n)]
        width = max(map(len, rows))
        ids = torch.tensor([[self.pad] * (width - len(r)) + r for r in rows])  # left padding for generate
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
        model = self.trainer.model
        model.eval()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=CALL_TOKENS,
                pad_token_id=self.pad,
                eos_token_id=self.tokenizer.eos_token_id,
                **sampling,
            )
        model.train()
        eos = self.tokenizer.eos_token_id
        responses = [r[: r.index(eos) + 1] if eos in r else r for r in out[:, width:].tolist()]
        return [(p, r, self.tokenizer.decode(r)) for p, r in zip(rows, responses, strict=True)]

    def accuracy(self, problems: list[Problem]) -> float:
        answers = self.sample([p.question for p in problems], greedy=True)
        return sum(_expr(text) == p.expr for p, (_, _, text) in zip(problems, answers, strict=True)) / len(problems)

    def step(self, problems: list[Problem]) -> float:
        """One GRPO step on ``problems`` (a group each); the mean reward."""
        size = self.options.group_size
        answers = self.sample([p.question for p in problems], greedy=False, n=size)
        rewards = torch.tensor(
            [float(_expr(text) == problems[i // size].expr) for i, (_, _, text) in enumerate(answers)]
        )
        if self.shuffle:  # the demo's control: rewards permuted within the step
            rewards = rewards[torch.randperm(len(rewards))]
        groups = torch.arange(len(answers)) // size
        advantages = compute_advantages("grpo", rewards, groups)
        self.trainer.step(
            [
                Sample(prompt_token_ids=p, response_token_ids=r, advantage=float(a))
                for (p, r, _), a in zip(answers, advantages, strict=True)
            ]
        )
        return float(rewards.mean())


def _expr(text: str) -> str | None:
    found = EXPR.search(text)
    return found.group(1) if found else None


def run(model: Path, seed: int, epochs: int, args: argparse.Namespace, options: DemoOptions) -> dict[str, Any]:
    replay = Replay(model, seed, epochs, options, args.shuffle)
    held = _problems(heldout_tasks(options.heldout, warmup_count=options.warmup.steps * options.warmup.batch))
    train = _problems(train_tasks(args.steps * options.groups_per_step))  # the demo's first tasks, in its order
    accuracy, rewards, began = [[0, replay.accuracy(held)]], [], time.monotonic()
    for step in range(1, args.steps + 1):
        chunk = train[(step - 1) * options.groups_per_step : step * options.groups_per_step]
        rewards.append(round(replay.step(chunk), 4))
        if step % args.every == 0:
            accuracy.append([step, replay.accuracy(held)])
        print(
            f"epochs={epochs} seed={seed} step {step}: reward {rewards[-1]:.3f}"
            + (f" held-out {accuracy[-1][1]:.3f}" if step % args.every == 0 else ""),
            file=sys.stderr,
        )
    seconds = (time.monotonic() - began) / args.steps
    return {
        "seed": seed,
        "accuracy": [[s, round(a, 4)] for s, a in accuracy],
        "reward": rewards,
        "s_per_step": round(seconds, 2),
    }


def _problems(tasks: list[DatasetTask]) -> list[Problem]:
    problems = []
    for task in tasks:
        a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)", task.input["expr"]).groups()
        problems.append(Problem(task.input["question"], int(a), int(b), op, ""))
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--every", type=int, default=5, help="held-out accuracy every N steps")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--epochs", default="1,2", help="PPO passes a step to compare (the demo's epochs_per_batch)")
    parser.add_argument("--shuffle", action="store_true", help="the control: rewards permuted within each step")
    parser.add_argument("--home", type=Path, default=Path.home() / ".cache" / "fulmen" / "test-models" / "demo-home")
    args = parser.parse_args()
    options = DemoOptions()
    model = warm_up(args.home / "demo-warmup", options.warmup)
    result: dict[str, Any] = {"steps": args.steps, "shuffle": args.shuffle, "model": str(model), "settings": {}}
    for epochs in (int(e) for e in args.epochs.split(",")):
        runs = [run(model, int(seed), epochs, args, options) for seed in args.seeds.split(",")]
        mean = [
            [point[0], round(statistics.fmean(r["accuracy"][k][1] for r in runs), 4)]
            for k, point in enumerate(runs[0]["accuracy"])
        ]
        result["settings"][f"epochs={epochs}"] = {"mean_accuracy": mean, "runs": runs}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
