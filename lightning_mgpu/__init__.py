"""lightning-mgpu: multi-GPU training plugins for PyTorch Lightning.

``import lightning_mgpu`` registers the preset strategy names (``"mgpu_ddp"``, ``"mgpu_ddp_spawn"``, ...)
with Lightning, so ``Trainer(strategy="mgpu_ddp")`` works.
"""

from lightning_mgpu import distributed
from lightning_mgpu.accumulation import ManualAccumulation
from lightning_mgpu.callbacks import DeviceMonitor, ScaleLR
from lightning_mgpu.checkpoint_io import AtomicCheckpointIO, IncompleteCheckpointError
from lightning_mgpu.checkpointing import (
    EveryNth,
    apply_activation_checkpointing,
    checkpointed_modules,
    remove_activation_checkpointing,
)
from lightning_mgpu.comm import COMM_HOOKS, CommStats, allreduce_gradients
from lightning_mgpu.distributed import effective_batch_size
from lightning_mgpu.precision import MGPUPrecision
from lightning_mgpu.presets import PRESETS, preset_table, register_presets
from lightning_mgpu.sampler import ResumableDistributedSampler
from lightning_mgpu.schedules import total_steps, warmup_schedule
from lightning_mgpu.strategies import MGPUDDPStrategy, MGPUShardedStrategy, ShardMemory

__version__ = "0.1.0.dev0"

__all__ = [
    "COMM_HOOKS",
    "PRESETS",
    "AtomicCheckpointIO",
    "CommStats",
    "DeviceMonitor",
    "EveryNth",
    "IncompleteCheckpointError",
    "MGPUDDPStrategy",
    "MGPUPrecision",
    "MGPUShardedStrategy",
    "ManualAccumulation",
    "ResumableDistributedSampler",
    "ScaleLR",
    "ShardMemory",
    "__version__",
    "allreduce_gradients",
    "apply_activation_checkpointing",
    "checkpointed_modules",
    "distributed",
    "effective_batch_size",
    "preset_table",
    "register_presets",
    "remove_activation_checkpointing",
    "total_steps",
    "warmup_schedule",
]

register_presets()
