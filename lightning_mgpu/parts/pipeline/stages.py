"""What ``torch.distributed.pipelining`` runs for each stage: the module of a stage (the user's ``training_step`` hooked
to the stage's blocks, :meth:`~lightning_mgpu.parts.pipeline.runner.StageRunner.run_stage`), its ``PipelineStage`` that
times it and keeps a sharded stage's gradients for one reduce-scatter per optimizer step, the loss whose backward
hands the schedule's gradients to Lightning's closure, and the per-gradient rules (a gradient as its parameter's
``DTensor``, the elements the data dimension shards, its copies among ranks) that the backend's sync and clipping
use."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Generator
from typing import Any, Callable, cast

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage

from lightning_mgpu.mesh import TENSOR_PARALLEL
from lightning_mgpu.parts.accumulation import BackwardSyncControl
from lightning_mgpu.parts.clipping import copies_among


class _StageOutput(Exception):
    """Raised by the hook after a stage's last block: the forward of this stage ends there."""

    def __init__(self, output: Tensor) -> None:
        super().__init__("pipeline stage output")
        self.output = output


def _like(param: Tensor, local: Tensor) -> Tensor:
    """``local`` as ``param``'s gradient: a ``DTensor`` of ``param``'s mesh and placements where ``param`` is one
    (tensor parallelism), else ``local`` itself."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _over_data(param: Tensor) -> int:
    """The elements of ``param`` the data dimension shards (``stage=3``): all of them, or this rank's tensor shard
    of them where the tensor-parallel plan splits ``param`` (a ``DTensor`` sharded over the ``tensor_parallel``
    dimension of its mesh; its data dimensions, flat or HSDP's two, do not count)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.numel()
    names = param.device_mesh.mesh_dim_names or ()
    split = math.prod(
        param.device_mesh.size(d)
        for d, p in enumerate(param.placements)
        if not (p.is_replicate() or p.is_partial()) and (names[d] if d < len(names) else None) == TENSOR_PARALLEL
    )
    return param.numel() // split


def _copies_over(ranks: int, replicas: int) -> Callable[[Tensor], int]:
    """Each gradient's copies over every rank where the ``ranks`` that hold its parameter (its tensor group with
    tensor parallelism, its stage's data x tensor ranks at ``stage=3``) may hold copies of it
    (:func:`~lightning_mgpu.parts.clipping.copies_among`, a plain tensor whole on each of them), times the
    ``replicas`` that hold equal gradients after the sync."""
    return lambda grad: copies_among(grad, ranks, plain=ranks) * replicas


class _ChunkedStage(PipelineStage):
    """``PipelineStage`` that tells its module (a :class:`_Stage`) which micro-batch it runs, and times its
    computation (the schedule waits for the received tensors before calling these)."""

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        runner = cast(_Stage, self.submod)
        runner.chunk = fwd_chunk_id
        with runner.timed():
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with cast(_Stage, self.submod).timed():
            return super().backward_one_chunk(*args, **kwargs)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """The schedule's end of one step. A stage sharded with FSDP2 (``stage=3``) keeps its gradients unsharded
        and unreduced here: they are reduce-scattered once per optimizer step, by :meth:`reduce_now` from
        :meth:`PipelineBackend.sync_gradients`, not once per ``accumulate_grad_batches`` micro-step."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(self.submod, FSDPModule):
            super().perform_reduce_grad(grad_scale_factor)

    def reduce_now(self) -> None:
        """Reduce-scatter the stage's accumulated gradients over the data dimension (FSDP2's post-backward, as the
        schedule's own end of step does it), and reshard its parameters."""
        super().perform_reduce_grad(1)


class _PendingGradients(torch.autograd.Function):
    """The loss Lightning's closure backpropagates: its backward adds the schedule's gradients."""

    @staticmethod
    def forward(ctx: Any, loss: Tensor, runner: Any) -> Tensor:  # the StageRunner
        ctx.runner = runner
        return loss.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None]:
        ctx.runner.add_pending(grad)
        return None, None


class PipelineSyncControl(BackwardSyncControl):
    """Nothing to block: the pipeline's gradients are synced once per optimizer step, after the closure
    (:meth:`PipelineBackend.sync_gradients`), never inside a backward."""

    wrapper = "the pipeline (no wrapper)"

    def controls(self, module: nn.Module) -> bool:
        return True

    def _block(self, module: nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class _Stage(nn.Module):
    """What ``PipelineStage`` runs for stage ``index``: the user's ``training_step`` on the micro-batch, hooked to
    this stage's blocks (:meth:`StageRunner.run_stage`)."""

    def __init__(self, runner: Any, index: int, blocks: list[nn.Module]) -> None:  # the StageRunner
        super().__init__()
        self.index = index
        self.blocks = nn.ModuleList(blocks)
        self._runner = [runner]  # not a submodule
        self.chunk = 0

    def forward(self, *args: Tensor) -> Tensor:
        return self._runner[0].run_stage(self.index, self.chunk, args[0])

    @contextlib.contextmanager
    def timed(self) -> Generator[None, None, None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._runner[0].busy_s += time.perf_counter() - start
