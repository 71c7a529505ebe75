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
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mgpu import _compat
from lightning_mgpu.comm import check_backend
from lightning_mgpu.parts.accumulation import DDPSyncControl, ManualGradientSync
from lightning_mgpu.parts.activation_checkpointing import ActivationCheckpointingPolicy
from lightning_mgpu.parts.ddp import DDPWrapping
from lightning_mgpu.parts.micro_batching import MicroBatching
from lightning_mgpu.plugins.checkpoint_io import PathLike, local_path, sharded_directory_message
from lightning_mgpu.plugins.precision import PrecisionAdoption
from lightning_mgpu.settings import (
    CommHookName,
    CompileSetting,
    DDPSettings,
    LossNormalization,
    MicroBatchSetting,
    NonFinite,
    StartMethod,
    split_ddp_kwargs,
)
from lightning_mgpu.strategies.base import MGPUStrategyMixin

_OWN_KEYWORDS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
    *DDPSettings.keywords(),
)


class MGPUDDPStrategy(MGPUStrategyMixin, DDPStrategy):
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

    Args:
        comm_hook: ``None`` (plain averaging all-reduce), ``"fp16"``, ``"bf16"`` (NCCL only), ``"powersgd"``
            or ``"batched_powersgd"``.
        comm_state: keyword arguments for the hook's state, e.g. ``{"matrix_approximation_rank": 2}`` for
            PowerSGD (defaults: rank 1, compression from the 2nd synchronisation).
        static_graph: tell DDP the graph is the same every iteration (faster; see torch's DDP docs).
        find_unused_parameters: DDP's flag; costs a graph traversal per step, leave off unless needed.
        process_group_backend: ``"gloo"``, ``"nccl"``; ``None``: gloo on CPU, nccl on CUDA.
        timeout: how long a collective waits for the other ranks, a :class:`datetime.timedelta`.
        start_method: ``"popen"`` (re-run the script per rank; scripts, torchrun, SLURM), ``"spawn"``,
            ``"fork"`` (notebooks; CPU or before CUDA is initialised) or ``"forkserver"``.
        log_comm_stats: log ``comm/*`` metrics through the Trainer's loggers.
        gradient_as_bucket_view: DDP's flag, on by default here (off in torch): gradients are views into the
            all-reduce buckets, which saves one gradient-sized buffer and one copy per step, and lets the
            ledger count plain all-reduce from the buckets without a Python comm hook. Set it to False if
            your code replaces ``param.grad`` tensors or calls ``detach_()`` on them (the ledger then counts
            through a Python hook, one extra pass over the gradients per step).
        activation_checkpointing: which blocks to checkpoint (free activations in forward, recompute them in
            backward), BatchNorm-safe: module classes, class names (for YAML), :class:`~lightning_mgpu.EveryNth`
            or a callable ``(module) -> bool``; see :func:`lightning_mgpu.apply_activation_checkpointing`.
            Checked against the model before any process starts.
        activation_checkpointing_reentrant: use torch's reentrant checkpointing instead of the non-reentrant
            default.
        loss_normalization: ``"tokens"``: ``training_step`` returns ``{"loss": <sum of per-token losses>,
            "num_tokens": <count>}`` and the gradient is that of the mean over every token of the optimizer step
            (all micro-batches, all ranks; one scalar all-reduce per step); ``None``: Lightning's.
        nonfinite: ``"error"``: a NaN/Inf gradient on any rank makes every rank raise the same
            ``FloatingPointError`` naming the rank and parameter (under the fp16 scaler: every rank skips the step).
        micro_batch_size: split each loader batch into micro-batches of this many rows and accumulate them (the
            gradient stays the whole batch's); ``"auto"``: the largest that fits. An out-of-memory error on any
            rank makes every rank redo the step at half the size (see :doc:`/guides/planning`). Automatic
            optimization only; the gradients are then averaged once after the last micro-batch.
        async_checkpoint: save checkpoints during fit without stopping training: the state is copied off the
            live tensors (pinned CPU memory on GPU) and written in a background thread, one write at a time; a
            failed write raises on every rank at the next save or at the end of fit, which waits for the last
            write. See the reliability guide.
        compile: ``True`` or a dict of :func:`torch.compile` keyword arguments (``{"mode": "max-autotune"}``):
            the LightningModule's ``forward`` is compiled in place after the DDP wrap (state-dict keys unchanged;
            see the compilation guide). A model compiled with ``torch.compile`` before ``Trainer.fit`` is refused
            with it; without it, such a model trains as under Lightning's DDP.
        exact_evaluation: validate, test and predict see every sample once, with as many batches on every rank
            (the epoch value of ``self.log(..., sync_dist=True)`` is the one-process value); ``False``: Lightning's
            padded sampler. See the evaluation guide.
        check_uneven_inputs: different numbers of training batches on the ranks raise the same error on every
            rank before the step that would hang (compared once per epoch; for iterable datasets, one all-reduce
            of one number per step); ``False``: Lightning's behaviour.
        checkpoint_io: how checkpoint files are written; default :class:`~lightning_mgpu.AtomicCheckpointIO`.
            A plugin you pass is used as it is (atomic saves are then up to it).
        **ddp_kwargs: passed to :class:`torch.nn.parallel.DistributedDataParallel` (e.g. ``bucket_cap_mb``);
            an unknown keyword raises, naming the closest valid one.

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
        loss_normalization: Optional[LossNormalization] = None,
        nonfinite: Optional[NonFinite] = None,
        micro_batch_size: Optional[MicroBatchSetting] = None,
        async_checkpoint: bool = False,
        compile: CompileSetting = False,
        exact_evaluation: bool = True,
        check_uneven_inputs: bool = True,
        **ddp_kwargs: Any,
    ) -> None:
        ddp_kwargs = split_ddp_kwargs(type(self).__name__, ddp_kwargs, _OWN_KEYWORDS)
        settings = DDPSettings(
            start_method=start_method,
            process_group_backend=process_group_backend,
            timeout=timeout,
            log_comm_stats=log_comm_stats,
            comm_hook=comm_hook,
            comm_state=dict(comm_state) if isinstance(comm_state, Mapping) and comm_state else comm_state or None,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            activation_checkpointing=activation_checkpointing,
            activation_checkpointing_reentrant=activation_checkpointing_reentrant,
            loss_normalization=loss_normalization,
            nonfinite=nonfinite,
            micro_batch_size=micro_batch_size,
            async_checkpoint=async_checkpoint,
            compile=compile,
            exact_evaluation=exact_evaluation,
            check_uneven_inputs=check_uneven_inputs,
            ddp_kwargs=ddp_kwargs,
        )
        if static_graph and not _compat.DDP_HAS_SET_STATIC_GRAPH:  # pragma: no cover - guarded by torch>=2.4
            raise RuntimeError("static_graph=True needs DistributedDataParallel._set_static_graph (torch>=2.4).")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            **ddp_kwargs,
        )
        self._settings = settings
        self._init_parts(settings)
        self._wrapping = DDPWrapping(settings)
        self._sync_control = DDPSyncControl()
        self._manual = ManualGradientSync(settings.comm_hook, bucket_cap_mb=ddp_kwargs.get("bucket_cap_mb") or 25.0)
        self._comm_hook_state: Any = None
        self._micro = MicroBatching(micro_batch_size) if micro_batch_size is not None else None

    # --- what users read ----------------------------------------------------------------------------------
    @property
    def settings(self) -> DDPSettings:
        """The validated settings this strategy was built with."""
        return self._settings

    @property
    def ddp_settings(self) -> DDPSettings:
        """The DDP settings (for the sharded strategy's stage 1: those of its DDP wrapper)."""
        return self._settings

    @property
    def comm_hook(self) -> Optional[str]:
        return self._settings.comm_hook

    @property
    def comm_hook_state(self) -> Any:
        """The registered hook's state (e.g. torch's ``PowerSGDState``), available after setup."""
        return self._comm_hook_state

    @property
    def static_graph(self) -> bool:
        return self._settings.static_graph

    # --- launch -------------------------------------------------------------------------------------------
    @override
    def _check_at_construction(self) -> None:
        check_backend(self._settings.comm_hook, self._group_backend())
        super()._check_at_construction()

    @override
    def _check_model_before_launch(self, trainer: pl.Trainer, model: pl.LightningModule) -> None:
        sync_batchnorm = _compat.strategy_layer_sync(self) is not None
        self._wrapping.check_model(model, self._device_type(), sync_batchnorm, self._micro)

    # --- set-up -------------------------------------------------------------------------------------------
    @override
    def setup_distributed(self) -> None:
        self._join_elastic_store()  # when torchrun restarted this job (_compat.torchelastic_shares_its_store)
        super().setup_distributed()

    @property
    def _manual_sync(self) -> bool:
        module = self.lightning_module
        return module is not None and not module.automatic_optimization

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        plugin = self.precision_plugin
        if not self._manual_sync or trainer.state.fn != TrainerFn.FITTING:
            PrecisionAdoption.connect_gradient_sync(plugin, None)
            return
        self._manual.setup(self.optimizers, self.world_size, PrecisionAdoption.model_parameter(plugin))
        PrecisionAdoption.connect_gradient_sync(plugin, self._sync_manual_gradients)

    @override
    def configure_ddp(self) -> None:
        self._checkpointing.apply(self.lightning_module)
        super().configure_ddp()
        self._compilation.compile_model(self.lightning_module)  # after the wrap: parts/compilation.py

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        # Lightning's DDPStrategy (2.6) builds DDP inside a side CUDA stream. DDP's reducer keeps the parameters'
        # AccumulateGrad nodes, which then belong to that stream while forwards and backwards run on the current
        # one, and torch >= 2.10 warns "The AccumulateGrad node's stream does not match ...". Built here on the
        # current stream, as the sharded strategy's stage 1 builds it (parts/ddp.py).
        return self._wrapping.wrap(model, self.root_device)

    @property
    def _ddp(self) -> DistributedDataParallel:
        """The model while fitting: Lightning's ``configure_ddp`` wrapped it (this family always trains a DDP
        module; the sharded stages 2/3, which do not, are another class)."""
        return cast(DistributedDataParallel, self.model)

    @override
    def _register_ddp_hooks(self) -> None:
        self._ledger.start(self._ddp, self.world_size)
        # Lightning registers hooks only when the device is CUDA; ours run on every device
        self._comm_hook_state = self._wrapping.register_hooks(self._ddp, self._ledger, self._manual_sync)

    # --- steps --------------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        model = self._ddp
        if self._manual_sync:
            # Manual optimization: DDP's reducer would sync every backward (and, without
            # find_unused_parameters, wait forever for the toggled-off optimizer's gradients). Keep it out of
            # the whole step; optimizer_step syncs what the stepping optimizer needs.
            self._wrapping.broadcast_buffers(model, self.world_size)
            with model.no_sync():
                return super().training_step(*args, **kwargs)
        if self._micro is not None:
            return self._micro_batched_step(model, *args, **kwargs)
        self._wrapping.before_training_step(model)
        return super().training_step(*args, **kwargs)

    def _micro_batched_step(self, model: DistributedDataParallel, batch: Any, *args: Any, **kwargs: Any) -> Any:
        assert self._micro is not None
        module = self.lightning_module
        assert module is not None
        accumulate = module.trainer.accumulate_grad_batches
        optimizer = self.optimizers[0] if self.optimizers else None
        step = super().training_step
        return self._wrapping.micro_batched_step(
            self._micro,
            model,
            step=lambda micro: step(micro, *args, **kwargs),
            backward=lambda loss: self.backward(loss / accumulate, optimizer),
            batch=batch,
            batch_idx=args[0] if args else None,
            accumulate_grad_batches=accumulate,
            stats=self._ledger.stats,
            rank=self.global_rank,
            world_size=self.world_size,
            device=self.root_device,
        )

    @property
    def micro_batching(self) -> Optional[MicroBatching]:
        """The micro-batching state (``micro_batch_size`` given): ``.size`` in use and ``.backoffs``; else None."""
        return self._micro

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        assert self.model is not None
        with self._sync_control.no_backward_sync(self.model, enabled=True):
            yield

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        if self._settings.count_from_buckets and self._backward_synced() and self._micro is None:
            self._ledger.record_buckets(self._ddp)

    def _backward_synced(self) -> bool:
        """Whether the backward that just ran all-reduced the gradients (the periodic-sync family overrides it)."""
        return self._ddp.require_backward_grad_sync

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[pl.LightningModule, Module]] = None,
        **kwargs: Any,
    ) -> Any:
        if self._manual_sync:
            # after the user's closure (its backward), before unscaling and on_before_optimizer_step: where DDP
            # would have finished its all-reduce in automatic optimization
            closure = self._manual.wrap_closure(optimizer, closure, self._ddp.process_group, self._ledger.stats)
        with self._manual.stepping():
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._after_optimizer_step()
        self._ledger.optimizer_stepped(self.lightning_module, self.is_global_zero)
        return output

    def _after_optimizer_step(self) -> None:
        """After each optimizer step, before the ledger counts it (the periodic-sync family syncs weights here)."""

    def _sync_manual_gradients(self, optimizer: Optimizer) -> None:
        """Manual optimization: average ``optimizer``'s gradients across ranks, once per step; handed to the
        precision plugin, which calls it before it moves or clips the gradients."""
        if self._manual_sync:
            self._manual.sync(optimizer, self._ddp.process_group, self._ledger.stats)

    # --- checkpoints --------------------------------------------------------------------------------------
    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
        local = local_path(checkpoint_path)
        if local is not None and os.path.isdir(local):
            raise IsADirectoryError(sharded_directory_message(local, type(self).__name__))
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    # --- end ----------------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        self._manual.teardown()
        PrecisionAdoption.connect_gradient_sync(self.precision_plugin, None)
        super().teardown()

    def _find_unused_parameters_fix(self) -> str:
        """The strategy, as the user writes it, with DDP's ``find_unused_parameters`` on (for error messages)."""
        return "strategy=MGPUDDPStrategy(find_unused_parameters=True)"

    @override
    def on_exception(self, exception: BaseException) -> None:
        DDPWrapping.explain(exception, self._find_unused_parameters_fix())
        self._end_group_after(exception)

    def __repr__(self) -> str:
        s = self._settings
        return (
            f"{type(self).__name__}(comm_hook={s.comm_hook!r}, static_graph={s.static_graph}, "
            f"start_method={s.start_method!r})"
        )
