"""ScaleLR: learning rates that follow the effective batch size (devices x nodes x accumulation)."""

from __future__ import annotations

import math
from typing import Any, Literal, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_mgpu.callbacks._base import MGPUCallback
from lightning_mgpu.distributed import effective_batch_size

__all__ = ["ScaleLR"]

# The factor applied is stored in each param group: param groups are part of the optimizer's state_dict, so
# a resumed run knows what the checkpointed LRs were scaled by and rescales by new/old when the world size
# changed, instead of scaling twice.
_KEY = "mgpu_lr_scale"
_GROUP_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")  # LambdaLR/StepLR..., OneCycleLR
_SCHEDULER_LISTS = ("base_lrs", "_last_lr", "max_lrs", "min_lrs")  # most schedulers, CyclicLR, ReduceLROnPlateau
_SCHEDULER_SCALARS = ("eta_min",)  # CosineAnnealingLR(WarmRestarts)


class ScaleLR(MGPUCallback):
    """Scale every optimizer's learning rates by the effective batch size relative to ``base_batch_size``
    (the batch the LRs in ``configure_optimizers`` were tuned for), before the first optimizer step.

    ``factor = B / base_batch_size`` (``rule="linear"``, Goyal et al. 2017) or its square root
    (``rule="sqrt"``, common for Adam), where ``B`` = per-device batch x devices x nodes x accumulation
    (:func:`~lightning_mgpu.effective_batch_size`). LR schedulers built in ``configure_optimizers`` are
    scaled with their optimizer (``base_lrs`` and friends), so their shape is kept.

    ``warmup_steps``: for the first optimizer steps the LR ramps linearly from the unscaled to the scaled
    value (applied around each ``optimizer.step`` through torch's step hooks, on top of any scheduler).

    Resuming: the factor is recorded in the optimizer's param groups, which the checkpoint stores; a run
    resumed on a different number of devices rescales the restored LRs by new/old factor.

    Example (the LRs were tuned for a batch of 256; this run has 32 x 8 devices x 2 = 512):

        >>> from pytorch_lightning import Trainer
        >>> from lightning_mgpu import ScaleLR
        >>> scale = ScaleLR(base_batch_size=256, batch_size=32)
        >>> trainer = Trainer(strategy="mgpu_ddp", accelerator="cpu", devices=8, accumulate_grad_batches=2,
        ...                   callbacks=[scale], logger=False)
        >>> scale.compute_factor(trainer)  # fit multiplies every LR by it before the first step
        2.0
        >>> ScaleLR(base_batch_size=256, batch_size=32, rule="sqrt").compute_factor(trainer)
        1.4142135623730951
    """

    def __init__(
        self,
        base_batch_size: int,
        rule: Literal["linear", "sqrt"] = "linear",
        warmup_steps: int = 0,
        batch_size: Optional[int] = None,
    ) -> None:
        """
        Args:
            base_batch_size: the effective batch size your LRs are tuned for.
            rule: ``"linear"`` or ``"sqrt"``.
            warmup_steps: optimizer steps of linear warmup from the unscaled to the scaled LR (0: none).
            batch_size: the per-device batch size, if it cannot be read from the train DataLoader.
        """
        for name, value, low in (("base_batch_size", base_batch_size, 1), ("warmup_steps", warmup_steps, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"ScaleLR({name}={value!r}): must be an int >= {low}.")
        if rule not in ("linear", "sqrt"):
            raise ValueError(f"ScaleLR(rule={rule!r}): choose 'linear' (lr x B/base) or 'sqrt' (lr x sqrt(B/base)).")
        bad_batch = isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        if batch_size is not None and bad_batch:
            raise ValueError(f"ScaleLR(batch_size={batch_size!r}): the per-device batch size must be an int >= 1.")
        self.base_batch_size = base_batch_size
        self.rule = rule
        self.warmup_steps = warmup_steps
        self.batch_size = batch_size
        self.factor: Optional[float] = None
        self.effective_batch_size: Optional[int] = None
        self._hook_handles: list[RemovableHandle] = []
        self._steps: dict[int, int] = {}
        self._saved: dict[int, list[float]] = {}

    def compute_factor(self, trainer: pl.Trainer) -> float:
        self.effective_batch_size = effective_batch_size(trainer, self.batch_size)
        ratio = self.effective_batch_size / self.base_batch_size
        return ratio if self.rule == "linear" else math.sqrt(ratio)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.factor = factor = self.compute_factor(trainer)
        lines = []
        for i, opt in enumerate(trainer.optimizers):
            ratios = []
            for group in opt.param_groups:
                ratio = factor / float(group.get(_KEY, 1.0))  # resumed groups carry the old factor
                before = group["lr"]
                for key in _GROUP_KEYS:
                    if isinstance(group.get(key), (int, float)):
                        group[key] *= ratio
                group[_KEY] = factor
                ratios.append(ratio)
                lines.append(f"optimizer {i} ({type(opt).__name__}) group lr {before:.3g} -> {group['lr']:.3g}")
            for config in trainer.lr_scheduler_configs:
                if config.scheduler.optimizer is opt:
                    _scale_scheduler(config.scheduler, ratios)
            if self.warmup_steps:
                # optimizer steps already taken by this optimizer (a resumed run continues its warmup)
                self._steps[id(opt)] = trainer.global_step // max(len(trainer.optimizers), 1)
                self._hook_handles.append(opt.register_step_pre_hook(self._pre_step))
                self._hook_handles.append(opt.register_step_post_hook(self._post_step))
        strategy = trainer.strategy
        rank_zero_info(
            f"ScaleLR: effective batch {self.effective_batch_size} (per-device batch x {trainer.num_devices} devices "
            f"x {trainer.num_nodes} nodes x accumulation {trainer.accumulate_grad_batches}, {type(strategy).__name__})"
            f" vs base {self.base_batch_size}: {self.rule} rule, lr x {factor:.4g}"
            + (f", warmup {self.warmup_steps} steps" if self.warmup_steps else "")
            + "\n  "
            + "\n  ".join(lines)
        )

    def warmup_multiplier(self, step: int) -> float:
        """LR multiplier on top of the scaled LR at optimizer step ``step`` (0-based) during warmup: from
        1/factor (the unscaled LR) to 1. Only a factor > 1 is warmed up (a smaller LR needs no warmup)."""
        factor = self.factor or 1.0
        if step >= self.warmup_steps or factor <= 1.0:
            return 1.0
        return (1.0 + (factor - 1.0) * step / self.warmup_steps) / factor

    def _pre_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        mult = self.warmup_multiplier(self._steps.get(id(opt), 0))
        if mult != 1.0:
            self._saved[id(opt)] = [g["lr"] for g in opt.param_groups]
            for g in opt.param_groups:
                g["lr"] = g["lr"] * mult

    def _post_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        saved = self._saved.pop(id(opt), None)
        if saved is not None:  # the scheduler (stepped after this) sees the scaled LR, never the warmed one
            for g, lr in zip(opt.param_groups, saved):
                g["lr"] = lr
        self._steps[id(opt)] = self._steps.get(id(opt), 0) + 1

    def _remove(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        self._steps.clear()
        self._saved.clear()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove()


def _scale_scheduler(scheduler: Any, ratios: list[float]) -> None:
    for name in _SCHEDULER_LISTS:
        values = getattr(scheduler, name, None)
        if isinstance(values, list) and len(values) == len(ratios):
            setattr(scheduler, name, [v * r if isinstance(v, (int, float)) else v for v, r in zip(values, ratios)])
    for name in _SCHEDULER_SCALARS:
        value = getattr(scheduler, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            setattr(scheduler, name, value * ratios[0])
    for inner in getattr(scheduler, "_schedulers", []) or []:  # SequentialLR, ChainedScheduler
        _scale_scheduler(inner, ratios)
