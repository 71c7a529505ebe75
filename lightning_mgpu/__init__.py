"""lightning-mgpu: multi-GPU training plugins for PyTorch Lightning.

``import lightning_mgpu`` registers the preset strategy names (``"mgpu_ddp"``, ``"mgpu_ddp_spawn"``, ...)
with Lightning, in both of its namespaces, so ``Trainer(strategy="mgpu_ddp")`` works with
``import lightning as L`` and with ``import pytorch_lightning as pl``. One Lightning distribution is enough:
with only ``lightning`` installed, ``lightning_mgpu`` and ``lightning_mgpu.lightning`` are the same package,
serving ``import lightning as L``.

Instances (strategies, precision plugins, callbacks) belong to one namespace, as Lightning's own do:

    from lightning_mgpu import MGPUDDPStrategy            # for pytorch_lightning.Trainer
    from lightning_mgpu.lightning import MGPUDDPStrategy  # for lightning.Trainer (import lightning as L)
"""

import os as _os

from lightning_mgpu import _namespace

if __name__ == "lightning_mgpu":  # not in the `lightning` copy, which is this file loaded again
    # `pytorch_lightning` installed: lightning_mgpu serves it and lightning_mgpu.lightning is the `lightning` copy;
    # `lightning` only: both names serve `lightning`; neither: an ImportError naming both pip install lines
    _namespace.setup_namespaces(__name__, _os.path.dirname(__file__))

from lightning_mgpu import distributed
from lightning_mgpu.callbacks import EMA, DeviceMonitor, ScaleLR
from lightning_mgpu.comm_hooks import COMM_HOOKS, allreduce_gradients
from lightning_mgpu.distributed import effective_batch_size
from lightning_mgpu.export import export_checkpoint
from lightning_mgpu.ledger import CommStats
from lightning_mgpu.migration import RemovedTrainerArgument, guard_trainer
from lightning_mgpu.parts.accumulation import ManualAccumulation
from lightning_mgpu.parts.activation_checkpointing import (
    EveryNth,
    apply_activation_checkpointing,
    checkpointed_modules,
    remove_activation_checkpointing,
)
from lightning_mgpu.parts.evaluation import EvenBatchSampler
from lightning_mgpu.parts.resume import ResumableDistributedSampler
from lightning_mgpu.parts.sharding import ShardMemory
from lightning_mgpu.parts.uneven_inputs import UnevenInputsError
from lightning_mgpu.planning import plan, plan_layouts
from lightning_mgpu.plugins.async_checkpoint import CheckpointWriteError
from lightning_mgpu.plugins.checkpoint_io import AtomicCheckpointIO, IncompleteCheckpointError
from lightning_mgpu.plugins.precision import MGPUPrecision
from lightning_mgpu.presets import PRESETS, UnknownPreset, preset_table, register_presets
from lightning_mgpu.quantization import quantize_frozen
from lightning_mgpu.schedules import total_steps, warmup_schedule
from lightning_mgpu.settings import FaultTolerance
from lightning_mgpu.strategies import (
    MGPUAutoStrategy,
    MGPUDDPStrategy,
    MGPUDiLoCoStrategy,
    MGPULocalSGDStrategy,
    MGPUShardedStrategy,
)

__version__ = "0.1.0.dev0"

__all__ = [
    "COMM_HOOKS",
    "EMA",
    "PRESETS",
    "AtomicCheckpointIO",
    "CheckpointWriteError",
    "CommStats",
    "DeviceMonitor",
    "EvenBatchSampler",
    "EveryNth",
    "FaultTolerance",
    "IncompleteCheckpointError",
    "MGPUAutoStrategy",
    "MGPUDDPStrategy",
    "MGPUDiLoCoStrategy",
    "MGPULocalSGDStrategy",
    "MGPUPrecision",
    "MGPUShardedStrategy",
    "ManualAccumulation",
    "RemovedTrainerArgument",
    "ResumableDistributedSampler",
    "ScaleLR",
    "ShardMemory",
    "UnevenInputsError",
    "UnknownPreset",
    "__version__",
    "allreduce_gradients",
    "apply_activation_checkpointing",
    "checkpointed_modules",
    "distributed",
    "effective_batch_size",
    "export_checkpoint",
    "plan",
    "plan_layouts",
    "preset_table",
    "quantize_frozen",
    "register_presets",
    "remove_activation_checkpointing",
    "total_steps",
    "warmup_schedule",
]

register_presets()
guard_trainer()  # Trainer(gpus=2) and the other Lightning 1.x arguments name their replacement

if __name__ == "lightning_mgpu" and _namespace.two_namespaces() and _namespace.lightning_available():
    # the `lightning` namespace: the same package loaded again with its imports rewritten (_namespace.py);
    # importing it registers the presets in lightning.pytorch's StrategyRegistry. Now if `lightning` is imported,
    # else as soon as it is: a `pytorch_lightning` script does not pay for importing `lightning` too
    _namespace.import_after("lightning", "lightning_mgpu.lightning")
