"""The sharded checkpoint of ``MGPUShardedStrategy(checkpoint="sharded")``: one directory per checkpoint, written by
every rank at once and loaded at any world size.

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
  background (:func:`sharded_directory_write`), and the marker still comes last.

Loading reads every entry as data unless ``weights_only=False`` (``plugins/checkpoint_io.py``), and each rank reads the
slices it owns now, whatever the world size at save time. An adapter-only checkpoint of a frozen base leaves the base
as built; the strategy's runtime refuses one saved over another base first.

Example::

    trainer = Trainer(strategy=MGPUShardedStrategy(stage=3, checkpoint="sharded"), devices=2)
    trainer.fit(model)
    trainer.save_checkpoint("run/last.ckpt")           # a directory: meta.pt, .metadata, __0_0.distcp, ...
    Trainer(strategy=MGPUShardedStrategy(stage=3, checkpoint="sharded"), devices=4).fit(
        model, ckpt_path="run/last.ckpt")              # resumed at 4 ranks
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_mgpu import comm
from lightning_mgpu.plugins.checkpoint_io import (
    EMA_STATE_KEY,
    begin_dir,
    check_complete,
    checkpoint_kind,
    commit_dir,
    dcp_layout,
    join_path,
    load_file,
    load_sharded_dir,
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
    completion marker says of the layout (world size, stage, backend). ``writes``: the runtime's background writes
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
    staging = broadcast(begin_dir(target) if rank0 else "")
    if writes is not None:
        _save_async(tensors, checkpoint, staging, target, info, rank, writes)
        return
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
    staging: str,
    target: str,
    info: dict[str, Any],
    rank: int,
    writes: Any,
) -> None:
    """With ``async_checkpoint=True``: every rank stages its shards now; the background write marks the directory
    complete only once every rank's part is on disk."""
    rank0 = rank == 0
    writes.unsettled = True
    staged = writes.writer.stage({"tensors": tensors, "meta": checkpoint if rank0 else None})
    write = sharded_directory_write(
        staged["tensors"],
        staging,
        writes.group(),
        write_meta=(
            lambda: write_checkpoint_file(join_path(staging, METADATA), lambda f: torch.save(staged["meta"], f))
        )
        if rank0
        else None,
        commit=(lambda: commit_dir(staging, target, info)) if rank0 else None,
    )
    writes.submit(str(target), rank, write)


def sharded_directory_write(
    tensors: dict[str, Any],
    staging: str,
    group: Any,
    write_meta: Optional[Callable[[], None]] = None,
    commit: Optional[Callable[[], None]] = None,
) -> Callable[[], None]:
    """The background half of an asynchronous sharded save, run on every rank: write this rank's staged
    ``tensors`` into ``staging`` (a local directory or an fsspec URL) with ``torch.distributed.checkpoint`` (its
    collectives on ``group``, a group of its own: they must not interleave with training's), then ``write_meta()``;
    the ranks agree that every part is written (or that one failed: then nobody marks it), and only then
    ``commit()`` (rank 0: the marker and the swap). Give ``write_meta`` and ``commit`` on rank 0 only."""

    def write() -> None:
        failed = torch.zeros(1)
        try:
            save_sharded(tensors, str(staging), group)
            if write_meta is not None:
                write_meta()
        except BaseException:
            failed[0] = 1
            raise
        finally:
            comm.all_reduce(failed, op=torch.distributed.ReduceOp.MAX, group=group)
        if failed.item():
            raise RuntimeError(f"another rank failed to write its part into {staging}; it was not marked complete")
        if commit is not None:
            commit()

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
