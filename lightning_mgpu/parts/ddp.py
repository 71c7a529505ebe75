"""DDP wrapping: comm hooks on every device type, static graph switched on at the first synchronised
forward, and rank 0's buffers broadcast by hand where DDP's own forward is kept out of the step."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu import comm
from lightning_mgpu._compat import enable_static_graph
from lightning_mgpu.comm import Ledger, register_comm_hook
from lightning_mgpu.settings import DDPSettings


class DDPWrapping:
    """What the DDP family does to torch's ``DistributedDataParallel`` after Lightning built it.

    Example::

        wrapping = DDPWrapping(DDPSettings(comm_hook="fp16"))
        state = wrapping.register_hooks(ddp_model, ledger, manual=False)
    """

    def __init__(self, settings: DDPSettings) -> None:
        self.settings = settings

    def register_hooks(self, ddp: DistributedDataParallel, ledger: Ledger, manual: bool) -> Any:
        """Register the comm hook (Lightning registers hooks only when the device is CUDA; the torch hooks used
        here run on gloo too). Returns the hook's state (e.g. ``PowerSGDState``), or None.

        Plain all-reduce with bucket views is counted from the buckets, and manual optimization syncs outside
        DDP's reducer: neither needs a hook."""
        if self.settings.count_from_buckets or manual:
            return None
        return register_comm_hook(ddp, self.settings.comm_hook, self.settings.comm_state, ledger.stats)

    def before_training_step(self, ddp: DistributedDataParallel) -> None:
        """Static graph: switched on just before the first synchronised forward (see ``_compat``)."""
        if (
            self.settings.static_graph
            and not ddp.static_graph
            and ddp.require_backward_grad_sync
            and torch.is_grad_enabled()
        ):
            enable_static_graph(ddp)

    def broadcast_buffers(self, ddp: DistributedDataParallel, world_size: int) -> None:
        """What DDP does before a synchronised forward (``broadcast_buffers=True``, its default): rank 0's
        buffers (BatchNorm statistics) overwrite the others', one broadcast per dtype."""
        if self.settings.ddp_kwargs.get("broadcast_buffers", True) is False or world_size == 1:
            return
        by_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for b in ddp.module.buffers():
            by_dtype.setdefault((b.device, b.dtype), []).append(b)
        for buffers in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in buffers])
            comm.broadcast(flat, src=0, group=ddp.process_group)
            offset = 0
            for b in buffers:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()
