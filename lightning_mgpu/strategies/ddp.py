"""``MGPUDDPStrategy``: Lightning's DDP with comm hooks on every device, static-graph accumulation that
works, and a communication ledger. An assembly of parts (``lightning_mgpu/parts``).

Example::

    import lightning_mgpu  # registers "mgpu_ddp", "mgpu_ddp_spawn", ... with Lightning
    from pytorch_lightning import Trainer

    trainer = Trainer(accelerator="cpu", devices=2, strategy="mgpu_ddp", accumulate_grad_batches=4)
    trainer.fit(model, datamodule)
    print(trainer.strategy.comm_stats.summary())
"""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Optional, Union, cast

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch.distributed import ReduceOp
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mgpu import _compat
from lightning_mgpu.parts.activation_checkpointing import ActivationCheckpointingPolicy, CheckpointSave
from lightning_mgpu.parts.ddp import DDPWrapping
from lightning_mgpu.plugins.checkpoint_io import PathLike, local_path, sharded_directory_message
from lightning_mgpu.settings import (
    CheckpointParams,
    CommHookName,
    CompileSetting,
    DDPSettings,
    FaultToleranceSetting,
    LossNormalization,
    MicroBatchSetting,
    NonFinite,
    StartMethod,
    from_arguments,
    lightning_arguments,
    split_ddp_kwargs,
    strategy_options,
)
from lightning_mgpu.strategies import properties
from lightning_mgpu.strategies.runtime import Runtime


@strategy_options(
    DDPSettings,
    var_keyword="passed to :class:`torch.nn.parallel.DistributedDataParallel` (e.g. ``bucket_cap_mb``); an unknown "
    "keyword raises, naming the closest valid one.",
)
class MGPUDDPStrategy(DDPStrategy):
    """Distributed data parallel training, correct by default on CPU (gloo) and CUDA (NCCL).

    What it adds to Lightning's :class:`~pytorch_lightning.strategies.DDPStrategy`:

    * ``comm_hook`` is registered on **every** device type (Lightning's registers hooks on CUDA only and
      silently trains without them elsewhere), and a hook the backend cannot run is refused at
      ``Trainer(...)`` construction, before any process starts.
    * ``static_graph=True`` works with ``accumulate_grad_batches`` (Lightning 2.6 + torch crash on the first
      ``no_sync`` micro-batch): static-graph mode is switched on just before the first synchronised
      forward, so non-stepping micro-batches never all-reduce.
    * Manual optimization (GANs, several optimizers): each optimizer's gradients are averaged once, when
      that optimizer steps, and never on the micro-batches in between; DDP's reducer stays out of it, so
      toggling the other optimizer's parameters off (``toggle_model``) needs no ``find_unused_parameters``.
      With :class:`~lightning_mgpu.ManualAccumulation` on the module, ``accumulate_grad_batches`` works too.
    * Checkpoint files are written atomically (:class:`~lightning_mgpu.AtomicCheckpointIO`): a kill during a
      save leaves the previous checkpoint whole.
    * :attr:`comm_stats`: a ledger of all-reduce calls and bytes handed to the collective, sync rounds and
      optimizer steps, with the ring all-reduce lower bound beside it; logged as ``comm/*`` every
      ``log_every_n_steps`` optimizer steps through the Trainer's loggers.

    Example (``Trainer(strategy="mgpu_ddp_fp16_compress")`` is the same; ``trainer.fit`` then starts the ranks):

        >>> from pytorch_lightning import Trainer
        >>> from lightning_mgpu import MGPUDDPStrategy
        >>> strategy = MGPUDDPStrategy(comm_hook="fp16", start_method="fork")
        >>> trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
        >>> trainer.strategy is strategy, trainer.world_size
        (True, 2)
        >>> MGPUDDPStrategy(comm_hook="fp8")  # refused before anything starts
        Traceback (most recent call last):
        ...
        ValueError: Unknown comm_hook='fp8'. Choose one of ['batched_powersgd', 'bf16', 'fp16', 'powersgd'] or None ...
    """

    strategy_name = "mgpu_ddp"
    #: syncs each optimizer's gradients at its step under manual optimization (``toggle_model`` needs no
    #: ``find_unused_parameters``); read by :mod:`lightning_mgpu.parts.accumulation` without importing this module
    syncs_manual_optimization = True

    def __init__(
        self,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        comm_hook: Optional[CommHookName] = None,
        comm_state: Optional[dict[str, Any]] = None,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: StartMethod = "popen",
        log_comm_stats: bool = True,
        gradient_as_bucket_view: bool = True,
        activation_checkpointing: Optional[ActivationCheckpointingPolicy] = None,
        activation_checkpointing_reentrant: bool = False,
        activation_checkpointing_save: CheckpointSave = None,
        loss_normalization: Optional[LossNormalization] = None,
        nonfinite: Optional[NonFinite] = None,
        micro_batch_size: Optional[MicroBatchSetting] = None,
        async_checkpoint: bool = False,
        checkpoint_params: CheckpointParams = "all",
        compile: CompileSetting = False,
        exact_evaluation: bool = True,
        check_uneven_inputs: bool = True,
        fault_tolerance: Optional[FaultToleranceSetting] = None,
        **ddp_kwargs: Any,
    ) -> None:
        ddp_kwargs = split_ddp_kwargs(ddp_kwargs)
        settings = from_arguments(DDPSettings, locals())
        if static_graph and not _compat.DDP_HAS_SET_STATIC_GRAPH:  # pragma: no cover - guarded by torch>=2.4
            raise RuntimeError("static_graph=True needs DistributedDataParallel._set_static_graph (torch>=2.4).")
        super().__init__(
            **lightning_arguments(locals()),
            process_group_backend=settings.process_group_backend,
            timeout=settings.timeout,
            start_method=settings.start_method,
            **settings.all_ddp_kwargs,
        )
        self._settings = settings
        self._runtime = Runtime(self, self, settings)

    # --- what users read (declared once for every mgpu strategy: strategies/properties.py) ---------------------
    @property
    def settings(self) -> DDPSettings:
        """The validated settings this strategy was built with."""
        return self._settings

    public_name = properties.public_name
    launch_settings = properties.launch_settings
    ddp_settings = properties.ddp_settings
    comm_stats = properties.comm_stats
    replicas = properties.replicas
    comm_hook = properties.comm_hook
    comm_hook_state = properties.comm_hook_state
    static_graph = properties.static_graph
    micro_batching = properties.micro_batching
    activation_checkpointing = properties.activation_checkpointing
    async_checkpoint = properties.async_checkpoint
    checkpoint_write_in_flight = properties.checkpoint_write_in_flight
    add_tokens = properties.add_tokens

    @property
    def _ddp_part(self) -> DDPWrapping:
        ddp = self._runtime.ddp
        assert ddp is not None  # built from DDPSettings
        return ddp

    @property
    def _ddp(self) -> DistributedDataParallel:
        """The model while fitting: ``configure_ddp`` wrapped it."""
        return cast(DistributedDataParallel, self.model)

    # --- plugins ------------------------------------------------------------------------------------------
    checkpoint_io = properties.checkpoint_io
    precision_plugin = properties.precision_plugin

    # --- launch -------------------------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        self._runtime.configure_launcher(self._check_at_construction)

    def _check_at_construction(self) -> None:
        """Runs in the main process at Trainer construction, once accelerator and devices are known."""
        self._runtime.check_at_construction()

    # --- set-up -------------------------------------------------------------------------------------------
    @override
    def setup_distributed(self) -> None:
        self._runtime.set_up_process()  # joins torchrun's store when it restarted this job
        super().setup_distributed()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self._runtime.setup_ddp_sync(trainer, self._ddp)
        self._runtime.join_replica_groups(trainer)

    @override
    def configure_ddp(self) -> None:
        assert isinstance(self.model, pl.LightningModule)
        self.model = self._runtime.wrap_ddp(self.model)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        self._runtime.setup_optimizers(trainer)

    # --- data ---------------------------------------------------------------------------------------------
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        self._runtime.sampler_requested()
        kwargs = super().distributed_sampler_kwargs
        return kwargs if self._runtime.replicas is None else self._runtime.replicas.sampler_kwargs(kwargs)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self._runtime.process_dataloader(super().process_dataloader(dataloader))

    @override
    def on_train_start(self) -> None:
        self._runtime.train_start()
        super().on_train_start()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        lightning_hook = super().on_train_batch_start
        self._runtime.train_batch_start(lambda: lightning_hook(batch, batch_idx), batch_idx)

    @override
    def reduce(
        self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Any:
        return self._runtime.reduce(tensor, group, reduce_op)

    # --- steps --------------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._runtime.training_step(super().training_step, self._ddp, *args, **kwargs)

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        assert self.model is not None
        with self._ddp_part.no_backward_sync(self.model):
            yield

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        self._runtime.after_backward(self._ddp)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[pl.LightningModule, Module]] = None,
        **kwargs: Any,
    ) -> Any:
        step = super().optimizer_step
        return self._runtime.optimizer_step(
            optimizer, closure, lambda c: step(optimizer, c, model, **kwargs), lambda: self._ddp.process_group
        )

    @override
    def on_predict_start(self) -> None:
        self._runtime.predict_start()
        super().on_predict_start()

    # --- checkpoints --------------------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        self._runtime.add_periodic_state(checkpoint, self._ddp)  # local SGD / DiLoCo: every rank's own state
        self._runtime.checkpoints.before_save(checkpoint)
        self._runtime.checkpoints.write_file(checkpoint, filepath, storage_options, super().save_checkpoint)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        remove = super().remove_checkpoint
        self._runtime.checkpoints.remove_when_written(lambda: remove(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
        local = local_path(checkpoint_path)
        if local is not None and os.path.isdir(local):
            raise IsADirectoryError(sharded_directory_message(local, type(self).__name__))
        loaded = super().load_checkpoint(os.fspath(checkpoint_path), weights_only=weights_only)
        return self._runtime.checkpoints.after_load(loaded)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._runtime.checkpoints.module_state(super().lightning_module_state_dict())

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._runtime.checkpoints.load_weights(
            checkpoint, strict, lambda c, s: super(MGPUDDPStrategy, self).load_model_state_dict(c, s)
        )
        self._runtime.checkpoints.load_masters(checkpoint)
        self._runtime.hold_periodic_state(checkpoint)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        load = super().load_optimizer_state_dict
        load(checkpoint)
        self._runtime.restore_periodic_state(load)

    # --- end ----------------------------------------------------------------------------------------------
    @override
    def on_train_end(self) -> None:
        self._runtime.train_end()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        self._runtime.teardown()
        super().teardown()

    def _find_unused_parameters_fix(self) -> str:
        """The strategy, as the user writes it, with DDP's ``find_unused_parameters`` on (for error messages)."""
        return "strategy=MGPUDDPStrategy(find_unused_parameters=True)"

    @override
    def on_exception(self, exception: BaseException) -> None:
        DDPWrapping.explain(exception, self._find_unused_parameters_fix())
        self._runtime.end_group_after(exception)

    def __repr__(self) -> str:
        s = self._settings
        return (
            f"{type(self).__name__}(comm_hook={s.comm_hook!r}, static_graph={s.static_graph}, "
            f"start_method={s.start_method!r})"
        )
