"""LR schedules whose length comes from the Trainer, so changing devices or accumulation keeps them right.

With N devices each rank sees 1/N of the data, and with accumulation k one optimizer step takes k batches:
a schedule written as "total_steps = len(dataset) // batch_size * epochs" is N*k times too long and never
finishes its decay (the multi-GPU training article "深度学习多卡训练": "lr_scheduler 会有所影响"). Lightning
already counts the real number:
``trainer.estimated_stepping_batches`` (devices, nodes, accumulation, ``max_steps`` and
``limit_train_batches`` included). :func:`warmup_schedule` builds on it::

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        return {"optimizer": opt, "lr_scheduler": lightning_mgpu.warmup_schedule(opt, self.trainer, warmup=0.1)}

Why a ``LambdaLR`` with our formula rather than torch's ``SequentialLR(LinearLR, CosineAnnealingLR / LinearLR /
ConstantLR)``: within the run the two give the same LRs to float rounding (``tests/unit/test_schedules.py`` compares
them step by step; the warmup's first step, ``peak / warmup``, is ``LinearLR(start_factor=1 / warmup)``, so
LinearLR's ``start_factor > 0`` is no obstacle), and both checkpoints resume exactly. They differ where it
matters to a run whose length is an estimate:

* torch's ``CosineAnnealingLR`` is periodic: one step past ``T_max`` its LR climbs back towards the peak (23
  steps, warmup 4, final 0.1 x peak: 5 steps past the end take it from 0.1 x to 0.26 x the peak), where ours
  holds ``final_lr_ratio``. ``estimated_stepping_batches`` is an estimate (a loader whose length changes, a
  finished run resumed with a larger ``max_epochs``), so steps past the end do happen;
* torch's chainable schedulers are recursive (each step multiplies the current LR), so the last step's LR is
  ``final_lr_ratio`` x peak only to rounding (linear: ``0.009999999999999997`` for ``0.1 x 0.1``); ``LambdaLR``
  computes every step from the base LR in closed form and lands on it exactly (``tests/unit/test_schedules.py``);
* closed form also means an LR a callback changes for one step does not carry into the next ones.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Union

import pytorch_lightning as pl
import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["total_steps", "warmup_schedule"]

_DECAYS = ("cosine", "linear", "constant")


def total_steps(trainer: pl.Trainer) -> int:
    """Optimizer steps the coming ``fit`` will take: ``trainer.estimated_stepping_batches`` as an int, with
    a clear error for an endless run (``max_epochs=-1`` without ``max_steps``). Call it from
    ``configure_optimizers`` (the Trainer knows the run's length there), as :func:`warmup_schedule` does.

    Example:

        >>> from pytorch_lightning import Trainer
        >>> from lightning_mgpu import total_steps
        >>> total_steps(Trainer(max_steps=1000, logger=False))
        1000
        >>> try:
        ...     total_steps(Trainer(max_epochs=-1, logger=False))
        ... except ValueError as err:
        ...     print(str(err).split(":")[0])
        The number of optimizer steps is unbounded (max_epochs=-1 and max_steps=-1, or an endless DataLoader)
    """
    steps = trainer.estimated_stepping_batches
    if math.isinf(steps):
        raise ValueError(
            "The number of optimizer steps is unbounded (max_epochs=-1 and max_steps=-1, or an endless "
            "DataLoader): a schedule needs a length. Set Trainer(max_steps=...) or Trainer(max_epochs=...)."
        )
    return int(steps)


def warmup_schedule(
    optimizer: torch.optim.Optimizer,
    trainer: pl.Trainer,
    *,
    warmup: Union[int, float] = 0.05,
    decay: Literal["cosine", "linear", "constant"] = "cosine",
    final_lr_ratio: float = 0.0,
) -> dict[str, Any]:
    """A Lightning ``lr_scheduler`` config (stepped every optimizer step): linear warmup from 0 (warmup step
    ``s`` uses ``(s + 1) / warmup`` of the peak LR, so none is spent at 0), then ``decay`` down to
    ``final_lr_ratio`` x the peak LR exactly at the last step of the run, held after it.

    Args:
        warmup: warmup length; a float in [0, 1) is a fraction of :func:`total_steps`, an int is steps.
        decay: ``"cosine"``, ``"linear"`` or ``"constant"`` after the warmup.
        final_lr_ratio: LR at the end as a fraction of the peak, in [0, 1].

    Example (in ``configure_optimizers``; here with a Trainer of 100 optimizer steps):

        >>> import torch
        >>> from pytorch_lightning import Trainer
        >>> from lightning_mgpu import warmup_schedule
        >>> opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        >>> config = warmup_schedule(opt, Trainer(max_steps=100, logger=False), warmup=0.1, decay="linear")
        >>> config["interval"]
        'step'
        >>> lrs = []
        >>> for _ in range(100):
        ...     lrs.append(opt.param_groups[0]["lr"]); opt.step(); config["scheduler"].step()
        >>> [round(lrs[i] / 1e-3, 2) for i in (0, 9, 54, 99)]  # warmup 10 steps, then linear down to 0 at the end
        [0.1, 1.0, 0.51, 0.0]
    """
    if decay not in _DECAYS:
        raise ValueError(f"warmup_schedule(decay={decay!r}): choose one of {', '.join(map(repr, _DECAYS))}.")
    if not 0.0 <= final_lr_ratio <= 1.0:
        raise ValueError(f"warmup_schedule(final_lr_ratio={final_lr_ratio!r}): must be in [0, 1].")
    total = total_steps(trainer)
    if isinstance(warmup, bool) or not isinstance(warmup, (int, float)):
        raise TypeError(f"warmup_schedule(warmup={warmup!r}): an int (steps) or a float in [0, 1) (fraction).")
    if isinstance(warmup, float):
        if not 0.0 <= warmup < 1.0:
            raise ValueError(
                f"warmup_schedule(warmup={warmup!r}): a float is a fraction of the run and must be in [0, 1); "
                f"pass an int for a number of steps."
            )
        warmup_steps = round(warmup * total)
    else:
        if not 0 <= warmup < max(total, 1):
            raise ValueError(f"warmup_schedule(warmup={warmup}): must be in [0, {total}) steps (the whole run).")
        warmup_steps = warmup
    lam = _Schedule(warmup_steps, total, decay, final_lr_ratio)
    return {"scheduler": LambdaLR(optimizer, lam), "interval": "step", "frequency": 1}


class _Schedule:
    """Picklable LR multiplier (checkpoints store LambdaLR's state, not the function; spawn pickles it)."""

    def __init__(self, warmup: int, total: int, decay: str, final: float) -> None:
        self.warmup, self.total, self.decay, self.final = warmup, total, decay, final

    def __call__(self, step: int) -> float:
        # LambdaLR calls this with the number of steps taken; the LR of step s is lambda(s)
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.decay == "constant":
            return 1.0
        span = max(self.total - 1 - self.warmup, 1)
        progress = min(max(step - self.warmup, 0) / span, 1.0)
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.decay == "cosine" else 1.0 - progress
        return self.final + (1.0 - self.final) * shape
