"""``MGPUParallelStrategy``: one process per device in a torch process group, without DistributedDataParallel.

The base of the strategies whose model is not a DDP module (the sharded stages 2 and 3: FSDP2, fairscale's
ShardedDataParallel). What Lightning's ``DDPStrategy`` does for the process group, without its DDP wrapping,
comm hooks and static-graph handling (Lightning's own ``FSDPStrategy`` is built the same way)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.distributed import ReduceOp
from typing_extensions import override

from lightning_mgpu import _compat
from lightning_mgpu.parts.process_group import group_is_up
from lightning_mgpu.settings import CommonSettings
from lightning_mgpu.strategies._common import MGPUStrategyMixin


class MGPUParallelStrategy(MGPUStrategyMixin, ParallelStrategy):
    """Distributed training without DDP: the process group, ranks, collectives and launch of the mgpu family.

    Not used directly: :class:`~lightning_mgpu.MGPUShardedStrategy` (stages 2 and 3) is built on it.

    Example::

        strategy = MGPUShardedStrategy(stage=3)   # an MGPUParallelStrategy, not a DDP strategy
        assert isinstance(strategy, MGPUParallelStrategy)
    """

    def __init__(
        self,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        settings: Optional[CommonSettings] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._node_count = 1
        self._init_parts(settings or CommonSettings())

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
        self._resume.sampler_requested()  # Lightning builds its DistributedSampler with these (see the mixin)
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._launch.process_group_backend

    @property
    def timeout(self) -> Optional[timedelta]:
        return self._launch.timeout

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.setup_distributed()

    @override
    def setup_distributed(self) -> None:
        self._join_elastic_store()  # when torchrun restarted this job (_compat.torchelastic_shares_its_store)
        reset_seed()
        self.set_world_ranks()
        if not group_is_up():
            assert self.cluster_environment is not None
            _compat.init_dist_connection(
                self.cluster_environment,
                self._group_backend(),
                timeout=self._launch.timeout,
                device_id=self.root_device if self.root_device.type != "cpu" else None,  # as Lightning passes it
            )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # both copies of rank_zero_only (Lightning's and lightning_utilities'), as Lightning's DDPStrategy does
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not group_is_up():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not group_is_up():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=torch.distributed.group.WORLD)
        return box[0]

    @override
    def reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Tensor:
        if isinstance(tensor, Tensor):
            return _compat.sync_ddp_if_available(tensor, group, reduce_op)
        return tensor
