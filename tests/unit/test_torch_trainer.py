"""The torch trainer on a tiny Qwen2 (CPU): every weight trains, accumulation is exact, LoRA, KL, SFT, save."""

from __future__ import annotations

import math
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fulmen.algorithm.batch import Sample, collate
from fulmen.algorithm.rl.advantages import compute_advantages, encode_group_ids
from fulmen.algorithm.tiny_model import TinyModelConfig, build_tiny_model
from fulmen.algorithm.trainer import TrainerBackend, token_logprobs
from fulmen.algorithm.trainer import logprobs as logprobs_module
from fulmen.algorithm.trainer.logprobs import gather_logprobs
from fulmen.algorithm.trainer.torch_backend import LoraSettings, TorchTrainer, TorchTrainerConfig
from fulmen.schemas.errors import ConfigurationError, PoisonInputError

TINY = TinyModelConfig(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", TINY)


def make_samples(seed: int, groups: int = 3, group_size: int = 4) -> list[Sample]:
    """GRPO groups: same prompt per group, responses of different lengths, binary rewards -> advantages."""
    rng = random.Random(seed)
    samples, rewards, keys = [], [], []
    for group in range(groups):
        prompt = [rng.randrange(5, 100) for _ in range(rng.randint(2, 9))]
        for _ in range(group_size):
            response = [rng.randrange(5, 100) for _ in range(rng.randint(1, 12))]
            samples.append(Sample(prompt, response, group_id=f"g{group}"))
            rewards.append(float(rng.random() < 0.5))
            keys.append(f"g{group}")
        rewards[-1], rewards[-2] = 1.0, 0.0  # every group has both outcomes
    advantages = compute_advantages("grpo", torch.tensor(rewards), encode_group_ids(keys)).tolist()
    return [
        Sample(s.prompt_token_ids, s.response_token_ids, a, group_id=s.group_id)
        for s, a in zip(samples, advantages, strict=True)
    ]


def make_trainer(model_dir: Path, **overrides: object) -> TorchTrainer:
    settings = {"device": "cpu", "dtype": "float32", "lr": 1e-3, "micro_batch_size": 4, **overrides}
    return TorchTrainer(TorchTrainerConfig(model_dir, **settings))


def trainable(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_torch_trainer_implements_the_backend_protocol(model_dir: Path) -> None:
    assert isinstance(make_trainer(model_dir), TrainerBackend)


def test_one_grpo_step_changes_every_trainable_parameter(model_dir: Path) -> None:
    trainer = make_trainer(model_dir)
    before = trainable(trainer)
    metrics = trainer.step(make_samples(0))
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(p.detach(), before[n])]
    assert unchanged == []
    assert metrics.step == 1 and metrics.skipped_updates == 0 and metrics.grad_norm > 0
    assert metrics.tokens == sum(len(s.response_token_ids) for s in make_samples(0))
    assert metrics.tokens_per_s > 0 and metrics.train_s > 0
    assert metrics.ratio_mean == pytest.approx(1.0) and metrics.clip_fraction == 0.0  # one epoch: on-policy


@pytest.mark.parametrize("split", [{"micro_batch_size": 5}, {"micro_batch_tokens": 40}], ids=["rows", "tree"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_gradient_accumulation_equals_one_large_batch(model_dir: Path, aggregation: str, split: dict) -> None:
    samples = make_samples(1)  # 12 samples of ragged lengths, in 3 groups sharing their prompts
    whole = make_trainer(model_dir, lr=1e-6, micro_batch_size=12, aggregation=aggregation)
    pieces = make_trainer(model_dir, lr=1e-6, aggregation=aggregation, **split)  # 5 + 5 + 2 rows, or 3+ trees
    assert len(pieces._micro_batches(pieces._prepare(samples))) >= 3
    whole_metrics, pieces_metrics = whole.step(samples), pieces.step(samples)
    assert pieces_metrics.loss == pytest.approx(whole_metrics.loss, rel=1e-5, abs=1e-7)
    assert pieces_metrics.grad_norm == pytest.approx(whole_metrics.grad_norm, rel=1e-5)
    for (name, a), b in zip(whole.model.named_parameters(), pieces.model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=f"gradient of {name}")
        torch.testing.assert_close(b.detach(), a.detach(), rtol=0, atol=1e-6, msg=f"weight {name}")


def test_missing_old_logprobs_are_computed_before_the_update(model_dir: Path) -> None:
    samples = make_samples(2)
    recorded = make_trainer(model_dir, epochs_per_batch=2)
    batch = collate(samples, recorded.pad_id)
    with torch.no_grad():
        old = token_logprobs(recorded.model, batch.input_ids, batch.attention_mask)
    with_logprobs = [
        Sample(
            s.prompt_token_ids, s.response_token_ids, s.advantage, old[i, len(s.prompt_token_ids) : s.length].tolist()
        )
        for i, s in enumerate(samples)
    ]
    computed = make_trainer(model_dir, epochs_per_batch=2)
    first, second = recorded.step(with_logprobs), computed.step(samples)
    assert first.loss == pytest.approx(second.loss, rel=1e-5)
    assert first.approx_kl == pytest.approx(second.approx_kl, rel=1e-4, abs=1e-7)
    for a, b in zip(recorded.model.parameters(), computed.model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-6)  # of the second epoch
    assert second.approx_kl != 0.0  # the second epoch moved away from the old policy


def test_lora_trains_only_the_adapter_and_saves_a_merged_model(model_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(model_dir, lora=LoraSettings(r=4, alpha=8), kl_coef=0.05)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    adapter = trainable(trainer)
    assert adapter and all("lora_" in name for name in adapter)
    for seed in (3, 4):  # lora_B starts at 0, so lora_A only gets a gradient from the second step on
        trainer.step(make_samples(seed))
    for name, param in trainer.model.named_parameters():
        if name in frozen:
            assert torch.equal(param.detach(), frozen[name]), f"frozen {name} changed"
        else:
            assert not torch.equal(param.detach(), adapter[name]), f"adapter {name} did not train"
    saved = trainer.save(tmp_path / "merged")
    assert not (saved / "adapter_config.json").exists() and (saved / "model.safetensors").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    assert not any("lora" in name for name, _ in reloaded.named_parameters())
    ids = collate(make_samples(5), trainer.pad_id).input_ids
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, trainer.model(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("lora", [None, LoraSettings(r=4)], ids=["full", "lora"])
def test_kl_to_the_reference_is_zero_at_first_and_positive_after_a_step(
    model_dir: Path, lora: LoraSettings | None
) -> None:
    trainer = make_trainer(model_dir, kl_coef=0.1, lora=lora)
    first = trainer.step(make_samples(6))
    second = trainer.step(make_samples(7))
    assert first.kl == pytest.approx(0.0, abs=1e-9)
    assert second.kl > 1e-6


def test_no_reference_model_without_kl(model_dir: Path) -> None:
    assert make_trainer(model_dir).reference is None
    assert make_trainer(model_dir).step(make_samples(8)).kl == 0.0


def test_sft_step_lowers_the_loss_on_a_repeated_batch(model_dir: Path) -> None:
    trainer = make_trainer(model_dir, lr=3e-3)
    samples = make_samples(9)
    losses = [trainer.sft_step(samples).loss for _ in range(8)]
    assert losses[-1] < 0.8 * losses[0]
    assert losses[0] == pytest.approx(-_mean_response_logprob(make_trainer(model_dir), samples), rel=1e-5)


def _mean_response_logprob(trainer: TorchTrainer, samples: list[Sample]) -> float:
    batch = collate(samples, trainer.pad_id)
    with torch.no_grad():
        logprobs = token_logprobs(trainer.model, batch.input_ids, batch.attention_mask)
    return float((logprobs * batch.response_mask).sum() / batch.response_mask.sum())


def test_save_reloads_with_identical_logits(model_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(model_dir)
    trainer.step(make_samples(10))
    saved = trainer.save(tmp_path / "v1")
    assert (saved / "config.json").exists() and (saved / "tokenizer.json").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    ids = collate(make_samples(11), trainer.pad_id).input_ids
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, trainer.model(input_ids=ids).logits)


def test_loading_and_saving_print_no_progress_bars(
    model_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from transformers.utils import logging as hf_logging

    capfd.readouterr()
    trainer = make_trainer(model_dir)
    trainer.save(tmp_path / "v1")
    printed = capfd.readouterr().err
    assert "Loading weights" not in printed and "Writing model shards" not in printed  # one a step, in the demo
    assert hf_logging.is_progress_bar_enabled()  # switched back on after: a caller's own bars are untouched


def test_over_length_sample_is_poison(model_dir: Path) -> None:
    trainer = make_trainer(model_dir, max_len=8)
    with pytest.raises(PoisonInputError, match="> max_len 8"):
        trainer.step([Sample([5] * 6, [6] * 3, advantage=1.0)])


def test_configuration_errors_say_what_to_set(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"lr must be > 0.*micro_batch_size must be >= 1"):
        TorchTrainerConfig(model_dir, lr=0, micro_batch_size=0)
    with pytest.raises(ConfigurationError, match="valid: token_mean, seq_mean"):
        TorchTrainerConfig(model_dir, aggregation="mean")
    with pytest.raises(ConfigurationError, match="dtype must be auto, float32 or bfloat16"):
        TorchTrainerConfig(model_dir, dtype="float16")
    with pytest.raises(ConfigurationError, match="cannot load a causal LM"):
        TorchTrainer(TorchTrainerConfig(tmp_path / "nothing-here", device="cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigurationError, match="no CUDA GPU; use device='cpu'"):
            TorchTrainer(TorchTrainerConfig(model_dir, device="cuda"))


def test_token_logprobs_match_log_softmax_and_ignore_padding(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = collate(make_samples(12), pad_id=0)
    with torch.no_grad():
        got = token_logprobs(model, batch.input_ids, batch.attention_mask)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        expected = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
        alone = token_logprobs(model, batch.input_ids[2:3, : batch.input_tokens], batch.attention_mask[2:3])
    assert got.dtype == torch.float32 and got.shape == batch.input_ids.shape
    assert bool((got[:, 0] == 0).all())
    torch.testing.assert_close(got[:, 1:], expected * batch.attention_mask[:, 1:], rtol=1e-5, atol=1e-5)
    assert bool((got[batch.attention_mask == 0] == 0).all())
    width = int(batch.attention_mask[2].sum())
    torch.testing.assert_close(alone[0, :width], got[2, :width], rtol=1e-5, atol=1e-5)  # padding changes nothing


@pytest.mark.parametrize("layout", ["padded", "packed", "tree"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_response_only_logprobs_equal_the_full_forward_in_values_and_gradients(
    model_dir: Path, lora: bool, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the response mask, the head runs on the response's predecessors only: the same logprobs there (0
    elsewhere) and the same gradient of a loss over the response, for the model and for a PEFT model around it,
    with the rows padded, packed into one (a sequence sees none of the others' tokens), or merged into their
    prefix tree (the groups' shared prompts computed once)."""
    monkeypatch.setattr(logprobs_module, "worth_packing", lambda *_: layout == "packed")
    if layout != "tree":
        monkeypatch.setattr(logprobs_module, "shared_prefix_tree", lambda *_: None)
    else:
        used = []
        real = logprobs_module.shared_prefix_tree
        monkeypatch.setattr(logprobs_module, "shared_prefix_tree", lambda *a: used.append(real(*a)) or used[-1])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    assert logprobs_module.plain_head(model) is not None  # a Qwen2 (bare or in PEFT): the head-only path runs
    batch = collate(make_samples(13), pad_id=0)
    weights = torch.randn(batch.input_ids.shape)

    def run(mask: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        got = token_logprobs(model, batch.input_ids, batch.attention_mask, mask)
        (got * weights * batch.response_mask).sum().backward()
        return got.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    full, full_grads = run(None)
    only, only_grads = run(batch.response_mask)
    if layout == "tree":  # the groups' prompts are shared: the tree is smaller than the rows
        assert used and used[-1] is not None and used[-1].size < batch.input_tokens
    torch.testing.assert_close(only, full * batch.response_mask, rtol=1e-5, atol=1e-6)
    assert bool((only[batch.response_mask == 0] == 0).all())
    assert full_grads.keys() == only_grads.keys() and full_grads
    for name, grad in full_grads.items():
        torch.testing.assert_close(only_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packing_is_chosen_when_it_saves_work() -> None:
    """A batch of unequal rows packs; equal rows, one row, or rows so long that the packed mask would be large,
    stay padded (the block mask is a full [N, N] square)."""
    worth = logprobs_module.worth_packing
    assert worth(torch.tensor([30, 60, 90, 100]), 100, hidden_size=576)  # short agent turns, a quarter padding
    assert not worth(torch.tensor([100, 100, 100]), 100, hidden_size=576)  # nothing to save
    assert not worth(torch.tensor([70]), 100, hidden_size=576)
    assert not worth(torch.tensor([3000, 4096]), 4096, hidden_size=4096)  # N^2 = 50M > PACKED_MASK_ELEMENTS
    assert not worth(torch.tensor([1000, 1024]), 1024, hidden_size=64)  # attention would cost more than it saves


def test_a_model_with_another_head_runs_whole() -> None:
    """plain_head knows Llama, Qwen2/3, Mistral only: any other model (its head may scale or soft-cap the logits) is
    run whole, its own logits gathered, also when a response mask is given."""

    class Other(torch.nn.Module):  # uniform logits over a vocabulary of 8: every logprob is log(1/8)
        def forward(self, input_ids, attention_mask, use_cache):
            return types.SimpleNamespace(logits=torch.zeros(*input_ids.shape, 8))

    assert logprobs_module.plain_head(Other()) is None
    batch = collate([Sample([1, 2], [3, 4, 5]), Sample([1], [2])], pad_id=0)
    got = token_logprobs(Other(), batch.input_ids, batch.attention_mask, batch.response_mask)
    expected = torch.full(batch.input_ids.shape, -math.log(8)) * batch.attention_mask
    expected[:, 0] = 0
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # float32: the backward works in place
def test_gather_logprobs_values_and_gradients_in_small_chunks(monkeypatch: pytest.MonkeyPatch, dtype) -> None:
    monkeypatch.setattr(logprobs_module, "CHUNK_ELEMENTS", 3 * 11)  # 3 rows of vocab 11 per chunk: 5 chunks
    logits = torch.randn(2, 7, 11, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 11, (2, 7))
    expected = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(gather_logprobs(logits, targets), expected.float())
    weights = torch.randn(2, 7, dtype=dtype)
    (mine,) = torch.autograd.grad((gather_logprobs(logits, targets) * weights).sum(), logits)
    (theirs,) = torch.autograd.grad((expected * weights).sum(), logits)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)  # forward is float32, hence the tolerance


def test_trainer_side_runs_without_pydantic() -> None:
    """The GPU machine has torch, transformers and peft only: nothing on the trainer side may need pydantic."""
    code = (
        "import sys\n"
        "for name in ('pydantic', 'pydantic_core', 'pydantic_settings'):\n"
        "    sys.modules[name] = None  # import of these now fails\n"
        "import fulmen.algorithm.rl.advantages, fulmen.algorithm.rl.losses, fulmen.algorithm.batch, fulmen.algorithm.trainer.torch_backend\n"
        "from fulmen.schemas.errors import ConfigurationError, PoisonInputError\n"
        "assert ConfigurationError.__module__ == 'fulmen.schemas.errors', ConfigurationError.__module__\n"
        "assert issubclass(PoisonInputError, Exception)\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_with_pydantic_the_errors_are_those_of_schemas() -> None:
    import fulmen.schemas.errors

    assert ConfigurationError is fulmen.schemas.errors.ConfigurationError
    assert PoisonInputError is fulmen.schemas.errors.PoisonInputError


@pytest.mark.parametrize(
    ("loss", "clip_eps", "clip_eps_high", "aggregation"),
    [("dapo", 0.2, 0.28, "token_mean"), ("gspo", 3e-4, 4e-4, "seq_mean"), ("cispo", 1.0, 3.0, "token_mean")],
)
def test_every_policy_loss_trains_every_parameter(
    model_dir: Path, loss: str, clip_eps: float, clip_eps_high: float, aggregation: str
) -> None:
    trainer = make_trainer(
        model_dir,
        policy_loss=loss,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        aggregation=aggregation,
        epochs_per_batch=2,
    )
    before = trainable(trainer)
    metrics = trainer.step(make_samples(20))
    assert [n for n, p in trainer.model.named_parameters() if torch.equal(p.detach(), before[n])] == []
    assert metrics.skipped_updates == 0 and metrics.grad_norm > 0 and metrics.approx_kl != 0.0
    assert metrics.is_weight_mean is None  # no correction: no importance statistics


def with_behaviour(trainer: TorchTrainer, samples: list[Sample], shift: float, rows: set[int]) -> list[Sample]:
    """The samples with behaviour logprobs recorded on ``rows``: the model's own minus ``shift`` (so the ratio
    proximal / behaviour is exp(shift) on every token of those rows)."""
    batch = collate(samples, trainer.pad_id)
    with torch.no_grad():
        own = token_logprobs(trainer.model, batch.input_ids, batch.attention_mask)
    return [
        Sample(
            s.prompt_token_ids,
            s.response_token_ids,
            s.advantage,
            (own[i, len(s.prompt_token_ids) : s.length] - shift).tolist() if i in rows else None,
        )
        for i, s in enumerate(samples)
    ]


def grads(trainer: TorchTrainer) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in trainer.model.parameters()]


@pytest.mark.parametrize(
    ("correction", "options", "scale", "truncated", "masked"),
    [
        ("decoupled", {}, 1.5, 0.0, 0.0),
        ("tis", {"correction_high": 1.2}, 1.2, 1.0, 0.0),
        ("tis", {"correction_high": 2.0}, 1.5, 0.0, 0.0),
        ("mis", {"correction_level": "sequence", "correction_high": 1e9}, None, 0.0, 0.0),  # products of 1.5s
        ("mis", {"correction_high": 1.2}, 0.0, 0.0, 1.0),
    ],
)
def test_corrections_weigh_the_gradient_by_proximal_over_behaviour(
    model_dir: Path, correction: str, options: dict, scale: float | None, truncated: float, masked: float
) -> None:
    """Behaviour logprobs recorded as the model's own minus log(1.5): the recomputed proximal ones are the model's,
    so each token's weight is 1.5 (decoupled), min(1.5, C) (tis), 1.5 or 0 (mis). One epoch is on-policy for
    pi_prox, so the weighted gradient (before clipping: off here) is exactly the scaled plain one."""
    samples = make_samples(21)
    baseline = make_trainer(model_dir, micro_batch_size=5, recompute_old_logprobs=True, max_grad_norm=None)
    recorded = with_behaviour(baseline, samples, math.log(1.5), set(range(len(samples))))
    plain = baseline.step(recorded)
    corrected = make_trainer(model_dir, micro_batch_size=5, correction=correction, max_grad_norm=None, **options)
    metrics = corrected.step(recorded)
    if scale is not None:
        assert metrics.loss == pytest.approx(scale * plain.loss, rel=1e-5, abs=1e-9)
        for a, b in zip(grads(baseline), grads(corrected), strict=True):
            torch.testing.assert_close(b, scale * a, rtol=1e-4, atol=1e-7)
    assert metrics.is_ratio_max == pytest.approx(
        1.5 ** (1 if "correction_level" not in options else max(len(s.response_token_ids) for s in samples)), rel=1e-4
    )
    assert (metrics.is_truncated_fraction, metrics.is_masked_fraction) == (truncated, masked)
    assert metrics.ratio_mean == pytest.approx(1.0) and plain.is_weight_mean is None


def test_rows_without_behaviour_logprobs_keep_weight_one_and_stay_out_of_the_statistics(model_dir: Path) -> None:
    samples = make_samples(22)
    recorded_rows = {0, 3, 4, 9}
    baseline = make_trainer(model_dir, recompute_old_logprobs=True)
    mixed = with_behaviour(baseline, samples, math.log(1.5), recorded_rows)
    plain = baseline.step(mixed)
    corrected = make_trainer(model_dir, correction="decoupled")
    metrics = corrected.step(mixed)
    # the loss of the first (on-policy) epoch is sum_b -A_b * n_b * w_b / N, with w_b = 1.5 only where recorded
    lengths = [len(s.response_token_ids) for s in samples]
    total = sum(lengths)
    expected = (
        sum(
            -s.advantage * n * (1.5 if i in recorded_rows else 1.0)
            for i, (s, n) in enumerate(zip(samples, lengths, strict=True))
        )
        / total
    )
    assert metrics.loss == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert plain.loss == pytest.approx(
        sum(-s.advantage * n for s, n in zip(samples, lengths, strict=True)) / total, rel=1e-5, abs=1e-7
    )
    assert metrics.is_weight_mean == pytest.approx(1.5, rel=1e-5)  # over the recorded rows' tokens only
    assert metrics.is_weight_max == pytest.approx(1.5, rel=1e-5)


def test_correction_settings_are_checked(model_dir: Path) -> None:
    with pytest.raises(ConfigurationError, match="unknown off-policy correction 'ips'; valid: tis, mis, decoupled"):
        TorchTrainerConfig(model_dir, correction="ips")
    with pytest.raises(ConfigurationError, match="valid: token, sequence"):
        TorchTrainerConfig(model_dir, correction="tis", correction_level="batch")
    with pytest.raises(ConfigurationError, match="correction_low <= correction_high"):
        TorchTrainerConfig(model_dir, correction="mis", correction_low=3.0, correction_high=2.0)
    with pytest.raises(ConfigurationError, match="valid: ppo_clip, dapo, gspo, cispo"):
        TorchTrainerConfig(model_dir, policy_loss="grpo")


def test_prefix_tree_merges_shared_prefixes_and_masks_ancestors_only() -> None:
    """Rows [1 2 3 4], [1 2 5], [1 2 3 6 7] and [8]: nodes 1 2 3 4 5 6 7 8 once each; a node sees its ancestors and
    itself, never a sibling branch; each row's tokens map to their nodes, padding to -1."""
    from fulmen.algorithm.trainer.prefix_tree import build_prefix_tree

    rows = [[1, 2, 3, 4, 0], [1, 2, 5, 0, 0], [1, 2, 3, 6, 7], [8, 0, 0, 0, 0]]
    ids = torch.tensor(rows)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    tree = build_prefix_tree(ids, mask)
    assert tree.size == 8
    assert tree.token_ids.tolist() == [1, 2, 3, 4, 6, 7, 5, 8]  # preorder, children in the order rows reach them
    assert tree.depth.tolist() == [0, 1, 2, 3, 3, 4, 2, 0]
    for row in range(4):  # each row's tokens are its nodes' tokens, at their depths
        nodes = tree.node_of[row][mask[row].bool()]
        assert tree.token_ids[nodes].tolist() == ids[row][mask[row].bool()].tolist()
        assert tree.depth[nodes].tolist() == list(range(len(nodes)))
    assert bool((tree.node_of[mask == 0] == -1).all())
    seen = tree.attention_mask()
    ancestors = {
        0: [0],
        1: [0, 1],
        2: [0, 1, 2],
        3: [0, 1, 2, 3],
        4: [0, 1, 2, 4],
        5: [0, 1, 2, 4, 5],
        6: [0, 1, 6],
        7: [7],
    }
    for node, expected in ancestors.items():
        assert torch.nonzero(seen[node]).flatten().tolist() == expected


def test_the_tree_is_chosen_only_when_rows_share_enough() -> None:
    """A group's calls with a long shared prompt run as a tree; rows that share nothing, or a model whose attention
    takes no custom mask, do not."""
    config = types.SimpleNamespace(hidden_size=64, _attn_implementation="sdpa")
    model = types.SimpleNamespace(config=config)
    prompt = list(range(10, 60))
    shared = collate([Sample(prompt, [70 + i, 80 + i]) for i in range(8)], pad_id=0)
    distinct = collate([Sample([100 + i, *prompt], [70, 80]) for i in range(8)], pad_id=0)
    tree = logprobs_module.shared_prefix_tree(model, shared.input_ids, shared.attention_mask)
    assert tree is not None and tree.size == 50 + 8 * 2
    assert logprobs_module.shared_prefix_tree(model, distinct.input_ids, distinct.attention_mask) is None
    config._attn_implementation = "flash_attention_2"
    assert logprobs_module.shared_prefix_tree(model, shared.input_ids, shared.attention_mask) is None


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_step_counts_the_tokens_it_computed_and_their_flops(model_dir: Path, lora: bool) -> None:
    """With prefix-tree micro-batches the decoder computes fewer tokens than the batch holds (the groups' prompts
    once each); the FLOPs are 2 per weight and token: the no-gradient pass once, the training pass 3 times (2 with
    LoRA: no weight gradients of the frozen base)."""
    samples = make_samples(5)
    trainer = make_trainer(
        model_dir, micro_batch_tokens=4096, recompute_old_logprobs=True, lora=LoraSettings(r=4) if lora else None
    )
    metrics = trainer.step(samples)
    batch = collate(samples, trainer.pad_id)
    tree = logprobs_module.build_prefix_tree(
        *[t for t in (batch.by_prefix().input_ids, batch.by_prefix().attention_mask)]
    )
    assert metrics.computed_tokens == tree.size < metrics.input_tokens
    head_rows = int(batch.response_mask.sum())  # every response token is predicted by one head row
    forward = 2.0 * (trainer.body_weights * tree.size + trainer.head_weights * head_rows)
    assert metrics.flops == pytest.approx(forward * (1 + (2 if lora else 3)))
    assert trainer.body_weights > 0 and trainer.head_weights == trainer.model.get_output_embeddings().weight.numel()


def test_building_the_tiny_model_prints_no_progress_bar(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from fulmen.algorithm.tiny_model import build_tiny_model

    capfd.readouterr()
    build_tiny_model(tmp_path / "tiny")  # `make demo` builds it on a fresh machine
    assert "Writing model shards" not in capfd.readouterr().err
