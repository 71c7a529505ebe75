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
from typing import Any, Callable, Optional, Union

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch import nn
from torch.distributed import ReduceOp
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mgpu import comm
from lightning_mgpu.comm import group_is_up
from lightning_mgpu.parts.activation_checkpointing import ActivationCheckpointingPolicy, CheckpointSave
from lightning_mgpu.parts.pipeline import PipelineStats
from lightning_mgpu.parts.sharding import (
    ShardMemory,
)
from lightning_mgpu.plugins.checkpoint_io import (
    PathLike,
)
from lightning_mgpu.settings import (
    Backend,
    CheckpointLayout,
    CheckpointParams,
    CommHookName,
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
    lightning_arguments,
    sharded_strategy_settings,
    strategy_options,
)
from lightning_mgpu.strategies import properties
from lightning_mgpu.strategies.sharded_model import ShardedModel

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

    Both are atomic: a save killed on any rank leaves the previous checkpoint whole; a sharded directory without its
    completion marker raises :class:`~lightning_mgpu.IncompleteCheckpointError` on load.

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
        sharded, settings = sharded_strategy_settings(arguments)  # at stage 1 with mgpu_ddp's DDP settings
        super().__init__(**lightning_arguments(arguments))
        self._node_count = 1
        self._common = settings
        self._sharded_settings = sharded
        # the model from its checks to its teardown (strategies/sharded_model.py), with the step object, the sharding
        # backend, the runtime and the checkpoint format it builds from the settings; the hooks hand their work to it
        self._sharded = ShardedModel(self, self, sharded, settings)
        self._runtime = self._sharded.runtime

    # --- what users read (declared once for every mgpu strategy: strategies/properties.py) ---------------------
    @property
    def settings(self) -> ShardedSettings:
        """The validated sharding settings (``ddp_settings``: the launch and, at stage 1, DDP ones)."""
        return self._sharded_settings

    @property
    def stage(self) -> int:
        return self._sharded_settings.stage

    @property
    def backend(self) -> str:
        return self._sharded_settings.backend

    @property
    def checkpoint_layout(self) -> str:
        return self._sharded_settings.checkpoint

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

    def pipeline_stats(self) -> Optional[PipelineStats]:
        """``pipeline_parallel_size > 1``: this rank's last training step (bytes sent between stages, the bubble
        measured and by formula); None before it or without a pipeline (after a spawn or fork launch: rank 0's)."""
        return self._sharded.steps.last_stats

    # --- plugins --------------------------------------------------------------------------------------
    checkpoint_io = properties.checkpoint_io
    precision_plugin = properties.precision_plugin

    # --- the process group: what Lightning's DDPStrategy does for it, without its DDP wrapping (as Lightning's
    # own FSDPStrategy) -----------------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        """True: Lightning's accelerator connector then puts in its DistributedSampler and syncs logged metrics."""
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
        return self._sharded.sampler_kwargs()

    process_group_backend = properties.process_group_backend
    timeout = properties.timeout

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.setup_distributed()
        self._sharded.environment_ready()  # the mesh of this process group, for configure_model's self.device_mesh

    @property
    def device_mesh(self) -> Any:
        """The ``DeviceMesh`` the LightningModule sees (``self.device_mesh``), built once per process group
        (:mod:`lightning_mgpu.mesh`): ``mesh["data_parallel"]`` and ``mesh["tensor_parallel"]``, as under
        Lightning's ``ModelParallelStrategy``."""
        return self._sharded.device_mesh().device_mesh

    def setup_distributed(self) -> None:
        self._sharded.start_process_group()

    def set_world_ranks(self) -> None:
        self._sharded.set_world_ranks()

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
        return self._runtime.reduce(self._sharded.steps.local_output(tensor), group, reduce_op)

    # --- checkpoints ----------------------------------------------------------------------------------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # optimizer state is split once the optimizers are wrapped (and FSDP2's parameters sharded)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._sharded.checkpoints.module_state()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self._sharded.checkpoints.optimizer_state(optimizer)

    def consolidated_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole state of ``optimizer`` as one process's ``optimizer.state_dict()`` (indexed by parameter),
        on rank 0; ``{}`` elsewhere. A collective: call it on every rank."""
        return self._sharded.checkpoints.consolidated_optimizer_state(optimizer)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Optional[Any] = None
    ) -> None:
        self._sharded.checkpoints.save(checkpoint, filepath, storage_options, super().save_checkpoint)

    @override
    def remove_checkpoint(self, filepath: PathLike) -> None:
        self._sharded.checkpoints.remove(filepath, super().remove_checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return self._sharded.load_checkpoint(checkpoint_path, weights_only, super().load_checkpoint)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._sharded.checkpoints.load_module_state(checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._sharded.checkpoints.load_optimizer_states(checkpoint)

    # --- launch ---------------------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        self._runtime.configure_launcher(self._sharded.check_at_construction)

    # --- set-up ---------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._sharded.setup(trainer)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self._sharded.setup_optimizers(trainer, super().setup_optimizers)

    # --- steps ----------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._sharded.training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._sharded.evaluation_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._sharded.evaluation_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._sharded.evaluation_step("predict_step", *args, **kwargs)

    # --- evaluation whose ranks may run different numbers of batches (parts/evaluation.py) ---------------------
    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._sharded.start_evaluation()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._sharded.start_evaluation()

    @override
    def on_predict_start(self) -> None:
        self._runtime.predict_start()
        super().on_predict_start()
        self._sharded.start_evaluation()

    @override
    def on_validation_end(self) -> None:
        self._sharded.end_evaluation()
        super().on_validation_end()

    @override
    def on_test_end(self) -> None:
        self._sharded.end_evaluation()
        super().on_test_end()

    @override
    def on_predict_end(self) -> None:
        self._sharded.end_evaluation()
        super().on_predict_end()

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        with self._sharded.no_backward_sync():
            yield

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Any:
        with self._sharded.steps.backward_context():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        self._sharded.after_backward()

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[pl.LightningModule, nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        step = super().optimizer_step
        return self._sharded.optimizer_step(optimizer, closure, lambda c: step(optimizer, c, model, **kwargs))

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

    def memory_report(self) -> ShardMemory:
        """Optimizer-state, gradient and parameter bytes held by this rank now (no communication)."""
        return self._sharded.memory_report()

    def __repr__(self) -> str:
        return self._sharded.describe(self.public_name)

    # --- end ------------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        if not self._sharded.teardown():  # True: the module stays sharded in place, its plugins torn down there
            super().teardown()

    @override
    def on_train_end(self) -> None:
        self._sharded.train_end()
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._sharded.end_after(exception)
