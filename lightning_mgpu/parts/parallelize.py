"""The one order in which the pack transforms a model for training, for every layout (torchtitan's ``parallelize``):

1. tensor parallelism (``tensor_parallel_size``: the plan names the model's own modules, so it splits them first);
2. activation checkpointing (inside the data dimension, so that DDP's and FSDP's hooks stay outside the recompute);
3. the data dimension: DDP's wrap (``mgpu_ddp``, ``MGPUShardedStrategy(stage=1)``), the sharding backend's shards
   (FSDP2 at stages 2 and 3, fairscale; with ``pipeline_parallel_size > 1``, each stage of this rank sharded over the
   data dimension by the pipeline's backend);
4. compilation (``compile=``), in place, after the wrap or the sharding.

SyncBatchNorm's conversion comes before it (in the strategy's set-up, as Lightning's ``DDPStrategy`` converts), the
optimizers after it (they hold the shards). A layout differs only in the :class:`DataDimension` it hands over and in
``split`` (nothing without tensor parallelism): the strategy's step object (``parts/steps.py``) splits the model and
chooses what compilation compiles (each block of the model, or of the pipeline's stages).

Example::

    model = parallelize(module, data, checkpointing=runtime.checkpointing, compilation=runtime.compilation,
                        split=lambda m: steps.split(m, mesh.tensor, None))
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

from torch import nn

from lightning_mgpu.parts.activation_checkpointing import ActivationCheckpointing
from lightning_mgpu.parts.compilation import Compilation


class DataDimension(Protocol):
    """The data dimension of a layout, step 3 of :func:`parallelize`."""

    def apply(self, module: nn.Module) -> nn.Module:
        """Wrap or shard ``module`` over the data dimension; returns the model Lightning trains (a wrapper, or the
        module itself where it is sharded in place)."""
        ...

    def compile(self, compilation: Compilation, module: nn.Module) -> None:
        """Compile what this layout compiles, after :meth:`apply`."""
        ...


def parallelize(
    module: nn.Module,
    data: DataDimension,
    *,
    checkpointing: ActivationCheckpointing,
    compilation: Compilation,
    split: Optional[Callable[[nn.Module], Any]] = None,
) -> nn.Module:
    """``module`` made ready for training in the one order of this module: ``split`` (tensor parallelism, where
    given), activation checkpointing, ``data`` (the data dimension), compilation. Returns the model Lightning trains."""
    if split is not None:
        split(module)
    checkpointing.apply(module)
    model = data.apply(module)
    data.compile(compilation, module)
    return model
