"""What every save and load of a strategy does around its checkpoint format (one file through the checkpoint IO, or
the sharded directory of ``plugins/sharded_checkpoint.py``).

A save first refuses what could not resume (the main process's ``trainer.save_checkpoint`` after a fork or spawn
launch: its optimizer states are gone), waits for the previous background write (raising its failure on every
rank), and puts into the checkpoint the mid-epoch position, the trainable-only filter of ``checkpoint_params`` and
the Hugging Face models' configurations. Who writes: rank 0 for a file; with fault tolerance, the lowest replica
group only. Inside a running fit with ``async_checkpoint=True`` the write goes to the background
(``plugins/async_checkpoint.py``), and an old checkpoint is removed only once its replacement is written. A load
restores the mid-epoch position, checks an adapter-only checkpoint's frozen base and puts the precision plugin's
FP32 masters back.

Example::

    rules = CheckpointRules(strategy, settings, resume, replicas, runtime.processes_and_nodes)  # in the runtime
    rules.before_save(checkpoint)
    rules.write_file(checkpoint, path, options, lightning_save)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Callable, Optional

import pytorch_lightning as pl
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.trainer.states import TrainerFn, TrainerStatus

from lightning_mgpu._compat import attached_trainer, is_wrapping_checkpoint_io
from lightning_mgpu.comm import group_is_up
from lightning_mgpu.export import record_hf_models
from lightning_mgpu.parts.fault_tolerance import ReplicaGroups
from lightning_mgpu.parts.resume import MidEpochResume
from lightning_mgpu.parts.trainable_state import (
    check_base,
    check_keys,
    frozen_parameters,
    saves_trainable_only,
    trainable_only,
)
from lightning_mgpu.plugins.async_checkpoint import AsyncCheckpointWriter, AsyncWrites
from lightning_mgpu.plugins.checkpoint_io import LightningSave
from lightning_mgpu.plugins.precision import PrecisionAdoption
from lightning_mgpu.settings import CommonSettings


@dataclasses.dataclass(eq=False)
class CheckpointRules:
    """The saves and loads of one strategy (see the module docstring). ``strategy``: the strategy it serves (its
    module, ranks, checkpoint IO and precision plugin); ``resume``: the mid-epoch resume part; ``replicas``: the
    fault-tolerant replica groups (None where off); ``processes_and_nodes``: the launch's processes per node and nodes
    (known once Lightning has set the strategy up)."""

    strategy: ParallelStrategy
    settings: CommonSettings
    resume: MidEpochResume
    replicas: Optional[ReplicaGroups]
    processes_and_nodes: Callable[[], tuple[int, int]]
    writes: Optional[AsyncWrites] = dataclasses.field(init=False)
    """The background writes (``async_checkpoint=True``); None where every save is written before it returns."""

    def __post_init__(self) -> None:
        self.writes = (
            AsyncWrites(AsyncCheckpointWriter(), self.settings.timeout) if self.settings.async_checkpoint else None
        )

    def check_io(self, io: Any) -> None:
        """At Trainer construction: the strategy's checkpoint IO plugin ``io`` (``None``: Lightning's default)."""
        if self.settings.async_checkpoint and is_wrapping_checkpoint_io(io):
            raise ValueError(
                f"async_checkpoint=True with {type(io).__name__}: the strategy already writes checkpoints in the "
                f"background, from a copy of the state, and marks them complete only once written; a second "
                f"background plugin would hand it back before the file exists. Remove {type(io).__name__} from the "
                f"plugins (or give its base plugin as checkpoint_io), or drop async_checkpoint=True."
            )

    def _attached(self) -> Optional[pl.Trainer]:
        return attached_trainer(self.strategy.lightning_module)

    def before_save(self, checkpoint: dict[str, Any]) -> None:
        """What every save does first, once: refuse a save that could not resume, wait for the previous background
        write (or raise its error), and put the mid-epoch position and the Hugging Face models' configurations
        into the checkpoint."""
        self._refuse_main_process_save()
        self.settle()
        self.resume.before_save(checkpoint, self._attached())
        module = self.strategy.lightning_module
        if module is not None and saves_trainable_only(module, self.settings.checkpoint_params):
            trainable_only(checkpoint, module)  # checkpoint_params: the frozen base out, its fingerprint in
        record_hf_models(checkpoint, self.strategy.lightning_module)  # what `lightning-mgpu export` writes out

    def _refuse_main_process_save(self) -> None:
        """Plain Lightning writes a checkpoint with empty optimizer states (and the main process's loop
        counters) when ``trainer.save_checkpoint`` runs in the main process after a spawn/fork fit."""
        start = self.settings.start_method
        if start != "popen" and not group_is_up() and math.prod(self.processes_and_nodes()) > 1:
            raise RuntimeError(
                f"trainer.save_checkpoint() was called in the main process after a {start!r} "
                f"launch. Training ran in the worker processes and their optimizer states are gone, so this "
                f"checkpoint could not resume training. Save from inside fit (ModelCheckpoint(save_last=True), or "
                f"trainer.save_checkpoint in a callback's on_train_end), or launch with start_method='popen', where "
                f"trainer.save_checkpoint after fit works."
            )

    def write_file(
        self, checkpoint: dict[str, Any], filepath: Any, options: Any, lightning_save: LightningSave
    ) -> None:
        """One checkpoint file, written by rank 0 through the checkpoint IO (atomic by default; ``lightning_save``
        is Lightning's save), in the background with ``async_checkpoint=True``; with fault tolerance, by the lowest
        replica group only."""
        if not self.writes_checkpoints():
            return
        if not self.saves_async():
            lightning_save(checkpoint, filepath, options)
            return
        assert self.writes is not None
        self.writes.unsettled = True
        if self.strategy.is_global_zero:  # one file, written by rank 0 (as Lightning's)
            staged = self.writes.writer.stage(checkpoint)
            io = self.strategy.checkpoint_io
            self.writes.submit(str(filepath), 0, lambda: io.save_checkpoint(staged, filepath, options))

    def saves_async(self) -> bool:
        """Async only inside a running fit: a save outside it (after fit, in validate) has no end of fit that
        waits for it, so it is written before it returns."""
        if self.writes is None:
            return False
        trainer = self._attached()
        return (
            trainer is not None
            and trainer.state.fn == TrainerFn.FITTING
            and trainer.state.status == TrainerStatus.RUNNING
        )

    def settle(self) -> None:
        """Every rank: wait for the background write in flight, raising a failure of any rank's on every rank."""
        if self.writes is not None:
            self.writes.settle(self.strategy.world_size)

    def writes_checkpoints(self) -> bool:
        """Whether this process's group writes checkpoints: always, except under fault tolerance, where the lowest
        replica group of the last quorum writes and removes them (:class:`~lightning_mgpu.parts.fault_tolerance.
        ReplicaGroups`)."""
        return self.replicas is None or self.replicas.writes_checkpoints()

    def remove_when_written(self, remove: Callable[[], None]) -> None:
        """Remove an old checkpoint once the write in flight has succeeded (ModelCheckpoint's top-k and
        ``save_last`` ask right after submitting the replacement), at once without a write in flight; with fault
        tolerance, only where this group writes them."""
        if not self.writes_checkpoints():
            return
        if self.writes is not None:
            self.writes.writer.remove_after_write(remove)
        else:
            remove()

    @property
    def write_in_flight(self) -> bool:
        return self.writes is not None and self.writes.writer.in_flight

    def after_load(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        self.resume.after_load(checkpoint, self.strategy.world_size, self.strategy.global_rank)
        return checkpoint

    def module_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The module's weights as the strategy saves them (``state``), with the precision plugin's masters."""
        return PrecisionAdoption.with_masters(self.strategy.precision_plugin, self.strategy.lightning_module, state)

    def saved_keys(self) -> Optional[set[str]]:
        """The module's state entries a save keeps under ``checkpoint_params`` (None: all of them)."""
        module = self.strategy.lightning_module
        if module is None or not saves_trainable_only(module, self.settings.checkpoint_params):
            return None
        frozen = frozen_parameters(module)
        return {k for k in module.state_dict() if k not in frozen}

    def frozen_left_out(self, checkpoint: Mapping[str, Any]) -> Optional[set[str]]:
        """For an adapter-only checkpoint (``checkpoint_params``): the frozen parameters it leaves out, once the
        model's frozen base is checked to be the one it was saved on (the same error on every rank otherwise);
        None for a full checkpoint. Call on every rank."""
        module = self.strategy.lightning_module
        assert module is not None
        return check_base(checkpoint, module, self.strategy.is_global_zero, self.strategy.broadcast)

    def load_weights(
        self, checkpoint: Mapping[str, Any], strict: bool, load: Callable[[Mapping[str, Any], bool], None]
    ) -> None:
        """Load the checkpoint's weights with ``load(checkpoint, strict)`` (the strategy's way); an adapter-only
        checkpoint loads non-strictly onto the checked base, its keys checked here when ``strict``."""
        left_out = self.frozen_left_out(checkpoint)
        if left_out is not None:
            module = self.strategy.lightning_module
            assert module is not None
            if strict:
                check_keys(checkpoint["state_dict"], module, left_out)
            strict = False
        load(checkpoint, strict)

    def load_masters(self, checkpoint: Any) -> None:
        PrecisionAdoption.load_masters(self.strategy.precision_plugin, self.strategy.lightning_module, checkpoint)

    def end(self) -> None:
        """Teardown: the last background write waited for, the writes' group left."""
        if self.writes is not None:
            self.writes.end()
