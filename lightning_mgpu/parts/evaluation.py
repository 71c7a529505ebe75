"""Exact evaluation: validate, test and predict see every sample exactly once, and every rank runs the same number
of batches.

Lightning shards evaluation loaders with torch's ``DistributedSampler``, which pads the last shard with repeated
samples so that every rank gets as many: the epoch value of ``self.log(name, value, sync_dist=True)`` then counts
the repeats (37 samples on 2 ranks in batches of 4: 38 samples are evaluated). Prediction uses an unpadded sampler,
whose shards may differ by one batch: a strategy whose forward is a collective (the sharded stages gather the
parameters in every forward) then waits forever on the rank with the extra batch.

Here Lightning's automatic sampler is replaced by :class:`EvenBatchSampler`: each rank takes every
``world_size``-th sample (as Lightning's samplers do, without padding) and cuts its share into the *same number*
of batches on every rank, ``ceil(ceil(N / world_size) / batch_size)``; the batches hold ``batch_size`` samples
except the last ones of a rank, which hold fewer (never none). With no sample counted twice, Lightning's own
reduction of a logged mean is exact: it sums ``value * batch_size`` and ``batch_size`` over the batches and the
ranks and divides, i.e. each batch is weighted by its size (the first dimension of the batch's first tensor, or
``self.log(..., batch_size=n)``).

Where equal counts are impossible without an empty batch (``batch_size=1`` and a set that does not divide by the
world size, e.g.), the shards stay exact and their batch counts differ by one; a sharded strategy then gathers its
parameters once for the loop (:meth:`lightning_mgpu.parts.sharding.ShardingBackend.start_uneven_evaluation`). A set
smaller than the world size keeps Lightning's padded sampler (a warning says so): every rank needs a sample.

Lightning warns, for ``trainer.validate`` and ``trainer.test`` on several devices, that its ``DistributedSampler``
"replicates some samples". Where this part replaces that sampler nothing is replicated, so the warning is held back
from the moment Lightning builds its sampler until the part has seen the loader; a loader that keeps Lightning's
sampler (a sampler of your own, ``drop_last=True``) and is padded gets a warning of the part's own instead.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sized
from typing import Any, Optional

import torch
from pytorch_lightning.overrides.distributed import UnrepeatedDistributedSampler
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler

from lightning_mgpu import _compat, comm


def common_batch_count(total: int, world_size: int, batch_size: int) -> Optional[int]:
    """The number of batches every rank gets from :class:`EvenBatchSampler` for ``total`` samples, or ``None``
    where equal counts would need an empty batch (a share smaller than the count).

    >>> common_batch_count(37, 2, 4)  # shares of 19 and 18 samples: 5 batches each
    5
    >>> common_batch_count(37, 2, 1) is None  # 19 and 18 batches of one sample
    True
    """
    if total < world_size:
        return None
    count = math.ceil(math.ceil(total / world_size) / batch_size)
    return count if total // world_size >= count else None


def batch_sizes(share: int, count: int, batch_size: int) -> list[int]:
    """``share`` samples cut into ``count`` batches of at most ``batch_size``: full batches first, then one
    partial batch, then batches of one sample, so that none is empty (``count <= share <= count * batch_size``).

    >>> batch_sizes(18, 5, 4)
    [4, 4, 4, 4, 2]
    >>> batch_sizes(6, 5, 4)
    [2, 1, 1, 1, 1]
    """
    sizes = []
    left = share
    for i in range(count):
        later = count - i - 1  # batches after this one, each needs a sample
        size = min(batch_size, left - later)
        sizes.append(size)
        left -= size
    return sizes


class UnpaddedShard(DistributedSampler):
    """This rank's share of ``dataset``: every ``num_replicas``-th index from ``rank`` of the epoch's order
    (``DistributedSampler``'s permutation of ``seed + epoch`` when ``shuffle``), without padding. A
    ``DistributedSampler`` (same attributes and ``set_epoch``) whose shards may differ in length by one.

    >>> list(UnpaddedShard(range(5), num_replicas=2, rank=1))
    [1, 3]
    """

    def __init__(self, dataset: Sized, num_replicas: int, rank: int, shuffle: bool = False, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)  # type: ignore[arg-type]
        self.total_size = len(dataset)
        self.num_samples = len(range(rank, self.total_size, num_replicas))

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.total_size, generator=generator).tolist()
        else:
            order = list(range(self.total_size))
        return iter(order[self.rank :: self.num_replicas])


class EvenBatchSampler(Sampler[list[int]]):
    """Cuts this rank's ``shard`` (a sampler of its indices) into batches of at most ``batch_size``: ``count``
    batches, the same on every rank (see :func:`common_batch_count`), or, where ``count`` is ``None``, the shard
    in batches of ``batch_size`` and a last smaller one (counts may then differ by one between ranks).

    The strategies put one into every evaluation loader where Lightning injects its sampler
    (``exact_evaluation=True``); to build one yourself (``use_distributed_sampler=False``)::

        shard = UnpaddedShard(dataset, num_replicas=trainer.world_size, rank=trainer.global_rank)
        count = common_batch_count(len(dataset), trainer.world_size, 8)
        DataLoader(dataset, batch_sampler=EvenBatchSampler(shard, batch_size=8, count=count))

    >>> from lightning_mgpu import EvenBatchSampler
    >>> from lightning_mgpu.parts.evaluation import UnpaddedShard, common_batch_count
    >>> count = common_batch_count(37, 2, 4)  # 37 samples, 2 ranks, batches of 4: 5 batches on each rank
    >>> ranks = [list(EvenBatchSampler(UnpaddedShard(range(37), 2, rank), 4, count)) for rank in (0, 1)]
    >>> [[len(batch) for batch in batches] for batches in ranks]
    [[4, 4, 4, 4, 3], [4, 4, 4, 4, 2]]
    >>> sorted(i for batches in ranks for batch in batches for i in batch) == list(range(37))  # each sample once
    True
    """

    def __init__(self, shard: Sampler[int], batch_size: int, count: Optional[int]) -> None:
        self.sampler = shard  # Lightning's set_epoch and shuffle checks look here
        self.batch_size = batch_size
        self.count = count
        self.drop_last = False

    def _sizes(self, share: int) -> list[int]:
        if self.count is None:
            full, rest = divmod(share, self.batch_size)
            return [self.batch_size] * full + ([rest] if rest else [])
        return batch_sizes(share, self.count, self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        indices = list(self.sampler)
        start = 0
        for size in self._sizes(len(indices)):
            yield indices[start : start + size]
            start += size

    def __len__(self) -> int:
        assert isinstance(self.sampler, Sized)
        return len(self._sizes(len(self.sampler)))

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)  # type: ignore[attr-defined]


def _predict_shard(batch_sampler: Any) -> Optional[tuple[UnrepeatedDistributedSampler, int]]:
    """The unpadded sampler Lightning put into a prediction loader (inside its index-tracking wrapper), and the
    batch size."""
    inner = _compat.tracked_batch_sampler(batch_sampler)
    if type(inner) is not BatchSampler or inner.drop_last:
        return None
    shard = inner.sampler
    return (shard, inner.batch_size) if isinstance(shard, UnrepeatedDistributedSampler) else None


class ExactEvaluation:
    """The part: puts :class:`EvenBatchSampler` into the evaluation loaders where Lightning put its automatic
    sampler (``enabled``; ``exact_evaluation=False`` keeps Lightning's).

    Replaced: a loader with a plain ``BatchSampler`` (``batch_size=...``, ``drop_last=False``) around the
    ``DistributedSampler`` (validate, test) or the unpadded sampler (predict) that Lightning injected. Kept as they
    are: a sampler or batch sampler of your own (Lightning wraps it in its ``DistributedSamplerWrapper``, which pads),
    ``drop_last=True``, ``use_distributed_sampler=False``, iterable datasets.

    Example (what the strategy's hooks call)::

        evaluation = ExactEvaluation(enabled=True)
        evaluation.sampler_requested()                    # distributed_sampler_kwargs: Lightning builds one
        loader = evaluation.process_dataloader(loader, trainer)
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._injected = False
        self._held: Optional[tuple[Any, ...]] = None  # the filter holding back Lightning's padding warning
        self._injected_was = False

    def sampler_requested(self) -> None:
        # Lightning reads distributed_sampler_kwargs only to build its automatic sampler, and hands that loader to
        # process_dataloader next. Between the two it warns that its DistributedSampler pads (validate, test):
        # held back until the part knows whether the loader keeps that sampler.
        self._injected = True
        if self.enabled and self._held is None:
            warnings.filterwarnings("ignore", message=_PADDING_WARNING)
            self._held = warnings.filters[0]

    def _release(self) -> None:
        if self._held is not None:
            filters: Any = warnings.filters  # a list (typed as a Sequence)
            if self._held in filters:  # an "ignore" entry leaves no trace in the warning registries
                filters.remove(self._held)
            self._held = None

    def process_dataloader(self, dataloader: object, trainer: Any) -> object:
        self._release()
        replaced = self._replace(dataloader, trainer)
        if replaced is None:
            _warn_if_padded(dataloader, trainer, held_back=self.enabled and self._injected_was)
            return dataloader
        return replaced

    def _replace(self, dataloader: object, trainer: Any) -> Optional[object]:
        """The loader with :class:`EvenBatchSampler`, or ``None`` where it keeps its sampler."""
        injected, self._injected = self._injected, False
        self._injected_was = injected
        if not self.enabled or not injected or trainer is None or trainer.training:
            return None
        if not isinstance(dataloader, DataLoader):
            return None
        batch_sampler = dataloader.batch_sampler
        shard: Any
        if trainer.predicting:
            found = _predict_shard(batch_sampler)
            if found is None:
                return None
            shard, batch_size = found
            total, world = shard.total_size, shard.num_replicas
        else:
            sampler = dataloader.sampler
            if type(sampler) is not DistributedSampler or type(batch_sampler) is not BatchSampler:
                return None
            batch_size = batch_sampler.batch_size
            if batch_sampler.drop_last:
                return None
            total, world = len(sampler.dataset), sampler.num_replicas  # type: ignore[arg-type]
            if total < world:
                rank_zero_warn(
                    f"The evaluation set has {total} samples for {world} ranks: every rank needs one, so Lightning's "
                    f"padded DistributedSampler is kept and the repeated samples are counted in the logged epoch "
                    f"values. Evaluate on fewer devices (Trainer(devices=1)) for exact values."
                )
                return None
            shard = UnpaddedShard(sampler.dataset, world, sampler.rank, shuffle=sampler.shuffle, seed=sampler.seed)  # type: ignore[arg-type]
        if world < 2:
            return None  # one rank: Lightning's sampler already yields every sample once, nothing is padded
        count = common_batch_count(total, world, batch_size)
        batches: Any = EvenBatchSampler(shard, batch_size, count)
        if trainer.predicting:
            batches = _compat.index_tracking_batch_sampler(batches)  # the indices Lightning's writers read
        # The loader is the copy Lightning has just made for this stage (it re-creates a loader to inject its
        # sampler); DataLoader refuses new samplers after construction, its iteration reads these two attributes.
        object.__setattr__(dataloader, "batch_sampler", batches)
        object.__setattr__(dataloader, "sampler", shard)
        return dataloader


_PADDING_WARNING = r"Using `DistributedSampler` with the dataloaders\. During `trainer\.\w+\(\)`"


def _warn_if_padded(dataloader: object, trainer: Any, held_back: bool) -> None:
    """Lightning's padding warning, held back while the part looked at the loader, in the part's words: only for
    validate and test (where Lightning warns), and only when the kept sampler does repeat samples."""
    if not held_back or trainer is None or trainer.state.fn not in (TrainerFn.VALIDATING, TrainerFn.TESTING):
        return
    sampler = getattr(dataloader, "sampler", None)
    if not isinstance(sampler, DistributedSampler) or sampler.num_replicas < 2 or sampler.drop_last:
        return
    total = len(sampler.dataset)  # type: ignore[arg-type]  # DistributedSampler takes sized datasets only
    if total % sampler.num_replicas == 0 or total < sampler.num_replicas:  # even, or said by _replace already
        return
    rank_zero_warn(
        f"`trainer.{trainer.state.fn.value}()` on {sampler.num_replicas} ranks keeps Lightning's `DistributedSampler` "
        f"for this loader (a sampler or batch sampler of your own, or drop_last=True), which repeats "
        f"{sampler.num_replicas - total % sampler.num_replicas} sample(s) so that every rank gets as many: the logged "
        f"epoch values count them. With the default sampler and drop_last=False the pack's exact evaluation "
        f"evaluates each sample once."
    )


def planned_counts_differ(counts: list[float]) -> bool:
    """Whether the ranks' planned numbers of evaluation batches (one entry per rank, ``inf`` when unknown) may
    differ, i.e. whether a collective in every forward could be left waiting."""
    return any(math.isinf(c) for c in counts) or len(set(counts)) > 1


def running_evaluation_loop(trainer: Any) -> Any:
    """The evaluation loop ``trainer`` runs now: fit's validation loop, or validate's, test's or predict's."""
    if trainer.predicting:
        return trainer.predict_loop
    if trainer.testing:
        return trainer.test_loop
    return trainer.fit_loop.epoch_loop.val_loop if trainer.state.fn == TrainerFn.FITTING else trainer.validate_loop


class UnevenLoops:
    """A sharded model's evaluation loops whose ranks may run different numbers of batches (``batch_size=1`` and a
    set that does not divide by the world size, a sampler of your own, ``limit_val_batches`` that differ): every
    forward of a sharded model is a collective (FSDP2 gathers the parameters, fairscale's ShardedDataParallel
    broadcasts its buffers), so the rank with the extra batch would wait for ever. At the start of each loop one
    all-gather of the ranks' planned batch counts says whether they may differ; if so the sharding backend does the
    forward's collective once for the loop (:meth:`~lightning_mgpu.parts.sharding.ShardingBackend.
    start_uneven_evaluation`), and undoes it at the loop's end.

    Example (the sharded strategy's ``on_validation_start`` / ``on_validation_end``)::

        loops = UnevenLoops()
        loops.start(trainer, model, sharding, world_size=2)
        ...
        loops.end(sharding)
    """

    def __init__(self) -> None:
        self._gathered: Any = None  # the model whose loop runs with its forward's collective done once

    def start(self, trainer: Any, model: Any, sharding: Any, world_size: int) -> None:
        """Before an evaluation loop, on every rank (a collective where the model's forward is one)."""
        if trainer is None or model is None or world_size < 2 or not sharding.forward_is_collective(model):
            return
        planned = float(sum(running_evaluation_loop(trainer).max_batches))
        if planned_counts_differ(comm.all_gather_object(planned)):
            sharding.start_uneven_evaluation(model)
            self._gathered = model

    def end(self, sharding: Any) -> None:
        """After the loop: every forward a collective again (FSDP2: back to the shards)."""
        if self._gathered is not None:
            model, self._gathered = self._gathered, None
            sharding.end_uneven_evaluation(model)
