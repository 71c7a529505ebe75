"""``MGPULocalSGDStrategy`` and ``MGPUDiLoCoStrategy``: DDP's processes and launch, without the gradient all-reduce
of every step; the weights are synced every ``sync_every`` optimizer steps instead (``parts/periodic_sync.py``).

Example::

    import lightning_mgpu  # registers "mgpu_local_sgd", "mgpu_diloco", ... with Lightning
    from pytorch_lightning import Trainer

    trainer = Trainer(accelerator="cpu", devices=2, strategy=MGPUDiLoCoStrategy(sync_every=32))
    trainer.fit(model, datamodule)
    print(trainer.strategy.comm_stats.summary())  # bytes per optimizer step: about 1/32 of mgpu_ddp's
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from pytorch_lightning.plugins.precision import Precision

from lightning_mgpu.parts.activation_checkpointing import ActivationCheckpointingPolicy, CheckpointSave
from lightning_mgpu.parts.periodic_sync import CHECKPOINT_KEY, PeriodicSync
from lightning_mgpu.settings import (
    CommDtype,
    CommonSettings,
    CompileSetting,
    DiLoCoSettings,
    LocalSGDSettings,
    StartMethod,
    arguments_of,
    from_arguments,
    lightning_arguments,
    strategy_options,
)
from lightning_mgpu.strategies.ddp import MGPUDDPStrategy

__all__ = ["CHECKPOINT_KEY", "MGPUDiLoCoStrategy", "MGPULocalSGDStrategy"]

_DDP_KEYWORDS = (
    ":class:`~lightning_mgpu.MGPUDDPStrategy` arguments (``loss_normalization``, ``nonfinite``, ...) and "
    "DistributedDataParallel's keywords; DDP's gradient options (``comm_hook``, ``static_graph``, "
    "``micro_batch_size``) are refused, naming why."
)


@strategy_options(LocalSGDSettings, CommonSettings, var_keyword=_DDP_KEYWORDS)
class MGPULocalSGDStrategy(MGPUDDPStrategy):
    """Local SGD: every rank steps its own optimizer on its own batches; every ``sync_every`` optimizer steps the
    ranks average their weights (one all-reduce of the weights instead of one of the gradients per step: about
    ``1/sync_every`` of mgpu_ddp's bytes, measured by :attr:`comm_stats`). torch's post-local SGD
    (``PeriodicModelAverager``), with checkpoints that resume exactly.

    * ``sync_every=1`` with SGD (momentum allowed) gives mgpu_ddp's weights to rounding: the update is linear.
    * Accumulation works: ``sync_every`` counts optimizer steps, not micro-batches.
    * After each sync every rank holds identical weights; in between they differ. A checkpoint holds the last
      synced weights, the step within the period and every rank's own weights and optimizer state: resuming on
      the same number of ranks continues exactly; on another number, from the last synced weights (with a
      warning). ``checkpoint["state_dict"]`` is rank 0's own weights, as in mgpu_ddp.
    * Manual optimization is refused (what a period counts is one optimizer's steps); use mgpu_ddp.
    * ``fault_tolerance`` (as :class:`MGPUDDPStrategy`'s, without ``warmup_steps``): replica groups that sync
      through torchft, each sync a transaction over the groups alive at it (the fault-tolerance guide).

    The other arguments (``process_group_backend``, ``timeout``, ``start_method``, ``log_comm_stats``, activation
    checkpointing, ``compile``, ``exact_evaluation``, ``check_uneven_inputs``, ``checkpoint_io`` and
    DistributedDataParallel's keywords) are those of :class:`MGPUDDPStrategy`; DDP's broadcast of rank 0's buffers
    before every forward is off: floating-point buffers (BatchNorm statistics) are averaged at each sync instead.

    Example (``trainer.fit(model, datamodule)`` then starts the ranks; after it,
    ``strategy.comm_stats.ratio_to_lower_bound`` is about 1/8: the bytes per step against mgpu_ddp's):

        >>> from pytorch_lightning import Trainer
        >>> from lightning_mgpu import MGPULocalSGDStrategy
        >>> strategy = MGPULocalSGDStrategy(sync_every=8, warmup_steps=100)  # or strategy="mgpu_local_sgd"
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=800, logger=False)
        >>> trainer.strategy is strategy, trainer.world_size
        (True, 2)
        >>> MGPULocalSGDStrategy(sync_every=0)  # refused before anything starts
        Traceback (most recent call last):
        ...
        ValueError: sync_every=0 must be an int >= 1: the number of optimizer steps between syncs (1 = every step).
    """

    strategy_name = "mgpu_local_sgd"
    syncs_manual_optimization = False

    def __init__(
        self,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        sync_every: int = 8,
        warmup_steps: int = 0,
        comm_dtype: Optional[CommDtype] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: StartMethod = "popen",
        log_comm_stats: bool = True,
        activation_checkpointing: Optional[ActivationCheckpointingPolicy] = None,
        activation_checkpointing_reentrant: bool = False,
        activation_checkpointing_save: CheckpointSave = None,
        compile: CompileSetting = False,
        exact_evaluation: bool = True,
        check_uneven_inputs: bool = True,
        **ddp_kwargs: Any,
    ) -> None:
        arguments = dict(locals())
        settings = from_arguments(LocalSGDSettings, arguments)
        super().__init__(
            **lightning_arguments(arguments),
            **arguments_of(CommonSettings, arguments),
            **LocalSGDSettings.ddp_kwargs(type(self).__name__, ddp_kwargs, settings.warmup_steps),
        )
        self._periodic = self._runtime.sync_periodically(settings)

    # --- what users read ----------------------------------------------------------------------------------
    @property
    def periodic_settings(self) -> LocalSGDSettings:
        """The validated periodic-sync settings (``sync_every``, ``warmup_steps``, ``comm_dtype``, ...)."""
        return self._periodic.settings

    @property
    def periodic_sync(self) -> PeriodicSync:
        """The sync part: ``steps``, ``since_sync``, ``syncs``, ``resumed`` (``"exact"``/``"synced"`` after a
        restore) and the last synced weights (``anchor``)."""
        return self._periodic

    def __repr__(self) -> str:
        s = self._periodic.settings
        return f"{type(self).__name__}(sync_every={s.sync_every}, start_method={self.launch_settings.start_method!r})"


@strategy_options(DiLoCoSettings, CommonSettings, var_keyword=_DDP_KEYWORDS)
class MGPUDiLoCoStrategy(MGPUDDPStrategy):
    """DiLoCo (the DiLoCo paper; torchft's ``DiLoCo``): ``sync_every`` inner optimizer steps on each rank (the
    LightningModule's own optimizer, AdamW in the paper), then an outer SGD step with Nesterov momentum on the last
    synced weights along the averaged difference ``synced - local``, which every rank copies in.

    One all-reduce of the weight difference every ``sync_every`` steps: about ``1/sync_every`` of mgpu_ddp's bytes
    (measured by :attr:`comm_stats`). With ``outer_lr=1, outer_momentum=0, nesterov=False`` it is local SGD;
    at ``sync_every=1`` with an SGD inner optimizer that equals mgpu_ddp to rounding. Checkpoints hold the outer
    optimizer's state too; everything else is as :class:`MGPULocalSGDStrategy`.

    Example (on 8 GPUs: ``Trainer(accelerator="gpu", devices=8, strategy=strategy)``):

        >>> from pytorch_lightning import Trainer
        >>> from lightning_mgpu import MGPUDiLoCoStrategy
        >>> strategy = MGPUDiLoCoStrategy(sync_every=64, outer_lr=0.7, comm_dtype="bf16")
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
        >>> type(trainer.strategy).__name__
        'MGPUDiLoCoStrategy'
        >>> MGPUDiLoCoStrategy(outer_momentum=1.0)
        Traceback (most recent call last):
        ...
        ValueError: outer_momentum=1.0 must be a number in [0, 1) (the DiLoCo paper uses 0.9).
    """

    strategy_name = "mgpu_diloco"
    syncs_manual_optimization = False

    def __init__(
        self,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        sync_every: int = 32,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        warmup_steps: int = 0,
        comm_dtype: Optional[CommDtype] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: StartMethod = "popen",
        log_comm_stats: bool = True,
        activation_checkpointing: Optional[ActivationCheckpointingPolicy] = None,
        activation_checkpointing_reentrant: bool = False,
        activation_checkpointing_save: CheckpointSave = None,
        compile: CompileSetting = False,
        exact_evaluation: bool = True,
        check_uneven_inputs: bool = True,
        **ddp_kwargs: Any,
    ) -> None:
        arguments = dict(locals())
        settings = from_arguments(DiLoCoSettings, arguments)
        super().__init__(
            **lightning_arguments(arguments),
            **arguments_of(CommonSettings, arguments),
            **LocalSGDSettings.ddp_kwargs(type(self).__name__, ddp_kwargs, settings.warmup_steps),
        )
        self._periodic = self._runtime.sync_periodically(settings)

    @property
    def periodic_settings(self) -> DiLoCoSettings:
        """The validated periodic-sync settings (``sync_every``, ``outer_lr``, ``outer_momentum``, ...)."""
        settings = self._periodic.settings
        assert isinstance(settings, DiLoCoSettings)
        return settings

    @property
    def periodic_sync(self) -> PeriodicSync:
        """The sync part (see :attr:`MGPULocalSGDStrategy.periodic_sync`)."""
        return self._periodic

    def __repr__(self) -> str:
        s = self._periodic.settings
        assert isinstance(s, DiLoCoSettings)
        return (
            f"{type(self).__name__}(sync_every={s.sync_every}, outer_lr={s.outer_lr}, "
            f"outer_momentum={s.outer_momentum}, nesterov={s.nesterov}, "
            f"start_method={self.launch_settings.start_method!r})"
        )
