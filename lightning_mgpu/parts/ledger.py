"""The communication ledger hooked up to a strategy: what it counts after each synchronised backward, when
it logs, and how the model's gradient size is read (one place for what both strategy families did)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import nn

from lightning_mgpu.comm import CommStats, buckets_from_grad_views


def attached_trainer(module: Optional[nn.Module]) -> Any:
    """The Trainer ``module`` (a LightningModule) is attached to, or None (public ``module.trainer`` raises
    when there is none)."""
    if module is None:
        return None
    try:
        return module.trainer
    except (RuntimeError, AttributeError):
        return None


def trainable_bytes(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad)


class Ledger:
    """A :class:`~lightning_mgpu.comm.CommStats` and when to fill and log it.

    Example::

        ledger = Ledger(log=True)
        ledger.start(model, world_size=2)          # after the model is wrapped
        ledger.record_buckets(ddp_model)            # after each synchronised backward (DDP, bucket views)
        ledger.optimizer_stepped(module, is_global_zero=True)
    """

    def __init__(self, log: bool = True) -> None:
        self.stats = CommStats()
        self.log = log
        self._bucket_layout: list[int] = []

    def start(self, model: nn.Module, world_size: int) -> None:
        """The model's trainable gradient bytes and the world size: the ring all-reduce lower bound's inputs."""
        self.stats.world_size = world_size
        self.stats.gradient_bytes = trainable_bytes(model.parameters())

    def record_round(self, layout: list[int]) -> None:
        self.stats.record_round(layout)

    def record_buckets(self, model: nn.Module) -> None:
        """One synchronised backward of DDP with bucket views: the buckets, read from the gradients' storages.

        DDP re-lays its buckets once, in its first iterations: read the layout then, and re-check it every 100
        rounds (reading walks every parameter: not for every step of a large model)."""
        stats = self.stats
        if not self._bucket_layout or stats.sync_rounds < 16 or stats.sync_rounds % 100 == 0:
            self._bucket_layout = buckets_from_grad_views(model.parameters())
        stats.record_round(self._bucket_layout)

    def optimizer_stepped(self, module: Optional[nn.Module], is_global_zero: bool) -> None:
        self.stats.optimizer_steps += 1
        self.write(module, is_global_zero)

    def write(self, module: Optional[nn.Module], is_global_zero: bool, force: bool = False) -> None:
        """Log ``comm/*`` through the Trainer's loggers every ``log_every_n_steps`` optimizer steps (rank 0)."""
        trainer = attached_trainer(module)
        if not self.log or trainer is None or not trainer.loggers or not is_global_zero:
            return
        # set on the Trainer at runtime by Lightning's logger connector (not a declared attribute)
        every = max(int(getattr(trainer, "log_every_n_steps", 50)), 1)
        if force or self.stats.optimizer_steps % every == 0:
            metrics = self.stats.as_metrics()
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
