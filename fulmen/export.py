"""``fulmen export``: a trained model out of a run, in the forms other tools serve.

    report = fulmen.export_model("run-2f9c...", "out/", gguf="q8_0")   # or a run directory

A run's checkpoints are ``<run dir>/checkpoints/v<N>``: a Hugging Face directory (every weight trained, or a LoRA
merged into its base when saved), or, with per-agent adapters, one PEFT adapter per agent beside ``adapters.json``.
The export writes, into ``target`` (which must not exist, or be empty):

* a whole model: the Hugging Face directory as the trainer saved it (``transformers`` and vLLM load it; its
  logprobs are the trainer's), and with ``gguf`` also ``model-<type>.gguf`` (f32, f16, bf16 or q8_0) for
  llama.cpp's ``llama-server``, Ollama and LM Studio;
* per-agent adapters: the adapters as they are (vLLM's ``--lora-modules``, or PEFT on the base model), or with
  ``merge_adapters`` one whole model per agent, ``<agent>/``, its adapter merged into the base (and its GGUF when
  asked: a GGUF holds one model, so per-agent adapters need the merge for it).

Everything goes to a sibling directory first and is renamed at the end, so an interrupted export leaves no half
of one.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from fulmen.schemas.errors import ConfigurationError

__all__ = ["ExportReport", "export_model", "find_run"]


@dataclass(frozen=True)
class ExportReport:
    """What an export wrote: the checkpoint it read (its version), the target, each model directory written
    (one, or one per agent), the GGUF files, and the per-agent adapters left unmerged (None: none)."""

    checkpoint: Path
    version: int
    target: Path
    models: list[Path] = field(default_factory=list)
    gguf: list[Path] = field(default_factory=list)
    adapters: list[str] | None = None

    def how_to_serve(self) -> list[str]:
        """One line per way to serve what was written."""
        lines = [
            f"transformers / vLLM: AutoModelForCausalLM.from_pretrained('{m}'), vllm serve {m}" for m in self.models
        ]
        lines += [f"llama.cpp: llama-server -m {path}" for path in self.gguf]
        if any(path.name.endswith("q8_0.gguf") for path in self.gguf):  # seen on a VM whose CPU lists AMX
            lines.append("  (if llama-server dies of an illegal instruction on q8_0, add --no-repack)")
        if self.adapters is not None:
            modules = " ".join(f"{a}={self.target / a}" for a in self.adapters)
            lines.append(f"vLLM: vllm serve BASE --enable-lora --lora-modules {modules} (BASE: adapters.json's base)")
        return lines


def find_run(run: str | Path, home: Path) -> Path:
    """The run directory ``run`` names: a directory with ``checkpoints/``, or a run id under ``<home>/runs``."""
    given = Path(run)
    for candidate in (given, home / "runs" / str(run)):
        if (candidate / "checkpoints").is_dir():
            return candidate
    runs = sorted(p.name for p in (home / "runs").glob("*") if (p / "checkpoints").is_dir())
    known = ", ".join(runs[-10:]) or "none"
    raise ConfigurationError(
        f"no run {str(run)!r}: neither a run directory with checkpoints/ nor a run under {home / 'runs'} "
        f"(runs with checkpoints there: {known})"
    )


def export_model(
    run: str | Path,
    target: str | Path,
    *,
    version: int | None = None,
    gguf: str | None = None,
    merge_adapters: bool = False,
    home: Path | None = None,
) -> ExportReport:
    """Export version ``version`` (default: the latest) of ``run`` into ``target`` (module docstring). Raises
    ConfigurationError for a run, version or target that does not fit."""
    from fulmen.infra.settings import default_home

    run_dir = find_run(run, home or default_home())
    number, checkpoint = _checkpoint(run_dir, version)
    target = Path(target)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigurationError(f"{target} exists and is not an empty directory: choose a new one")
    per_agent = _adapters_manifest(checkpoint)
    if gguf is not None:
        _check_gguf_type(gguf)
        if per_agent is not None and not merge_adapters:
            raise ConfigurationError(
                "a GGUF file holds one model, and this checkpoint holds per-agent adapters: add --merge-adapters "
                "for one model (and one GGUF) per agent"
            )
    if merge_adapters and per_agent is None:
        raise ConfigurationError(f"{checkpoint} holds a whole model, no adapters to merge: leave --merge-adapters out")
    staging = target.with_name(f".{target.name}.exporting")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        report = _write(checkpoint, number, staging, target, per_agent, gguf, merge_adapters)
        if target.exists():
            target.rmdir()  # empty, checked above
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return report


def _checkpoint(run_dir: Path, version: int | None) -> tuple[int, Path]:
    from fulmen.algorithm.service.run import latest_checkpoint

    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise ConfigurationError(f"{run_dir} has no checkpoint yet (a run saves checkpoints/v<N> after each step)")
    if version is None:
        return latest
    path = run_dir / "checkpoints" / f"v{version}"
    if not path.is_dir():
        versions = sorted(int(p.name[1:]) for p in (run_dir / "checkpoints").glob("v*") if p.name[1:].isdigit())
        raise ConfigurationError(f"{run_dir} has no version {version}; it has {', '.join(map(str, versions))}")
    return version, path


def _adapters_manifest(checkpoint: Path) -> dict | None:
    from fulmen.algorithm.trainer.base import ADAPTERS_FILE

    manifest = checkpoint / ADAPTERS_FILE
    return json.loads(manifest.read_text(encoding="utf-8")) if manifest.is_file() else None


def _check_gguf_type(kind: str) -> None:
    from fulmen.producers.llm_gateway.backends.gguf_export import TENSOR_TYPES

    if kind not in TENSOR_TYPES:
        raise ConfigurationError(f"--gguf {kind!r}: valid types are {', '.join(TENSOR_TYPES)}")


def _write(
    checkpoint: Path,
    number: int,
    staging: Path,
    target: Path,
    per_agent: dict | None,
    gguf: str | None,
    merge: bool,
) -> ExportReport:
    """Write into ``staging``; the report names the paths as they will be under ``target``."""
    if per_agent is None:
        shutil.copytree(checkpoint, staging)
        written = [(staging, target)]
    elif not merge:
        shutil.copytree(checkpoint, staging)
        return ExportReport(checkpoint, number, target, adapters=list(per_agent["agents"]))
    else:
        staging.mkdir(parents=True)
        written = [
            (_merge(checkpoint, agent, per_agent["base_model"], staging / agent), target / agent)
            for agent in per_agent["agents"]
        ]
    ggufs = []
    if gguf is not None:
        from fulmen.producers.llm_gateway.backends.gguf_export import export_gguf

        for model, final in written:
            export_gguf(model, model / f"model-{gguf}.gguf", gguf)
            ggufs.append(final / f"model-{gguf}.gguf")
    return ExportReport(checkpoint, number, target, models=[final for _, final in written], gguf=ggufs)


def _merge(checkpoint: Path, agent: str, base_model: str, out: Path) -> Path:
    """``agent``'s adapter merged into the base model, saved as a whole Hugging Face model in ``out``."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fulmen.algorithm.trainer.torch_backend import no_progress_bars

    if not Path(base_model).is_dir():
        raise ConfigurationError(
            f"the adapters' base model {base_model!r} (adapters.json) is not a directory here: export on the machine "
            "that trained them, or copy the base model there"
        )
    with no_progress_bars():
        base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, checkpoint / agent).merge_and_unload()
        merged.save_pretrained(out)
        AutoTokenizer.from_pretrained(base_model).save_pretrained(out)
    return out
