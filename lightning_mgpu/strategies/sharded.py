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
import os
from abc import ABCMeta
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mgpu import _compat, comm
from lightning_mgpu._compat import unwrap_optimizer
from lightning_mgpu.comm import attached_trainer, group_is_up
from lightning_mgpu.parts.activation_checkpointing import ActivationCheckpointingPolicy, classes_present
from lightning_mgpu.parts.evaluation import planned_counts_differ
from lightning_mgpu.parts.sharding import (
    ShardingBackend,
    check_optimizer,
    follow_module_mode,
    local_bytes,
    make_backend,
    rebind_schedulers,
)
from lightning_mgpu.plugins.async_checkpoint import sharded_directory_write
from lightning_mgpu.plugins.checkpoint_io import (
    PathLike,
    begin_dir,
    check_complete,
    commit_dir,
    local_path,
    recover_dir,
    remove_dir,
    write_file_atomic,
)
from lightning_mgpu.plugins.precision import MGPUPrecision, PrecisionAdoption
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
from lightning_mgpu.strategies.base import MGPUParallelStrategy, MGPUStrategyMixin
from lightning_mgpu.strategies.ddp import MGPUDDPStrategy

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


# ----------------------------------------------------------------------------------------------------
# The checkpoints of :class:`~lightning_mgpu.MGPUShardedStrategy`: the consolidated file or the sharded directory
# (``torch.distributed.checkpoint``), written atomically (and in the background with ``async_checkpoint=True``), and
# loaded at any world size. A mixin of the sharded strategy's shared base; the sharding backend (``parts/sharding.py``)
# gathers and scatters the states.


_METADATA = "meta.pt"  # the non-tensor part of a sharded checkpoint (Lightning's ModelParallelStrategy name)
_OPTIMIZER_COUNT = "mgpu_sharded_optimizers"


class ShardedCheckpoints(MGPUStrategyMixin):
    """Save, remove and load the sharded strategy's checkpoints (a base of :class:`MGPUShardedStrategy`)."""

    _sharding: ShardingBackend
    _sharded_settings: ShardedSettings
    _backend_name: str
    _checkpoint_layout: str

    def _process_group(self) -> Any:
        return torch.distributed.group.WORLD if group_is_up() else None

    # --- checkpoints ----------------------------------------------------------------------------------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Optimizer state can only be split once the optimizers are wrapped (and, for FSDP2, the parameters
        # sharded); a consolidated checkpoint is loaded through the same path.
        return True

    @override
    def _module_state(self) -> dict[str, Any]:
        module = self.lightning_module
        assert module is not None
        if self._checkpoint_layout == "sharded":
            return module.state_dict()
        return self._sharding.full_model_state(module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        optimizer = unwrap_optimizer(optimizer)
        assert self.lightning_module is not None
        if self._checkpoint_layout == "sharded":
            return self._sharding.sharded_optimizer_state(self.lightning_module, optimizer)
        return self.consolidated_optimizer_state(optimizer)

    def consolidated_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole state of ``optimizer`` as one process's ``optimizer.state_dict()`` (indexed by parameter),
        on rank 0; ``{}`` elsewhere. A collective: call it on every rank."""
        optimizer = unwrap_optimizer(optimizer)
        assert self.lightning_module is not None
        return self._sharding.full_optimizer_state(self.lightning_module, optimizer, self.is_global_zero)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Optional[Any] = None
    ) -> None:
        self._refuse_main_process_save()
        self._settle_async_writes()  # the previous background write finished everywhere (or raise)
        self._resume.before_save(checkpoint)  # before the sharded layout puts the non-tensor part into meta.pt
        filepath = self.broadcast(str(filepath))  # a string: Path() would mangle a remote URL (s3://...)
        local = local_path(filepath)
        if self._checkpoint_layout == "consolidated":
            if local is not None and os.path.isdir(local):
                raise IsADirectoryError(
                    f"{local} is a directory (a sharded checkpoint?); a consolidated checkpoint is one file. Choose "
                    f"another file name, or save with MGPUShardedStrategy(checkpoint='sharded')."
                )
            super().save_checkpoint(checkpoint, filepath, storage_options)  # checkpoint_io: atomic by default
            return
        import torch.distributed.checkpoint as dcp

        if storage_options is not None:
            raise TypeError("storage_options is not supported with checkpoint='sharded' (DCP writes the files).")
        if local is None:
            raise ValueError(
                f"checkpoint='sharded' writes to a local or mounted filesystem; {filepath} is remote. Save to a "
                f"local path, or use checkpoint='consolidated' (one file, which Lightning uploads)."
            )
        path = Path(local)
        if path.is_file():
            raise FileExistsError(
                f"{path} is a file (a consolidated checkpoint?); a sharded checkpoint is a directory. Choose another "
                f"name, or save with MGPUShardedStrategy(checkpoint='consolidated')."
            )
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        optimizer_states = checkpoint.pop("optimizer_states", None)
        for i, state in enumerate(optimizer_states or []):
            tensors[f"optimizer_{i}"] = state
        # None: saved with weights only (Lightning then refuses to resume training from it, as for a file)
        checkpoint[_OPTIMIZER_COUNT] = None if optimizer_states is None else len(optimizer_states)
        # Every rank writes into a hidden staging directory that rank 0 creates; only once all have written
        # does rank 0 mark it complete and swap it in under `path`. A save killed or failing on any rank
        # leaves the previous checkpoint under `path` (ModelCheckpoint(save_last=True) overwrites last.ckpt).
        staging = Path(self.broadcast(str(begin_dir(path)) if self.is_global_zero else ""))
        if self._saves_async():
            self._save_sharded_async(tensors, checkpoint, staging, path)
            return
        dcp.save(tensors, checkpoint_id=str(staging), process_group=self._process_group())
        if self.is_global_zero:
            write_file_atomic(staging / _METADATA, lambda f: torch.save(checkpoint, f))
        self.barrier("mgpu_sharded_save_written")  # every rank's shards are on disk
        if self.is_global_zero:
            commit_dir(staging, path, self._marker_info(checkpoint))
        self.barrier("mgpu_sharded_save_done")

    def _marker_info(self, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "format": "lightning_mgpu.sharded",
            "version": 1,
            "world_size": self.world_size,
            "stage": self._sharded_settings.stage,
            "backend": self._backend_name,
            "layout": self._checkpoint_layout,
            "optimizers": checkpoint[_OPTIMIZER_COUNT],
            "epoch": checkpoint.get("epoch"),
            "global_step": checkpoint.get("global_step"),
        }

    def _save_sharded_async(
        self, tensors: dict[str, Any], checkpoint: dict[str, Any], staging: Path, path: Path
    ) -> None:
        """The sharded layout with ``async_checkpoint=True``: every rank stages its shards now; the background
        write marks the directory complete only once every rank's part is on disk (``plugins/async_checkpoint.py``)."""
        assert self._async is not None
        self._async_unsettled = True
        rank0 = self.is_global_zero
        staged = self._async.stage({"tensors": tensors, "meta": checkpoint if rank0 else None})
        info = self._marker_info(checkpoint)
        self._async.rank = self.global_rank
        write = sharded_directory_write(
            staged["tensors"],
            staging,
            self._async_checkpoint_group(),
            write_meta=(lambda: write_file_atomic(staging / _METADATA, lambda f: torch.save(staged["meta"], f)))
            if rank0
            else None,
            commit=(lambda: commit_dir(staging, path, info)) if rank0 else None,
        )
        self._async.submit(str(path), write)

    @override
    def remove_checkpoint(self, filepath: PathLike) -> None:
        local = local_path(filepath)
        if self.is_global_zero and local is not None and os.path.isdir(local):
            # whatever the checkpoint_io: the strategy wrote the directory, not the plugin
            self._remove_when_written(lambda: remove_dir(local))
            return
        super().remove_checkpoint(os.fspath(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if self.is_global_zero and (local := local_path(checkpoint_path)) is not None:
            recover_dir(local)  # a save killed in the instant of its swap; the broadcast below waits for it
        checkpoint_path = self.broadcast(str(checkpoint_path))
        local = local_path(checkpoint_path)
        if local is None or not os.path.isdir(local):
            self._loaded_sharded = False
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        path = Path(local)
        check_complete(path)  # never load half a checkpoint
        if not (path / _METADATA).is_file():
            raise FileNotFoundError(
                f"{path} is a directory without {_METADATA}: not a sharded checkpoint of mgpu_sharded. Pass the "
                f"checkpoint directory written by trainer.save_checkpoint."
            )
        import torch.distributed.checkpoint as dcp

        module = self.lightning_module
        assert module is not None
        checkpoint: dict[str, Any] = torch.load(path / _METADATA, weights_only=False, map_location="cpu")
        saved_optimizers = checkpoint.pop(_OPTIMIZER_COUNT, None)
        template: dict[str, Any] = {"state_dict": module.state_dict()}
        load_optimizers = bool(self.lightning_restore_optimizer and self.optimizers and saved_optimizers is not None)
        if load_optimizers:
            if saved_optimizers != len(self.optimizers):
                raise ValueError(
                    f"{path} holds {saved_optimizers} optimizer states and configure_optimizers returned "
                    f"{len(self.optimizers)} optimizers: resume with the same configure_optimizers."
                )
            for i, opt in enumerate(self.optimizers):
                template[f"optimizer_{i}"] = self._sharding.optimizer_load_template(module, opt)
        # every rank reads the slices it owns now, whatever the world size at save time
        dcp.load(template, checkpoint_id=str(path), process_group=self._process_group())
        module.load_state_dict(template["state_dict"], strict=module.strict_loading)
        if load_optimizers:
            for i, opt in enumerate(self.optimizers):
                self._sharding.finish_optimizer_load(opt, template[f"optimizer_{i}"])
            checkpoint["optimizer_states"] = [template[f"optimizer_{i}"] for i in range(len(self.optimizers))]
        elif saved_optimizers is not None:
            checkpoint["optimizer_states"] = []
        self._loaded_sharded = True
        self._resume.after_load(checkpoint)  # the file branch does it in super().load_checkpoint
        return checkpoint

    @override
    def _load_module_state(self, checkpoint: Mapping[str, Any], strict: bool) -> None:
        if self._loaded_sharded:
            return  # loaded in place by load_checkpoint
        assert self.lightning_module is not None
        self._sharding.load_full_model_state(self.lightning_module, checkpoint["state_dict"], strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._loaded_sharded:
            return
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(
                f"The checkpoint has {len(states)} optimizer states and configure_optimizers returned "
                f"{len(self.optimizers)} optimizers: resume with the same configure_optimizers."
            )
        assert self.lightning_module is not None
        for opt, state in zip(self.optimizers, states):
            if not state:
                raise ValueError(
                    "The checkpoint's optimizer state is empty: it was saved in the main process after a spawn or "
                    "fork launch (plain Lightning does that). Resume from a checkpoint written during fit "
                    "(ModelCheckpoint), or pass weights_only=True to Trainer.fit's ckpt_path logic by loading the "
                    "weights with LightningModule.load_from_checkpoint and starting a new fit."
                )
            self._sharding.load_full_optimizer_state(self.lightning_module, opt, state)


class _StageDispatch(ABCMeta):
    """``MGPUShardedStrategy(stage=...)`` as users (and LightningCLI, and the presets) write it builds the stage's
    class: stage 1 is DDP + a sharded optimizer (an MGPUDDPStrategy); stages 2/3 shard gradients (and parameters)
    and are not DDP. A bad stage goes to the stage-2/3 class, whose settings refuse it. (A metaclass, not
    ``__new__``: LightningCLI reads the arguments from ``__new__`` when a class defines one.)"""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:

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
        exact_evaluation: every evaluation sample once, as many batches on every rank (as for ``mgpu_ddp``); an
            evaluation loop whose ranks could still run different numbers of batches (a sampler of your own, an
            iterable dataset) does the forward's collective once for the loop, so it cannot hang (stages 2 and 3:
            the parameters gathered once, every rank then holds the whole model during that loop; fairscale: the
            buffers broadcast once).
        check_uneven_inputs: uneven training inputs raise on every rank instead of hanging (as for ``mgpu_ddp``).
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
        exact_evaluation: bool = True,
        check_uneven_inputs: bool = True,
        comm_hook: Optional[CommHookName] = None,
        comm_state: Optional[dict[str, Any]] = None,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        micro_batch_size: Optional[MicroBatchSetting] = None,
        **ddp_kwargs: Any,
    ) -> None:
        sharded = ShardedSettings(
            stage=stage,
            backend=backend,
            checkpoint=checkpoint,
            wrap_modules=wrap_modules,  # type: ignore[arg-type]  # a sequence or one class: the settings normalise it
            micro_batch_size=micro_batch_size,
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
            "exact_evaluation": exact_evaluation,
            "check_uneven_inputs": check_uneven_inputs,
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
            super().__init__(**common, settings=CommonSettings(**settings))  # type: ignore[call-arg]  # stages 2/3's base
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


# ----------------------------------------------------------------------------------------------------
# ZeRO stage 1: mgpu_ddp's DistributedDataParallel (comm hooks, ledger, accumulation without extra syncs) with the
# optimizer state sharded across ranks (torch ``ZeroRedundancyOptimizer`` or fairscale ``OSS``).
#
# Users write ``MGPUShardedStrategy(stage=1)`` or ``strategy="mgpu_zero1"``; this is the class they get.
#
# Example::
#
#     strategy = MGPUShardedStrategy(stage=1, comm_hook="fp16")
#     assert isinstance(strategy, (MGPUShardedStrategy, MGPUDDPStrategy))


class MGPUZeRO1Strategy(MGPUShardedStrategy, MGPUDDPStrategy):  # type: ignore[misc]  # `settings`: the sharded ones
    """Stage 1 of :class:`~lightning_mgpu.MGPUShardedStrategy`: DDP plus a sharded optimizer. The sharded
    strategy's checkpoint and optimizer handling comes first in the MRO, DDP's training loop after it."""

    _takes_ddp_keywords = True

    @override
    def _find_unused_parameters_fix(self) -> str:
        return "strategy=MGPUShardedStrategy(stage=1, find_unused_parameters=True)"


# ----------------------------------------------------------------------------------------------------
# ZeRO stages 2 and 3 without DDP: torch FSDP2 (``fully_shard``), or fairscale ``OSS`` + ``ShardedDataParallel``
# at stage 2. Built on :class:`MGPUParallelStrategy` (process group, launch, ledger, failures, resume) and the
# sharded strategy's optimizer and checkpoint handling; the backend (``parts/sharding.py``) shards the model and
# says how its gradient sync is blocked.
#
# Users write ``MGPUShardedStrategy(stage=2|3)`` or ``strategy="mgpu_sharded"`` / ``"mgpu_zero3"``; this is the
# class they get.
#
# Example::
#
#     strategy = MGPUShardedStrategy(stage=3, wrap_modules=[nn.TransformerEncoderLayer])
#     assert isinstance(strategy, MGPUShardedStrategy) and not isinstance(strategy, MGPUDDPStrategy)


class MGPUFSDPStrategy(MGPUShardedStrategy, MGPUParallelStrategy):
    """Stages 2 and 3 of :class:`~lightning_mgpu.MGPUShardedStrategy` (see there for the arguments)."""

    _sync_blocked = False  # inside block_backward_sync: the backward's gradients are not reduced
    _gathered_for_evaluation = False  # an evaluation loop runs with its forward's collective done once (below)

    # --- set-up -------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if not fitting and self._sharding.is_sharded(self.model):
            # validate/test/predict after fit in the same process: the module stays sharded (FSDP2 cannot be
            # undone) and its shards agree; a broadcast of module states cannot take DTensors.
            self.setup_precision_plugin()
            return
        layer_sync = _compat.strategy_layer_sync(self)
        if fitting and layer_sync is not None:
            self.model = layer_sync.apply(self.model)  # SyncBatchNorm, as Lightning's DDPStrategy converts it
        # before convert_module: in master modes FSDP2's sharded FP32 parameters are the master copy, so the
        # plugin must not cast the module's parameters to half itself
        policy = self._sharding.mixed_precision_policy(self.precision_plugin) if fitting else None
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self._shard_model(policy)
            self.setup_optimizers(trainer)  # after the model is sharded: the optimizers hold the shards
        else:
            comm.broadcast_module_states(self.model)  # evaluation without a wrapper: rank 0's weights everywhere
        self.setup_precision_plugin()
        if fitting:
            clipping = self._sharding.norm_clipping(self._process_group(), self._ledger.stats)
            PrecisionAdoption.connect_norm_clipping(self.precision_plugin, clipping)  # shards: the global norm
            _compat.optimizers_to_device(self.optimizers, self.root_device)

    def _shard_model(self, policy: Any) -> None:
        # Order (torchtitan's parallelize): SyncBatchNorm conversion -> activation checkpointing -> sharding, so
        # that FSDP's hooks stay outside the recompute.
        module = self.lightning_module
        assert module is not None
        self._checkpointing.apply(module)
        mesh = self._sharding.device_mesh(self.root_device.type, self.world_size)
        sharded = self._sharding.shard_model(module, mesh, policy)
        if sharded is not None:
            self.model = sharded
        assert self.model is not None
        self._ledger.start(self.model, self.world_size)

    # --- steps --------------------------------------------------------------------------------------------
    def _redirect(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # FSDP2 shards the LightningModule itself: its pre-forward hook (gather the root's parameters, lazy init)
        # only runs through __call__, so every step goes through forward, as for a wrapper (fairscale's SDP).
        assert self.model is not None and self.lightning_module is not None
        return _compat.forward_redirection(self)(self.model, self.lightning_module, method, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        follow_module_mode(self.model, self.lightning_module)  # after validation: fairscale's SDP hooks need it
        with self.precision_plugin.train_step_context():
            return self._count_tokens(self._redirect("training_step", *args, **kwargs))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._redirect("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._redirect("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._redirect("predict_step", *args, **kwargs)

    # --- evaluation whose ranks may run different numbers of batches (parts/evaluation.py) ---------------------
    def _current_evaluation_loop(self, trainer: pl.Trainer) -> Any:
        if trainer.predicting:
            return trainer.predict_loop
        if trainer.testing:
            return trainer.test_loop
        return trainer.fit_loop.epoch_loop.val_loop if trainer.state.fn == TrainerFn.FITTING else trainer.validate_loop

    def _start_evaluation(self) -> None:
        """Every forward of a sharded model is a collective (FSDP2 gathers parameters, fairscale's
        ShardedDataParallel broadcasts buffers): if the ranks could run different numbers of batches in this loop
        (one all-gather of the planned counts says so), do that collective once for the loop instead."""
        trainer = attached_trainer(self.lightning_module)
        model = self.model
        if not self._launch.exact_evaluation or trainer is None or model is None or self.world_size < 2:
            return
        if not self._sharding.forward_is_collective(model):
            return
        planned = float(sum(self._current_evaluation_loop(trainer).max_batches))
        if planned_counts_differ(comm.all_gather_object(planned)):
            self._sharding.start_uneven_evaluation(model)
            self._gathered_for_evaluation = True

    def _end_evaluation(self) -> None:
        if self._gathered_for_evaluation and self.model is not None:
            self._gathered_for_evaluation = False
            self._sharding.end_uneven_evaluation(self.model)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._start_evaluation()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._start_evaluation()

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._start_evaluation()

    @override
    def on_validation_end(self) -> None:
        self._end_evaluation()
        super().on_validation_end()

    @override
    def on_test_end(self) -> None:
        self._end_evaluation()
        super().on_test_end()

    @override
    def on_predict_end(self) -> None:
        self._end_evaluation()
        super().on_predict_end()

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        assert self.model is not None
        self._sync_blocked = True
        try:
            with self._sharding.sync_control.no_backward_sync(self.model, enabled=True):
                yield
        finally:
            self._sync_blocked = False

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        trainer = attached_trainer(self.lightning_module)
        if self._sync_blocked or self.model is None or trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return
        self._ledger.record_round(self._sharding.sync_layout(self.model))

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(*args, **kwargs)
        self._ledger.optimizer_stepped(self.lightning_module, self.is_global_zero)
        return output

    # --- end ----------------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None:
            PrecisionAdoption.connect_norm_clipping(self.precision_plugin, None)
            self.model = module  # unwrap fairscale's ShardedDataParallel (FSDP2 shards the module in place)
            trainer = attached_trainer(module)
            layer_sync = _compat.strategy_layer_sync(self)
            if layer_sync is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
                self.model = layer_sync.revert(self.model)
        super().teardown()
