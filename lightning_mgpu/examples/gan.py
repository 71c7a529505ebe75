"""A GAN that draws 8x8 digits: two optimizers, manual optimization, ``accumulate_grad_batches`` through
:class:`~lightning_mgpu.ManualAccumulation`, trained with ``mgpu_ddp`` (no ``find_unused_parameters``).

    python -m lightning_mgpu.examples.gan fit --config configs/gan.yaml
    python -m lightning_mgpu.examples.gan fit --config configs/gan.yaml --trainer.accumulate_grad_batches 2

Quality is measured as the squared maximum mean discrepancy (RBF kernel, median bandwidth) between generated
images and real held-out ones: ``val/mmd`` every epoch, ``test/mmd`` and ``test/mmd_untrained`` (the same
generator before training) at the end.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from typing_extensions import override

from lightning_mgpu.examples._cli import fit_then_test
from lightning_mgpu.parts.accumulation import ManualAccumulation


def mmd2(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Squared MMD between samples ``x`` and ``y`` (rows), RBF kernel with the median-distance bandwidth.
    Computed in FP32 whatever the training precision (``cdist`` has no bf16 kernel on CPU)."""
    xy = torch.cat([x, y]).float()
    d2 = torch.cdist(xy, xy).pow(2)
    bandwidth = d2[d2 > 0].median().clamp_min(1e-6)
    k = torch.exp(-d2 / bandwidth)
    n = len(x)
    return k[:n, :n].mean() + k[n:, n:].mean() - 2 * k[:n, n:].mean()


class DigitsGAN(ManualAccumulation, pl.LightningModule):
    """MLP generator and discriminator on 8x8 digits (pixels in [0, 1]).

    Each micro-batch computes both models' gradients before either optimizer steps (simultaneous updates),
    which makes ``accumulate_grad_batches=k`` exactly equal to a k-times larger batch.

    Args:
        noise_dim: size of the generator's input noise.
        hidden: width of the hidden layers.
        lr: Adam learning rate of both models.
        betas: Adam betas (0.5 for the first moment, as usual for GANs).
    """

    def __init__(
        self, noise_dim: int = 16, hidden: int = 128, lr: float = 2e-3, betas: tuple[float, float] = (0.5, 0.999)
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = nn.Sequential(
            nn.Linear(noise_dim, hidden),
            nn.LeakyReLU(0.2),
            nn.Linear(hidden, 2 * hidden),
            nn.LeakyReLU(0.2),
            nn.Linear(2 * hidden, 64),
            nn.Sigmoid(),
        )
        self.discriminator = nn.Sequential(
            nn.Linear(64, 2 * hidden),
            nn.LeakyReLU(0.2),
            nn.Linear(2 * hidden, hidden),
            nn.LeakyReLU(0.2),
            nn.Linear(hidden, 1),
        )
        # the generator as built, before any training, for test/mmd_untrained: taken here, not when fit starts, so
        # that the main process of a spawn or fork launch (whose fit ran in the ranks) tests against it too; a
        # plain dict so that it is neither a submodule (parameters(), DDP) nor part of the checkpoint
        self._untrained = {k: v.detach().clone() for k, v in self.generator.state_dict().items()}

    def forward(self, noise: torch.Tensor) -> torch.Tensor:
        return self.generator(noise).view(-1, 1, 8, 8)

    def sample_noise(self, n: int) -> torch.Tensor:
        return torch.randn(n, self.hparams["noise_dim"], device=self.device)

    def discriminator_loss(self, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
        """Real images labelled 1, generated ones 0 (pass ``fake.detach()`` to leave the generator out)."""
        real_logits, fake_logits = self.discriminator(real), self.discriminator(fake)
        return F.binary_cross_entropy_with_logits(
            real_logits, torch.ones_like(real_logits)
        ) + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits))

    def generator_loss(self, fake: torch.Tensor) -> torch.Tensor:
        """Non-saturating generator loss: generated images labelled 1."""
        logits = self.discriminator(fake)
        return F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))

    @override
    def training_step(self, batch: Any, batch_idx: int) -> None:
        real = batch[0].flatten(1)
        g_opt, d_opt = self.optimizers()
        fake = self.generator(self.sample_noise(len(real)))

        with d_opt.toggle_model():  # generator frozen: only the discriminator gets gradients
            d_loss = self.discriminator_loss(real, fake.detach())
            self.manual_backward(d_loss)
        with g_opt.toggle_model():  # discriminator frozen
            g_loss = self.generator_loss(fake)
            self.manual_backward(g_loss)
        # With accumulate_grad_batches=k these step, sync and clear only on the k-th micro-batch.
        for opt in (d_opt, g_opt):
            opt.step()
            opt.zero_grad()
        # epoch means, reduced across ranks once per epoch (not one extra all-reduce per micro-batch)
        self.log_dict({"train/d_loss": d_loss, "train/g_loss": g_loss}, on_step=False, on_epoch=True, sync_dist=True)

    def _mmd(self, batch: Any, generator: nn.Module) -> torch.Tensor:
        real = batch[0].flatten(1)
        return mmd2(generator(self.sample_noise(len(real))), real)

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/mmd", self._mmd(batch, self.generator), sync_dist=True, prog_bar=True)

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test/mmd", self._mmd(batch, self.generator), sync_dist=True)
        untrained = copy.deepcopy(self.generator)
        untrained.load_state_dict(self._untrained)
        self.log("test/mmd_untrained", self._mmd(batch, untrained), sync_dist=True)

    @override
    def configure_optimizers(self) -> Any:
        lr, betas = self.hparams["lr"], tuple(self.hparams["betas"])
        return [
            torch.optim.Adam(self.generator.parameters(), lr=lr, betas=betas),
            torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=betas),
        ]


def main(args: Optional[list[str]] = None) -> None:
    """``LightningCLI`` over :class:`DigitsGAN` and the digits; ``fit`` is followed by ``test`` and a summary."""

    def report(trainer: pl.Trainer, result: dict[str, float]) -> None:
        print(
            f"test MMD^2 generated vs held-out digits: {result['test/mmd']:.4f} trained, "
            f"{result['test/mmd_untrained']:.4f} untrained"
        )
        stats = getattr(trainer.strategy, "comm_stats", None)
        if stats is not None:
            print(f"comm ledger (rank 0): {stats.summary()}")

    fit_then_test(DigitsGAN, args, report)


if __name__ == "__main__":
    # run the importable module's main: under `python -m` this file is `__main__`, and the config's
    # class_path (lightning_mgpu.examples.DigitsGAN) must match the class the CLI was given
    from lightning_mgpu.examples.gan import main as _main

    _main()
