"""Samples -> TrainBatch: layout, alignment of old logprobs, checked shapes, over-length and micro-batches."""

from __future__ import annotations

import pytest
import torch

from fulmen.algorithm.batch import Sample, TrainBatch, collate
from fulmen.schemas.errors import PoisonInputError

SAMPLES = [
    Sample([5, 6, 7], [8, 9], advantage=1.0, old_logprobs=[-0.5, -0.25], group_id="g1", model_version=3),
    Sample([5], [10, 11, 12, 13], advantage=-1.0, group_id="g1"),
    Sample([4, 4], [2], advantage=0.5, old_logprobs=[-1.0], group_id="g2"),
]


def test_collate_right_pads_and_aligns_logprobs_to_tokens() -> None:
    batch = collate(SAMPLES, pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 10, 11, 12, 13], [4, 4, 2, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch.response_mask.tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1], [0, 0, 1, 0, 0]]
    assert batch.old_logprobs.tolist() == [[0, 0, 0, -0.5, -0.25], [0] * 5, [0, 0, -1.0, 0, 0]]
    assert batch.has_old_logprobs.tolist() == [True, False, True]
    assert batch.advantages.tolist() == [1.0, -1.0, 0.5]
    assert (batch.response_tokens, batch.input_tokens, batch.size) == (7, 13, 3)


def test_over_length_and_malformed_samples_are_poison() -> None:
    with pytest.raises(
        PoisonInputError, match=r"sample 1 \(group 'g1'\): 1 prompt \+ 4 response tokens = 5 > max_len 4"
    ):
        collate([SAMPLES[2], SAMPLES[1]], pad_id=0, max_len=4)
    with pytest.raises(PoisonInputError, match="empty prompt or response"):
        collate([Sample([1, 2], [])], pad_id=0)
    with pytest.raises(PoisonInputError, match="1 old logprobs for 2 response tokens"):
        collate([Sample([1], [2, 3], old_logprobs=[-1.0])], pad_id=0)


def test_split_cuts_each_micro_batch_to_its_longest_row() -> None:
    parts = collate(SAMPLES, pad_id=0).split(2)
    assert [p.size for p in parts] == [2, 1]
    assert parts[1].input_ids.tolist() == [[4, 4, 2]]
    assert parts[1].old_logprobs.tolist() == [[0, 0, -1.0]]
    assert parts[0].input_ids.shape == (2, 5)
    with pytest.raises(ValueError, match="micro_batch_size"):
        collate(SAMPLES, pad_id=0).split(0)


def test_by_length_orders_rows_shortest_first_keeping_each_row_whole() -> None:
    batch = collate(SAMPLES, pad_id=0)
    ordered = batch.by_length()
    assert ordered.attention_mask.sum(dim=-1).tolist() == [3, 5, 5]
    assert ordered.input_ids.tolist() == [[4, 4, 2, 0, 0], [5, 6, 7, 8, 9], [5, 10, 11, 12, 13]]  # stable for ties
    assert ordered.advantages.tolist() == [0.5, 1.0, -1.0]
    assert ordered.old_logprobs[0].tolist() == [0, 0, -1.0, 0, 0]
    assert ordered.has_old_logprobs.tolist() == [True, True, False]


def test_with_old_logprobs_fills_only_missing_rows_unless_told_to_overwrite() -> None:
    batch = collate(SAMPLES, pad_id=0)
    computed = torch.full(batch.old_logprobs.shape, -9.0)
    filled = batch.with_old_logprobs(computed)
    assert filled.old_logprobs.tolist() == [[0, 0, 0, -0.5, -0.25], [0, -9, -9, -9, -9], [0, 0, -1.0, 0, 0]]
    assert bool(filled.has_old_logprobs.all())
    assert batch.with_old_logprobs(computed, overwrite=True).old_logprobs[0].tolist() == [0, 0, 0, -9, -9]


def test_shapes_are_checked() -> None:
    batch = collate(SAMPLES, pad_id=0)
    with pytest.raises(ValueError, match="response_mask must be"):
        TrainBatch(**{**vars(batch), "response_mask": batch.response_mask[:, :2]})
    with pytest.raises(ValueError, match="advantages must be"):
        TrainBatch(**{**vars(batch), "advantages": torch.zeros(2)})
    with pytest.raises(ValueError, match="input_ids must be long"):
        TrainBatch(**{**vars(batch), "input_ids": batch.input_ids.float()})


def test_behaviour_logprobs_are_the_recorded_ones_and_survive_a_recompute() -> None:
    batch = collate(SAMPLES, pad_id=0)
    assert torch.equal(batch.behaviour_logprobs, batch.old_logprobs)
    assert batch.has_behaviour_logprobs.tolist() == [True, False, True]
    proximal = batch.with_old_logprobs(torch.full(batch.old_logprobs.shape, -9.0), overwrite=True)
    assert proximal.old_logprobs[0].tolist() == [0, 0, 0, -9, -9]
    assert proximal.behaviour_logprobs.tolist() == [[0, 0, 0, -0.5, -0.25], [0] * 5, [0, 0, -1.0, 0, 0]]
    assert proximal.has_behaviour_logprobs.tolist() == [True, False, True]
    part = proximal.split(2)[1]
    assert part.behaviour_logprobs.tolist() == [[0, 0, -1.0]] and part.has_behaviour_logprobs.tolist() == [True]
    with pytest.raises(ValueError, match="behaviour_logprobs must be"):
        TrainBatch(**{**vars(batch), "behaviour_logprobs": batch.behaviour_logprobs[:, :2]})


def test_by_prefix_sorts_rows_by_their_tokens_and_split_by_tree_counts_shared_prefixes_once() -> None:
    """Rows [5 6 7], [1 2 3 4], [1 2 9], [5 6 8]: sorted [1 2 3 4], [1 2 9], [5 6 7], [5 6 8]; the tree of the first two
    holds 5 tokens (4 + 3 - 2 shared), of the last two 4; a budget of 5 cuts between them, one of 3 leaves the
    4-token row alone."""
    batch = collate([Sample([5, 6], [7]), Sample([1, 2], [3, 4]), Sample([1, 2], [9]), Sample([5, 6], [8])], pad_id=0)
    ordered = batch.by_prefix()
    assert ordered.input_ids.tolist() == [[1, 2, 3, 4], [1, 2, 9, 0], [5, 6, 7, 0], [5, 6, 8, 0]]
    assert ordered.response_mask.tolist()[1] == [0.0, 0.0, 1.0, 0.0]  # every field moved with its row
    assert [part.size for part in ordered.split_by_tree(5)] == [2, 2]
    assert [part.size for part in ordered.split_by_tree(9)] == [4]
    assert [part.size for part in ordered.split_by_tree(3)] == [1, 1, 1, 1]
