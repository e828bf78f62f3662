"""The LLM gateway's transformers backend loads a model version without printing progress bars."""

from __future__ import annotations

from pathlib import Path

import pytest

from fulmen.algorithm.tiny_model import build_tiny_model
from fulmen.producers.llm_gateway.backends.transformers_backend import TransformersBackend
from fulmen.producers.llm_gateway.settings import LlmSection


def test_loading_a_version_prints_no_progress_bar(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from transformers.utils import logging as hf_logging

    model = build_tiny_model(tmp_path / "model")
    backend = TransformersBackend(LlmSection(model=str(model), device="cpu"))
    capfd.readouterr()
    loaded = backend._load(str(model), 3)
    assert loaded.version == 3
    assert "Loading weights" not in capfd.readouterr().err  # one a version: the demo loads thirty
    assert hf_logging.is_progress_bar_enabled()  # switched back on after
