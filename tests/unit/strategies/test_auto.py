"""``mgpu_auto``'s planning, in one process (``strategies/auto.py``)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu.strategies.auto import random_streams_kept


def test_planning_gives_torchs_random_generator_back_as_it_found_it():
    """What planning draws (a sample batch: a loader's iterator draws its seed from torch's generator, a shuffle its
    order) leaves the generator as it was, so rank 0, which plans, trains on the random numbers the other ranks do.
    Negative control: the same draws outside it move the generator."""
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, shuffle=True)
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    next(iter(loader))
    assert not torch.equal(torch.random.get_rng_state(), before)
    torch.manual_seed(0)
    with random_streams_kept(torch.device("cpu")):
        next(iter(loader))
        torch.randn(3)
    assert torch.equal(torch.random.get_rng_state(), before)
