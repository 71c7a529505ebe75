"""``parts/predictions.py`` without a Trainer: every rank's batches of one loader put back as one process batches
them (each sample once, in dataset-index order, ``batch_size`` per batch), from the indices Lightning records."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from lightning_mgpu.parts.predictions import FIX, PredictionGathering, assemble, local_batches

N, WORLD, BATCH = 37, 2, 4
X = torch.randn(N, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
Pair = namedtuple("Pair", ["first", "second"])


def predict(indices: list[int]) -> Any:
    """A batch output with every kind of structure: a tensor, a dict, a tuple, a namedtuple and a None."""
    x = X[indices]
    return {"y": x * 2, "parts": (x[:, :2], Pair(x.sum(1), x[:, 0].long())), "none": None}


def one_process() -> list[Any]:
    return [predict(list(range(s, min(s + BATCH, N)))) for s in range(0, N, BATCH)]


def rank_batches(rank_indices: list[list[int]]) -> list[list[tuple[list[int], Any]]]:
    return [
        [(idx[s : s + BATCH], predict(idx[s : s + BATCH])) for s in range(0, len(idx), BATCH)] for idx in rank_indices
    ]


def unrepeated() -> list[list[int]]:
    """Lightning's predict split: rank r takes r, r + W, ... (no padding; 19 and 18 samples here)."""
    return [list(range(r, N, WORLD)) for r in range(WORLD)]


def padded(shuffle: bool = False) -> list[list[int]]:
    """torch's DistributedSampler: 38 entries, the first sample repeated on the last rank."""
    ds = TensorDataset(X)
    return [list(DistributedSampler(ds, num_replicas=WORLD, rank=r, shuffle=shuffle, seed=3)) for r in range(WORLD)]


def test_lightnings_split_comes_back_as_one_process_batches():
    got = assemble(rank_batches(unrepeated()), BATCH)
    torch.testing.assert_close(got, one_process())
    assert [len(b["y"]) for b in got] == [4] * 9 + [1]
    assert isinstance(got[0]["parts"][1], Pair) and got[0]["none"] is None


@pytest.mark.parametrize("shuffle", [False, True])
def test_padding_repeats_are_kept_once_and_the_order_is_the_datasets(shuffle):
    ranks = padded(shuffle)
    assert sum(len(r) for r in ranks) == N + 1  # the repeat is there
    torch.testing.assert_close(assemble(rank_batches(ranks), BATCH), one_process())


def test_negative_control_each_ranks_own_batches_are_not_the_one_process_list():
    mine = [out for _, out in rank_batches(unrepeated())[0]]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(mine, one_process())


def test_without_a_batch_size_the_largest_batch_decides():
    torch.testing.assert_close(assemble(rank_batches(unrepeated()), None), one_process())


def test_an_output_without_a_row_per_sample_comes_back_batch_by_batch_with_a_warning():
    ranks = [[(idx, [f"s{i}" for i in idx]) for idx, _ in rank] for rank in rank_batches(padded())]
    with pytest.warns(UserWarning, match="could not put the predictions of predict loader 0") as record:
        got = assemble(ranks, BATCH)
    assert FIX in str(record[0].message) and "str" in str(record[0].message)
    # every batch of both ranks, ordered by its first index; none of them is all repeats here, so all 10 stay
    assert len(got) == 10 and got[0] == ["s0", "s2", "s4", "s6"] and got[1] == ["s1", "s3", "s5", "s7"]
    assert sorted(int(s[1:]) for b in got for s in b) == sorted([*range(N), 0])


def test_a_batch_that_only_repeats_is_left_out_of_the_batch_by_batch_answer():
    ranks = [[([0, 1], "a"), ([2, 3], "b")], [([4], "c"), ([0], "repeat")]]
    with pytest.warns(UserWarning, match="has no row per sample"):
        assert assemble(ranks, 2) == ["a", "b", "c"]


@pytest.mark.parametrize(
    "bad, why",
    [
        (lambda x: x.sum(), "shape ()"),
        (lambda x: x.T, "first dimension is not"),
        (lambda x: 3.0, "float"),
    ],
)
def test_what_cannot_be_split_is_named(bad, why):
    ranks = [[(idx, bad(X[idx])) for idx, _ in rank] for rank in rank_batches(unrepeated())]
    with pytest.warns(UserWarning, match="could not put") as record:
        got = assemble(ranks, BATCH)
    assert why in str(record[0].message) and len(got) == 10


def test_batches_whose_tensors_differ_beyond_the_first_dimension_cannot_be_joined():
    ranks = [[([0, 1], torch.zeros(2, 3))], [([2, 3], torch.zeros(2, 4))]]
    with pytest.warns(UserWarning, match="cannot be joined"):
        assert len(assemble(ranks, 2)) == 2


def test_unknown_indices_come_back_rank_by_rank_with_a_warning():
    ranks = [[(None, torch.zeros(2)), (None, torch.ones(2))], [(None, torch.full((2,), 2.0))]]
    with pytest.warns(UserWarning, match="does not say which samples"):
        got = assemble(ranks, 2)
    assert [float(b[0]) for b in got] == [0.0, 1.0, 2.0]


def test_predict_step_returning_none_gives_one_none_per_one_process_batch():
    ranks = [[(idx, None) for idx, _ in rank] for rank in rank_batches(unrepeated())]
    assert assemble(ranks, BATCH) == [None] * 10


class _Trainer:
    class state:
        fn = "predict"


def _predict_impl(model=None, dataloaders=None, datamodule=None, return_predictions=None, ckpt_path=None):
    return None


@pytest.mark.parametrize("given, requested, handed_on", [(None, True, None), (True, True, None), (False, False, False)])
def test_before_launch_reads_return_predictions_and_hands_true_on_as_none(given, requested, handed_on):
    gathering = PredictionGathering()
    args, kwargs = gathering.before_launch(_Trainer(), _predict_impl, ("model", None, None, given, None), {})
    assert gathering.requested is requested and args[3] is handed_on and args[0] == "model"
    args, kwargs = gathering.before_launch(_Trainer(), _predict_impl, ("model",), {"return_predictions": given})
    assert gathering.requested is requested and kwargs["return_predictions"] is handed_on


def test_before_launch_leaves_other_calls_alone():
    class Fitting:
        class state:
            fn = "fit"

    gathering = PredictionGathering()
    assert gathering.before_launch(Fitting(), _predict_impl, ("m", None, None, True), {}) == (
        ("m", None, None, True),
        {},
    )
    assert gathering.requested is None


class _Loader:
    """What Lightning's predict loader shows: a batch sampler with the indices it handed out and a batch size."""

    def __init__(self, seen: list[list[int]]) -> None:
        self.batch_sampler = type("Wrapper", (), {"seen_batch_indices": seen, "batch_size": 2})()


def test_batches_drawn_ahead_of_the_predictions_are_not_paired():
    size, batches = local_batches(_Loader([[0, 2], [4, 6], [8, 10]]), ["a", "b"])  # a worker drew one more
    assert size == 2 and batches == [([0, 2], "a"), ([4, 6], "b")]


def test_with_dataloader_iter_only_equal_counts_pair_up():
    assert local_batches(_Loader([[0, 2], [4, 6]]), ["a", "b"], exact=True)[1] == [([0, 2], "a"), ([4, 6], "b")]
    assert local_batches(_Loader([[0, 2], [4, 6]]), ["ab"], exact=True)[1] == [(None, "ab")]


def test_a_loader_without_recorded_indices_gives_none():
    assert local_batches(object(), ["a"]) == (None, [(None, "a")])
    assert local_batches(_Loader([[None, None]]), ["a"])[1] == [(None, "a")]  # an IterableDataset's "indices"
