"""Determinism: with ``pl.seed_everything(s)`` and ``Trainer(deterministic=True)``, two 2-process CPU fits
(gloo, fork launch) give bit-identical weights, and each rank's data order is reproducible.

What Lightning 2.6.6 guarantees (from its source), and what these tests rely on:

* ``seed_everything(s)`` seeds ``random``, numpy and torch in the calling process and sets the environment
  variable ``PL_GLOBAL_SEED=s`` (``lightning_fabric/utilities/seed.py``): a model built after it gets the same
  random initialisation every time.
* ``DDPStrategy.setup_distributed`` (inherited by mgpu_ddp and mgpu_sharded) calls ``reset_seed()`` in every
  worker, which re-seeds the three generators from ``PL_GLOBAL_SEED``: every rank's random stream (dropout)
  starts from ``s`` whatever the launcher.
* Training data: with ``use_distributed_sampler=True`` (the default) Lightning replaces the DataLoader's
  sampler by ``DistributedSampler(shuffle=True, seed=int(PL_GLOBAL_SEED or 0))`` -- training data is always
  shuffled, whatever the DataLoader's ``shuffle`` (``data_connector.py``: ``_process_dataloader``,
  ``_get_distributed_sampler``) -- and the fit loop calls ``set_epoch(epoch)`` on it at each epoch start. torch's
  sampler draws one permutation from a generator seeded with ``seed + epoch`` and gives rank r of W its positions r,
  r+W, ... (padded by repetition when W does not divide the dataset). The order therefore depends on the seed,
  the epoch, the rank and W only, not on the model's use of the RNG; without ``seed_everything`` the seed is 0.
* ``deterministic=True`` only calls ``torch.use_deterministic_algorithms(True)`` (and switches cuDNN
  benchmarking off) in the process that builds the Trainer -- forked workers inherit it; it seeds nothing.
  DataLoader worker processes (``num_workers > 0``) are seeded only by ``seed_everything(s, workers=True)``.

Both flags are process-global: the runs happen inside :func:`_global_state_restored`, so later tests in this
pytest process see neither the seed nor deterministic mode.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.conftest import _DIST_ENV
from tests.helpers import WORLD, fit

SAMPLES, BATCH, EPOCHS = 48, 4, 3
SEED, OTHER_SEED = 1234, 99
STRATEGIES = ["mgpu_ddp_fork", "mgpu_sharded_notebook"]  # mgpu_ddp and mgpu_sharded stage 2 (FSDP2), fork launch
_GLOBAL_ENV = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "CUBLAS_WORKSPACE_CONFIG", *_DIST_ENV)


class DropoutRegressor(pl.LightningModule):
    """Random in two ways: initialisation from the global RNG (no seed of its own) and dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ShuffledData(pl.LightningDataModule):
    """Samples ``(x, y, index)``: the batch carries the dataset indices. A plain shuffled DataLoader, so
    Lightning puts its own DistributedSampler in."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        x = torch.randn(SAMPLES, 6, generator=g, dtype=torch.float64)
        y = torch.randn(SAMPLES, 3, generator=g, dtype=torch.float64)
        self.dataset = TensorDataset(x, y, torch.arange(SAMPLES))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=BATCH, shuffle=True)


class SeenIndices(Callback):
    """Writes ``out_dir/indices{rank}.pt``: per epoch, the dataset indices this rank trained on, in order, and
    whether deterministic algorithms were on in the worker."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)
        self.seen: list[list[int]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        while len(self.seen) <= trainer.current_epoch:
            self.seen.append([])
        self.seen[trainer.current_epoch] += batch[2].tolist()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = {"epochs": self.seen, "deterministic": torch.are_deterministic_algorithms_enabled()}
        torch.save(record, self.out_dir / f"indices{trainer.global_rank}.pt")


@contextmanager
def _global_state_restored() -> Iterator[None]:
    """Undo what seed_everything and Trainer(deterministic=True) change in this process."""
    env = {k: os.environ.get(k) for k in _GLOBAL_ENV}
    rng = (torch.random.get_rng_state(), random.getstate(), np.random.get_state())
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.random.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])
        for k, v in env.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def seeded_fit(out_dir: Path, strategy: str, seed: int) -> dict[str, Any]:
    """seed_everything, build the model, fit 2 ranks with Lightning's sampler; each rank's weights and indices."""
    for k in _GLOBAL_ENV:  # a fresh port and no seed left over from the run before
        os.environ.pop(k, None)
    pl.seed_everything(seed, verbose=False)
    model = DropoutRegressor().double()
    initial = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    out_dir.mkdir(parents=True)
    ranks = fit(
        model,
        strategy,
        out_dir,
        datamodule=ShuffledData(),
        max_epochs=EPOCHS,
        use_distributed_sampler=True,
        deterministic=True,
        callbacks=[SeenIndices(out_dir)],
    )
    seen = [torch.load(out_dir / f"indices{r}.pt") for r in range(WORLD)]
    return {
        "initial": initial,
        "weights": [r["weights"] for r in ranks],
        "order": [s["epochs"] for s in seen],  # order[rank][epoch] = indices in the order trained
        "deterministic": [s["deterministic"] for s in seen],
    }


@pytest.fixture(scope="module", params=STRATEGIES)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per strategy, three fits: two with SEED, one with OTHER_SEED (the negative control)."""
    tmp = tmp_path_factory.mktemp(request.param)
    with _global_state_restored():
        return {
            name: seeded_fit(tmp / name, request.param, seed)
            for name, seed in (("first", SEED), ("second", SEED), ("other", OTHER_SEED))
        }


def test_same_seed_gives_bit_identical_weights(runs):
    first, second = runs["first"], runs["second"]
    assert torch.equal(first["initial"], second["initial"])
    for rank in range(WORLD):
        assert torch.equal(first["weights"][rank], second["weights"][rank])
    assert torch.equal(first["weights"][0], first["weights"][1])  # the replicas agree
    assert not torch.equal(first["weights"][0], first["initial"])  # it trained
    assert first["deterministic"] == [True] * WORLD  # deterministic mode reached the workers


def test_same_seed_gives_each_rank_the_same_data_order(runs):
    assert runs["first"]["order"] == runs["second"]["order"]
    assert [len(epochs) for epochs in runs["first"]["order"]] == [EPOCHS] * WORLD


def test_ranks_see_disjoint_halves_of_the_dataset_each_epoch(runs):
    order = runs["first"]["order"]
    for epoch in range(EPOCHS):
        rank0, rank1 = set(order[0][epoch]), set(order[1][epoch])
        assert len(order[0][epoch]) == len(order[1][epoch]) == SAMPLES // WORLD
        assert not rank0 & rank1
        assert rank0 | rank1 == set(range(SAMPLES))


def test_sampler_reshuffles_every_epoch(runs):
    for epochs in runs["first"]["order"]:
        assert epochs[0] != sorted(epochs[0])  # shuffled, not rank-strided in order
        for a in range(EPOCHS):
            for b in range(a + 1, EPOCHS):
                assert set(epochs[a]) != set(epochs[b])  # a rank gets other samples, not only another order


def test_comparison_can_fail_a_different_seed_changes_weights_and_data_order(runs):
    first, other = runs["first"], runs["other"]
    assert not torch.equal(first["initial"], other["initial"])
    for rank in range(WORLD):
        assert not torch.equal(first["weights"][rank], other["weights"][rank])
        for epoch in range(EPOCHS):
            assert first["order"][rank][epoch] != other["order"][rank][epoch]
