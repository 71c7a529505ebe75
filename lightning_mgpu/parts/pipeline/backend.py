"""``PipelineBackend``: the sharded strategy's backend with ``pipeline_parallel_size > 1`` (the package's docstring,
``parts/pipeline/__init__.py``, says what it does): the checks before launch, the stages placed over the mesh, the
gradient sync across replicas and stages, and the clipping by the norm over every stage. It holds the blocks this
rank keeps (:class:`~lightning_mgpu.parts.pipeline.blocks.HeldBlocks`: which it trains, the others freed and
gathered, the whole model's states for checkpoints) and the steps through the stages
(:class:`~lightning_mgpu.parts.pipeline.runner.StageRunner`: the schedule's training step, evaluation through the
stages), and hands each of the strategy's calls to the one that does it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mgpu import comm
from lightning_mgpu.ledger import CommStats
from lightning_mgpu.mesh import ParallelDims, ParallelMesh
from lightning_mgpu.parts.clipping import GlobalNormClipping
from lightning_mgpu.parts.pipeline.blocks import HeldBlocks
from lightning_mgpu.parts.pipeline.hooks import StageHooks
from lightning_mgpu.parts.pipeline.plan import PipelineError, StagePlan, check_stage_count, master_precision_refusal
from lightning_mgpu.parts.pipeline.runner import PipelineStats, StageRunner
from lightning_mgpu.parts.pipeline.stages import PipelineSyncControl, _copies_over, _like, _over_data
from lightning_mgpu.parts.sharding import ShardingBackend, optimizer_params
from lightning_mgpu.quantization import refuse_bitsandbytes_shards


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
        self._whole_for_evaluation = False  # an evaluation loop whose ranks may run different numbers of batches
        self.held = HeldBlocks(self.stages, size)
        self.runner = StageRunner(self.held, StageHooks(self.held, token_loss), schedule, self.microbatches, token_loss)

    @property
    def dims(self) -> Optional[ParallelDims]:
        """The mesh's sizes (None before :meth:`shard_model`)."""
        return self.held.dims

    @property
    def last_stats(self) -> Optional[PipelineStats]:
        """This rank's last training step (None before it)."""
        return self.runner.last_stats

    # --- after a spawn/fork launch -------------------------------------------------------------------------
    def results_for_main_process(self) -> Optional[dict[str, Any]]:
        """In rank 0's worker after the call: its last step's stats, for the main process's strategy (a dict:
        Lightning moves the results with ``apply_to_collection``, which refuses frozen dataclasses)."""
        return asdict(self.last_stats) if self.last_stats is not None else None

    def restore_results_from_worker(self, state: Optional[dict[str, Any]]) -> None:
        """In the main process: rank 0's last step (``trainer.strategy.pipeline_stats()`` after ``fit``)."""
        self.runner.last_stats = PipelineStats(**state) if state is not None else None

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
        refuse_bitsandbytes_shards(module, "stage=3 with pipeline_parallel_size > 1")
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
        self.held.place(module, parallel, self.split)
        self.runner.start_fit()
        if self.stage == 3:
            self.held.shard_stages(parallel, self.runner)
        self.held.start_fit()
        return None

    def wrap_optimizer(self, optimizer: Optimizer, group: Any) -> Optimizer:
        self.held.optimizers.append(optimizer)  # its state for the freed blocks is dropped (a loaded checkpoint's)
        return optimizer

    def blocks(self) -> list[nn.Module]:
        """The pipeline's blocks, in order (all stages'; empty before :meth:`shard_model`): what compilation
        compiles one by one."""
        return list(self.held.blocks)

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
        self.runner.ledger = ledger  # the stage sends and this backend's all-reduces count into it
        data, tensor = (self.dims.data_parallel, self.dims.tensor) if self.dims is not None else (1, 1)
        copies: Optional[Callable[[Tensor], int]] = None
        if self.held.sharded_stages:
            group, copies = None, _copies_over(data * tensor, 1)  # copies among the stage's ranks
        elif tensor > 1:
            group, copies = None, _copies_over(tensor, data)
        else:
            group = self.held.pipeline_group
        owned = {id(p) for p in self.held.owned_params()}  # the optimizer's DTensors at stage=3
        shared = {id(p) for p in self.held.shared_params()}
        return GlobalNormClipping(
            lambda opt: [p for p in optimizer_params(opt) if id(p) in owned],
            group,
            ledger,
            replicated=lambda opt: [p for p in optimizer_params(opt) if id(p) in shared],
            count_replicated=self.held.pipeline_index == 0,
            norm_dtype=torch.float64,
            copies=copies,
        )

    def sync_layout(self, model: nn.Module) -> list[int]:
        """``stage=3``: the bytes of each reduce-scatter of one optimizer step (one per stage of this rank: the
        stage's whole gradients, as handed to it; with tensor parallelism, this rank's tensor shards of them), for
        the ledger's ``round_bytes``; the all-reduces of the weights outside the blocks are counted as they are
        issued."""
        return [
            sum(
                _over_data(p) * p.element_size()
                for b in self.held.stage_blocks(s)
                for p in b.parameters()
                if p.requires_grad
            )
            for s in sorted(self.held.sharded_stages)
        ]

    # --- the steps through the stages (the runner's) ----------------------------------------------------------
    def check_training_loader(self, loader: Any, batches_run: float) -> None:
        self.runner.check_training_loader(loader, batches_run)

    def use_loss_scale(self, scale: float) -> None:
        self.runner.use_loss_scale(scale)

    def training_step(self, module: Any, accumulate: int, batch: Any, batch_idx: int = 0) -> Any:
        return self.runner.training_step(module, accumulate, batch, batch_idx)

    def evaluation_step(self, module: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.runner.evaluation_step(module, method, *args, **kwargs)

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
        if self.held.sharded_stages:
            self.runner.reduce_scatter_stages()
        elif dp > 1:
            self._reduce(self.held.owned_params(), self.held.data_group, dp)
        if self.dims.tensor > 1:
            self._reduce_shared_per_tensor_rank()
            return
        self._reduce(self.held.shared_params(), None, dp)

    def _reduce_shared_per_tensor_rank(self) -> None:
        """Tensor parallelism within the stages: the gradients of the weights outside the blocks summed over the
        ranks of this rank's tensor coordinate only (each holds its own shard, or a copy of what its tensor group
        holds), over the stages then over the data replicas (averaged there)."""
        assert self.dims is not None
        self._reduce(self.held.shared_params(), self.held.pipeline_group, 1)
        if self.dims.data_parallel > 1:
            self._reduce(self.held.shared_params(), self.held.data_group, self.dims.data_parallel)

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
        comm.all_reduce(flat, group=group, ledger=self.runner.ledger)
        flags = flat[-len(params) :]
        offset = 0
        for i, (p, t) in enumerate(zip(params, locals_)):
            n = t.numel()
            if flags[i] > 0:
                p.grad = _like(p, (flat[offset : offset + n].view_as(t) / divide).to(p.dtype))
            offset += n

    # --- evaluation: through the stages, or on the whole model ---------------------------------------------
    def runs_stages_in_evaluation(self) -> bool:
        """Whether evaluation steps run through the stages: while the other stages' blocks are freed (during fit,
        after the first training step). Otherwise every rank holds the whole model (before the first training
        step, after fit) and runs the step on it, as without a pipeline."""
        return bool(self.held.freed) and not self._whole_for_evaluation

    def hold_whole_model(self) -> None:
        """Before an evaluation step on the whole model (:meth:`runs_stages_in_evaluation` is False: before the first
        training step, as in Lightning's sanity check): this rank's sharded stages (``stage=3``) gathered whole, as
        the other stages' blocks are, until the next training step. Nothing to do at ``stage=2``."""
        self.held.unshard_stages()

    def start_uneven_evaluation(self, model: nn.Module) -> None:
        """Ranks that may run different numbers of evaluation batches: the whole model on every rank for this
        loop (no step is then a collective)."""
        self.gather_blocks()  # freed again by the next training step
        self._whole_for_evaluation = True

    def end_uneven_evaluation(self, model: nn.Module) -> None:
        self._whole_for_evaluation = False

    def forward_is_collective(self, model: nn.Module) -> bool:
        return self.runs_stages_in_evaluation()

    # --- the blocks this rank holds, and the whole model's states (the held blocks') -------------------------
    def free_blocks(self) -> None:
        self.held.free_blocks()

    def gather_blocks(self) -> None:
        self.held.gather_blocks()

    def freed_bytes(self) -> int:
        return self.held.freed_bytes()

    def full_model_state(self, module: nn.Module, keys: Optional[set[str]] = None) -> dict[str, Any]:
        return self.held.full_model_state(module, keys)

    def load_full_model_state(self, module: nn.Module, state: dict[str, Any], strict: bool) -> None:
        self.held.load_full_model_state(module, state, strict)

    def sharded_model_state(self, module: nn.Module) -> dict[str, Any]:
        return self.held.sharded_model_state(module)

    def sharded_optimizer_state(self, module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
        with self.held.stages_resharded():  # keyed by the names of the optimizer's parameters: the shards registered
            return super().sharded_optimizer_state(module, optimizer)

    def load_full_optimizer_state(self, module: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
        """One process's optimizer state: this rank keeps the state of what it trains (at ``stage=3``, the shards
        of its stages' blocks)."""
        super().load_full_optimizer_state(module, optimizer, self.held.optimizer_state_in_shards(optimizer, state))
        self.held.drop_freed_state(optimizer)

    def full_optimizer_state(self, module: nn.Module, optimizer: Optimizer, is_global_zero: bool) -> dict[str, Any]:
        return self.held.full_optimizer_state(optimizer)
