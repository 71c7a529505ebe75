"""The evaluation batch sampler without a Trainer: every sample once, the same number of non-empty batches on every
rank where that is possible, batches no larger than the loader's (``lightning_mgpu/parts/evaluation.py``)."""

from __future__ import annotations

import itertools

import pytest

from lightning_mgpu.parts.evaluation import (
    EvenBatchSampler,
    UnpaddedShard,
    batch_sizes,
    common_batch_count,
    planned_counts_differ,
)


def rank_batches(
    total: int, world: int, batch_size: int, shuffle: bool = False, epoch: int = 0
) -> list[list[list[int]]]:
    count = common_batch_count(total, world, batch_size)
    out = []
    for rank in range(world):
        shard = UnpaddedShard(range(total), world, rank, shuffle=shuffle, seed=3)
        sampler = EvenBatchSampler(shard, batch_size, count)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
        assert len(sampler) == len(out[-1])
    return out


# every set at least as large as the world (a smaller one keeps Lightning's sampler: every rank needs a sample)
SHAPES = [s for s in itertools.product([2, 3, 5, 7, 8, 37, 64, 101], [2, 3, 4], [1, 2, 4, 5]) if s[0] >= s[1]]


@pytest.mark.parametrize(("total", "world", "batch_size"), SHAPES)
def test_every_sample_once_and_equal_batch_counts_where_possible(total, world, batch_size):
    batches = rank_batches(total, world, batch_size)
    flat = sorted(i for rank in batches for batch in rank for i in batch)
    assert flat == list(range(total))  # no padding, nothing left out
    assert all(1 <= len(batch) <= batch_size for rank in batches for batch in rank)
    counts = {len(rank) for rank in batches}
    if common_batch_count(total, world, batch_size) is not None:
        assert len(counts) == 1
    else:  # only where a rank would need an empty batch: counts differ by one
        assert batch_size == 1 or total < world * 2
        assert max(counts) - min(counts) <= 1


def test_the_issue_example_37_samples_2_ranks_batches_of_4():
    batches = rank_batches(37, 2, 4)
    assert [len(b) for b in batches[0]] == [4, 4, 4, 4, 3]
    assert [len(b) for b in batches[1]] == [4, 4, 4, 4, 2]
    assert batches[0][0] == [0, 2, 4, 6]  # every world_size-th sample, as Lightning's samplers take them


def test_shuffled_epochs_differ_and_stay_exact():
    first, second = rank_batches(37, 2, 4, shuffle=True, epoch=0), rank_batches(37, 2, 4, shuffle=True, epoch=1)
    assert first != second
    for batches in (first, second):
        assert sorted(i for rank in batches for b in rank for i in b) == list(range(37))


def test_common_count_needs_a_sample_for_every_batch():
    assert common_batch_count(1, 2, 4) is None  # a rank without a sample
    assert common_batch_count(37, 2, 1) is None  # 19 and 18 single-sample batches
    assert common_batch_count(38, 2, 1) == 19
    assert batch_sizes(6, 5, 4) == [2, 1, 1, 1, 1]


def test_planned_counts():
    assert not planned_counts_differ([5.0, 5.0])
    assert planned_counts_differ([5.0, 4.0])
    assert planned_counts_differ([float("inf"), float("inf")])  # iterable loaders: unknown
