"""Our advantages and PPO loss held equal to verl's ``core_algos`` (the reference implementation at scale).

Needs verl (the optional ``gpu`` extra); skipped without it. Covered: ``compute_grpo_outcome_advantage`` (with
and without std normalisation = our grpo and dr_grpo), ``compute_rloo_outcome_advantage``,
``compute_policy_loss_vanilla`` (token-mean and seq-mean-token-mean, clip-higher, micro-batch normalisation
through ``global_batch_info``), ``agg_loss`` and ``kl_penalty(..., "low_var_kl")``. Known, intended differences
(not tested): a group of one sample (verl: advantage r for RLOO, r / (1 + eps) for GRPO; ours: 0) and verl's
dual clip at ratio 3 for negative advantages (ours has none; ratios here stay inside (1/3, 3)).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

try:
    import verl  # noqa: F401
except ImportError:
    pytest.skip("verl not installed (the optional gpu extra: pip install 'fulmen[gpu]')", allow_module_level=True)

from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig

from fulmen.algorithm.advantages import compute_advantages, encode_group_ids
from fulmen.algorithm.losses import aggregate, batch_normalizer, k3_kl, ppo_clip

VERL_AGGREGATION = {"token_mean": "token-mean", "seq_mean": "seq-mean-token-mean"}


def grouped_rewards(seed: int) -> tuple[torch.Tensor, list[str]]:
    """Groups of 2..8 samples (verl treats a lone sample differently on purpose), some with equal rewards."""
    g = torch.Generator().manual_seed(seed)
    rewards, uids = [], []
    for group in range(6):
        size = int(torch.randint(2, 9, (1,), generator=g))
        if group == 0:
            rewards += [1.0] * size
        else:
            rewards += torch.randint(0, 3, (size,), generator=g).float().div(2).tolist()
        uids += [f"uid-{group}"] * size
    return torch.tensor(rewards), uids


def verl_outcome(function, rewards: torch.Tensor, uids: list[str], **kwargs: object) -> torch.Tensor:
    """verl's estimators take token-level rewards [N, L] (the score on the last token) and give [N, L]."""
    token_rewards = torch.zeros(len(rewards), 5)
    token_rewards[:, -1] = rewards
    advantages, _ = function(token_rewards, torch.ones(len(rewards), 5), np.array(uids, dtype=object), **kwargs)
    return advantages[:, 0]


@pytest.mark.parametrize("seed", range(5))
def test_advantages_match_verl(seed: int) -> None:
    rewards, uids = grouped_rewards(seed)
    groups = encode_group_ids(uids)
    ours = {name: compute_advantages(name, rewards, groups) for name in ("grpo", "dr_grpo", "rloo")}
    grpo = verl_outcome(core_algos.compute_grpo_outcome_advantage, rewards, uids, epsilon=1e-6)
    dr_grpo = verl_outcome(core_algos.compute_grpo_outcome_advantage, rewards, uids, norm_adv_by_std_in_grpo=False)
    rloo = verl_outcome(core_algos.compute_rloo_outcome_advantage, rewards, uids)
    torch.testing.assert_close(ours["grpo"], grpo, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours["dr_grpo"], dr_grpo, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours["rloo"], rloo, rtol=1e-5, atol=1e-6)


def policy_inputs(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows, width = 8, 12
    old = -torch.rand(rows, width, generator=g) * 4
    new = old + (torch.randn(rows, width, generator=g) * 0.3).clamp(-1.0, 1.0)  # ratios inside (1/3, 3)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    return {"logprobs": new, "old_logprobs": old, "advantages": torch.randn(rows, generator=g), "mask": mask}


def actor_config(clip_low: float, clip_high: float, **global_batch_info: float) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=1, clip_ratio=clip_low,
        clip_ratio_low=clip_low, clip_ratio_high=clip_high, global_batch_info=dict(global_batch_info),
    )  # fmt: skip


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
@pytest.mark.parametrize(("clip_low", "clip_high"), [(0.2, 0.2), (0.2, 0.28)])
def test_ppo_clip_loss_gradient_and_metrics_match_verl(aggregation: str, clip_low: float, clip_high: float) -> None:
    for seed in range(5):
        inputs = policy_inputs(seed)
        new_ours = inputs["logprobs"].clone().requires_grad_(True)
        new_verl = inputs["logprobs"].clone().requires_grad_(True)
        ours, metrics = ppo_clip(
            new_ours, inputs["old_logprobs"], inputs["advantages"], inputs["mask"],
            clip_eps=clip_low, clip_eps_high=clip_high, aggregation=aggregation,
        )  # fmt: skip
        theirs, verl_metrics = core_algos.compute_policy_loss_vanilla(
            inputs["old_logprobs"], new_verl, inputs["advantages"][:, None].expand_as(inputs["mask"]),
            inputs["mask"], loss_agg_mode=VERL_AGGREGATION[aggregation], config=actor_config(clip_low, clip_high),
        )  # fmt: skip
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
        ours.backward()
        theirs.backward()
        torch.testing.assert_close(new_ours.grad, new_verl.grad, rtol=1e-5, atol=1e-7)
        assert metrics.clip_fraction.item() == pytest.approx(verl_metrics["actor/pg_clipfrac"], abs=1e-6)
        assert metrics.approx_kl.item() == pytest.approx(verl_metrics["actor/ppo_kl"], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_micro_batch_normalisation_matches_verl_global_batch_info(aggregation: str) -> None:
    inputs = policy_inputs(11)
    normalizer = batch_normalizer(inputs["mask"], aggregation)
    info = {"dp_size": 1, "batch_num_tokens": normalizer, "global_batch_size": normalizer}
    part = {k: v[:3] for k, v in inputs.items()}
    ours, _ = ppo_clip(**part, aggregation=aggregation, normalizer=normalizer)
    theirs, _ = core_algos.compute_policy_loss_vanilla(
        part["old_logprobs"], part["logprobs"], part["advantages"][:, None].expand_as(part["mask"]), part["mask"],
        loss_agg_mode=VERL_AGGREGATION[aggregation], config=actor_config(0.2, 0.2, **info),
    )  # fmt: skip
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_aggregate_and_k3_match_verl(aggregation: str) -> None:
    inputs = policy_inputs(12)
    ref = inputs["old_logprobs"] + torch.randn_like(inputs["old_logprobs"]) * 0.5
    ours_kl = k3_kl(inputs["logprobs"], ref)
    torch.testing.assert_close(ours_kl, core_algos.kl_penalty(inputs["logprobs"], ref, "low_var_kl"))
    torch.testing.assert_close(
        aggregate(ours_kl, inputs["mask"], aggregation),
        core_algos.agg_loss(ours_kl, inputs["mask"], VERL_AGGREGATION[aggregation]),
        rtol=1e-5, atol=1e-7,
    )  # fmt: skip
