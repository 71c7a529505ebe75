"""Gradient-sync control for accumulation: a context manager that skips the gradient collective of the
backward passes inside it (STYLE.md rule 7; Fabric's ``_DDPBackwardSyncControl`` is the model).

It does nothing when ``enabled`` is False, and raises ``TypeError`` when the module is not the wrapper it
controls, instead of silently syncing every micro-batch. Never flip a wrapper's private flags by hand.

Example::

    control = DDPSyncControl()
    with control.no_backward_sync(ddp_model, enabled=not last_micro_batch):
        loss.backward()
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from contextlib import AbstractContextManager

from torch import nn
from torch.nn.parallel import DistributedDataParallel


class BackwardSyncControl:
    """Base: skip the gradient sync of the backward passes run inside :meth:`no_backward_sync`."""

    wrapper = "a data-parallel wrapper"

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return contextlib.nullcontext()
        if not self.controls(module):
            raise TypeError(
                f"Blocking the gradient sync needs the model wrapped in {self.wrapper}, got {type(module).__name__}. "
                f"The strategy's setup wraps it; call this only on the model the strategy trains."
            )
        return self._block(module)

    def controls(self, module: nn.Module) -> bool:
        raise NotImplementedError

    def _block(self, module: nn.Module) -> AbstractContextManager:
        raise NotImplementedError


class DDPSyncControl(BackwardSyncControl):
    """torch ``DistributedDataParallel``: its ``no_sync()`` (the reducer skips the all-reduce)."""

    wrapper = "torch's DistributedDataParallel"

    def controls(self, module: nn.Module) -> bool:
        return isinstance(module, DistributedDataParallel)

    def _block(self, module: nn.Module) -> AbstractContextManager:
        assert isinstance(module, DistributedDataParallel)
        return module.no_sync()


class FSDP2SyncControl(BackwardSyncControl):
    """torch FSDP2 (``fully_shard``): ``set_requires_gradient_sync(False)`` for the root and every unit."""

    wrapper = "torch FSDP2 (fully_shard)"

    def controls(self, module: nn.Module) -> bool:
        from torch.distributed.fsdp import FSDPModule

        return isinstance(module, FSDPModule)

    @contextlib.contextmanager
    def _block(self, module: nn.Module) -> Generator[None, None, None]:
        module.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)  # type: ignore[operator]


class ShardedDDPSyncControl(BackwardSyncControl):
    """fairscale ``ShardedDataParallel``: its ``no_sync()``."""

    wrapper = "fairscale's ShardedDataParallel"

    def controls(self, module: nn.Module) -> bool:
        from fairscale.nn.data_parallel import ShardedDataParallel

        return isinstance(module, ShardedDataParallel)

    def _block(self, module: nn.Module) -> AbstractContextManager:
        return module.no_sync()  # type: ignore[operator]
