"""Callbacks: :class:`DeviceMonitor` (what every rank is doing) and :class:`ScaleLR` (LR follows the effective
batch size)."""

from lightning_mgpu.callbacks.device_monitor import DeviceMonitor
from lightning_mgpu.callbacks.scale_lr import ScaleLR

__all__ = ["DeviceMonitor", "ScaleLR"]
