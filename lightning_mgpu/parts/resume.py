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
"""

from __future__ import annotations

import math
from collections.abc import Iterator, MutableMapping
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import RunningStage
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

from lightning_mgpu._compat import update_dataloader

POSITION_KEY = "mgpu_sampler_position"
"""Top-level checkpoint key of a mid-epoch position (absent in checkpoints written at an epoch's end)."""
_FORMAT = "lightning_mgpu.sampler_position"
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
        order = self.global_order()
        rest = order[self._skip :]
        self._skip = 0  # a second pass over the same epoch (another fit) starts at its beginning
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % self.num_replicas]
        elif (pad := -len(rest) % self.num_replicas) and order:
            # torch pads with the epoch's first samples (repeated when the dataset is smaller than the padding)
            rest += (order * math.ceil(pad / len(order)))[:pad]
        return iter(rest[self.rank :: self.num_replicas])

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


def mid_epoch(trainer: pl.Trainer) -> bool:
    """Whether a checkpoint written now resumes inside an epoch: some of its batches are done and the last one
    is not (after the last batch, Lightning's resume moves on to the next epoch)."""
    return batches_done(trainer) > 0 and not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch


def resumable_train_loader(
    dataloader: object, trainer: pl.Trainer, *, injected: bool, position: Optional[dict[str, Any]]
) -> tuple[object, bool]:
    """The training loader with a resumable sampler, whose position Lightning saves and restores with its
    loop state (the loader gets ``state_dict``/``load_state_dict``).

    The sampler is replaced only where Lightning put in its own automatic ``DistributedSampler``
    (``injected``: Lightning asked the strategy for ``distributed_sampler_kwargs`` for this very loader) and
    a :class:`ResumableDistributedSampler` the user built is adopted as it is. Any other sampler (one you set,
    Lightning's ``DistributedSamplerWrapper`` around a custom sampler, ``use_distributed_sampler=False``) is
    kept and resumes as in plain Lightning. (A ``DistributedSampler`` you build from
    ``trainer.distributed_sampler_kwargs`` inside ``train_dataloader`` also sets that flag and is replaced,
    by one with its own arguments: the same order.) ``position``: what :func:`take_position` found in the
    checkpoint. Returns the loader and whether it took ``position`` (with several training loaders, the
    position belongs to the one that can take it).
    """
    sampler = getattr(dataloader, "sampler", None)
    if not isinstance(sampler, ResumableDistributedSampler):
        # exactly torch's class: a subclass or Lightning's DistributedSamplerWrapper has an order of its own
        if not (injected and type(sampler) is DistributedSampler and isinstance(dataloader, DataLoader)):
            _warn_if_resuming_mid_epoch(position, f"its sampler ({type(sampler).__name__}) is yours")
            return dataloader, False
        ours = ResumableDistributedSampler(
            sampler.dataset,
            num_replicas=sampler.num_replicas,
            rank=sampler.rank,
            shuffle=sampler.shuffle,
            seed=sampler.seed,
            drop_last=sampler.drop_last,
        )
        try:
            # Lightning's own re-instantiation, the one that put its DistributedSampler in (custom DataLoader
            # subclasses included, from the arguments it recorded)
            dataloader = update_dataloader(dataloader, ours, RunningStage.TRAINING)
        except MisconfigurationException as err:
            _warn_if_resuming_mid_epoch(position, f"it cannot be re-created with another sampler ({err})")
            return dataloader, False
        sampler = ours
    assert isinstance(dataloader, DataLoader)
    if dataloader.batch_size is None or type(dataloader.batch_sampler) is not BatchSampler:
        # a batch sampler of the user's decides the batches: the position cannot be counted in samples
        _warn_if_resuming_mid_epoch(position, "it has a batch_sampler of its own")
        return dataloader, False
    _attach_position(dataloader, sampler, trainer)
    if trainer.fit_loop.is_resuming:  # a checkpoint was loaded (`restarting` is False after a finished epoch)
        # Lightning creates the epoch's iterator in setup_data, before its set_epoch in on_advance_start, and
        # does not create it again in a resumed epoch: with num_workers > 0 the workers draw their indices at
        # once, so the resumed epoch would get the permutation of the sampler's initial epoch 0 (measured,
        # also for end-of-epoch checkpoints). Set the epoch now.
        sampler.set_epoch(resumed_epoch(trainer))
    if position is not None:
        apply_position(sampler, position, dataloader.batch_size, trainer.accumulate_grad_batches)
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


def _attach_position(dataloader: DataLoader, sampler: ResumableDistributedSampler, trainer: pl.Trainer) -> None:
    # Instance attributes make the loader match Lightning's `_Stateful` protocol: FitLoop.on_save_checkpoint
    # stores state_dict() with the loop state, Lightning no longer warns that the loader is not resumable, and
    # load_state_dict() is called before the epoch's iterator is created. The loader is the copy Lightning
    # (or `_update_dataloader` above) made for this fit, not an object of the user's.
    micro_batch = dataloader.batch_size * sampler.num_replicas  # type: ignore[operator]

    def state_dict() -> dict[str, Any]:
        done = batches_done(trainer)
        return {
            "format": _FORMAT,
            "version": 1,
            "epoch": sampler.epoch,
            "consumed": done * micro_batch,
            "complete": not mid_epoch(trainer),
            "micro_batch": micro_batch,
            "batch_size": dataloader.batch_size,
            "world_size": sampler.num_replicas,
            "dataset_size": sampler.dataset_size,
            "shuffle": sampler.shuffle,
            "seed": sampler.seed,
        }

    def load_state_dict(state: dict[str, Any]) -> None:
        apply_position(sampler, state, dataloader.batch_size, trainer.accumulate_grad_batches)  # type: ignore[arg-type]

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


# ----------------------------------------------------------------------------------------------------
# Mid-epoch resume as a part: the training sampler's position travels in the checkpoint (the sampler above).


class MidEpochResume:
    """Where the strategy meets Lightning's data connector and checkpoint connector.

    Example (what the strategy's hooks call)::

        resume = MidEpochResume()
        resume.sampler_requested()                        # distributed_sampler_kwargs: Lightning builds one
        loader = resume.process_train_loader(loader, trainer)
        resume.before_save(checkpoint); resume.after_load(checkpoint)
    """

    def __init__(self) -> None:
        self._injected = False  # Lightning has just put its automatic DistributedSampler into a loader
        self._position: Optional[dict[str, Any]] = None  # the mid-epoch position of the checkpoint resumed

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
        return dataloader

    def before_save(self, checkpoint: MutableMapping[str, Any]) -> None:
        move_position(checkpoint)  # the sampler's mid-epoch position: out of Lightning's loop state

    def after_load(self, checkpoint: MutableMapping[str, Any]) -> None:
        self._position = take_position(checkpoint)  # applied when the training loader is built
