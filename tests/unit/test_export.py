"""``fulmen export`` / ``fulmen.export_model``: a run's checkpoint out as a Hugging Face directory with the
trainer's logprobs, per-agent adapters as they are or merged into one model each (the merged model's logits are
the adapter's on its base), a GGUF beside it, and clear refusals (run, version, target, type)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fulmen.algorithm.tiny_model import build_tiny_model
from fulmen.export import export_model
from fulmen.schemas.errors import ConfigurationError

IDS = torch.tensor([[3, 17, 42, 7, 99, 5]])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def logits(directory: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture
def run(tiny: Path, tmp_path: Path) -> Path:
    """A run with two whole-model versions; v2's weights differ from v1's."""
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "home" / "runs" / "run-export-1"
    shutil.copytree(tiny, run_dir / "checkpoints" / "v1")
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    model.save_pretrained(run_dir / "checkpoints" / "v2")
    shutil.copy(tiny / "tokenizer.json", run_dir / "checkpoints" / "v2")
    return run_dir


@pytest.fixture
def adapters_run(tiny: Path, tmp_path: Path) -> Path:
    """A per-agent run: agents ``write`` and ``check``, each a non-zero LoRA adapter on the tiny base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    checkpoint = tmp_path / "home" / "runs" / "run-agents" / "checkpoints" / "v3"
    for seed, agent in enumerate(("write", "check")):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        get_peft_model(base, config).save_pretrained(checkpoint / agent)
    manifest = {"agents": ["write", "check"], "base_model": str(tiny)}
    (checkpoint / "adapters.json").write_text(json.dumps(manifest))
    return checkpoint.parent.parent


def test_the_latest_version_exports_with_the_trainers_logits(run: Path, tmp_path: Path) -> None:
    report = export_model("run-export-1", tmp_path / "out", home=run.parent.parent)
    assert (report.version, report.models) == (2, [tmp_path / "out"])
    assert torch.equal(logits(tmp_path / "out"), logits(run / "checkpoints" / "v2"))
    assert not torch.equal(logits(tmp_path / "out"), logits(run / "checkpoints" / "v1"))
    assert not list(tmp_path.glob(".out.exporting"))  # the staging directory is gone
    assert any("vllm serve" in line for line in report.how_to_serve())


def test_a_version_and_a_run_directory_can_be_named_and_a_gguf_written(run: Path, tmp_path: Path) -> None:
    report = export_model(run, tmp_path / "v1", version=1, gguf="q8_0", home=tmp_path / "elsewhere")
    assert report.version == 1 and torch.equal(logits(tmp_path / "v1"), logits(run / "checkpoints" / "v1"))
    assert report.gguf == [tmp_path / "v1" / "model-q8_0.gguf"] and report.gguf[0].stat().st_size > 0
    assert any(line.startswith("llama.cpp: llama-server -m") for line in report.how_to_serve())


def test_per_agent_adapters_merge_into_one_model_each(adapters_run: Path, tiny: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    report = export_model(adapters_run, tmp_path / "merged", merge_adapters=True, gguf="f16")
    assert report.models == [tmp_path / "merged" / "write", tmp_path / "merged" / "check"]
    assert [p.name for p in report.gguf] == ["model-f16.gguf", "model-f16.gguf"]
    for agent in ("write", "check"):
        base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
        adapted = PeftModel.from_pretrained(base, adapters_run / "checkpoints" / "v3" / agent).eval()
        with torch.no_grad():
            expected = adapted(IDS).logits
        assert torch.allclose(logits(tmp_path / "merged" / agent), expected, atol=1e-4), agent
    assert not torch.allclose(logits(tmp_path / "merged" / "write"), logits(tmp_path / "merged" / "check"))


def test_per_agent_adapters_export_as_they_are(adapters_run: Path, tmp_path: Path) -> None:
    report = export_model(adapters_run, tmp_path / "as-is")
    assert report.adapters == ["write", "check"] and report.models == []
    assert (tmp_path / "as-is" / "write" / "adapter_config.json").is_file()
    assert any("--lora-modules write=" in line for line in report.how_to_serve())
    with pytest.raises(ConfigurationError, match="add --merge-adapters"):
        export_model(adapters_run, tmp_path / "gguf", gguf="f32")


def test_what_does_not_fit_is_refused_clearly(run: Path, tmp_path: Path) -> None:
    home = run.parent.parent
    with pytest.raises(ConfigurationError, match=r"no run 'nope'.*runs with checkpoints there: run-export-1"):
        export_model("nope", tmp_path / "x", home=home)
    with pytest.raises(ConfigurationError, match="has no version 7; it has 1, 2"):
        export_model(run, tmp_path / "x", version=7)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("mine")
    with pytest.raises(ConfigurationError, match="not an empty directory"):
        export_model(run, tmp_path / "full")
    with pytest.raises(ConfigurationError, match="valid types are f32, f16, bf16, q8_0"):
        export_model(run, tmp_path / "y", gguf="q4_k")
    with pytest.raises(ConfigurationError, match="no adapters to merge"):
        export_model(run, tmp_path / "z", merge_adapters=True)
    assert (tmp_path / "full" / "file").read_text() == "mine" and not (tmp_path / "y").exists()


def test_the_command_prints_what_it_wrote_and_how_to_serve_it(run: Path, tmp_path: Path) -> None:
    from fulmen.cli.main import app

    result = CliRunner().invoke(
        app,
        ["export", "run-export-1", str(tmp_path / "cli"), "--version", "1"],
        env={"FULMEN_HOME": str(run.parent.parent), "COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    assert "version 1" in result.output and "vllm serve" in result.output
    bad = CliRunner().invoke(app, ["export", "nope", str(tmp_path / "c2")], env={"FULMEN_HOME": str(run.parent.parent)})
    assert bad.exit_code == 1 and "no run 'nope'" in bad.output
