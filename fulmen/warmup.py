"""The supervised warm-up before RL: demonstrations of an agent by a scripted teacher, taught to the model.

``fulmen train --warmup-teacher teacher:teach`` (``FULMEN_TRAIN_WARMUP_*``, ``fulmen.train(warmup_teacher=...)``)
and ``examples.train`` run it before the first GRPO step: :func:`warmed_model`.

A small model may never reach a reward with an agent's prompts (SmolLM2-135M-Instruct, zero-shot, solves none of
the three examples: it ignores the tools and writes prose), and GRPO learns nothing from a group whose rewards
are all equal. The usual remedy is a short supervised warm-up on demonstrations before RL. Here the
demonstrations come from the agent itself:

1. :func:`demonstrations` runs the REAL agent (its framework, prompts and tools; ``run(task, llm)`` called as the
   runner calls it) once per training task against a :class:`fulmen.testing.ScriptedOpenAI` whose replies come
   from the *teacher*, ``teach(task, messages) -> Reply``: what a perfect model would answer at that
   point of the conversation (it knows the task's gold answer). Episodes whose reward is not full are dropped.
2. Every recorded call becomes a :class:`~fulmen.algorithm.batch.Sample` exactly as the LLM gateway will see it:
   the request parsed by the gateway's own parser and rendered with the model's tokenizer and chat template (the
   prompt ids of a real call), and the teacher's reply as the model must write it: the text the chat template
   renders for that assistant turn (``<tool_call>`` blocks for tool calls) up to and including end-of-turn.
3. :func:`warm_up` fine-tunes the model on them (``TorchTrainer.sft_step``, cross-entropy on the replies only)
   and saves the result, cached by its recipe (examples, tasks, model files, template, steps, learning rate).

Held-out tasks are never demonstrated: pass training tasks only.

The other source of demonstrations is the store: ``--warmup-sql "SELECT RolloutId FROM ..."`` fine-tunes on the
calls of the stored rollouts a query selects (the rewarded episodes of an earlier run, production traffic a person
approved: :func:`stored_warm_up`), as stored, token ids and all. With both, the teacher's phase runs first.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import logging
import math
import os
import random
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fulmen.algorithm.batch import Sample
from fulmen.producers.llm_gateway.protocol import parse_chat
from fulmen.producers.runner.agent import LLMEndpoint, call_agent, load_agent
from fulmen.schemas.errors import ConfigurationError
from fulmen.testing import RecordedRequest, Reply, ScriptedOpenAI

__all__ = [
    "Demonstration",
    "Teaching",
    "WarmupPlan",
    "conversation_texts",
    "demonstrations",
    "end_token_ids",
    "reply_message",
    "samples_of",
    "stored_warm_up",
    "tiny_model_for",
    "warm_up",
    "warmed_model",
]

log = logging.getLogger(__name__)

FULL_REWARD = 0.999
"""A demonstration episode is kept when the agent's reward reaches this (a teacher reply the agent could not use
is a teacher bug, or a framework that behaves unexpectedly: either way not something to imitate)."""
MARKER = "warmup.json"


Teacher = Callable[[dict[str, Any], list[dict[str, Any]]], Reply]  # (task, messages so far) -> the reply


@dataclass(frozen=True)
class Teaching:
    """What a warm-up demonstrates: ``agent`` (``module:function``, run as the runner runs it) answered by
    ``teacher(task, messages)``, a perfect model's reply at that point of the episode (it may read the task's gold
    answer). ``name`` names it in logs and in the cache."""

    name: str
    agent: str
    teacher: Teacher


@dataclass(frozen=True)
class Demonstration:
    """One episode of the teacher: the task, the agent's reward, and each call (request body, teacher's reply)."""

    task: dict[str, Any]
    reward: float | None
    calls: list[tuple[dict[str, Any], Reply]]


@dataclass(frozen=True)
class WarmupPlan:
    """``steps`` supervised updates of ``batch`` samples each (drawn in turn from every demonstrated call), at
    learning rate ``lr``, micro-batches of ``micro_batch_size``; with ``token_budget`` instead as many updates as
    it takes to train on that many tokens (prompt and reply: what the decoder computes), the last one included
    (an equal-compute baseline to an RL run that trained on that many)."""

    steps: int = 40
    batch: int = 16
    lr: float = 2e-5
    micro_batch_size: int = 4
    seed: int = 0
    token_budget: int = 0

    def updates(self, batch_tokens: float) -> int:
        """The number of updates: ``steps``, or what ``token_budget`` buys at ``batch_tokens`` tokens a batch."""
        if self.token_budget <= 0:
            return self.steps
        return max(1, math.ceil(self.token_budget / max(batch_tokens, 1.0)))


def demonstrations(teaching: Teaching, tasks: Sequence[dict[str, Any]], concurrency: int = 8) -> list[Demonstration]:
    """Run the agent on each task against its teacher (module docstring); the full-reward episodes."""
    agent = load_agent(teaching.agent)
    teacher = teaching.teacher

    def script(request: RecordedRequest) -> Reply:
        index = int(request.path.split("/")[2])  # /task/<index>/v1/chat/completions
        return teacher(tasks[index], list(request.body.get("messages") or []))

    async def episodes(server: ScriptedOpenAI) -> list[float | None]:
        gate = asyncio.Semaphore(concurrency)

        async def one(index: int) -> float | None:
            llm = LLMEndpoint(base_url=server.url(f"/task/{index}"), model="teacher", api_key="teacher")
            async with gate:
                return await call_agent(agent, dict(tasks[index]), llm)

        return list(await asyncio.gather(*(one(i) for i in range(len(tasks)))))

    with ScriptedOpenAI(script) as server:
        rewards = asyncio.run(episodes(server))
        recorded = server.chat_requests()
    shown: list[Demonstration] = []
    for index, reward in enumerate(rewards):
        calls = [(r.body, r.reply) for r in recorded if r.path.startswith(f"/task/{index}/") and r.reply is not None]
        if reward is None or reward < FULL_REWARD:
            log.warning("%s: the teacher's episode on task %d got reward %s; left out", teaching.name, index, reward)
            continue
        shown.append(Demonstration(dict(tasks[index]), reward, calls))
    return shown


def reply_message(reply: Reply) -> dict[str, Any]:
    """The OpenAI assistant message of ``reply`` (what the agent's next request will carry back)."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for i, call in enumerate(reply.tool_calls)
        ]
    return message


def samples_of(shown: Sequence[Demonstration], tokenizer: Any, end_ids: set[int]) -> list[Sample]:
    """One supervised sample per demonstrated call, as the gateway renders it with ``tokenizer`` (whose
    ``chat_template`` is the one the gateway serves the model with); a reply ends at the first of ``end_ids``
    (the tokens the gateway stops generating at: the model's and the tokenizer's end-of-sequence ids)."""
    samples = []
    for demonstration in shown:
        for body, reply in demonstration.calls:
            request = parse_chat(body, max_n=1)
            prompt = tokenizer.apply_chat_template(
                request.messages, tools=request.tools, tokenize=False, add_generation_prompt=True
            )
            whole = tokenizer.apply_chat_template(
                [*request.messages, reply_message(reply)], tools=request.tools, tokenize=False
            )
            if not whole.startswith(prompt):
                raise ValueError(
                    "the chat template renders the conversation differently once the reply is added; "
                    "cannot tell the reply's text apart"
                )
            reply_ids = _through_end_of_turn(tokenizer, whole[len(prompt) :], end_ids)
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            samples.append(Sample(prompt_token_ids=prompt_ids, response_token_ids=reply_ids))
    return samples


def _through_end_of_turn(tokenizer: Any, text: str, end_ids: set[int]) -> list[int]:
    """The reply's token ids up to and including the first end token (what the gateway stops generating at)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ends = [i for i, token in enumerate(ids) if token in end_ids]
    if not ends:
        raise ValueError(f"the chat template wrote no end-of-turn token (one of {sorted(end_ids)}) after the reply")
    return ids[: ends[0] + 1]


def end_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """The ids the LLM gateway's transformers backend stops at: the model's generation eos and the tokenizer's."""
    found = model.generation_config.eos_token_id
    ids = set(found if isinstance(found, list) else [found] if found is not None else [])
    return ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


def _recipe(
    teaching: Teaching, tasks: Sequence[dict[str, Any]], model: Path, chat_template: str | None, plan: WarmupPlan
) -> str:
    digest = hashlib.sha256()
    digest.update(
        json.dumps([teaching.name, list(tasks), chat_template, plan.__dict__], sort_keys=True, default=str).encode()
    )
    _digest_model_files(digest, model)
    for module in (teaching.agent.split(":")[0], teaching.teacher.__module__):  # a changed agent or teacher
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.origin:
            digest.update(Path(spec.origin).read_bytes())
    return digest.hexdigest()[:16]


def _digest_model_files(digest: Any, model: Path) -> None:
    """Add ``model``'s files (size and time of change) to ``digest``: a rebuilt model is another recipe."""
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        path = model / name
        if path.is_file():
            stat = path.stat()
            digest.update(f"{name}:{stat.st_size}:{stat.st_mtime_ns}".encode())


def conversation_texts(shown: Sequence[Demonstration], tokenizer: Any) -> list[str]:
    """Each demonstrated call's whole conversation (prompt and reply) as the chat template renders it: a corpus
    to learn a tokenizer's merges from."""
    texts = []
    for demonstration in shown:
        for body, reply in demonstration.calls:
            request = parse_chat(body, max_n=1)
            texts.append(
                tokenizer.apply_chat_template(
                    [*request.messages, reply_message(reply)], tools=request.tools, tokenize=False
                )
            )
    return texts


def tiny_model_for(teaching: Teaching, shown: Sequence[Demonstration], out: Path) -> Path:
    """Fulmen's tiny model (:mod:`fulmen.algorithm.tiny_model`) with its BPE merges learnt from the demonstrated
    conversations (as the demo's are from its own): byte-level, the agents' prompts with their tool schemas are
    600-1,200 tokens, several times what the merges leave, and a model this small learns the longer ones far
    more slowly. Built once into ``out/tiny-<hash of the corpus>``."""
    from fulmen.algorithm.tiny_model import build_tiny_model, build_tiny_tokenizer

    corpus = conversation_texts(shown, build_tiny_tokenizer())
    digest = hashlib.sha256(json.dumps([teaching.name, corpus]).encode()).hexdigest()[:16]
    target = out / f"tiny-{digest}"
    if not (target / "config.json").is_file():
        build_tiny_model(target, corpus=corpus)
    return target


def warm_up(
    teaching: Teaching,
    model: Path,
    tasks: Sequence[dict[str, Any]],
    out: Path,
    *,
    plan: WarmupPlan | None = None,
    chat_template: str | None = None,
    shown: Sequence[Demonstration] | None = None,
    on_step: Callable[[int, int, float], None] = lambda *_: None,
) -> Path:
    """``model`` fine-tuned on the teacher's demonstrations of ``tasks`` (recorded now unless ``shown`` holds
    them), saved as ``out/<recipe>/model`` (reused when that exists). ``chat_template`` is the one the gateway will
    serve with (None: the model's own)."""
    plan = plan or WarmupPlan()
    target = out / _recipe(teaching, tasks, model, chat_template, plan) / "model"
    if (target / MARKER).is_file():
        log.info("reusing the warmed-up model at %s", target)
        return target
    trainer = _trainer(model, plan, chat_template)
    shown = list(shown) if shown is not None else demonstrations(teaching, tasks)
    samples = samples_of(shown, trainer.tokenizer, end_token_ids(trainer.model, trainer.tokenizer))
    if not samples:
        raise ConfigurationError(
            f"the {teaching.name} teacher demonstrated nothing: no episode reached a full reward (run the agent "
            "against the teacher by itself to see why, e.g. the scaffold's `python teacher.py`)"
        )
    log.info("%s: %d demonstrated episodes, %d calls; warming up", teaching.name, len(shown), len(samples))
    recorded = {"teaching": teaching.name, "tasks": len(tasks), "episodes": len(shown)}
    return _train_and_save(trainer, samples, plan, target, recorded, on_step)


def stored_warm_up(
    settings: Any,
    train: Mapping[str, Any],
    model: Path,
    out: Path,
    on_phase: Callable[[str], None] = log.info,
    on_step: Callable[[int, int, float], None] = lambda *_: None,
) -> Path:
    """``model`` fine-tuned on every call of the stored rollouts ``train["warmup_sql"]`` selects (a read-only SELECT
    of rollout ids, read from ``train["source_store"]`` by replay's loader,
    :func:`fulmen.algorithm.service.run.load_replay_buffer`: each rollout's latest attempt, calls of another base
    model or vocabulary refused; no reward needed, the selection is the judgement), ``warmup_steps`` updates at
    ``warmup_lr``; the calls' token ids are the gateway's own, so no chat template is involved. Saved as
    ``out/<recipe>/model``, the recipe a digest of the calls, the plan and the model files (reused when it exists).
    ``settings``: a :class:`~fulmen.algorithm.settings.TrainSettings` (the store to read)."""
    from fulmen.algorithm.service.run import load_replay_buffer

    scoped = settings.model_copy(update={"train": settings.train.model_copy(update=dict(train))})
    buffer = load_replay_buffer(scoped, str(model), selection=train["warmup_sql"], require_reward=False)
    samples = [
        Sample(prompt_token_ids=list(t.prompt_token_ids), response_token_ids=list(t.response_token_ids))
        for group in buffer.groups
        for rollout in group.rollouts
        for t in rollout.transitions
        if t.response_token_ids
    ]
    if not samples:
        raise ConfigurationError(f"--warmup-sql selected no call with a response to imitate: {buffer.summary()}")
    plan = WarmupPlan(steps=train["warmup_steps"], lr=train["warmup_lr"], seed=train["seed"])
    on_phase(
        f"warm-up: {plan.steps} supervised steps on the {len(samples)} stored calls of the rollouts --warmup-sql "
        f"selects ({buffer.summary()}; cached in {out})"
    )
    digest = hashlib.sha256(
        json.dumps([[s.prompt_token_ids, s.response_token_ids] for s in samples] + [plan.__dict__]).encode()
    )
    _digest_model_files(digest, model)
    target = out / f"sql-{digest.hexdigest()[:16]}" / "model"
    if (target / MARKER).is_file():
        log.info("reusing the warmed-up model at %s", target)
        return target
    recorded = {"warmup_sql": train["warmup_sql"], "episodes": buffer.rollouts}
    return _train_and_save(_trainer(model, plan, None), samples, plan, target, recorded, on_step)


def _trainer(model: Path, plan: WarmupPlan, chat_template: str | None) -> Any:
    """The torch trainer a warm-up fine-tunes ``model`` with (float32 on the CPU, as the examples measured it)."""
    from fulmen.algorithm.trainer.torch_backend import TorchTrainer, TorchTrainerConfig

    config = TorchTrainerConfig(
        model, device="cpu", dtype="float32", lr=plan.lr, micro_batch_size=plan.micro_batch_size, seed=plan.seed
    )
    trainer = TorchTrainer(config)
    if chat_template:
        trainer.tokenizer.chat_template = chat_template
    return trainer


def _train_and_save(
    trainer: Any,
    samples: list[Sample],
    plan: WarmupPlan,
    target: Path,
    recorded: dict[str, Any],
    on_step: Callable[[int, int, float], None],
) -> Path:
    """``plan``'s updates on ``samples``, the model saved to ``target`` with its :data:`MARKER` (``recorded`` and
    what the updates did), written last: a directory without it is an unfinished warm-up."""
    steps, tokens, loss = _supervised(trainer, samples, plan, on_step)
    trainer.save(target)
    done = {"calls": len(samples), "plan": plan.__dict__, "updates": steps, "tokens_trained": tokens}
    (target / MARKER).write_text(json.dumps({**recorded, **done, "last_loss": loss}) + "\n")
    log.info("warmed up in %d steps, %d tokens (last loss %.4f): %s", steps, tokens, loss, target)
    return target


def warmed_model(
    train: Mapping[str, Any],
    agent: str,
    model: Path,
    tasks: Sequence[Any],
    home: Path,
    on_phase: Callable[[str], None] | None = None,
    *,
    settings: Any = None,
) -> Path:
    """``model``, or its copy fine-tuned before RL (``TrainSection`` fields in ``train``), cached under
    ``<home>/warmups`` by recipe: with ``warmup_teacher``, on the teacher's demonstrations of ``agent`` on the first
    ``warmup_tasks`` of ``tasks`` (task specs: training tasks only); with ``warmup_sql``, then on the stored calls it
    selects (:func:`stored_warm_up`, reading the store of ``settings``, a ``TrainSettings``; default: the one in
    force). Each phase runs ``warmup_steps`` updates at ``warmup_lr``."""
    said = on_phase or log.info
    if train.get("warmup_teacher"):
        model = _teacher_warm_up(train, agent, model, tasks, home, said)
    if train.get("warmup_sql"):
        if settings is None:
            from fulmen.algorithm.settings import TrainSettings

            settings = TrainSettings()
        model = stored_warm_up(settings, train, model, home / "warmups", said)
    return model


def _teacher_warm_up(
    train: Mapping[str, Any], agent: str, model: Path, tasks: Sequence[Any], home: Path, said: Callable[[str], None]
) -> Path:
    """The teacher's phase of :func:`warmed_model`; the chat template is the one the LLM gateway will serve with
    (``FULMEN_LLM_CHAT_TEMPLATE``, else the model's own)."""
    teacher = train["warmup_teacher"]
    if not agent:
        raise ConfigurationError("--warmup-teacher demonstrates the agent: pass --agent module:function too")
    if os.getcwd() not in sys.path:  # a teacher next to where the command runs, as the runner finds the agent
        sys.path.insert(0, os.getcwd())
    teaching = Teaching(agent, agent, load_agent(teacher))
    inputs = [task.input for task in tasks[: train["warmup_tasks"]]]
    if not inputs:
        raise ConfigurationError("--warmup-teacher demonstrates training tasks: give a dataset")
    plan = WarmupPlan(steps=train["warmup_steps"], lr=train["warmup_lr"], seed=train["seed"])
    template = os.environ.get("FULMEN_LLM_CHAT_TEMPLATE")
    if template:
        from fulmen.producers.llm_gateway.backends.tokenizing import chat_template_override

        template = chat_template_override(template)
    said(
        f"warm-up: {plan.steps} supervised steps on {teacher}'s demonstrations of {len(inputs)} training tasks "
        f"(cached in {home / 'warmups'})"
    )
    return warm_up(teaching, model, inputs, home / "warmups", plan=plan, chat_template=template)


def _supervised(
    trainer: Any, samples: list[Sample], plan: WarmupPlan, on_step: Callable[[int, int, float], None]
) -> tuple[int, int, float]:
    """``plan``'s supervised updates over ``samples`` (a seeded order, drawn in turn); (updates, tokens, last loss)."""
    order = list(range(len(samples)))
    random.Random(plan.seed).shuffle(order)
    per_sample = sum(len(x.prompt_token_ids) + len(x.response_token_ids) for x in samples) / len(samples)
    steps = plan.updates(per_sample * min(plan.batch, len(order)))
    loss, tokens = float("nan"), 0
    for step in range(steps):
        picked = [samples[order[(step * plan.batch + i) % len(order)]] for i in range(min(plan.batch, len(order)))]
        loss = trainer.sft_step(picked).loss
        tokens += sum(len(x.prompt_token_ids) + len(x.response_token_ids) for x in picked)
        on_step(step + 1, steps, loss)
    return steps, tokens, loss
