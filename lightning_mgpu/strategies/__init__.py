"""Strategy plugins: thin assemblies of parts (``lightning_mgpu/parts``), one family per module.

* ``ddp.py``: :class:`MGPUDDPStrategy` (the DDP family);
* ``periodic.py``: :class:`MGPULocalSGDStrategy`, :class:`MGPUDiLoCoStrategy` (DDP's launch, weights synced every
  H steps instead of gradients every step);
* ``sharded.py``: :class:`MGPUShardedStrategy`, which builds the stage's class: ``zero1.py`` (stage 1: DDP + a
  sharded optimizer) or ``fsdp.py`` (stages 2/3: FSDP2 / fairscale, on ``_process_group.py``, not DDP).
"""

from lightning_mgpu.strategies._common import MGPUStrategyMixin
from lightning_mgpu.strategies._process_group import MGPUParallelStrategy
from lightning_mgpu.strategies.auto import MGPUAutoStrategy
from lightning_mgpu.strategies.ddp import MGPUDDPStrategy
from lightning_mgpu.strategies.fsdp import MGPUFSDPStrategy
from lightning_mgpu.strategies.periodic import MGPUDiLoCoStrategy, MGPULocalSGDStrategy
from lightning_mgpu.strategies.sharded import MGPUShardedStrategy, ShardMemory
from lightning_mgpu.strategies.zero1 import MGPUZeRO1Strategy

__all__ = [
    "MGPUAutoStrategy",
    "MGPUDDPStrategy",
    "MGPUDiLoCoStrategy",
    "MGPUFSDPStrategy",
    "MGPULocalSGDStrategy",
    "MGPUParallelStrategy",
    "MGPUShardedStrategy",
    "MGPUStrategyMixin",
    "MGPUZeRO1Strategy",
    "ShardMemory",
]
