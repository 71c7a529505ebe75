"""A small vision transformer for the 8x8 digits with a BatchNorm conv stem: the activation-checkpointing sample.

    python -m lightning_mgpu.examples.transformer fit --config configs/transformer.yaml

The config checkpoints every ``ConvBlock`` and ``nn.TransformerEncoderLayer`` (BatchNorm statistics stay
exactly those of a run without checkpointing; see :mod:`lightning_mgpu.parts.activation_checkpointing`).
"""

from __future__ import annotations

from typing import Optional

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from typing_extensions import override

from lightning_mgpu.examples._cli import fit_then_test
from lightning_mgpu.examples.classifier import DigitsClassifier


class ConvBlock(nn.Module):
    """Conv 3x3 -> BatchNorm -> ReLU."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class DigitsTransformer(DigitsClassifier):
    """Two ``ConvBlock`` s, then the 64 pixels as tokens through ``layers`` transformer encoder layers.

    Args:
        d_model: token width. heads: attention heads. layers: encoder layers. dropout: in the encoder layers.
    """

    def __init__(
        self,
        d_model: int = 64,
        heads: int = 4,
        layers: int = 4,
        dropout: float = 0.1,
        lr: float = 3e-3,
        weight_decay: float = 0.05,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Sequential(ConvBlock(1, d_model // 2), ConvBlock(d_model // 2, d_model))
        self.position = nn.Parameter(torch.zeros(1, 64, d_model))
        self.encoder = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, 2 * d_model, dropout, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 10)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.stem(x).flatten(2).transpose(1, 2) + self.position  # (batch, 64, d_model)
        for layer in self.encoder:
            tokens = layer(tokens)
        return self.head(self.norm(tokens).mean(1))


def main(args: Optional[list[str]] = None) -> None:
    """``LightningCLI`` over :class:`DigitsTransformer` and the digits; ``fit`` is followed by ``test``."""

    def report(trainer: pl.Trainer, result: dict[str, float]) -> None:
        policy = getattr(trainer.strategy, "activation_checkpointing", None)
        print(f"held-out test accuracy {result['test_acc']:.4f}; activation_checkpointing={policy!r}")

    fit_then_test(DigitsTransformer, args, report)


if __name__ == "__main__":
    # run the importable module's main: under `python -m` this file is `__main__`, and the config's
    # class_path (lightning_mgpu.examples.DigitsTransformer) must match the class the CLI was given
    from lightning_mgpu.examples.transformer import main as _main

    _main()
