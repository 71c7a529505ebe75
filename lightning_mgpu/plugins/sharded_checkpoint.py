"""The checkpoints of ``MGPUShardedStrategy`` (:class:`ShardedCheckpoints`, what its checkpoint hooks hand their work
to): ``checkpoint="consolidated"``, one Lightning file gathered on rank 0, or ``checkpoint="sharded"``, one directory
per checkpoint, written by every rank at once; either loaded at any world size.

What a directory holds:

* ``torch.distributed.checkpoint``'s files (``.metadata`` and each rank's ``.distcp``): ``state_dict`` (the weights,
  each rank writing its shards), ``optimizer_<i>`` (each optimizer's state, keyed by parameter name, as the sharding
  backend lays it out) and, where the EMA callback runs, ``ema_state_dict`` (its average, sharded as the weights);
* ``meta.pt`` (:data:`METADATA`, Lightning's ``ModelParallelStrategy`` name): everything else Lightning puts into a
  checkpoint (epoch, loops, callbacks, hyper-parameters), written by rank 0, with the number of optimizer states
  (``None``: saved with weights only) and the EMA's parameter names;
* the completion marker (``plugins/checkpoint_io.py``), written last by rank 0 once every rank's part is on disk: the
  directory is staged under a hidden name and swapped in place, so a save killed on any rank leaves the previous
  checkpoint under its name. With ``async_checkpoint=True`` the ranks stage their shards and write them in the
  background (:func:`sharded_directory_write`), and the marker still comes last. The training thread then issues no
  collective of the save's own: rank 0 makes the staging directory in the background and sends its name to the
  others there, on the writes' gloo group.

Loading reads every entry as data unless ``weights_only=False`` (``plugins/checkpoint_io.py``), and each rank reads the
slices it owns now, whatever the world size at save time. An adapter-only checkpoint of a frozen base leaves the base
as built; the strategy's checkpoint rules (``plugins/checkpoint_rules.py``) refuse one saved over another base first.

Example::

    trainer = Trainer(strategy=MGPUShardedStrategy(stage=3, checkpoint="sharded"), devices=2)
    trainer.fit(model)
    trainer.save_checkpoint("run/last.ckpt")           # a directory: meta.pt, .metadata, __0_0.distcp, ...
    Trainer(strategy=MGPUShardedStrategy(stage=3, checkpoint="sharded"), devices=4).fit(
        model, ckpt_path="run/last.ckpt")              # resumed at 4 ranks
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from pytorch_lightning.strategies import ParallelStrategy
from torch import nn
from torch.optim import Optimizer

from lightning_mgpu import comm
from lightning_mgpu._compat import unwrap_optimizer
from lightning_mgpu.parts.trainable_state import check_sharded_save
from lightning_mgpu.plugins.checkpoint_io import (
    EMA_STATE_KEY,
    LightningSave,
    PathLike,
    begin_dir,
    check_complete,
    checkpoint_kind,
    commit_dir,
    dcp_layout,
    join_path,
    load_file,
    load_sharded_dir,
    local_path,
    recover_dir,
    remove_dir,
    save_sharded,
    write_checkpoint_file,
)

METADATA = "meta.pt"
"""The non-tensor part of a sharded checkpoint directory, written by rank 0."""
OPTIMIZER_COUNT = "mgpu_sharded_optimizers"
"""The entry of :data:`METADATA` that counts the optimizer states saved (``None``: saved with weights only)."""
EMA_NAMES = "mgpu_sharded_ema"
"""The entry of :data:`METADATA` that names the parameters of the EMA average saved beside ``state_dict``."""
FORMAT = {"format": "lightning_mgpu.sharded", "version": 1}
"""The first entries of the completion marker of a sharded directory."""


def save_dir(
    checkpoint: dict[str, Any],
    target: str,
    *,
    rank: int,
    broadcast: Callable[[Any], Any],
    barrier: Callable[[str], None],
    group: Any,
    marker: Mapping[str, Any],
    writes: Optional[Any] = None,
) -> None:
    """Write Lightning's ``checkpoint`` as the sharded directory ``target`` (a local path, or a prefix at an fsspec
    URL): a collective, every rank calls it with its own ``checkpoint`` (its shards). ``broadcast(obj)`` and
    ``barrier(name)``: the strategy's, over all ranks; ``group``: the process group of the write; ``marker``: what the
    completion marker says of the layout (world size, stage, backend). ``writes``: the strategy's background writes
    when this save goes to the background (``async_checkpoint=True`` inside a fit), else ``None``."""
    rank0 = rank == 0
    if checkpoint_kind(target) == "file":
        raise FileExistsError(
            f"{target} is a file (a consolidated checkpoint?); a sharded checkpoint is a directory. Choose another "
            f"name, or save with MGPUShardedStrategy(checkpoint='consolidated')."
        )
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    optimizer_states = checkpoint.pop("optimizer_states", None)
    for i, state in enumerate(optimizer_states or []):
        tensors[f"optimizer_{i}"] = state
    # None: saved with weights only (Lightning then refuses to resume training from it, as for a file)
    checkpoint[OPTIMIZER_COUNT] = None if optimizer_states is None else len(optimizer_states)
    ema = checkpoint.pop(EMA_STATE_KEY, None)
    if ema is not None:  # the EMA callback's average: each rank's shards, as the weights
        tensors[EMA_STATE_KEY] = ema
        checkpoint[EMA_NAMES] = sorted(ema)
    tensors = dcp_layout(tensors)  # here, on every rank: an async write runs on another thread
    info = {
        **FORMAT,
        **marker,
        "optimizers": checkpoint[OPTIMIZER_COUNT],
        "epoch": checkpoint.get("epoch"),
        "global_step": checkpoint.get("global_step"),
    }
    # Every rank writes into a hidden staging directory that rank 0 creates; only once all have written
    # does rank 0 mark it complete and swap it in under `target`. A save killed or failing on any rank
    # leaves the previous checkpoint under `target` (ModelCheckpoint(save_last=True) overwrites last.ckpt).
    if writes is not None:  # rank 0 creates it in the background and sends its name there
        _save_async(tensors, checkpoint, target, info, rank, writes)
        return
    staging = broadcast(begin_dir(target) if rank0 else "")
    save_sharded(tensors, staging, group)
    if rank0:
        write_checkpoint_file(join_path(staging, METADATA), lambda f: torch.save(checkpoint, f))
    barrier("mgpu_sharded_save_written")  # every rank's shards are written
    if rank0:
        commit_dir(staging, target, info)
    barrier("mgpu_sharded_save_done")


def _save_async(
    tensors: dict[str, Any],
    checkpoint: dict[str, Any],
    target: str,
    info: dict[str, Any],
    rank: int,
    writes: Any,
) -> None:
    """With ``async_checkpoint=True``: every rank stages its shards now (the GPU copies only queued) and returns;
    the rest runs in the background (:func:`sharded_directory_write`): rank 0 makes the staging directory, the ranks
    write into it, and it is marked complete only once every rank's part is on disk."""
    rank0 = rank == 0
    writes.unsettled = True
    group = writes.group()  # (made at the first asynchronous save: a collective, once)
    staged = writes.writer.stage({"tensors": tensors, "meta": checkpoint if rank0 else None})
    meta = staged["meta"]
    write = sharded_directory_write(
        staged["tensors"],
        group,
        write_meta=(
            (lambda staging: write_checkpoint_file(join_path(staging, METADATA), lambda f: torch.save(meta, f)))
            if rank0
            else None
        ),
        commit=(lambda staging: commit_dir(staging, target, info)) if rank0 else None,
        begin=(lambda: begin_dir(target)) if rank0 else None,
    )
    writes.submit(str(target), rank, write)


def sharded_directory_write(
    tensors: dict[str, Any],
    group: Any,
    write_meta: Optional[Callable[[str], None]] = None,
    commit: Optional[Callable[[str], None]] = None,
    begin: Optional[Callable[[], str]] = None,
) -> Callable[[], None]:
    """The background half of an asynchronous sharded save, run on every rank: write this rank's staged
    ``tensors`` into the staging directory (a local directory or an fsspec URL) with
    ``torch.distributed.checkpoint`` (its collectives on ``group``, a group of its own: they must not interleave with
    training's), then ``write_meta(staging)``; the ranks agree that every part is written (or that one failed: then
    nobody marks it), and only then ``commit(staging)`` (rank 0: the marker and the swap). Give ``write_meta`` and
    ``commit`` on rank 0 only.

    The staging directory is made by ``begin()`` (rank 0, give it there only), in the background, and its name sent to
    the other ranks over ``group`` (they wait for it there, not on the training thread). If ``begin`` fails, every
    rank's write fails with its cause and nothing is written."""

    def receive_staging() -> str:
        made: dict[str, str] = {}
        error: Optional[BaseException] = None
        if begin is not None:  # rank 0
            try:
                made = {"staging": str(begin())}
            except BaseException as err:
                error = err
                made = {"error": f"{type(err).__name__}: {err}"}
        if comm.group_is_up():
            made = comm.broadcast_object(made, 0, group=group)  # the others wait here, in their writer threads
        if error is not None:
            raise error
        if "error" in made:
            raise RuntimeError(f"rank 0 could not make the staging directory, so nothing was written: {made['error']}")
        return made["staging"]

    def write() -> None:
        into = receive_staging()
        failed = torch.zeros(1)
        try:
            save_sharded(tensors, str(into), group)
            if write_meta is not None:
                write_meta(into)
        except BaseException:
            failed[0] = 1
            raise
        finally:
            comm.all_reduce(failed, op=torch.distributed.ReduceOp.MAX, group=group)
        if failed.item():
            raise RuntimeError(f"another rank failed to write its part into {into}; it was not marked complete")
        if commit is not None:
            commit(into)

    return write


def read_meta(path: Union[Path, str], weights_only: Optional[bool]) -> dict[str, Any]:
    """The non-tensor part of the sharded directory ``path`` (:data:`METADATA`), read as data unless
    ``weights_only=False``; a directory without the completion marker or without :data:`METADATA` is refused."""
    check_complete(path)  # never load half a checkpoint
    if checkpoint_kind(join_path(path, METADATA)) != "file":
        raise FileNotFoundError(
            f"{path} is a directory without {METADATA}: not a sharded checkpoint of mgpu_sharded. Pass the "
            f"checkpoint directory written by trainer.save_checkpoint, or a checkpoint file."
        )
    return load_file(join_path(path, METADATA), weights_only, map_location="cpu", ckpt_path=path)


def load_dir(
    path: Union[Path, str],
    module: Optional[nn.Module],
    *,
    weights_only: Optional[bool],
    group: Any,
    optimizers: Sequence[Optimizer],
    restore_optimizers: bool,
    sharding: Any,
    frozen_left_out: Callable[[dict[str, Any]], Optional[Any]],
) -> dict[str, Any]:
    """Load the sharded directory ``path`` into ``module`` (strictly unless its ``strict_loading`` is False) and, when
    ``restore_optimizers`` and the checkpoint has optimizer states, into ``optimizers`` (their count must match), in
    place: a collective over ``group``, each rank reading the slices it owns now. An incomplete directory or one
    without :data:`METADATA` is refused before ``module`` is needed. ``sharding``: the strategy's sharding backend (the
    optimizer state's template and its last step); ``frozen_left_out(checkpoint)``: the frozen base's keys an
    adapter-only checkpoint left out (they stay as built), ``None`` for a whole checkpoint. Returns Lightning's
    checkpoint dict (``optimizer_states`` loaded already, the EMA average under its key)."""
    checkpoint = read_meta(path, weights_only)  # an incomplete or foreign directory is refused first
    assert module is not None
    saved_optimizers = checkpoint.pop(OPTIMIZER_COUNT, None)
    left_out = frozen_left_out(checkpoint)  # adapter-only: refused now on another base
    ema_names = checkpoint.pop(EMA_NAMES, None)
    weights = {k: v for k, v in module.state_dict().items() if k not in (left_out or ())}
    template: dict[str, Any] = {"state_dict": weights}
    if ema_names is not None:  # shaped and sharded as the parameters they average
        template[EMA_STATE_KEY] = {name: torch.empty_like(weights[name]) for name in ema_names}
    load_optimizers = bool(restore_optimizers and optimizers and saved_optimizers is not None)
    if load_optimizers:
        if saved_optimizers != len(optimizers):
            raise ValueError(
                f"{path} holds {saved_optimizers} optimizer states and configure_optimizers returned "
                f"{len(optimizers)} optimizers: resume with the same configure_optimizers."
            )
        for i, opt in enumerate(optimizers):
            template[f"optimizer_{i}"] = sharding.optimizer_load_template(module, opt)
    # every rank reads the slices it owns now, whatever the world size at save time
    load_sharded_dir(template, path, group, weights_only)
    # adapter-only: the frozen base stays as built (DCP found every key of the template in the checkpoint)
    strict = getattr(module, "strict_loading", True)  # a LightningModule's choice
    module.load_state_dict(template["state_dict"], strict=strict and left_out is None)
    if ema_names is not None:
        checkpoint[EMA_STATE_KEY] = template[EMA_STATE_KEY]
    if load_optimizers:
        for i, opt in enumerate(optimizers):
            sharding.finish_optimizer_load(opt, template[f"optimizer_{i}"])
        checkpoint["optimizer_states"] = [template[f"optimizer_{i}"] for i in range(len(optimizers))]
    elif saved_optimizers is not None:
        checkpoint["optimizer_states"] = []
    return checkpoint


def _world_group() -> Any:
    return torch.distributed.group.WORLD if comm.group_is_up() else None


class ShardedCheckpoints:
    """The checkpoints of ``MGPUShardedStrategy``, both layouts: what its ``save_checkpoint``, ``remove_checkpoint``,
    ``load_checkpoint``, ``lightning_module_state_dict``, ``optimizer_state`` and the two ``load_*_state_dict`` hooks
    do. ``layout``: ``"consolidated"`` (one file, gathered on rank 0, atomic through the checkpoint IO, a plain
    Lightning checkpoint) or ``"sharded"`` (the directory of :func:`save_dir`); either loads at any world size.

    ``strategy``: the strategy served (its ranks, ``broadcast``, ``barrier``, module and optimizers, as Lightning's
    ``Strategy`` has them); ``rules``: its :class:`~lightning_mgpu.plugins.checkpoint_rules.CheckpointRules` (what
    every save and load does first and after, the background writes, adapter-only checkpoints, the precision plugin's
    masters); ``sharding()``: the
    strategy's sharding backend now (``parts/sharding.py``: it gathers and scatters the states); ``marker``: what the
    completion marker of a directory says of the layout beside the world size (stage, backend).

    Example::

        marker = {"stage": 3, "backend": "torch"}
        checkpoints = ShardedCheckpoints(strategy, rules, lambda: backend, "sharded", marker)
        checkpoints.save(checkpoint, "run/last.ckpt", None, lightning_save)   # a directory, every rank writing
    """

    def __init__(
        self,
        strategy: ParallelStrategy,
        rules: Any,
        sharding: Callable[[], Any],
        layout: str,
        marker: Mapping[str, Any],
    ) -> None:
        self.strategy = strategy
        self.rules = rules
        self._sharding = sharding
        self.layout = layout
        self._marker = dict(marker)
        self.loaded_in_place = False  # the last load read a directory: weights and optimizer states are in place

    # --- before launch --------------------------------------------------------------------------------------
    def check_model(self, model: nn.Module, checkpoint_params: Any) -> None:
        """Before launch: a model whose checkpoints this layout cannot write is refused with the fix (a sharded
        directory of a 4-bit base with ``checkpoint_params="all"``)."""
        if self.layout == "sharded":
            check_sharded_save(model, checkpoint_params)

    def check_masters(self, mode: str, stage: int) -> None:
        """At Trainer construction, with MGPUPrecision's master mode ``mode``: stage 1's sharded directory is
        refused (its optimizer state is keyed by the model's parameter names, and the optimizer steps FP32
        masters)."""
        if stage == 1 and self.layout == "sharded":
            raise ValueError(
                f"MGPUPrecision({mode!r}) with stage=1 and checkpoint='sharded' is not supported: the sharded "
                f"optimizer checkpoint is keyed by the model's parameter names and the optimizer steps FP32 masters. "
                f"Use checkpoint='consolidated' (the default) or stage=2/3, whose FP32 masters FSDP2 shards itself."
            )

    def _served_module(self) -> nn.Module:
        module = self.strategy.lightning_module
        assert module is not None
        return module

    # --- saving ---------------------------------------------------------------------------------------------
    def module_state(self) -> dict[str, Any]:
        """The module's state as this layout saves it: this rank's shards, or the whole state (on rank 0; an
        adapter-only save gathers the entries it keeps, not the frozen base), with the precision plugin's masters."""
        module = self._served_module()
        if self.layout == "sharded":
            return self.rules.module_state(self._sharding().sharded_model_state(module))
        return self.rules.module_state(self._sharding().full_model_state(module, self.rules.saved_keys()))

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``optimizer``'s state as this layout saves it (this rank's shards, or the whole state on rank 0)."""
        optimizer = unwrap_optimizer(optimizer)
        if self.layout == "sharded":
            return self._sharding().sharded_optimizer_state(self._served_module(), optimizer)
        return self.consolidated_optimizer_state(optimizer)

    def consolidated_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole state of ``optimizer`` as one process's ``optimizer.state_dict()`` on rank 0; ``{}``
        elsewhere. A collective."""
        optimizer = unwrap_optimizer(optimizer)
        return self._sharding().full_optimizer_state(self._served_module(), optimizer, self.strategy.is_global_zero)

    def save(self, checkpoint: dict[str, Any], filepath: PathLike, options: Any, lightning_save: LightningSave) -> None:
        """Write ``checkpoint`` at ``filepath`` (a collective): a file through the checkpoint IO
        (``lightning_save``: Lightning's save), or the directory; in the background with ``async_checkpoint=True``;
        with fault tolerance, by the lowest replica group only."""
        self.rules.before_save(checkpoint)  # before the sharded layout puts the non-tensor part into meta.pt
        if self.layout == "sharded" and self.rules.saves_async():
            # rank 0's path reaches the others in the background, with the name of its staging directory
            # (sharded_directory_write): nothing on the training thread waits for the other ranks
            filepath = str(filepath)
        else:
            filepath = self.strategy.broadcast(str(filepath))  # a string: Path() would mangle a remote URL (s3://...)
        local = local_path(filepath)
        if self.layout == "consolidated":
            if local is not None and os.path.isdir(local):
                raise IsADirectoryError(
                    f"{local} is a directory (a sharded checkpoint?); a consolidated checkpoint is one file. Choose "
                    f"another file name, or save with MGPUShardedStrategy(checkpoint='sharded')."
                )
            self.rules.write_file(checkpoint, filepath, options, lightning_save)  # atomic by default
            return
        if options is not None:
            raise TypeError("storage_options is not supported with checkpoint='sharded' (DCP writes the files).")
        if not self.rules.writes_checkpoints():  # fault tolerance: the lowest replica group writes
            return
        save_dir(
            checkpoint,
            local if local is not None else str(filepath),  # a local directory, or a prefix at an fsspec URL
            rank=self.strategy.global_rank,
            broadcast=self.strategy.broadcast,
            barrier=self.strategy.barrier,
            group=_world_group(),
            marker={"world_size": self.strategy.world_size, **self._marker, "layout": self.layout},
            writes=self.rules.writes if self.rules.saves_async() else None,
        )

    def remove(self, filepath: PathLike, lightning_remove: Callable[[Any], None]) -> None:
        """Remove the checkpoint at ``filepath`` once the write in flight has succeeded: a directory by rank 0
        (whatever the checkpoint IO: the strategy wrote it, not the plugin), a file by ``lightning_remove``."""
        local = local_path(filepath)
        if self.strategy.is_global_zero and local is not None and os.path.isdir(local):
            self.rules.remove_when_written(lambda: remove_dir(local))
            return
        self.rules.remove_when_written(lambda: lightning_remove(os.fspath(filepath)))

    # --- loading --------------------------------------------------------------------------------------------
    def load(
        self,
        checkpoint_path: PathLike,
        weights_only: Optional[bool],
        lightning_load: Callable[..., dict[str, Any]],
    ) -> dict[str, Any]:
        """Read the checkpoint at ``checkpoint_path`` (a collective), either layout whatever this strategy saves:
        a file through ``lightning_load`` (Lightning's), whose states :meth:`load_module_state` and
        :meth:`load_optimizer_states` then scatter; a directory loaded in place now (weights and optimizer states,
        each rank reading the slices it owns). A save killed in the instant of its swap is recovered first."""
        if self.strategy.is_global_zero:
            recover_dir(local_path(checkpoint_path) or checkpoint_path)
        checkpoint_path = self.strategy.broadcast(str(checkpoint_path))  # the broadcast waits for the recovery
        local = local_path(checkpoint_path)
        path: Union[Path, str] = Path(local) if local is not None else str(checkpoint_path)  # a URL stays a string
        if checkpoint_kind(path) != "dir":
            self.loaded_in_place = False
            return self.rules.after_load(lightning_load(os.fspath(checkpoint_path), weights_only=weights_only))
        checkpoint = load_dir(
            path,
            self.strategy.lightning_module,  # needed once the directory is found complete and its meta.pt read
            weights_only=weights_only,
            group=_world_group(),
            optimizers=self.strategy.optimizers,
            restore_optimizers=self.strategy.lightning_restore_optimizer,
            sharding=self._sharding(),
            frozen_left_out=self.rules.frozen_left_out,
        )
        self.loaded_in_place = True
        return self.rules.after_load(checkpoint)

    def load_module_state(self, checkpoint: Mapping[str, Any], strict: bool) -> None:
        """A file's weights scattered into the module (a directory's are loaded already), then the masters."""
        if not self.loaded_in_place:
            module = self._served_module()
            sharding = self._sharding()
            self.rules.load_weights(
                checkpoint, strict, lambda c, s: sharding.load_full_model_state(module, c["state_dict"], s)
            )
        self.rules.load_masters(checkpoint)

    def load_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        """A file's optimizer states scattered into the optimizers (a directory's are loaded already)."""
        if self.loaded_in_place:
            return
        optimizers = self.strategy.optimizers
        states = checkpoint["optimizer_states"]
        if len(states) != len(optimizers):
            raise ValueError(
                f"The checkpoint has {len(states)} optimizer states and configure_optimizers returned "
                f"{len(optimizers)} optimizers: resume with the same configure_optimizers."
            )
        for opt, state in zip(optimizers, states):
            if not state:
                raise ValueError(
                    "The checkpoint's optimizer state is empty: it was saved in the main process after a spawn or "
                    "fork launch (plain Lightning does that). Resume from a checkpoint written during fit "
                    "(ModelCheckpoint), or pass weights_only=True to Trainer.fit's ckpt_path logic by loading the "
                    "weights with LightningModule.load_from_checkpoint and starting a new fit."
                )
            self._sharding().load_full_optimizer_state(self._served_module(), opt, state)
