"""Uneven training inputs: a clear error on every rank before the first step that cannot complete, instead of a hang.

Every training step of a distributed strategy is a collective (DDP's gradient all-reduce, the sharded stages'
gathers and reduce-scatters): a rank that runs out of batches before the others leaves them waiting forever.
Lightning's automatic ``DistributedSampler`` pads the shards to equal lengths, but an ``IterableDataset`` sharded by
rank or a sampler of your own can give the ranks different numbers of batches.

Two checks, chosen by the training loader:

* **a loader with a length** (a map-style dataset): at the first batch of every epoch, the ranks compare the number
  of batches Lightning will run (``trainer.num_training_batches``, limits applied): one small all-gather per epoch,
  nothing per step. Different counts raise :class:`UnevenInputsError` on every rank before the epoch's first step.
* **an iterable dataset** (no length, or a length that is only a hint): each batch is fetched, then the ranks agree
  whether every one of them got a batch (one all-reduce of one number per step). All got one: the step runs; none
  did: the epoch ends on every rank together; some did: :class:`UnevenInputsError` on every rank, naming the ranks
  that ran out, before that step.

Only the batches the epoch uses count (``limit_train_batches`` and ``max_steps`` applied). Nothing is dropped or
repeated silently: the run stops with the error, which names the fix (give every rank the
same number of batches, or bound the epoch with ``limit_train_batches``). ``check_uneven_inputs=False`` turns both
checks off (Lightning's behaviour: uneven inputs hang).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_mgpu import comm

FIX = (
    "Give every rank the same number of training batches (an IterableDataset sharded by rank must yield as many "
    "samples on each; a sampler of your own must give each rank a shard of the same length, e.g. torch's "
    "DistributedSampler, which pads), or bound the epoch with Trainer(limit_train_batches=N) where N is at most the "
    "smallest rank's count."
)


class UnevenInputsError(RuntimeError):
    """The ranks have different numbers of training batches: the first step some rank cannot take would hang.

    Raised on every rank (the same message) by the strategies with ``check_uneven_inputs=True``, before that step.

    >>> from lightning_mgpu import UnevenInputsError
    >>> from lightning_mgpu.parts.uneven_inputs import check_batch_counts
    >>> try:
    ...     check_batch_counts([3, 2], epoch=0)  # what each rank planned, compared once per epoch
    ... except UnevenInputsError as err:
    ...     print(str(err)[:62])
    Epoch 0 has 3 training batches on rank 0 and 2 on rank 1: ever
    >>> check_batch_counts([3, 3], epoch=0) is None
    True
    """


def check_batch_counts(counts: list[float], epoch: int) -> None:
    """Raise :class:`UnevenInputsError` if the ranks' planned batch counts for ``epoch`` differ (``inf``: no
    length, checked step by step instead).

    Example::

        check_batch_counts([5, 5], epoch=0)  # nothing
        check_batch_counts([5, 4], epoch=0)  # UnevenInputsError: Epoch 0 has 5 training batches on rank 0 and 4 ...
    """
    if any(math.isinf(c) for c in counts) or len(set(counts)) <= 1:
        return
    shown = " and ".join(
        f"{int(c)} on rank {r}" if r else f"{int(c)} training batches on rank {r}" for r, c in enumerate(counts)
    )
    raise UnevenInputsError(
        f"Epoch {epoch} has {shown}: every step is a collective, so the ranks with more batches would wait forever "
        f"for the others at step {int(min(counts))}. {FIX}"
    )


def agree_on_batches(have: bool, batches_done: int, device: Optional[torch.device] = None) -> bool:
    """One step of the agreement (a collective): whether every rank has its next batch; ``False`` when none has
    (the epoch ends together); raises :class:`UnevenInputsError` on every rank when only some have."""
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    flags = torch.zeros(world, dtype=torch.int32, device=device)
    flags[rank] = int(have)
    comm.all_reduce(flags)  # one element per rank: also says which ranks ran out
    count = int(flags.sum())
    if count == world:
        return True
    if count == 0:
        return False
    out = [r for r in range(world) if not flags[r]]
    raise UnevenInputsError(
        f"Rank{'s' if len(out) > 1 else ''} {', '.join(map(str, out))} ran out of training data after {batches_done} "
        f"batches of this epoch while the other ranks have more: step {batches_done} would wait forever. {FIX}"
    )


def needs_agreement(dataloader: object) -> bool:
    """Whether the loader's batch count is known only by iterating it (an iterable dataset, or no length)."""
    if not isinstance(dataloader, DataLoader):
        return False
    if isinstance(dataloader.dataset, IterableDataset):
        return True
    try:
        len(dataloader)
    except TypeError:
        return True
    return False


def agreed(
    dataloader: DataLoader, device: Optional[torch.device] = None, bound: Optional[Callable[[], float]] = None
) -> DataLoader:
    """``dataloader`` whose iteration agrees across ranks at every batch (:func:`agree_on_batches`). The loader is
    the copy Lightning made for this fit; it keeps its class (a subclass adds the agreement to ``__iter__``).
    ``bound``: read when an epoch's iteration starts, the batches the epoch will use (``limit_train_batches``,
    ``max_steps``); a batch past it is fetched without agreeing (Lightning fetches one ahead and never uses it)."""
    base = type(dataloader)
    if getattr(base, "_mgpu_agreed", False):
        return dataloader

    def __iter__(self: DataLoader) -> Iterator[Any]:
        iterator = base.__iter__(self)
        limit = bound() if bound is not None else math.inf
        done = 0
        while True:
            try:
                batch = next(iterator)
                have = True
            except StopIteration:
                batch, have = None, False
            if done >= limit:  # not used by this epoch: nothing to agree on
                if not have:
                    return
            elif not agree_on_batches(have, done, device):
                return
            done += 1
            yield batch

    cls = type(base.__name__, (base,), {"__iter__": __iter__, "_mgpu_agreed": True, "__module__": base.__module__})
    object.__setattr__(dataloader, "__class__", cls)
    return dataloader


class UnevenInputs:
    """The part: :func:`agreed` on iterable training loaders, :func:`check_batch_counts` at each epoch's first batch.

    Example (what the strategy's hooks call)::

        uneven = UnevenInputs(enabled=True)
        loader = uneven.process_dataloader(loader, trainer, device)
        uneven.on_train_batch_start(trainer)   # every batch; compares the counts once per epoch
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._checked_epoch: Optional[int] = None

    def process_dataloader(self, dataloader: object, trainer: Any, device: Optional[torch.device] = None) -> object:
        if not self.enabled or trainer is None or not trainer.training or trainer.world_size < 2:
            return dataloader
        if needs_agreement(dataloader):
            assert isinstance(dataloader, DataLoader)
            return agreed(dataloader, device, bound=lambda: planned_batches(trainer))
        return dataloader

    def on_train_batch_start(self, trainer: Any) -> None:
        if not self.enabled or trainer is None or trainer.world_size < 2:
            return
        epoch = trainer.current_epoch
        if self._checked_epoch == epoch:
            return
        self._checked_epoch = epoch
        check_batch_counts(comm.all_gather_object(planned_batches(trainer)), epoch)


def planned_batches(trainer: Any) -> float:
    """The batches this rank will run in the epoch that starts: Lightning's count (``limit_train_batches``
    applied), bounded by what ``max_steps`` leaves (``inf``: no length)."""
    planned = float(trainer.num_training_batches)
    if trainer.max_steps is not None and trainer.max_steps >= 0:
        left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
        planned = min(planned, float(max(left, 0)))
    return planned
