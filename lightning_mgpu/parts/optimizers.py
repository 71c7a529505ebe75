"""The torch optimizer behind Lightning's wrapper (one place for the unwrapping every part needs)."""

from __future__ import annotations

from typing import Any

from pytorch_lightning.core.optimizer import LightningOptimizer
from torch.optim import Optimizer


def unwrap_optimizer(optimizer: Any) -> Optimizer:
    """``optimizer`` itself, or the torch optimizer a :class:`LightningOptimizer` wraps.

    Example::

        opt = unwrap_optimizer(self.optimizers())  # in a LightningModule: the torch.optim object
    """
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
