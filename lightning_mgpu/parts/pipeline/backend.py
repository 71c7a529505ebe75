"""``PipelineBackend``: the sharded strategy's backend with ``pipeline_parallel_size > 1`` (the package's docstring,
``parts/pipeline/__init__.py``, says what it does): the stages built over the mesh, the schedule's step, the gradient
sync across replicas and stages, the clipping, evaluation through the stages, the blocks freed and gathered, and the
whole model's states for checkpoints."""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Generator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, cast

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.optim import Optimizer

from lightning_mgpu import _compat, comm
from lightning_mgpu.ledger import CommStats
from lightning_mgpu.mesh import DATA_PARALLEL, PIPELINE, ParallelDims, ParallelMesh
from lightning_mgpu.parts.clipping import GlobalNormClipping
from lightning_mgpu.parts.pipeline.batches import (
    _fingerprint,
    _first_tensor,
    _leaves,
    _to_device,
    check_loader_batches,
    combine_logs,
    split_batch,
)
from lightning_mgpu.parts.pipeline.plan import (
    SHAPE_NEEDED,
    PipelineError,
    StagePlan,
    check_stage_count,
    master_precision_refusal,
)
from lightning_mgpu.parts.pipeline.stages import (
    PipelineSyncControl,
    _ChunkedStage,
    _copies_over,
    _like,
    _over_data,
    _PendingGradients,
    _Stage,
    _StageOutput,
)
from lightning_mgpu.parts.sharding import ShardingBackend, optimizer_params
from lightning_mgpu.parts.token_loss import TokenNormalization


@dataclass(frozen=True)
class PipelineStats:
    """One pipeline step of this rank (``trainer.strategy.pipeline_stats()``): the bytes it sent to other stages
    (activations forward, their gradients backward, from their shapes), and the measured bubble (the fraction of the
    schedule's wall time this rank's stages did not compute) beside the formula, ``(P - 1) / (m + P - 1)`` for
    GPipe and 1F1B, divided by the stages per rank for interleaved 1F1B."""

    stages: int
    stages_per_rank: int
    microbatches: int
    bytes_sent: int
    bubble: float
    bubble_theory: float


class PipelineBackend(ShardingBackend):
    """The sharded strategy's backend with ``pipeline_parallel_size > 1`` (see the module docstring): the stages,
    their schedule, the gradient sync across the data replicas, the global-norm clipping across stages, the
    forward-only evaluation through the stages, and the whole model gathered for checkpoints.

    ``size``: the pipeline stages' ranks (P); ``schedule``: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``;
    ``microbatches``: m (None: the number of stages); ``split``: module names or ``"auto"``; ``token_loss``:
    ``loss_normalization="tokens"`` (the micro-batches' loss sums added, their token counts returned);
    ``shard_stage``: 2 (whole replicas of each stage in the data dimension) or 3 (each stage's blocks sharded over
    it with FSDP2)."""

    sync_control = PipelineSyncControl()

    def __init__(
        self,
        size: int,
        schedule: str,
        microbatches: Optional[int],
        split: Any,
        token_loss: bool = False,
        shard_stage: int = 2,
    ) -> None:
        super().__init__(stage=shard_stage)
        self.size = size
        self.token_loss = token_loss
        self.schedule_name = schedule
        self.split = split
        self.stages = size * (2 if schedule == "interleaved_1f1b" and split == "auto" else 1)
        if split != "auto":
            self.stages = len(split) + 1
        self.microbatches = microbatches if microbatches is not None else self.stages
        self.plan: Optional[StagePlan] = None
        self.module: Optional[nn.Module] = None
        self.dims: Optional[ParallelDims] = None
        self.rank = 0
        self.pipeline_index = 0
        self.pipeline_group: Any = None
        self.data_group: Any = None
        self.ledger: Optional[CommStats] = None
        self._blocks: list[nn.Module] = []
        self._local: list[int] = []  # the stage indices this rank runs
        self._schedules: dict[Any, Any] = {}
        self._micro: list[Any] = []
        self._step_batch_index = 0
        self._logged: dict[int, list[tuple[str, Any, dict[str, Any]]]] = {}
        self._losses: dict[int, Tensor] = {}
        self._tokens: dict[int, float] = {}  # token_loss: each micro-batch's num_tokens (the last stage's)
        self._scale = 1.0
        self._pending: list[tuple[nn.Parameter, Tensor]] = []
        self._stale = False  # the stages trained since the blocks were last gathered
        self._loader_checked = False  # the training loader's batch sizes, once per fit
        self._freed: list[tuple[Tensor, torch.Size]] = []  # the freed tensors, with their shapes
        self._held_optimizers: list[Optimizer] = []
        self._boundaries: dict[Any, list[tuple[torch.Size, torch.dtype]]] = {}
        self._loss_meta: dict[Any, tuple[torch.Size, torch.dtype]] = {}
        self._tuple_outputs: dict[int, int] = {}
        self._sends = (0, 0)  # (sends, bytes) of one step of this rank, from the boundary shapes
        self.busy_s = 0.0  # time in the stages' forward and backward computation during the last step
        self.last_stats: Optional[PipelineStats] = None
        self._whole_for_evaluation = False  # an evaluation loop whose ranks may run different numbers of batches
        # stage=3: each local stage's blocks one FSDP2 unit over the data dimension (the PipelineStage's submodule)
        self._sharded_stages: dict[int, _Stage] = {}
        self._stage_objects: dict[int, _ChunkedStage] = {}  # the latest PipelineStage of each local stage
        self._sharded_params: list[Tensor] = []  # the sharded (DTensor) parameters the optimizer holds
        self._unsharded = False  # the sharded stages gathered whole (by _unshard_stages)
        self._grad_scale: Optional[Tensor] = None  # what flowed into the step's loss (1 / k, x the loss scale)
        self._loss_scale = 1.0  # the fp16 loss scale the schedule's backward starts from (use_loss_scale)

    # --- after a spawn/fork launch -------------------------------------------------------------------------
    def results_for_main_process(self) -> Optional[dict[str, Any]]:
        """In rank 0's worker after the call: its last step's stats, for the main process's strategy (a dict:
        Lightning moves the results with ``apply_to_collection``, which refuses frozen dataclasses)."""
        return asdict(self.last_stats) if self.last_stats is not None else None

    def restore_results_from_worker(self, state: Optional[dict[str, Any]]) -> None:
        """In the main process: rank 0's last step (``trainer.strategy.pipeline_stats()`` after ``fit``)."""
        self.last_stats = PipelineStats(**state) if state is not None else None

    # --- before launch ------------------------------------------------------------------------------------
    def check_model(
        self,
        module: nn.Module,
        precision_plugin: Any,
        clip_by_norm: bool,
        callbacks: Sequence[Any] = (),
        trainable_only: bool = False,
    ) -> None:
        """Before any process starts: the split against the model, the clipping against the precision plugin, the
        callbacks that need every weight on every rank, an adapter-only checkpoint (``trainable_only``: what
        ``checkpoint_params`` makes of this model) (the sizes against the world size: the settings, at Trainer
        construction)."""
        averaging = [
            type(c).__name__
            for c in callbacks
            # Lightning's averaging callbacks, and the pack's EMA (lightning_mgpu.callbacks.ema, by name: parts do not
            # import callbacks), which averages what each rank holds and would average freed blocks
            if {k.__name__ for k in type(c).__mro__} & {"WeightAveraging", "StochasticWeightAveraging", "EMA"}
        ]
        if averaging:
            raise PipelineError(
                f"{averaging[0]} under pipeline parallelism: during training each rank holds only the blocks of its "
                f"own stages, and the callback averages every weight of the model on every rank. Remove "
                f"{averaging[0]} from the Trainer's callbacks, or train without pipeline_parallel_size: the pack's "
                f"EMA averages each rank's shard under strategy='mgpu_zero3' and under tensor_parallel_size."
            )
        if trainable_only:
            raise PipelineError(
                "checkpoint_params='trainable' (or 'auto' with most parameters frozen) under pipeline parallelism: "
                "during training each rank holds only the blocks of its own stages, and an adapter-only checkpoint "
                "records the frozen base (each frozen parameter's shape and first row) from global rank 0, which "
                "no longer holds the other stages' blocks: the checkpoint would not load back onto the same base. "
                "Use checkpoint_params='all' (a full checkpoint, which resumes under pipeline parallelism), or "
                "train the adapters without pipeline_parallel_size (strategy='mgpu_zero3', or tensor_parallel_size "
                "for a model the plan splits)."
            )
        plan = check_stage_count(module, self.split, self.stages)
        blocks = len(plan.names)
        if blocks < self.stages:
            raise PipelineError(f"{self.stages} stages but only {blocks} blocks in {plan.container!r}.")
        self._check_master_precision(precision_plugin)
        if self.stage == 3:
            self._check_shardable(module, plan)
        if clip_by_norm and not hasattr(precision_plugin, "use_norm_clipping"):
            raise PipelineError(
                f"gradient_clip_val by norm with {type(precision_plugin).__name__} under pipeline parallelism: each "
                f"stage holds the gradients of its own blocks, and only MGPUPrecision clips them by the norm over "
                f"all stages. Use precision='32-true' (a float64 model: call .double() on it), '16-mixed' or "
                f"'bf16-mixed', or gradient_clip_algorithm='value'."
            )

    def _check_master_precision(self, precision_plugin: Any) -> None:
        """MGPUPrecision's master modes are refused (not built yet), with the fix."""
        if getattr(precision_plugin, "master", False):
            raise PipelineError(master_precision_refusal(precision_plugin.mode, self.size))

    def _check_shardable(self, module: nn.Module, plan: StagePlan) -> None:
        """``stage=3``: FSDP2 shards each stage's blocks; refuse what it cannot shard, with the fix."""
        users: dict[int, list[str]] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            users.setdefault(id(param), []).append(name)
        for name, param in module.named_parameters(remove_duplicate=False):
            inside = [b for b in plan.names if name.startswith(b + ".")]
            if not inside:
                continue
            outside = [n for n in users[id(param)] if not n.startswith(inside[0] + ".")]
            if outside:
                raise PipelineError(
                    f"{name} is tied to {outside[0]} (one parameter used in block {inside[0]!r} and outside it): "
                    f"stage=3 shards each stage's blocks over the data dimension, and a parameter shared with "
                    f"another block or outside the blocks cannot be sharded with them. Untie them, or use stage=2 "
                    f"(whole replicas of each stage)."
                )

    # --- set-up -------------------------------------------------------------------------------------------
    def shard_mesh(self, mesh: ParallelMesh) -> Any:
        return mesh

    def shard_model(self, module: nn.Module, mesh: Any, mp_policy: Any = None) -> Optional[nn.Module]:
        parallel: ParallelMesh = mesh
        self.dims = parallel.dims
        self.rank = torch.distributed.get_rank()
        self.pipeline_index = self.dims.coordinates(self.rank)[PIPELINE]
        self.pipeline_group = parallel.device_mesh[PIPELINE].get_group()
        self.data_group = parallel.device_mesh[DATA_PARALLEL].get_group() if self.dims.data_parallel > 1 else None
        self.module = module
        self.plan = check_stage_count(module, self.split, self.stages)
        modules = dict(module.named_modules())
        self._blocks = [modules[n] for n in self.plan.names]
        self._local = [s for s in range(self.stages) if s % self.size == self.pipeline_index]
        self._schedules.clear()
        if self.stage == 3:
            self._shard_stages(parallel)
        self._stale = False
        self._loader_checked = False
        self._held_optimizers = []  # (the freed tensors' shapes stay: a fit that ended in an error leaves them freed)
        return None

    def wrap_optimizer(self, optimizer: Optimizer, group: Any) -> Optimizer:
        self._held_optimizers.append(optimizer)  # its state for the freed blocks is dropped (a loaded checkpoint's)
        return optimizer

    def norm_clipping(self, group: Any, ledger: CommStats) -> Optional[GlobalNormClipping]:
        """Clipping by the norm over every stage, one rule for every layout inside the pipeline: each rank sums the
        squares of the gradients it trains, each weighted by ``1 / (the ranks holding the same values)``, and of the
        weights outside the blocks on the first stage only; the sum is all-reduced (in float64: a stage may hold no
        gradient, and every rank must add the same dtype). Who holds the same values:

        * ``stage=3`` (with HSDP or tensor parallelism too): a gradient's copies among its stage's data x tensor
          ranks (:func:`~lightning_mgpu.parts.clipping.copies_among`: 1 for a block's weight sharded over flat data,
          HSDP's replicas for one sharded within a shard group, the tensor size for a layer the plan leaves whole, data
          x tensor over the plan's split for the weights outside the blocks), over all ranks;
        * tensor parallelism with whole replicas of each stage: its copies in the tensor group (a layer the plan does
          not split, a row-wise layer's bias) times the data replicas (equal after the sync), over all ranks;
        * neither: whole gradients, equal on the data replicas, so the pipeline's own ranks hold the norm (the sum
          over the pipeline group alone, no weighting)."""
        self.ledger = ledger
        data, tensor = (self.dims.data_parallel, self.dims.tensor) if self.dims is not None else (1, 1)
        copies: Optional[Callable[[Tensor], int]] = None
        if self._sharded_stages:
            group, copies = None, _copies_over(data * tensor, 1)  # copies among the stage's ranks
        elif tensor > 1:
            group, copies = None, _copies_over(tensor, data)
        else:
            group = self.pipeline_group
        owned = {id(p) for p in self._owned_params()}  # the optimizer's DTensors at stage=3
        shared = {id(p) for p in self._shared_params()}
        return GlobalNormClipping(
            lambda opt: [p for p in optimizer_params(opt) if id(p) in owned],
            group,
            ledger,
            replicated=lambda opt: [p for p in optimizer_params(opt) if id(p) in shared],
            count_replicated=self.pipeline_index == 0,
            norm_dtype=torch.float64,
            copies=copies,
        )

    # --- stage=3: ZeRO-3 over the data dimension, each local stage one FSDP2 unit -----------------------------
    def _shard_stages(self, parallel: ParallelMesh) -> None:
        """Shard the blocks of each of this rank's stages with FSDP2 (``fully_shard``) over the data dimension of
        the mesh, as one unit: the ``PipelineStage``'s submodule, whose first forward of an optimizer step (the
        stage) gathers them and whose reduce-scatter at the step's end frees them again; the other stages' blocks
        and the parameters outside the blocks stay plain tensors (those outside replicated on every rank)."""
        from torch.distributed.fsdp import fully_shard

        from lightning_mgpu.parts.tensor_parallel import fsdp_dim

        for s in self._local:
            if s not in self._sharded_stages:  # a second fit in the same process keeps its units
                runner = _Stage(self, s, self._stage_blocks(s))
                # gathered at the step's first forward and kept until its reduce-scatter (torchtitan's choice
                # with a pipeline): the gradients are whole for the step anyway; one all-gather per step, not two
                # per micro-batch
                fully_shard(runner, mesh=parallel.data, reshard_after_forward=False, shard_placement_fn=fsdp_dim)
                self._sharded_stages[s] = runner
        self._sharded_params = [
            p for s in self._local for b in self._stage_blocks(s) for p in b.parameters() if p.requires_grad
        ]

    def _step_params(self, module: nn.Module) -> list[nn.Parameter]:
        """The parameters whose gradients a training step holds aside while the schedule runs (see
        :meth:`training_step`): all that train, but the sharded stages' (FSDP2 accumulates those itself, unsharded,
        until :meth:`sync_gradients`)."""
        sharded = {id(p) for s in self._sharded_stages for b in self._stage_blocks(s) for p in b.parameters()}
        return [p for p in module.parameters() if p.requires_grad and id(p) not in sharded]

    def _unshard_stages(self) -> None:
        """Gather this rank's sharded stages whole (an all-gather over the data dimension): their blocks then hold
        plain tensors, for a forward outside the schedule (the probe, evaluation) and for :meth:`gather_blocks`."""
        if self._sharded_stages and not self._unsharded:
            for s in sorted(self._sharded_stages):
                self._sharded_stages[s].unshard()  # type: ignore[operator]
            self._unsharded = True

    def _reshard_stages(self) -> None:
        if self._unsharded:
            for s in sorted(self._sharded_stages):
                self._sharded_stages[s].reshard()  # type: ignore[operator]
            self._unsharded = False

    def _reduce_scatter_stages(self) -> None:
        """Once per optimizer step: each sharded stage's gradients, accumulated over the step's micro-batches and
        ``accumulate_grad_batches`` micro-steps, reduce-scattered (averaged) over the data dimension, then scaled by
        what flowed into the step's loss (``1 / accumulate_grad_batches``, times the loss scale under fp16)."""
        for s in sorted(self._sharded_stages):
            self._stage_objects[s].reduce_now()
        scale = self._grad_scale
        if scale is None:
            return
        with torch.no_grad():
            for p in self._sharded_params:
                if p.grad is not None:
                    local = comm.local_shard(p.grad)
                    local.mul_(scale.to(local.dtype))

    def sync_layout(self, model: nn.Module) -> list[int]:
        """``stage=3``: the bytes of each reduce-scatter of one optimizer step (one per stage of this rank: the
        stage's whole gradients, as handed to it; with tensor parallelism, this rank's tensor shards of them), for
        the ledger's ``round_bytes``; the all-reduces of the weights outside the blocks are counted as they are
        issued."""
        return [
            sum(
                _over_data(p) * p.element_size()
                for b in self._stage_blocks(s)
                for p in b.parameters()
                if p.requires_grad
            )
            for s in sorted(self._sharded_stages)
        ]

    @staticmethod
    def _in_shards(params: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
        """``values`` (whole tensors, one process's) with each one of a ``DTensor``'s shape cut to this rank's
        piece of it (FSDP2's shards at ``stage=3``, the tensor plan's split layers; ``params``: the parameter or
        buffer each key belongs to), without communication."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        out = dict(values)
        for key, value in values.items():
            param = params.get(key)
            if isinstance(param, DTensor) and isinstance(value, Tensor) and not isinstance(value, DTensor):
                if tuple(value.shape) == tuple(param.shape):
                    whole = value.detach().to(device=param.device, dtype=param.dtype)
                    out[key] = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
        return out

    # --- the parameters -----------------------------------------------------------------------------------
    def _stage_blocks(self, stage: int) -> list[nn.Module]:
        assert self.plan is not None
        start, end = self.plan.bounds[stage]
        return self._blocks[start:end]

    def _owned_params(self) -> list[nn.Parameter]:
        if self._sharded_stages:  # the optimizer's DTensors, whether or not the stages are gathered now
            return cast(list[nn.Parameter], list(self._sharded_params))
        return [p for s in self._local for b in self._stage_blocks(s) for p in b.parameters() if p.requires_grad]

    def _shared_params(self) -> list[nn.Parameter]:
        assert self.module is not None
        in_blocks = {id(p) for b in self._blocks for p in b.parameters()}
        return [p for p in self.module.parameters() if p.requires_grad and id(p) not in in_blocks]

    def _block_tensors(self, stages: Sequence[int]) -> list[Tensor]:
        """The parameters and buffers of the blocks of ``stages``, each once."""
        seen: set[int] = set()
        out = []
        for s in stages:
            for b in self._stage_blocks(s):
                for t in [*b.parameters(), *b.buffers()]:
                    if id(t) not in seen:
                        seen.add(id(t))
                        out.append(t)
        return out

    def _kept_ids(self) -> set[int]:
        """The tensors this rank trains or uses: its stages' blocks' and those held outside the blocks."""
        assert self.module is not None
        in_blocks = {id(m) for b in self._blocks for m in b.modules()}
        outside = [
            t
            for m in self.module.modules()
            if id(m) not in in_blocks
            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        ]
        return {id(t) for t in [*self._block_tensors(self._local), *outside]}

    @torch.no_grad()
    def free_blocks(self) -> None:
        """Free the storage of the other stages' blocks' parameters and buffers (and any gradient or optimizer
        state of theirs): this rank then holds its own blocks and the parameters outside the blocks only. Undone by
        :meth:`gather_blocks`."""
        self._reshard_stages()
        if self._freed or self.plan is None:
            return
        kept = self._kept_ids()
        others = [s for s in range(self.stages) if s not in self._local]
        freed = [t for t in self._block_tensors(others) if id(t) not in kept]
        for t in freed:
            # a DTensor (tensor parallelism): its shard's storage freed, its global shape kept
            local = _compat.local_storage(t)
            self._freed.append((t, local.shape))
            local.data = torch.empty(0, dtype=t.dtype, device=t.device)
            if isinstance(t, nn.Parameter):
                t.grad = None
            for opt in self._held_optimizers:
                opt.state.pop(t, None)

    def freed_bytes(self) -> int:
        """The bytes of the freed tensors (0 while every rank holds the whole model)."""
        return sum(math.prod(shape) * t.element_size() for t, shape in self._freed)

    def _owner(self, stage: int) -> int:
        """The global rank that trains ``stage`` in this rank's pipeline."""
        assert self.dims is not None
        here = self.dims.coordinates(self.rank)
        index = stage % self.size
        return ((index * self.dims.data_parallel) + here[DATA_PARALLEL]) * self.dims.tensor + here["tensor_parallel"]

    # --- one training step --------------------------------------------------------------------------------
    def check_training_loader(self, loader: Any, batches_run: float) -> None:
        """:func:`check_loader_batches` once per fit, at its first training batch (the loader Lightning prepared)."""
        if not self._loader_checked:
            self._loader_checked = True
            check_loader_batches(loader, self.microbatches, batches_run)

    def training_step(self, module: Any, accumulate: int, batch: Any, batch_idx: int = 0) -> Any:
        """Forward and backward of every micro-batch through the stages (the schedule's); returns the batch's loss
        (the mean of the micro-batches' losses, the same on every stage) as a tensor whose backward adds the
        schedule's gradients, for Lightning's closure. The gradients are in ``.grad``, scaled by ``1 / (m x
        accumulate)``. ``token_loss``: the loss is the sum of the micro-batches' sums, the gradients scaled by
        ``1 / accumulate``, and the step returns ``{"loss": ..., "num_tokens": <the batch's tokens>}``."""
        m = self.microbatches
        micro = split_batch(batch, m)
        key = tuple((tuple(t.shape), t.dtype) for t in _leaves(micro[0]))
        self._micro, self._step_batch_index = micro, batch_idx
        self._logged, self._losses, self._tokens = {}, {}, {}
        self._scale = 1.0 if self.token_loss else 1.0 / m  # token sums add up; means are averaged
        schedule = self._schedule_for(module, key)  # a new shape: its probe runs the whole model
        self.free_blocks()  # this rank's stages only, from the first step and after each gather
        self._stale = True
        device = self._module_device(module)
        first = 0 in self._local
        last = self.stages - 1 in self._local
        args = (torch.arange(m, device=device),) if first else ()
        target = torch.arange(m, device=device) if last else None
        # Lightning zeroes the gradients between the training step and its backward: the schedule's gradients
        # wait aside and are added by the backward of the loss returned (scaled by what flows into it: 1 / k)
        params = self._step_params(module)
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            with self._logs_captured(module):
                self.busy_s, start = 0.0, time.perf_counter()
                schedule.step(*args, target=target, return_outputs=False)
                elapsed = time.perf_counter() - start
            self._pending = [(p, p.grad) for p in params if p.grad is not None]
        finally:
            for p, g in zip(params, held):
                p.grad = g
        if self.ledger is not None:
            self.ledger.record_stage_sends(*self._sends)
        theory = (self.size - 1) / (m + self.size - 1)
        if self.schedule_name == "interleaved_1f1b":
            theory /= len(self._local)
        measured = max(0.0, 1.0 - self.busy_s / elapsed) if elapsed > 0 else 0.0
        self.last_stats = PipelineStats(self.stages, len(self._local), m, self._sends[1], measured, theory)
        payload: Any = None
        if last:
            losses = torch.stack([self._losses[i] for i in range(m)])
            tokens = sum(self._tokens[i] for i in range(m)) if self.token_loss else 0.0
            combined = (losses.sum() if self.token_loss else losses.mean()).cpu()
            payload = (combined, tokens, combine_logs([self._logged.get(i, []) for i in range(m)]))
        payload = comm.broadcast_object(payload, src=self._owner(self.stages - 1), group=self.pipeline_group)
        loss, tokens, logs = payload
        for name, value, kwargs in logs:
            module.log(name, value.to(device), **kwargs)
        pending = _PendingGradients.apply(loss.to(device).requires_grad_(True), self)
        return {"loss": pending, "num_tokens": tokens} if self.token_loss else pending

    def add_pending(self, scale: Tensor) -> None:
        """The backward of the loss :meth:`training_step` returned: the schedule's gradients, times ``scale`` (what
        flows into that loss: ``1 / accumulate_grad_batches``, times the loss scale under fp16), added to
        ``.grad``."""
        pending, self._pending = self._pending, []
        # the schedule's backward started from the loss times the loss scale already (use_loss_scale): what is left
        # to apply is 1 / accumulate_grad_batches
        scale = scale.detach() / self._loss_scale
        self._grad_scale = scale  # the sharded stages' gradients take it after their reduce-scatter
        with torch.no_grad():
            for p, g in pending:
                g = g * scale.to(g.dtype)
                p.grad = g if p.grad is None else p.grad + g

    # --- one evaluation step ------------------------------------------------------------------------------
    def runs_stages_in_evaluation(self) -> bool:
        """Whether evaluation steps run through the stages: while the other stages' blocks are freed (during fit,
        after the first training step). Otherwise every rank holds the whole model (before the first training
        step, after fit) and runs the step on it, as without a pipeline."""
        return bool(self._freed) and not self._whole_for_evaluation

    def hold_whole_model(self) -> None:
        """Before an evaluation step on the whole model (:meth:`runs_stages_in_evaluation` is False: before the first
        training step, as in Lightning's sanity check): this rank's sharded stages (``stage=3``) gathered whole, as
        the other stages' blocks are, until the next training step. Nothing to do at ``stage=2``."""
        self._unshard_stages()

    def evaluation_step(self, module: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        """The user's ``validation_step``, ``test_step`` or ``predict_step`` (``method``) through the stages,
        forward only: each stage runs it with the blocks of its own stages (the hooks of :meth:`run_stage`) on the
        whole batch, the activation at each stage boundary broadcast from the stage's rank to the pipeline's ranks;
        the last stage runs it to its end. Its ``self.log`` calls and its return value are then the same on every
        rank of the pipeline (logged there again, returned): Lightning's reduction over all ranks gives the value
        of one process. A collective of the pipeline's ranks, which hold the same batch (the evaluation loaders
        are sharded over the data replicas); a batch that differs between them raises :class:`PipelineError`."""
        assert self.plan is not None and self.module is not None
        self._unshard_stages()  # stage=3: this rank's stages whole until the next training step
        device = self._module_device(module)
        fingerprints = comm.all_gather_object(_fingerprint(args[0] if args else None), group=self.pipeline_group)
        if any(f != fingerprints[0] for f in fingerprints):  # every rank of the pipeline raises
            raise PipelineError(
                f"The ranks of one pipeline got different {method} batches (their shapes and sums: {fingerprints}). "
                f"Every stage of a pipeline must evaluate the same batch: shard the evaluation loaders over the data "
                f"replicas, with trainer.strategy.distributed_sampler_kwargs (Lightning's automatic sampler does), "
                f"not over the global ranks."
            )
        received: Optional[Tensor] = None
        last = self.stages - 1
        payload: Any = None
        failure: Optional[BaseException] = None  # this rank's, re-raised after the stage's collective
        for s in range(self.stages):
            owner = self._owner(s)
            sent: Any = None
            if s in self._local:
                try:
                    sent, out = self._evaluation_stage(module, method, s, received, args, kwargs)
                    if s == last:
                        payload = (_to_device(out, torch.device("cpu")), self._portable_logs(module))
                except Exception as error:  # the other ranks wait in the next collective: they raise too
                    failure = error
                    payload = f"{type(error).__name__}: {error}"
            if s == last:
                break
            meta: Any = (tuple(sent.shape), sent.dtype) if sent is not None else payload
            meta = comm.broadcast_object(meta if failure is None else payload, src=owner, group=self.pipeline_group)
            if isinstance(meta, str):
                raise failure if failure is not None else PipelineError(f"Pipeline stage {s} failed: {meta}")
            buffer = sent if sent is not None else torch.empty(meta[0], dtype=meta[1], device=device)
            comm.broadcast(buffer, src=owner, group=self.pipeline_group)  # not a training step's bytes
            received = buffer
        self._logged, self._logs_wanted = {}, False
        payload = comm.broadcast_object(payload, src=self._owner(last), group=self.pipeline_group)
        if isinstance(payload, str):
            raise failure if failure is not None else PipelineError(f"Pipeline stage {last} failed: {payload}")
        out, logs = payload
        named = dict(module.named_modules())
        for name, value, given in logs:
            module.log(name, named[value[1]] if isinstance(value, tuple) else value.to(device), **given)
        return _to_device(out, device)

    def _evaluation_stage(
        self, module: Any, method: str, stage: int, received: Optional[Tensor], args: Any, kwargs: Any
    ) -> tuple[Optional[Tensor], Any]:
        """The user's step run as ``stage`` (no gradients, its logs captured on the last stage): the activation it
        sends on (None on the last stage) and what the step returned (the last stage's)."""
        assert self.plan is not None
        taken: list[int] = []
        last = stage == self.stages - 1
        self._chunk, self._logs_wanted, self._logged = 0, last, {}
        sent: Optional[Tensor] = None
        out: Any = None
        try:
            with torch.no_grad(), self._logs_captured(module), self._stage_hooks(stage, received, taken):
                out = getattr(module, method)(*args, **kwargs)
        except _StageOutput as stage_output:
            sent = stage_output.output.contiguous()
        if (stage != 0 and len(taken) != 1) or (not last and sent is None):
            raise PipelineError(
                f"The {method} of {type(module).__name__} does not call the blocks of {self.plan.container!r} each "
                f"once in order (the first block of pipeline stage {stage} ran {len(taken)} time(s)). Under pipeline "
                f"parallelism it needs {SHAPE_NEEDED}, as training_step does."
            )
        return sent, out

    def _portable_logs(self, module: Any) -> list[tuple[str, Any, dict[str, Any]]]:
        """The last stage's captured ``self.log`` calls, with tensors on the CPU and a metric (a submodule, such as
        a torchmetrics ``Metric``) by its name in the module: the other ranks log their own copy of it, whose
        states (never updated there) add nothing when it is synced over the ranks."""
        names = {id(m): n for n, m in module.named_modules()}
        out: list[tuple[str, Any, dict[str, Any]]] = []
        for name, value, given in self._logged.get(0, []):
            if isinstance(value, nn.Module) and id(value) in names:
                out.append((name, ("module", names[id(value)]), given))
            elif isinstance(value, (Tensor, int, float)):
                out.append((name, torch.as_tensor(value).detach().cpu(), given))
            else:
                raise PipelineError(
                    f"self.log({name!r}, {type(value).__name__}) in an evaluation step under pipeline parallelism: "
                    f"log a number, a tensor, or a metric that is an attribute of the LightningModule."
                )
        return out

    def start_uneven_evaluation(self, model: nn.Module) -> None:
        """Ranks that may run different numbers of evaluation batches: the whole model on every rank for this
        loop (no step is then a collective)."""
        self.gather_blocks()  # freed again by the next training step
        self._whole_for_evaluation = True

    def end_uneven_evaluation(self, model: nn.Module) -> None:
        self._whole_for_evaluation = False

    def forward_is_collective(self, model: nn.Module) -> bool:
        return self.runs_stages_in_evaluation()

    @staticmethod
    def _module_device(module: Any) -> torch.device:
        return next(iter(module.parameters())).device

    @contextlib.contextmanager
    def _logs_captured(self, module: Any) -> Generator[None, None, None]:
        signature = inspect.signature(type(module).log)
        backend = self

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(module, name, value, *args, **kwargs).arguments
            given = {k: v for k, v in bound.items() if k not in ("self", "name", "value")}
            given.update(given.pop("kwargs", {}))
            if backend._logs_wanted:  # the last stage's calls: the loss exists there only
                backend._logged.setdefault(backend._chunk, []).append((name, value, given))

        module.log = log
        try:
            yield
        finally:
            del module.log

    _chunk = 0
    _logs_wanted = False

    @contextlib.contextmanager
    def _stage_hooks(self, stage: int, received: Optional[Tensor], taken: list[int]) -> Generator[None, None, None]:
        """The forward of the user's step as stage ``stage``: the blocks before the stage's skipped, its first block
        fed ``received`` (each time: counted in ``taken``), :class:`_StageOutput` raised after its last block
        (unless it is the last stage)."""
        assert self.plan is not None
        start, end = self.plan.bounds[stage]
        handles: list[Any] = []
        skipped: list[tuple[nn.Module, Any]] = []  # each with its instance forward (compiled, checkpointed) or None
        for j in range(start):
            block = self._blocks[j]
            skipped.append((block, block.__dict__.get("forward")))
            block.forward = self._passthrough(j)
        if stage != 0:

            def take(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                taken.append(1)
                return (received, *args[1:]), kwargs

            handles.append(self._blocks[start].register_forward_pre_hook(take, with_kwargs=True))
        if stage != self.stages - 1:

            def stop(block: nn.Module, args: Any, output: Any) -> None:
                tensor = _first_tensor(output)
                if tensor is None:
                    raise PipelineError(
                        f"The last block of pipeline stage {stage} returned {type(output).__name__}, not a tensor (or "
                        f"a tuple starting with one). The pipeline needs {SHAPE_NEEDED}."
                    )
                raise _StageOutput(tensor)

            handles.append(self._blocks[end - 1].register_forward_hook(stop))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            for block, previous in skipped:
                self._restore_forward(block, previous)

    def run_stage(self, stage: int, chunk: int, received: Tensor) -> Tensor:
        """The user's ``training_step`` on micro-batch ``chunk``, run as stage ``stage``: see the module docstring."""
        module: Any = self.module
        assert module is not None and self.plan is not None
        self._chunk, self._logs_wanted = chunk, stage == self.stages - 1
        try:
            with self._stage_hooks(stage, received, []):
                out = module.training_step(self._micro[chunk], self._step_batch_index)
        except _StageOutput as stage_output:
            return stage_output.output.contiguous()
        loss = out["loss"] if isinstance(out, dict) else out
        if not isinstance(loss, Tensor):
            raise PipelineError(
                "training_step returned no loss tensor on the last pipeline stage; return the loss (or a dict with "
                "'loss')."
            )
        self._losses[chunk] = loss.detach()
        if self.token_loss:
            self._tokens[chunk] = TokenNormalization.tokens_of(out)
        return loss

    @staticmethod
    def _restore_forward(block: nn.Module, previous: Any) -> None:
        """Put back the ``forward`` a skipped block had before its passthrough: its class's, or the instance
        ``forward`` that compilation or activation checkpointing put there (kept across steps, so that the block
        runs compiled in a later whole-model evaluation and after fit)."""
        if previous is None:
            del block.forward
        else:
            block.__dict__["forward"] = previous

    def blocks(self) -> list[nn.Module]:
        """The pipeline's blocks, in order (all stages'; empty before :meth:`shard_model`): what compilation
        compiles one by one."""
        return list(self._blocks)

    def _passthrough(self, index: int) -> Callable[..., Any]:
        extra = self._tuple_outputs.get(index, 0)

        def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
            return (x, *([None] * extra)) if extra else x

        return forward

    def use_loss_scale(self, scale: float) -> None:
        """Before each training step, under a loss scaler (fp16): the scale the backward of the step's loss will be
        multiplied by. The schedule's backward starts from the last stage's loss times ``scale``, as one process's
        backward of the scaled loss does: every stage's half-precision backward then runs on scaled gradients (small
        ones do not underflow; one that overflows turns to inf there and the scaler's agreed check skips the step on
        every rank), and :meth:`add_pending` applies only the rest of what flows into the loss returned."""
        self._loss_scale = float(scale)

    def _loss(self, output: Tensor, target: Tensor) -> Tensor:
        # a half loss times the loss scale in float32, as torch's GradScaler.scale does (in half it overflows at
        # 65504 where one process does not)
        if self._loss_scale != 1.0 and output.dtype in (torch.float16, torch.bfloat16):
            output = output.float()
        return output * (self._scale * self._loss_scale)

    # --- the stages, built once per micro-batch shape -------------------------------------------------------
    def _schedule_for(self, module: Any, key: Any) -> Any:
        if key in self._schedules:
            return self._schedules[key]
        boundaries, loss_meta = self._probe(module)
        device = self._module_device(module)
        stages: list[Any] = []
        for s in self._local:
            if s == 0:
                inputs: Tensor = torch.zeros(1, dtype=torch.long, device=device)
            else:
                shape, dtype = boundaries[s - 1]
                inputs = torch.empty(shape, dtype=dtype, device=device).requires_grad_(dtype.is_floating_point)
            if s == self.stages - 1:
                outputs = torch.empty(loss_meta[0], dtype=loss_meta[1], device=device).requires_grad_(True)
            else:
                shape, dtype = boundaries[s]
                outputs = torch.empty(shape, dtype=dtype, device=device).requires_grad_(dtype.is_floating_point)
            runner = self._sharded_stages[s] if s in self._sharded_stages else _Stage(self, s, self._stage_blocks(s))
            stage = _ChunkedStage(
                runner, s, self.stages, device, input_args=inputs, output_args=outputs, group=self.pipeline_group
            )
            stages.append(stage)
            self._stage_objects[s] = stage
        m = self.microbatches
        schedule: Any
        if self.schedule_name == "interleaved_1f1b":
            schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=self._loss, scale_grads=False)
        elif self.schedule_name == "gpipe":
            schedule = ScheduleGPipe(stages[0], m, loss_fn=self._loss, scale_grads=False)
        else:
            schedule = Schedule1F1B(stages[0], m, loss_fn=self._loss, scale_grads=False)
        sends, sent = 0, 0
        for s in self._local:  # an activation forward from each stage but the last, its gradient back from the next
            for boundary in ([boundaries[s]] if s != self.stages - 1 else []) + ([boundaries[s - 1]] if s else []):
                shape, dtype = boundary
                sends += m
                sent += m * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        self._sends = (sends, sent)
        self._schedules[key] = schedule
        return schedule

    def _probe(self, module: Any) -> tuple[list[tuple[torch.Size, torch.dtype]], tuple[torch.Size, torch.dtype]]:
        """One forward of the whole ``training_step`` on micro-batch 0 (no gradients, evaluation mode, the random
        state restored, logs dropped): the blocks' order, the activation at each stage boundary and the loss's
        shape. Raises :class:`PipelineError` where the model does not have the shape the pipeline needs."""
        assert self.plan is not None
        calls: list[int] = []
        inputs: dict[int, Any] = {}
        outputs: dict[int, Any] = {}
        handles = []
        for j, block in enumerate(self._blocks):

            def pre(b: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], j: int = j) -> None:
                calls.append(j)
                inputs[j] = args[0] if args else None

            def post(b: nn.Module, args: Any, output: Any, j: int = j) -> None:
                outputs[j] = output

            handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(block.register_forward_hook(post))
        refree = bool(self._freed)  # a new shape after the first step: the whole model for one forward
        self.gather_blocks()
        training = module.training
        module.eval()
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad(), self._logs_captured(module):
                out = module.training_step(self._micro[0], self._step_batch_index)
        finally:
            module.train(training)
            for h in handles:
                h.remove()
            if refree:
                self.free_blocks()
        self._logged = {}
        names = self.plan.names
        if calls != list(range(len(self._blocks))):
            order = [names[j] for j in calls]
            raise PipelineError(
                f"The training_step of {type(module).__name__} calls the blocks of {self.plan.container!r} in the "
                f"order {order}, not each once in order. The pipeline needs {SHAPE_NEEDED}."
            )
        boundaries = []
        for s in range(self.stages - 1):
            end = self.plan.bounds[s][1]
            sent, taken = _first_tensor(outputs[end - 1]), inputs[end]
            if type(sent).__name__ == "DTensor":
                raise PipelineError(
                    f"The output of {names[end - 1]!r} at a pipeline stage boundary is a DTensor (the tensor-parallel "
                    f"plan leaves it distributed): stages send plain tensors. Use tensor_parallel_plan='auto', or "
                    f"a plan whose last layer of each block hands out a plain tensor (use_local_output=True, the "
                    f"styles' default)."
                )
            if (
                sent is None
                or not isinstance(taken, Tensor)
                or sent.shape != taken.shape
                or not torch.equal(sent, taken)
            ):
                raise PipelineError(
                    f"At the stage boundary before {names[end]!r}, the forward does not hand the output of "
                    f"{names[end - 1]!r} (its first tensor) to {names[end]!r} as its first argument unchanged. The "
                    f"pipeline needs {SHAPE_NEEDED}. Choose other split points (pipeline_split) where it does."
                )
            boundaries.append((sent.shape, sent.dtype))
        for j, output in outputs.items():
            if isinstance(output, (tuple, list)):
                self._tuple_outputs[j] = len(output) - 1
        loss = out["loss"] if isinstance(out, dict) else out
        if not isinstance(loss, Tensor):
            raise PipelineError(
                f"training_step of {type(module).__name__} returned {type(out).__name__}; under pipeline parallelism "
                f"it must return the loss tensor (or a dict with 'loss')."
            )
        if self.token_loss:  # on every rank, before any stage runs: refused together, not in the last stage only
            TokenNormalization.tokens_of(out)
        return boundaries, (loss.shape, loss.dtype)

    # --- after the closure: the replicas' and the shared weights' gradients ----------------------------------
    def after_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """Lightning's closure (the step's last training_step and its backward), then :meth:`sync_gradients`:
        before the precision plugin unscales and clips."""

        def synced() -> Any:
            out = closure()
            self.sync_gradients()
            return out

        return synced

    def sync_gradients(self) -> None:
        """Average the blocks' gradients over the data-parallel replicas, and sum the gradients of the weights
        outside the blocks over the stages (then average them over the replicas): every replica then holds the
        one-process gradient of what it trains. A parameter without a gradient on every rank keeps none."""
        assert self.dims is not None
        dp = self.dims.data_parallel
        if self._sharded_stages:
            self._reduce_scatter_stages()
        elif dp > 1:
            self._reduce(self._owned_params(), self.data_group, dp)
        if self.dims.tensor > 1:
            self._reduce_shared_per_tensor_rank()
            return
        self._reduce(self._shared_params(), None, dp)

    def _reduce_shared_per_tensor_rank(self) -> None:
        """Tensor parallelism within the stages: the gradients of the weights outside the blocks summed over the
        ranks of this rank's tensor coordinate only (each holds its own shard, or a copy of what its tensor group
        holds), over the stages then over the data replicas (averaged there)."""
        assert self.dims is not None
        self._reduce(self._shared_params(), self.pipeline_group, 1)
        if self.dims.data_parallel > 1:
            self._reduce(self._shared_params(), self.data_group, self.dims.data_parallel)

    def _reduce(self, params: list[nn.Parameter], group: Any, divide: int) -> None:
        if not params:
            return
        # a DTensor's (tensor parallelism) local shard: the ranks of ``group`` share its tensor coordinate
        grads = [comm.local_shard(p.grad) if p.grad is not None else None for p in params]
        locals_ = [comm.local_shard(p) for p in params]
        reference = next((g for g in grads if g is not None), None)
        dtype = reference.dtype if reference is not None else params[0].dtype
        flat = torch.cat(
            [(g if g is not None else torch.zeros_like(t)).reshape(-1).to(dtype) for t, g in zip(locals_, grads)]
            + [torch.tensor([0.0 if g is None else 1.0 for g in grads], dtype=dtype, device=locals_[0].device)]
        )
        comm.all_reduce(flat, group=group, ledger=self.ledger)
        flags = flat[-len(params) :]
        offset = 0
        for i, (p, t) in enumerate(zip(params, locals_)):
            n = t.numel()
            if flags[i] > 0:
                p.grad = _like(p, (flat[offset : offset + n].view_as(t) / divide).to(p.dtype))
            offset += n

    # --- the whole model on every rank ------------------------------------------------------------------------
    @torch.no_grad()
    def gather_blocks(self) -> None:
        """Allocate the freed tensors again and broadcast each block's weights and buffers from the rank that
        trains it to the other ranks of its pipeline: every rank then holds the trained model (a collective of the
        pipeline's ranks; at ``stage=3`` of the data replicas too, which gather their stages' shards first)."""
        self._unshard_stages()
        if not (self._stale or self._freed) or self.plan is None or self.dims is None or not comm.group_is_up():
            return  # nothing trained since the last gather (validate/test/predict outside fit: rank 0's weights)
        shapes = {id(t): shape for t, shape in self._freed}
        self._stale, self._freed = False, []
        for s in range(self.stages):
            tensors = []  # a DTensor's local shard (tensor parallelism): the owner of this tensor coordinate has it
            for t in self._block_tensors([s]):
                local = _compat.local_storage(t)
                if id(t) in shapes:
                    local.data = torch.empty(shapes[id(t)], dtype=t.dtype, device=t.device)
                tensors.append(local)
            owner = self._owner(s)
            for dtype in sorted({t.dtype for t in tensors}, key=str):
                group = [t for t in tensors if t.dtype == dtype]
                if self.rank == owner:
                    flat = torch.cat([t.detach().reshape(-1) for t in group])
                else:
                    flat = torch.empty(sum(t.numel() for t in group), dtype=dtype, device=group[0].device)
                comm.broadcast(flat, src=owner, group=self.pipeline_group)
                if self.rank == owner:
                    continue
                offset = 0
                for t in group:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    def full_model_state(self, module: nn.Module, keys: Optional[set[str]] = None) -> dict[str, Any]:
        """The whole module's state on every rank; during training the other stages' blocks are freed again
        right after (the state keeps their gathered values until it is dropped)."""
        refree = bool(self._freed)
        self.gather_blocks()
        state = module.state_dict()
        if self._sharded_stages:  # FSDP2's state_dict holds the shards: whole (an all-gather over the data ranks)
            state = {k: comm.full_tensor(v) for k, v in state.items()}
        if refree:
            self.free_blocks()
        state = state if keys is None else {k: v for k, v in state.items() if k in keys}
        if self.dims is not None and self.dims.tensor > 1:  # the tensor group's shards gathered, key by key
            state = {k: comm.full_tensor(v) for k, v in state.items()}
        return state

    def load_full_model_state(self, module: nn.Module, state: dict[str, Any], strict: bool) -> None:
        """One process's state dict: every rank loads the whole of it, or, while the other stages' blocks are
        freed, its own blocks and the parameters outside the blocks (the others' keys are checked, their values
        not kept)."""
        state = self._in_shards(
            dict([*module.named_parameters(remove_duplicate=False), *module.named_buffers()]), state
        )
        if not self._freed:
            module.load_state_dict(state, strict=strict)
            return
        freed = {id(t) for t, _ in self._freed}
        names = {
            name
            for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]
            if id(t) in freed
        }
        result = module.load_state_dict({k: v for k, v in state.items() if k not in names}, strict=False)
        missing = [k for k in result.missing_keys if k not in names] + sorted(names - state.keys())
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(module).__name__}: missing keys {missing}, unexpected "
                f"keys {result.unexpected_keys}. Load a checkpoint of this model, or pass strict=False."
            )

    def sharded_model_state(self, module: nn.Module) -> dict[str, Any]:
        """``checkpoint="sharded"`` (``stage=3``): this rank's part for DCP, the shards of its stages' blocks and the
        weights outside the blocks (written once), without the other stages' freed blocks (their owners write
        them)."""
        with self._stages_resharded():
            state = module.state_dict()
        return {k: v for k, v in state.items() if k not in self._freed_names(module)}

    def sharded_optimizer_state(self, module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
        with self._stages_resharded():  # keyed by the names of the optimizer's parameters: the shards registered
            return super().sharded_optimizer_state(module, optimizer)

    @contextlib.contextmanager
    def _stages_resharded(self) -> Generator[None, None, None]:
        """The sharded stages' ``DTensor`` parameters registered on the blocks (after a gather, until the next
        training step, the gathered ones are), gathered again after where they were."""
        gathered = self._unsharded
        self._reshard_stages()
        try:
            yield
        finally:
            if gathered:
                self._unshard_stages()

    def _freed_names(self, module: nn.Module) -> set[str]:
        freed = {id(t) for t, _ in self._freed}
        return {
            name
            for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]
            if id(t) in freed
        }

    def load_full_optimizer_state(self, module: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
        """One process's optimizer state: this rank keeps the state of what it trains (at ``stage=3``, the shards
        of its stages' blocks)."""
        params = optimizer_params(optimizer)
        states = {
            i: self._in_shards({k: params[i] for k in s}, s) if i < len(params) else s
            for i, s in state["state"].items()
        }
        super().load_full_optimizer_state(module, optimizer, {**state, "state": states})
        for t, _ in self._freed:
            optimizer.state.pop(t, None)

    def full_optimizer_state(self, module: nn.Module, optimizer: Optimizer, is_global_zero: bool) -> dict[str, Any]:
        """One process's ``optimizer.state_dict()``: each parameter's state from the stage that trains it."""
        state = optimizer.state_dict()
        params = optimizer_params(optimizer)
        mine = {id(p) for p in self._owned_params()}
        if self.pipeline_index == 0:
            mine |= {id(p) for p in self._shared_params()}
        local = {  # a DTensor's state whole (tensor parallelism: a collective of the tensor group, in one order)
            i: {k: comm.full_tensor(v).cpu() if isinstance(v, Tensor) else v for k, v in s.items()}
            for i, s in state["state"].items()
            if id(params[i]) in mine
        }
        merged: dict[int, Any] = {}
        for part in comm.all_gather_object(local, group=self.pipeline_group):
            merged.update(part)
        return {"state": dict(sorted(merged.items())), "param_groups": state["param_groups"]}
