"""``MGPUShardedStrategy``: ZeRO stages 1/2/3 on every device type, with accumulation that does not sync,
and checkpoints that resume at another world size.

Example::

    import lightning_mgpu  # registers "mgpu_sharded", "mgpu_zero1", "mgpu_zero3", ...
    from pytorch_lightning import Trainer

    trainer = Trainer(accelerator="cpu", devices=2, strategy="mgpu_sharded", accumulate_grad_batches=2)
    trainer.fit(model, datamodule)
    print(trainer.strategy.memory_report())  # optimizer-state / gradient / parameter bytes held by this rank
"""

from __future__ import annotations

import inspect
import logging
from abc import ABCMeta
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from torch import nn
from typing_extensions import override

from lightning_mgpu import _compat
from lightning_mgpu.checkpointing import ActivationCheckpointingPolicy, classes_present
from lightning_mgpu.parts.process_group import group_is_up
from lightning_mgpu.precision import MGPUPrecision
from lightning_mgpu.settings import (
    Backend,
    CheckpointLayout,
    CommHookName,
    CommonSettings,
    LossNormalization,
    MicroBatchSetting,
    NonFinite,
    ShardedSettings,
    Stage,
    StartMethod,
    split_ddp_kwargs,
)
from lightning_mgpu.strategies._common import MGPUStrategyMixin
from lightning_mgpu.strategies._sharded_checkpoints import ShardedCheckpoints
from lightning_mgpu.strategies._sharding import (
    ShardingBackend,
    check_optimizer,
    local_bytes,
    make_backend,
    rebind_schedulers,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardMemory:
    """Bytes this rank holds right now (a DTensor counts its local shard), from
    ``trainer.strategy.memory_report()`` of :class:`MGPUShardedStrategy` (no communication).

    Example:

        >>> import pytorch_lightning as pl, torch
        >>> from lightning_mgpu import MGPUShardedStrategy
        >>> from lightning_mgpu.examples import DigitsCNN, DigitsDataModule
        >>> class Report(pl.Callback):
        ...     def on_train_end(self, trainer, module):
        ...         memory = trainer.strategy.memory_report()
        ...         print(memory.parameters == sum(p.numel() * 4 for p in module.parameters()))
        >>> trainer = pl.Trainer(strategy=MGPUShardedStrategy(stage=3), accelerator="cpu", devices=1, max_steps=2,
        ...                      callbacks=[Report()], logger=False, enable_checkpointing=False,
        ...                      enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(DigitsCNN(), DigitsDataModule())  # on 1 rank the shard is the whole model
        True
    """

    optimizer_state: int
    gradients: int
    parameters: int


class _StageDispatch(ABCMeta):
    """``MGPUShardedStrategy(stage=...)`` as users (and LightningCLI, and the presets) write it builds the stage's
    class: stage 1 is DDP + a sharded optimizer (an MGPUDDPStrategy); stages 2/3 shard gradients (and parameters)
    and are not DDP. A bad stage goes to the stage-2/3 class, whose settings refuse it. (A metaclass, not
    ``__new__``: LightningCLI reads the arguments from ``__new__`` when a class defines one.)"""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        from lightning_mgpu.strategies.fsdp import MGPUFSDPStrategy
        from lightning_mgpu.strategies.zero1 import MGPUZeRO1Strategy

        if not issubclass(cls, (MGPUZeRO1Strategy, MGPUFSDPStrategy)):
            stage = kwargs.get("stage", args[0] if args else 2)
            stage_class = MGPUZeRO1Strategy if type(stage) is int and stage == 1 else MGPUFSDPStrategy
            # a user's subclass of MGPUShardedStrategy keeps its overrides in front of the stage's class
            built: type = stage_class if cls is MGPUShardedStrategy else _with_stage_class(cls, stage_class)
            return type.__call__(built, *args, **kwargs)
        return type.__call__(cls, *args, **kwargs)


_STAGED: dict[tuple[type, type], type] = {}


def _with_stage_class(user_class: type, stage_class: type) -> type:
    """``user_class`` (a subclass of MGPUShardedStrategy) on top of the stage's class, made once per pair. Under
    the fork and popen launches it works as it is; a spawn launch pickles the strategy by class name, so give a
    subclass used with spawn the stage class as a base yourself (e.g. ``class Mine(MGPUFSDPStrategy)``)."""
    key = (user_class, stage_class)
    if key not in _STAGED:
        _STAGED[key] = type(user_class.__name__, (user_class, stage_class), {"__module__": user_class.__module__})
    return _STAGED[key]


class MGPUShardedStrategy(ShardedCheckpoints, MGPUStrategyMixin, ParallelStrategy, metaclass=_StageDispatch):
    """Sharded data-parallel training (ZeRO), torch-native by default, on CPU (gloo) and CUDA (NCCL).

    * ``stage=1``: optimizer state split across ranks (torch ``ZeroRedundancyOptimizer``, or fairscale
      ``OSS``); gradients all-reduced by mgpu_ddp's DDP (comm hooks and the ledger work as there).
    * ``stage=2`` (default): + gradients (FSDP2 ``fully_shard(reshard_after_forward=False)``, or fairscale
      ``OSS`` + ``ShardedDataParallel``).
    * ``stage=3``: + parameters (FSDP2 ``fully_shard``; not with fairscale).

    With ``accumulate_grad_batches=k`` the gradients are reduced once per optimizer step, never on the k-1
    micro-batches before it (FSDP2 ``set_requires_gradient_sync``, ``no_sync`` elsewhere); the ledger
    (:attr:`comm_stats`) counts each gradient collective of a synchronised backward.

    Checkpoints (``trainer.save_checkpoint``, ``ModelCheckpoint``) resume at any world size, either layout
    from ``Trainer.fit(ckpt_path=...)``:

    * ``checkpoint="consolidated"`` (default): one file, a plain Lightning checkpoint gathered on rank 0 that
      loads on one device without this package;
    * ``checkpoint="sharded"``: a directory written by every rank in parallel with
      ``torch.distributed.checkpoint`` (no rank ever holds the whole state).

    Both are atomic: a save killed on any rank leaves the previous checkpoint complete under its name. A
    sharded directory is written under a hidden name and swapped in only after every rank has written and rank
    0 has added its completion marker; loading a directory without the marker raises
    :class:`~lightning_mgpu.IncompleteCheckpointError`.

    Args:
        stage: 1, 2 or 3 (see above).
        backend: ``"torch"`` or ``"fairscale"`` (optional extra: ``pip install 'lightning-mgpu[fairscale]'``;
            stages 1 and 2).
        checkpoint: ``"consolidated"`` or ``"sharded"``: the layout written.
        wrap_modules: stages 2/3 torch: module classes that each become an FSDP unit (gathered one at a
            time). Default: transformer layers if the model has any, else each direct child with parameters.
        start_method: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"`` (as for ``mgpu_ddp``).
        loss_normalization: ``"tokens"``: the gradient of the mean over every token of the step (as for
            ``mgpu_ddp``).
        nonfinite: ``"error"``: every rank raises the same error on a NaN/Inf gradient (as for ``mgpu_ddp``).
        micro_batch_size: stage 1 only: as for :class:`~lightning_mgpu.MGPUDDPStrategy`.
        async_checkpoint: stage checkpoints saved during fit off the live tensors and write them in the
            background (either layout; a sharded directory is marked complete once every rank's part is written).
        **kwargs: :class:`~lightning_mgpu.MGPUDDPStrategy` arguments; ``comm_hook``, ``static_graph`` and DDP
            keyword arguments apply to stage 1 and fairscale stage 1 only.

    Example (``Trainer(strategy="mgpu_zero3")`` is the same with the consolidated layout):

        >>> from pytorch_lightning import Trainer
        >>> from lightning_mgpu import MGPUShardedStrategy
        >>> strategy = MGPUShardedStrategy(stage=3, checkpoint="sharded")
        >>> trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
        >>> type(trainer.strategy).__name__, trainer.strategy.stage  # the stage's own class
        ('MGPUFSDPStrategy', 3)
        >>> type(MGPUShardedStrategy(stage=1)).__name__
        'MGPUZeRO1Strategy'
    """

    strategy_name = "mgpu_sharded"
    #: the next ``__init__`` in the MRO takes DDP's keywords (stage 1 is an MGPUDDPStrategy)
    _takes_ddp_keywords = False

    def __init__(
        self,
        stage: Stage = 2,
        backend: Backend = "torch",
        checkpoint: CheckpointLayout = "consolidated",
        wrap_modules: Optional[Sequence[type[nn.Module]]] = None,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: StartMethod = "popen",
        log_comm_stats: bool = True,
        activation_checkpointing: Optional[ActivationCheckpointingPolicy] = None,
        activation_checkpointing_reentrant: bool = False,
        loss_normalization: Optional[LossNormalization] = None,
        nonfinite: Optional[NonFinite] = None,
        async_checkpoint: bool = False,
        comm_hook: Optional[CommHookName] = None,
        comm_state: Optional[dict[str, Any]] = None,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        micro_batch_size: Optional[MicroBatchSetting] = None,
        **ddp_kwargs: Any,
    ) -> None:
        if micro_batch_size is not None and stage != 1:
            raise ValueError(
                f"micro_batch_size={micro_batch_size!r} is supported at stage 1 (strategy='mgpu_zero1') and by "
                f"mgpu_ddp, not yet at stage={stage!r}: FSDP2 reduce-scatters gradients only inside a backward, so "
                f"an out-of-memory error there on one rank could not be redone by all. Use stage=1, or leave "
                f"micro_batch_size=None and lower the loader's batch size."
            )
        sharded = ShardedSettings(
            stage=stage,
            backend=backend,
            checkpoint=checkpoint,
            wrap_modules=wrap_modules,  # type: ignore[arg-type]  # a sequence or one class: the settings normalise it
        )
        own = [name for name in inspect.signature(MGPUShardedStrategy.__init__).parameters if name != "self"]
        ddp_kwargs = split_ddp_kwargs("MGPUShardedStrategy", ddp_kwargs, own[:-1])  # all but **ddp_kwargs
        ddp_only = {
            "comm_hook": comm_hook,
            "static_graph": static_graph,
            "find_unused_parameters": find_unused_parameters,
        }
        sharded.check_ddp_settings({**ddp_only, **ddp_kwargs})
        common: dict[str, Any] = {
            "accelerator": accelerator,
            "parallel_devices": parallel_devices,
            "cluster_environment": cluster_environment,
            "checkpoint_io": checkpoint_io,
            "precision_plugin": precision_plugin,
        }
        settings: dict[str, Any] = {
            "process_group_backend": process_group_backend,
            "timeout": timeout,
            "start_method": start_method,
            "log_comm_stats": log_comm_stats,
            "activation_checkpointing": activation_checkpointing,
            "activation_checkpointing_reentrant": activation_checkpointing_reentrant,
            "loss_normalization": loss_normalization,
            "nonfinite": nonfinite,
            "async_checkpoint": async_checkpoint,
        }
        if micro_batch_size is not None:  # stage 1 (above): MGPUDDPStrategy takes it
            settings["micro_batch_size"] = micro_batch_size
        if self._takes_ddp_keywords:
            ddp: dict[str, Any] = {
                **ddp_only,
                "comm_state": comm_state,
                "gradient_as_bucket_view": gradient_as_bucket_view,
            }
            super().__init__(**common, **settings, **ddp, **ddp_kwargs)
        else:
            super().__init__(**common, settings=CommonSettings(**settings))  # type: ignore[call-arg]
        self._sharded_settings = sharded
        self._backend_name: str = backend
        self._checkpoint_layout: str = checkpoint
        self._sharding: ShardingBackend = make_backend(sharded.stage, backend, sharded.wrap_modules)
        self._loaded_sharded = False

    @property
    @override
    def public_name(self) -> str:
        # the stage classes this package builds print as the class users wrote; a user's subclass as itself
        internal = type(self).__module__.startswith("lightning_mgpu.")
        return "MGPUShardedStrategy" if internal else type(self).__name__

    @property
    def settings(self) -> ShardedSettings:
        """The validated sharding settings (``ddp_settings``: the launch and, at stage 1, DDP ones)."""
        return self._sharded_settings

    @property
    def stage(self) -> int:
        return self._sharded_settings.stage

    @property
    def backend(self) -> str:
        return self._backend_name

    @property
    def checkpoint_layout(self) -> str:
        return self._checkpoint_layout

    # --- launch ---------------------------------------------------------------------------------------
    @override
    def _check_at_construction(self) -> None:
        super()._check_at_construction()
        plugin = self.precision_plugin
        if not (isinstance(plugin, MGPUPrecision) and plugin.master):
            return
        if self._backend_name == "fairscale":
            raise ValueError(
                f"MGPUPrecision({plugin.mode!r}) with backend='fairscale': fairscale's ShardedDataParallel reduces "
                f"each gradient to the rank whose optimizer owns that very parameter, so the optimizer cannot hold "
                f"separate FP32 masters. Use strategy='mgpu_sharded' (FSDP2 keeps sharded FP32 masters) or "
                f"'mgpu_zero1', or MGPUPrecision('{plugin.mode.replace('master', 'mixed')}') with fairscale."
            )
        if self._sharded_settings.stage == 1 and self._checkpoint_layout == "sharded":
            raise ValueError(
                f"MGPUPrecision({plugin.mode!r}) with stage=1 and checkpoint='sharded' is not supported: the sharded "
                f"optimizer checkpoint is keyed by the model's parameter names and the optimizer steps FP32 masters. "
                f"Use checkpoint='consolidated' (the default) or stage=2/3, whose FP32 masters FSDP2 shards itself."
            )

    @override
    def _full_module_state(self) -> dict[str, Any]:
        # Lightning's launcher hands back rank 0's state_dict(), which under FSDP2 holds only its shards
        assert self.lightning_module is not None
        return self._sharding.full_model_state(self.lightning_module)

    @override
    def _check_model_before_launch(self, trainer: pl.Trainer, model: pl.LightningModule) -> None:
        if self._sharded_settings.uses_ddp:
            super()._check_model_before_launch(trainer, model)
        wrap = self._sharded_settings.wrap_modules
        if wrap is not None and not any(isinstance(m, wrap) for m in model.modules()):
            # FSDP2 would silently make the whole model one unit (all parameters gathered at once)
            names = [c.__name__ for c in wrap]
            raise ValueError(
                f"wrap_modules={names} matches no module of {type(model).__name__}, so the whole model would be "
                f"one FSDP unit. Name classes the model has; the module classes present are "
                f"{classes_present(model)}. Or leave wrap_modules=None (the model's blocks are chosen for you)."
            )
        clip_by_norm = trainer.gradient_clip_val and trainer.gradient_clip_algorithm in (None, "norm")
        if clip_by_norm and self._sharding.needs_global_norm and not isinstance(self.precision_plugin, MGPUPrecision):
            raise MisconfigurationException(
                f"gradient_clip_val={trainer.gradient_clip_val} by norm with {type(self.precision_plugin).__name__}: "
                f"fairscale's ShardedDataParallel leaves each rank the gradients it owns, and only MGPUPrecision "
                f"clips them by the norm over all ranks (this plugin would clip each shard by its own norm). Use "
                f"precision='32-true', '16-mixed' or 'bf16-mixed' (or plugins=[MGPUPrecision(...)]), "
                f"gradient_clip_algorithm='value', or strategy='mgpu_sharded' (FSDP2)."
            )
        if not model.automatic_optimization:
            raise MisconfigurationException(
                f"{type(model).__name__} uses manual optimization, which MGPUShardedStrategy does not support yet "
                f"(the sharded optimizers step and gather parameters themselves). Use strategy='mgpu_ddp', which "
                f"supports manual optimization with accumulation."
            )

    # --- set-up ---------------------------------------------------------------------------------------
    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # A second fit() in the same process re-wraps: start from the module's own optimizers.
        _compat.reset_optimizers_and_schedulers(self)
        super().setup_optimizers(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        group = self._process_group()
        wrapped = []
        for opt in self.optimizers:
            check_optimizer(opt, self._sharded_settings.stage, self._backend_name)
            new = self._sharding.wrap_optimizer(opt, group)
            if new is not opt:
                rebind_schedulers(self.lr_scheduler_configs, opt, new)
            wrapped.append(new)
        self.optimizers = wrapped
        assert self.model is not None
        self.model = self._sharding.wrap_after_optimizers(self.model, wrapped, group)

    def _process_group(self) -> Any:
        return torch.distributed.group.WORLD if group_is_up() else None

    # --- memory ---------------------------------------------------------------------------------------
    def memory_report(self) -> ShardMemory:
        """Optimizer-state, gradient and parameter bytes held by this rank now (no communication)."""
        module = self.lightning_module
        assert module is not None
        opt_bytes = 0
        for opt in self.optimizers:
            local = self._sharding.local_optimizer(opt)
            for state in local.state.values():
                opt_bytes += sum(local_bytes(v) for v in state.values())
        grads = sum(local_bytes(p.grad) for p in module.parameters() if p.grad is not None)
        params = sum(local_bytes(p) for p in module.parameters())
        return ShardMemory(optimizer_state=opt_bytes, gradients=grads, parameters=params)

    def __repr__(self) -> str:
        return (
            f"{self.public_name}(stage={self._sharded_settings.stage}, backend={self._backend_name!r}, "
            f"checkpoint={self._checkpoint_layout!r}, start_method={self.launch_settings.start_method!r})"
        )


# MGPUShardedStrategy is never instantiated as itself: __new__ builds the stage's concrete class, which gets the
# ParallelStrategy methods from MGPUDDPStrategy or MGPUParallelStrategy. LightningCLI (jsonargparse) refuses an
# abstract class_path, so the abstract-method set ABCMeta computed for the shared base is cleared.
MGPUShardedStrategy.__abstractmethods__ = frozenset()
