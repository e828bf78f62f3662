"""Per-call credit, broadcast against anchor (issue 17), on the demo task and the calc example, in one process.

Both strategies start from the same warmed-up model and sample with the same seeds (the LLM gateway's sampler,
``producers/llm_gateway/backends/sampling.py``, one seed per row), so step 1's episodes are identical and the
runs differ only by how the calls were credited. Each step: ``--groups-per-step`` tasks x ``--group-size``
episodes at temperature 1 -> one ``TransitionBatch`` per episode -> Fulmen's own trainer path
(``credit_groups`` with the strategy, ``build_samples`` with GRPO advantages, the episode scope and, for
``anchor``, the step advantages ``TrainSection(credit="anchor").step_advantage_weight`` turns on) -> one update
of :class:`TorchTrainer`. Held-out accuracy: greedy episodes, mean reward, before step 1 and after every
``--every`` steps.

Tasks (both multi-call, so ``anchor`` differs from ``broadcast``):

* ``demo`` (``fulmen.algorithm.demo``): the demo agent's two calls, call 1 the ``calc`` tool call (its prompt is
  the question: the same state for the whole group), call 2 the answer after the tool's result (the same state
  for the rollouts that made the same call). The warmed-up tiny model (``fulmen.algorithm.demo.warmup``, ~3 min,
  cached in ``--home``), the demo's training order and 48 held-out questions, its trainer settings (lr 1e-3,
  two PPO passes, k3 KL 0.1). As in ``bench/demo_learning.py`` (whose helpers it reuses) the system around it is
  left out; unlike it, both calls are sampled and trained. A call-1 reply whose expression is not
  ``<int><op><int>`` ends the episode with reward 0 (the real agent would evaluate any safe expression).
* ``calc_agent`` (``examples/calc_agent``): the calc agent's conversation as AutoGen sends it, up to two
  calculator rounds and a reflection call (``bench/gpu_scenarios.py``'s episode runner, warm-up samples and
  accuracy, reused). The tiny model with BPE merges learnt from the teacher's conversations, warmed up for
  ``--calc-warmup-steps`` supervised steps on the teacher's replies (training tasks only; cached in ``--home``).

    .venv/bin/python bench/credit.py [--steps 12] [--calc-steps 8] [--seed 0] [--tasks demo,calc_agent]
        [--demo-warmup-steps 600] [--demo-groups 12] [--calc-warmup-steps 300] [--threads 1] [--warmup-only]

On shared cores keep ``--threads 1`` (two torch threads spun for each other there, ~8x slower). The warm-ups
are cached in ``--home``; ``--warmup-only`` builds them and stops, so that a timed run measures only training.

Last line: one JSON object keyed by strategy (``broadcast``, ``anchor``). Each holds the calc example's figures
at its top level (``reward_by_step``, ``heldout_before``, ``heldout_after``, ``heldout_by_step`` as
``[step, accuracy]`` pairs, ``calls_per_episode``, ``s_per_step``) and the demo's under ``"demo"`` (the same
keys); ``"about"`` records the settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import demo_learning  # noqa: E402  (bench/: the demo replay's helpers)
import gpu_scenarios as calc_bench  # noqa: E402  (bench/: the calc episode runner, its warm-up and accuracy)
import torch  # noqa: E402

from fulmen.algorithm.batch import Sample  # noqa: E402
from fulmen.algorithm.demo.agent import ANSWER_TOKENS, CALL_TOKENS  # noqa: E402
from fulmen.algorithm.demo.run import DemoOptions  # noqa: E402
from fulmen.algorithm.demo.tasks import Problem, apply, heldout_tasks, train_tasks  # noqa: E402
from fulmen.algorithm.demo.warmup import conversation_samples, warm_up  # noqa: E402
from fulmen.algorithm.service.groups import ClosedGroup, credit_groups  # noqa: E402
from fulmen.algorithm.service.samples import build_samples  # noqa: E402
from fulmen.algorithm.settings import TrainSection  # noqa: E402
from fulmen.algorithm.trainer.torch_backend import TorchTrainer, TorchTrainerConfig  # noqa: E402
from fulmen.schemas.events import RolloutMode, RolloutStatus, Transition, TransitionBatch  # noqa: E402

STRATEGIES = ("broadcast", "anchor")
SAMPLING = calc_bench.SAMPLING
CALL = re.compile(r"(\d+)([-+*])(\d+)")
INTEGER = re.compile(r"-?\d+")
Episodes = tuple[list[float], list[list[Sample]]]  # rewards, and each episode's calls (prompt, response, logprobs)


@dataclass(frozen=True)
class Setup:
    """One task's run: its model, trainer settings, tasks, and how to play its episodes."""

    model: Path
    lr: float
    kl_coef: float
    epochs: int
    group_size: int
    groups_per_step: int
    steps: int
    train: list[Any]
    heldout: list[Any]
    runner: Callable[[TorchTrainer], Any]  # -> an object with run(tasks, temperature, seed) -> Episodes
    accuracy: Callable[[Any, list[Any]], float]


class DemoEpisodes:
    """The demo agent's episode (``fulmen.algorithm.demo.agent``), both calls sampled with the gateway's sampler
    and rendered as the warm-up renders them (``conversation_samples``)."""

    def __init__(self, trainer: TorchTrainer) -> None:
        self.trainer, self.tokenizer, self.pad = trainer, trainer.tokenizer, trainer.pad_id
        self.eos = {self.tokenizer.eos_token_id}

    def _sample(self, prompts: list[list[int]], tokens: int, temperature: float, seeds: list[int]) -> list[Any]:
        rows = [SAMPLING.Row(p, tokens, temperature=temperature, seed=s) for p, s in zip(prompts, seeds, strict=True)]
        self.trainer.model.eval()
        try:
            return SAMPLING.generate(self.trainer.model, rows, self.pad, self.eos)
        finally:
            self.trainer.model.train()

    def run(self, problems: list[Problem], temperature: float, seed: int) -> Episodes:
        first = [conversation_samples(p, self.tokenizer)[0].prompt_token_ids for p in problems]
        seeds = [seed * 1_000_003 + i * 31 for i in range(len(problems))]
        calls = [
            [Sample(p, o.token_ids, old_logprobs=o.logprobs)]
            for p, o in zip(first, self._sample(first, CALL_TOKENS, temperature, seeds), strict=True)
        ]
        rewards = [0.0] * len(problems)
        second: list[tuple[int, list[int]]] = []
        for i, (problem, episode) in enumerate(zip(problems, calls, strict=True)):
            found = CALL.fullmatch(demo_learning._expr(self.tokenizer.decode(episode[0].response_token_ids)) or "")
            if found is not None:
                shown = Problem(problem.question, int(found.group(1)), int(found.group(3)), found.group(2), "")
                second.append((i, conversation_samples(shown, self.tokenizer, shown.op)[1].prompt_token_ids))
        if second:
            outputs = self._sample(
                [p for _, p in second], ANSWER_TOKENS, temperature, [seeds[i] + 1 for i, _ in second]
            )
            for (i, prompt), out in zip(second, outputs, strict=True):
                calls[i].append(Sample(prompt, out.token_ids, old_logprobs=out.logprobs))
                found = INTEGER.search(self.tokenizer.decode(out.token_ids, skip_special_tokens=True))
                rewards[i] = float(
                    found is not None and int(found.group()) == apply(problems[i].a, problems[i].op, problems[i].b)
                )
        return rewards, calls


def _demo_accuracy(episodes: DemoEpisodes, problems: list[Problem]) -> float:
    rewards, _ = episodes.run(problems, temperature=0.0, seed=0)
    return sum(rewards) / len(rewards)


def demo_setup(args: argparse.Namespace) -> Setup:
    demo = DemoOptions()
    steps = args.demo_warmup_steps
    options = dataclasses.replace(
        demo, warmup=dataclasses.replace(demo.warmup, steps=steps), groups_per_step=args.demo_groups
    )
    cache = "demo-warmup" if steps == demo.warmup.steps else f"demo-warmup-{steps}"  # the demo's own: shared
    model = warm_up(args.home / cache, options.warmup)
    held = demo_learning._problems(
        heldout_tasks(options.heldout, warmup_count=options.warmup.steps * options.warmup.batch)
    )
    train = demo_learning._problems(train_tasks(args.steps * options.groups_per_step))  # the demo's order
    return Setup(
        model,
        options.lr,
        options.kl_coef,
        options.epochs_per_batch,
        options.group_size,
        options.groups_per_step,
        args.steps,
        train,
        held,
        DemoEpisodes,
        _demo_accuracy,
    )


def calc_setup(args: argparse.Namespace) -> Setup:
    model = _calc_model(args)
    skip = args.calc_warmup_tasks  # the warm-up's demonstrated tasks come first; GRPO trains on the next ones
    train = calc_bench.train_tasks(skip + args.calc_steps * args.calc_groups)[skip:]
    return Setup(
        model,
        args.calc_lr,
        0.1,
        2,
        args.calc_group_size,
        args.calc_groups,
        args.calc_steps,
        train,
        calc_bench.heldout_tasks(args.calc_heldout),
        lambda t: calc_bench.Episodes(t, args.calc_max_tokens),
        lambda episodes, tasks: calc_bench.accuracy(episodes, tasks, 64),
    )


def _calc_model(args: argparse.Namespace) -> Path:
    """The tiny model, BPE merges learnt from the teacher's calc conversations, warmed up on them (cached)."""
    from fulmen.algorithm.tiny_model import TinyModelConfig, build_tiny_model, build_tiny_tokenizer

    home = args.home / "credit-calc" / f"warmup-{args.calc_warmup_steps}-{args.calc_warmup_tasks}"
    target = home / "model"
    if (target / "config.json").is_file():
        return target
    tasks = calc_bench.train_tasks(args.calc_warmup_tasks)
    plain = build_tiny_tokenizer()
    plain.chat_template = calc_bench.TEMPLATE
    shown = calc_bench.demonstrations(_Renderer(plain), tasks)
    corpus = [plain.decode([*s.prompt_token_ids, *s.response_token_ids]) for s in shown]
    base = build_tiny_model(
        home / "base", TinyModelConfig(num_attention_heads=8, num_key_value_heads=8, bpe_vocab_size=1024), corpus=corpus
    )
    trainer = TorchTrainer(
        TorchTrainerConfig(model_path=base, device="cpu", dtype="float32", lr=3e-3, micro_batch_size=64, seed=0)
    )
    samples = calc_bench.demonstrations(calc_bench.Episodes(trainer, args.calc_max_tokens), tasks)
    rng = random.Random(0)
    for step in range(args.calc_warmup_steps):
        loss = trainer.sft_step(rng.sample(samples, 32)).loss
        if (step + 1) % 50 == 0:
            print(f"calc warm-up {step + 1}/{args.calc_warmup_steps}: loss {loss:.3f}", file=sys.stderr)
    trainer.save(target)
    return target


@dataclass(frozen=True)
class _Renderer:
    """What ``gpu_scenarios.demonstrations`` reads of its episode runner: the tokenizer and the end ids."""

    tokenizer: Any

    @property
    def eos(self) -> set[int]:
        return {self.tokenizer.eos_token_id}


def _groups(step: int, rewards: Sequence[float], calls: Sequence[list[Sample]], size: int) -> list[ClosedGroup]:
    """The step's episodes as the collector hands them to the trainer: one TransitionBatch each, by task."""
    groups = []
    for g in range(len(rewards) // size):
        name = f"s{step}-g{g}"
        batches = tuple(_batch(f"{name}-r{r}", name, rewards[r], calls[r]) for r in range(g * size, (g + 1) * size))
        groups.append(ClosedGroup(name, name, RolloutMode.TRAIN, size, batches))
    return groups


def _batch(rollout: str, group: str, reward: float, calls: list[Sample]) -> TransitionBatch:
    transitions = [
        Transition(
            rollout_id=rollout,
            attempt=1,
            index=i,
            trace_id="0" * 32,
            span_id=f"{i + 1:016x}",
            prompt_token_ids=list(c.prompt_token_ids),
            response_token_ids=list(c.response_token_ids),
            response_logprobs=list(c.old_logprobs) if c.old_logprobs else None,
        )
        for i, c in enumerate(calls)
        if c.response_token_ids
    ]
    return TransitionBatch(
        rollout_id=rollout,
        attempt=1,
        task_id=group,
        group_id=group,
        status=RolloutStatus.SUCCEEDED,
        episode_reward=reward,
        transitions=transitions,
    )


def train(setup: Setup, strategy: str, seed: int, every: int, label: str) -> dict[str, Any]:
    """One run of ``strategy`` on ``setup``: reward per step and held-out accuracy."""
    torch.manual_seed(seed)
    trainer = TorchTrainer(
        TorchTrainerConfig(
            model_path=setup.model,
            device="cpu",
            dtype="float32",
            lr=setup.lr,
            micro_batch_size=32,
            seed=seed,
            kl_coef=setup.kl_coef,
            clip_eps=0.2,
            epochs_per_batch=setup.epochs,
        )
    )
    episodes = setup.runner(trainer)
    weight = TrainSection(credit=strategy).step_advantage_weight
    before = setup.accuracy(episodes, setup.heldout)
    heldout, rewards, calls_made, began = [[0, round(before, 4)]], [], [], time.monotonic()
    for step in range(1, setup.steps + 1):
        chunk = setup.train[(step - 1) * setup.groups_per_step : step * setup.groups_per_step]
        tasks = [t for t in chunk for _ in range(setup.group_size)]
        got, calls = episodes.run(tasks, temperature=1.0, seed=seed * 7919 + step)
        groups = credit_groups(_groups(step, got, calls, setup.group_size), strategy)
        trainer.step(build_samples(groups, estimator="grpo", step_weight=weight).samples)
        rewards.append(round(sum(got) / len(got), 4))
        calls_made.append(round(sum(map(len, calls)) / len(calls), 3))
        if step % every == 0 or step == setup.steps:
            heldout.append([step, round(setup.accuracy(episodes, setup.heldout), 4)])
        print(
            f"{label} {strategy} step {step}: reward {rewards[-1]:.3f} calls {calls_made[-1]:.2f} held-out "
            f"{heldout[-1][1]:.3f}",
            file=sys.stderr,
        )
    return {
        "reward_by_step": rewards,
        "heldout_before": round(before, 4),
        "heldout_after": heldout[-1][1],
        "heldout_by_step": heldout,
        "calls_per_episode": calls_made,
        "s_per_step": round((time.monotonic() - began) / setup.steps, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="demo,calc_agent")
    parser.add_argument("--steps", type=int, default=12, help="demo GRPO steps per strategy")
    parser.add_argument(
        "--demo-groups", type=int, default=12, help="demo tasks per step (the demo's 12: four of each untaught wording)"
    )
    parser.add_argument(
        "--demo-warmup-steps",
        type=int,
        default=600,
        help="the demo's supervised warm-up (600, ~3 min on 2 free cores; cached in --home)",
    )
    parser.add_argument("--every", type=int, default=2, help="held-out accuracy every N steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calc-steps", type=int, default=8)
    parser.add_argument("--calc-groups", type=int, default=8, help="calc tasks per step")
    parser.add_argument("--calc-group-size", type=int, default=4)
    parser.add_argument("--calc-heldout", type=int, default=32)
    parser.add_argument("--calc-lr", type=float, default=1e-3)
    parser.add_argument("--calc-max-tokens", type=int, default=48)
    parser.add_argument("--calc-warmup-steps", type=int, default=300)
    parser.add_argument("--calc-warmup-tasks", type=int, default=2000)
    parser.add_argument("--home", type=Path, default=Path.home() / ".cache" / "fulmen" / "test-models" / "demo-home")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (on shared cores two threads spin "
        "for each other: a demo warm-up step took 10 s with two, 1.2 s with one, load 8)",
    )
    parser.add_argument("--warmup-only", action="store_true", help="build (or find) the warmed-up models, then stop")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    chosen = args.tasks.split(",")
    began = time.monotonic()
    setups = {name: build(args) for name, build in (("demo", demo_setup), ("calc_agent", calc_setup)) if name in chosen}
    if args.warmup_only:
        print(json.dumps({name: str(setup.model) for name, setup in setups.items()}))
        return
    report: dict[str, Any] = {s: {} for s in STRATEGIES}
    for name, setup in setups.items():
        for strategy in STRATEGIES:
            result = train(setup, strategy, args.seed, args.every, name)
            if name == "calc_agent":
                report[strategy].update(result)
            else:
                report[strategy][name] = result
    report["about"] = {
        "layout": "per strategy: the calc example's figures at the top, the demo's under 'demo'",
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "wall_s": round(time.monotonic() - began, 1),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
