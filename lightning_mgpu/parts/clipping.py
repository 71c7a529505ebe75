"""Gradient-norm clipping by the norm over all parameters of all ranks, where each rank holds only a share.

Lightning's ``clip_gradients(..., "norm")`` computes ``torch.nn.utils.clip_grad_norm_`` over the gradients this
process holds. Under DDP and ZeRO stage 1 every rank holds the whole averaged gradient, so that norm is already
the global one and nothing is added. Where gradients are sharded it is not: fairscale's
``ShardedDataParallel`` leaves each rank the gradients of the parameters it owns, so a local norm would clip
each rank's shard by its own norm (the ranks still agree with each other; the weights are silently wrong).
FSDP2's ``DTensor`` gradients would be reduced by torch's own ``clip_grad_norm_``, but in several collectives;
here every sharded stage and backend takes the same path: the squared norm of the local share, **one** scalar
all-reduce (counted in the ledger: 1 call, 8 bytes, per clipped optimizer step), then every local share scaled
by ``max_norm / (total + 1e-6)`` clamped at 1, as ``clip_grad_norm_`` does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mgpu import comm
from lightning_mgpu.ledger import CommStats

#: optimizer -> the parameters whose gradients this rank holds a distinct share of
ShareOf = Callable[[Optimizer], list[Tensor]]


@dataclass(eq=False)  # compared as objects, as before: one per strategy
class GlobalNormClipping:
    """Clip by the global gradient norm when each rank holds a distinct share of the gradients.

    Args:
        share_of: the parameters of an optimizer whose gradient shares this rank holds (FSDP2: every
            parameter, each a ``DTensor`` shard; fairscale stage 2: the parameters this rank's ``OSS`` owns).
        group: the process group (``None``: the default group).
        ledger: counts the scalar all-reduce.
        weight_copies: ``DTensor`` gradients replicated over some dimensions of their mesh (the replicas of a
            hybrid mesh, the tensor-parallel ranks of a layer that is not split) add ``1 / copies`` of their squared
            norm on each rank, so that the sum over all ranks of ``group`` counts each element once.
        replicated: the parameters of an optimizer whose whole gradient every rank of ``group`` holds (the
            pipeline's parameters outside the stages' blocks): scaled on every rank, counted in the norm once
            (where ``count_replicated``, on one rank of the group).
        norm_dtype: the dtype of the squared norm's all-reduce, where a rank may hold no gradient (the same on
            every rank); None: float64 if any local gradient is, else float32.
        copies: each gradient's number of ranks of ``group`` holding its values, where the group's size does not
            give it (the pipeline's stages hold different parameters: :func:`copies_among` over a stage's ranks);
            each adds ``1 / copies`` of its squared norm. Takes the place of ``weight_copies``.

    Example::

        clipping = GlobalNormClipping(lambda opt: [p for g in opt.param_groups for p in g["params"]])
        total = clipping.clip(optimizer, max_norm=1.0)  # the pre-clip norm over all ranks
    """

    share_of: ShareOf
    group: Any = None
    ledger: Optional[CommStats] = None
    replicated: Optional[ShareOf] = None
    count_replicated: bool = True
    norm_dtype: Optional[torch.dtype] = None
    weight_copies: bool = False
    copies: Optional[Callable[[Tensor], int]] = None

    def total_norm(self, grads: Iterable[Tensor]) -> Tensor:
        """The L2 norm over every rank's shares (a collective: call it on every rank)."""
        grads = list(grads)
        local = [comm.local_shard(g) for g in grads]
        dtype = self.norm_dtype or (torch.float64 if any(g.dtype == torch.float64 for g in local) else torch.float32)
        # a rank holding no share still joins the all-reduce, with a zero on the group's collective device
        device = local[0].device if local else comm.collective_device(self.group)
        squared = torch.zeros((), dtype=dtype, device=device)
        ranks = torch.distributed.get_world_size(self.group) if self.weight_copies and comm.group_is_up() else 1
        for g, shard in zip(grads, local):
            norm = torch.linalg.vector_norm(shard, dtype=dtype) ** 2
            if self.copies is not None:
                norm = norm / self.copies(g)
            elif self.weight_copies:
                norm = norm / copies_among(g, ranks)
            squared += norm
        if comm.group_is_up():
            comm.all_reduce(squared, group=self.group, ledger=self.ledger)
        return squared.sqrt()

    def clip(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        """Scale this rank's gradient shares so that the global norm is at most ``max_norm``; returns the
        pre-clip global norm."""
        grads = [p.grad for p in self.share_of(optimizer) if p.grad is not None]
        whole = [p.grad for p in self.replicated(optimizer) if p.grad is not None] if self.replicated else []
        total = self.total_norm(grads + whole if self.count_replicated else grads)
        grads += whole
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for g in grads:
                local = comm.local_shard(g)
                local.mul_(coef.to(local.dtype))
        return total


def copies_among(grad: Tensor, ranks: int, plain: int = 1) -> int:
    """How many of ``ranks`` ranks, which all hold ``grad``'s parameter, hold the same values of ``grad``: for a
    ``DTensor``, ``ranks`` over its distinct pieces (the product of its mesh's sizes over the placements that
    neither replicate nor hold partial sums: ``Shard``, and the strided shard FSDP2 puts over the data dimension of
    a tensor-parallel weight), so that the replicas of a hybrid mesh, the tensor-parallel ranks of a layer that is
    not split, and the ranks outside its mesh count as copies; ``plain`` for a plain tensor (1 where each rank's
    tensor is a distinct share, ``ranks`` where every rank holds it whole).

    Example:

        >>> import torch
        >>> copies_among(torch.zeros(3), ranks=4), copies_among(torch.zeros(3), ranks=4, plain=4)
        (1, 4)
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(grad, DTensor):
        return plain
    mesh = grad.device_mesh
    distinct = math.prod(
        mesh.size(d) for d, p in enumerate(grad.placements) if not (p.is_replicate() or p.is_partial())
    )
    return max(ranks // distinct, 1)
