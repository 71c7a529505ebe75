"""A decoder-only language model of ``nn.TransformerEncoderLayer`` blocks and random tokens, to plan at any size.

The planner's benchmark and tests use it at 125M, 1B and 7B parameters (under FakeTensorMode: nothing is
allocated) and at a few million for the measured checks::

    lightning-mgpu plan --config lm.yaml --devices 8 --device-memory 80GiB

with ``model: {class_path: lightning_mgpu.planning.lm.TransformerLM, init_args: {d_model: 2048, layers: 18}}``
and ``data: {class_path: lightning_mgpu.planning.lm.RandomTokens, init_args: {batch_size: 8, seq_len: 2048}}``.
"""

from __future__ import annotations

from typing import Any, Optional

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

__all__ = ["RandomTokens", "TransformerLM"]


class TransformerLM(pl.LightningModule):
    """Token embedding, ``layers`` pre-norm causal transformer layers (FFN ``4 d_model``), LayerNorm, untied head.

    Args:
        vocab: vocabulary size. d_model: width. heads: attention heads. layers: depth. lr: AdamW learning rate.
        ffn: the feed-forward width (default ``4 d_model``); a model with another attention and MLP (grouped
            keys and values, a gated MLP) is stood in for at its parameter count with ``ffn`` = its parameters per
            layer less ``4 d_model**2``, over ``2 d_model``.
    """

    def __init__(
        self,
        vocab: int = 32000,
        d_model: int = 768,
        heads: int = 12,
        layers: int = 12,
        lr: float = 3e-4,
        ffn: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model, heads, ffn or 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    @override
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=x.device, dtype=x.dtype)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        self.log("train_loss", loss)
        return loss

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])


class _Tokens(Dataset):
    def __init__(self, samples: int, seq_len: int, vocab: int) -> None:
        self.samples, self.seq_len, self.vocab = samples, seq_len, vocab

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        seq = torch.randint(self.vocab, (self.seq_len + 1,), generator=g)
        return seq[:-1], seq[1:]


class RandomTokens(pl.LightningDataModule):
    """Random token sequences (inputs and next-token targets): ``batch_size`` per device of ``seq_len`` tokens."""

    def __init__(self, batch_size: int = 8, seq_len: int = 512, vocab: int = 32000, samples: int = 1024) -> None:
        super().__init__()
        self.save_hyperparameters()
        self._data: Optional[_Tokens] = None

    @override
    def setup(self, stage: Optional[str] = None) -> None:
        self._data = _Tokens(self.hparams["samples"], self.hparams["seq_len"], self.hparams["vocab"])

    @override
    def train_dataloader(self) -> DataLoader:
        assert self._data is not None, "call setup() first"
        return DataLoader(self._data, batch_size=self.hparams["batch_size"])
