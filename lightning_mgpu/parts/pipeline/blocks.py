"""``HeldBlocks``: what of the model one rank of the pipeline holds (the package's docstring,
``parts/pipeline/__init__.py``, says why): which stages' blocks it trains and which weights it shares with every
stage (those outside the blocks), the other stages' blocks freed during training and gathered again from the ranks
that train them, each of its stages one FSDP2 unit over the data dimension at ``stage=3``, and the whole model's and
its optimizer's states, full or sharded, for checkpoints and their loads."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Generator, Sequence
from typing import Any, Optional, cast

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mgpu import _compat, comm
from lightning_mgpu.mesh import DATA_PARALLEL, PIPELINE, ParallelDims, ParallelMesh
from lightning_mgpu.parts.pipeline.plan import StagePlan, check_stage_count
from lightning_mgpu.parts.pipeline.stages import _Stage
from lightning_mgpu.parts.sharding import optimizer_params


def _named_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    """Every parameter (each name of a tied one) and buffer of ``module``, by name."""
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]


class HeldBlocks:
    """The blocks one rank of the pipeline holds (see the module docstring): ``stages`` stages over ``size``
    pipeline ranks (P), stage ``s`` on pipeline rank ``s % size``. Set by :meth:`place` at set-up."""

    def __init__(self, stages: int, size: int) -> None:
        self.stages = stages
        self.size = size
        self.plan: Optional[StagePlan] = None
        self.module: Optional[nn.Module] = None
        self.dims: Optional[ParallelDims] = None
        self.rank = 0
        self.pipeline_index = 0
        self.pipeline_group: Any = None
        self.data_group: Any = None
        self.blocks: list[nn.Module] = []
        self.local: list[int] = []  # the stage indices this rank runs
        self.stale = False  # the stages trained since the blocks were last gathered
        self.freed: list[tuple[Tensor, torch.Size]] = []  # the freed tensors, with their shapes
        self.optimizers: list[Optimizer] = []  # their state for the freed blocks is dropped
        # stage=3: each local stage's blocks one FSDP2 unit over the data dimension (the PipelineStage's submodule)
        self.sharded_stages: dict[int, _Stage] = {}
        self.sharded_params: list[Tensor] = []  # the sharded (DTensor) parameters the optimizer holds
        self.unsharded = False  # the sharded stages gathered whole (by unshard_stages)

    def place(self, module: nn.Module, parallel: ParallelMesh, split: Any) -> None:
        """At set-up: this rank's place in the mesh, and the blocks of ``module`` that ``split`` gives each stage."""
        self.dims = parallel.dims
        self.rank = torch.distributed.get_rank()
        self.pipeline_index = self.dims.coordinates(self.rank)[PIPELINE]
        self.pipeline_group = parallel.device_mesh[PIPELINE].get_group()
        self.data_group = parallel.device_mesh[DATA_PARALLEL].get_group() if self.dims.data_parallel > 1 else None
        self.module = module
        self.plan = check_stage_count(module, split, self.stages)
        modules = dict(module.named_modules())
        self.blocks = [modules[n] for n in self.plan.names]
        self.local = [s for s in range(self.stages) if s % self.size == self.pipeline_index]

    def start_fit(self) -> None:
        """At set-up, after :meth:`place` (and the units of ``stage=3``): nothing trained yet, no optimizer held."""
        self.stale = False
        self.optimizers = []  # (the freed tensors' shapes stay: a fit that ended in an error leaves them freed)

    # --- the parameters -----------------------------------------------------------------------------------
    def stage_blocks(self, stage: int) -> list[nn.Module]:
        assert self.plan is not None
        start, end = self.plan.bounds[stage]
        return self.blocks[start:end]

    def owned_params(self) -> list[nn.Parameter]:
        if self.sharded_stages:  # the optimizer's DTensors, whether or not the stages are gathered now
            return cast(list[nn.Parameter], list(self.sharded_params))
        return [p for s in self.local for b in self.stage_blocks(s) for p in b.parameters() if p.requires_grad]

    def shared_params(self) -> list[nn.Parameter]:
        assert self.module is not None
        in_blocks = {id(p) for b in self.blocks for p in b.parameters()}
        return [p for p in self.module.parameters() if p.requires_grad and id(p) not in in_blocks]

    def _block_tensors(self, stages: Sequence[int]) -> list[Tensor]:
        """The parameters and buffers of the blocks of ``stages``, each once."""
        seen: set[int] = set()
        out = []
        for s in stages:
            for b in self.stage_blocks(s):
                for t in [*b.parameters(), *b.buffers()]:
                    if id(t) not in seen:
                        seen.add(id(t))
                        out.append(t)
        return out

    def _kept_ids(self) -> set[int]:
        """The tensors this rank trains or uses: its stages' blocks' and those held outside the blocks."""
        assert self.module is not None
        in_blocks = {id(m) for b in self.blocks for m in b.modules()}
        outside = [
            t
            for m in self.module.modules()
            if id(m) not in in_blocks
            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        ]
        return {id(t) for t in [*self._block_tensors(self.local), *outside]}

    def owner(self, stage: int) -> int:
        """The global rank that trains ``stage`` in this rank's pipeline."""
        assert self.dims is not None
        here = self.dims.coordinates(self.rank)
        index = stage % self.size
        return ((index * self.dims.data_parallel) + here[DATA_PARALLEL]) * self.dims.tensor + here["tensor_parallel"]

    # --- stage=3: ZeRO-3 over the data dimension, each local stage one FSDP2 unit -----------------------------
    def shard_stages(self, parallel: ParallelMesh, runner: Any) -> None:
        """Shard the blocks of each of this rank's stages with FSDP2 (``fully_shard``) over the data dimension of
        the mesh, as one unit: the ``PipelineStage``'s submodule, whose first forward of an optimizer step (the
        stage) gathers them and whose reduce-scatter at the step's end frees them again; the other stages' blocks
        and the parameters outside the blocks stay plain tensors (those outside replicated on every rank).
        ``runner``: the :class:`~lightning_mgpu.parts.pipeline.runner.StageRunner` whose ``run_stage`` the units
        call."""
        from torch.distributed.fsdp import fully_shard

        from lightning_mgpu.parts.tensor_parallel import fsdp_dim

        for s in self.local:
            if s not in self.sharded_stages:  # a second fit in the same process keeps its units
                unit = _Stage(runner, s, self.stage_blocks(s))
                # gathered at the step's first forward and kept until its reduce-scatter (torchtitan's choice
                # with a pipeline): the gradients are whole for the step anyway; one all-gather per step, not two
                # per micro-batch
                fully_shard(unit, mesh=parallel.data, reshard_after_forward=False, shard_placement_fn=fsdp_dim)
                self.sharded_stages[s] = unit
        self.sharded_params = [
            p for s in self.local for b in self.stage_blocks(s) for p in b.parameters() if p.requires_grad
        ]

    def unshard_stages(self) -> None:
        """Gather this rank's sharded stages whole (an all-gather over the data dimension): their blocks then hold
        plain tensors, for a forward outside the schedule (the probe, evaluation) and for :meth:`gather_blocks`."""
        if self.sharded_stages and not self.unsharded:
            for s in sorted(self.sharded_stages):
                self.sharded_stages[s].unshard()  # type: ignore[operator]
            self.unsharded = True

    def reshard_stages(self) -> None:
        if self.unsharded:
            for s in sorted(self.sharded_stages):
                self.sharded_stages[s].reshard()  # type: ignore[operator]
            self.unsharded = False

    @contextlib.contextmanager
    def stages_resharded(self) -> Generator[None, None, None]:
        """The sharded stages' ``DTensor`` parameters registered on the blocks (after a gather, until the next
        training step, the gathered ones are), gathered again after where they were."""
        gathered = self.unsharded
        self.reshard_stages()
        try:
            yield
        finally:
            if gathered:
                self.unshard_stages()

    # --- the other stages' blocks freed and gathered ----------------------------------------------------------
    @torch.no_grad()
    def free_blocks(self) -> None:
        """Free the storage of the other stages' blocks' parameters and buffers (and any gradient or optimizer
        state of theirs): this rank then holds its own blocks and the parameters outside the blocks only. Undone by
        :meth:`gather_blocks`."""
        self.reshard_stages()
        if self.freed or self.plan is None:
            return
        kept = self._kept_ids()
        others = [s for s in range(self.stages) if s not in self.local]
        freed = [t for t in self._block_tensors(others) if id(t) not in kept]
        for t in freed:
            # a DTensor (tensor parallelism): its shard's storage freed, its global shape kept
            local = _compat.local_storage(t)
            self.freed.append((t, local.shape))
            local.data = torch.empty(0, dtype=t.dtype, device=t.device)
            if isinstance(t, nn.Parameter):
                t.grad = None
            for opt in self.optimizers:
                opt.state.pop(t, None)

    def freed_bytes(self) -> int:
        """The bytes of the freed tensors (0 while every rank holds the whole model)."""
        return sum(math.prod(shape) * t.element_size() for t, shape in self.freed)

    def _freed_names(self, module: nn.Module) -> set[str]:
        freed = {id(t) for t, _ in self.freed}
        return {name for name, t in _named_tensors(module) if id(t) in freed}

    @torch.no_grad()
    def gather_blocks(self) -> None:
        """Allocate the freed tensors again and broadcast each block's weights and buffers from the rank that
        trains it to the other ranks of its pipeline: every rank then holds the trained model (a collective of the
        pipeline's ranks; at ``stage=3`` of the data replicas too, which gather their stages' shards first)."""
        self.unshard_stages()
        if not (self.stale or self.freed) or self.plan is None or self.dims is None or not comm.group_is_up():
            return  # nothing trained since the last gather (validate/test/predict outside fit: rank 0's weights)
        shapes = {id(t): shape for t, shape in self.freed}
        self.stale, self.freed = False, []
        for s in range(self.stages):
            tensors = []  # a DTensor's local shard (tensor parallelism): the owner of this tensor coordinate has it
            for t in self._block_tensors([s]):
                local = _compat.local_storage(t)
                if id(t) in shapes:
                    local.data = torch.empty(shapes[id(t)], dtype=t.dtype, device=t.device)
                tensors.append(local)
            owner = self.owner(s)
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

    # --- the whole model's states -----------------------------------------------------------------------------
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

    def full_model_state(self, module: nn.Module, keys: Optional[set[str]] = None) -> dict[str, Any]:
        """The whole module's state on every rank; during training the other stages' blocks are freed again
        right after (the state keeps their gathered values until it is dropped)."""
        refree = bool(self.freed)
        self.gather_blocks()
        state = module.state_dict()
        if self.sharded_stages:  # FSDP2's state_dict holds the shards: whole (an all-gather over the data ranks)
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
        state = self._in_shards(dict(_named_tensors(module)), state)
        if not self.freed:
            module.load_state_dict(state, strict=strict)
            return
        names = self._freed_names(module)
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
        with self.stages_resharded():
            state = module.state_dict()
        return {k: v for k, v in state.items() if k not in self._freed_names(module)}

    def optimizer_state_in_shards(self, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        """One process's optimizer state with each value of a ``DTensor`` parameter's shape cut to this rank's
        piece of it (at ``stage=3``, the shards of its stages' blocks)."""
        params = optimizer_params(optimizer)
        states = {
            i: self._in_shards({k: params[i] for k in s}, s) if i < len(params) else s
            for i, s in state["state"].items()
        }
        return {**state, "state": states}

    def drop_freed_state(self, optimizer: Optimizer) -> None:
        """The optimizer state of the freed blocks dropped (this rank keeps the state of what it trains)."""
        for t, _ in self.freed:
            optimizer.state.pop(t, None)

    def full_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """One process's ``optimizer.state_dict()``: each parameter's state from the stage that trains it."""
        state = optimizer.state_dict()
        params = optimizer_params(optimizer)
        mine = {id(p) for p in self.owned_params()}
        if self.pipeline_index == 0:
            mine |= {id(p) for p in self.shared_params()}
        local = {  # a DTensor's state whole (tensor parallelism: a collective of the tensor group, in one order)
            i: {k: comm.full_tensor(v).cpu() if isinstance(v, Tensor) else v for k, v in s.items()}
            for i, s in state["state"].items()
            if id(params[i]) in mine
        }
        merged: dict[int, Any] = {}
        for part in comm.all_gather_object(local, group=self.pipeline_group):
            merged.update(part)
        return {"state": dict(sorted(merged.items())), "param_groups": state["param_groups"]}
