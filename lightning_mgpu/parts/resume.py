"""Mid-epoch resume as a part: the training sampler's position travels in the checkpoint (``sampler.py``)."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Optional

from lightning_mgpu.sampler import move_position, resumable_train_loader, take_position


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
