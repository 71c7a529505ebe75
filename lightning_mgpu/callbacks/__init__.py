"""Callbacks: :class:`DeviceMonitor` (what every rank is doing), :class:`ScaleLR` (LR follows the effective
batch size) and :class:`EMA` (a moving average of the weights, each rank of its own shard)."""

from lightning_mgpu.callbacks.device_monitor import DeviceMonitor
from lightning_mgpu.callbacks.ema import EMA
from lightning_mgpu.callbacks.scale_lr import ScaleLR

__all__ = ["EMA", "DeviceMonitor", "ScaleLR"]
