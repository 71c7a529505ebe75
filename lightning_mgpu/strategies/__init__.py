"""Strategy plugins, one family per module.

* ``base.py``: what every mgpu strategy shares (:class:`MGPUStrategyMixin`: the parts it owns and the Lightning
  hooks it hands to them) and :class:`MGPUParallelStrategy` (process group and launch of the strategies that are
  not DDP);
* ``ddp.py``: :class:`MGPUDDPStrategy` (the DDP family);
* ``periodic.py``: :class:`MGPULocalSGDStrategy`, :class:`MGPUDiLoCoStrategy` (DDP's launch, weights synced every
  H steps instead of gradients every step);
* ``sharded.py``: :class:`MGPUShardedStrategy` (ZeRO stages 1-3, one class) and its checkpoints (the
  sharding backends they use are a part: ``lightning_mgpu/parts/sharding.py``);
* ``auto.py``: :class:`MGPUAutoStrategy`; ``launchers.py``: the launchers' checks and fork on CPU.
"""

from lightning_mgpu.strategies.auto import MGPUAutoStrategy
from lightning_mgpu.strategies.base import MGPUParallelStrategy, MGPUStrategyMixin
from lightning_mgpu.strategies.ddp import MGPUDDPStrategy
from lightning_mgpu.strategies.periodic import MGPUDiLoCoStrategy, MGPULocalSGDStrategy
from lightning_mgpu.strategies.sharded import MGPUShardedStrategy, ShardMemory

__all__ = [
    "MGPUAutoStrategy",
    "MGPUDDPStrategy",
    "MGPUDiLoCoStrategy",
    "MGPULocalSGDStrategy",
    "MGPUParallelStrategy",
    "MGPUShardedStrategy",
    "MGPUStrategyMixin",
    "ShardMemory",
]
