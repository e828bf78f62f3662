"""The calc scenario on one GPU, in one process: held-out accuracy before and after ~8 minutes of GRPO.

A stock CUDA PyTorch machine has no Java (so no Kafka), no AutoGen and no pydantic: this script hands the pieces
to each other directly. It uses Fulmen's own code where that code runs on torch alone:

* the LLM gateway's sampler (``producers/llm_gateway/backends/sampling.py``: batched, per-row temperature,
  recording each sampled token's logprob) and its tool-call parser (``tool_calls.py``), loaded by file (their
  package imports the Kafka side);
* the chat template the gateway serves SmolLM2 with (``chatml-tools``, ``schemas/chat_template.py``);
* the credit strategies (``fulmen.algorithm.rl.credit``), the advantage estimators (``fulmen.algorithm.rl.advantages``)
  and the trainer (``fulmen.algorithm.trainer.torch_backend.TorchTrainer``: PPO-clip, token mean);
* the calc example's data, calculator, reward and teacher (``examples/calc_agent``).

What it does instead of the system: the episode is the calc agent's conversation as AutoGen AgentChat sends it
(the agent's system message and the user's question, the ``calculator`` tool, the tool's result, the reflection
call), generated here with the sampler; each call's prompt ids, response ids and logprobs are its transition
(the gateway records exactly these; the transitions consumer's trace-tree step is not needed when the calls are
known in process). A warm-up first (``--warmup-steps`` supervised steps on the teacher's replies in the same
conversations, training tasks only), then GRPO steps for ``--minutes``: ``--groups-per-step`` tasks x
``--group-size`` episodes at temperature 1, broadcast credit, GRPO advantages, one update. Held-out accuracy:
greedy episodes on ``--heldout`` held-out problems, before the GRPO steps and after.

The model: a Hugging Face directory (``--model``; SmolLM2-135M-Instruct made by ``bench/smollm2.py``). Its weights
(540 MB, or the 93 MB GGUF) exceed what one call may carry to the lent GPU machine (64 MiB): carry the GGUF in
two parts over two calls and join them there, or use ``--random-weights`` (SmolLM2's shapes from its
``config.json``, for speed and memory only; accuracy is then meaningless). ``--device cpu --tiny`` runs the
same code on Fulmen's tiny model here.

    python bench/gpu_scenarios.py --model DIR [--minutes 8] [--device cuda]

Prints one JSON line: heldout_before, heldout_after, steps, s_per_step, tokens/s, peak GPU memory, settings.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def _by_file(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


SAMPLING = _by_file("fulmen_sampling", ROOT / "producers" / "llm_gateway" / "backends" / "sampling.py")
TOOL_CALLS = _by_file("fulmen_tool_calls", ROOT / "producers" / "llm_gateway" / "tool_calls.py")
TEMPLATE = _by_file("fulmen_chat_template", ROOT / "schemas" / "chat_template.py").CHAT_TEMPLATE

from examples.calc_agent.calculator import CalcError, calculate, format_number  # noqa: E402
from examples.calc_agent.data import heldout_tasks, train_tasks  # noqa: E402
from examples.calc_agent.reward import reward as calc_reward  # noqa: E402
from fulmen.algorithm.batch import Sample  # noqa: E402
from fulmen.algorithm.rl.advantages import compute_advantages, encode_group_ids  # noqa: E402
from fulmen.algorithm.rl.credit import assign_credit  # noqa: E402
from fulmen.algorithm.trainer.torch_backend import TorchTrainer, TorchTrainerConfig  # noqa: E402

# The calc agent's request as AutoGen AgentChat 0.7 sends it (examples/calc_agent/agent.py: SYSTEM, the tool).
SYSTEM = "Solve the problem. Use the calculator tool for the arithmetic, then reply with the final number."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression exactly, e.g. 12*8-30.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"description": "expression", "title": "Expression", "type": "string"}},
                "required": ["expression"],
                "additionalProperties": False,
            },
            "strict": False,
        },
    }
]
MAX_TOOL_ROUNDS = 2


class Episodes:
    """Runs calc episodes in batches with the gateway's sampler; returns rewards and per-call samples."""

    def __init__(self, trainer: TorchTrainer, max_tokens: int) -> None:
        self.trainer = trainer
        self.tokenizer = trainer.tokenizer
        self.tokenizer.chat_template = TEMPLATE
        config = trainer.model.generation_config
        eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        self.eos = {e for e in [*eos, self.tokenizer.eos_token_id] if e is not None}
        self.pad = trainer.pad_id
        self.max_tokens = max_tokens

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def run(self, tasks: list[dict], temperature: float, seed: int) -> tuple[list[float], list[list[Sample]]]:
        """One episode per task (in one batch per call index): rewards, and each episode's calls as samples."""
        model = self.trainer.model
        model.eval()
        conversations = [
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": t["question"]}] for t in tasks
        ]
        calls: list[list[Sample]] = [[] for _ in tasks]
        answers = [""] * len(tasks)
        open_ = list(range(len(tasks)))
        for round_index in range(MAX_TOOL_ROUNDS + 1):
            if not open_:
                break
            prompts = [self.prompt_ids(conversations[i]) for i in open_]
            seeds = [seed * 1_000_003 + i * 31 + round_index for i in open_]
            rows = [
                SAMPLING.Row(p, self.max_tokens, temperature=temperature, seed=s)
                for p, s in zip(prompts, seeds, strict=True)
            ]
            outputs = SAMPLING.generate(model, rows, self.pad, self.eos)
            still = []
            for i, prompt, out in zip(open_, prompts, outputs, strict=True):
                calls[i].append(Sample(prompt, out.token_ids, old_logprobs=out.logprobs, group_id=str(i)))
                text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
                content, tool_calls = TOOL_CALLS.extract_tool_calls(text)
                if not tool_calls or round_index == MAX_TOOL_ROUNDS:
                    answers[i] = content
                    continue
                conversations[i].append({"role": "assistant", "content": None, "tool_calls": tool_calls})
                for call in tool_calls:
                    conversations[i].append(
                        {
                            "role": "tool",
                            "tool_call_id": call["id"],
                            "content": _calculator(call["function"]["arguments"]),
                        }
                    )
                still.append(i)
            open_ = still
        return [calc_reward(a, t["answer"]) for a, t in zip(answers, tasks, strict=True)], calls


def _calculator(arguments: str) -> str:
    try:
        return format_number(calculate(json.loads(arguments).get("expression", "")))
    except (CalcError, ValueError, AttributeError, TypeError) as exc:
        return f"error: {exc}"


def demonstrations(episodes: Episodes, tasks: list[dict]) -> list[Sample]:
    """The teacher's conversation for each task, as (prompt, reply) samples: the calculator call, then the
    number (examples/calc_agent/teacher.py's replies)."""
    samples = []
    for task in tasks:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": task["expression"]})},
        }
        result = format_number(calculate(task["expression"]))
        after = [
            *messages,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": result},
        ]
        for prompt_messages, reply in (
            (messages, {"role": "assistant", "content": None, "tool_calls": [call]}),
            (after, {"role": "assistant", "content": str(task["answer"])}),
        ):
            prompt = episodes.tokenizer.apply_chat_template(
                prompt_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
            )
            whole = episodes.tokenizer.apply_chat_template([*prompt_messages, reply], tools=TOOLS, tokenize=False)
            reply_ids = episodes.tokenizer(whole[len(prompt) :], add_special_tokens=False)["input_ids"]
            end = next(k for k, token in enumerate(reply_ids) if token in episodes.eos)
            samples.append(
                Sample(episodes.tokenizer(prompt, add_special_tokens=False)["input_ids"], reply_ids[: end + 1])
            )
    return samples


def grpo_samples(tasks: list[dict], rewards: list[float], calls: list[list[Sample]], group: int) -> list[Sample]:
    """Broadcast credit, GRPO advantages per task group (episode scope), one sample per call."""
    returns = torch.tensor(rewards, dtype=torch.float64)
    groups = encode_group_ids(i // group for i in range(len(tasks)))
    advantages = compute_advantages("grpo", returns, groups).tolist()
    samples = []
    for episode, (reward, advantage) in enumerate(zip(rewards, advantages, strict=True)):
        credited = assign_credit("broadcast", reward, [None] * len(calls[episode]))
        for sample, _ in zip(calls[episode], credited, strict=True):
            if sample.response_token_ids:
                samples.append(
                    Sample(
                        sample.prompt_token_ids,
                        sample.response_token_ids,
                        advantage=advantage,
                        old_logprobs=sample.old_logprobs,
                        group_id=str(episode // group),
                    )
                )
    return samples


def accuracy(episodes: Episodes, tasks: list[dict], batch: int) -> float:
    rewards = []
    for start in range(0, len(tasks), batch):
        rewards += episodes.run(tasks[start : start + batch], temperature=0.0, seed=0)[0]
    return sum(rewards) / len(rewards)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a Hugging Face model directory (SmolLM2-135M-Instruct)")
    parser.add_argument("--tiny", action="store_true", help="Fulmen's tiny model instead (a smoke test)")
    parser.add_argument("--random-weights", action="store_true", help="--model's config with random weights")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-step", type=int, default=16)
    parser.add_argument("--heldout", type=int, default=64)
    parser.add_argument("--warmup-steps", type=int, default=8)
    parser.add_argument("--warmup-tasks", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-steps", type=int, default=1000)
    args = parser.parse_args()
    model_dir = _model(args)
    device = torch.device(args.device)
    trainer = TorchTrainer(
        TorchTrainerConfig(
            model_path=model_dir, device=args.device, dtype="auto", lr=args.lr, micro_batch_size=16, seed=0
        )
    )
    episodes = Episodes(trainer, args.max_tokens)
    teach = demonstrations(episodes, train_tasks(args.warmup_tasks))
    for group in trainer.optimizer.param_groups:  # the warm-up: the same weights, ten times the learning rate
        group["lr"] = args.lr * 10
    for step in range(args.warmup_steps):
        trainer.sft_step(random.Random(step).sample(teach, min(len(teach), 32)))
    for group in trainer.optimizer.param_groups:
        group["lr"] = args.lr
    heldout = heldout_tasks(args.heldout)
    started = time.perf_counter()
    before = accuracy(episodes, heldout, 64)
    pool = train_tasks(100_000)
    steps, tokens, train_start, trained = 0, 0, time.perf_counter(), []
    while time.perf_counter() - train_start < args.minutes * 60 and steps < args.max_steps:
        tasks = [
            pool[(steps * args.groups_per_step + g) % len(pool)]
            for g in range(args.groups_per_step)
            for _ in range(args.group_size)
        ]
        rewards, calls = episodes.run(tasks, temperature=1.0, seed=steps + 1)
        samples = grpo_samples(tasks, rewards, calls, args.group_size)
        metrics = trainer.step(samples)
        tokens += metrics.input_tokens
        trained.append(round(sum(rewards) / len(rewards), 4))
        steps += 1
    train_s = time.perf_counter() - train_start
    after = accuracy(episodes, heldout, 64)
    report = {
        "scenario": "calc_agent",
        "model": str(model_dir),
        "random_weights": args.random_weights,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "heldout_before": round(before, 4),
        "heldout_after": round(after, 4),
        "steps": steps,
        "s_per_step": round(train_s / max(steps, 1), 2),
        "train_tokens_per_s": round(tokens / train_s, 1),
        "reward_by_step": trained,
        "wall_s": round(time.perf_counter() - started, 1),
        "peak_gpu_memory_gb": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if device.type == "cuda"
        else None,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "without_the_system": "no Kafka, store, gateways or runner here: the sampler, credit, advantages and trainer "
        "are called directly (module docstring)",
    }
    print(json.dumps(report))
    return 0


def _model(args: argparse.Namespace) -> Path:
    if args.tiny:
        from fulmen.algorithm.tiny_model import build_tiny_model

        return build_tiny_model(Path("/tmp/fulmen-gpu-scenarios-tiny"))
    if args.model is None:
        raise SystemExit("--model DIR (a Hugging Face directory) or --tiny")
    if not args.random_weights:
        return args.model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target = Path("/tmp/fulmen-gpu-scenarios-random")
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model)).save_pretrained(target)
    AutoTokenizer.from_pretrained(args.model).save_pretrained(target)
    return target


if __name__ == "__main__":
    sys.exit(main())
