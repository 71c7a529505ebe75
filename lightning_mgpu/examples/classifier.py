"""Digit classifiers: the shared steps, and a small CNN with BatchNorm, the sample every preset is shown with."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override


class DigitsClassifier(pl.LightningModule):
    """The 10-class steps the digit samples share; subclasses define ``forward`` and save ``lr`` and
    ``weight_decay`` as hyperparameters (AdamW).

    Loss is logged with ``sync_dist=True`` (mean over ranks); accuracy is a torchmetrics metric, which
    all-gathers its counts across ranks when computed, so ``val_acc``/``test_acc`` cover the whole split.
    """

    def __init__(self) -> None:
        super().__init__()
        self.val_acc = MulticlassAccuracy(num_classes=10, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=10, average="micro")

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc, prog_bar=True)

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test_acc", self.test_acc)

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=self.hparams["weight_decay"])


class DigitsCNN(DigitsClassifier):
    """Conv-BN-ReLU x2, pooling, linear head. About 29k parameters (channels=32)."""

    def __init__(self, lr: float = 0.01, channels: int = 32, weight_decay: float = 1e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1),
            nn.BatchNorm2d(c),
            nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1),
            nn.BatchNorm2d(2 * c),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * c * 4 * 4, 10)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))
