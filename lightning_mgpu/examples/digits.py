"""The 8x8 handwritten digits (UCI, as shipped by scikit-learn) as tensors and a LightningDataModule."""

from __future__ import annotations

import gzip
from importlib import resources
from typing import Optional

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset, random_split
from typing_extensions import override


def load_digits(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(images, labels)``: images ``(1797, 1, 8, 8)`` scaled to [0, 1], labels ``(1797,)`` int64."""
    with resources.files("lightning_mgpu.examples").joinpath("data/digits.csv.gz").open("rb") as raw:
        table = np.loadtxt(gzip.open(raw), delimiter=",", dtype=np.float32)
    images = torch.from_numpy(table[:, :-1] / 16.0).to(dtype).reshape(-1, 1, 8, 8)
    labels = torch.from_numpy(table[:, -1]).long()
    return images, labels


class DigitsDataModule(pl.LightningDataModule):
    """Train / validation / held-out test split of the digits, fixed by ``split_seed``.

    Args:
        batch_size: per-device batch size (the effective batch is ``batch_size x devices x accumulation``).
        val_size: images held out for validation during fit.
        test_size: images held out for the final test; never seen during fit.
        drop_last: drop each epoch's last, smaller training batch (pipeline parallelism needs every batch to
            split into equal micro-batches).
    """

    def __init__(
        self,
        batch_size: int = 32,
        val_size: int = 200,
        test_size: int = 400,
        split_seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be >= 1.")
        self.save_hyperparameters()
        self.batch_size = batch_size
        self._splits: Optional[tuple[TensorDataset, ...]] = None

    @override
    def setup(self, stage: Optional[str] = None) -> None:
        if self._splits is not None:
            return
        x, y = load_digits()
        full = TensorDataset(x, y)
        n_test, n_val = self.hparams["test_size"], self.hparams["val_size"]
        lengths = [len(full) - n_val - n_test, n_val, n_test]
        gen = torch.Generator().manual_seed(self.hparams["split_seed"])
        self._splits = tuple(random_split(full, lengths, generator=gen))  # type: ignore[arg-type]

    def _loader(self, index: int, shuffle: bool) -> DataLoader:
        assert self._splits is not None, "call setup() first"
        drop = bool(self.hparams["drop_last"]) and index == 0
        return DataLoader(self._splits[index], batch_size=self.batch_size, shuffle=shuffle, drop_last=drop)

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(0, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(1, shuffle=False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader(2, shuffle=False)
