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
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Optional, Union, cast

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.rank_zero import rank_zero_only
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch import nn
from torch.distributed import ReduceOp
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mgpu import _compat, comm
from lightning_mgpu._compat import attached_trainer
from lightning_mgpu.comm import group_is_up
from lightning_mgpu.ledger import CommStats
from lightning_mgpu.mesh import DATA_PARALLEL, ParallelMesh, expose_to_module
from lightning_mgpu.parts.activation_checkpointing import ActivationCheckpointingPolicy, CheckpointSave
from lightning_mgpu.parts.ddp import DDPWrapping
from lightning_mgpu.parts.evaluation import UnevenLoops
from lightning_mgpu.parts.fault_tolerance import ReplicaGroups
from lightning_mgpu.parts.micro_batching import MicroBatching
from lightning_mgpu.parts.parallelize import parallelize
from lightning_mgpu.parts.pipeline import PipelineStats
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
from lightning_mgpu.plugins.checkpoint_io import (
    PathLike,
)
from lightning_mgpu.plugins.precision import MGPUPrecision, PrecisionAdoption
from lightning_mgpu.plugins.sharded_checkpoint import ShardedCheckpoints
from lightning_mgpu.quantization import has_nf4
from lightning_mgpu.settings import (
    Backend,
    CheckpointLayout,
    CheckpointParams,
    CommHookName,
    CommonSettings,
    CompileSetting,
    DDPSettings,
    FaultToleranceSetting,
    LossNormalization,
    MeshLayout,
    MicroBatchSetting,
    NonFinite,
    Offload,
    PipelineScheduleName,
    PipelineSplit,
    ShardedSettings,
    Stage,
    StartMethod,
    TensorParallelPlanSetting,
    from_arguments,
    lightning_arguments,
    split_ddp_kwargs,
    strategy_options,
)
from lightning_mgpu.strategies.launchers import launched_weights_only
from lightning_mgpu.strategies.runtime import Runtime

log = logging.getLogger(__name__)


@strategy_options(
    ShardedSettings,
    DDPSettings,
    var_keyword=":class:`~lightning_mgpu.MGPUDDPStrategy` arguments; ``comm_hook``, ``static_graph`` and DDP keyword "
    "arguments apply to stage 1 and fairscale stage 1 only.",
)
class MGPUShardedStrategy(ParallelStrategy):
    """Sharded data-parallel training (ZeRO), torch-native by default, on CPU (gloo) and CUDA (NCCL).

    * ``stage=1``: optimizer state split across ranks (torch ``ZeroRedundancyOptimizer``, or fairscale
      ``OSS``); gradients all-reduced by torch's DistributedDataParallel, wrapped as mgpu_ddp wraps it (comm hooks,
      static graph, micro-batching and the ledger work as there).
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

    Example (``Trainer(strategy="mgpu_zero3")`` is the same with the consolidated layout):

        >>> from pytorch_lightning import Trainer
        >>> from lightning_mgpu import MGPUShardedStrategy
        >>> strategy = MGPUShardedStrategy(stage=3, checkpoint="sharded")
        >>> trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
        >>> type(trainer.strategy).__name__, trainer.strategy.stage  # one class for every stage
        ('MGPUShardedStrategy', 3)
        >>> MGPUShardedStrategy(stage=1, comm_hook="fp16").comm_hook  # stage 1 wraps the model in DDP
        'fp16'
    """

    strategy_name = "mgpu_sharded"

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
        activation_checkpointing_save: CheckpointSave = None,
        loss_normalization: Optional[LossNormalization] = None,
        nonfinite: Optional[NonFinite] = None,
        async_checkpoint: bool = False,
        checkpoint_params: CheckpointParams = "all",
        exact_evaluation: bool = True,
        check_uneven_inputs: bool = True,
        comm_hook: Optional[CommHookName] = None,
        comm_state: Optional[dict[str, Any]] = None,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        micro_batch_size: Optional[MicroBatchSetting] = None,
        mesh: MeshLayout = "flat",
        shard_size: Optional[int] = None,
        compile: CompileSetting = False,
        tensor_parallel_size: int = 1,
        tensor_parallel_plan: TensorParallelPlanSetting = "auto",
        tensor_comm_stats: bool = False,
        pipeline_parallel_size: int = 1,
        pipeline_schedule: PipelineScheduleName = "1f1b",
        pipeline_microbatches: Optional[int] = None,
        pipeline_split: PipelineSplit = "auto",
        offload: Offload = None,
        fault_tolerance: Optional[FaultToleranceSetting] = None,
        **ddp_kwargs: Any,
    ) -> None:
        arguments = dict(locals())
        sharded = from_arguments(ShardedSettings, arguments)
        sharded.check_fault_tolerance(fault_tolerance)
        ddp_kwargs = split_ddp_kwargs(ddp_kwargs)
        ddp_only = {
            "comm_hook": comm_hook,
            "static_graph": static_graph,
            "find_unused_parameters": find_unused_parameters,
        }
        sharded.check_ddp_settings({**ddp_only, **ddp_kwargs})
        # stage 1 trains a DistributedDataParallel model: its settings are mgpu_ddp's
        settings: CommonSettings = (
            from_arguments(DDPSettings, arguments, ddp_kwargs=ddp_kwargs)
            if sharded.uses_ddp
            else from_arguments(CommonSettings, arguments)
        )
        super().__init__(**lightning_arguments(arguments))
        self._node_count = 1
        self._common = settings
        self._sharded_settings = sharded
        self._backend_name: str = backend
        self._checkpoint_layout: str = checkpoint
        # how each step runs the model, chosen once (parts/steps.py): whole (split by tensor parallelism), or through
        # the pipeline's stages, whose backend is then the sharding backend too
        self._steps = steps_for(sharded, token_loss=loss_normalization == "tokens")
        self._sharding: ShardingBackend = self._steps.sharding(
            make_backend(sharded.stage, backend, sharded.unit_classes, offload=sharded.offload)
        )
        self._parallel_mesh: Optional[ParallelMesh] = None  # built at set-up: lightning_mgpu/mesh.py
        self._mesh_group: Any = None  # the default process group the mesh was built over
        self._sync_blocked = False  # inside block_backward_sync: the backward's gradients are not reduced
        self._uneven = UnevenLoops()  # evaluation loops whose ranks may run different numbers of batches
        # stage 1: the DDP part of mgpu_ddp, composed (parts/ddp.py), in the runtime; None at stages 2 and 3
        self._runtime = Runtime(
            self,
            self,
            settings,
            check_model=self._check_model,
            full_module_state=self._full_module_state,
            hand_back=[self._steps],
        )
        # both layouts' saves and loads (plugins/sharded_checkpoint.py), over the sharding backend in use
        self._checkpoints = ShardedCheckpoints(
            self,
            self._runtime.checkpoints,
            self._sharding_backend,
            checkpoint,
            {"stage": sharded.stage, "backend": backend},
        )

    def _sharding_backend(self) -> ShardingBackend:
        return self._sharding

    # --- what users read ------------------------------------------------------------------------------
    @property
    def public_name(self) -> str:
        """The strategy's class as users write it (what summaries and errors print)."""
        return type(self).__name__

    @property
    def settings(self) -> ShardedSettings:
        """The validated sharding settings (``ddp_settings``: the launch and, at stage 1, DDP ones)."""
        return self._sharded_settings

    @property
    def launch_settings(self) -> CommonSettings:
        """The settings every mgpu strategy has (launch, process group, ledger, activation checkpointing)."""
        return self._common

    @property
    def ddp_settings(self) -> CommonSettings:
        """The launch settings and, at stage 1, the DDP ones (a :class:`~lightning_mgpu.settings.DDPSettings`)."""
        return self._common

    @property
    def replicas(self) -> Optional[ReplicaGroups]:
        """The fault-tolerant replica groups (``fault_tolerance``): committed and dropped steps, heals, the last
        step's quorum; None where fault tolerance is off."""
        return self._runtime.replicas

    @property
    def stage(self) -> int:
        return self._sharded_settings.stage

    @property
    def backend(self) -> str:
        return self._backend_name

    @property
    def checkpoint_layout(self) -> str:
        return self._checkpoint_layout

    @property
    def comm_stats(self) -> CommStats:
        """The communication ledger of this rank (see :class:`~lightning_mgpu.CommStats`)."""
        return self._runtime.comm_stats

    @property
    def comm_hook(self) -> Optional[str]:
        """Stage 1: the DDP comm hook; stages 2 and 3 reduce-scatter without one (None)."""
        ddp = self._runtime.ddp
        return ddp.settings.comm_hook if ddp is not None else None

    @property
    def comm_hook_state(self) -> Any:
        """Stage 1: the registered hook's state (e.g. torch's ``PowerSGDState``), available after setup."""
        ddp = self._runtime.ddp
        return ddp.hook_state if ddp is not None else None

    @property
    def static_graph(self) -> bool:
        ddp = self._runtime.ddp
        return ddp.settings.static_graph if ddp is not None else False

    @property
    def micro_batching(self) -> Optional[MicroBatching]:
        """Stage 1 with ``micro_batch_size``: ``.size`` in use and ``.backoffs``; else None."""
        ddp = self._runtime.ddp
        return ddp.micro if ddp is not None else None

    @property
    def activation_checkpointing(self) -> Any:
        """The activation-checkpointing policy (``None``: off)."""
        return self._runtime.checkpointing.policy

    @property
    def async_checkpoint(self) -> bool:
        """Whether checkpoints saved during fit are staged and written in the background."""
        return self._common.async_checkpoint

    @property
    def checkpoint_write_in_flight(self) -> bool:
        """Whether a background checkpoint write of this rank is running now (``async_checkpoint=True``)."""
        return self._runtime.checkpoints.write_in_flight

    def pipeline_stats(self) -> Optional[PipelineStats]:
        """``pipeline_parallel_size > 1``: the last training step of this rank (bytes sent between stages, the
        measured bubble beside the formula); None before it, or without a pipeline. After a spawn or fork launch
        (``start_method="fork"`` in a notebook) the main process holds rank 0's, as it holds its
        ``callback_metrics``."""
        return self._steps.last_stats

    def add_tokens(self, num_tokens: Any, loss_sum: Any = None) -> None:
        """Manual optimization with ``loss_normalization="tokens"``: count a micro-batch's tokens (see
        :meth:`MGPUDDPStrategy.add_tokens`; the sharded strategy trains with automatic optimization only)."""
        self._runtime.add_tokens(num_tokens, loss_sum)

    # --- plugins --------------------------------------------------------------------------------------
    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """:class:`~lightning_mgpu.AtomicCheckpointIO` unless a plugin was given (then that one, as it is)."""
        return self._runtime.checkpoint_io()

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        _compat.set_strategy_checkpoint_io(self, io)

    @property
    @override
    def precision_plugin(self) -> Precision:
        plugin = _compat.strategy_precision_plugin(self)
        return plugin if plugin is not None else Precision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        _compat.set_strategy_precision_plugin(self, PrecisionAdoption.adopt(plugin))

    # --- the process group: what Lightning's DDPStrategy does for it, without its DDP wrapping (as Lightning's
    # own FSDPStrategy) -----------------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning's accelerator connector (its list of distributed strategies names only its own
        classes): True, so that Lightning puts in its DistributedSampler and syncs logged metrics."""
        return True

    @property
    def num_nodes(self) -> int:
        return self._node_count

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._node_count = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        self._runtime.sampler_requested()  # Lightning builds its DistributedSampler with these
        # the ranks of a tensor-parallel group see the same batch: the data is split over the data dimension only
        dims = self._sharded_settings.parallel_dims(self.num_nodes * self.num_processes, self.num_nodes)
        kwargs = {"num_replicas": dims.data_parallel, "rank": dims.coordinates(self.global_rank)[DATA_PARALLEL]}
        return kwargs if self._runtime.replicas is None else self._runtime.replicas.sampler_kwargs(kwargs)

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._common.process_group_backend

    @property
    def timeout(self) -> Optional[timedelta]:
        return self._common.timeout

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.setup_distributed()
        if self._mesh_group is not comm.default_group():
            # a new process group: a new mesh (the old mesh's groups ended with the old process group). On the same
            # process group (fit, then validate, test or predict in the same processes) the mesh is the one the
            # module was sharded over: building another would only add process groups.
            self._parallel_mesh = None
        expose_to_module(self.lightning_module, self._built_mesh().device_mesh)  # configure_model reads it

    @property
    def device_mesh(self) -> Any:
        """The ``DeviceMesh`` the LightningModule sees (``self.device_mesh``), built once per process group
        (:mod:`lightning_mgpu.mesh`): ``mesh["data_parallel"]`` and ``mesh["tensor_parallel"]``, as under
        Lightning's ``ModelParallelStrategy``."""
        return self._built_mesh().device_mesh

    def _built_mesh(self) -> ParallelMesh:
        if self._parallel_mesh is None:
            if not group_is_up():
                raise RuntimeError(
                    "MGPUShardedStrategy.device_mesh is built at set-up, once the processes have started: read it "
                    "in the LightningModule's configure_model (self.device_mesh) or any hook after it."
                )
            dims = self._sharded_settings.parallel_dims(self.world_size, self.num_nodes)
            self._parallel_mesh = dims.build(self.root_device.type)
            self._mesh_group = comm.default_group()
            expose_to_module(self.lightning_module, self._parallel_mesh.device_mesh)  # self.device_mesh
        return self._parallel_mesh

    def setup_distributed(self) -> None:
        self._runtime.set_up_process()  # joins torchrun's store when it restarted this job
        reset_seed()
        self.set_world_ranks()
        if not group_is_up():
            assert self.cluster_environment is not None
            _compat.init_dist_connection(
                self.cluster_environment,
                self._runtime.group_backend(),
                timeout=self._common.timeout,
                device_id=self.root_device if self.root_device.type != "cpu" else None,  # as Lightning passes it
            )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # both copies of rank_zero_only (Lightning's and lightning_utilities'), as Lightning's DDPStrategy does
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # a function attribute

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not group_is_up():
            return
        comm.barrier(device=self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not group_is_up():
            return obj
        return comm.broadcast_object(obj, src, group=torch.distributed.group.WORLD)

    @override
    def reduce(
        self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Any:
        # a value logged from the loss over the sharded vocabulary ("auto+sequence") is a replicated DTensor
        return self._runtime.reduce(self._steps.local_output(tensor), group, reduce_op)

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
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._checkpoints.module_state()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self._checkpoints.optimizer_state(optimizer)

    def consolidated_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole state of ``optimizer`` as one process's ``optimizer.state_dict()`` (indexed by parameter),
        on rank 0; ``{}`` elsewhere. A collective: call it on every rank."""
        return self._checkpoints.consolidated_optimizer_state(optimizer)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Optional[Any] = None
    ) -> None:
        self._checkpoints.save(checkpoint, filepath, storage_options, super().save_checkpoint)

    @override
    def remove_checkpoint(self, filepath: PathLike) -> None:
        self._checkpoints.remove(filepath, super().remove_checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if weights_only is None:  # Lightning drops the user's for strategies that restore after set-up
            weights_only = launched_weights_only(self.launcher)
        return self._checkpoints.load(checkpoint_path, weights_only, super().load_checkpoint)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._checkpoints.load_module_state(checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._checkpoints.load_optimizer_states(checkpoint)

    # --- launch ---------------------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        self._runtime.configure_launcher(self._check_at_construction)

    def _check_at_construction(self) -> None:
        """Runs in the main process at Trainer construction, once accelerator and devices are known."""
        self._runtime.check_at_construction()
        processes, nodes = self._runtime.processes_and_nodes()
        self._sharded_settings.mesh_shape(processes * nodes, nodes)  # a hybrid mesh that cannot be built: now
        plugin = self.precision_plugin
        if not (isinstance(plugin, MGPUPrecision) and plugin.master):
            return
        self._sharding.check_precision(plugin.mode)
        self._checkpoints.check_masters(plugin.mode, self._sharded_settings.stage)

    def _full_module_state(self) -> dict[str, Any]:
        # Lightning's launcher hands back rank 0's state_dict(), which under FSDP2 holds only its shards
        assert self.lightning_module is not None
        return self._sharding.full_model_state(self.lightning_module)

    def _check_model(self, trainer: pl.Trainer, model: pl.LightningModule) -> None:
        """The sharded strategy's checks of the model before launch (fitting only; stage 1's DDP part checks its
        own before, in the runtime)."""
        self._checkpoints.check_model(model, self._runtime.settings.checkpoint_params)
        clip_by_norm = trainer.gradient_clip_val and trainer.gradient_clip_algorithm in (None, "norm")
        processes, nodes = self._runtime.processes_and_nodes()
        shard_ranks = self._sharded_settings.mesh_shape(processes * nodes, nodes)[1]
        self._sharding.check_before_launch(  # FSDP2's units and 4-bit shards, fairscale's clipping
            model, self.precision_plugin, trainer.gradient_clip_val if clip_by_norm else None, shard_ranks
        )
        four_bit = has_nf4(model)
        self._steps.check_model(  # tensor parallelism's and the pipeline's checks
            model,
            four_bit=four_bit,
            precision_plugin=self.precision_plugin,
            clip_by_norm=bool(clip_by_norm),
            trainer=trainer,
            trainable_only=saves_trainable_only(model, self._runtime.settings.checkpoint_params),
        )
        if not model.automatic_optimization:
            raise MisconfigurationException(
                f"{type(model).__name__} uses manual optimization, which MGPUShardedStrategy does not support yet "
                f"(the sharded optimizers step and gather parameters themselves). Use strategy='mgpu_ddp', which "
                f"supports manual optimization with accumulation."
            )

    # --- set-up ---------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if not fitting and self._sharding.is_sharded(self.model):
            # validate/test/predict after fit in the same process: the module stays sharded (FSDP2 cannot be
            # undone) and its shards agree; a broadcast of module states cannot take DTensors. What FSDP does not
            # own (the buffers, any parameter left unsharded) goes to the device, wherever it was left.
            self._sharding.state_to_device(self.model, self.root_device)
            self.setup_precision_plugin()
            return
        layer_sync = _compat.strategy_layer_sync(self)
        if fitting and layer_sync is not None:
            self.model = layer_sync.apply(self.model)  # SyncBatchNorm, as Lightning's DDPStrategy converts it
        # before convert_module: in master modes FSDP2's sharded FP32 parameters are the master copy, so the
        # plugin must not cast the module's parameters to half itself (stage 1 and fairscale: the plugin keeps its
        # own FP32 masters and casts the module, as under mgpu_ddp)
        keeps_masters = fitting and self._sharding.keeps_masters
        masters = PrecisionAdoption.fsdp_mixed_precision(self.precision_plugin) if keeps_masters else None
        policy = self._sharding.mixed_precision_policy(masters)
        self.precision_plugin.convert_module(self.model)
        # offloaded, the whole model never sits on the device: FSDP2 moves each unit there as it shards it, and its
        # shards on to the host (the start weights' broadcast stages host tensors through comm)
        offloaded = fitting and self._sharded_settings.offload is not None
        if not offloaded:
            self.model_to_device()
        if fitting:
            if self._runtime.ddp is None:  # DDP broadcasts rank 0's weights itself
                comm.broadcast_start_weights(self.model)  # one model on every rank before it is split or sharded
            self._wrap_model(policy)
            if offloaded:  # what FSDP does not own (a module outside every unit's parameters and buffers)
                self._sharding.state_to_device(self.model, self.root_device)
                _compat.record_module_device(self.model, self.root_device)  # self.device: where it computes
            self.setup_optimizers(trainer)  # after the model is wrapped or sharded: the optimizers hold the shards
        else:
            comm.broadcast_module_states(self.model)  # evaluation without a wrapper: rank 0's weights everywhere
        self.setup_precision_plugin()
        if fitting:
            clipping = self._sharding.norm_clipping(self._process_group(), self._runtime.ledger.stats)
            PrecisionAdoption.connect_norm_clipping(self.precision_plugin, clipping)  # shards: the global norm
            if self._sharded_settings.offload is None:  # offloaded: the optimizer state stays in host memory
                _compat.optimizers_to_device(self.optimizers, self.root_device)
            self._runtime.join_replica_groups(trainer)  # fault tolerance: the groups replicate these shards

    def _wrap_model(self, policy: Any) -> None:
        """The model made ready for training in the one order (``parts/parallelize.py``): tensor parallelism ->
        activation checkpointing -> DDP (stage 1) or sharding (stages 2/3, each pipeline stage) -> compilation; the
        sharded optimizers come after (``setup_optimizers``)."""
        module = self.lightning_module
        assert module is not None
        if self._runtime.ddp is not None:
            self.model = self._runtime.wrap_ddp(module)  # as mgpu_ddp: checkpointing, wrap, hooks, compilation
            return
        mesh = self._built_mesh()
        counted = self._runtime.ledger.stats if self._sharded_settings.tensor_comm_stats else None
        self.model = parallelize(
            module,
            self._steps.sharded(self._sharding, mesh, policy, self._sharded_settings.unit_classes),
            checkpointing=self._runtime.checkpointing,
            compilation=self._runtime.compilation,
            split=lambda m: self._steps.split(m, mesh.tensor, counted),
        )
        self._runtime.ledger.start(self.model, self.world_size, self._sharding.mesh_shape)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # A second fit() in the same process re-wraps: start from the module's own optimizers.
        _compat.reset_optimizers_and_schedulers(self)
        super().setup_optimizers(trainer)
        self._runtime.setup_optimizers(trainer)  # master weights, before the optimizers are wrapped
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

    # --- steps ----------------------------------------------------------------------------------------
    def _redirect(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # Every step goes through the wrapper's forward (DDP's, fairscale's SDP's), or the module's own __call__
        # under FSDP2, which shards the LightningModule itself: its pre-forward hook (gather the root's
        # parameters, lazy init) only runs through __call__.
        assert self.model is not None and self.lightning_module is not None
        return _compat.forward_redirection(self)(self.model, self.lightning_module, method, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        follow_module_mode(self.model, self.lightning_module)  # after validation: fairscale's SDP hooks need it
        return self._runtime.training_step(self._one_training_step, self._stage1_ddp(), *args, **kwargs)

    def _one_training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.train_step_context(), self._steps.counting():
            return self._steps.training_step(self.lightning_module, self._loss_scale, self._redirect, *args, **kwargs)

    def _loss_scale(self) -> float:
        return PrecisionAdoption.loss_scale(self.precision_plugin)

    def _stage1_ddp(self) -> Optional[DistributedDataParallel]:
        """Stage 1: the DDP model the runtime's DDP part drives; None at stages 2 and 3."""
        return cast(DistributedDataParallel, self.model) if self._runtime.ddp is not None else None

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._steps.evaluation_step(
                self.lightning_module, "validation_step", self._redirect, *args, **kwargs
            )

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._steps.evaluation_step(self.lightning_module, "test_step", self._redirect, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._steps.evaluation_step(self.lightning_module, "predict_step", self._redirect, *args, **kwargs)

    # --- evaluation whose ranks may run different numbers of batches (parts/evaluation.py) ---------------------
    def _start_evaluation(self) -> None:
        # The pipeline's evaluation through the stages is one collective whatever exact_evaluation: checked always
        if self._common.exact_evaluation or self._steps.pipelined:
            self._uneven.start(attached_trainer(self.lightning_module), self.model, self._sharding, self.world_size)

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
        self._runtime.predict_start()
        super().on_predict_start()
        self._start_evaluation()

    @override
    def on_validation_end(self) -> None:
        self._uneven.end(self._sharding)
        super().on_validation_end()

    @override
    def on_test_end(self) -> None:
        self._uneven.end(self._sharding)
        super().on_test_end()

    @override
    def on_predict_end(self) -> None:
        self._uneven.end(self._sharding)
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
    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Any:
        # the split layers' backward collectives (tensor_comm_stats=True); the loss over the sharded vocabulary
        # ("auto+sequence") differentiates under loss_parallel too
        with self._steps.backward_context():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        trainer = attached_trainer(self.lightning_module)
        if self._sync_blocked or self.model is None or trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return
        if self._runtime.ddp is None:
            self._runtime.ledger.record_round(self._sharding.sync_layout(self.model))
        else:
            self._runtime.after_backward(self._stage1_ddp())

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[pl.LightningModule, nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        step = super().optimizer_step
        closure = self._steps.after_closure(closure)  # a pipeline's: the replicas' and the stages' gradient sync
        with self._steps.counting():  # the step's own (clipping's norm of split gradients); the closure's once
            return self._runtime.optimizer_step(optimizer, closure, lambda c: step(optimizer, c, model, **kwargs))

    # --- data -----------------------------------------------------------------------------------------
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

    # --- memory ---------------------------------------------------------------------------------------
    def memory_report(self) -> ShardMemory:
        """Optimizer-state, gradient and parameter bytes held by this rank now (no communication)."""
        assert self.lightning_module is not None
        return self._sharding.memory_report(self.lightning_module, self.optimizers)

    def __repr__(self) -> str:
        return (
            f"{self.public_name}(stage={self._sharded_settings.stage}, backend={self._backend_name!r}, "
            f"checkpoint={self._checkpoint_layout!r}, start_method={self._common.start_method!r}"
            + (f", offload={self._sharded_settings.offload!r})" if self._sharded_settings.offload else ")")
        )

    # --- end ------------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        module = self.lightning_module
        stays = module is not None and self._sharding.is_sharded(module)
        if module is not None:
            PrecisionAdoption.connect_norm_clipping(self.precision_plugin, None)
            self.model = module  # unwrap DDP or fairscale's ShardedDataParallel (FSDP2 shards the module in place)
            trainer = attached_trainer(module)
            layer_sync = _compat.strategy_layer_sync(self)
            if layer_sync is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
                self.model = layer_sync.revert(self.model)
        self._runtime.teardown()
        if stays:
            # Lightning's teardown moves the module and the optimizer states to the CPU. A module sharded in place
            # (FSDP2) stays where it is, as Lightning's own ModelParallelStrategy leaves it: FSDP keeps its padded
            # shards on the device, so a move would leave the parameters it gathers on the device and the module's
            # buffers on the CPU (a later validate/test/predict would then mix devices).
            assert self.cluster_environment is not None and self.accelerator is not None
            self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        super().teardown()

    @override
    def on_train_end(self) -> None:
        self._steps.train_end()  # a pipeline's: every rank holds the trained model after fit
        self._runtime.train_end()
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._runtime.ddp is not None:  # stage 1: DDP's errors name the fix
            DDPWrapping.explain(exception, "strategy=MGPUShardedStrategy(stage=1, find_unused_parameters=True)")
        # every stage and layout: a failed collective names the ranks that failed, and the group ends as mgpu_ddp's
        self._runtime.end_group_after(exception)
