"""A tiny two-optimizer GAN-shaped module for the manual-optimization tests, and its plain-torch reference.

The noise comes with the data (``(x, z)`` pairs), so one process with the global batch and N ranks with
slices of it see exactly the same samples and the same noise.
"""

from __future__ import annotations

import copy
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import ManualAccumulation

Z_DIM, X_DIM = 4, 6


def make_gan_data(n: int = 96, dtype: torch.dtype = torch.float64) -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, X_DIM, generator=g, dtype=dtype) * 0.5 + 1.0
    z = torch.randn(n, Z_DIM, generator=g, dtype=dtype)
    return TensorDataset(x, z)


class TinyGAN(ManualAccumulation, pl.LightningModule):
    """Generator (SGD+momentum) and discriminator (Adam), each with a StepLR that halves-ish the LR every
    optimizer step: a scheduler stepped per micro-batch would change the weights. All backward passes of a
    micro-batch run before its optimizer steps (so accumulation equals the larger batch exactly)."""

    def __init__(self, lr_g: float = 0.1, lr_d: float = 0.05, gamma: float = 0.7) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(Z_DIM, 16), nn.Tanh(), nn.Linear(16, X_DIM))
        self.discriminator = nn.Sequential(nn.Linear(X_DIM, 16), nn.Tanh(), nn.Linear(16, 1))
        self.lr_g, self.lr_d, self.gamma = lr_g, lr_d, gamma

    def d_loss(self, x: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
        real_logits, fake_logits = self.discriminator(x), self.discriminator(fake)
        return F.binary_cross_entropy_with_logits(
            real_logits, torch.ones_like(real_logits)
        ) + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits))

    def g_loss(self, fake: torch.Tensor) -> torch.Tensor:
        logits = self.discriminator(fake)
        return F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, z = batch
        g_opt, d_opt = self.optimizers()
        fake = self.generator(z)
        with d_opt.toggle_model():
            self.manual_backward(self.d_loss(x, fake.detach()))
        with g_opt.toggle_model():
            self.manual_backward(self.g_loss(fake))
        d_opt.step()
        d_opt.zero_grad()
        g_opt.step()
        g_opt.zero_grad()
        for scheduler in self.lr_schedulers():
            scheduler.step()

    def configure_optimizers(self) -> Any:
        g_opt = torch.optim.SGD(self.generator.parameters(), lr=self.lr_g, momentum=0.9)
        d_opt = torch.optim.Adam(self.discriminator.parameters(), lr=self.lr_d)
        schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=self.gamma) for o in (g_opt, d_opt)]
        return [g_opt, d_opt], schedulers


def gan_reference(model: TinyGAN, dataset: TensorDataset, global_batch: int, epochs: int) -> dict[str, torch.Tensor]:
    """One process, plain torch, batches of ``global_batch`` in order; the discriminator's parameters are
    frozen for the generator's backward (what toggle_model does)."""
    model = copy.deepcopy(model)
    (g_opt, d_opt), (g_sch, d_sch) = model.configure_optimizers()  # the optimizers only; the loop is ours
    for _ in range(epochs):
        for x, z in DataLoader(dataset, batch_size=global_batch, shuffle=False):
            fake = model.generator(z)
            model.d_loss(x, fake.detach()).backward()
            model.discriminator.requires_grad_(False)
            model.g_loss(fake).backward()
            model.discriminator.requires_grad_(True)
            for opt in (d_opt, g_opt):
                opt.step()
                opt.zero_grad(set_to_none=True)
            g_sch.step()
            d_sch.step()
    return weights(model)


def weights(model: TinyGAN) -> dict[str, torch.Tensor]:
    return {
        name: torch.cat([p.detach().flatten().clone() for p in getattr(model, name).parameters()])
        for name in ("generator", "discriminator")
    }
