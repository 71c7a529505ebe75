"""Strategy plugins. One strategy per module."""

from lightning_mgpu.strategies.ddp import MGPUDDPStrategy

__all__ = ["MGPUDDPStrategy"]
