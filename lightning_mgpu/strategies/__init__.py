"""Strategy plugins, one family per module.

Each public strategy is a direct subclass of Lightning's ``DDPStrategy`` or ``ParallelStrategy`` whose overridden
hooks hand their work to one :class:`~lightning_mgpu.strategies.runtime.Runtime` (``runtime.py``: the parts the
strategy owns and their coordination).

* ``ddp.py``: :class:`MGPUDDPStrategy` (the DDP family);
* ``periodic.py``: :class:`MGPULocalSGDStrategy`, :class:`MGPUDiLoCoStrategy` (DDP's launch, weights synced every
  H steps instead of gradients every step);
* ``sharded.py``: :class:`MGPUShardedStrategy` (ZeRO stages 1-3, one class) and its checkpoints (the
  sharding backends they use are a part: ``lightning_mgpu/parts/sharding.py``);
* ``auto.py``: :class:`MGPUAutoStrategy`; ``launchers.py``: the launchers' checks and fork on CPU.
"""

from lightning_mgpu.strategies.auto import MGPUAutoStrategy
from lightning_mgpu.strategies.ddp import MGPUDDPStrategy
from lightning_mgpu.strategies.periodic import MGPUDiLoCoStrategy, MGPULocalSGDStrategy
from lightning_mgpu.strategies.sharded import MGPUShardedStrategy

__all__ = [
    "MGPUAutoStrategy",
    "MGPUDDPStrategy",
    "MGPUDiLoCoStrategy",
    "MGPULocalSGDStrategy",
    "MGPUShardedStrategy",
]
