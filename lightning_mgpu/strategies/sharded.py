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

import logging
import os
import tempfile
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.types import _PATH
from pytorch_lightning.core.optimizer import LightningOptimizer
from pytorch_lightning.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mgpu.checkpoint_io import (
    begin_dir,
    check_complete,
    commit_dir,
    local_path,
    recover_dir,
    remove_dir,
    write_file_atomic,
)
from lightning_mgpu.checkpointing import classes_present
from lightning_mgpu.precision import MGPUPrecision
from lightning_mgpu.sampler import move_position, take_position
from lightning_mgpu.settings import Backend, CheckpointLayout, ShardedSettings, Stage, split_ddp_kwargs
from lightning_mgpu.strategies._launchers import _CheckedMultiProcessingLauncher
from lightning_mgpu.strategies._sharding import (
    FSDP2Backend,
    ShardingBackend,
    check_optimizer,
    local_bytes,
    make_backend,
    rebind_schedulers,
)
from lightning_mgpu.strategies.ddp import _OWN_KEYWORDS as _DDP_OWN_KEYWORDS
from lightning_mgpu.strategies.ddp import MGPUDDPStrategy

log = logging.getLogger(__name__)

_SHARDED_KEYWORDS = ("stage", "backend", "checkpoint", "wrap_modules")
_METADATA = "meta.pt"  # the non-tensor part of a sharded checkpoint (Lightning's ModelParallelStrategy name)
_OPTIMIZER_COUNT = "mgpu_sharded_optimizers"


@dataclass(frozen=True)
class ShardMemory:
    """Bytes this rank holds right now (a DTensor counts its local shard)."""

    optimizer_state: int
    gradients: int
    parameters: int


class MGPUShardedStrategy(MGPUDDPStrategy):
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
        **kwargs: :class:`~lightning_mgpu.MGPUDDPStrategy` arguments; ``comm_hook``, ``static_graph`` and DDP
            keyword arguments apply to stage 1 and fairscale stage 1 only.
    """

    strategy_name = "mgpu_sharded"

    def __init__(
        self,
        stage: Stage = 2,
        backend: Backend = "torch",
        checkpoint: CheckpointLayout = "consolidated",
        wrap_modules: Optional[Sequence[type[nn.Module]]] = None,
        **kwargs: Any,
    ) -> None:
        sharded = ShardedSettings(stage=stage, backend=backend, checkpoint=checkpoint, wrap_modules=wrap_modules)
        ddp_kwargs = split_ddp_kwargs(type(self).__name__, kwargs, [*_SHARDED_KEYWORDS, *_DDP_OWN_KEYWORDS])
        sharded.check_ddp_settings(
            {
                **{k: kwargs.get(k) for k in ("comm_hook", "static_graph", "find_unused_parameters")},
                **{k: v for k, v in ddp_kwargs.items() if k not in _DDP_OWN_KEYWORDS},
            }
        )
        classes = sharded.wrap_modules
        super().__init__(**kwargs)  # as it is: LightningCLI follows **kwargs into the parent signature
        self._sharded_settings = sharded
        self._stage: int = stage
        self._backend_name: str = backend
        self._checkpoint_layout: str = checkpoint
        self._sharding: ShardingBackend = make_backend(stage, backend, classes)
        self._loaded_sharded = False
        self._mp_policy: Any = None

    @override
    def _find_unused_parameters_fix(self) -> str:
        return f"strategy=MGPUShardedStrategy(stage={self._stage}, find_unused_parameters=True)"

    @property
    @override
    def settings(self) -> ShardedSettings:  # type: ignore[override]
        """The validated sharding settings (``ddp_settings``: the launch and, at stage 1, DDP ones)."""
        return self._sharded_settings

    @property
    def stage(self) -> int:
        return self._stage

    @property
    def backend(self) -> str:
        return self._backend_name

    @property
    def checkpoint_layout(self) -> str:
        return self._checkpoint_layout

    @property
    @override
    def _uses_ddp(self) -> bool:
        return self._sharding.wraps_with_ddp

    # --- launch ---------------------------------------------------------------------------------------
    @override
    def _check_precision(self) -> None:
        super()._check_precision()
        plugin = self._precision_plugin
        if not (isinstance(plugin, MGPUPrecision) and plugin.master):
            return
        if self._backend_name == "fairscale":
            raise ValueError(
                f"MGPUPrecision({plugin.mode!r}) with backend='fairscale': fairscale's ShardedDataParallel reduces "
                f"each gradient to the rank whose optimizer owns that very parameter, so the optimizer cannot hold "
                f"separate FP32 masters. Use strategy='mgpu_sharded' (FSDP2 keeps sharded FP32 masters) or "
                f"'mgpu_zero1', or MGPUPrecision('{plugin.mode.replace('master', 'mixed')}') with fairscale."
            )
        if self._stage == 1 and self._checkpoint_layout == "sharded":
            raise ValueError(
                f"MGPUPrecision({plugin.mode!r}) with stage=1 and checkpoint='sharded' is not supported: the sharded "
                f"optimizer checkpoint is keyed by the model's parameter names and the optimizer steps FP32 masters. "
                f"Use checkpoint='consolidated' (the default) or stage=2/3, whose FP32 masters FSDP2 shards itself."
            )

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, _MultiProcessingLauncher):
            self._launcher = _ShardedMultiProcessingLauncher(
                self._check_before_launch, self, start_method=self._start_method
            )

    @override
    def _check_before_launch(self, trainer: pl.Trainer) -> None:
        super()._check_before_launch(trainer)
        model = self._lightning_module
        wrap = self._sharded_settings.wrap_modules
        if model is not None and wrap is not None and not any(isinstance(m, wrap) for m in model.modules()):
            # FSDP2 would silently make the whole model one unit (all parameters gathered at once)
            names = [c.__name__ for c in wrap]
            raise ValueError(
                f"wrap_modules={names} matches no module of {type(model).__name__}, so the whole model would be "
                f"one FSDP unit. Name classes the model has; the module classes present are "
                f"{classes_present(model)}. Or leave wrap_modules=None (the model's blocks are chosen for you)."
            )
        if model is not None and not model.automatic_optimization and trainer.state.fn == TrainerFn.FITTING:
            raise MisconfigurationException(
                f"{type(model).__name__} uses manual optimization, which {type(self).__name__} does not support yet "
                f"(the sharded optimizers step and gather parameters themselves). Use strategy='mgpu_ddp', which "
                f"supports manual optimization with accumulation."
            )

    # --- set-up ---------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn != TrainerFn.FITTING and self._fsdp:
            # validate/test/predict after fit in the same process: the module stays sharded (FSDP2 cannot be
            # undone) and its shards agree; DDP's start-up broadcast of module states cannot take DTensors.
            assert self.accelerator is not None
            self.accelerator.setup(trainer)
            self.setup_precision_plugin()
            return
        plugin = self.precision_plugin
        if isinstance(self._sharding, FSDP2Backend) and isinstance(plugin, MGPUPrecision):
            # master modes: FSDP2's sharded FP32 parameters are the master copy, gathered in half for compute
            self._mp_policy = plugin.keep_masters_in_fsdp()
        super().setup(trainer)

    @override
    def configure_ddp(self) -> None:
        if self._uses_ddp:
            super().configure_ddp()
            return
        assert isinstance(self.model, pl.LightningModule)
        self._apply_activation_checkpointing()  # before sharding: FSDP's hooks stay outside the recompute
        mesh = None
        if isinstance(self._sharding, FSDP2Backend):
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(self.root_device.type, (self.world_size,))
        sharded = self._sharding.shard_model(self.model, mesh, self._mp_policy)
        if sharded is not None:
            self.model = sharded
        self._comm_stats.world_size = self.world_size
        self._comm_stats.gradient_bytes = sum(
            p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad
        )

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # A second fit() in the same process re-wraps: start from the module's own optimizers.
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        group = self._process_group()
        wrapped = []
        for opt in self.optimizers:
            check_optimizer(opt, self._stage, self._backend_name)
            new = self._sharding.wrap_optimizer(opt, group)
            if new is not opt:
                rebind_schedulers(self.lr_scheduler_configs, opt, new)
            wrapped.append(new)
        self.optimizers = wrapped
        assert self.model is not None
        self.model = self._sharding.wrap_after_optimizers(self.model, wrapped, group)

    def _process_group(self) -> Any:
        return torch.distributed.group.WORLD if torch.distributed.is_initialized() else None

    @override
    def _register_ddp_hooks(self) -> None:
        if self._uses_ddp:
            super()._register_ddp_hooks()

    # --- steps ----------------------------------------------------------------------------------------
    def _redirect(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # FSDP2 shards the LightningModule itself: its pre-forward hook (gather the root's parameters, lazy
        # init) only runs through __call__, so every step goes through forward, as for a DDP wrapper.
        assert self.model is not None and self.lightning_module is not None
        return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)

    @property
    def _fsdp(self) -> bool:
        from torch.distributed.fsdp import FSDPModule

        return isinstance(self.model, FSDPModule)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if not self._fsdp:
            return super().training_step(*args, **kwargs)
        with self.precision_plugin.train_step_context():
            return self._redirect("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._fsdp:
            return super().validation_step(*args, **kwargs)
        with self.precision_plugin.val_step_context():
            return self._redirect("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._fsdp:
            return super().test_step(*args, **kwargs)
        with self.precision_plugin.test_step_context():
            return self._redirect("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._fsdp:
            return super().predict_step(*args, **kwargs)
        with self.precision_plugin.predict_step_context():
            return self._redirect("predict_step", *args, **kwargs)

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        if self._uses_ddp:
            with super().block_backward_sync():
                yield
            return
        self._sync_blocked = True
        try:
            assert self.model is not None
            with self._sharding.no_sync(self.model):
                yield
        finally:
            self._sync_blocked = False

    _sync_blocked = False

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        if self._uses_ddp or self._sync_blocked or self.model is None:
            return
        if self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            self._comm_stats.record_round(self._sharding.sync_layout(self.model))

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
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.lightning_module is not None
        if self._checkpoint_layout == "sharded":
            return self._sharding.sharded_optimizer_state(self.lightning_module, optimizer)
        return self.consolidated_optimizer_state(optimizer)

    def consolidated_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole state of ``optimizer`` as one process's ``optimizer.state_dict()`` (indexed by parameter),
        on rank 0; ``{}`` elsewhere. A collective: call it on every rank."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.lightning_module is not None
        return self._sharding.full_optimizer_state(self.lightning_module, optimizer, self.is_global_zero)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        self._refuse_main_process_save()
        move_position(checkpoint)  # before the sharded layout puts the non-tensor part into meta.pt
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
        dcp.save(tensors, checkpoint_id=str(staging), process_group=self._process_group())
        if self.is_global_zero:
            write_file_atomic(staging / _METADATA, lambda f: torch.save(checkpoint, f))
        self.barrier("mgpu_sharded_save_written")  # every rank's shards are on disk
        if self.is_global_zero:
            info = {
                "format": "lightning_mgpu.sharded",
                "version": 1,
                "world_size": self.world_size,
                "stage": self._stage,
                "backend": self._backend_name,
                "layout": self._checkpoint_layout,
                "optimizers": checkpoint[_OPTIMIZER_COUNT],
                "epoch": checkpoint.get("epoch"),
                "global_step": checkpoint.get("global_step"),
            }
            commit_dir(staging, path, info)
        self.barrier("mgpu_sharded_save_done")

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        local = local_path(filepath)
        if self.is_global_zero and local is not None and os.path.isdir(local):
            remove_dir(local)  # whatever the checkpoint_io: the strategy wrote the directory, not the plugin
            return
        super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
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
        self._sampler_position = take_position(checkpoint)  # the file branch does it in super().load_checkpoint
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

    @override
    def teardown(self) -> None:
        if self.model is not None and self.lightning_module is not None and not self._fsdp:
            self.model = self.lightning_module  # unwrap fairscale's ShardedDataParallel (DDP: Lightning does it)
        super().teardown()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(stage={self._stage}, backend={self._backend_name!r}, "
            f"checkpoint={self._checkpoint_layout!r}, start_method={self._start_method!r})"
        )


class _ShardedMultiProcessingLauncher(_CheckedMultiProcessingLauncher):
    """After a spawn/fork fit, the weights handed back to the main process are gathered from all ranks
    (Lightning's launcher hands back rank 0's ``state_dict()``, which under FSDP2 holds only its shards)."""

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Optional[_WorkerOutput]:
        strategy = trainer.strategy
        assert isinstance(strategy, MGPUShardedStrategy) and strategy.lightning_module is not None
        # collective: every rank takes part
        state_dict = strategy._sharding.full_model_state(strategy.lightning_module)
        plugin = strategy.precision_plugin
        if isinstance(plugin, MGPUPrecision):
            state_dict = plugin.fp32_state_dict(strategy.lightning_module, state_dict)  # ZeRO-1 master modes
        if strategy.local_rank != 0:
            return None
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        extra = self.get_extra_results(trainer)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, extra)
