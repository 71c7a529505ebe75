"""The uneven-input checks without a Trainer (``lightning_mgpu/parts/uneven_inputs.py``); the agreement across
ranks is tested on 2 processes in ``tests/integration/parts/test_uneven_inputs.py``."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_mgpu.parts.uneven_inputs import UnevenInputsError, check_batch_counts, needs_agreement


class Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from range(3)


def test_equal_or_unknown_counts_pass():
    check_batch_counts([4.0, 4.0], epoch=0)
    check_batch_counts([float("inf"), 3.0], epoch=0)  # no length: agreed step by step instead


def test_different_counts_name_every_rank_and_the_fix():
    with pytest.raises(UnevenInputsError) as info:
        check_batch_counts([4.0, 3.0, 4.0], epoch=2)
    text = str(info.value)
    assert "Epoch 2 has 4 training batches on rank 0 and 3 on rank 1 and 4 on rank 2" in text
    assert "at step 3" in text and "limit_train_batches" in text


def test_iterable_loaders_are_agreed_step_by_step():
    assert needs_agreement(DataLoader(Stream(), batch_size=2))
    assert not needs_agreement(DataLoader(TensorDataset(torch.zeros(4)), batch_size=2))
    assert not needs_agreement([1, 2, 3])  # not a DataLoader: left as it is
