"""What every mgpu strategy shows its users, read from its runtime and declared once: the ledger, the replica groups,
the DDP part's hook and micro-batching, the checkpointing state, ``add_tokens``.

Each strategy class assigns them (``comm_stats = properties.comm_stats``): class attributes, not a base class, so
that every strategy stays a direct subclass of Lightning's (the development page, "Strategies are plain classes").
What differs between strategies (their ``settings``, Lightning's hooks they override) stays in each class.

Two of Lightning's own properties are declared here too, each as Lightning's property with one half replaced
(``checkpoint_io``'s getter, ``precision_plugin``'s setter): the other half stays Lightning's, read from its
``Strategy`` at import (a rename there fails the import, naming it), and the getter Lightning's loop calls several
times a step is Lightning's own function, with nothing added.

Example::

    class MGPUDDPStrategy(DDPStrategy):
        comm_stats = properties.comm_stats      # trainer.strategy.comm_stats.summary()
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar, cast

from lightning_fabric.plugins import CheckpointIO
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import Strategy

from lightning_mgpu.ledger import CommStats
from lightning_mgpu.parts.fault_tolerance import ReplicaGroups
from lightning_mgpu.parts.micro_batching import MicroBatching
from lightning_mgpu.plugins.precision import PrecisionAdoption
from lightning_mgpu.settings import CommonSettings
from lightning_mgpu.strategies.runtime import Runtime

T = TypeVar("T")


def _reads(read: Callable[[Runtime], T], doc: str) -> T:
    """A read-only property of the strategy's runtime (typed as its value: the strategy's attribute reads as ``T``)."""

    def getter(strategy: Any) -> T:
        return read(strategy._runtime)

    return cast(T, property(getter, doc=doc))


def _public_name(strategy: Any) -> str:
    return type(strategy).__name__


public_name = cast(str, property(_public_name, doc="The strategy's class as users write it (what summaries print)."))

launch_settings: CommonSettings = _reads(
    lambda r: r.settings,
    "The settings every mgpu strategy has (launch, process group, ledger, activation checkpointing).",
)
ddp_settings: CommonSettings = _reads(
    lambda r: r.settings,
    "The launch settings and, where a DDP wrapper trains the model (``mgpu_ddp``, the sharded stage 1), the DDP ones "
    "(a :class:`~lightning_mgpu.settings.DDPSettings`).",
)
comm_stats: CommStats = _reads(
    lambda r: r.comm_stats, "The communication ledger of this rank (see :class:`~lightning_mgpu.CommStats`)."
)
replicas: Optional[ReplicaGroups] = _reads(
    lambda r: r.replicas,
    "The fault-tolerant replica groups (``fault_tolerance``): committed and dropped steps, heals, the last step's "
    "quorum; None where fault tolerance is off.",
)
comm_hook: Optional[str] = _reads(
    lambda r: r.ddp.settings.comm_hook if r.ddp is not None else None,
    "The DDP comm hook (``mgpu_ddp``, the sharded stage 1); None without one (stages 2 and 3 reduce-scatter).",
)
comm_hook_state: Any = _reads(
    lambda r: r.ddp.hook_state if r.ddp is not None else None,
    "The registered comm hook's state (e.g. torch's ``PowerSGDState``), available after set-up; else None.",
)
static_graph: bool = _reads(
    lambda r: r.ddp.settings.static_graph if r.ddp is not None else False,
    "Whether DDP runs in static-graph mode (False where no DDP wrapper trains the model).",
)
micro_batching: Optional[MicroBatching] = _reads(
    lambda r: r.ddp.micro if r.ddp is not None else None,
    "The micro-batching state (``micro_batch_size`` given): ``.size`` in use and ``.backoffs``; else None.",
)
activation_checkpointing: Any = _reads(
    lambda r: r.checkpointing.policy, "The activation-checkpointing policy (``None``: off)."
)
async_checkpoint: bool = _reads(
    lambda r: r.settings.async_checkpoint,
    "Whether checkpoints saved during fit are staged and written in the background.",
)
process_group_backend: Optional[str] = _reads(
    lambda r: r.settings.process_group_backend,
    "The process group's backend as given (``None``: chosen for the device, ``nccl`` on CUDA, ``gloo`` on the CPU); "
    "the strategies whose Lightning base has no such property declare it.",
)
timeout: Optional[timedelta] = _reads(lambda r: r.settings.timeout, "The process group's timeout for collectives.")
checkpoint_write_in_flight: bool = _reads(
    lambda r: r.checkpoints.write_in_flight,
    "Whether a background checkpoint write of this rank is running now (``async_checkpoint=True``).",
)


def _checkpoint_io(strategy: Any) -> CheckpointIO:
    """:class:`~lightning_mgpu.AtomicCheckpointIO` unless a plugin was given (then that one, as it is)."""
    return cast(CheckpointIO, strategy._runtime.checkpoint_io())


def _adopt_precision(strategy: Any, plugin: Optional[Precision]) -> None:
    """The precision plugin given, adopted (:class:`~lightning_mgpu.plugins.precision.PrecisionAdoption`), then
    stored as Lightning stores it."""
    store = _LIGHTNING_PRECISION.fset
    assert store is not None  # Lightning's property has a setter
    store(strategy, PrecisionAdoption.adopt(plugin))


_LIGHTNING_CHECKPOINT_IO: property = vars(Strategy)["checkpoint_io"]
_LIGHTNING_PRECISION: property = vars(Strategy)["precision_plugin"]
#: Lightning's ``checkpoint_io`` with the pack's getter (its setter Lightning's)
checkpoint_io: CheckpointIO = cast(CheckpointIO, _LIGHTNING_CHECKPOINT_IO.getter(_checkpoint_io))
#: Lightning's ``precision_plugin`` with a setter that adopts the plugin (its getter Lightning's; typed ``Any``: it
#: takes ``None`` and gives a ``Precision``, which a class attribute's one type cannot say)
precision_plugin: Any = _LIGHTNING_PRECISION.setter(_adopt_precision)


def add_tokens(self: Any, num_tokens: Any, loss_sum: Any = None) -> None:
    """Manual optimization with ``loss_normalization="tokens"``: count this micro-batch's tokens (and their summed
    loss, for the logged ``loss_per_token``) before its ``opt.step()``.

    Example::

        self.manual_backward(token_losses.sum())
        self.trainer.strategy.add_tokens(mask.sum(), token_losses.sum())
        opt.step()
    """
    self._runtime.add_tokens(num_tokens, loss_sum)
