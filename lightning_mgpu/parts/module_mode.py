"""The training wrapper follows the LightningModule's train/eval mode.

Lightning's evaluation loop puts ``trainer.model`` (the wrapper) in eval mode and, afterwards, restores the
mode of the *LightningModule* only (``_ModuleMode`` in its evaluation loop); the wrapper stays in eval mode.
fairscale's ``ShardedDataParallel`` registers its gradient hooks only while ``self.training`` is true, so after
any validation during fit (the default sanity check is enough) nothing would be reduced and every rank would
step its shard with its local gradient.
"""

from __future__ import annotations

from typing import Optional

from torch import nn


def follow_module_mode(wrapper: Optional[nn.Module], module: Optional[nn.Module]) -> None:
    """Set the wrapper's own ``training`` flag to the module's (not recursively: submodules a user switched to
    eval mode on purpose, e.g. frozen BatchNorm layers, keep their mode).

    Example::

        follow_module_mode(strategy.model, strategy.lightning_module)  # before each training step
    """
    if wrapper is None or module is None or wrapper is module:
        return
    if wrapper.training != module.training:
        wrapper.training = module.training
