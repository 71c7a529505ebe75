"""Measure what the planner predicts: one real training step on CPU under torch's ``MemTracker`` (real tensors).

Used by the tests and ``benchmarks/bench_planner.py`` to check the plan. ``mgpu_ddp`` / ``mgpu_zero1`` are
measured in one process: ``gradient_as_bucket_view=True`` (mgpu_ddp's default) keeps every gradient allocated
in its bucket between steps, which ``zero_grad(set_to_none=False)`` reproduces without a process group. The
sharded stages are measured as rank 0 of a world of ``world_size`` in *this* process, on torch's fake process
group (``torch.testing._internal.distributed.fake_pg``: collectives allocate their outputs but move no data),
with the same ``fully_shard`` units as ``mgpu_sharded`` / ``mgpu_zero3`` and optimizer state sharded per
parameter (DTensor shards), which is what a gloo or NCCL rank holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_mgpu import comm
from lightning_mgpu._compat import fake_store, mem_tracker
from lightning_mgpu.mesh import ParallelDims
from lightning_mgpu.parts.sharding import fsdp_unit_roots
from lightning_mgpu.planning.trace import PRECISION_LAYOUT, ModelFactory, _loss, _optimizers, _quiet

__all__ = ["Measured", "fake_process_group", "measure_step"]


@dataclass(frozen=True)
class Measured:
    """Peak bytes of one rank during a real step, split as ``MemTracker`` attributes them at the peak."""

    peak_bytes: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    """Activations, temporaries and anything else allocated during the step (all-gathered FSDP parameters)."""


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """A default process group of ``world_size`` ranks in this process (torch's fake backend: no peers)."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; measure in a fresh one.")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        comm.destroy_group()


def _shard(module: nn.Module, stage: int) -> None:
    from torch.distributed.fsdp import fully_shard

    mesh = ParallelDims(world_size=dist.get_world_size()).build("cpu").data  # flat, as mgpu_sharded's
    for unit in reversed(fsdp_unit_roots(module)):  # innermost first, as mgpu_sharded does
        fully_shard(unit, mesh=mesh, reshard_after_forward=stage == 3)
    fully_shard(module, mesh=mesh, reshard_after_forward=stage == 3)


def measure_step(
    factory: ModelFactory, batch: Any, precision: str = "32-true", policy: Any = None, strategy: str = "mgpu_ddp"
) -> Measured:
    """Peak of a real second training step (the first creates the optimizer state) on this rank.

    ``strategy``: ``"mgpu_ddp"`` (one process), or ``"mgpu_zero1"``, ``"mgpu_sharded"``, ``"mgpu_zero3"`` inside
    :func:`fake_process_group`. Master-weight precisions are not measured (their step needs the strategy's
    precision plugin)."""
    from lightning_mgpu.parts.activation_checkpointing import apply_activation_checkpointing

    _, autocast, master = PRECISION_LAYOUT[precision]
    if master:
        raise ValueError(f"measure_step does not run {precision!r}: measure 32-true or a mixed precision.")
    torch.manual_seed(0)
    module = factory()
    module.train()
    if policy is not None:
        apply_activation_checkpointing(module, policy)
    sharded: Optional[int] = {"mgpu_sharded": 2, "mgpu_zero3": 3}.get(strategy)
    if sharded is not None:
        _shard(module, sharded)
    optimizers = _optimizers(module)
    if strategy == "mgpu_zero1":  # optimizer state split across the ranks, as mgpu_zero1 does
        from torch.distributed.optim import ZeroRedundancyOptimizer

        def zero(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
            import inspect

            accepted = inspect.signature(type(opt).__init__).parameters  # defaults may hold more (AdamW)
            kwargs = {k: v for k, v in opt.defaults.items() if k in accepted}
            params = [p for g in opt.param_groups for p in g["params"]]
            return ZeroRedundancyOptimizer(params, optimizer_class=type(opt), **kwargs)

        optimizers = [zero(opt) for opt in optimizers]

    def step() -> None:
        with torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext():
            loss = _loss(module, batch)
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=sharded is not None)  # bucket views keep DDP's gradients allocated

    with _quiet():
        step()
        tracker = mem_tracker()
        tracker.track_external(module, *(getattr(o, "optim", o) for o in optimizers))  # ZeRO's local optimizer
        with tracker:
            step()
    peak = {getattr(k, "name", k): v for k, v in next(iter(tracker.get_tracker_snapshot("peak").values())).items()}
    return Measured(
        peak_bytes=peak["Total"],
        parameters=peak["PARAM"] + peak["BUFFER"],
        gradients=peak["GRAD"],
        optimizer_state=peak["OPT"],
        activations=peak["ACT"] + peak["TEMP"] + peak["OTH"],
    )
