"""The demo's starting model: the tiny model, fine-tuned on two-call conversations that explain half the wordings.

:func:`warm_up` builds the tiny model (``fulmen.algorithm.tiny_model``; its BPE merges learnt from rendered demo
conversations, so a prompt is ~60-90 tokens instead of ~180-250 bytes) and runs ``WarmupPlan.steps``
supervised steps (``TorchTrainer.sft_step``) on episodes rendered with the chat template exactly as the LLM
gateway renders the agent's calls: for each problem two samples, ``(prompt of call 1, tool call +
<|im_end|>)`` and ``(prompt of call 2, result + <|im_end|>)``.

A warm-up episode uses the right operator when its wording is one of ``tasks.TAUGHT`` (one per operator) and a
random one otherwise (the tool's result and the answer follow from it). So the warm-up teaches the protocol —
call ``calc`` with the question's two numbers, then answer with the tool's result — and that the wording picks
the operator, but not what the other wordings mean: on the held-out set (those only) accuracy starts near one
in three, and what they mean is what GRPO learns from the reward alone. Measured: with every operator random,
GRPO did not learn it in 30 steps (nothing in the model read the wording yet); a single verb as the only cue
was learnt too slowly, by the warm-up and by GRPO alike. Measured on 2 cores: copying the numbers
into the call is learnt after ~400 steps of 16, copying the result into the answer later.
The result is cached: a directory whose ``warmup.json`` records the same recipe (plan, model shape, task,
chat template) is reused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from fulmen.algorithm.batch import Sample
from fulmen.algorithm.demo.agent import TOOLS
from fulmen.algorithm.demo.tasks import (
    A_RANGE,
    B_RANGE,
    CORPUS_SEED,
    OPERATORS,
    TAUGHT,
    WORDINGS,
    Problem,
    apply,
    generate,
    warmup_problems,
)

__all__ = ["WarmupPlan", "conversation_samples", "conversation_text", "warm_up"]

log = logging.getLogger(__name__)

MARKER = "warmup.json"


@dataclass(frozen=True)
class WarmupPlan:
    """``steps`` SFT updates of ``batch`` episodes (2 samples each) at learning rate ``lr``; the model's shape
    (``hidden``, ``layers``, ``heads``) and BPE vocabulary (``vocab``, learnt from ``corpus`` episodes)."""

    steps: int = 600
    batch: int = 16
    lr: float = 3e-3
    hidden: int = 128
    layers: int = 4
    heads: int = 8
    vocab: int = 512
    corpus: int = 2000
    seed: int = 0


def _messages(problem: Problem, op: str) -> tuple[list[dict], list[dict], str, str]:
    """(call-1 messages, call-2 messages, tool call text, answer) of an episode of ``problem`` using ``op``."""
    expr, result = f"{problem.a}{op}{problem.b}", str(apply(problem.a, op, problem.b))
    user = [{"role": "user", "content": problem.question}]
    call = {"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": {"expr": expr}}}
    after = [
        *user,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": result},
    ]
    tool_call = '<tool_call>{"name": "calc", "arguments": {"expr": "' + expr + '"}}</tool_call>'
    return user, after, tool_call, result


def conversation_samples(problem: Problem, tokenizer, op: str | None = None) -> list[Sample]:
    """The two supervised samples of one episode of ``problem`` that uses ``op`` (default: the right one)."""
    user, after, tool_call, result = _messages(problem, op or problem.op)
    return [_sample(tokenizer, user, tool_call), _sample(tokenizer, after, result)]


def conversation_text(problem: Problem, tokenizer, op: str | None = None) -> str:
    """A whole episode rendered as one text (both calls and the final answer): the tokenizer's corpus."""
    _, after, _, result = _messages(problem, op or problem.op)
    return tokenizer.apply_chat_template(
        [*after, {"role": "assistant", "content": result}], tools=TOOLS, tokenize=False
    )


def _sample(tokenizer, messages: list[dict], reply: str) -> Sample:
    prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    response_ids = [*tokenizer(reply, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    return Sample(prompt_token_ids=prompt_ids, response_token_ids=response_ids)


def _shown_operator(problem: Problem, rng: random.Random) -> str:
    """The operator a warm-up episode uses: the right one for a wording in ``TAUGHT``, else one at random."""
    return problem.op if problem.wording in TAUGHT else rng.choice(OPERATORS)


def _recipe(plan: WarmupPlan) -> dict:
    from fulmen.algorithm.tiny_model import CHAT_TEMPLATE

    task = {"wordings": WORDINGS, "taught": sorted(TAUGHT), "ranges": [A_RANGE, B_RANGE], "tools": TOOLS}
    recipe = {**asdict(plan), "task": task, "chat_template": hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()}
    return json.loads(json.dumps(recipe))


def warm_up(
    directory: Path, plan: WarmupPlan | None = None, on_step: Callable[[int, int, float], None] = lambda *_: None
) -> Path:
    """The warmed-up model directory ``directory/model`` (built, or reused when its recipe matches).

    ``on_step(step, steps, loss)`` after each supervised step (not called when the cache is reused).
    """
    from fulmen.algorithm.tiny_model import TinyModelConfig, build_tiny_model, build_tiny_tokenizer
    from fulmen.algorithm.trainer.torch_backend import TorchTrainer, TorchTrainerConfig

    plan = plan or WarmupPlan()
    target = directory / "model"
    marker = target / MARKER
    recipe = _recipe(plan)
    if marker.is_file() and json.loads(marker.read_text()) == recipe:
        log.info("reusing the warmed-up model at %s", target)
        return target
    rng = random.Random(plan.seed)
    plain = build_tiny_tokenizer()
    corpus = [conversation_text(p, plain, rng.choice(OPERATORS)) for p in generate(plan.corpus, CORPUS_SEED)]
    shape = TinyModelConfig(
        hidden_size=plan.hidden,
        num_hidden_layers=plan.layers,
        num_attention_heads=plan.heads,
        num_key_value_heads=plan.heads,
        intermediate_size=4 * plan.hidden,
        bpe_vocab_size=plan.vocab,
        seed=plan.seed,
    )
    base = build_tiny_model(directory / "base", shape, corpus=corpus)
    trainer = TorchTrainer(
        TorchTrainerConfig(
            model_path=base, device="cpu", dtype="float32", lr=plan.lr, micro_batch_size=64, seed=plan.seed
        )
    )
    problems = warmup_problems(plan.steps * plan.batch)
    rng.shuffle(problems)
    for step in range(plan.steps):
        chunk = problems[step * plan.batch : (step + 1) * plan.batch]
        samples = [s for p in chunk for s in conversation_samples(p, trainer.tokenizer, _shown_operator(p, rng))]
        metrics = trainer.sft_step(samples)
        on_step(step + 1, plan.steps, metrics.loss)
        if (step + 1) % 50 == 0:
            log.info("warm-up step %d/%d: loss %.4f", step + 1, plan.steps, metrics.loss)
    trainer.save(target)
    marker.write_text(json.dumps(recipe) + "\n")
    log.info("warmed up the tiny model in %d steps (last loss %.4f): %s", plan.steps, metrics.loss, target)
    return target
