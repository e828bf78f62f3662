"""Off-policy corrections (TIS, MIS, decoupled) held equal to a plain loop at token and sequence level; their
statistics, the combination over micro-batches, neutrality outside the mask and the registry's errors."""

from __future__ import annotations

import math

import pytest
import torch

from fulmen.algorithm.rl.corrections import (
    Correction,
    CorrectionLevel,
    ImportanceStats,
    get_correction_fn,
    register_correction,
)
from fulmen.schemas.errors import ConfigurationError
from tests.unit.test_losses import random_inputs


def random_logprobs(seed: int, rows: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_ratio, mask)``: proximal minus behaviour logprobs of a ragged batch (an empty row), some ratios far
    from 1."""
    inputs = random_inputs(seed, rows=rows, width=8)
    return (inputs["logprobs"] - inputs["old_logprobs"]) * 2, inputs["mask"]


def reference_weights(
    name: str, log_ratio: torch.Tensor, mask: torch.Tensor, level: str, low: float, high: float
) -> list[list[float]]:
    """The weights of the module docstring with math.*, token by token; 1 outside the mask."""
    out = []
    for lr_row, mask_row in zip(log_ratio.tolist(), mask.tolist(), strict=True):
        row_sum = sum(v for v, m in zip(lr_row, mask_row, strict=True) if m)
        weights = []
        for value, keep in zip(lr_row, mask_row, strict=True):
            if not keep:
                weights.append(1.0)
                continue
            rho = math.exp(row_sum if level == "sequence" else value)
            if name == "tis":
                weights.append(min(rho, high))
            elif name == "mis":
                weights.append(rho if low <= rho <= high else 0.0)
            else:
                weights.append(rho)
        out.append(weights)
    return out


@pytest.mark.parametrize("level", list(CorrectionLevel))
@pytest.mark.parametrize(
    ("name", "low", "high"),
    [("tis", 0.0, 2.0), ("tis", 0.0, 1.2), ("mis", 0.0, 2.0), ("mis", 0.5, 1.5), ("decoupled", 0.0, 2.0)],
)
def test_weights_and_statistics_match_the_loop_reference(name: str, low: float, high: float, level: str) -> None:
    fn = get_correction_fn(name)
    for seed in range(10):
        log_ratio, mask = random_logprobs(seed)
        weights, stats = fn(log_ratio, mask, level=level, low=low, high=high)
        expected = reference_weights(name, log_ratio, mask, level, low, high)
        torch.testing.assert_close(weights, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
        covered = [
            (w, math.exp(sum(v for v, k in zip(lr, m, strict=True) if k) if level == "sequence" else v))
            for w_row, lr, m in zip(expected, log_ratio.tolist(), mask.tolist(), strict=True)
            for w, v, k in zip(w_row, lr, m, strict=True)
            if k
        ]
        floats = stats.as_floats()
        assert floats["tokens"] == len(covered)
        assert floats["weight_mean"] == pytest.approx(sum(w for w, _ in covered) / len(covered), rel=1e-12)
        assert floats["weight_max"] == pytest.approx(max(w for w, _ in covered), rel=1e-12)
        assert floats["ratio_max"] == pytest.approx(max(r for _, r in covered), rel=1e-12)
        assert floats["truncated_fraction"] == pytest.approx(sum(0 < w < r for w, r in covered) / len(covered))
        assert floats["masked_fraction"] == pytest.approx(sum(w == 0 for w, _ in covered) / len(covered))


def test_the_corrections_do_what_their_names_say() -> None:
    log_ratio = torch.log(torch.tensor([[1.0, 0.25, 1.0, 3.0, 1.1]], dtype=torch.float64))
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    tis, tis_stats = get_correction_fn("tis")(log_ratio, mask, high=2.0)
    mis, mis_stats = get_correction_fn("mis")(log_ratio, mask, level="token", low=0.5, high=2.0)
    exact, exact_stats = get_correction_fn("decoupled")(log_ratio, mask)
    torch.testing.assert_close(tis, torch.tensor([[1.0, 0.25, 1.0, 2.0, 1.1]], dtype=torch.float64))
    torch.testing.assert_close(mis, torch.tensor([[1.0, 0.0, 1.0, 0.0, 1.1]], dtype=torch.float64))
    torch.testing.assert_close(exact, torch.tensor([[1.0, 0.25, 1.0, 3.0, 1.1]], dtype=torch.float64))
    assert (tis_stats.truncated_fraction.item(), tis_stats.masked_fraction.item()) == (0.25, 0.0)
    assert (mis_stats.truncated_fraction.item(), mis_stats.masked_fraction.item()) == (0.0, 0.5)
    assert (exact_stats.truncated_fraction.item(), exact_stats.masked_fraction.item()) == (0.0, 0.0)
    assert tis_stats.ratio_max.item() == pytest.approx(3.0) and tis_stats.weight_max.item() == pytest.approx(2.0)
    # sequence level: one weight per row, the product of its token ratios (0.25 * 3 * 1.1 = 0.825, inside)
    seq, _ = get_correction_fn("mis")(log_ratio, mask, level="sequence", low=0.5, high=2.0)
    torch.testing.assert_close(seq, torch.tensor([[1.0, 0.825, 0.825, 0.825, 0.825]], dtype=torch.float64))


def test_equal_policies_give_weight_one_everywhere() -> None:
    _, mask = random_logprobs(3)
    for name in Correction:
        for level in CorrectionLevel:
            weights, stats = get_correction_fn(name)(torch.zeros_like(mask), mask, level=level)
            assert bool((weights == 1).all()), (name, level)
            assert stats.weight_mean.item() == stats.ratio_max.item() == 1.0
            assert stats.truncated_fraction.item() == stats.masked_fraction.item() == 0.0


def test_weights_are_detached_and_huge_ratios_stay_finite() -> None:
    log_ratio, mask = random_logprobs(4)
    log_ratio = (log_ratio * 100).requires_grad_(True)  # exp(+-600) without the clamp
    for name in Correction:
        weights, stats = get_correction_fn(name)(log_ratio, mask, level="sequence")
        assert not weights.requires_grad and bool(torch.isfinite(weights).all())
        assert math.isfinite(stats.ratio_max.item()) and stats.ratio_max.item() <= math.exp(20) * (1 + 1e-12)


def test_combining_micro_batches_equals_the_whole_batch() -> None:
    log_ratio, mask = random_logprobs(5, rows=9)
    mask[4] = 0  # a micro-batch may hold a row without recorded logprobs
    for name in Correction:
        whole = get_correction_fn(name)(log_ratio, mask, high=1.5)[1].as_floats()
        parts = [get_correction_fn(name)(log_ratio[i : i + 4], mask[i : i + 4], high=1.5)[1] for i in (0, 4, 8)]
        combined = ImportanceStats.combine(parts).as_floats()
        assert combined == pytest.approx(whole, rel=1e-12)
    empty = get_correction_fn("tis")(log_ratio[:1], torch.zeros_like(mask[:1]))[1]
    assert empty.as_floats() == {
        "weight_mean": 1.0,
        "weight_max": 1.0,
        "ratio_max": 1.0,
        "truncated_fraction": 0.0,
        "masked_fraction": 0.0,
        "tokens": 0.0,
    }
    assert ImportanceStats.combine([empty, empty]).as_floats() == empty.as_floats()


def test_argument_and_registry_errors() -> None:
    log_ratio, mask = random_logprobs(6)
    with pytest.raises(ValueError, match="low <= high"):
        get_correction_fn("mis")(log_ratio, mask, low=2.0, high=1.0)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        get_correction_fn("tis")(log_ratio, mask[:, :3])
    with pytest.raises(ConfigurationError, match="unknown importance-ratio level 'geometric'; valid: token, sequence"):
        get_correction_fn("tis")(log_ratio, mask, level="geometric")
    with pytest.raises(ConfigurationError, match="unknown off-policy correction 'is'; valid: tis, mis, decoupled"):
        get_correction_fn("is")
    with pytest.raises(ConfigurationError, match="already registered"):
        register_correction("tis")(lambda log_ratio, mask, **options: None)
