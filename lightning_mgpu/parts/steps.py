"""The step: how one training or evaluation step of the sharded strategy runs the model, chosen once when the
strategy is built, so that no hook of the strategy asks which layout it trains.

* :class:`ModelSteps`: the whole model on every rank (``pipeline_parallel_size=1``), its layers split by tensor
  parallelism where ``tensor_parallel_size > 1`` (then the step runs under the loss over the sharded vocabulary where
  the plan has one, and a replicated ``DTensor`` output becomes the plain tensor Lightning expects);
* :class:`PipelineSteps`: ``pipeline_parallel_size > 1``, each training step the schedule's forward and backward of
  every micro-batch through the stages (``parts/pipeline/``), evaluation through the stages while the other stages'
  blocks are freed, the gradients synced across stages and replicas after Lightning's closure, and the whole model
  gathered on every rank at the end of fit. The stages' blocks may be split by tensor parallelism too.

Both hold the strategy's :class:`~lightning_mgpu.parts.tensor_parallel.TensorParallelism` (which does nothing with
``tensor_parallel_size=1``).

Example::

    steps = steps_for(settings, token_loss=False)   # in the strategy's __init__: ModelSteps or PipelineSteps
    steps.training_step(module, loss_scale, redirect, batch, batch_idx)      # the strategy's training_step
"""

from __future__ import annotations

import math
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Optional

from torch import nn

from lightning_mgpu._compat import attached_trainer
from lightning_mgpu.ledger import CommStats
from lightning_mgpu.parts.compilation import Compilation
from lightning_mgpu.parts.pipeline import PipelineBackend, PipelineStats
from lightning_mgpu.parts.pipeline.batches import check_same_batch
from lightning_mgpu.parts.tensor_parallel import TensorParallelism
from lightning_mgpu.settings import ShardedSettings

#: the strategy's forward redirection: ``redirect(method, *args, **kwargs)`` runs the LightningModule's ``method``
#: through the wrapper's forward (DDP's, fairscale's) or the sharded module's own ``__call__``
Redirect = Callable[..., Any]


class ModelSteps:
    """The whole model on every rank, split by tensor parallelism where its size is above 1."""

    #: whether the model runs through pipeline stages (then every evaluation loop is a collective of the pipeline's
    #: ranks, whatever ``exact_evaluation``)
    pipelined = False

    def __init__(self, tensor: TensorParallelism) -> None:
        self.tensor = tensor
        self._tensor_group: Any = None  # tensor_parallel_size > 1: the ranks that split each layer see one batch
        self._batch_checked = False  # the first training batch of a fit compared over that group

    def checks_evaluation(self, exact_evaluation: bool) -> bool:
        """Whether an evaluation loop checks that its ranks run the same batches: with ``exact_evaluation``, and
        always through pipeline stages (one collective of the pipeline's ranks)."""
        return exact_evaluation or self.pipelined

    def sharding(self, backend: Any) -> Any:
        """The sharding backend the strategy holds: ``backend``, the one its stage and options make."""
        return backend

    @property
    def last_stats(self) -> Optional[PipelineStats]:
        """The pipeline's last training step (:class:`PipelineSteps`); None without a pipeline."""
        return None

    def results_for_main_process(self) -> Optional[dict[str, Any]]:
        """What rank 0's worker hands to the main process after a spawn or fork launch (nothing here)."""
        return None

    def restore_results_from_worker(self, state: Optional[dict[str, Any]]) -> None:
        """In the main process: what :meth:`results_for_main_process` handed over."""

    # --- before launch -------------------------------------------------------------------------------------
    def check_model(
        self,
        model: nn.Module,
        *,
        four_bit: bool,
        precision_plugin: Any,
        clip_by_norm: bool,
        trainer: Any,
        trainable_only: bool,
    ) -> None:
        """Before any process starts: a 4-bit base is refused under tensor or pipeline parallelism (not built yet),
        a model the tensor-parallel plan cannot split is refused with the fix, then the stages are checked
        (:meth:`check_stages`). ``trainer``: the Trainer being set up; ``trainable_only``: whether checkpoints save
        the trainable parameters only (``checkpoint_params``)."""
        layout = "tensor" if self.tensor.size > 1 else "pipeline" if self.pipelined else None
        if four_bit and layout is not None:
            raise ValueError(
                f"{type(model).__name__} has a 4-bit base (quantize_frozen), and a 4-bit base under {layout} "
                "parallelism is not built yet. Train it with data parallelism: mgpu_zero3 or HSDP shard the base, "
                "mgpu_ddp keeps it whole on each rank."
            )
        self.tensor.check_before_launch(model)
        self.check_stages(model, precision_plugin, clip_by_norm, getattr(trainer, "callbacks", ()), trainable_only)

    def check_stages(
        self, model: nn.Module, precision_plugin: Any, clip_by_norm: bool, callbacks: Any, trainable_only: bool
    ) -> None:
        """The pipeline's checks before launch (:class:`PipelineSteps`); nothing without stages."""

    # --- set-up --------------------------------------------------------------------------------------------
    def split(self, module: nn.Module, mesh: Any, stats: Optional[CommStats]) -> None:
        """Tensor parallelism over the ``"tensor_parallel"`` mesh (nothing at size 1); ``stats``: the ledger that
        counts its collectives from now on (``tensor_comm_stats=True``), else None."""
        self.tensor.apply(module, mesh)
        if self.tensor.size > 1:
            self._tensor_group, self._batch_checked = mesh.get_group(), False
        if stats is not None:
            self.tensor.count_into(stats, mesh)

    def compile(self, compilation: Compilation, module: nn.Module, unit_classes: Any) -> None:
        """``compile=``: each block of the model, after sharding."""
        compilation.compile_blocks(module, unit_classes)

    def sharded(self, sharding: Any, mesh: Any, policy: Any, unit_classes: Any) -> ShardedDimension:
        """The sharding backend as the data dimension of :func:`~lightning_mgpu.parts.parallelize.parallelize`:
        ``sharding`` shards over the strategy's ``mesh`` (``ParallelMesh``) with FSDP2's mixed-precision ``policy``,
        then this step object's compilation (``unit_classes``: the strategy's ``wrap_modules``)."""
        return ShardedDimension(self, sharding, mesh, policy, unit_classes)

    # --- steps ---------------------------------------------------------------------------------------------
    def counting(self) -> AbstractContextManager[None]:
        """A block whose tensor-parallel collectives the ledger counts (``tensor_comm_stats=True``)."""
        return self.tensor.counting()

    @contextmanager
    def backward_context(self) -> Generator[None, None, None]:
        """Around Lightning's backward: the split layers' collectives counted, under the loss over the sharded
        vocabulary (``"auto+sequence"``)."""
        with self.tensor.counting(), self.tensor.step_context():
            yield

    def local_output(self, output: Any) -> Any:
        """A value with each replicated ``DTensor`` as a plain tensor (what Lightning reduces and logs)."""
        return self.tensor.local_output(output)

    def training_step(
        self, module: Any, loss_scale: Callable[[], float], redirect: Redirect, *args: Any, **kwargs: Any
    ) -> Any:
        """The LightningModule's ``training_step`` on the model, under the loss over the sharded vocabulary where
        the tensor-parallel plan has one. ``loss_scale()``: the fp16 loss scale of the precision plugin (read only
        where the step needs it: the pipeline's schedule starts its backward from it). The first training batch of a
        fit is compared over the tensor-parallel group, whose ranks must hold the same batch."""
        if self._tensor_group is not None and not self._batch_checked:
            self._batch_checked = True
            check_same_batch(
                args[0] if args else None, "training_step", self._tensor_group, "one tensor-parallel group", ValueError
            )
        return self._on_model(redirect, "training_step", *args, **kwargs)

    def evaluation_step(self, module: Any, method: str, redirect: Redirect, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``validation_step``, ``test_step`` or ``predict_step`` (``method``) on the model."""
        return self._on_model(redirect, method, *args, **kwargs)

    def _on_model(self, redirect: Redirect, method: str, *args: Any, **kwargs: Any) -> Any:
        with self.tensor.step_context():
            return self.tensor.local_output(redirect(method, *args, **kwargs))

    def after_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """Lightning's closure, as the optimizer step runs it (here: unchanged)."""
        return closure

    def train_end(self) -> None:
        """At the end of fit, before Lightning's: nothing to gather here."""


class PipelineSteps(ModelSteps):
    """``pipeline_parallel_size > 1``: every step through the stages of ``pipeline`` (the sharding backend too)."""

    pipelined = True

    def __init__(self, tensor: TensorParallelism, pipeline: PipelineBackend) -> None:
        super().__init__(tensor)
        self.pipeline = pipeline

    def sharding(self, backend: Any) -> Any:
        """The pipeline's backend (which shards each stage over the data dimension at ``stage=3``)."""
        return self.pipeline

    @property
    def last_stats(self) -> Optional[PipelineStats]:
        return self.pipeline.last_stats

    def results_for_main_process(self) -> Optional[dict[str, Any]]:
        return self.pipeline.results_for_main_process()

    def restore_results_from_worker(self, state: Optional[dict[str, Any]]) -> None:
        self.pipeline.restore_results_from_worker(state)

    def check_stages(
        self, model: nn.Module, precision_plugin: Any, clip_by_norm: bool, callbacks: Any, trainable_only: bool
    ) -> None:
        """The split, the clipping and the precision, the callbacks (``callbacks``: the Trainer's, set by
        Lightning's callback connector), an adapter-only checkpoint."""
        self.pipeline.check_model(model, precision_plugin, clip_by_norm, callbacks, trainable_only)

    def compile(self, compilation: Compilation, module: nn.Module, unit_classes: Any) -> None:
        """``compile=``: each block of the stages; their hooks and ``training_step`` stay eager."""
        compilation.compile_pipeline_blocks(module, self.pipeline.blocks())

    def training_step(
        self, module: Any, loss_scale: Callable[[], float], redirect: Redirect, *args: Any, **kwargs: Any
    ) -> Any:
        """Every micro-batch's forward and backward through the stages (the schedule's); a last batch that cannot
        be split is refused at the first step, not after an epoch."""
        trainer = attached_trainer(module)
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        if trainer is not None:
            steps = trainer.max_steps * accumulate if trainer.max_steps >= 0 else math.inf
            self.pipeline.check_training_loader(trainer.train_dataloader, min(trainer.num_training_batches, steps))
        self.pipeline.use_loss_scale(loss_scale())
        return self.pipeline.training_step(module, accumulate, *args, **kwargs)

    def evaluation_step(self, module: Any, method: str, redirect: Redirect, *args: Any, **kwargs: Any) -> Any:
        """Through the stages (forward only, by stage) while the other stages' blocks are freed; else on the whole
        model, which this rank then holds (its sharded stages gathered)."""
        if self.pipeline.runs_stages_in_evaluation():
            with self.tensor.step_context():
                return self.pipeline.evaluation_step(module, method, *args, **kwargs)
        self.pipeline.hold_whole_model()
        return super().evaluation_step(module, method, redirect, *args, **kwargs)

    def after_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """The replicas' and the stages' gradient sync after Lightning's closure, before unscaling and clipping."""
        return self.pipeline.after_closure(closure)

    def train_end(self) -> None:
        """Every rank holds the trained model after fit."""
        self.pipeline.gather_blocks()


def steps_for(settings: ShardedSettings, token_loss: bool) -> ModelSteps:
    """The step object of the sharded strategy built with ``settings``: :class:`PipelineSteps` with
    ``pipeline_parallel_size > 1``, else :class:`ModelSteps`; ``token_loss``: ``loss_normalization="tokens"``."""
    tensor = TensorParallelism(settings.tensor_parallel_size, settings.tensor_parallel_plan)
    if not settings.pipelined:
        return ModelSteps(tensor)
    pipeline = PipelineBackend(
        settings.pipeline_parallel_size,
        settings.pipeline_schedule,
        settings.pipeline_microbatches,
        settings.pipeline_split,
        token_loss=token_loss,
        shard_stage=settings.stage,
    )
    return PipelineSteps(tensor, pipeline)


class ShardedDimension:
    """A sharding backend as the data dimension of :func:`~lightning_mgpu.parts.parallelize.parallelize` (see
    :meth:`ModelSteps.sharded`): the model sharded in place (FSDP2; the pipeline's stages) or wrapped (fairscale)."""

    def __init__(self, steps: ModelSteps, sharding: Any, mesh: Any, policy: Any, unit_classes: Any) -> None:
        self.steps = steps
        self.sharding = sharding
        self.mesh = mesh
        self.policy = policy
        self.unit_classes = unit_classes

    def apply(self, module: nn.Module) -> nn.Module:
        sharded = self.sharding.shard_model(module, self.sharding.shard_mesh(self.mesh), self.policy)
        return sharded if sharded is not None else module

    def compile(self, compilation: Compilation, module: nn.Module) -> None:
        self.steps.compile(compilation, module, self.unit_classes)
