"""Strategy plugins. One strategy per module."""

from lightning_mgpu.strategies.ddp import MGPUDDPStrategy
from lightning_mgpu.strategies.sharded import MGPUShardedStrategy, ShardMemory

__all__ = ["MGPUDDPStrategy", "MGPUShardedStrategy", "ShardMemory"]
