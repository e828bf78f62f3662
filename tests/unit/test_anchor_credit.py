"""The ``anchor`` credit (issue 17, GiGPO's anchor states): calls with the same prompt in a group compared.

Hand-computed cases, a plain-Python reference against the vectorised path on random groups, the edge cases
(one rollout, all rewards equal, no peers), and the length normalisation: a policy that adds useless calls
(same reward, more calls) gains neither advantage mass nor gradient weight against the short policy.
"""

from __future__ import annotations

import json
import math
import random
from collections import defaultdict

import pytest
import torch
from typer.testing import CliRunner

from fulmen.algorithm.batch import collate
from fulmen.algorithm.rl.anchor import anchor_advantages, episode_length_weights, prompt_key, step_group_ids
from fulmen.algorithm.rl.credit import CreditStrategy, assign_credit
from fulmen.algorithm.rl.losses import ppo_clip
from fulmen.algorithm.service.groups import ClosedGroup, credit_groups
from fulmen.algorithm.service.samples import build_samples
from fulmen.algorithm.settings import TrainSettings
from fulmen.cli.main import app
from fulmen.schemas.events import RolloutMode, RolloutStatus, Transition, TransitionBatch

pytestmark = pytest.mark.multiagent

SQRT3_2 = math.sqrt(3) / 2  # GRPO's advantage of R = [1, 1, 0, 0] (or [1, 0, 1, 0]): +-0.866 (unbiased std)


def _episode(
    group: str,
    rollout: str,
    reward: float | None,
    prompts: list[list[int]],
    length: int = 1,
    intermediate: list[float | None] | None = None,
) -> TransitionBatch:
    observed = intermediate or [None] * len(prompts)
    transitions = [
        Transition(
            rollout_id=rollout,
            attempt=1,
            index=i,
            trace_id="a" * 32,
            span_id=f"{i + 1:016x}",
            prompt_token_ids=p,
            response_token_ids=[7] * length,
            intermediate_reward=observed[i],
        )
        for i, p in enumerate(prompts)
    ]
    return TransitionBatch(
        rollout_id=rollout,
        attempt=1,
        task_id=group,
        group_id=group,
        status=RolloutStatus.SUCCEEDED,
        episode_reward=reward,
        transitions=transitions,
    )


def _group(group: str, *episodes: TransitionBatch) -> ClosedGroup:
    return ClosedGroup(group, group, RolloutMode.TRAIN, len(episodes), tuple(episodes))


def _advantages(
    groups: list[ClosedGroup],
    credit: str = "anchor",
    gamma: float = 1.0,
    weight: float | None = 1.0,
    estimator: str = "grpo",
) -> list[list[list[float]]]:
    """Per group, per rollout, per call: the advantage ``build_samples`` gives (the trainer's path)."""
    credited = credit_groups(groups, credit, gamma)
    flat = iter(build_samples(credited, estimator=estimator, step_weight=weight).advantages)
    return [[[next(flat) for _ in r.transitions] for r in g.rollouts if r.transitions] for g in groups]


def _mass(advantages: list[float]) -> float:
    return sum(advantages)


# --- the strategy, its settings ---------------------------------------------------------------------------------
def test_anchor_credit_gives_each_call_its_return() -> None:
    # R = 1, gamma = 0.5, i = [-, 0.2, -]: G2 = 1, G1 = 0.2 + 0.5, G0 = 0.5 * 0.7
    assert assign_credit(CreditStrategy.ANCHOR, 1.0, [None, 0.2, None], gamma=0.5) == pytest.approx([0.35, 0.7, 1.0])
    assert assign_credit("anchor", 0.5, [None, None]) == [0.5, 0.5]  # gamma 1, nothing intermediate: R
    assert assign_credit("anchor", None, [None]) == [None]


def test_anchor_is_selected_by_the_run_settings_and_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TrainSettings().train.step_advantage_weight is None  # broadcast by default: no step groups
    monkeypatch.setenv("FULMEN_TRAIN_CREDIT", "anchor")
    monkeypatch.setenv("FULMEN_TRAIN_ANCHOR_WEIGHT", "0.5")
    assert TrainSettings().train.step_advantage_weight == 0.5
    result = CliRunner().invoke(app, ["config", "show"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)["train"]
    assert (shown["credit"], shown["anchor_weight"]) == ("anchor", 0.5)
    monkeypatch.setenv("FULMEN_TRAIN_ANCHOR_WEIGHT", "-1")
    with pytest.raises(ValueError, match="anchor_weight"):
        TrainSettings()


def test_step_groups_are_equal_prompts_within_one_group() -> None:
    ids = step_group_ids(["g", "g", "g", "h"], [[1, 2], [1, 2], [1, 3], [1, 2]]).tolist()
    assert ids[0] == ids[1] and len({ids[0], ids[2], ids[3]}) == 3  # same prompt in another group: another state
    assert prompt_key([1, 2]) == prompt_key([1, 2]) != prompt_key([2, 1])
    assert prompt_key([1, 256]) != prompt_key([257, 0])  # ids are not concatenated digits or bytes


# --- cases by hand ---------------------------------------------------------------------------------------------
def test_a_shared_later_state_tells_the_calls_apart() -> None:
    # R = [1, 0, 1, 0]; all four start at p0; a and b then reach the same state pX (their second calls are
    # compared: returns 1 vs 0 -> +-1/sqrt(2)); c and d reach states of their own (no peer: episode advantage).
    group = _group(
        "g",
        _episode("g", "a", 1.0, [[1], [2]]),
        _episode("g", "b", 0.0, [[1], [2]]),
        _episode("g", "c", 1.0, [[1], [3]]),
        _episode("g", "d", 0.0, [[1], [4]]),
    )
    (advantages,) = _advantages([group])
    half = 1 / math.sqrt(2)
    expected = [
        [2 * SQRT3_2, SQRT3_2 + half],
        [-2 * SQRT3_2, -SQRT3_2 - half],
        [2 * SQRT3_2, SQRT3_2],
        [-2 * SQRT3_2, -SQRT3_2],
    ]
    assert advantages == [pytest.approx(e, abs=1e-5) for e in expected]
    (weighted,) = _advantages([group], weight=0.5)
    assert weighted[0] == pytest.approx([1.5 * SQRT3_2, SQRT3_2 + 0.5 * half], abs=1e-5)
    (broadcast,) = _advantages([group], credit="broadcast", weight=None)
    assert broadcast == [pytest.approx([s * SQRT3_2] * 2, abs=1e-5) for s in (1, -1, 1, -1)]


def test_the_step_return_is_the_discounted_return_from_the_call() -> None:
    # gamma 0.5: a's calls return [0.5, 1], b's [0.25, 0.5, 1]; the first calls (shared p0) compare 0.5 with 0.25
    group = _group("g", _episode("g", "a", 1.0, [[1], [2]]), _episode("g", "b", 1.0, [[1], [3], [4]]))
    (advantages,) = _advantages([group], gamma=0.5)
    # episode advantages 0 (both R = 1); step: +-1/sqrt(2) * ... GRPO of [0.5, 0.25] = +-0.7071; lambda = 2.5 / T
    assert advantages[0] == pytest.approx([2.5 / 2 * (1 / math.sqrt(2)), 0.0], abs=1e-5)
    assert advantages[1] == pytest.approx([-2.5 / 3 * (1 / math.sqrt(2)), 0.0, 0.0], abs=1e-5)


# --- edge cases ------------------------------------------------------------------------------------------------
def test_one_rollout_gets_no_advantage() -> None:
    (advantages,) = _advantages([_group("g", _episode("g", "a", 1.0, [[1], [1], [2]]))])
    assert advantages == [[0.0, 0.0, 0.0]]  # repeated prompt inside one episode: a peer, but the same return


def test_all_rewards_equal_give_no_advantage() -> None:
    group = _group("g", *(_episode("g", f"r{k}", 0.5, [[1], [2 + k % 2], [9]]) for k in range(4)))
    assert _advantages([group]) == [[[0.0] * 3] * 4]


def test_calls_without_peers_fall_back_to_the_episode_advantage() -> None:
    group = _group("g", *(_episode("g", f"r{k}", float(k % 2), [[10 + k], [20 + k]]) for k in range(4)))
    (anchor,), (broadcast,) = _advantages([group]), _advantages([group], "broadcast", weight=None)
    assert anchor == [pytest.approx(rollout, abs=1e-6) for rollout in broadcast]
    assert anchor[1] == pytest.approx([SQRT3_2] * 2, abs=1e-5)


def test_weight_zero_is_the_length_normalised_episode_advantage() -> None:
    group = _group("g", _episode("g", "a", 1.0, [[1]]), _episode("g", "b", 0.0, [[1], [2], [3]]))
    (advantages,) = _advantages([group], weight=0.0)
    assert advantages == [
        pytest.approx([2 * (1 / math.sqrt(2))], abs=1e-5),
        pytest.approx([-2 / 3 * (1 / math.sqrt(2))] * 3, abs=1e-5),
    ]


# --- no bias toward longer episodes ----------------------------------------------------------------------------
def _short_and_long_policies() -> list[ClosedGroup]:
    """Two tasks in one step: the short policy answers in one call; the long one makes the same first call then
    three useless calls (the same reward). Every useless call even has a peer (the loser made it too)."""
    short = _group("s", _episode("s", "s1", 1.0, [[1]]), _episode("s", "s0", 0.0, [[1]]))
    useless = [[2], [3], [4]]
    long = _group("l", _episode("l", "l1", 1.0, [[1], *useless]), _episode("l", "l0", 0.0, [[1], *useless]))
    return [short, long]


def test_useless_calls_gain_no_advantage_mass() -> None:
    (short, long) = _advantages(_short_and_long_policies())
    assert _mass(long[0]) == pytest.approx(_mass(short[0]), abs=1e-5) and _mass(short[0]) > 0
    assert _mass(long[1]) == pytest.approx(_mass(short[1]), abs=1e-5)
    # broadcast weighs a call as a call: the long winner has four times the mass (what the anchor credit removes)
    (short_b, long_b) = _advantages(_short_and_long_policies(), "broadcast", weight=None)
    assert _mass(long_b[0]) == pytest.approx(4 * _mass(short_b[0]), abs=1e-5)


def test_useless_calls_in_one_group_and_under_discount_only_lose() -> None:
    group = _group(
        "g",
        _episode("g", "short", 1.0, [[1]]),
        _episode("g", "long", 1.0, [[1], [5], [6], [7]]),
        _episode("g", "x", 0.0, [[1]]),
        _episode("g", "y", 0.0, [[1]]),
    )
    for gamma in (1.0, 0.9):
        (advantages,) = _advantages([group], gamma=gamma)
        assert _mass(advantages[1]) < _mass(advantages[0])


@pytest.mark.parametrize("aggregation", ["seq_mean", "token_mean"])
def test_useless_calls_gain_no_gradient_weight(aggregation: str) -> None:
    """The PPO-clip loss's gradient summed over each winning episode's tokens: the same for both policies."""
    groups = credit_groups(_short_and_long_policies(), "anchor", 1.0)
    data = build_samples(groups, step_weight=1.0)
    batch = collate(data.samples, pad_id=0)
    logprobs = torch.full(batch.old_logprobs.shape, -1.0, requires_grad=True)
    loss, _ = ppo_clip(
        logprobs, logprobs.detach().clone(), batch.advantages, batch.response_mask, aggregation=aggregation
    )
    loss.backward()
    per_row = (logprobs.grad * batch.response_mask).sum(dim=1).tolist()  # rows: s1, s0, l1 x4, l0 x4
    short_winner, long_winner = per_row[0], sum(per_row[2:6])
    assert long_winner == pytest.approx(short_winner, abs=1e-7) and short_winner < 0  # descent raises them


def test_length_weights_sum_to_the_calls() -> None:
    weights = episode_length_weights(torch.tensor([0, 0, 0, 1, 2, 2]))
    assert weights.tolist() == pytest.approx([2 / 3, 2 / 3, 2 / 3, 2.0, 1.0, 1.0])
    assert float(weights.sum()) == pytest.approx(6.0)


# --- the vectorised path against a plain loop ------------------------------------------------------------------
def _reference(groups: list[ClosedGroup], gamma: float, weight: float, estimator: str) -> list[float]:
    """GiGPO's formula with dicts and loops (the anchor module docstring), one value per call in order."""

    def normalise(values: list[float], index: int) -> float:
        if len(values) < 2:
            return 0.0
        mean = sum(values) / len(values)
        if estimator == "dr_grpo":
            return values[index] - mean
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        return (values[index] - mean) / (std + 1e-6)

    calls = []  # (group, episode number, prompt, return, episode advantage)
    episodes = 0
    for group in groups:
        rollouts = [r for r in group.rollouts if r.transitions]
        outcomes = [r.episode_reward for r in rollouts]
        for k, rollout in enumerate(rollouts):
            returns = assign_credit(
                "anchor", rollout.episode_reward, [t.intermediate_reward for t in rollout.transitions], gamma
            )
            for t, g in zip(rollout.transitions, returns, strict=True):
                calls.append((group.group_id, episodes, tuple(t.prompt_token_ids), g, normalise(outcomes, k)))
            episodes += 1
    members: dict[tuple, list[int]] = defaultdict(list)
    lengths: dict[int, int] = defaultdict(int)
    for i, (group_id, episode, prompt, _, _) in enumerate(calls):
        members[(group_id, prompt)].append(i)
        lengths[episode] += 1
    result = []
    for i, (group_id, episode, prompt, _, episode_advantage) in enumerate(calls):
        peers = members[(group_id, prompt)]
        step = normalise([calls[j][3] for j in peers], peers.index(i))
        result.append(len(calls) / episodes / lengths[episode] * (episode_advantage + weight * step))
    return result


def _random_groups(rng: random.Random) -> list[ClosedGroup]:
    groups = []
    for g in range(rng.randint(1, 4)):
        episodes = []
        for r in range(rng.randint(1, 6)):
            prompts = [[1]] + [[rng.randint(2, 4)] for _ in range(rng.randint(0, 3))]  # few states: many peers
            reward = rng.choice([0.0, 0.5, 1.0])
            observed = [rng.choice([None, None, 0.25]) for _ in prompts]
            episodes.append(_episode(f"g{g}", f"g{g}r{r}", reward, prompts, intermediate=observed))
        groups.append(_group(f"g{g}", *episodes))
    return groups


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo"])
def test_vectorised_matches_the_loop_reference(seed: int, estimator: str) -> None:
    rng = random.Random(seed)
    groups, gamma, weight = _random_groups(rng), rng.choice([1.0, 0.8]), rng.choice([1.0, 0.5])
    flat = [
        a
        for group in _advantages(groups, gamma=gamma, weight=weight, estimator=estimator)
        for rollout in group
        for a in rollout
    ]
    assert flat == pytest.approx(_reference(groups, gamma, weight, estimator), abs=1e-5)


def test_anchor_advantages_checks_its_inputs() -> None:
    one = torch.zeros(3)
    with pytest.raises(ValueError, match="must all be"):
        anchor_advantages(one, torch.zeros(2), torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=">= 0"):
        anchor_advantages(one, one, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), weight=-1)


# --- the training loop uses it ---------------------------------------------------------------------------------
def test_the_training_loop_trains_on_anchor_advantages(tmp_path) -> None:
    from tests.unit.test_train_loop import build, reply, run

    def two_calls(request, number):  # the same two states in every rollout; reward by arrival parity
        batch = reply(request, number)
        second = batch.transitions[0].model_copy(update={"index": 1, "span_id": "d" * 16, "prompt_token_ids": [1, 9]})
        return batch.model_copy(update={"transitions": [batch.transitions[0], second]})

    trained = {}
    for credit in ("broadcast", "anchor"):
        loop, _, backend, _ = build(tmp_path / credit, answer=two_calls, steps=1, credit=credit)
        run(loop)
        trained[credit] = [s.advantage for s in backend.batches[0]]
    assert any(trained["broadcast"]) and len(trained["anchor"]) == len(trained["broadcast"]) == 8
    # every call has a peer with another return: its step advantage equals its episode advantage (the rollouts'
    # order within a group follows their random ids, so the runs are compared as sorted values)
    assert sorted(trained["anchor"]) == pytest.approx(sorted(2 * a for a in trained["broadcast"]), abs=1e-5)
    assert trained["anchor"][0::2] == pytest.approx(trained["anchor"][1::2], abs=1e-6)  # both calls of a rollout
