"""Mid-epoch resume: a ``DistributedSampler`` whose place in the epoch travels in the checkpoint.

What Lightning 2.6.6 does when ``Trainer.fit(ckpt_path=...)`` resumes from a checkpoint written mid-epoch
(``FitLoop.setup_data``/``reset``, ``_TrainingEpochLoop.reset``/``on_run_start``): it restores its counters
(epoch, ``batch_idx``, optimizer steps, so accumulation windows stay aligned) and calls ``set_epoch`` with the
same epoch (same permutation), but a torch ``DataLoader`` has no position: its new iterator starts at the
epoch's first batch, and the epoch ends when the restored counter reaches the epoch's length. The first j
batches of the interrupted epoch are trained on twice and its last j never (measured in
``tests/integration/parts/test_resume.py``); Lightning only warns that the dataloader "is not resumable". With
``num_workers > 0`` even an end-of-epoch checkpoint resumes wrongly: the resumed epoch's iterator is created
(and the workers draw their indices) before ``set_epoch``, so it gets the permutation of epoch 0. A loader with
``state_dict``/``load_state_dict`` is saved in ``loops.fit_loop.state_dict.combined_loader`` and given its
state back before the epoch's iterator is created.

What this module adds (``MGPUDDPStrategy`` and ``MGPUShardedStrategy`` use it for the training loader, see
:func:`resumable_train_loader`):

* :class:`ResumableDistributedSampler`: torch's ``DistributedSampler`` (the same permutation for
  ``seed + epoch``, the same padding and per-rank split) that can begin an epoch after its first ``s`` samples.
* The position ``s`` is counted in the epoch's *global* order: after j micro-batches of ``b`` samples on
  each of ``N`` ranks the ranks have consumed exactly the first ``j * N * b`` entries of the permutation
  (rank r takes entries r, r+N, ..., so micro-batch j is the contiguous block ``[j*N*b, (j+1)*N*b)``).
  Resumed on ``N'`` ranks with ``N' * b' == N * b`` the remaining entries are split across the ``N'`` ranks:
  the run continues with the same global micro-batches, and no sample is used twice or skipped.
* Mid-epoch positions go into the checkpoint under :data:`POSITION_KEY` (a top-level key, which plain
  Lightning ignores: a checkpoint written here still resumes without this package, replaying as above).
* On any resume the sampler gets the resumed epoch before the iterator exists (right with workers too).
* A checkpoint written inside an accumulation window holds no gradients: the samples still continue exactly,
  but the window's step lacks the gradients of the micro-batches before the save (a warning says so).

Loaders with a state of their own (torchdata's ``StatefulDataLoader``, litdata's ``StreamingDataLoader``), which
plain Lightning resumes wrongly (measured in the tests' negative control):

* A ``StatefulDataLoader`` with Lightning's automatic sampler gets the resumable sampler in its batch sampler
  (its own state is replaced by the position): exact at the same and at another world size.
* Lightning saves only rank 0's loader states and loads them on every rank; :func:`gather_loader_states` saves
  every rank's under :data:`LOADER_STATES_KEY` and :func:`restore_loader_states` gives each rank its own. At
  another world size a mid-epoch state counted per rank (a ``StatefulDataLoader`` with the user's sampler) is
  refused when the checkpoint is loaded; litdata's, counted across ranks, is re-split by litdata.
* Every training sampler gets the resumed epoch before the iterator exists (see :func:`set_epoch_now`).
* litdata's ``restore`` flag is cleared at the resumed epoch's last batch (:meth:`MidEpochResume.batch_started`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, MutableMapping
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.distributed import DistributedSamplerWrapper
from pytorch_lightning.trainer.states import RunningStage
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

from lightning_mgpu import comm
from lightning_mgpu._compat import update_dataloader, wrapped_sampler

POSITION_KEY = "mgpu_sampler_position"
"""Top-level checkpoint key of a mid-epoch position (absent in checkpoints written at an epoch's end)."""
LOADER_STATES_KEY = "mgpu_loader_states"
"""Top-level checkpoint key of every rank's states of the training loaders that keep their own position
(``StatefulDataLoader``, litdata's ``StreamingDataLoader``), with the world size they were written at."""
_FORMAT = "lightning_mgpu.sampler_position"
_STATES_FORMAT = "lightning_mgpu.loader_states"
# the entries of a position that decide the epoch's global order: resuming with another value would make the
# "first s samples" other samples
_ORDER_FIELDS = ("dataset_size", "shuffle", "seed")


class ResumableDistributedSampler(DistributedSampler):
    """torch's :class:`~torch.utils.data.DistributedSampler` that can start an epoch part-way through.

    Without :meth:`skip` it yields exactly what ``DistributedSampler`` yields (same arguments, same
    ``set_epoch``). ``skip(epoch, consumed)`` makes the next iteration of ``epoch`` leave out the first
    ``consumed`` samples of the epoch's global order (:meth:`global_order`) and split the rest across this
    run's ranks, padded or trimmed to a multiple of ``num_replicas`` as torch does. ``len()`` stays the whole
    epoch's share: Lightning counts a resumed epoch's batches from its beginning.

    ``MGPUDDPStrategy`` and ``MGPUShardedStrategy`` put one in place of Lightning's automatic sampler and save
    its position in checkpoints. To keep a sampler of your own (``use_distributed_sampler=False``), build
    this one in your ``train_dataloader`` and the strategies save and restore it the same way::

        sampler = ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=7)
        return DataLoader(dataset, batch_size=8, sampler=sampler)

    Example (rank 1 of 2 over 10 samples, without shuffling; then the same epoch resumed after 6 samples):

        >>> from lightning_mgpu import ResumableDistributedSampler
        >>> sampler = ResumableDistributedSampler(range(10), num_replicas=2, rank=1, shuffle=False)
        >>> list(sampler)
        [1, 3, 5, 7, 9]
        >>> sampler.skip(0, 6)
        >>> list(sampler), len(sampler)  # the rest of epoch 0 split over the ranks; len() is the whole epoch's
        ([7, 9], 5)
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self._skip = 0  # samples of this epoch's global order that the next iteration leaves out

    @property
    def dataset_size(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # DistributedSampler needs a sized dataset

    def global_order(self) -> list[int]:
        """This epoch's order of the whole dataset before padding and the split across ranks (torch's: one
        ``randperm`` from a generator seeded with ``seed + epoch``, or ``0..n-1`` without shuffling)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(self.dataset_size, generator=g).tolist()
        return list(range(self.dataset_size))

    def __iter__(self) -> Iterator[int]:
        # A generator: the order is drawn, and the position used up, at the first index taken. torch's loader
        # iterator with workers calls iter() twice when it is created (in __init__ and again in _reset) and
        # draws only from the second, so an eager iter() would spend the position on the first (measured: a
        # StatefulDataLoader with num_workers=1 restarted the epoch).
        order = self.global_order()
        rest = order[self._skip :]
        self._skip = 0  # a second pass over the same epoch (another fit) starts at its beginning
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % self.num_replicas]
        elif (pad := -len(rest) % self.num_replicas) and order:
            # torch pads with the epoch's first samples (repeated when the dataset is smaller than the padding)
            rest += (order * math.ceil(pad / len(order)))[:pad]
        yield from rest[self.rank :: self.num_replicas]

    def set_epoch(self, epoch: int) -> None:
        # Lightning calls set_epoch(e) at every epoch start, also for the resumed epoch: keep the position then
        if epoch != self.epoch:
            self._skip = 0
        super().set_epoch(epoch)

    def skip(self, epoch: int, consumed: int) -> None:
        """Make the next iteration the rest of ``epoch`` after the first ``consumed`` samples of its global order."""
        if consumed < 0:
            raise ValueError(f"consumed must be >= 0, got {consumed}.")
        self.epoch = epoch
        self._skip = consumed


def _saved_in_on_train_batch_end(trainer: pl.Trainer) -> bool:
    """Lightning's test (``_TrainingEpochLoop.update_restart_stage``) for a checkpoint written in
    ``on_train_batch_end``: the batch is processed but not yet marked completed."""
    # typed as ready/completed trackers; a _BatchProgress holds _ProcessedTrackers (+ started, processed)
    total: Any = trainer.fit_loop.epoch_loop.batch_progress.total
    return bool(total.ready == total.started == total.processed == total.completed + 1)


def batches_done(trainer: pl.Trainer) -> int:
    """Batches of the current epoch that a run resumed from a checkpoint written now counts as done.

    Lightning's rule (``_TrainingEpochLoop.reset``): a checkpoint written in ``on_train_batch_end``
    (``ModelCheckpoint(every_n_train_steps=...)``) counts that batch; written anywhere else (validation end,
    epoch end, ``on_train_batch_start``), only the completed batches count: an unfinished batch runs again.
    """
    completed = trainer.fit_loop.epoch_loop.batch_progress.current.completed
    return completed + 1 if _saved_in_on_train_batch_end(trainer) else completed


def resumed_epoch(trainer: pl.Trainer) -> int:
    """While a resumed fit builds its training loader: the epoch it will train first, i.e. what
    ``FitLoop.on_advance_start`` passes to ``set_epoch`` once ``FitLoop.reset`` has run (the epoch in progress,
    or the next one when the checkpoint was written in ``on_train_batch_end`` of an epoch's last batch)."""
    current: Any = trainer.fit_loop.epoch_progress.current  # typed as ready/completed; holds `processed`
    last_batch_done = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch and _saved_in_on_train_batch_end(trainer)
    return int(current.processed) + 1 if last_batch_done else int(current.processed)


def _in_on_train_batch_start(trainer: pl.Trainer) -> bool:
    """A batch is drawn and has not started (``on_train_batch_start``): a state taken now resumes with it."""
    total: Any = trainer.fit_loop.epoch_loop.batch_progress.total
    return bool(total.ready == total.completed + 1 and total.started == total.completed)


def mid_epoch(trainer: pl.Trainer) -> bool:
    """Whether a checkpoint written now resumes inside an epoch: some of its batches are done and the last one
    is not (after the last batch, Lightning's resume moves on to the next epoch). In ``on_train_batch_start`` (where
    a fault-tolerant replica group's state is taken for a healing one) the drawn batch is still to run, the epoch's
    last included."""
    batch = trainer.fit_loop.epoch_loop.batch_progress
    return batches_done(trainer) > 0 and (not batch.is_last_batch or _in_on_train_batch_start(trainer))


def _is_torchdata(obj: object, name: str, package: str = "torchdata.") -> bool:
    """Whether ``obj`` is the class ``name`` of ``package`` (torchdata's, or litdata's; both optional, so
    recognised by name instead of imported)."""
    cls = type(obj)
    return cls.__name__ == name and cls.__module__.startswith(package)


def order_sampler(dataloader: object) -> Optional[Any]:
    """The sampler that orders a loader's samples when its batches are consecutive runs of ``batch_size`` of
    them: torch's ``BatchSampler`` (a loader with ``batch_size``), or torchdata's (the same batches, with an
    iterator that remembers its place: what ``StatefulDataLoader`` uses). ``None`` for a batch sampler of the
    user's, or none."""
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if type(batch_sampler) is BatchSampler or _is_torchdata(batch_sampler, "BatchSampler"):
        return batch_sampler.sampler  # type: ignore[union-attr]
    return None


def _replacement(sampler: Any, dataloader: DataLoader) -> Optional[ResumableDistributedSampler]:
    """Our sampler in place of the one Lightning injected, with the same arguments: for torch's
    ``DistributedSampler`` (a loader with ``shuffle``, or torch's samplers) the same order; for the
    ``DistributedSamplerWrapper`` Lightning puts around torchdata's ``RandomSampler`` (``StatefulDataLoader(...,
    shuffle=True)``) torch's shuffled order for the wrapper's seed, the order a torch ``DataLoader(...,
    shuffle=True)`` gets. ``None`` for any other sampler (kept)."""
    if type(sampler) is DistributedSampler:
        dataset, shuffle = sampler.dataset, sampler.shuffle
    elif type(sampler) is DistributedSamplerWrapper and _is_torchdata(wrapped_sampler(sampler), "RandomSampler"):
        inner = wrapped_sampler(sampler)
        dataset, shuffle = dataloader.dataset, True
        if inner.replacement or inner.num_samples != len(dataset):  # type: ignore[arg-type]  # a map-style dataset
            return None  # sampling with replacement or a part of the data: an order of its own
    else:
        return None
    return ResumableDistributedSampler(
        dataset,
        num_replicas=sampler.num_replicas,
        rank=sampler.rank,
        shuffle=shuffle,
        seed=sampler.seed,
        drop_last=sampler.drop_last,
    )


def set_epoch_now(dataloader: object, epoch: int) -> None:
    """Give the loader's samplers the resumed epoch before the epoch's iterator exists. Lightning creates the
    iterator in ``setup_data`` and calls ``set_epoch`` only afterwards: torch's workers, and a
    ``StatefulDataLoader`` fast-forwarding to its saved position, draw the indices at once, from the
    sampler's initial epoch 0."""
    samplers = {id(s): s for s in (getattr(dataloader, "sampler", None), order_sampler(dataloader))}
    for sampler in samplers.values():
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


def resumable_train_loader(
    dataloader: object, trainer: pl.Trainer, *, injected: bool, position: Optional[dict[str, Any]]
) -> tuple[object, bool]:
    """The training loader with a resumable sampler, whose position Lightning saves and restores with its
    loop state (the loader gets ``state_dict``/``load_state_dict``).

    The sampler is replaced only where Lightning put in its own automatic sampler (``injected``: Lightning
    asked the strategy for ``distributed_sampler_kwargs`` for this very loader): torch's ``DistributedSampler``,
    or, in a torchdata ``StatefulDataLoader(..., shuffle=True)``, the ``DistributedSamplerWrapper`` around
    torchdata's ``RandomSampler``. A :class:`ResumableDistributedSampler` the user built is adopted as it is.
    Any other sampler (one you set, Lightning's wrapper around a custom sampler, ``use_distributed_sampler=False``)
    is kept; a loader with a ``state_dict`` of its own resumes through it (``MidEpochResume`` keeps its state
    per rank). (A ``DistributedSampler`` you build from ``trainer.distributed_sampler_kwargs`` inside
    ``train_dataloader`` also sets that flag and is replaced, by one with its own arguments: the same order.)
    ``position``: what :func:`take_position` found in the checkpoint. Returns the loader and whether it took
    ``position`` (with several training loaders, the position belongs to the one that can take it).
    """
    if trainer.fit_loop.is_resuming:  # a checkpoint was loaded (`restarting` is False after a finished epoch)
        set_epoch_now(dataloader, resumed_epoch(trainer))
    sampler = order_sampler(dataloader)
    if sampler is None:
        # a batch sampler of the user's decides the batches: the position cannot be counted in samples
        _warn_if_resuming_mid_epoch(position, "it has a batch_sampler of its own")
        return dataloader, False
    if not isinstance(sampler, ResumableDistributedSampler):
        ours = _replacement(sampler, dataloader) if injected and isinstance(dataloader, DataLoader) else None
        if ours is None or not isinstance(dataloader, DataLoader):
            _warn_if_resuming_mid_epoch(position, f"its sampler ({type(sampler).__name__}) is yours")
            return dataloader, False
        if type(dataloader.batch_sampler) is BatchSampler:
            try:
                # Lightning's own re-instantiation, the one that put its DistributedSampler in (custom DataLoader
                # subclasses included, from the arguments it recorded)
                dataloader = update_dataloader(dataloader, ours, RunningStage.TRAINING)
            except MisconfigurationException as err:
                _warn_if_resuming_mid_epoch(position, f"it cannot be re-created with another sampler ({err})")
                return dataloader, False
        else:
            # torchdata's BatchSampler, which Lightning built for this fit around its sampler: swap the sampler in
            # it (the StatefulDataLoader itself keeps every other argument)
            dataloader.batch_sampler.sampler = ours  # type: ignore[union-attr]  # a BatchSampler, see order_sampler
        sampler = ours
        if trainer.fit_loop.is_resuming:
            sampler.set_epoch(resumed_epoch(trainer))  # see set_epoch_now
    assert isinstance(dataloader, DataLoader) and dataloader.batch_sampler is not None
    batch_size: int = dataloader.batch_sampler.batch_size  # type: ignore[attr-defined]
    _attach_position(dataloader, sampler, trainer, batch_size)
    if position is not None:
        apply_position(sampler, position, batch_size, trainer.accumulate_grad_batches)
        return dataloader, True
    if trainer.fit_loop.is_resuming and mid_epoch(trainer):
        rank_zero_warn(
            f"This checkpoint was written {batches_done(trainer)} batches into an epoch without a sampler position "
            f"(by plain Lightning, or with another training loader): the resumed epoch starts again at its first "
            f"batch and stops when Lightning's batch count is reached, so {batches_done(trainer)} batches are used "
            f"twice and as many are left out. Resume from an end-of-epoch checkpoint, or from one written with "
            f"lightning_mgpu's resumable sampler."
        )
    return dataloader, False


def _attach_position(
    dataloader: DataLoader, sampler: ResumableDistributedSampler, trainer: pl.Trainer, batch_size: int
) -> None:
    # Instance attributes make the loader match Lightning's `_Stateful` protocol: FitLoop.on_save_checkpoint
    # stores state_dict() with the loop state, Lightning no longer warns that the loader is not resumable, and
    # load_state_dict() is called before the epoch's iterator is created. The loader is the copy Lightning
    # (or `_update_dataloader` above) made for this fit, not an object of the user's. On a StatefulDataLoader
    # they take the place of its own methods: the position is the sampler's, counted in the global order.
    micro_batch = batch_size * sampler.num_replicas

    def state_dict() -> dict[str, Any]:
        done = batches_done(trainer)
        return {
            "format": _FORMAT,
            "version": 1,
            "epoch": sampler.epoch,
            "consumed": done * micro_batch,
            "complete": not mid_epoch(trainer),
            "micro_batch": micro_batch,
            "batch_size": batch_size,
            "world_size": sampler.num_replicas,
            "dataset_size": sampler.dataset_size,
            "shuffle": sampler.shuffle,
            "seed": sampler.seed,
        }

    def load_state_dict(state: dict[str, Any]) -> None:
        apply_position(sampler, state, batch_size, trainer.accumulate_grad_batches)

    object.__setattr__(dataloader, "state_dict", state_dict)
    object.__setattr__(dataloader, "load_state_dict", load_state_dict)


def apply_position(
    sampler: ResumableDistributedSampler, position: dict[str, Any], batch_size: int, accumulate_grad_batches: int
) -> None:
    """Make ``sampler`` continue from a checkpoint's mid-epoch ``position`` in a run with per-device
    ``batch_size``: raises if the position would name other samples (another dataset size, seed or
    shuffling) or if a micro-batch would hold another number of samples (Lightning's batch counters would
    then be wrong); warns if the checkpoint was written inside an accumulation window."""
    if position.get("format") != _FORMAT or position.get("complete"):
        return  # not ours, or the epoch was finished: Lightning moves on to the next one (set_epoch resets)
    here = {"dataset_size": sampler.dataset_size, "shuffle": sampler.shuffle, "seed": sampler.seed}
    changed = {k: (position[k], here[k]) for k in _ORDER_FIELDS if position[k] != here[k]}
    if changed:
        details = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items())
        raise ValueError(
            f"The checkpoint was written mid-epoch with another training-data order ({details}): its position "
            f"(the first {position['consumed']} samples of epoch {position['epoch']}) would name other samples. "
            f"Resume with the same dataset and seed (pl.seed_everything / PL_GLOBAL_SEED), or from an end-of-epoch "
            f"checkpoint."
        )
    world = sampler.num_replicas
    if position["micro_batch"] != batch_size * world:
        old_world, old_batch = position["world_size"], position["batch_size"]
        fix = position["micro_batch"] / world
        hint = f"batch_size={int(fix)} per device" if fix.is_integer() else "a world size that divides it"
        raise ValueError(
            f"The checkpoint was written mid-epoch with {old_world} ranks x batch_size {old_batch} = "
            f"{position['micro_batch']} samples per micro-batch; this run has {world} x {batch_size}. Lightning "
            f"counts the resumed epoch in micro-batches (batch_idx, accumulation windows, the epoch's end), so "
            f"they must hold as many samples as before: resume with {hint}, or from an end-of-epoch checkpoint."
        )
    sampler.skip(position["epoch"], position["consumed"])
    k = accumulate_grad_batches
    done = position["consumed"] // position["micro_batch"]
    if done % k:
        rank_zero_warn(
            f"This checkpoint was written inside an accumulation window (after micro-batch {done % k} of "
            f"accumulate_grad_batches={k}). Checkpoints hold no gradients, so the resumed run steps after the "
            f"window's remaining {k - done % k} micro-batches with their gradients only: every sample is still "
            f"used once, but that step differs from the uninterrupted run. ModelCheckpoint(every_n_train_steps=...) "
            f"saves right after optimizer steps, where resuming is exact."
        )


def _warn_if_resuming_mid_epoch(position: Optional[dict[str, Any]], why: str) -> None:
    if position is not None and not position.get("complete"):
        rank_zero_warn(
            f"The checkpoint holds a mid-epoch position of lightning_mgpu's resumable sampler, but the training "
            f"loader was left as it is because {why}: Lightning restarts the epoch at its first batch (batches "
            f"already trained on are used twice, as many at the end are left out)."
        )


def take_position(checkpoint: MutableMapping[str, Any]) -> Optional[dict[str, Any]]:
    """Remove and return the mid-epoch position of a loaded checkpoint (``None`` if it has none)."""
    return checkpoint.pop(POSITION_KEY, None)


def move_position(checkpoint: MutableMapping[str, Any]) -> None:
    """Before a checkpoint is written: move the sampler's entry out of Lightning's loop state to
    :data:`POSITION_KEY` (mid-epoch) or drop it (end of epoch). Left in the loop state, it would make plain
    Lightning refuse the checkpoint for a loader without ``load_state_dict`` ("The CombinedLoader has 0 stateful
    loaders, but found 1 states"), e.g. on one device without this package. Kept where it is when other
    stateful loaders share the list: Lightning pairs the entries with the loaders by position."""
    fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    states = fit_state.get("combined_loader")
    if not states or len(states) != 1 or states[0].get("format") != _FORMAT:
        return
    del fit_state["combined_loader"]
    if not states[0]["complete"]:
        checkpoint[POSITION_KEY] = states[0]


def loader_kind(state: Any) -> tuple[str, bool]:
    """What kind of loader wrote ``state`` (one entry of Lightning's ``combined_loader`` list), and whether its
    position can be carried to another world size.

    * lightning_mgpu's position: counted in the epoch's global order (:func:`apply_position` checks the rest).
    * litdata's ``StreamingDataLoader`` over one ``StreamingDataset``: its state counts the samples of the
      epoch across all ranks (``sample_in_epoch``), and litdata re-splits the rest over another number of ranks,
      batch size or workers ("elastic" resume; the same ``drop_last`` needed).
    * torchdata's ``StatefulDataLoader`` (with a sampler of the user's, or an iterable dataset): its state counts
      the batches *this rank* drew (``_num_yielded``) and its workers' own states: at another world size they
      would name other samples.
    * anything else: per rank.
    """
    if not isinstance(state, dict):
        return "a stateful training loader", False
    if state.get("format") == _FORMAT:
        return "lightning_mgpu's resumable sampler", True
    dataset = state.get("dataset")
    if isinstance(dataset, dict) and "sample_in_epoch" in dataset and isinstance(state.get("num_samples_yielded"), int):
        return "litdata's StreamingDataLoader", True
    if isinstance(dataset, dict) or "num_samples_yielded" in state:
        return "litdata's StreamingDataLoader over a combined or parallel dataset", False
    if "_num_yielded" in state:
        return "torchdata's StatefulDataLoader", False
    return "a stateful training loader", False


def gather_loader_states(checkpoint: MutableMapping[str, Any], trainer: Optional[pl.Trainer]) -> None:
    """Before a checkpoint is written, on every rank (a collective when several ranks train): store every
    rank's state of the stateful training loaders under :data:`LOADER_STATES_KEY`, with the world size and
    whether the checkpoint is mid-epoch. Lightning keeps only the writer's (rank 0's) in its loop state, and
    restores that one on every rank: right only for a loader whose state is the same on every rank. Rank 0's
    stays where Lightning put it, so plain Lightning still loads the checkpoint."""
    fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    states = fit_state.get("combined_loader")
    if not states:
        return
    world = trainer.world_size if trainer is not None else 1
    ranks = comm.all_gather_object(states) if world > 1 and comm.group_is_up() else [states]
    checkpoint[LOADER_STATES_KEY] = {
        "format": _STATES_FORMAT,
        "version": 1,
        "world_size": len(ranks),
        "epoch": trainer.current_epoch if trainer is not None else None,
        "mid_epoch": bool(trainer is not None and mid_epoch(trainer)),
        "loaders": [loader_kind(state) for state in states],
        "ranks": ranks,
    }


def restore_loader_states(checkpoint: MutableMapping[str, Any], world_size: int, rank: int) -> None:
    """After a checkpoint is loaded: give this rank its own loader states (same world size); at another world
    size keep rank 0's for loaders that carry a global position (litdata re-splits it), and refuse, before
    training, a mid-epoch checkpoint of a loader whose position is per rank."""
    record = checkpoint.pop(LOADER_STATES_KEY, None)
    if not isinstance(record, dict) or record.get("format") != _STATES_FORMAT:
        return
    fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    saved = record["world_size"]
    if saved == world_size:
        fit_state["combined_loader"] = record["ranks"][rank]
        return
    per_rank = [kind for kind, elastic in record["loaders"] if not elastic]
    if record["mid_epoch"] and per_rank:
        raise ValueError(
            f"The checkpoint was written mid-epoch (epoch {record['epoch']}) at world size {saved} with a training "
            f"loader that keeps its position per rank ({', '.join(per_rank)}): it counts the batches each rank drew, "
            f"which at world size {world_size} would name other samples (some used twice, some never). Resume at "
            f"world size {saved}, or from an end-of-epoch checkpoint. To resume mid-epoch at any world size, give the "
            f"StatefulDataLoader no sampler of its own and leave use_distributed_sampler=True: lightning_mgpu then "
            f"puts in its resumable sampler, whose position is counted across all ranks (or use litdata's "
            f"StreamingDataLoader)."
        )


# ----------------------------------------------------------------------------------------------------
# Mid-epoch resume as a part: the training sampler's position travels in the checkpoint (the sampler above).


class MidEpochResume:
    """Where the strategy meets Lightning's data connector and checkpoint connector.

    Example (what the strategy's hooks call)::

        resume = MidEpochResume()
        resume.sampler_requested()                        # distributed_sampler_kwargs: Lightning builds one
        loader = resume.process_train_loader(loader, trainer)
        resume.before_save(checkpoint, trainer); resume.after_load(checkpoint, world_size, rank)
    """

    def __init__(self) -> None:
        self._injected = False  # Lightning has just put its automatic DistributedSampler into a loader
        self._position: Optional[dict[str, Any]] = None  # the mid-epoch position of the checkpoint resumed
        self._resumed_streams: list[Any] = []  # litdata loaders of a resumed fit, until its first epoch's last batch

    def sampler_requested(self) -> None:
        # Lightning reads the strategy's distributed_sampler_kwargs only to build its automatic DistributedSampler,
        # and hands that loader to process_dataloader next: a DistributedSampler found there is Lightning's.
        self._injected = True

    def process_dataloader(self, dataloader: object, trainer: Any) -> object:
        injected, self._injected = self._injected, False
        if trainer is None or not trainer.training:
            return dataloader  # evaluation loaders are read whole: nothing to resume
        if not trainer.fit_loop.is_resuming:
            self._position = None  # a later reload (reload_dataloaders_every_n_epochs) starts its epoch whole
        dataloader, took = resumable_train_loader(dataloader, trainer, injected=injected, position=self._position)
        if took:  # with several training loaders, the position is for the one that can take it, not the first
            self._position = None
        if trainer.fit_loop.is_resuming and _is_torchdata(dataloader, "StreamingDataLoader", "litdata."):
            self._resumed_streams.append(dataloader)
        return dataloader

    def batch_started(self, trainer: Any) -> None:
        """The strategy's ``on_train_batch_start``. litdata's ``StreamingDataLoader`` resumes from a loaded state
        while its ``restore`` flag is set, and clears it only when the resumed epoch's iterator runs out. Lightning
        never draws past an epoch's last batch (its fetcher counts the batches done before the checkpoint), so the
        flag stayed set and the next epoch replayed the resumed epoch's rest, then ended (measured: 2 of epoch
        1's 6 micro-batches, training stopped 2 steps early). Once the resumed epoch's last batch is drawn, the
        loader is told that the restored epoch is over: the next epoch starts afresh, as in the uninterrupted run."""
        if not self._resumed_streams or trainer is None:
            return
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            for loader in self._resumed_streams:
                loader.restore = False
            self._resumed_streams = []

    def before_save(self, checkpoint: MutableMapping[str, Any], trainer: Optional[pl.Trainer] = None) -> None:
        """On every rank (a collective where other stateful loaders train)."""
        move_position(checkpoint)  # the sampler's mid-epoch position: out of Lightning's loop state
        gather_loader_states(checkpoint, trainer)  # the other loaders' states: every rank's

    def after_load(self, checkpoint: MutableMapping[str, Any], world_size: int = 1, rank: int = 0) -> None:
        self._position = take_position(checkpoint)  # applied when the training loader is built
        restore_loader_states(checkpoint, world_size, rank)  # this rank's own, or refused at another world size
