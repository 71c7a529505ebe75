"""plugins/sharded_checkpoint.py without a Trainer: what a directory holds (the marker, meta.pt's counts and names), a
round trip of weights, optimizer state and EMA into a fresh model, and the refusals that name the fix. The integration
tests (strategies, async checkpoints, resume at another world size, S3) go through a Trainer."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lightning_mgpu.parts.sharding import ShardingBackend
from lightning_mgpu.plugins.async_checkpoint import AsyncCheckpointWriter, AsyncWrites
from lightning_mgpu.plugins.checkpoint_io import COMPLETE_MARKER, EMA_STATE_KEY, check_complete
from lightning_mgpu.plugins.sharded_checkpoint import (
    EMA_NAMES,
    METADATA,
    OPTIMIZER_COUNT,
    ShardedCheckpoints,
    load_dir,
    read_meta,
    save_dir,
    sharded_directory_write,
)
from tests.parts_harness import in_one_rank_group


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, sharding: ShardingBackend) -> None:
    checkpoint = {
        "state_dict": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer_states": [sharding.sharded_optimizer_state(model, optimizer)],
        EMA_STATE_KEY: {"weight": model.weight.detach() * 2},
        "epoch": 3,
        "global_step": 7,
    }
    save_dir(
        checkpoint,
        path,
        rank=0,
        broadcast=lambda obj: obj,
        barrier=lambda name: None,
        group=None,
        marker={"world_size": 1, "stage": 3, "layout": "sharded"},
    )


def _load(path: str, model: nn.Module, optimizers: list, restore: bool = True) -> dict:
    return load_dir(
        path,
        model,
        weights_only=True,
        group=None,
        optimizers=optimizers,
        restore_optimizers=restore,
        sharding=ShardingBackend(3),
        frozen_left_out=lambda checkpoint: None,
    )


def _round_trip() -> None:
    path = os.path.join(tempfile.mkdtemp(), "last.ckpt")
    model, optimizer = _trained(0)
    _save(path, model, optimizer, ShardingBackend(3))

    marker = json.load(open(os.path.join(path, COMPLETE_MARKER)))
    assert {k: marker[k] for k in ("format", "version", "world_size", "optimizers", "epoch", "global_step")} == {
        "format": "lightning_mgpu.sharded",
        "version": 1,
        "world_size": 1,
        "optimizers": 1,
        "epoch": 3,
        "global_step": 7,
    }
    assert METADATA in marker["files"] and ".metadata" in marker["files"]
    meta = read_meta(path, weights_only=True)
    assert (meta[OPTIMIZER_COUNT], meta[EMA_NAMES], meta["epoch"]) == (1, ["weight"], 3)
    assert "state_dict" not in meta and "optimizer_states" not in meta  # the tensors are in DCP's files

    fresh, fresh_optimizer = _trained(1)
    assert not torch.equal(fresh.weight, model.weight)  # the round trip below has something to prove
    loaded = _load(path, fresh, [fresh_optimizer])
    torch.testing.assert_close(fresh.state_dict(), model.state_dict())
    for p, q in zip(fresh.parameters(), model.parameters()):
        torch.testing.assert_close(fresh_optimizer.state[p], optimizer.state[q])
    torch.testing.assert_close(loaded[EMA_STATE_KEY]["weight"], model.weight.detach() * 2)
    assert (loaded["epoch"], len(loaded["optimizer_states"])) == (3, 1)

    # weights only: the optimizer is left as it was
    other, other_optimizer = _trained(2)
    before = {k: v.clone() for k, v in other_optimizer.state[other.weight].items()}
    assert _load(path, other, [other_optimizer], restore=False)["optimizer_states"] == []
    torch.testing.assert_close(other_optimizer.state[other.weight], before)

    # another optimizer count than saved: refused, naming both counts and the fix
    two = [torch.optim.SGD([fresh.weight], lr=0.1), torch.optim.SGD([fresh.bias], lr=0.1)]
    with pytest.raises(ValueError, match="holds 1 optimizer states and configure_optimizers returned 2 optimizers"):
        _load(path, fresh, two)


def test_a_sharded_directory_holds_its_counts_and_loads_back_weights_optimizer_state_and_ema():
    in_one_rank_group(_round_trip)


def test_a_file_is_not_overwritten_by_a_sharded_save_and_a_directory_without_meta_is_refused(tmp_path):
    taken = tmp_path / "last.ckpt"
    taken.write_bytes(b"a consolidated checkpoint")
    model, optimizer = _trained(0)
    with pytest.raises(FileExistsError, match=r"is a file .*checkpoint='consolidated'"):
        _save(str(taken), model, optimizer, ShardingBackend(3))
    assert taken.read_bytes() == b"a consolidated checkpoint"  # nothing of the user's is touched

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / COMPLETE_MARKER).write_text(json.dumps({"files": []}))
    with pytest.raises(FileNotFoundError, match=r"without meta\.pt: not a sharded checkpoint"):
        read_meta(bare, weights_only=True)


# ---------------------------------------------------------------------------------------------------------
# asynchronous saves: nothing on the training thread waits for the other ranks
# ---------------------------------------------------------------------------------------------------------

_COLLECTIVES = (
    "broadcast",
    "broadcast_object_list",
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "gather_object",
    "scatter_object_list",
    "reduce_scatter_tensor",
    "barrier",
)


def _recording_collectives(calls: list[tuple[str, bool]]) -> dict[str, Any]:
    """Wrap torch.distributed's collectives to record (name, called on the main thread); returns the originals."""
    originals = {name: getattr(torch.distributed, name) for name in _COLLECTIVES}

    def wrap(name: str, fn: Any) -> Any:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            calls.append((name, threading.current_thread() is threading.main_thread()))
            return fn(*args, **kwargs)

        return recorded

    for name, fn in originals.items():
        setattr(torch.distributed, name, wrap(name, fn))
    return originals


def _async_save_issues_no_collective_on_the_training_thread() -> None:
    path = os.path.join(tempfile.mkdtemp(), "last.ckpt")
    model, optimizer = _trained(0)
    writes = AsyncWrites(AsyncCheckpointWriter(), timeout=timedelta(seconds=60))
    writes.group()  # made at the first asynchronous save (a collective, once): this is a later save
    rules = SimpleNamespace(
        before_save=lambda checkpoint: None,
        saves_async=lambda: True,
        writes_checkpoints=lambda: True,
        writes=writes,
    )

    def no_collective(*args: Any) -> Any:
        raise AssertionError("the asynchronous save asked the strategy for a collective on the training thread")

    strategy = SimpleNamespace(broadcast=no_collective, barrier=no_collective, global_rank=0, world_size=1)
    checkpoints = ShardedCheckpoints(strategy, rules, lambda: ShardingBackend(3), "sharded", {"stage": 3})  # type: ignore[arg-type]
    checkpoint = {
        "state_dict": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer_states": [ShardingBackend(3).sharded_optimizer_state(model, optimizer)],
        "epoch": 3,
        "global_step": 7,
    }
    calls: list[tuple[str, bool]] = []
    originals = _recording_collectives(calls)
    try:
        checkpoints.save(checkpoint, path, None, lambda *args: None)
        writes.settle(1)
    finally:
        for name, fn in originals.items():
            setattr(torch.distributed, name, fn)
    assert calls and not [c for c in calls if c[1]], calls  # all in the writer thread (the staging name, DCP's)
    assert ("broadcast_object_list", False) in calls  # rank 0 sent the staging directory's name there
    assert check_complete(path)["global_step"] == 7
    assert os.listdir(os.path.dirname(path)) == ["last.ckpt"]  # the staging directory swapped in
    fresh, fresh_optimizer = _trained(1)
    _load(path, fresh, [fresh_optimizer])
    torch.testing.assert_close(fresh.state_dict(), model.state_dict())
    writes.end()


def test_an_asynchronous_sharded_save_issues_no_collective_on_the_training_thread():
    in_one_rank_group(_async_save_issues_no_collective_on_the_training_thread)


def _a_failure_to_make_the_staging_directory_fails_the_write_on_every_rank() -> None:
    into = os.path.join(tempfile.mkdtemp(), "never")

    def begin() -> str:
        raise PermissionError(13, "Permission denied", into)

    written: list[str] = []
    write = sharded_directory_write(
        {"w": torch.ones(2)}, None, write_meta=written.append, commit=written.append, begin=begin
    )
    with pytest.raises(PermissionError, match="Permission denied"):
        write()
    assert written == [] and not os.path.exists(into)


def test_a_failure_to_make_the_staging_directory_in_the_background_fails_the_write():
    in_one_rank_group(_a_failure_to_make_the_staging_directory_fails_the_write_on_every_rank)
