"""PPO-clip and the loss reduction: held equal to a plain loop; clipping, KL and micro-batch accumulation."""

from __future__ import annotations

import math

import pytest
import torch

from fulmen.algorithm.rl.losses import (
    Aggregation,
    LossAggregation,
    aggregate,
    batch_normalizer,
    get_aggregation,
    get_policy_loss_fn,
    k3_kl,
    ppo_clip,
    register_aggregation,
)
from fulmen.schemas.errors import ConfigurationError


def random_inputs(seed: int, rows: int = 6, width: int = 9) -> dict[str, torch.Tensor]:
    """Logprobs near old ones (some ratios outside the clip range), ragged masks incl. an empty row."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    new = old + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.3
    ref = old + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.2
    mask = torch.zeros(rows, width, dtype=torch.float64)
    for row in range(rows):
        start = int(torch.randint(1, 4, (1,), generator=g))
        stop = int(torch.randint(start, width + 1, (1,), generator=g))  # stop == start: an empty row
        mask[row, start:stop] = 1
    mask[0, 1:] = 1  # at least one long row
    advantages = torch.randn(rows, generator=g, dtype=torch.float64)
    return {"logprobs": new, "old_logprobs": old, "ref_logprobs": ref, "mask": mask, "advantages": advantages}


def reference_ppo(inputs: dict[str, torch.Tensor], mode: str, clip: float, clip_high: float, kl_coef: float) -> float:
    """PPO-clip + k3 KL written token by token with math.*, reduced per the mode's definition."""
    new, old, ref = (inputs[k].tolist() for k in ("logprobs", "old_logprobs", "ref_logprobs"))
    mask, adv = inputs["mask"].tolist(), inputs["advantages"].tolist()
    row_means, tokens = [], []
    for b in range(len(new)):
        values = []
        for t in range(len(new[b])):
            if not mask[b][t]:
                continue
            ratio = math.exp(new[b][t] - old[b][t])
            surrogate = max(-adv[b] * ratio, -adv[b] * min(max(ratio, 1 - clip), 1 + clip_high))
            d = ref[b][t] - new[b][t]
            values.append(surrogate + kl_coef * (math.exp(d) - d - 1))
        tokens += values
        if values:
            row_means.append(sum(values) / len(values))
    if mode == "token_mean":
        return sum(tokens) / len(tokens)
    return sum(row_means) / len(row_means)


@pytest.mark.parametrize("mode", list(LossAggregation))
@pytest.mark.parametrize(("clip", "clip_high", "kl_coef"), [(0.2, None, 0.0), (0.1, 0.28, 0.05)])
def test_ppo_clip_matches_the_loop_reference(mode: str, clip: float, clip_high: float | None, kl_coef: float) -> None:
    for seed in range(20):
        inputs = random_inputs(seed)
        loss, _ = ppo_clip(**inputs, clip_eps=clip, clip_eps_high=clip_high, aggregation=mode, kl_coef=kl_coef)
        expected = reference_ppo(inputs, mode, clip, clip_high if clip_high is not None else clip, kl_coef)
        assert loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)


def test_token_mean_and_seq_mean_differ_only_when_lengths_differ() -> None:
    per_token = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    ragged = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert aggregate(per_token, ragged, "token_mean").item() == pytest.approx(7 / 5)
    assert aggregate(per_token, ragged, "seq_mean").item() == pytest.approx((1 + 3) / 2)
    even = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    per_token = torch.tensor([[1.0, 2.0, 9.0, 9.0], [3.0, 5.0, 9.0, 9.0]])
    assert aggregate(per_token, even, "token_mean").item() == aggregate(per_token, even, "seq_mean").item() == 2.75


def test_masked_positions_never_leak_even_when_not_finite() -> None:
    per_token = torch.tensor([[1.0, float("nan"), float("inf")]])
    mask = torch.tensor([[1, 0, 0]])
    for mode in LossAggregation:
        assert aggregate(per_token, mask, mode).item() == 1.0


def test_all_masked_reduces_to_zero() -> None:
    for mode in LossAggregation:
        assert aggregate(torch.ones(2, 3), torch.zeros(2, 3), mode).item() == 0.0


@pytest.mark.parametrize("mode", list(LossAggregation))
def test_micro_batch_losses_sum_to_the_full_batch_loss(mode: str) -> None:
    inputs = random_inputs(7, rows=8)
    full, _ = ppo_clip(**inputs, aggregation=mode, kl_coef=0.1)
    normalizer = batch_normalizer(inputs["mask"], mode)
    pieces = [
        ppo_clip(**{k: v[i : i + 3] for k, v in inputs.items()}, aggregation=mode, kl_coef=0.1, normalizer=normalizer)
        for i in range(0, 8, 3)
    ]
    assert sum(loss for loss, _ in pieces).item() == pytest.approx(full.item(), rel=1e-12)
    # The same pieces reduced each on its own (no shared normalizer) do not add up: the normalizer matters.
    alone = [ppo_clip(**{k: v[i : i + 3] for k, v in inputs.items()}, aggregation=mode)[0] for i in range(0, 8, 3)]
    assert sum(alone).item() != pytest.approx(full.item(), rel=1e-3)


def test_batch_normalizer_counts_tokens_or_non_empty_rows() -> None:
    mask = torch.tensor([[0, 1, 1], [0, 0, 0], [1, 0, 0]])
    assert batch_normalizer(mask, "token_mean") == 3.0
    assert batch_normalizer(mask, "seq_mean") == 2.0


def surrogate_grad(ratio: float, advantage: float, clip: float = 0.2) -> float:
    """d loss / d logprob for one token whose ratio to the old policy is ``ratio``."""
    logprobs = torch.tensor([[0.0, math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    loss, _ = ppo_clip(
        logprobs,
        torch.zeros(1, 2, dtype=torch.float64),
        torch.tensor([advantage], dtype=torch.float64),
        torch.tensor([[0.0, 1.0]]),
        clip_eps=clip,
    )
    loss.backward()
    return logprobs.grad[0, 1].item()


def test_clipping_stops_the_gradient_only_beyond_the_boundary_in_the_advantage_direction() -> None:
    # Positive advantage: pushing the ratio up is cut off above 1 + eps; below it the gradient is -A * ratio.
    assert surrogate_grad(1.19, 1.0) == pytest.approx(-1.19)
    assert surrogate_grad(1.21, 1.0) == 0.0
    assert surrogate_grad(0.5, 1.0) == pytest.approx(-0.5)  # a ratio far below 1 still gets pushed up
    # Negative advantage: cut off below 1 - eps; above 1 + eps the (pessimistic) unclipped term stays active.
    assert surrogate_grad(0.81, -1.0) == pytest.approx(0.81)
    assert surrogate_grad(0.79, -1.0) == 0.0
    assert surrogate_grad(1.5, -1.0) == pytest.approx(1.5)


def test_clip_fraction_counts_strictly_clipped_tokens() -> None:
    ratios = torch.tensor([[1.0, 1.3, 0.7, 1.2]], dtype=torch.float64)  # 1.2 is exactly on the boundary
    _, metrics = ppo_clip(
        ratios.log(), torch.zeros_like(ratios), torch.tensor([1.0], dtype=torch.float64), torch.ones_like(ratios)
    )
    # A > 0: only 1.3 is clipped (0.7 below 1 - eps keeps its gradient; 1.2 gives equal terms)
    assert metrics.clip_fraction.item() == pytest.approx(0.25)
    assert metrics.ratio_mean.item() == pytest.approx(1.05)
    assert metrics.approx_kl.item() == pytest.approx(-ratios.log().mean().item())
    assert metrics.tokens.item() == 4


def test_kl_is_zero_when_policy_equals_reference() -> None:
    inputs = random_inputs(3)
    inputs["ref_logprobs"] = inputs["logprobs"].clone()
    with_kl, metrics = ppo_clip(**inputs, kl_coef=0.5)
    without, _ = ppo_clip(**{k: v for k, v in inputs.items() if k != "ref_logprobs"})
    assert metrics.ref_kl.item() == 0.0
    assert with_kl.item() == without.item()
    assert torch.equal(k3_kl(inputs["logprobs"], inputs["logprobs"]), torch.zeros_like(inputs["logprobs"]))


def test_k3_is_positive_and_matches_its_formula() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -0.1]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -0.5, -0.1]], dtype=torch.float64)
    d = ref - logprobs
    torch.testing.assert_close(k3_kl(logprobs, ref), d.exp() - d - 1)
    assert bool((k3_kl(logprobs, ref)[0, :2] > 0).all())


def test_metrics_are_detached_and_the_loss_is_not() -> None:
    inputs = random_inputs(5)
    inputs["logprobs"].requires_grad_(True)
    loss, metrics = ppo_clip(**inputs, kl_coef=0.1)
    assert loss.requires_grad and loss.ndim == 0
    assert all(not value.requires_grad and value.ndim == 0 for value in vars(metrics).values())
    assert set(metrics.as_floats()) == {"clip_fraction", "approx_kl", "ref_kl", "ratio_mean", "tokens"}


def test_argument_errors() -> None:
    inputs = random_inputs(0)
    with pytest.raises(ValueError, match="advantages must be"):
        ppo_clip(**{**inputs, "advantages": inputs["advantages"][:2]})
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        ppo_clip(**{k: v for k, v in inputs.items() if k != "ref_logprobs"}, kl_coef=0.1)
    with pytest.raises(ValueError, match="clip_eps"):
        ppo_clip(**inputs, clip_eps=1.5)


def test_registries_answer_unknown_names_with_the_valid_ones() -> None:
    with pytest.raises(ConfigurationError, match="unknown policy loss 'grpo'; valid: ppo_clip, dapo, gspo, cispo"):
        get_policy_loss_fn("grpo")
    with pytest.raises(ConfigurationError, match="unknown loss aggregation 'token_sum'; valid: token_mean, seq_mean"):
        get_aggregation("token_sum")
    with pytest.raises(ConfigurationError, match="already registered"):
        register_aggregation("seq_mean", Aggregation(total=lambda x, keep: x.sum(), count=lambda keep: keep.sum()))
    assert get_policy_loss_fn("ppo_clip") is ppo_clip


# -- DAPO, GSPO, CISPO and off-policy weights ----------------------------------------------------------------------


def random_weights(seed: int, like: torch.Tensor) -> torch.Tensor:
    """Importance weights as a correction makes them: positive, some 0 (masked), some truncated at 2."""
    g = torch.Generator().manual_seed(1000 + seed)
    weights = torch.exp(torch.randn(like.shape, generator=g, dtype=like.dtype) * 0.5).clamp(max=2.0)
    return weights.masked_fill(torch.rand(like.shape, generator=g, dtype=like.dtype) < 0.1, 0.0)


def reduce_rows(rows: list[list[float]], mode: str) -> float:
    """token_mean or seq_mean of ragged per-token values, by definition (empty rows count in neither)."""
    tokens = [v for row in rows for v in row]
    if mode == "token_mean":
        return sum(tokens) / len(tokens)
    means = [sum(row) / len(row) for row in rows if row]
    return sum(means) / len(means)


def reference_policy_loss(
    name: str, inputs: dict[str, torch.Tensor], mode: str, low: float, high: float, weights: torch.Tensor | None
) -> float:
    """ppo_clip / dapo, gspo and cispo token by token with math.*: the formulas of their docstrings."""
    new, old, mask = inputs["logprobs"].tolist(), inputs["old_logprobs"].tolist(), inputs["mask"].tolist()
    adv = inputs["advantages"].tolist()
    w = weights.tolist() if weights is not None else [[1.0] * len(row) for row in new]
    rows = []
    for b in range(len(new)):
        positions = [t for t in range(len(new[b])) if mask[b][t]]
        if positions:
            seq_ratio = math.exp(sum(new[b][t] - old[b][t] for t in positions) / len(positions))
        values = []
        for t in positions:
            ratio = seq_ratio if name == "gspo" else math.exp(new[b][t] - old[b][t])
            if name == "cispo":
                value = -min(max(ratio, 1 - low), 1 + high) * adv[b] * new[b][t]
            else:
                value = max(-adv[b] * ratio, -adv[b] * min(max(ratio, 1 - low), 1 + high))
            values.append(w[b][t] * value)
        rows.append(values)
    return reduce_rows(rows, mode)


@pytest.mark.parametrize("mode", list(LossAggregation))
@pytest.mark.parametrize(
    ("name", "low", "high"),
    [
        ("ppo_clip", 0.2, 0.2),
        ("dapo", 0.2, 0.28),
        ("gspo", 3e-4, 4e-4),
        ("gspo", 0.1, 0.2),
        ("cispo", 1.0, 3.0),
        ("cispo", 0.2, 0.28),
    ],
)
def test_every_loss_matches_its_loop_reference_with_and_without_weights(
    name: str, low: float, high: float, mode: str
) -> None:
    loss_fn = get_policy_loss_fn(name)
    for seed in range(10):
        inputs = {k: v for k, v in random_inputs(seed).items() if k != "ref_logprobs"}
        for weights in (None, random_weights(seed, inputs["logprobs"])):
            loss, metrics = loss_fn(**inputs, clip_eps=low, clip_eps_high=high, aggregation=mode, weights=weights)
            expected = reference_policy_loss(name, inputs, mode, low, high, weights)
            assert loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)
            assert metrics.tokens.item() == inputs["mask"].sum().item()


def test_dapo_is_clip_higher_ppo_with_token_mean_by_default() -> None:
    inputs = random_inputs(4)
    inputs["logprobs"][0, 1] = inputs["old_logprobs"][0, 1] + math.log(1.25)  # between 1 + 0.2 and 1 + 0.28
    inputs["advantages"][0] = 1.0
    dapo_loss, dapo_metrics = get_policy_loss_fn("dapo")(**inputs)
    ppo_loss, _ = ppo_clip(**inputs, clip_eps=0.2, clip_eps_high=0.28, aggregation="token_mean")
    assert dapo_loss.item() == ppo_loss.item()
    symmetric, symmetric_metrics = ppo_clip(**inputs)
    assert symmetric_metrics.clip_fraction.item() > dapo_metrics.clip_fraction.item()  # 1.25 is clipped only there
    assert dapo_loss.item() < symmetric.item()


def test_gspo_gradient_is_the_sequence_objective_gradient() -> None:
    """seq_mean GSPO = -mean_b min(s_b A_b, clip(s_b) A_b) with s_b the length-normalised sequence ratio."""
    for seed in range(5):
        inputs = random_inputs(seed)
        ours = inputs["logprobs"].clone().requires_grad_(True)
        loss, _ = get_policy_loss_fn("gspo")(
            ours, inputs["old_logprobs"], inputs["advantages"], inputs["mask"], clip_eps=0.05, clip_eps_high=0.08
        )
        loss.backward()
        theirs = inputs["logprobs"].clone().requires_grad_(True)
        terms = []
        for b in range(theirs.shape[0]):
            keep = inputs["mask"][b].bool()
            if not keep.any():
                continue
            s = torch.exp((theirs[b][keep] - inputs["old_logprobs"][b][keep]).mean())
            a = inputs["advantages"][b]
            terms.append(-torch.minimum(s * a, s.clamp(0.95, 1.08) * a))
        torch.stack(terms).mean().backward()
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-10, atol=1e-12)


def test_gspo_clips_whole_sequences() -> None:
    old = torch.zeros(2, 3, dtype=torch.float64)
    new = torch.tensor([[0.0, 0.3, 0.3], [0.0, 0.0, 0.0]], dtype=torch.float64)  # row 0: s = exp(0.3) > 1 + eps
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    _, metrics = get_policy_loss_fn("gspo")(new, old, torch.tensor([1.0, 1.0], dtype=torch.float64), mask)
    assert metrics.clip_fraction.item() == 0.5  # both tokens of row 0, none of row 1
    assert metrics.ratio_mean.item() == pytest.approx((2 * math.exp(0.3) + 2) / 4)


def test_cispo_keeps_the_gradient_of_tokens_ppo_would_clip() -> None:
    """CISPO's gradient is -clip(ratio) * A * grad logprobs: bounded, never zero, unlike PPO's beyond the clip."""
    old = torch.zeros(1, 4, dtype=torch.float64)
    ratios = torch.tensor([[1.0, 1.0, 1.5, 9.0]], dtype=torch.float64)  # 1.5 and 9 lie beyond PPO's 1.2
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    advantage = torch.tensor([2.0], dtype=torch.float64)
    new = ratios.log().requires_grad_(True)
    loss, metrics = get_policy_loss_fn("cispo")(new, old, advantage, mask, clip_eps=1.0, clip_eps_high=3.0)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, -2.0, -3.0, -8.0]], dtype=torch.float64) / 3)
    assert metrics.clip_fraction.item() == pytest.approx(1 / 3)  # only 9 > 4 was clipped
    ppo_new = ratios.log().requires_grad_(True)
    ppo_clip(ppo_new, old, advantage, mask)[0].backward()
    assert ppo_new.grad[0, 2].item() == ppo_new.grad[0, 3].item() == 0.0


def test_weights_scale_the_gradient_and_are_not_differentiated() -> None:
    inputs = {k: v for k, v in random_inputs(9).items() if k != "ref_logprobs"}
    weights = random_weights(9, inputs["logprobs"]).requires_grad_(True)
    for name in ("ppo_clip", "gspo", "cispo"):
        plain = inputs["logprobs"].clone().requires_grad_(True)
        weighted = inputs["logprobs"].clone().requires_grad_(True)
        get_policy_loss_fn(name)(plain, *(inputs[k] for k in ("old_logprobs", "advantages", "mask")))[0].backward()
        loss, _ = get_policy_loss_fn(name)(
            weighted, *(inputs[k] for k in ("old_logprobs", "advantages", "mask")), weights=weights
        )
        loss.backward()
        assert weights.grad is None  # detached inside: importance weights change the measure, not the objective
        if name != "gspo":  # per-token terms: each token's gradient scales by its own weight
            torch.testing.assert_close(weighted.grad, plain.grad * weights.detach(), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="weights must be"):
        ppo_clip(**inputs, weights=weights[:, :2])


@pytest.mark.parametrize("name", ["dapo", "gspo", "cispo"])
@pytest.mark.parametrize("mode", list(LossAggregation))
def test_micro_batches_sum_to_the_full_batch_for_every_loss(name: str, mode: str) -> None:
    inputs = random_inputs(13, rows=8)
    loss_fn = get_policy_loss_fn(name)
    full, _ = loss_fn(**inputs, aggregation=mode, kl_coef=0.1)
    normalizer = batch_normalizer(inputs["mask"], mode)
    pieces = [
        loss_fn(**{k: v[i : i + 3] for k, v in inputs.items()}, aggregation=mode, kl_coef=0.1, normalizer=normalizer)[0]
        for i in range(0, 8, 3)
    ]
    assert sum(pieces).item() == pytest.approx(full.item(), rel=1e-12)
