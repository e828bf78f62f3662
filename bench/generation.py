"""Generation engines side by side on SmolLM2-135M-Instruct, CPU, float32, the same threads for each.

    python bench/generation.py [--threads 2] [--engines transformers,transformers_cb,llamacpp,llamacpp_bf16]

Engines (:data:`ENGINES`): ``transformers`` (the gateway's transformers backend, in process, batched generate,
driven through the backend class), ``transformers_cb`` (transformers' continuous batching, ``generate_batch`` with
``paged|sdpa`` attention and shared KV blocks), ``llamacpp`` (the gateway's llamacpp backend: llama-server with f32
weights and KV) and ``llamacpp_bf16`` (bf16 weights: faster, logprobs further from the trainer's).

Workloads: prompts of random token ids (300..40000, fixed seed), every completion exactly ``--new-tokens`` long
(no end of sequence: llama-server's ``ignore_eos``, no eos id for the others), temperature 1, ``--rows`` calls at
once. Per engine: ``shared_prompt_s`` (every call the same prompt), ``distinct_prompts_s`` (each its own),
``prefill_tokens_per_s`` (fresh distinct prompts, one new token each), ``decode_tokens_per_s_c16`` (the distinct
run's tokens after the first, over its time less the prefill run's), ``gflops_effective`` (the distinct run's
matmul work: projections, attention over the context, the LM head for sampled positions only, over its time) and
its fraction of a 2048^3 float32 matmul measured in the same run, ``weight_sync_s`` (a new full-weight version,
from load_version to served; for transformers_cb: from_pretrained), ``adapter_sync_s`` (a LoRA version: merged, as
both backends serve one), ``logprob_abs_diff_mean``/``_max`` (the engine's logprobs of its distinct-run tokens vs
the trainer's ``token_logprobs`` on the same ids, float32), ``peak_rss_mb``. With ``--gateway`` (default on) the
llamacpp engine also runs behind the real gateway with a local Kafka: ``tokens_identical`` (the ids in the spans
are the ids llama-server returned) and ``weight_sync_via_kafka_s`` / ``adapter_sync_via_kafka_s`` (publish on
the models topic -> the gateway serves it).

Progress goes to stderr; the last stdout line is one JSON object: every engine under its name, and the winner's
figures at the top level with ``"winner"`` (the fastest, shared + distinct, among the engines whose logprobs are
within 1e-3 of the trainer's on average).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from bench.smollm2 import ensure_smollm2
from bench.span_ingest import free_port, peak_rss_mb
from bench.train_step import peak_mib, reset_peak

_CPU = torch.device("cpu")


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[float]


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- engines ----------------------------------------------------------------------------------------------------
class BackendEngine:
    """A gateway backend (one replica) driven through its class: concurrent ``complete`` calls with token ids."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    async def generate(self, prompts: list[list[int]], new_tokens: int) -> list[Sampled]:
        from fulmen.producers.llm_gateway.protocol import CompletionRequest, SamplingParams

        sampling = SamplingParams(max_tokens=new_tokens, temperature=1.0)
        calls = [self.backend.complete(CompletionRequest("fulmen", None, list(p), sampling)) for p in prompts]
        results = await asyncio.gather(*calls)
        return [Sampled(r.choices[0].token_ids, r.choices[0].logprobs) for r in results]

    async def load(self, version: int, uri: Path, base: Path | None = None) -> float:
        from fulmen.schemas import ModelVersion

        event = ModelVersion(
            model_name="fulmen",
            version=version,
            uri=str(uri),
            base_model=str(base or ""),
            format="hf_lora_adapter" if base else "hf",
        )
        started = time.perf_counter()
        await self.backend.load_version(event)
        return time.perf_counter() - started

    def peak_rss_mb(self) -> float:
        return peak_mib(_CPU)

    async def close(self) -> None:
        await self.backend.close()


async def transformers_engine(model: Path, args: argparse.Namespace, home: Path) -> BackendEngine:
    from fulmen.producers.llm_gateway.backends.transformers_backend import TransformersBackend
    from fulmen.producers.llm_gateway.settings import LlmSection

    options = LlmSection(
        model=str(model), device="cpu", dtype="float32", max_batch_rows=args.rows, batch_wait_ms=50, model_version=0
    )
    backend = TransformersBackend(options)
    await backend.start()
    backend._loaded.eos_ids = frozenset()  # the backend has no ignore_eos: without eos ids every row runs to length
    return BackendEngine(backend)


class LlamaCppEngine(BackendEngine):
    def peak_rss_mb(self) -> float:  # the engine is the child process
        serving = self.backend._serving
        return peak_rss_mb(serving.server.process.pid) if serving else 0.0


async def llamacpp_engine(model: Path, args: argparse.Namespace, home: Path, kind: str = "f32") -> BackendEngine:
    from fulmen.producers.llm_gateway.backends.llamacpp import LlamaCppBackend

    backend = LlamaCppBackend(llamacpp_options(model, args, kind), 0, home, body_options={"ignore_eos": True})
    await backend.start()
    return LlamaCppEngine(backend)


def llamacpp_options(model: Path, args: argparse.Namespace, kind: str = "f32", **more: Any) -> Any:
    from fulmen.producers.llm_gateway.settings import LlmSection

    return LlmSection(
        backend="llamacpp",
        model=str(model),
        model_version=0,
        llamacpp_threads=args.threads,
        llamacpp_slots=args.rows,
        llamacpp_gguf_type=kind,
        llamacpp_context=args.prompt_tokens + args.new_tokens + 64,
        **more,
    )


class ContinuousBatchingEngine:
    """transformers' ``generate_batch`` (continuous batching, paged attention), on a worker thread."""

    def __init__(self, model: Path) -> None:
        self.path = model
        self.model = self._load(model)

    @staticmethod
    def _load(path: Path) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="paged|sdpa")

    def _run(self, prompts: list[list[int]], new_tokens: int) -> list[Sampled]:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        config = GenerationConfig(
            max_new_tokens=new_tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            eos_token_id=-1,
            pad_token_id=2,
        )
        batching = ContinuousBatchingConfig(return_logprobs=True, allow_block_sharing=True)
        outputs = self.model.generate_batch(
            [list(p) for p in prompts],
            generation_config=config,
            continuous_batching_config=batching,
            progress_bar=False,
        )
        ordered = sorted(outputs.values(), key=lambda o: int(str(o.request_id).rsplit("_", 1)[-1]))
        return [Sampled(list(o.generated_tokens), [float(x) for x in o.logprobs]) for o in ordered]

    async def generate(self, prompts: list[list[int]], new_tokens: int) -> list[Sampled]:
        return await asyncio.to_thread(self._run, prompts, new_tokens)

    async def load(self, version: int, uri: Path, base: Path | None = None) -> float:
        started = time.perf_counter()
        if base is None:
            self.model = await asyncio.to_thread(self._load, uri)
        else:
            from peft import PeftModel

            self.model = await asyncio.to_thread(
                lambda: PeftModel.from_pretrained(self.model, str(uri)).merge_and_unload()
            )
        return time.perf_counter() - started

    def peak_rss_mb(self) -> float:
        return peak_mib(_CPU)

    async def close(self) -> None:
        self.model = None


async def cb_engine(model: Path, args: argparse.Namespace, home: Path) -> ContinuousBatchingEngine:
    return await asyncio.to_thread(ContinuousBatchingEngine, model)


async def bf16_engine(model: Path, args: argparse.Namespace, home: Path) -> BackendEngine:
    return await llamacpp_engine(model, args, home, "bf16")


ENGINES = {
    "transformers": transformers_engine,
    "transformers_cb": cb_engine,
    "llamacpp": llamacpp_engine,
    "llamacpp_bf16": bf16_engine,
}


TOKENS_CHECKED = {  # how each engine's recorded ids are known to be the sampled ones (llamacpp: measured, below)
    "transformers": "by construction: the backend's CallResult holds the ids its sampler drew",
    "transformers_cb": "not a gateway backend: its own output ids",
    "llamacpp": "see the gateway run (--no-gateway skipped it)",
    "llamacpp_bf16": "the llamacpp backend, whose gateway run checks them (f32)",
}


# --- measurements -----------------------------------------------------------------------------------------------
class Prompts:
    """Random token-id prompts from one seeded generator: every call to :meth:`take` gives fresh ones."""

    def __init__(self, length: int, seed: int = 0) -> None:
        self.length = length
        self.generator = torch.Generator().manual_seed(seed)

    def take(self, count: int) -> list[list[int]]:
        return torch.randint(300, 40000, (count, self.length), generator=self.generator).tolist()


async def measure(engine: Any, prompts: Prompts, args: argparse.Namespace, versions: dict[str, Path]) -> dict:
    rows, new = args.rows, args.new_tokens
    await engine.generate(prompts.take(1), 4)  # warm-up
    reset_peak(_CPU)
    started = time.perf_counter()
    await engine.generate(prompts.take(rows), 1)
    prefill_s = time.perf_counter() - started
    started = time.perf_counter()
    await engine.generate(prompts.take(1) * rows, new)
    shared_s = time.perf_counter() - started
    distinct = prompts.take(rows)
    started = time.perf_counter()
    outputs = await engine.generate(distinct, new)
    distinct_s = time.perf_counter() - started
    lengths = [len(o.token_ids) for o in outputs]
    # None when the prefill run took longer than the whole distinct run (a busy machine)
    decode_rate = round(rows * (new - 1) / (distinct_s - prefill_s), 1) if distinct_s > prefill_s else None
    report = {
        "shared_prompt_s": round(shared_s, 2),
        "distinct_prompts_s": round(distinct_s, 2),
        "prefill_tokens_per_s": round(rows * prompts.length / prefill_s, 1),
        "decode_tokens_per_s_c16": decode_rate,
        "completion_tokens": sorted(set(lengths)),
        "peak_rss_mb": round(engine.peak_rss_mb(), 1),
    }
    report["weight_sync_s"] = round(await engine.load(1, versions["full"]), 2)
    report["adapter_sync_s"] = round(await engine.load(2, versions["adapter"], versions["base"]), 2)
    return {"report": report, "prompts": distinct, "outputs": outputs}


def matmul_gflops() -> float:
    """The best of five 2048^3 float32 matmuls on this process's threads (run before and after the engines: the
    higher counts, a busy moment of the machine should not make the engines look better)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(5))
    return 2 * 2048**3 / best / 1e9


def _timed(function: Any) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def useful_flops(config: Any, rows: int, prompt: int, new: int) -> float:
    """Matmul FLOPs of ``rows`` sequences: projections and MLP for every token, attention over the context, the LM
    head for the sampled positions only (what a server must compute; padding and extra logits not counted)."""
    d, layers, ff, vocab = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    kv = (config.num_key_value_heads or config.num_attention_heads) * (d // config.num_attention_heads)
    tokens = prompt + new
    per_token = layers * 2 * (2 * d * d + 2 * d * kv + 3 * d * ff)
    attention = layers * 4 * d * tokens * (tokens + 1) / 2
    return rows * (tokens * per_token + attention + new * 2 * d * vocab)


def logprob_gap(model: Any, prompts: list[list[int]], outputs: list[Sampled]) -> dict:
    from fulmen.algorithm.trainer.logprobs import token_logprobs

    gaps = []
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            expected = token_logprobs(model, ids, torch.ones_like(ids))[0, len(prompt) :]
        gaps.append((expected - torch.tensor(out.logprobs)).abs())
    every = torch.cat(gaps)
    return {"logprob_abs_diff_mean": float(every.mean()), "logprob_abs_diff_max": float(every.max())}


def make_versions(model: Path, root: Path) -> dict[str, Path]:
    """A full-weight copy (a new checkpoint to convert) and a LoRA adapter that changes the weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    full = root / "v1"
    shutil.copytree(model, full)
    adapted = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
        LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    adapted.save_pretrained(root / "adapter")
    return {"full": full, "adapter": root / "adapter", "base": model}


# --- the llamacpp engine behind the gateway -----------------------------------------------------------------------
async def through_gateway(model: Path, args: argparse.Namespace, home: Path, bootstrap: str, versions: dict) -> dict:
    from openai import AsyncOpenAI

    from fulmen.infra.kafka.admin import ensure_topics
    from fulmen.infra.settings import FulmenSettings
    from fulmen.producers.llm_gateway import LlmGateway, LlmGatewaySettings
    from fulmen.producers.llm_gateway.backends import ReplicaRouter
    from fulmen.producers.llm_gateway.backends.llamacpp import LlamaCppBackend
    from fulmen.schemas import ModelVersion, TopicKey, semconv
    from fulmen.testing.llm_pipeline import RecordingTransport, published_spans
    from fulmen.testing.publishing import event_publisher

    settings = FulmenSettings(home=home, kafka={"bootstrap": bootstrap})
    await ensure_topics(settings)
    options = llamacpp_options(model, args, port=0)
    transport = RecordingTransport()
    replica = LlamaCppBackend(options, 0, home, transport=transport, body_options={"ignore_eos": True})
    gateway = LlmGateway(
        LlmGatewaySettings(home=home, kafka=settings.kafka.model_dump(), llm=options.model_dump()),
        backend=ReplicaRouter([replica], options),
    )
    await gateway.start()
    report: dict[str, Any] = {}
    try:
        client = AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="x", max_retries=0)
        prompts = Prompts(args.prompt_tokens, seed=7).take(args.rows)
        await asyncio.gather(
            *(client.completions.create(model="fulmen", prompt=p, max_tokens=args.new_tokens) for p in prompts)
        )
        spans = await published_spans(settings, args.rows, timeout_s=60)
        recorded = Counter(tuple(s["attributes"][semconv.RESPONSE_TOKEN_IDS]) for s in spans)
        report["tokens_identical"] = recorded == Counter(tuple(t) for t in transport.sampled())
        async with event_publisher(settings) as publisher:
            for key, event in (
                ("weight_sync_via_kafka_s", ModelVersion(model_name="fulmen", version=1, uri=str(versions["full"]))),
                (
                    "adapter_sync_via_kafka_s",
                    ModelVersion(
                        model_name="fulmen", version=2, uri=str(versions["adapter"]), format="hf_lora_adapter"
                    ),
                ),
            ):
                started = time.perf_counter()
                await publisher.publish(TopicKey.MODELS, event)
                while gateway.backend.model_version != event.version:
                    await asyncio.sleep(0.005)
                report[key] = round(time.perf_counter() - started, 2)
    finally:
        await gateway.stop()
    return report


def gateway_phase(model: Path, args: argparse.Namespace, versions: dict) -> dict:
    from fulmen.infra.kafka.local import LocalKafka
    from fulmen.infra.settings import BrokerSettings

    home = Path(tempfile.mkdtemp(prefix="fulmen-bench-generation-gw-"))
    broker = LocalKafka(BrokerSettings(port=free_port(), controller_port=free_port()), home / "kafka")
    broker.start()
    try:
        return asyncio.run(through_gateway(model, args, home, broker.bootstrap, versions))
    finally:
        broker.stop()
        shutil.rmtree(home, ignore_errors=True)


# --- the run --------------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = ensure_smollm2()
    root = Path(tempfile.mkdtemp(prefix="fulmen-bench-generation-"))
    try:
        versions = make_versions(model, root)
        matmul = matmul_gflops()
        say(f"2048^3 float32 matmul on {args.threads} threads: {matmul:.1f} GFLOP/s")
        flops = useful_flops(AutoConfig.from_pretrained(model), args.rows, args.prompt_tokens, args.new_tokens)
        runs: dict[str, dict] = {}
        for name in args.engines:
            say(f"{name}: starting")
            runs[name] = asyncio.run(run_engine(name, model, args, root, versions))
            say(f"{name}: {json.dumps(runs[name]['report'])}")
        matmul = max(matmul, matmul_gflops())
        say(f"2048^3 float32 matmul again: best {matmul:.1f} GFLOP/s")
        for report in (measured["report"] for measured in runs.values()):
            report["gflops_effective"] = round(flops / report["distinct_prompts_s"] / 1e9, 2)
            report["matmul_fraction"] = round(report["gflops_effective"] / matmul, 3)
        reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        result: dict[str, Any] = {"matmul_gflops": round(matmul, 1)}
        for name, measured in runs.items():
            result[name] = {
                **measured["report"],
                **logprob_gap(reference, measured["prompts"], measured["outputs"]),
                "tokens_identical": TOKENS_CHECKED[name],
            }
        if args.gateway and "llamacpp" in runs:
            say("llamacpp behind the gateway with a local Kafka")
            result["llamacpp"].update(gateway_phase(model, args, versions))
        return finish(result, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def run_engine(name: str, model: Path, args: argparse.Namespace, root: Path, versions: dict) -> dict:
    """Start, measure and close one engine on one event loop (its tasks and child process belong to it)."""
    engine = await ENGINES[name](model, args, root / name)
    try:
        return await measure(engine, Prompts(args.prompt_tokens), args, versions)
    finally:
        await engine.close()


def finish(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    exact = [n for n in args.engines if n in result and result[n]["logprob_abs_diff_mean"] <= 1e-3]
    if exact:
        winner = min(exact, key=lambda n: result[n]["shared_prompt_s"] + result[n]["distinct_prompts_s"])
        result = {"winner": winner, **result[winner], **result}
    result["workload"] = {
        "rows": args.rows,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "model": "SmolLM2-135M-Instruct",
        "dtype": "float32",
    }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--engines", type=lambda s: s.split(","), default=list(ENGINES))
    parser.add_argument("--no-gateway", dest="gateway", action="store_false")
    args = parser.parse_args()
    unknown = [name for name in args.engines if name not in ENGINES]
    if unknown:
        parser.error(f"unknown engines {unknown}: valid are {', '.join(ENGINES)}")
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
