"""Precision adoption: the strategy turns Lightning's plugin into :class:`~lightning_mgpu.MGPUPrecision`, and
hands it what it needs through arguments (never by writing into it at run time)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from pytorch_lightning.plugins.precision import Precision
from torch import nn
from torch.optim import Optimizer

from lightning_mgpu.parts.clipping import GlobalNormClipping
from lightning_mgpu.precision import MGPUPrecision, adopt


class PrecisionAdoption:
    """Example::

    part = PrecisionAdoption()
    plugin = part.adopt(Precision())           # MGPUPrecision("32-true")
    part.check(plugin, [torch.device("cpu")])  # before launch
    """

    @staticmethod
    def adopt(plugin: Optional[Precision]) -> Optional[Precision]:
        # precision="16-mixed"/"bf16-mixed" -> MGPUPrecision: overflow agreed across ranks, counted and logged
        return adopt(plugin)

    @staticmethod
    def check(plugin: Optional[Precision], devices: Optional[list[torch.device]]) -> None:
        if isinstance(plugin, MGPUPrecision) and devices:
            plugin.check(devices[0].type)

    @staticmethod
    def attach_masters(plugin: Precision, optimizers: list[Optimizer]) -> None:
        """Before any wrapper (ZeroRedundancyOptimizer) is built around the optimizers."""
        if isinstance(plugin, MGPUPrecision):
            plugin.attach_master_weights(optimizers)

    @staticmethod
    def model_parameter(plugin: Precision) -> Callable[[torch.Tensor], torch.Tensor]:
        """Optimizer parameter -> the parameter backward writes the gradient of (master modes: the half one)."""
        if isinstance(plugin, MGPUPrecision):
            return plugin.model_parameter
        return lambda p: p

    @staticmethod
    def connect_gradient_sync(plugin: Precision, sync: Optional[Callable[[Optimizer], None]]) -> None:
        """Manual optimization: the plugin calls ``sync`` before it moves or clips an optimizer's gradients."""
        if isinstance(plugin, MGPUPrecision):
            plugin.use_gradient_sync(sync)

    @staticmethod
    def connect_norm_clipping(plugin: Precision, clipping: Optional[GlobalNormClipping]) -> None:
        """Sharded gradients: norm clipping by the norm over all ranks (``None``: the local norm is global)."""
        if isinstance(plugin, MGPUPrecision):
            plugin.use_norm_clipping(clipping)

    @staticmethod
    def with_masters(plugin: Precision, module: Optional[nn.Module], state: dict[str, Any]) -> dict[str, Any]:
        """The module's state as saved: master modes put their FP32 masters in place of the half weights."""
        if isinstance(plugin, MGPUPrecision) and module is not None:
            return plugin.fp32_state_dict(module, state)
        return state

    @staticmethod
    def load_masters(plugin: Precision, module: Optional[nn.Module], checkpoint: Mapping[str, Any]) -> None:
        # masters that exist already (a restore after set-up: sharded strategies, LearningRateFinder, a second
        # fit) take the checkpoint's FP32 values; otherwise the next step would copy stale ones back
        state = checkpoint.get("state_dict")
        if isinstance(plugin, MGPUPrecision) and module is not None and state is not None:
            plugin.load_masters(module, state)
