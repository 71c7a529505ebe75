"""Activation checkpointing as a part: checked against the model before launch, applied before the model is
wrapped (DDP) or sharded (FSDP: its hooks stay outside the recompute), removed at teardown."""

from __future__ import annotations

from typing import Optional

from torch import nn

from lightning_mgpu.checkpointing import (
    ActivationCheckpointingPolicy,
    apply_activation_checkpointing,
    remove_activation_checkpointing,
    select_modules,
)


class ActivationCheckpointing:
    """Example::

    part = ActivationCheckpointing("Block", reentrant=False)
    part.check(module)   # before launch: a policy that matches nothing raises
    part.apply(module)   # before DDP / fully_shard
    part.remove(module)  # teardown: the user's module back unchanged
    """

    def __init__(self, policy: Optional[ActivationCheckpointingPolicy], reentrant: bool = False) -> None:
        self.policy = policy
        self.reentrant = reentrant

    def check(self, module: nn.Module) -> None:
        if self.policy is not None:
            select_modules(module, self.policy)

    def apply(self, module: Optional[nn.Module]) -> None:
        # Order (torchtitan's parallelize): SyncBatchNorm conversion (Lightning's layer sync, done before the
        # wrapping) -> activation checkpointing -> DDP / sharding. Checkpointing patches the blocks' forward in
        # place, so DDP/FSDP see the same module tree and state-dict keys as without it.
        if self.policy is not None and module is not None:
            apply_activation_checkpointing(module, self.policy, use_reentrant=self.reentrant)

    def remove(self, module: Optional[nn.Module]) -> None:
        if self.policy is not None and module is not None:
            remove_activation_checkpointing(module)
