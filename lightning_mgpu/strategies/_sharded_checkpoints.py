"""The checkpoints of :class:`~lightning_mgpu.MGPUShardedStrategy`: the consolidated file or the sharded directory
(``torch.distributed.checkpoint``), written atomically (and in the background with ``async_checkpoint=True``), and
loaded at any world size. A mixin of the sharded strategy's shared base; the sharding backend (``_sharding.py``)
gathers and scatters the states.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mgpu.checkpoint_io import (
    PathLike,
    begin_dir,
    check_complete,
    commit_dir,
    local_path,
    recover_dir,
    remove_dir,
    write_file_atomic,
)
from lightning_mgpu.parts.async_writer import sharded_directory_write
from lightning_mgpu.parts.optimizers import unwrap_optimizer

log = logging.getLogger(__name__)

_METADATA = "meta.pt"  # the non-tensor part of a sharded checkpoint (Lightning's ModelParallelStrategy name)
_OPTIMIZER_COUNT = "mgpu_sharded_optimizers"


if TYPE_CHECKING:  # what the mixin relies on: the sharded strategy's shared base
    from pytorch_lightning.strategies import ParallelStrategy

    from lightning_mgpu.settings import ShardedSettings
    from lightning_mgpu.strategies._common import MGPUStrategyMixin
    from lightning_mgpu.strategies._sharding import ShardingBackend

    class _StrategyBase(MGPUStrategyMixin, ParallelStrategy):
        _sharding: ShardingBackend
        _sharded_settings: ShardedSettings
        _backend_name: str
        _checkpoint_layout: str

        def _process_group(self) -> Any: ...
else:
    _StrategyBase = object


class ShardedCheckpoints(_StrategyBase):
    """Save, remove and load the sharded strategy's checkpoints (mixed into :class:`MGPUShardedStrategy`)."""

    # --- checkpoints ----------------------------------------------------------------------------------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Optimizer state can only be split once the optimizers are wrapped (and, for FSDP2, the parameters
        # sharded); a consolidated checkpoint is loaded through the same path.
        return True

    @override
    def _module_state(self) -> dict[str, Any]:
        module = self.lightning_module
        assert module is not None
        if self._checkpoint_layout == "sharded":
            return module.state_dict()
        return self._sharding.full_model_state(module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        optimizer = unwrap_optimizer(optimizer)
        assert self.lightning_module is not None
        if self._checkpoint_layout == "sharded":
            return self._sharding.sharded_optimizer_state(self.lightning_module, optimizer)
        return self.consolidated_optimizer_state(optimizer)

    def consolidated_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole state of ``optimizer`` as one process's ``optimizer.state_dict()`` (indexed by parameter),
        on rank 0; ``{}`` elsewhere. A collective: call it on every rank."""
        optimizer = unwrap_optimizer(optimizer)
        assert self.lightning_module is not None
        return self._sharding.full_optimizer_state(self.lightning_module, optimizer, self.is_global_zero)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Optional[Any] = None
    ) -> None:
        self._refuse_main_process_save()
        self._settle_async_writes()  # the previous background write finished everywhere (or raise)
        self._resume.before_save(checkpoint)  # before the sharded layout puts the non-tensor part into meta.pt
        filepath = self.broadcast(str(filepath))  # a string: Path() would mangle a remote URL (s3://...)
        local = local_path(filepath)
        if self._checkpoint_layout == "consolidated":
            if local is not None and os.path.isdir(local):
                raise IsADirectoryError(
                    f"{local} is a directory (a sharded checkpoint?); a consolidated checkpoint is one file. Choose "
                    f"another file name, or save with MGPUShardedStrategy(checkpoint='sharded')."
                )
            super().save_checkpoint(checkpoint, filepath, storage_options)  # checkpoint_io: atomic by default
            return
        import torch.distributed.checkpoint as dcp

        if storage_options is not None:
            raise TypeError("storage_options is not supported with checkpoint='sharded' (DCP writes the files).")
        if local is None:
            raise ValueError(
                f"checkpoint='sharded' writes to a local or mounted filesystem; {filepath} is remote. Save to a "
                f"local path, or use checkpoint='consolidated' (one file, which Lightning uploads)."
            )
        path = Path(local)
        if path.is_file():
            raise FileExistsError(
                f"{path} is a file (a consolidated checkpoint?); a sharded checkpoint is a directory. Choose another "
                f"name, or save with MGPUShardedStrategy(checkpoint='consolidated')."
            )
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        optimizer_states = checkpoint.pop("optimizer_states", None)
        for i, state in enumerate(optimizer_states or []):
            tensors[f"optimizer_{i}"] = state
        # None: saved with weights only (Lightning then refuses to resume training from it, as for a file)
        checkpoint[_OPTIMIZER_COUNT] = None if optimizer_states is None else len(optimizer_states)
        # Every rank writes into a hidden staging directory that rank 0 creates; only once all have written
        # does rank 0 mark it complete and swap it in under `path`. A save killed or failing on any rank
        # leaves the previous checkpoint under `path` (ModelCheckpoint(save_last=True) overwrites last.ckpt).
        staging = Path(self.broadcast(str(begin_dir(path)) if self.is_global_zero else ""))
        if self._saves_async():
            self._save_sharded_async(tensors, checkpoint, staging, path)
            return
        dcp.save(tensors, checkpoint_id=str(staging), process_group=self._process_group())
        if self.is_global_zero:
            write_file_atomic(staging / _METADATA, lambda f: torch.save(checkpoint, f))
        self.barrier("mgpu_sharded_save_written")  # every rank's shards are on disk
        if self.is_global_zero:
            commit_dir(staging, path, self._marker_info(checkpoint))
        self.barrier("mgpu_sharded_save_done")

    def _marker_info(self, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "format": "lightning_mgpu.sharded",
            "version": 1,
            "world_size": self.world_size,
            "stage": self._sharded_settings.stage,
            "backend": self._backend_name,
            "layout": self._checkpoint_layout,
            "optimizers": checkpoint[_OPTIMIZER_COUNT],
            "epoch": checkpoint.get("epoch"),
            "global_step": checkpoint.get("global_step"),
        }

    def _save_sharded_async(
        self, tensors: dict[str, Any], checkpoint: dict[str, Any], staging: Path, path: Path
    ) -> None:
        """The sharded layout with ``async_checkpoint=True``: every rank stages its shards now; the background
        write marks the directory complete only once every rank's part is on disk (``parts/async_writer.py``)."""
        assert self._async is not None
        self._async_unsettled = True
        rank0 = self.is_global_zero
        staged = self._async.stage({"tensors": tensors, "meta": checkpoint if rank0 else None})
        info = self._marker_info(checkpoint)
        self._async.rank = self.global_rank
        write = sharded_directory_write(
            staged["tensors"],
            staging,
            self._async_checkpoint_group(),
            write_meta=(lambda: write_file_atomic(staging / _METADATA, lambda f: torch.save(staged["meta"], f)))
            if rank0
            else None,
            commit=(lambda: commit_dir(staging, path, info)) if rank0 else None,
        )
        self._async.submit(str(path), write)

    @override
    def remove_checkpoint(self, filepath: PathLike) -> None:
        local = local_path(filepath)
        if self.is_global_zero and local is not None and os.path.isdir(local):
            # whatever the checkpoint_io: the strategy wrote the directory, not the plugin
            self._remove_when_written(lambda: remove_dir(local))
            return
        super().remove_checkpoint(os.fspath(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if self.is_global_zero and (local := local_path(checkpoint_path)) is not None:
            recover_dir(local)  # a save killed in the instant of its swap; the broadcast below waits for it
        checkpoint_path = self.broadcast(str(checkpoint_path))
        local = local_path(checkpoint_path)
        if local is None or not os.path.isdir(local):
            self._loaded_sharded = False
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        path = Path(local)
        check_complete(path)  # never load half a checkpoint
        if not (path / _METADATA).is_file():
            raise FileNotFoundError(
                f"{path} is a directory without {_METADATA}: not a sharded checkpoint of mgpu_sharded. Pass the "
                f"checkpoint directory written by trainer.save_checkpoint."
            )
        import torch.distributed.checkpoint as dcp

        module = self.lightning_module
        assert module is not None
        checkpoint: dict[str, Any] = torch.load(path / _METADATA, weights_only=False, map_location="cpu")
        saved_optimizers = checkpoint.pop(_OPTIMIZER_COUNT, None)
        template: dict[str, Any] = {"state_dict": module.state_dict()}
        load_optimizers = bool(self.lightning_restore_optimizer and self.optimizers and saved_optimizers is not None)
        if load_optimizers:
            if saved_optimizers != len(self.optimizers):
                raise ValueError(
                    f"{path} holds {saved_optimizers} optimizer states and configure_optimizers returned "
                    f"{len(self.optimizers)} optimizers: resume with the same configure_optimizers."
                )
            for i, opt in enumerate(self.optimizers):
                template[f"optimizer_{i}"] = self._sharding.optimizer_load_template(module, opt)
        # every rank reads the slices it owns now, whatever the world size at save time
        dcp.load(template, checkpoint_id=str(path), process_group=self._process_group())
        module.load_state_dict(template["state_dict"], strict=module.strict_loading)
        if load_optimizers:
            for i, opt in enumerate(self.optimizers):
                self._sharding.finish_optimizer_load(opt, template[f"optimizer_{i}"])
            checkpoint["optimizer_states"] = [template[f"optimizer_{i}"] for i in range(len(self.optimizers))]
        elif saved_optimizers is not None:
            checkpoint["optimizer_states"] = []
        self._loaded_sharded = True
        self._resume.after_load(checkpoint)  # the file branch does it in super().load_checkpoint
        return checkpoint

    @override
    def _load_module_state(self, checkpoint: Mapping[str, Any], strict: bool) -> None:
        if self._loaded_sharded:
            return  # loaded in place by load_checkpoint
        assert self.lightning_module is not None
        self._sharding.load_full_model_state(self.lightning_module, checkpoint["state_dict"], strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._loaded_sharded:
            return
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(
                f"The checkpoint has {len(states)} optimizer states and configure_optimizers returned "
                f"{len(self.optimizers)} optimizers: resume with the same configure_optimizers."
            )
        assert self.lightning_module is not None
        for opt, state in zip(self.optimizers, states):
            if not state:
                raise ValueError(
                    "The checkpoint's optimizer state is empty: it was saved in the main process after a spawn or "
                    "fork launch (plain Lightning does that). Resume from a checkpoint written during fit "
                    "(ModelCheckpoint), or pass weights_only=True to Trainer.fit's ckpt_path logic by loading the "
                    "weights with LightningModule.load_from_checkpoint and starting a new fit."
                )
            self._sharding.load_full_optimizer_state(self.lightning_module, opt, state)
