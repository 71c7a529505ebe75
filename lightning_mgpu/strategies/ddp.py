"""``MGPUDDPStrategy``: Lightning's DDP with comm hooks on every device, static-graph accumulation that
works, and a communication ledger.

Example::

    import lightning_mgpu  # registers "mgpu_ddp", "mgpu_ddp_spawn", ... with Lightning
    from pytorch_lightning import Trainer

    trainer = Trainer(accelerator="cpu", devices=2, strategy="mgpu_ddp", accumulate_grad_batches=4)
    trainer.fit(model, datamodule)
    print(trainer.strategy.comm_stats.summary())
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_fabric.utilities.distributed import _destroy_dist_connection
from lightning_fabric.utilities.types import _PATH
from pytorch_lightning.plugins.io.wrapper import _WrappingCheckpointIO
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.exceptions import MisconfigurationException, _augment_message
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mgpu._compat import _DDP_HAS_SET_STATIC_GRAPH, _elastic_attempt_store, _torchelastic_shares_its_store
from lightning_mgpu.accumulation import check_accumulate_grad_batches, check_manual_accumulation
from lightning_mgpu.checkpoint_io import AtomicCheckpointIO, local_path, sharded_directory_message
from lightning_mgpu.checkpointing import (
    ActivationCheckpointingPolicy,
    apply_activation_checkpointing,
    remove_activation_checkpointing,
    select_modules,
)
from lightning_mgpu.comm import (
    CommStats,
    allreduce_gradients,
    buckets_from_grad_views,
    check_backend,
    register_comm_hook,
)
from lightning_mgpu.precision import MGPUPrecision, adopt
from lightning_mgpu.sampler import move_position, resumable_train_loader, take_position
from lightning_mgpu.settings import CommHookName, DDPSettings, StartMethod, split_ddp_kwargs
from lightning_mgpu.strategies import _failures
from lightning_mgpu.strategies._launchers import _CheckedMultiProcessingLauncher, _CheckedSubprocessScriptLauncher

log = logging.getLogger(__name__)

_OWN_KEYWORDS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
    *DDPSettings.keywords(),
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

    Args:
        comm_hook: ``None`` (plain averaging all-reduce), ``"fp16"``, ``"bf16"`` (NCCL only), ``"powersgd"``
            or ``"batched_powersgd"``.
        comm_state: keyword arguments for the hook's state, e.g. ``{"matrix_approximation_rank": 2}`` for
            PowerSGD (defaults: rank 1, compression from the 2nd synchronisation).
        static_graph: tell DDP the graph is the same every iteration (faster; see torch's DDP docs).
        find_unused_parameters: DDP's flag; costs a graph traversal per step, leave off unless needed.
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
        checkpoint_io: how checkpoint files are written; default :class:`~lightning_mgpu.AtomicCheckpointIO`.
            A plugin you pass is used as it is (atomic saves are then up to it).
        **ddp_kwargs: passed to :class:`torch.nn.parallel.DistributedDataParallel` (e.g. ``bucket_cap_mb``).
    """

    strategy_name = "mgpu_ddp"

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
        **ddp_kwargs: Any,
    ) -> None:
        ddp_kwargs = split_ddp_kwargs(type(self).__name__, ddp_kwargs, _OWN_KEYWORDS)
        self._settings = DDPSettings(
            start_method=start_method,
            process_group_backend=process_group_backend,
            timeout=timeout,
            log_comm_stats=log_comm_stats,
            comm_hook=comm_hook,
            comm_state=dict(comm_state) if isinstance(comm_state, Mapping) else comm_state,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            activation_checkpointing=activation_checkpointing,
            activation_checkpointing_reentrant=activation_checkpointing_reentrant,
            ddp_kwargs=ddp_kwargs,
        )
        if static_graph and not _DDP_HAS_SET_STATIC_GRAPH:  # pragma: no cover - guarded by torch>=2.4
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
        self._comm_hook = comm_hook
        self._comm_state = dict(comm_state) if comm_state else None
        self._static_graph = static_graph
        self._log_comm_stats = log_comm_stats
        self._comm_stats = CommStats()
        self._comm_hook_state: Any = None
        # Plain all-reduce with bucket views runs DDP's built-in C++ path (fastest: no Python in the
        # reduction) and is counted after each synchronised backward from the bucket storages; every other
        # case goes through a Python comm hook that counts what it hands to all_reduce.
        self._count_from_buckets = comm_hook is None and gradient_as_bucket_view
        self._bucket_layout: list[int] = []
        # manual optimization: per optimizer, the parameters to sync (trainable at setup, in optimizer order)
        self._manual_params: dict[int, list[torch.Tensor]] = {}
        self._in_optimizer_step = False
        self._synced: set[int] = set()  # manual optimization: optimizers whose gradients are averaged this step
        self._step_guards: list[Any] = []
        self._activation_checkpointing = activation_checkpointing
        self._activation_checkpointing_reentrant = activation_checkpointing_reentrant

    @property
    def settings(self) -> DDPSettings:
        """The validated settings this strategy was built with."""
        return self._settings

    @property
    def ddp_settings(self) -> DDPSettings:
        """The DDP settings (for the sharded strategy's stage 1: those of its DDP wrapper)."""
        return self._settings

    @property
    def activation_checkpointing(self) -> Optional[ActivationCheckpointingPolicy]:
        """The activation-checkpointing policy (``None``: off)."""
        return self._activation_checkpointing

    @property
    def comm_stats(self) -> CommStats:
        """The communication ledger of this rank (see :class:`~lightning_mgpu.comm.CommStats`)."""
        return self._comm_stats

    @property
    def comm_hook_state(self) -> Any:
        """The registered hook's state (e.g. torch's ``PowerSGDState``), available after setup."""
        return self._comm_hook_state

    @property
    def static_graph(self) -> bool:
        return self._static_graph

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """:class:`~lightning_mgpu.AtomicCheckpointIO` unless a plugin was given (then that one, as it is; a
        wrapping plugin without a base, e.g. ``AsyncCheckpointIO()``, gets ``AtomicCheckpointIO`` as its base)."""
        # Lightning's Strategy.checkpoint_io with our default in place of TorchCheckpointIO
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        elif isinstance(self._checkpoint_io, _WrappingCheckpointIO):
            self._checkpoint_io.checkpoint_io = AtomicCheckpointIO()  # ignored when it has a base already
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    @override
    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        # precision="16-mixed"/"bf16-mixed" -> MGPUPrecision: overflow agreed across ranks, counted and logged
        self._precision_plugin = adopt(plugin)

    def _check_precision(self) -> None:
        plugin = self._precision_plugin
        if isinstance(plugin, MGPUPrecision) and self.parallel_devices:
            plugin.check(self.parallel_devices[0].type)

    def _configure_launcher(self) -> None:
        # Runs in the main process at Trainer construction, after accelerator and devices are known:
        # the last moment to refuse a configuration before any process is started.
        check_backend(self._comm_hook, self._get_process_group_backend())
        self._check_precision()
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _CheckedSubprocessScriptLauncher(
                self._check_before_launch,
                self.cluster_environment,
                self.num_processes,
                self.num_nodes,
                on_failure=self._end_group_after,
                grace_s=self._roll_call_s() + 5.0,  # rank 0's roll call, then a margin to raise and print
            )
        else:
            self._launcher = _CheckedMultiProcessingLauncher(
                self._check_before_launch, self, start_method=self._start_method
            )

    def _check_before_launch(self, trainer: pl.Trainer) -> None:
        """Runs in the main process when fit() is called, before any worker starts (and in each torchrun or
        SLURM process before it joins the group)."""
        check_accumulate_grad_batches(trainer.accumulate_grad_batches)
        backend = self._get_process_group_backend()
        if backend == "nccl" and self.root_device.type != "cuda":
            # torch fails only inside every worker ("Distributed package doesn't have NCCL built in" on a CPU
            # build; NCCL collectives take CUDA tensors only). Refused here, not at Trainer construction, so that
            # a configuration can still be built and inspected on a machine without GPUs.
            raise MisconfigurationException(
                f"process_group_backend={backend!r} needs CUDA devices, but this Trainer runs on "
                f"{self.root_device.type!r}. Use process_group_backend='gloo' (or leave it None: gloo on CPU, nccl "
                f"on CUDA), or train on GPUs with Trainer(accelerator='gpu')."
            )
        model = self._lightning_module
        if model is None or trainer.state.fn != TrainerFn.FITTING:
            return
        check_manual_accumulation(trainer, model)
        if self._layer_sync is not None and self._uses_ddp and self.root_device.type == "cpu":
            raise MisconfigurationException(
                "sync_batchnorm=True on CPU: torch's DistributedDataParallel refuses SyncBatchNorm layers in CPU "
                "modules ('SyncBatchNorm layers only work with GPU modules'). Train on GPUs, drop sync_batchnorm, or "
                "use strategy=MGPUShardedStrategy(activation_checkpointing=...) with the BatchNorm layers inside "
                "checkpointed blocks (mgpu_sharded, stage 2 or 3), where lightning_mgpu synchronises them on CPU."
            )
        if self._activation_checkpointing is not None:
            select_modules(model, self._activation_checkpointing)  # a policy that matches nothing fails here
        if not model.automatic_optimization and self._comm_hook in ("powersgd", "batched_powersgd"):
            raise MisconfigurationException(
                f"comm_hook={self._comm_hook!r} needs automatic optimization: with manual optimization mgpu_ddp "
                f"averages each optimizer's gradients itself when it steps, outside DDP's buckets, where PowerSGD "
                f"cannot run. Use comm_hook='fp16' (half the bytes) or None for {type(model).__name__}."
            )

    @property
    def _uses_ddp(self) -> bool:
        """Whether the model is wrapped in torch's DistributedDataParallel."""
        return True

    @property
    def _manual_sync(self) -> bool:
        module = self.lightning_module
        return module is not None and not module.automatic_optimization

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if not self._manual_sync or trainer.state.fn != TrainerFn.FITTING:
            return
        self._manual_params = {}
        plugin = self.precision_plugin
        for opt in self.optimizers:
            seen: set[int] = set()  # per optimizer: a parameter shared by two optimizers is synced for each
            params = []
            for group in opt.param_groups:
                for p in group["params"]:
                    if isinstance(plugin, MGPUPrecision):
                        p = plugin.model_parameter(p)  # master mode: sync the half gradients, before the copy
                    if p.requires_grad and id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
            self._manual_params[id(opt)] = params
            self._step_guards.append(opt.register_step_pre_hook(self._refuse_unsynced_step))
        if isinstance(plugin, MGPUPrecision):
            plugin.sync_gradients = self._sync_manual_gradients

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if isinstance(self.precision_plugin, MGPUPrecision) and trainer.state.fn == TrainerFn.FITTING:
            # before any wrapper (ZeroRedundancyOptimizer) is built around them
            self.precision_plugin.attach_master_weights(self.optimizers)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = self._module_state()
        plugin = self.precision_plugin
        if isinstance(plugin, MGPUPrecision) and self.lightning_module is not None:
            state = plugin.fp32_state_dict(self.lightning_module, state)  # master modes: the FP32 masters
        return state

    def _module_state(self) -> dict[str, Any]:
        """The module's weights as this strategy saves them, before the precision plugin puts in its masters."""
        return super().lightning_module_state_dict()

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._load_module_state(checkpoint, strict)
        plugin = self.precision_plugin
        state = checkpoint.get("state_dict")
        if isinstance(plugin, MGPUPrecision) and self.lightning_module is not None and state is not None:
            # masters that exist already (a restore after set-up: sharded strategies, LearningRateFinder, a
            # second fit) take the checkpoint's FP32 values; otherwise the next step would copy stale ones back
            plugin.load_masters(self.lightning_module, state)

    def _load_module_state(self, checkpoint: Mapping[str, Any], strict: bool) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)

    def _refuse_unsynced_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if not self._in_optimizer_step:
            raise MisconfigurationException(
                f"{type(optimizer).__name__}.step() was called on the raw torch optimizer, so its gradients were "
                f"not averaged across the {self.world_size} ranks and the replicas would drift apart. Step through "
                f"Lightning's wrapper: `opt = self.optimizers()` (not `use_pl_optimizer=False` or an optimizer "
                f"kept from configure_optimizers), then `opt.step()`."
            )

    @override
    def configure_ddp(self) -> None:
        self._apply_activation_checkpointing()
        super().configure_ddp()

    def _apply_activation_checkpointing(self) -> None:
        # Order (torchtitan's parallelize): SyncBatchNorm conversion (Lightning's layer sync, done before
        # configure_ddp) -> activation checkpointing -> DDP / sharding. Checkpointing patches the blocks'
        # forward in place, so DDP/FSDP see the same module tree and state-dict keys as without it.
        if self._activation_checkpointing is not None and self.lightning_module is not None:
            apply_activation_checkpointing(
                self.lightning_module,
                self._activation_checkpointing,
                use_reentrant=self._activation_checkpointing_reentrant,
            )

    @override
    def _register_ddp_hooks(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        stats = self._comm_stats
        stats.world_size = self.world_size
        stats.gradient_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        if self._count_from_buckets or self._manual_sync:
            return
        # Lightning registers hooks only when the device is CUDA; the torch hooks used here run on gloo too.
        self._comm_hook_state = register_comm_hook(self.model, self._comm_hook, self._comm_state, stats)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        model = self.model
        if self._manual_sync and isinstance(model, DistributedDataParallel):
            # Manual optimization: DDP's reducer would sync every backward (and, without
            # find_unused_parameters, wait forever for the toggled-off optimizer's gradients). Keep it out of
            # the whole step; optimizer_step syncs what the stepping optimizer needs.
            self._broadcast_buffers(model)
            with model.no_sync():
                return super().training_step(*args, **kwargs)
        if (
            self._static_graph
            and isinstance(model, DistributedDataParallel)
            and not model.static_graph
            and model.require_backward_grad_sync
            and torch.is_grad_enabled()
        ):
            # First synchronised forward: the reducer still has num_iterations_ == 0, so static-graph mode
            # can be switched on now. Earlier no_sync micro-batches ran in normal mode and never fired the
            # reducer's hooks into its static-graph bookkeeping (see _compat._DDP_HAS_SET_STATIC_GRAPH).
            model._set_static_graph()
        return super().training_step(*args, **kwargs)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        model = self.model
        if self._count_from_buckets and isinstance(model, DistributedDataParallel) and model.require_backward_grad_sync:
            stats = self._comm_stats
            # DDP re-lays its buckets once, in its first iterations: read the layout then, and re-check it
            # every 100 rounds (reading walks every parameter: not for every step of a large model).
            if not self._bucket_layout or stats.sync_rounds < 16 or stats.sync_rounds % 100 == 0:
                self._bucket_layout = buckets_from_grad_views(model.parameters())
            stats.record_round(self._bucket_layout)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[pl.LightningModule, Module]] = None,
        **kwargs: Any,
    ) -> Any:
        ddp = self.model
        if self._manual_sync and isinstance(ddp, DistributedDataParallel):
            inner = optimizer.optimizer if isinstance(optimizer, pl.core.optimizer.LightningOptimizer) else optimizer
            params = self._manual_params.get(id(inner))
            if params is None:
                raise MisconfigurationException(
                    f"{type(inner).__name__} was not returned by configure_optimizers, so mgpu_ddp cannot sync its "
                    f"gradients. Create every optimizer in configure_optimizers."
                )
            user_closure = closure

            def closure(inner: Optimizer = inner) -> Any:
                # after the user's closure (its backward), before unscaling and on_before_optimizer_step:
                # where DDP would have finished its all-reduce in automatic optimization
                out = user_closure()
                self._sync_manual_gradients(inner)
                return out

        self._in_optimizer_step = True
        try:
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            self._in_optimizer_step = False
            self._synced.clear()
        self._comm_stats.optimizer_steps += 1
        if self._log_comm_stats:
            self._maybe_log_comm_stats()
        return output

    def _sync_manual_gradients(self, optimizer: Optimizer) -> None:
        """Manual optimization: average ``optimizer``'s gradients across ranks, once per step. Runs in the
        step's closure, or earlier when the precision plugin needs the averaged gradients (``clip_gradients``
        called between ``manual_backward`` and ``opt.step()`` must clip the global gradient)."""
        ddp = self.model
        inner = optimizer.optimizer if isinstance(optimizer, pl.core.optimizer.LightningOptimizer) else optimizer
        params = self._manual_params.get(id(inner))
        if not self._manual_sync or not isinstance(ddp, DistributedDataParallel) or params is None:
            return
        if id(inner) in self._synced:
            return
        allreduce_gradients(
            params,
            group=ddp.process_group,
            compress=self._comm_hook,
            ledger=self._comm_stats,
            bucket_cap_mb=self._ddp_kwargs.get("bucket_cap_mb", 25.0),
        )
        self._synced.add(id(inner))

    def _maybe_log_comm_stats(self, force: bool = False) -> None:
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if trainer is None or not trainer.loggers or not self.is_global_zero:
            return
        # set on the Trainer at runtime by Lightning's logger connector (not a declared attribute)
        every = max(int(getattr(trainer, "log_every_n_steps", 50)), 1)
        if force or self._comm_stats.optimizer_steps % every == 0:
            metrics = self._comm_stats.as_metrics()
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _broadcast_buffers(self, model: DistributedDataParallel) -> None:
        """What DDP does before a synchronised forward (``broadcast_buffers=True``, its default): rank 0's
        buffers (BatchNorm statistics) overwrite the others', one broadcast per dtype."""
        if not self._ddp_kwargs.get("broadcast_buffers", True) or self.world_size == 1:
            return
        by_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for b in model.module.buffers():
            by_dtype.setdefault((b.device, b.dtype), []).append(b)
        for buffers in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in buffers])
            torch.distributed.broadcast(flat, src=0, group=model.process_group)
            offset = 0
            for b in buffers:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        self._refuse_main_process_save()
        move_position(checkpoint)  # the sampler's mid-epoch position: out of Lightning's loop state
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def _refuse_main_process_save(self) -> None:
        """Plain Lightning writes a checkpoint with empty optimizer states (and the main process's loop
        counters) when ``trainer.save_checkpoint`` runs in the main process after a spawn/fork fit."""
        if (
            isinstance(self._launcher, _MultiProcessingLauncher)
            and not torch.distributed.is_initialized()
            and self.num_processes * self.num_nodes > 1
        ):
            raise RuntimeError(
                f"trainer.save_checkpoint() was called in the main process after a {self._start_method!r} launch. "
                f"Training ran in the worker processes and their optimizer states are gone, so this checkpoint "
                f"could not resume training. Save from inside fit (ModelCheckpoint(save_last=True), or "
                f"trainer.save_checkpoint in a callback's on_train_end), or launch with start_method='popen', where "
                f"trainer.save_checkpoint after fit works."
            )

    @override
    def teardown(self) -> None:
        for handle in self._step_guards:
            handle.remove()
        self._step_guards = []
        if self._activation_checkpointing is not None and self.lightning_module is not None:
            remove_activation_checkpointing(self.lightning_module)  # hand the user's module back unchanged
        super().teardown()

    @override
    def on_train_end(self) -> None:
        if self._log_comm_stats:
            self._maybe_log_comm_stats(force=True)
        super().on_train_end()

    def _find_unused_parameters_fix(self) -> str:
        """The strategy, as the user writes it, with DDP's ``find_unused_parameters`` on (for error messages)."""
        return "strategy=MGPUDDPStrategy(find_unused_parameters=True)"

    @override
    def on_exception(self, exception: BaseException) -> None:
        _augment_message(
            exception,
            pattern=".*Expected to have finished reduction in the prior iteration.*",
            new_message=(
                f"Some parameters of your LightningModule were not used to produce the loss returned by "
                f"training_step. If that is intended, pass `{self._find_unused_parameters_fix()}` "
                "(slower: a graph traversal per step); better, remove or freeze (requires_grad=False) the unused "
                "parameters."
            ),
        )
        _augment_message(
            exception,
            pattern=".*Expected to mark a variable ready only once.*",
            new_message=(
                "DDP saw a parameter's gradient twice in one backward. With reentrant activation checkpointing "
                "(torch.utils.checkpoint(use_reentrant=True), or activation_checkpointing_reentrant=True) use the "
                "non-reentrant mode instead: MGPUDDPStrategy(activation_checkpointing=...) is non-reentrant by "
                "default. Otherwise a parameter is used outside forward or shared across checkpointed blocks; "
                "static_graph=True can help when the graph is the same every step."
            ),
        )
        self._end_group_after(exception)

    @override
    def setup_distributed(self) -> None:
        if _torchelastic_shares_its_store() and not torch.distributed.is_initialized():
            # Lightning's _init_dist_connection would init from env:// on the agent's store, which keeps the
            # previous attempt's addresses after a torchrun restart (_compat.py); give it a per-attempt prefix.
            # Lightning's setup_distributed then finds the group initialised and only sets the ranks and seed.
            self.set_world_ranks()
            torch.distributed.init_process_group(
                self._get_process_group_backend(),
                store=_elastic_attempt_store(self._timeout),
                rank=self.global_rank,
                world_size=self.world_size,
                timeout=self._timeout,
                device_id=self.root_device if self.root_device.type != "cpu" else None,  # as Lightning passes it
            )
            if self._get_process_group_backend() == "nccl":  # what Lightning's _init_dist_connection does for NCCL
                atexit.register(_destroy_dist_connection)
        super().setup_distributed()

    def _roll_call_s(self) -> float:
        """How long a rank whose collective failed waits for the others to answer: a quarter of the timeout,
        within [2 s, 10 s] (the healthy ranks fail in the same collective within moments of each other)."""
        return min(10.0, max(2.0, self._timeout.total_seconds() / 4)) if self._timeout else 5.0

    def _end_group_after(self, exception: BaseException) -> list[int]:
        """One rank failed: say which, and leave the group so that no rank waits for it (``_failures.py``).

        A rank whose own code raised announces it and keeps its process group: the group is healthy, and a
        script that catches the exception on every rank (a pruning callback, say) fits again on it; when the
        process ends instead, its connections close and the peers' collectives fail at once. A rank whose
        collective failed because of another rank takes a roll call, names the ranks that raised or stopped
        answering, and leaves the broken group. Returns the ranks that did not answer the roll call (the popen
        launcher kills those of its children). Runs once per exception: from the launcher in the workers and
        in popen's rank 0, then again (a no-op) from Lightning's ``on_exception``."""
        done = getattr(exception, "_mgpu_missing_ranks", None)
        if done is not None:
            return list(done)
        missing: list[int] = []
        if torch.distributed.is_available() and torch.distributed.is_initialized() and self.world_size > 1:
            grace_s = self._roll_call_s()
            if _failures.is_peer_failure(exception):
                text, missing = _failures.explain(
                    self.global_rank, self.world_size, grace_s, self._timeout, str(exception)
                )
                _failures.prepend(exception, text)
                _failures.tear_down()
            else:
                _failures.announce(self.global_rank, exception, grace_s)
        with contextlib.suppress(AttributeError, TypeError):  # a few built-in exception types take no attributes
            exception._mgpu_missing_ranks = missing  # type: ignore[attr-defined]
        return missing

    # --- mid-epoch resume: the training sampler's position travels in the checkpoint (sampler.py) -------
    _sampler_injected = False  # Lightning has just put its automatic DistributedSampler into a loader
    _sampler_position: Optional[dict[str, Any]] = None  # the mid-epoch position of the checkpoint being resumed

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Lightning reads these (`_DataConnector._resolve_sampler`) only to build its automatic
        # DistributedSampler, and hands that loader to process_dataloader next: the flag tells process_dataloader
        # that a DistributedSampler it finds there is Lightning's, not one the user set.
        self._sampler_injected = True
        return super().distributed_sampler_kwargs

    @override
    def process_dataloader(self, dataloader: object) -> object:
        injected, self._sampler_injected = self._sampler_injected, False
        dataloader = super().process_dataloader(dataloader)
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if trainer is None or not trainer.training:
            return dataloader  # evaluation loaders are read whole: nothing to resume
        if not trainer.fit_loop.is_resuming:
            self._sampler_position = None  # a later reload (reload_dataloaders_every_n_epochs) starts its epoch whole
        dataloader, took = resumable_train_loader(
            dataloader, trainer, injected=injected, position=self._sampler_position
        )
        if took:  # with several training loaders, the position is for the one that can take it, not the first
            self._sampler_position = None
        return dataloader

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        local = local_path(checkpoint_path)
        if local is not None and os.path.isdir(local):
            raise IsADirectoryError(sharded_directory_message(local, type(self).__name__))
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._sampler_position = take_position(checkpoint)  # applied when the training loader is built
        return checkpoint

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(comm_hook={self._comm_hook!r}, static_graph={self._static_graph}, "
            f"start_method={self._start_method!r})"
        )
