"""The sharded strategy's model and the parts that train it: what ``MGPUShardedStrategy``'s hooks hand their work to.
It builds, from the strategy's settings, the step object (``parts/steps.py``: the whole model, tensor-split or not, or
the pipeline's stages), the sharding backend, the runtime and the sharded checkpoint format, and holds them.

* the process group and the device mesh (built once per group, ``lightning_mgpu/mesh.py``), the sampler's ranks over
  the data dimension;
* before launch: the checks of the model and the plugins each layout needs (the sharding backend's units and 4-bit
  shards, tensor parallelism's and the pipeline's, the sharded checkpoint's), at Trainer construction and when
  ``fit`` is called;
* set-up: SyncBatchNorm, the precision plugin's conversion (FSDP2's sharded FP32 parameters are the master copy in
  master modes), one model on every rank, then the one ``parallelize`` of every layout (``parts/parallelize.py``),
  the optimizers wrapped over the shards, the global-norm clipping connected, the replica groups joined;
  evaluation after fit in the same processes keeps the sharded module as it is;
* each step through the step object, evaluation whose ranks may run different numbers of batches, the backward's
  sync and the ledger's rounds;
* teardown: the wrappers undone, an FSDP2 module left sharded where it is (as Lightning's ``ModelParallelStrategy``
  leaves it).

Example::

    self._sharded = ShardedModel(self, self, sharded, common)   # in the strategy's __init__
    self._sharded.setup(trainer)                                # its setup hook
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Callable, Optional, cast

import pytorch_lightning as pl
from lightning_fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.rank_zero import rank_zero_only
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_mgpu import _compat, comm
from lightning_mgpu._compat import attached_trainer
from lightning_mgpu.mesh import DATA_PARALLEL, GroupMesh, ParallelMesh, expose_to_module
from lightning_mgpu.parts.ddp import DDPWrapping
from lightning_mgpu.parts.evaluation import UnevenLoops
from lightning_mgpu.parts.parallelize import parallelize
from lightning_mgpu.parts.sharding import (
    ShardingBackend,
    ShardMemory,
    check_optimizer,
    follow_module_mode,
    make_backend,
    rebind_schedulers,
)
from lightning_mgpu.parts.steps import steps_for
from lightning_mgpu.parts.trainable_state import saves_trainable_only
from lightning_mgpu.plugins.checkpoint_io import PathLike
from lightning_mgpu.plugins.precision import MGPUPrecision, PrecisionAdoption
from lightning_mgpu.plugins.sharded_checkpoint import ShardedCheckpoints
from lightning_mgpu.quantization import has_nf4
from lightning_mgpu.settings import CommonSettings, ShardedSettings
from lightning_mgpu.strategies.launchers import launched_weights_only
from lightning_mgpu.strategies.runtime import Ranks, Runtime


class ShardedModel:
    """The model of one ``MGPUShardedStrategy`` (``strategy``; ``ranks``: the same object, see
    :class:`~lightning_mgpu.strategies.runtime.Runtime`), made ready as its sharding ``settings`` and ``common``
    (launch, and at stage 1 DDP) settings say, by the parts it builds from them: ``steps`` (``parts/steps.py``), the
    ``sharding`` backend, the ``runtime`` and the sharded ``checkpoints`` format (see the module docstring)."""

    def __init__(
        self, strategy: ParallelStrategy, ranks: Ranks, settings: ShardedSettings, common: CommonSettings
    ) -> None:
        self.strategy = strategy
        self.settings = settings
        # how each step runs the model, chosen once (parts/steps.py): whole (split by tensor parallelism), or through
        # the pipeline's stages, whose backend is then the sharding backend too
        self.steps = steps_for(settings, token_loss=common.loss_normalization == "tokens")
        self.sharding: ShardingBackend = self.steps.sharding(
            make_backend(settings.stage, settings.backend, settings.unit_classes, offload=settings.offload)
        )
        # stage 1: the DDP part of mgpu_ddp, composed (parts/ddp.py), in the runtime; None at stages 2 and 3
        self.runtime = Runtime(
            strategy,
            ranks,
            common,
            check_model=self.check_model,
            full_module_state=self.full_module_state,
            hand_back=[self.steps],
        )
        # both layouts' saves and loads (plugins/sharded_checkpoint.py), over the sharding backend in use
        self.checkpoints = ShardedCheckpoints(
            strategy,
            self.runtime.checkpoints,
            self.sharding_backend,
            settings.checkpoint,
            {"stage": settings.stage, "backend": settings.backend},
        )
        self.mesh = GroupMesh()  # built at set-up, once per process group (lightning_mgpu/mesh.py)
        self.uneven = UnevenLoops()  # evaluation loops whose ranks may run different numbers of batches
        self.sync_blocked = False  # inside block_backward_sync: the backward's gradients are not reduced

    def sharding_backend(self) -> ShardingBackend:
        """The sharding backend in use (what the checkpoint format asks for at each save and load)."""
        return self.sharding

    # --- the process group: what Lightning's DDPStrategy does for it, without its DDP wrapping ----------------------
    def start_process_group(self) -> None:
        s = self.strategy
        self.runtime.set_up_process()  # joins torchrun's store when it restarted this job
        reset_seed()
        self.runtime.ranks.set_world_ranks()
        if not comm.group_is_up():
            assert s.cluster_environment is not None
            _compat.init_dist_connection(
                s.cluster_environment,
                self.runtime.group_backend(),
                timeout=self.runtime.settings.timeout,
                device_id=s.root_device if s.root_device.type != "cpu" else None,  # as Lightning passes it
            )

    def set_world_ranks(self) -> None:
        s = self.strategy
        processes, nodes = self.runtime.processes_and_nodes()
        if s.cluster_environment is not None:
            s.cluster_environment.set_global_rank(s.node_rank * processes + s.local_rank)
            s.cluster_environment.set_world_size(nodes * processes)
        # both copies of rank_zero_only (Lightning's and lightning_utilities'), as Lightning's DDPStrategy does
        rank_zero_only.rank = utils_rank_zero_only.rank = s.global_rank  # type: ignore[attr-defined]  # a function attribute

    def sampler_kwargs(self) -> dict[str, Any]:
        """What Lightning builds its DistributedSampler with: the ranks of a tensor-parallel group see the same batch,
        so the data is split over the data dimension only (and over the live replicas under fault tolerance)."""
        self.runtime.sampler_requested()
        processes, nodes = self.runtime.processes_and_nodes()
        dims = self.settings.parallel_dims(processes * nodes, nodes)
        kwargs = {
            "num_replicas": dims.data_parallel,
            "rank": dims.coordinates(self.strategy.global_rank)[DATA_PARALLEL],
        }
        return kwargs if self.runtime.replicas is None else self.runtime.replicas.sampler_kwargs(kwargs)

    # --- the device mesh ------------------------------------------------------------------------------------------
    def device_mesh(self) -> ParallelMesh:
        """The mesh of this process group (built now if it has none yet, and then made the LightningModule's
        ``self.device_mesh``)."""
        return self.mesh.get(self._build_mesh, "MGPUShardedStrategy")

    def _build_mesh(self) -> ParallelMesh:
        world, nodes = self.strategy.world_size, self.runtime.processes_and_nodes()[1]
        built = self.settings.parallel_dims(world, nodes).build(self.strategy.root_device.type)
        expose_to_module(self.strategy.lightning_module, built.device_mesh)
        return built

    def environment_ready(self) -> None:
        """After the process group is up: the mesh of this group, exposed before ``configure_model`` reads it (to
        this module too, where the mesh was built for an earlier one)."""
        self.mesh.forget_if_new_group()
        expose_to_module(self.strategy.lightning_module, self.device_mesh().device_mesh)

    # --- checks before launch -------------------------------------------------------------------------------------
    def check_at_construction(self) -> None:
        """Runs in the main process at Trainer construction, once accelerator and devices are known."""
        self.runtime.check_at_construction()
        processes, nodes = self.runtime.processes_and_nodes()
        self.settings.mesh_shape(processes * nodes, nodes)  # a hybrid mesh that cannot be built: now
        plugin = self.strategy.precision_plugin
        if not (isinstance(plugin, MGPUPrecision) and plugin.master):
            return
        self.sharding.check_precision(plugin.mode)
        self.checkpoints.check_masters(plugin.mode, self.settings.stage)

    def check_model(self, trainer: pl.Trainer, model: pl.LightningModule) -> None:
        """The sharded strategy's checks of the model before launch (fitting only; stage 1's DDP part checks its own
        before, in the runtime)."""
        self.checkpoints.check_model(model, self.runtime.settings.checkpoint_params)
        clip_by_norm = trainer.gradient_clip_val and trainer.gradient_clip_algorithm in (None, "norm")
        processes, nodes = self.runtime.processes_and_nodes()
        shard_ranks = self.settings.mesh_shape(processes * nodes, nodes)[1]
        precision_plugin = self.strategy.precision_plugin
        self.sharding.check_before_launch(  # FSDP2's units and 4-bit shards, fairscale's clipping
            model, precision_plugin, trainer.gradient_clip_val if clip_by_norm else None, shard_ranks
        )
        self.steps.check_model(  # tensor parallelism's and the pipeline's checks
            model,
            four_bit=has_nf4(model),
            precision_plugin=precision_plugin,
            clip_by_norm=bool(clip_by_norm),
            trainer=trainer,
            trainable_only=saves_trainable_only(model, self.runtime.settings.checkpoint_params),
        )
        if not model.automatic_optimization:
            raise MisconfigurationException(
                f"{type(model).__name__} uses manual optimization, which MGPUShardedStrategy does not support yet "
                f"(the sharded optimizers step and gather parameters themselves). Use strategy='mgpu_ddp', which "
                f"supports manual optimization with accumulation."
            )

    def full_module_state(self) -> dict[str, Any]:
        """The whole module's weights (Lightning's launcher hands back rank 0's ``state_dict()``, which under FSDP2
        holds only its shards)."""
        assert self.strategy.lightning_module is not None
        return self.sharding.full_model_state(self.strategy.lightning_module)

    # --- set-up ---------------------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        """The strategy's ``setup``: the model ready for ``trainer.state.fn`` (see the module docstring)."""
        s = self.strategy
        assert s.accelerator is not None and s.model is not None
        s.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if not fitting and self.sharding.is_sharded(s.model):
            # validate/test/predict after fit in the same process: the module stays sharded (FSDP2 cannot be
            # undone) and its shards agree; a broadcast of module states cannot take DTensors. What FSDP does not
            # own (the buffers, any parameter left unsharded) goes to the device, wherever it was left.
            self.sharding.state_to_device(s.model, s.root_device)
            s.setup_precision_plugin()
            return
        layer_sync = _compat.strategy_layer_sync(s)
        if fitting and layer_sync is not None:
            s.model = layer_sync.apply(s.model)  # SyncBatchNorm, as Lightning's DDPStrategy converts it
        # before convert_module: in master modes FSDP2's sharded FP32 parameters are the master copy, so the
        # plugin must not cast the module's parameters to half itself (stage 1 and fairscale: the plugin keeps its
        # own FP32 masters and casts the module, as under mgpu_ddp)
        keeps_masters = fitting and self.sharding.keeps_masters
        masters = PrecisionAdoption.fsdp_mixed_precision(s.precision_plugin) if keeps_masters else None
        policy = self.sharding.mixed_precision_policy(masters)
        s.precision_plugin.convert_module(s.model)
        # offloaded, the whole model never sits on the device: FSDP2 moves each unit there as it shards it, and its
        # shards on to the host (the start weights' broadcast stages host tensors through comm)
        offloaded = fitting and self.settings.offload is not None
        if not offloaded:
            s.model_to_device()
        if fitting:
            if self.runtime.ddp is None:  # DDP broadcasts rank 0's weights itself
                comm.broadcast_start_weights(s.model)  # one model on every rank before it is split or sharded
            self._wrap(policy)
            if offloaded:  # what FSDP does not own (a module outside every unit's parameters and buffers)
                self.sharding.state_to_device(s.model, s.root_device)
                _compat.record_module_device(s.model, s.root_device)  # self.device: where it computes
            s.setup_optimizers(trainer)  # after the model is wrapped or sharded: the optimizers hold the shards
        else:
            comm.broadcast_module_states(s.model)  # evaluation without a wrapper: rank 0's weights everywhere
        s.setup_precision_plugin()
        if fitting:
            clipping = self.sharding.norm_clipping(comm.default_group(), self.runtime.ledger.stats)
            PrecisionAdoption.connect_norm_clipping(s.precision_plugin, clipping)  # shards: the global norm
            if self.settings.offload is None:  # offloaded: the optimizer state stays in host memory
                _compat.optimizers_to_device(s.optimizers, s.root_device)
            self.runtime.join_replica_groups(trainer)  # fault tolerance: the groups replicate these shards

    def _wrap(self, policy: Any) -> None:
        """The model made ready for training in the one order (``parts/parallelize.py``): tensor parallelism ->
        activation checkpointing -> DDP (stage 1) or sharding (stages 2/3, each pipeline stage) -> compilation; the
        sharded optimizers come after (:meth:`setup_optimizers`)."""
        s = self.strategy
        module = s.lightning_module
        assert module is not None
        if self.runtime.ddp is not None:
            s.model = self.runtime.wrap_ddp(module)  # as mgpu_ddp: checkpointing, wrap, hooks, compilation
            return
        mesh = self.device_mesh()
        counted = self.runtime.ledger.stats if self.settings.tensor_comm_stats else None
        s.model = parallelize(
            module,
            self.steps.sharded(self.sharding, mesh, policy, self.settings.unit_classes),
            checkpointing=self.runtime.checkpointing,
            compilation=self.runtime.compilation,
            split=lambda m: self.steps.split(m, mesh.tensor, counted),
        )
        self.runtime.ledger.start(s.model, s.world_size, self.sharding.mesh_shape)

    def setup_optimizers(self, trainer: pl.Trainer, lightning_setup: Callable[[pl.Trainer], None]) -> None:
        """The module's own optimizers (a second fit in the same process re-wraps), Lightning's ``setup_optimizers``
        (``lightning_setup``), the masters, then (fitting) each optimizer wrapped over the shards (its schedulers
        rebound to the wrapper) and the model wrapped after them where the backend does."""
        s = self.strategy
        _compat.reset_optimizers_and_schedulers(s)
        lightning_setup(trainer)
        self.runtime.setup_optimizers(trainer)  # master weights, before the optimizers are wrapped
        if trainer.state.fn != TrainerFn.FITTING:
            return
        group = comm.default_group()
        wrapped = []
        for opt in s.optimizers:
            check_optimizer(opt, self.settings.stage, self.settings.backend)
            new = self.sharding.wrap_optimizer(opt, group)
            if new is not opt:
                rebind_schedulers(s.lr_scheduler_configs, opt, new)
            wrapped.append(new)
        s.optimizers = wrapped
        assert s.model is not None
        s.model = self.sharding.wrap_after_optimizers(s.model, wrapped, group)

    # --- steps ----------------------------------------------------------------------------------------------------
    def redirect(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` of the LightningModule run through the wrapper's forward (DDP's, fairscale's SDP's), or the
        module's own ``__call__`` under FSDP2, which shards the LightningModule itself: its pre-forward hook (gather
        the root's parameters, lazy init) only runs through ``__call__``."""
        s = self.strategy
        assert s.model is not None and s.lightning_module is not None
        return _compat.forward_redirection(s)(s.model, s.lightning_module, method, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        s = self.strategy
        follow_module_mode(s.model, s.lightning_module)  # after validation: fairscale's SDP hooks need it
        return self.runtime.training_step(self._one_training_step, self._stage1_ddp(), *args, **kwargs)

    def _one_training_step(self, *args: Any, **kwargs: Any) -> Any:
        s = self.strategy
        with s.precision_plugin.train_step_context(), self.steps.counting():
            return self.steps.training_step(s.lightning_module, self._loss_scale, self.redirect, *args, **kwargs)

    def _loss_scale(self) -> float:
        return PrecisionAdoption.loss_scale(self.strategy.precision_plugin)

    def _stage1_ddp(self) -> Optional[DistributedDataParallel]:
        """Stage 1: the DDP model the runtime's DDP part drives; None at stages 2 and 3."""
        return cast(DistributedDataParallel, self.strategy.model) if self.runtime.ddp is not None else None

    def evaluation_step(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``validation_step``, ``test_step`` or ``predict_step`` (``method``), under the precision plugin's context
        for it."""
        plugin = self.strategy.precision_plugin
        contexts = {"validation_step": plugin.val_step_context, "test_step": plugin.test_step_context}
        with contexts.get(method, plugin.predict_step_context)():
            return self.steps.evaluation_step(self.strategy.lightning_module, method, self.redirect, *args, **kwargs)

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], step: Callable[..., Any]) -> Any:
        """Lightning's optimizer step (``step(closure)``) through the runtime; a pipeline's closure syncs the replicas'
        and the stages' gradients after Lightning's."""
        closure = self.steps.after_closure(closure)
        with self.steps.counting():  # the step's own (clipping's norm of split gradients); the closure's once
            return self.runtime.optimizer_step(optimizer, closure, step)

    @contextmanager
    def no_backward_sync(self) -> Generator[None, None, None]:
        """``block_backward_sync``: the backward's gradients are not reduced (nor counted in the ledger)."""
        assert self.strategy.model is not None
        self.sync_blocked = True
        try:
            with self.sharding.sync_control.no_backward_sync(self.strategy.model, enabled=True):
                yield
        finally:
            self.sync_blocked = False

    def after_backward(self) -> None:
        """After a training backward that reduced its gradients: the ledger's round (stage 1: the DDP part's)."""
        s = self.strategy
        trainer = attached_trainer(s.lightning_module)
        if self.sync_blocked or s.model is None or trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return
        if self.runtime.ddp is None:
            self.runtime.ledger.record_round(self.sharding.sync_layout(s.model))
        else:
            self.runtime.after_backward(self._stage1_ddp())

    # --- evaluation whose ranks may run different numbers of batches (parts/evaluation.py) -------------------------
    def start_evaluation(self) -> None:
        # The pipeline's evaluation through the stages is one collective whatever exact_evaluation: checked always
        if self.steps.checks_evaluation(self.runtime.settings.exact_evaluation):
            s = self.strategy
            self.uneven.start(attached_trainer(s.lightning_module), s.model, self.sharding, s.world_size)

    def end_evaluation(self) -> None:
        self.uneven.end(self.sharding)

    def load_checkpoint(
        self, path: PathLike, weights_only: Optional[bool], lightning_load: Callable[..., dict[str, Any]]
    ) -> dict[str, Any]:
        if weights_only is None:  # Lightning drops the user's for strategies that restore after set-up
            weights_only = launched_weights_only(self.strategy.launcher)
        return self.checkpoints.load(path, weights_only, lightning_load)

    def describe(self, name: str) -> str:
        """The strategy as its ``repr`` shows it (``name``: its class as users write it)."""
        s, offload = self.settings, self.settings.offload
        return (
            f"{name}(stage={s.stage}, backend={s.backend!r}, checkpoint={s.checkpoint!r}, "
            f"start_method={self.runtime.settings.start_method!r}" + (f", offload={offload!r})" if offload else ")")
        )

    def memory_report(self) -> ShardMemory:
        assert self.strategy.lightning_module is not None
        return self.sharding.memory_report(self.strategy.lightning_module, self.strategy.optimizers)

    # --- the end of fit, teardown ---------------------------------------------------------------------------------
    def train_end(self) -> None:
        self.steps.train_end()  # a pipeline's: every rank holds the trained model after fit
        self.runtime.train_end()

    def end_after(self, exception: BaseException) -> None:
        """``on_exception``: a failed collective names the ranks that failed, and the group ends as mgpu_ddp's; at
        stage 1 DDP's errors name the fix."""
        if self.runtime.ddp is not None:
            DDPWrapping.explain(exception, "strategy=MGPUShardedStrategy(stage=1, find_unused_parameters=True)")
        self.runtime.end_group_after(exception)

    # --- teardown -------------------------------------------------------------------------------------------------
    def teardown(self) -> bool:
        """The wrappers undone and the runtime's parts ended; True where the module stays sharded in place (FSDP2),
        its plugins then torn down here: Lightning's teardown (which the strategy runs otherwise) would move it."""
        s = self.strategy
        module = s.lightning_module
        stays = module is not None and self.sharding.is_sharded(module)
        if module is not None:
            PrecisionAdoption.connect_norm_clipping(s.precision_plugin, None)
            s.model = module  # unwrap DDP or fairscale's ShardedDataParallel (FSDP2 shards the module in place)
            trainer = attached_trainer(module)
            layer_sync = _compat.strategy_layer_sync(s)
            if layer_sync is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
                s.model = layer_sync.revert(s.model)
        self.runtime.teardown()
        if stays:
            # Lightning's teardown moves the module and the optimizer states to the CPU. A module sharded in place
            # (FSDP2) stays where it is, as Lightning's own ModelParallelStrategy leaves it: FSDP keeps its padded
            # shards on the device, so a move would leave the parameters it gathers on the device and the module's
            # buffers on the CPU (a later validate/test/predict would then mix devices).
            assert s.cluster_environment is not None and s.accelerator is not None
            s.cluster_environment.teardown()
            s.precision_plugin.teardown()
            s.accelerator.teardown()
            s.checkpoint_io.teardown()
        return stays
