"""Pipeline parallelism: the model's blocks split into consecutive stages, each on its own ranks, every batch cut
into micro-batches that flow through the stages (``torch.distributed.pipelining``: ``PipelineStage`` and its
GPipe, 1F1B and interleaved 1F1B schedules).

The model is the user's LightningModule, unchanged. Its blocks are the children of one ``nn.Sequential`` or
``nn.ModuleList`` that its forward calls in order (``for block in self.blocks: x = block(x)``); everything else
(embeddings, masks, positions, the final norm and head, the loss) is computed by the user's own ``training_step``.
Each stage runs that ``training_step`` on its micro-batch with hooks on the blocks: the blocks before the stage's
are skipped, the first block of the stage takes the activation received from the previous stage in place of its
first argument, and the forward stops after the stage's last block, whose output (its first tensor) is sent on.
The last stage runs the ``training_step`` to its end: its loss, scaled by ``1 / (micro-batches x
accumulate_grad_batches)``, is what the schedule's backward starts from (the ``1 / accumulate_grad_batches`` is
applied by Lightning's own backward of the loss the step returns), so the gradients are those of one process with
the same global batch. Under the fp16 loss scaler the schedule's backward starts from that loss times the loss
scale (:meth:`PipelineBackend.use_loss_scale`), as one process's backward of the scaled loss does, so every stage's
half-precision backward runs on scaled gradients. With ``loss_normalization="tokens"`` the last stage's
``training_step`` returns each micro-batch's sum of token losses and its ``num_tokens``: the sums are added, not
averaged, and the pipeline's step
returns ``{"loss": <the batch's sum>, "num_tokens": <the batch's count>}`` on every rank of the pipeline, so each
of its P ranks counts its replica's tokens (``parts/token_loss.py``: the all-reduce over all W ranks gives
``P x T``, and the rescale by ``W x k / (P x T)`` turns the synced gradients, ``sum / (replicas x k)``, into
``sum / T``). ``self.log`` calls made in ``training_step`` on the last stage are collected per
micro-batch, combined with their ``reduce_fx`` (the mean of equal micro-batches: the value of the whole batch),
and logged once on every rank of the pipeline.

Each rank trains the blocks of its stages and the parameters outside the blocks (their gradients are summed over
the stages, which handles weights tied between the embedding and the head). During training it holds only those:
at the first training step the storage of the other stages' blocks' parameters and buffers is freed (each keeps its
Parameter object, dtype and device, with an empty tensor in place of its values), so they have no gradient and no
optimizer state. Evaluation during fit runs through the stages too (:meth:`PipelineBackend.evaluation_step`): the
user's ``validation_step`` on each stage with its blocks, forward only, on the whole batch, its logs and output
those of the last stage on every rank of the pipeline. For a consolidated checkpoint, an evaluation loop whose
ranks may run different numbers of batches, and at the end of fit, the freed tensors are allocated again and each
block's weights are broadcast from the stage that trains them, so that every rank holds the trained model (an
evaluation step then runs it whole, data-parallel over the data replicas). MGPUPrecision's master modes are refused
before launch (each rank's optimizer would step FP32 masters of every block, the other stages' never trained
there). With
``compile=...`` each block's ``forward`` is compiled in place (``parts/compilation.py``) and the hooks above stay
eager; a block skipped as another stage's gets its compiled ``forward`` back after the step.

With tensor parallelism within the stages (``tensor_parallel_size > 1``: the plan applied over the mesh's tensor
dimension before :meth:`PipelineBackend.shard_model`), the pipeline group of a rank is the mesh's pipeline dimension
at its data and tensor coordinates, so stages exchange plain activations with the rank holding the same shards. The
blocks' ``DTensor`` parameters are freed and gathered by their local shards (each keeps its global shape), the
weights outside the blocks are summed over the stages per tensor coordinate, the clipping norm weighs each gradient
by ``1 / (the ranks holding its values)``, and the consolidated state is gathered over the tensor group.

With ``stage=3`` the data dimension shards each stage instead of replicating it (ZeRO-3 inside the pipeline, as
torchtitan composes pipeline and FSDP): each of this rank's stages (the ``PipelineStage``'s module) is one FSDP2
unit, ``fully_shard`` over the mesh's ``data_parallel`` dimension, so its blocks' parameters, gradients and
optimizer state are ``DTensor`` shards between optimizer steps. The unit is gathered at the step's first forward
and kept gathered (``reshard_after_forward=False``, as torchtitan does with a pipeline: one all-gather per optimizer
step); ``PipelineStage`` turns gradient sync off during the schedule, and the end of the schedule's step does not
reduce either
(:meth:`_ChunkedStage.perform_reduce_grad`): the gradients accumulate unsharded over every micro-batch and every
``accumulate_grad_batches`` batch, and :meth:`PipelineBackend.sync_gradients` reduce-scatters them once per
optimizer step, then scales them by what flowed into the step's loss. The parameters outside the blocks stay
replicated. For the probe, evaluation and :meth:`PipelineBackend.gather_blocks` the units are gathered whole
(``unshard``), and resharded at the next training step. With ``mesh="hybrid"`` (HSDP inside the pipeline) the
unit is sharded over the 2-D ``("data_replicate", "data_shard")`` mesh of its stage: the reduce-scatter stays in
the shard group and the replicas all-reduce their shards. With tensor parallelism too (torchtitan's pipeline x FSDP
x tensor), the plan splits the blocks first and FSDP2 shards their ``DTensor`` parameters over the data dimension
of the same mesh (2-D ``DTensor`` parameters on ``("data_parallel", "tensor_parallel")``). The clipping norm weighs
each gradient by ``1 / (the ranks of its stage holding the same values)``: HSDP's replicas of a shard, the tensor
ranks of a weight the plan leaves whole.

Example::

    backend = PipelineBackend(size=2, schedule="1f1b", microbatches=4, split="auto")  # the strategy's backend
    backend.shard_model(module, parallel_mesh)  # at set-up: the stages and their blocks
    loss = backend.training_step(module, 1, batch, batch_idx)  # all stages' forwards and backwards (k=1)
    loss.backward()  # Lightning's closure: the schedule's gradients land in .grad
    backend.sync_gradients()  # after the closure: the replicas and the weights outside the blocks
"""

from lightning_mgpu.parts.pipeline.backend import PipelineBackend
from lightning_mgpu.parts.pipeline.batches import check_loader_batches, combine_logs, split_batch
from lightning_mgpu.parts.pipeline.plan import (
    SHAPE_NEEDED,
    PipelineError,
    StagePlan,
    balanced_bounds,
    check_stage_count,
    master_precision_refusal,
    plan_stages,
)
from lightning_mgpu.parts.pipeline.runner import PipelineStats
from lightning_mgpu.parts.pipeline.stages import PipelineSyncControl

__all__ = [
    "SHAPE_NEEDED",
    "PipelineBackend",
    "PipelineError",
    "PipelineStats",
    "PipelineSyncControl",
    "StagePlan",
    "balanced_bounds",
    "check_loader_batches",
    "check_stage_count",
    "combine_logs",
    "master_precision_refusal",
    "plan_stages",
    "split_batch",
]
