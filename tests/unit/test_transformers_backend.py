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


def test_a_chat_template_setting_replaces_the_models_own(tmp_path: Path) -> None:
    """FULMEN_LLM_CHAT_TEMPLATE, as vLLM's --chat-template: a model whose template ignores tools (SmolLM2-135M's)
    gets one that lists them and renders an assistant turn that has only tool calls."""
    from transformers import AutoTokenizer

    from fulmen.schemas.chat_template import CHAT_TEMPLATE
    from fulmen.schemas.errors import ConfigurationError

    model = build_tiny_model(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    tokenizer.save_pretrained(model)
    template = tmp_path / "mine.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    call = {"id": "c", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    own = TransformersBackend(LlmSection(model=str(model), device="cpu"))._load(str(model), 0).tokenizer
    assert "search" not in own.apply_chat_template(messages[:1], tools=tools, tokenize=False)
    built_in = TransformersBackend(LlmSection(model=str(model), device="cpu", chat_template="chatml-tools"))
    loaded = built_in._load(str(model), 0).tokenizer
    assert loaded.chat_template == CHAT_TEMPLATE
    text = loaded.apply_chat_template(messages, tools=tools, tokenize=False)
    assert '"name": "search"' in text and '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>' in text
    from_file = TransformersBackend(LlmSection(model=str(model), device="cpu", chat_template=str(template)))
    assert from_file._load(str(model), 0).tokenizer.apply_chat_template(messages, tokenize=False) == "[user][assistant]"
    with pytest.raises(ConfigurationError, match="neither 'chatml-tools' nor a file"):
        TransformersBackend(LlmSection(model=str(model), device="cpu", chat_template="nope"))._load(str(model), 0)


@pytest.mark.scale
async def test_a_lora_version_is_merged_into_its_base_and_a_broken_one_is_refused(tmp_path: Path) -> None:
    """A ``ModelVersion`` may name a PEFT adapter (``hf_lora_adapter``) instead of full weights: the in-process
    replica serves it merged into ``base_model``; one it cannot load leaves the version serving as it was."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from fulmen.producers.llm_gateway.backends.base import VersionRefusedError
    from fulmen.schemas import ModelVersion

    base = build_tiny_model(tmp_path / "base")
    adapted = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    adapted.save_pretrained(tmp_path / "adapter")
    expected = adapted.merge_and_unload().state_dict()
    backend = TransformersBackend(LlmSection(model=str(base), device="cpu"))
    await backend.start()
    try:
        event = ModelVersion(
            model_name="fulmen",
            version=4,
            uri=str(tmp_path / "adapter"),
            format="hf_lora_adapter",
            base_model=str(base),
        )
        assert not backend.swaps_in_place(event)
        await backend.load_version(event)
        assert backend.model_version == 4
        served = backend._loaded.model.state_dict()  # type: ignore[union-attr]
        name = next(key for key in expected if "q_proj.weight" in key)
        assert torch.equal(served[name], expected[name])
        assert not torch.equal(served[name], AutoModelForCausalLM.from_pretrained(base).state_dict()[name])
        with pytest.raises(VersionRefusedError, match="could not load"):
            await backend.load_version(event.model_copy(update={"version": 5, "uri": str(tmp_path / "nowhere")}))
        assert backend.model_version == 4
    finally:
        await backend.close()
