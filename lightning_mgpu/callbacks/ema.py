"""An exponential moving average (EMA) of the weights that every rank keeps of its own shard only: no collective to
update it, none to evaluate with it, sharded in the checkpoint where the weights are sharded.

After each update step ``ema = decay * ema + (1 - decay) * weights`` (the first update copies the weights: the
rule of ``torch.optim.swa_utils.get_ema_avg_fn`` and Lightning's ``EMAWeightAveraging``, whose option names this
callback takes). Under ``mgpu_ddp``, ZeRO-1 and local SGD every rank holds the whole model and averages it; under
ZeRO-2/3 and HSDP (FSDP2) a parameter is a ``DTensor`` and each rank averages the local shard it holds. Only
trainable parameters are averaged (a frozen base, as under LoRA, costs nothing).

Lightning's ``WeightAveraging`` keeps an ``AveragedModel``, a deep copy of the whole LightningModule on one rank:
under sharding that is the full model on every rank. This callback holds one tensor per trainable parameter,
shaped as that rank's shard.

Example::

    from lightning_mgpu import EMA
    from pytorch_lightning import Trainer

    trainer = Trainer(strategy="mgpu_zero3", devices=2, callbacks=[EMA(decay=0.999)])
"""

from __future__ import annotations

from typing import Any, Optional

import pytorch_lightning as pl
import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from typing_extensions import override

from lightning_mgpu import comm
from lightning_mgpu.callbacks._base import MGPUCallback
from lightning_mgpu.plugins.checkpoint_io import EMA_STATE_KEY


def _reshard(module: nn.Module) -> None:
    """Free FSDP2's gathered parameters (a local operation, no collective), so that the next forward gathers the
    shards this callback has just written."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


class EMA(MGPUCallback):
    """Keeps an exponential moving average of the trainable weights, each rank of its own shard.

    Args:
        decay: the weight of the old average, in ``[0, 1)``.
        update_every_n_steps: update after every n-th optimizer step (``step_idx % n == 0``, ``step_idx`` the
            0-based index of the optimizer step just taken).
        update_starting_at_step: the first 0-based optimizer step after which the average is updated; the first
            update copies the weights.
        evaluate_with_ema: validate and test with the averaged weights (swapped into the model in place, tensor by
            tensor, and swapped back after the loop); ``False``: evaluate the trained weights.

    The average is in ``trainer.save_checkpoint`` / ``ModelCheckpoint`` files under ``"ema_state_dict"`` (one
    entry per trainable parameter, named as in the LightningModule's ``state_dict``): whole tensors in a
    one-file checkpoint, ``DTensor`` shards in a sharded directory (``MGPUShardedStrategy(checkpoint="sharded")``),
    so that resuming restores it exactly, at another world size too. ``lightning-mgpu export --ema`` writes these
    weights for Hugging Face.

    Example (the same under every ``mgpu_*`` strategy, each rank averaging its own shard):

        >>> import pytorch_lightning as pl
        >>> import torch
        >>> from lightning_mgpu import EMA
        >>> from lightning_mgpu.examples import DigitsCNN, DigitsDataModule
        >>> ema = EMA(decay=0.9, update_every_n_steps=2)
        >>> [ema.should_update(step) for step in range(4)]
        [True, False, True, False]
        >>> model = DigitsCNN()
        >>> trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, limit_val_batches=0, callbacks=[ema],
        ...                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False)
        >>> trainer.fit(model, DigitsDataModule())
        >>> trained = {n: p.detach().clone() for n, p in model.named_parameters()}
        >>> ema.swap(model)  # the average into the parameters, in place
        >>> any(not torch.equal(p, trained[n]) for n, p in model.named_parameters())
        True
        >>> ema.swap(model)  # and the trained weights back
        >>> all(torch.equal(p, trained[n]) for n, p in model.named_parameters())
        True
    """

    def __init__(
        self,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int = 0,
        evaluate_with_ema: bool = True,
    ) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= float(decay) < 1.0:
            raise ValueError(f"EMA(decay={decay!r}): the decay is a float in [0, 1), e.g. EMA(decay=0.999).")
        every = update_every_n_steps
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(
                f"EMA(update_every_n_steps={update_every_n_steps!r}): a positive integer, e.g. "
                f"EMA(update_every_n_steps=1) to update after every optimizer step."
            )
        if (
            isinstance(update_starting_at_step, bool)
            or not isinstance(update_starting_at_step, int)
            or update_starting_at_step < 0
        ):
            raise ValueError(
                f"EMA(update_starting_at_step={update_starting_at_step!r}): a 0-based optimizer step, an integer "
                f">= 0, e.g. EMA(update_starting_at_step=100)."
            )
        self.decay = float(decay)
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.evaluate_with_ema = evaluate_with_ema
        self._ema: dict[str, torch.Tensor] = {}  # name -> this rank's shard of the average
        self._loaded: Optional[dict[str, Any]] = None  # read from a checkpoint, placed at first use
        self._last_updated_step = 0
        self._swapped = False

    # --- what is averaged ----------------------------------------------------------------------------
    @staticmethod
    def _params(pl_module: nn.Module) -> dict[str, torch.Tensor]:
        """The trainable parameters by ``state_dict`` name; under FSDP2 the sharded ones (``DTensor``)."""
        _reshard(pl_module)
        return {name: p for name, p in pl_module.named_parameters() if p.requires_grad}

    @staticmethod
    def _all_names(pl_module: nn.Module, params: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """Every ``state_dict`` name of the averaged parameters, tied ones under each of their names (GPT-2's
        ``lm_head.weight`` is ``transformer.wte.weight``), so that a checkpoint's average replaces every copy."""
        first = {id(p): name for name, p in params.items()}
        return [(name, p) for name, p in pl_module.named_parameters(remove_duplicate=False) if id(p) in first]

    def _place_loaded(self, params: dict[str, torch.Tensor]) -> None:
        """The average read from a checkpoint, as this rank's shards on the parameters' devices: a sharded
        checkpoint hands ``DTensor`` shards, a one-file checkpoint whole tensors, which each rank slices locally."""
        loaded = self._loaded
        if loaded is None:
            return
        self._loaded = None
        missing = sorted(set(params) - set(loaded))
        if missing:
            raise KeyError(
                f"The checkpoint's EMA has no entry for {missing[:5]}: it was saved with other trainable parameters. "
                f"Resume with the LightningModule that wrote it, or start a new fit without ckpt_path."
            )
        self._ema = {}
        for name, p in params.items():
            saved = loaded[name]
            local = comm.local_shard(p.detach())
            if isinstance(saved, DTensor):
                value = saved.to_local()
            elif isinstance(p, DTensor):
                # every rank holds the whole tensor: each keeps its slice, no communication (src_data_rank=None)
                value = distribute_tensor(
                    saved.to(local.device), p.device_mesh, p.placements, src_data_rank=None
                ).to_local()
            else:
                value = saved
            self._ema[name] = value.to(device=local.device, dtype=local.dtype).clone()

    # --- the update ----------------------------------------------------------------------------------
    def should_update(self, step_idx: int) -> bool:
        """Whether the average is updated after the 0-based optimizer step ``step_idx``."""
        return step_idx >= self.update_starting_at_step and step_idx % self.update_every_n_steps == 0

    @torch.no_grad()
    def update(self, pl_module: nn.Module) -> None:
        """``ema = decay * ema + (1 - decay) * weights`` on this rank's shards (the first update copies them)."""
        params = self._params(pl_module)
        self._place_loaded(params)
        decay = self.decay
        for name, p in params.items():
            local = comm.local_shard(p.detach())
            average = self._ema.get(name)
            if average is None:
                self._ema[name] = local.clone()
            else:
                average.mul_(decay).add_(local, alpha=1.0 - decay)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # global_step counts optimizer steps: an update once per step, not per micro-batch
        step_idx = trainer.global_step - 1
        if trainer.global_step > self._last_updated_step and self.should_update(step_idx):
            self.update(pl_module)
            self._last_updated_step = trainer.global_step

    # --- evaluating with the average -----------------------------------------------------------------
    @torch.no_grad()
    def swap(self, pl_module: nn.Module) -> None:
        """Exchange the weights and the average in place, one tensor at a time (one temporary of one parameter's
        shard): called twice, everything is as it was."""
        params = self._params(pl_module)
        self._place_loaded(params)
        if not self._ema:
            return
        for name, p in params.items():
            local = comm.local_shard(p.detach())
            average = self._ema[name]
            kept = local.clone()
            local.copy_(average)
            average.copy_(kept)
        self._swapped = not self._swapped

    def _swap_in(self, pl_module: nn.Module) -> None:
        if self.evaluate_with_ema and not self._swapped and (self._ema or self._loaded is not None):
            self.swap(pl_module)

    def _swap_out(self, pl_module: nn.Module) -> None:
        if self._swapped:
            self.swap(pl_module)

    # the loop's start and end (not the epoch's): the strategy's own evaluation set-up runs after the callbacks'
    # start and its tear-down after their end, and ModelCheckpoint saves after every other callback's end
    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_in(pl_module)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_out(pl_module)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_in(pl_module)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_out(pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._swap_out(pl_module)  # the trained weights back in the model, whatever failed during evaluation

    # --- checkpoints ---------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "last_updated_step": self._last_updated_step,
            "decay": self.decay,
            "update_every_n_steps": self.update_every_n_steps,
            "update_starting_at_step": self.update_starting_at_step,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_updated_step = int(state_dict["last_updated_step"])

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._swapped:
            raise RuntimeError(
                "A checkpoint was saved while the EMA weights were swapped in for evaluation: its state_dict would "
                "hold the average. Save outside validation_step/test_step (ModelCheckpoint does: it runs after the "
                "EMA callback has swapped the trained weights back)."
            )
        params = self._params(pl_module)
        self._place_loaded(params)
        if not self._ema:
            return
        sharded = getattr(trainer.strategy, "checkpoint_layout", None) == "sharded"
        entries: dict[str, torch.Tensor] = {}
        first = {id(p): name for name, p in params.items()}
        for name, p in self._all_names(pl_module, params):
            average = self._ema[first[id(p)]]
            if isinstance(p, DTensor):
                spread = DTensor.from_local(
                    average, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
                # a one-file checkpoint holds whole tensors (the weights are gathered for it too); a sharded
                # directory each rank's shard
                entries[name] = spread if sharded else comm.full_tensor(spread).cpu()
            else:
                entries[name] = average
        checkpoint[EMA_STATE_KEY] = entries

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        saved = checkpoint.get(EMA_STATE_KEY)
        self._ema = {}
        self._swapped = False
        # placed at first use: the parameters may not be on their device, or sharded, yet
        self._loaded = dict(saved) if saved is not None else None
