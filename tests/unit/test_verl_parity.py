"""Our advantages, losses and off-policy corrections held equal to verl 0.9.1 (the reference implementation at scale).

Needs verl (the optional ``gpu`` extra); skipped without it. Covered, from ``verl.trainer.ppo.core_algos``:
``compute_grpo_outcome_advantage`` (with and without std normalisation = our grpo and dr_grpo),
``compute_rloo_outcome_advantage``, ``compute_policy_loss_vanilla`` (= ppo_clip and dapo: token-mean and
seq-mean-token-mean, clip-higher, micro-batch normalisation through ``global_batch_info``),
``compute_policy_loss_gspo``, ``compute_policy_loss_cispo``, each with ``rollout_is_weights`` (= our ``weights``),
``agg_loss`` and ``kl_penalty(..., "low_var_kl")``; from ``verl.trainer.ppo.rollout_corr_helper``:
``compute_rollout_correction_weights`` at token and sequence level with one threshold (= tis), with
``"low_high"`` (IcePop = mis) and with an infinite threshold (= decoupled), their statistics, and verl's
decoupled mode end to end (the vanilla loss around the recomputed old logprobs, weighted); from
``verl.workers.reward_manager.dapo``: ``DAPORewardManager``'s overlong penalty (= overlong_penalty up to the
limit). Not in verl 0.9.1 as a function: dynamic sampling (a branch of its DAPO trainer loop); loop references
cover it. Known, intended differences (not tested): a group of one sample (verl: advantage r for RLOO,
r / (1 + eps) for GRPO; ours: 0), verl's dual clip at ratio 3 for negative advantages (ours has none; ratios
here stay inside (1/3, 3)), GSPO's log-ratio clamp (verl: at most 10 after adding the token term; ours: +-20
on the sequence's), and verl's sequence-level "fraction high" statistic (per sequence; ours per token).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

try:
    import verl  # noqa: F401
except ImportError:
    pytest.skip("verl not installed (the optional gpu extra: pip install 'fulmen[gpu]')", allow_module_level=True)

from types import SimpleNamespace

from verl import DataProto
from verl.trainer.ppo import core_algos, rollout_corr_helper
from verl.workers.config import ActorConfig
from verl.workers.reward_manager.dapo import DAPORewardManager

from fulmen.algorithm.rl.advantages import compute_advantages, encode_group_ids
from fulmen.algorithm.rl.corrections import get_correction_fn
from fulmen.algorithm.rl.losses import aggregate, batch_normalizer, get_policy_loss_fn, k3_kl, ppo_clip
from fulmen.algorithm.rl.shaping import overlong_penalty

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
        strategy="fsdp",
        rollout_n=4,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=clip_low,
        clip_ratio_low=clip_low,
        clip_ratio_high=clip_high,
        global_batch_info=dict(global_batch_info),
    )


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_micro_batch_normalisation_matches_verl_global_batch_info(aggregation: str) -> None:
    inputs = policy_inputs(11)
    normalizer = batch_normalizer(inputs["mask"], aggregation)
    info = {"dp_size": 1, "batch_num_tokens": normalizer, "global_batch_size": normalizer}
    part = {k: v[:3] for k, v in inputs.items()}
    ours, _ = ppo_clip(**part, aggregation=aggregation, normalizer=normalizer)
    theirs, _ = core_algos.compute_policy_loss_vanilla(
        part["old_logprobs"],
        part["logprobs"],
        part["advantages"][:, None].expand_as(part["mask"]),
        part["mask"],
        loss_agg_mode=VERL_AGGREGATION[aggregation],
        config=actor_config(0.2, 0.2, **info),
    )
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
        rtol=1e-5,
        atol=1e-7,
    )


VERL_LOSSES = {
    "ppo_clip": core_algos.compute_policy_loss_vanilla,
    "dapo": core_algos.compute_policy_loss_vanilla,
    "gspo": core_algos.compute_policy_loss_gspo,
    "cispo": core_algos.compute_policy_loss_cispo,
}


def is_weights(seed: int, like: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + seed)
    return torch.exp(torch.randn(like.shape, generator=g) * 0.4).clamp(max=2.0)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
@pytest.mark.parametrize(
    ("name", "clip_low", "clip_high"),
    [
        ("ppo_clip", 0.2, 0.2),
        ("ppo_clip", 0.2, 0.28),
        ("dapo", 0.2, 0.28),
        ("gspo", 3e-4, 4e-4),
        ("gspo", 0.05, 0.1),
        ("cispo", 1.0, 3.0),
        ("cispo", 0.2, 0.28),
    ],
)
def test_every_policy_loss_gradient_and_metrics_match_verl(
    name: str, clip_low: float, clip_high: float, aggregation: str
) -> None:
    ours_fn, theirs_fn = get_policy_loss_fn(name), VERL_LOSSES[name]
    for seed in range(5):
        inputs = policy_inputs(seed)
        for weights in (None, is_weights(seed, inputs["logprobs"])):
            new_ours = inputs["logprobs"].clone().requires_grad_(True)
            new_verl = inputs["logprobs"].clone().requires_grad_(True)
            ours, metrics = ours_fn(
                new_ours,
                inputs["old_logprobs"],
                inputs["advantages"],
                inputs["mask"],
                clip_eps=clip_low,
                clip_eps_high=clip_high,
                aggregation=aggregation,
                weights=weights,
            )
            theirs, verl_metrics = theirs_fn(
                inputs["old_logprobs"],
                new_verl,
                inputs["advantages"][:, None].expand_as(inputs["mask"]),
                inputs["mask"],
                loss_agg_mode=VERL_AGGREGATION[aggregation],
                config=actor_config(clip_low, clip_high),
                rollout_is_weights=weights,
            )
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
            ours.backward()
            theirs.backward()
            torch.testing.assert_close(new_ours.grad, new_verl.grad, rtol=1e-5, atol=1e-7)
            assert metrics.clip_fraction.item() == pytest.approx(verl_metrics["actor/pg_clipfrac"], abs=1e-6)
            assert metrics.approx_kl.item() == pytest.approx(verl_metrics["actor/ppo_kl"], rel=1e-5, abs=1e-7)


def correction_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_ratio, mask)``: proximal minus behaviour logprobs, every row with at least one token."""
    inputs = policy_inputs(seed)
    g = torch.Generator().manual_seed(200 + seed)
    return torch.randn(inputs["mask"].shape, generator=g) * 0.5, inputs["mask"]


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize(
    ("name", "low", "high", "verl_threshold"),
    [
        ("tis", 0.0, 2.0, 2.0),
        ("tis", 0.0, 1.3, 1.3),
        ("mis", 0.5, 2.0, "0.5_2.0"),
        ("mis", 0.3, 3.0, "0.3_3.0"),
        ("decoupled", 0.0, 2.0, float("inf")),
    ],
)
def test_importance_weights_and_their_statistics_match_verl(
    name: str, low: float, high: float, verl_threshold: float | str, level: str
) -> None:
    for seed in range(5):
        log_ratio, mask = correction_inputs(seed)
        ours, stats = get_correction_fn(name)(log_ratio, mask, level=level, low=low, high=high)
        theirs, verl_metrics = rollout_corr_helper.compute_rollout_correction_weights(
            log_ratio, mask, rollout_is=level, rollout_is_threshold=verl_threshold
        )
        torch.testing.assert_close(ours * mask, theirs, rtol=1e-5, atol=1e-7)  # verl: 0 outside the mask, ours 1
        assert stats.weight_mean.item() == pytest.approx(verl_metrics["rollout_is_mean"], rel=1e-5)
        if level == "token":
            assert stats.weight_max.item() == pytest.approx(verl_metrics["rollout_is_max"], rel=1e-5)
            if name == "tis":
                assert stats.truncated_fraction.item() == pytest.approx(
                    verl_metrics["rollout_is_ratio_fraction_high"], abs=1e-6
                )
        else:
            assert stats.ratio_max.item() == pytest.approx(verl_metrics["rollout_is_max"], rel=1e-5)
        if name == "mis":
            assert stats.masked_fraction.item() == pytest.approx(verl_metrics["rollout_is_oob_ratio"], abs=1e-6)


@pytest.mark.parametrize(
    ("name", "options", "verl_threshold"),
    [
        ("tis", {"level": "token", "high": 2.0}, 2.0),
        ("tis", {"level": "sequence", "high": 2.0}, 2.0),
        ("mis", {"level": "sequence", "low": 0.5, "high": 2.0}, "0.5_2.0"),
        ("decoupled", {}, float("inf")),
    ],
)
def test_decoupled_mode_end_to_end_matches_verl(name: str, options: dict, verl_threshold: float | str) -> None:
    """Three policies: behaviour (recorded), proximal (recomputed: the PPO ratio's denominator), current. verl's
    decoupled mode: IS weights between proximal and behaviour into the vanilla loss around the proximal ones."""
    for seed in range(5):
        inputs = policy_inputs(seed)
        proximal, mask = inputs["old_logprobs"], inputs["mask"]
        behaviour = proximal - correction_inputs(seed)[0]
        weights, _ = get_correction_fn(name)(proximal - behaviour, mask, **options)
        new_ours = inputs["logprobs"].clone().requires_grad_(True)
        ours, _ = ppo_clip(new_ours, proximal, inputs["advantages"], mask, clip_eps_high=0.28, weights=weights)
        verl_weights, verl_mask, _ = rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
            proximal, behaviour, mask, rollout_is=options.get("level", "token"), rollout_is_threshold=verl_threshold
        )
        new_verl = inputs["logprobs"].clone().requires_grad_(True)
        theirs, _ = core_algos.compute_policy_loss_vanilla(
            proximal,
            new_verl,
            inputs["advantages"][:, None].expand_as(mask),
            verl_mask,
            config=actor_config(0.2, 0.28),
            rollout_is_weights=verl_weights.batch["rollout_is_weights"],
        )
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
        ours.backward()
        theirs.backward()
        torch.testing.assert_close(new_ours.grad, new_verl.grad, rtol=1e-5, atol=1e-7)


class _Tokenizer:
    eos_token = "</s>"

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


@pytest.mark.parametrize(("max_tokens", "buffer", "penalty"), [(16, 4, 1.0), (12, 12, 0.5)])
def test_overlong_penalty_matches_verl_dapo_reward_manager(max_tokens: int, buffer: int, penalty: float) -> None:
    lengths = list(range(1, max_tokens + 1))  # verl never sees a response past its limit
    rows, prompt = len(lengths), 3
    responses = torch.ones(rows, max_tokens, dtype=torch.long)
    attention = torch.zeros(rows, prompt + max_tokens, dtype=torch.long)
    attention[:, :prompt] = 1
    for row, length in enumerate(lengths):
        attention[row, prompt : prompt + length] = 1
    data = DataProto.from_dict(
        tensors={
            "prompts": torch.ones(rows, prompt, dtype=torch.long),
            "responses": responses,
            "attention_mask": attention,
        },
        non_tensors={
            "reward_model": np.array([{"ground_truth": ""}] * rows, dtype=object),
            "data_source": np.array(["test"] * rows, dtype=object),
        },
    )
    config = SimpleNamespace(enable=True, len=buffer, penalty_factor=penalty, log=False)
    manager = DAPORewardManager(
        _Tokenizer(), num_examine=0, compute_score=lambda **_: 0.0, max_resp_len=max_tokens, overlong_buffer_cfg=config
    )
    verl_rewards = manager(data).sum(dim=-1)  # the score (0 here) plus the penalty, on the last response token
    ours = overlong_penalty(torch.tensor(lengths), max_tokens, buffer, penalty)
    torch.testing.assert_close(ours.float(), verl_rewards, rtol=1e-6, atol=1e-7)
    assert float(ours.min()) == -penalty  # the full penalty at the limit
