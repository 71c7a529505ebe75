"""ZeRO stage 1: mgpu_ddp's DistributedDataParallel (comm hooks, ledger, accumulation without extra syncs) with the
optimizer state sharded across ranks (torch ``ZeroRedundancyOptimizer`` or fairscale ``OSS``).

Users write ``MGPUShardedStrategy(stage=1)`` or ``strategy="mgpu_zero1"``; this is the class they get.

Example::

    strategy = MGPUShardedStrategy(stage=1, comm_hook="fp16")
    assert isinstance(strategy, (MGPUShardedStrategy, MGPUDDPStrategy))
"""

from __future__ import annotations

from typing_extensions import override

from lightning_mgpu.strategies.ddp import MGPUDDPStrategy
from lightning_mgpu.strategies.sharded import MGPUShardedStrategy


class MGPUZeRO1Strategy(MGPUShardedStrategy, MGPUDDPStrategy):  # type: ignore[misc]  # `settings`: the sharded ones
    """Stage 1 of :class:`~lightning_mgpu.MGPUShardedStrategy`: DDP plus a sharded optimizer. The sharded
    strategy's checkpoint and optimizer handling comes first in the MRO, DDP's training loop after it."""

    _takes_ddp_keywords = True

    @override
    def _find_unused_parameters_fix(self) -> str:
        return "strategy=MGPUShardedStrategy(stage=1, find_unused_parameters=True)"
