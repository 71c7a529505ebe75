"""The runtime: the plain object every mgpu strategy holds, built from its settings. It owns the parts (the ledger,
failure handling, mid-epoch resume, exact evaluation, uneven inputs, activation checkpointing, compilation, the
token and non-finite checks, the DDP part, the periodic sync, the checkpoint rules, prediction gathering, the results
a worker hands back) and coordinates them: the launch and its checks, the process group's join, the step and its
closures, the end of fit. What a save or load does is the checkpoint rules' (``checkpoints``:
``plugins/checkpoint_rules.py``).

A strategy is a direct subclass of Lightning's ``DDPStrategy`` or ``ParallelStrategy`` whose overridden hooks each
hand their work to the runtime, explicitly (``strategies/``); the runtime reads what Lightning gave the strategy
(its module, devices, ranks, plugins) from the strategy it serves.

Example::

    runtime = Runtime(strategy, strategy, settings)   # in the strategy's __init__
    runtime.comm_stats                                # the ledger's counts
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any, Callable, Optional, Protocol, Union, cast

import pytorch_lightning as pl
from lightning_fabric.plugins import CheckpointIO
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.distributed import ReduceOp
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu import _compat, comm
from lightning_mgpu._compat import attached_trainer
from lightning_mgpu.comm_hooks import check_backend
from lightning_mgpu.ledger import CommStats, Ledger
from lightning_mgpu.parts import rendezvous
from lightning_mgpu.parts.accumulation import check_accumulate_grad_batches, check_manual_accumulation
from lightning_mgpu.parts.activation_checkpointing import ActivationCheckpointing
from lightning_mgpu.parts.compilation import Compilation
from lightning_mgpu.parts.ddp import DDPWrapping, StepContext
from lightning_mgpu.parts.evaluation import ExactEvaluation
from lightning_mgpu.parts.failures import FailureHandling
from lightning_mgpu.parts.fault_tolerance import ReplicaGroups
from lightning_mgpu.parts.nonfinite import NonFiniteCheck
from lightning_mgpu.parts.parallelize import parallelize
from lightning_mgpu.parts.periodic_sync import PeriodicSync
from lightning_mgpu.parts.predictions import PredictionGathering
from lightning_mgpu.parts.resume import MidEpochResume
from lightning_mgpu.parts.token_loss import TokenNormalization
from lightning_mgpu.parts.uneven_inputs import UnevenInputs
from lightning_mgpu.parts.worker_results import WorkerResults
from lightning_mgpu.plugins.checkpoint_io import choose_checkpoint_io
from lightning_mgpu.plugins.checkpoint_rules import CheckpointRules
from lightning_mgpu.plugins.precision import PrecisionAdoption
from lightning_mgpu.settings import CommonSettings, DDPSettings, LocalSGDSettings
from lightning_mgpu.strategies.launchers import (
    _CheckedMultiProcessingLauncher,
    _CheckedSubprocessScriptLauncher,
    check_interactive,
)

log = logging.getLogger(__name__)


class Ranks(Protocol):
    """What a strategy has beyond Lightning's ``ParallelStrategy``: processes per node, nodes, and how it sets the
    world ranks (Lightning's ``DDPStrategy`` has them; so has ``MGPUShardedStrategy``)."""

    @property
    def num_processes(self) -> int: ...

    @property
    def num_nodes(self) -> int: ...

    def set_world_ranks(self) -> None: ...


class Runtime:
    """The parts of one strategy and their coordination (see the module docstring).

    ``strategy``: the Lightning strategy it serves; ``ranks``: the same object, seen through what
    ``ParallelStrategy`` lacks (:class:`Ranks`); ``settings``: its validated settings (a
    :class:`~lightning_mgpu.settings.DDPSettings` gives it the DDP part); ``check_model``: the strategy's own
    checks of the model before launch; ``full_module_state``: the whole module's weights on every rank (the
    sharded strategy gathers them)."""

    def __init__(
        self,
        strategy: ParallelStrategy,
        ranks: Ranks,
        settings: CommonSettings,
        check_model: Optional[Callable[[pl.Trainer, pl.LightningModule], None]] = None,
        full_module_state: Optional[Callable[[], dict[str, Any]]] = None,
        hand_back: Sequence[Any] = (),
    ) -> None:
        self.strategy = strategy
        self.ranks = ranks
        self.settings = settings
        self.ledger = Ledger(log=settings.log_comm_stats)
        self.failures = FailureHandling(settings.timeout)
        self.resume = MidEpochResume()
        self.evaluation = ExactEvaluation(settings.exact_evaluation)
        self.uneven = UnevenInputs(settings.check_uneven_inputs)
        self.checkpointing = ActivationCheckpointing(
            settings.activation_checkpointing,
            settings.activation_checkpointing_reentrant,
            settings.activation_checkpointing_save,
        )
        self.compilation = Compilation(settings.compile)
        tokens = settings.loss_normalization == "tokens"
        self.tokens = TokenNormalization(self.ledger.stats) if tokens else None
        self.nonfinite = NonFiniteCheck(self.ledger.stats) if settings.nonfinite == "error" else None
        self.predictions = PredictionGathering()
        self.ddp = DDPWrapping(settings) if isinstance(settings, DDPSettings) else None
        """The DDP part (``mgpu_ddp``, its periodic family, the sharded stage 1); None where no DDP wraps the model."""
        ft = getattr(settings, "fault_tolerance", None)
        self.replicas = ReplicaGroups(ft, self.ledger.stats) if ft is not None else None
        """The fault-tolerant replica groups (``fault_tolerance``); None where it is off."""
        self.checkpoints = CheckpointRules(strategy, settings, self.resume, self.replicas, self.processes_and_nodes)
        """What every save and load does around the strategy's checkpoint format."""
        self.periodic: Optional[PeriodicSync] = None
        """The periodic weight sync (``mgpu_local_sgd``, ``mgpu_diloco`` set it); None elsewhere."""
        self.sharded_choices: tuple[str, ...] = ()
        """The sharded stages 2/3 the strategy may still become (``mgpu_auto`` sets them)."""
        self._check_model = check_model
        self.worker_results = WorkerResults(
            strategy, self.ledger.stats, self.checkpoints.module_state, full_module_state, hand_back
        )
        """What rank 0's worker hands to the main process after a spawn/fork launch (``parts/worker_results.py``)."""

    # --- what users read --------------------------------------------------------------------------------------
    @property
    def comm_stats(self) -> CommStats:
        return self.ledger.stats

    def processes_and_nodes(self) -> tuple[int, int]:
        return self.ranks.num_processes, self.ranks.num_nodes

    def group_backend(self) -> str:
        """The process-group backend asked for, or the device's default (gloo on CPU, nccl on CUDA), as Lightning's
        DDP chooses it; from the devices' type, not from this rank's device (see :meth:`device_type`)."""
        return self.settings.process_group_backend or ("nccl" if self.device_type() == "cuda" else "gloo")

    def device_type(self) -> str:
        """The type of the Trainer's devices. The launch path (Trainer construction, the checks before launch, the
        launcher) asks only for this, never for ``root_device``: that indexes the devices by this process's local
        rank, which a cluster environment may put past the local device count before any worker exists (Lightning's
        DDP reads ``root_device`` only once set up, in the worker)."""
        devices = self.strategy.parallel_devices
        return devices[0].type if devices else self.strategy.root_device.type

    def _attached(self) -> Optional[pl.Trainer]:
        return attached_trainer(self.strategy.lightning_module)

    def _accumulate(self) -> int:
        """The Trainer's ``accumulate_grad_batches`` now (1 outside a Trainer)."""
        trainer = self._attached()
        return trainer.accumulate_grad_batches if trainer is not None else 1

    # --- plugins ----------------------------------------------------------------------------------------------
    def checkpoint_io(self) -> CheckpointIO:
        """:class:`~lightning_mgpu.AtomicCheckpointIO` unless a plugin was given (then that one, as it is; a
        wrapping plugin without a base, e.g. ``AsyncCheckpointIO()``, gets ``AtomicCheckpointIO`` as its base)."""
        io = choose_checkpoint_io(_compat.strategy_checkpoint_io(self.strategy))
        _compat.set_strategy_checkpoint_io(self.strategy, io)
        return io

    # --- launch -----------------------------------------------------------------------------------------------
    def check_at_construction(self) -> None:
        """Runs in the main process at Trainer construction, once accelerator and devices are known."""
        if self.ddp is not None:
            check_backend(self.ddp.settings.comm_hook, self.group_backend())
        strategy = self.strategy
        PrecisionAdoption.check(_compat.strategy_precision_plugin(strategy), strategy.parallel_devices)
        self.checkpoints.check_io(_compat.strategy_checkpoint_io(strategy))

    def configure_launcher(self, check_at_construction: Callable[[], None]) -> None:
        """The last moment to refuse a configuration before any process is started: the notebook check, then the
        strategy's construction checks (``check_at_construction``), then the launcher with its pre-launch check."""
        check_interactive(self.strategy, self.settings.start_method)
        check_at_construction()
        strategy = self.strategy
        assert strategy.cluster_environment is not None
        launcher: Any
        if self.settings.start_method == "popen":
            launcher = _CheckedSubprocessScriptLauncher(
                self.check_before_launch,
                strategy.cluster_environment,
                *self.processes_and_nodes(),
                on_failure=self.end_group_after,
                grace_s=self.failures.roll_call_s() + 5.0,  # rank 0's roll call, then a margin to raise and print
                finish=self.gather_predictions,
            )
        else:
            launcher = _CheckedMultiProcessingLauncher(
                self.check_before_launch,
                strategy,
                start_method=self.settings.start_method,
                on_failure=self.end_group_after,
                weights=self.worker_results.weights,
                results=(self.worker_results.results, self.worker_results.restore),
                returned=(self.predictions.before_launch, self.gather_predictions),
                device_type=self.device_type,
            )
        _compat.set_strategy_launcher(strategy, launcher)

    def check_before_launch(self, trainer: pl.Trainer) -> None:
        """Runs in the main process when fit() is called, before any worker starts (and in each torchrun or
        SLURM process before it joins the group)."""
        check_accumulate_grad_batches(trainer.accumulate_grad_batches)
        backend = self.group_backend()
        if backend == "nccl" and self.device_type() != "cuda":
            # torch fails only inside every worker ("Distributed package doesn't have NCCL built in" on a CPU
            # build; NCCL collectives take CUDA tensors only). Refused here, not at Trainer construction, so that
            # a configuration can still be built and inspected on a machine without GPUs.
            raise MisconfigurationException(
                f"process_group_backend={backend!r} needs CUDA devices, but this Trainer runs on "
                f"{self.device_type()!r}. Use process_group_backend='gloo' (or leave it None: gloo on CPU, "
                f"nccl on CUDA), or train on GPUs with Trainer(accelerator='gpu')."
            )
        model = self.strategy.lightning_module
        if model is None or trainer.state.fn != TrainerFn.FITTING:
            return
        check_manual_accumulation(trainer, model)
        self.compilation.check(model, type(self.strategy).__name__, self.sharded_choices)
        if self.periodic is not None:
            self.periodic.check_model(model, type(self.strategy).__name__, self.strategy.precision_plugin)
        if self.ddp is not None:
            sync_batchnorm = _compat.strategy_layer_sync(self.strategy) is not None
            self.ddp.check_model(model, self.device_type(), sync_batchnorm, self.ddp.micro)
        if self._check_model is not None:
            self._check_model(trainer, model)
        self.checkpointing.check(model)  # a policy that matches nothing fails here

    # --- set-up -----------------------------------------------------------------------------------------------
    def set_up_process(self) -> None:
        """In every rank, first at set-up: no warning printed by each rank for what Lightning does in every loop, the
        group's destruction at exit whatever its backend, then the process group joined (``parts/rendezvous.py``)."""
        _compat.leaf_specs_without_warning()
        comm.leave_group_at_exit()
        rendezvous.join_strategy_group(
            self.strategy,
            self.ranks.set_world_ranks,
            self.group_backend,
            self.settings.timeout,
            self.processes_and_nodes()[1],
        )

    def wrap_ddp(self, module: pl.LightningModule) -> DistributedDataParallel:
        """The DDP part's model set-up, in the one order (``parts/parallelize.py``): activation checkpointing -> the
        DDP wrap with its comm hook, counted by the ledger -> compilation of ``forward``."""
        assert self.ddp is not None
        data = self.ddp.dimension(self.strategy.root_device, self.ledger, self.strategy.world_size, self.manual_sync())
        ddp = parallelize(module, data, checkpointing=self.checkpointing, compilation=self.compilation)
        return cast(DistributedDataParallel, ddp)

    def manual_sync(self) -> bool:
        """Manual optimization under DDP: each optimizer's gradients are averaged at its step, outside DDP."""
        module = self.strategy.lightning_module
        return self.ddp is not None and module is not None and not module.automatic_optimization

    def setup_ddp_sync(self, trainer: pl.Trainer, ddp: DistributedDataParallel) -> None:
        """After the DDP set-up: the manual-optimization gradient sync handed to the precision plugin, and the
        periodic sync's starting point (after DDP's wrap broadcast rank 0's weights: every rank the same anchor)."""
        strategy = self.strategy
        plugin = strategy.precision_plugin
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.ddp is not None and self.manual_sync() and fitting:
            to_model = PrecisionAdoption.model_parameter(plugin)
            self.ddp.manual.setup(strategy.optimizers, strategy.world_size, to_model)
            PrecisionAdoption.connect_gradient_sync(plugin, lambda opt: self.sync_manual_gradients(opt, ddp))
        else:
            PrecisionAdoption.connect_gradient_sync(plugin, None)
        module = strategy.lightning_module
        if self.periodic is not None and fitting and module is not None:
            self.periodic.setup(module.parameters(), ddp.process_group, strategy.world_size, module.buffers())

    def join_replica_groups(self, trainer: pl.Trainer) -> None:
        """Fault tolerance, when fitting: join the other replica groups through the lighthouse, over the store this
        group's process group was made on."""
        strategy = self.strategy
        module = strategy.lightning_module
        if self.replicas is None or trainer.state.fn != TrainerFn.FITTING or module is None:
            return
        env = strategy.cluster_environment
        assert env is not None
        self.replicas.setup(trainer, module, strategy.global_rank, strategy.world_size, env.main_address, env.main_port)

    def sync_manual_gradients(self, optimizer: Any, ddp: DistributedDataParallel) -> None:
        """Manual optimization: average ``optimizer``'s gradients across ranks, once per step; handed to the
        precision plugin, which calls it before it moves or clips the gradients."""
        if self.ddp is not None and self.manual_sync():
            self.ddp.manual.sync(optimizer, ddp.process_group, self.ledger.stats)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            PrecisionAdoption.attach_masters(self.strategy.precision_plugin, self.strategy.optimizers)

    # --- steps ------------------------------------------------------------------------------------------------
    def training_step(
        self, step: Callable[..., Any], ddp: Optional[DistributedDataParallel], *args: Any, **kwargs: Any
    ) -> Any:
        """One ``training_step``: ``step`` runs the LightningModule's (through the strategy's wrapper), each call's
        tokens counted (``loss_normalization="tokens"``); with the DDP part, through it (manual optimization,
        micro-batching, static graph); with the periodic sync, outside the warm-up without DDP's all-reduce. Nothing
        that only one of these reads is computed for a step that has none of them."""
        if self.tokens is not None:
            step = self.tokens.counting(step, lambda: self.strategy.lightning_module)
        if self.ddp is None or ddp is None:
            return step(*args, **kwargs)
        run = functools.partial(
            self.ddp.training_step, ddp, step, args, kwargs, manual=self.manual_sync(), context=self._step_context
        )
        if self.periodic is None:
            return run()
        with self.periodic.no_sync(ddp):
            return run()

    def _step_context(self) -> StepContext:
        """What a manual or micro-batched DDP step reads (:class:`~lightning_mgpu.parts.ddp.StepContext`)."""
        strategy = self.strategy
        accumulate = self._accumulate()
        optimizer = strategy.optimizers[0] if strategy.optimizers else None
        return StepContext(
            backward=lambda loss: strategy.backward(loss / accumulate, optimizer),
            accumulate_grad_batches=accumulate,
            stats=self.ledger.stats,
            rank=strategy.global_rank,
            world_size=strategy.world_size,
            device=strategy.root_device,
        )

    def add_tokens(self, num_tokens: Any, loss_sum: Any = None) -> None:
        if self.tokens is None:
            raise RuntimeError("add_tokens needs the strategy built with loss_normalization='tokens'.")
        self.tokens.add(num_tokens, loss_sum)

    def after_backward(self, ddp: Optional[DistributedDataParallel]) -> None:
        """After a backward of the DDP model: count a synchronised one (the periodic sync's backwards are, only in
        the warm-up)."""
        if self.ddp is None or ddp is None:
            return
        synced = ddp.require_backward_grad_sync and (self.periodic is None or self.periodic.in_warmup)
        self.ddp.after_backward(ddp, self.ledger, synced)

    def optimizer_step(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        step: Callable[[Callable[[], Any]], Any],
        group: Optional[Callable[[], Any]] = None,
    ) -> Any:
        """One optimizer step: ``step(closure)`` runs Lightning's. The closure is wrapped: the manual-optimization
        gradient sync (DDP, over the process group ``group()``), the token rescale, the non-finite check, in that
        order after the closure's backward; after the step, the periodic sync, then the ledger counts it."""
        strategy = self.strategy
        manual = self.ddp.manual if self.ddp is not None and self.manual_sync() else None
        if manual is not None:
            # after the user's closure (its backward), before unscaling and on_before_optimizer_step: where DDP
            # would have finished its all-reduce in automatic optimization
            process_group = group() if group is not None else None
            closure = manual.wrap_closure(optimizer, closure, process_group, self.ledger.stats)
        plugin = strategy.precision_plugin
        if self.tokens is not None:
            to_model = PrecisionAdoption.model_parameter(plugin)
            closure = self.tokens.wrap_closure(optimizer, closure, strategy, to_model, self._accumulate)
        if self.nonfinite is not None:
            scaled = bool(getattr(plugin, "uses_scaler", False))  # fp16: the scaler's agreed check skips the step
            to_model = PrecisionAdoption.model_parameter(plugin)
            closure = self.nonfinite.wrap_closure(optimizer, closure, strategy, to_model, scaled)
        replicas = self.replicas
        if replicas is not None:  # a transaction over the replica groups: committed, or dropped everywhere
            inner = step
            step = lambda c: replicas.optimizer_step(optimizer, c, inner)  # noqa: E731
        if manual is not None:
            with manual.stepping():
                output = step(closure)
        else:
            output = step(closure)
        if self.periodic is not None:
            self.periodic.after_optimizer_step(self.ledger.stats)
        self.ledger.optimizer_stepped(strategy.lightning_module, strategy.is_global_zero)
        return output

    # --- periodic sync (mgpu_local_sgd, mgpu_diloco: parts/periodic_sync.py) -----------------------------------
    def sync_periodically(self, settings: LocalSGDSettings) -> PeriodicSync:
        """Sync the weights every ``sync_every`` steps instead of the gradients every step (the strategy's DDP hooks
        then hand the steps, backwards and checkpoints to the sync as well)."""
        self.periodic = PeriodicSync(settings)
        if self.replicas is not None:  # across replica groups the sync is the transaction, at the next step's start
            self.replicas.periodic = self.periodic
            self.periodic.deferred = True
        return self.periodic

    def add_periodic_state(self, checkpoint: dict[str, Any], ddp: DistributedDataParallel) -> None:
        """Every rank (a collective): the periodic sync's state and every rank's own, into rank 0's checkpoint."""
        if self.periodic is not None:
            self.periodic.add_to_checkpoint(checkpoint, self.strategy, ddp.process_group)

    def hold_periodic_state(self, checkpoint: Any) -> None:
        if self.periodic is not None:
            self.periodic.hold(checkpoint)

    def restore_periodic_state(self, load_optimizer_states: Callable[[dict[str, Any]], None]) -> None:
        if self.periodic is not None:
            self.periodic.restore_held(self.strategy.global_rank, self.strategy.world_size, load_optimizer_states)

    # --- data -------------------------------------------------------------------------------------------------
    def sampler_requested(self) -> None:
        """Lightning is building its automatic sampler for the loader it hands to ``process_dataloader`` next."""
        self.resume.sampler_requested()
        self.evaluation.sampler_requested()

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self._attached()
        dataloader = self.evaluation.process_dataloader(dataloader, trainer)  # validate/test/predict
        dataloader = self.resume.process_dataloader(dataloader, trainer)  # training
        return self.uneven.process_dataloader(dataloader, trainer)  # training

    def reduce(self, tensor: Any, group: Optional[Any], reduce_op: Optional[Union[ReduceOp, str]]) -> Any:
        """Lightning's reduce (``self.log(..., sync_dist=True)``); with ``exact_evaluation`` the mean of an integer
        tensor (the summed batch sizes of a logged mean) is not truncated
        (:func:`lightning_mgpu.comm.lightning_reduce`)."""
        if isinstance(tensor, Tensor):
            return comm.lightning_reduce(tensor, group, reduce_op, exact_mean=self.settings.exact_evaluation)
        return tensor

    def train_start(self) -> None:
        """Fault tolerance: the group joins the others before its first batch is drawn (a group started again heals
        there, the data position included)."""
        if self.replicas is not None:
            self.replicas.join()

    def train_batch_start(self, lightning_hook: Callable[[], None], batch_idx: int) -> None:
        trainer = self._attached()
        self.uneven.on_train_batch_start(trainer)  # once per epoch: the counts
        lightning_hook()
        self.resume.batch_started(trainer)
        if self.replicas is not None and trainer is not None:  # the step's quorum (and a heal) before its forward
            self.replicas.begin_step(accumulating_before=batch_idx % trainer.accumulate_grad_batches != 0)

    # --- trainer.predict, and what a worker hands to the main process ----------------------------------------
    def predict_start(self) -> None:
        self.predictions.on_predict_start(self._attached())

    def gather_predictions(self, trainer: pl.Trainer, results: Any) -> Any:
        """Every rank, after a Trainer call: ``trainer.predict``'s predictions of all ranks, each once, in dataset
        order; on every rank under popen (each rank's call returns them), on rank 0 under spawn/fork (its worker
        hands them to the main process; with several nodes, every rank)."""
        to_all = self.settings.start_method == "popen" or self.processes_and_nodes()[1] > 1
        return self.predictions.gather(trainer, results, to_all=to_all)

    # --- failures ---------------------------------------------------------------------------------------------
    def end_group_after(self, exception: BaseException) -> list[int]:
        """One rank failed: say which, and leave the group so that no rank waits for it (``parts/failures.py``)."""
        return self.failures.end_group_after(exception, self.strategy.global_rank, self.strategy.world_size)

    # --- end --------------------------------------------------------------------------------------------------
    def train_end(self) -> None:
        if self.replicas is not None:
            self.replicas.settle()  # the last batch's dropped step, undone
            self.replicas.finish()  # local SGD / DiLoCo: the last period's sync
        self.checkpoints.settle()  # fit's end waits for the last write; its failure raises on every rank
        self.ledger.write(self.strategy.lightning_module, self.strategy.is_global_zero, force=True)

    def teardown(self) -> None:
        self.checkpoints.end()
        if self.replicas is not None:
            self.replicas.teardown()
        if self.ddp is not None:
            self.ddp.manual.teardown()
            PrecisionAdoption.connect_gradient_sync(self.strategy.precision_plugin, None)
        module = self.strategy.lightning_module
        self.compilation.remove(module)  # the eager forwards back, then the checkpointed ones
        self.checkpointing.remove(module)  # the user's module back
