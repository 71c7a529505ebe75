"""Atomic checkpoints: a process killed in the middle of a save leaves the previous checkpoint complete and
loadable under its name, for one file (AtomicCheckpointIO, the default of every mgpu strategy) and for a
sharded directory (MGPUShardedStrategy(checkpoint="sharded"): marked complete only once every rank wrote).

The kill tests fork a worker into its own session; it fits on 2 fork-launched ranks and saves ``last.ckpt``
after every epoch. The worker's second save stops at a chosen point, signals a ``ready`` file and blocks;
the test then SIGKILLs the worker's whole process group (the ranks included) and inspects the directory.
With ``async_checkpoint=True`` the save stops in the background writer thread, while training goes on.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import functools
import io
import json
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Optional

import pytest
import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import TorchCheckpointIO
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from pytorch_lightning.plugins.io import AsyncCheckpointIO
from typing_extensions import override

import lightning_mgpu.plugins.sharded_checkpoint as sharded_checkpoint
from lightning_mgpu import (
    AtomicCheckpointIO,
    IncompleteCheckpointError,
    MGPUDDPStrategy,
    MGPULocalSGDStrategy,
    MGPUShardedStrategy,
)
from lightning_mgpu.plugins.checkpoint_io import COMPLETE_MARKER, check_complete, recover_dir
from tests.helpers import Poison
from tests.matrix import tiers
from tests.models import RankData, Regressor, make_data

STEPS_PER_EPOCH = 2  # 16 samples, 2 ranks x batch 4
DEADLINE_S = 120.0


# ---------------------------------------------------------------------------------------------------------
# the kill harness
# ---------------------------------------------------------------------------------------------------------


def _block_until_killed(ready: Path, content: str = "") -> None:
    ready.with_suffix(".part").write_text(content)
    ready.with_suffix(".part").replace(ready)  # the test reads it as soon as it exists
    threading.Event().wait()  # the test SIGKILLs this process


def _wait_for(path: Path, deadline: float) -> None:
    """In a worker rank: wait for another rank's signal file (bounded, so a broken test cannot hang)."""
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.01)


class _HalfWrite:
    """Installed in a worker before fit (its forked ranks inherit it): every file opened for writing in
    ``directory`` is counted; the second one stops after half as many bytes as the first one had, writes
    that count into ``ready`` and blocks. One rule for every writer: bytes reach the checkpoint directory
    through Python file objects (ours through ``torch.save(obj, file)``, Lightning's through a copy)."""

    def __init__(self, directory: Path, ready: Path) -> None:
        self.directory = directory.resolve()
        self.ready = ready
        self.first_size: Optional[int] = None
        self.opened = 0
        self._open = builtins.open
        builtins.open = self.open  # type: ignore[assignment]

    def open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = self._open(file, mode, *args, **kwargs)
        if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wxa"):
            if Path(file).resolve().parent == self.directory:
                self.opened += 1
                return _CountingFile(f, self, self.opened)
        return f


class _CountingFile:
    def __init__(self, f: IO[bytes], trip: _HalfWrite, index: int) -> None:
        self._f = f
        self._trip = trip
        self._index = index
        self._written = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if self._index == 2:
            assert self._trip.first_size is not None
            limit = self._trip.first_size // 2
            if self._written + n >= limit:
                self._f.write(memoryview(data).cast("B")[: limit - self._written])
                self._f.flush()
                _block_until_killed(self._trip.ready, str(limit))
        self._written += n
        return self._f.write(data)

    def close(self) -> None:
        if self._index == 1 and self._trip.first_size is None:
            self._trip.first_size = self._written
        self._f.close()

    def __enter__(self) -> _CountingFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _hang_before_rank1_writes(ckpt_dir: Path, signals: Path) -> None:
    """Rank 1 stops before writing its shard of the second save, once rank 0 has written its own."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    original = FileSystemWriter.write_data
    calls = [0]

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2 and torch.distributed.get_rank() == 1:
            _wait_for(signals / "rank0_wrote", time.monotonic() + DEADLINE_S)
            _block_until_killed(signals / "ready")
        result = original(self, plan, planner)  # synchronous: the shard file is written and fsynced
        if calls[0] == 2:
            (signals / "rank0_wrote").touch()
        return result

    FileSystemWriter.write_data = write_data  # type: ignore[method-assign]


def _hang_before_the_marker(ckpt_dir: Path, signals: Path) -> None:
    """Rank 0 stops after every rank has written the second save, before it marks it complete."""
    original = sharded_checkpoint.commit_dir
    calls = [0]

    def commit_dir(staging: Path, path: Any, info: dict[str, Any]) -> None:
        calls[0] += 1
        if calls[0] == 2:
            _block_until_killed(signals / "ready")
        original(staging, path, info)

    sharded_checkpoint.commit_dir = commit_dir


class _FirstEpoch(Callback):
    """Rank 0 writes the epoch its fit starts at (1 after a resume from the end of epoch 0)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.out.write_text(str(trainer.current_epoch))


def _fit(
    strategy: Any,
    ckpt_dir: Path,
    max_epochs: int,
    ckpt_path: Optional[Path] = None,
    weights_only: Optional[bool] = None,
    callbacks: Optional[list[Callback]] = None,
) -> int:
    """Fit on 2 fork-launched ranks, saving last.ckpt at the end of every epoch; returns the first epoch."""
    first_epoch = ckpt_dir.parent / "first_epoch.txt"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=max_epochs,
        # every epoch to the same name, last.ckpt (save_last=True alone saves only at the end of fit)
        callbacks=[
            ModelCheckpoint(dirpath=ckpt_dir, filename="last", enable_version_counter=False),
            _FirstEpoch(first_epoch),
            *(callbacks or []),
        ],
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        Regressor().double(), datamodule=RankData(make_data(n=16), 4), ckpt_path=ckpt_path, weights_only=weights_only
    )
    return int(first_epoch.read_text())


def _worker(setup: Callable[[Path, Path], Any], strategy: Any, ckpt_dir: Path, signals: Path) -> None:
    os.setsid()  # its own process group: the test kills it and the ranks it forks at once
    setup(ckpt_dir, signals)
    _fit(strategy, ckpt_dir, max_epochs=3)
    (signals / "finished").touch()  # only if the save did not stop: the test fails


def _kill_during_second_save(setup: Callable[[Path, Path], Any], strategy: Any, ckpt_dir: Path, signals: Path) -> str:
    """Run the worker until its second save stops, SIGKILL its process group; returns ``ready``'s content."""
    signals.mkdir()
    worker = multiprocessing.get_context("fork").Process(target=_worker, args=(setup, strategy, ckpt_dir, signals))
    worker.start()
    ready = signals / "ready"
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ready.exists():
            assert worker.is_alive(), f"the worker ended (exit code {worker.exitcode}) without stopping mid-save"
            assert time.monotonic() < deadline, "the worker did not reach the second save in time"
            worker.join(timeout=0.05)  # returns at once if the worker dies
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)  # type: ignore[arg-type]
        worker.join()
    assert worker.exitcode == -signal.SIGKILL
    return ready.read_text()


def _entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ---------------------------------------------------------------------------------------------------------
# one file
# ---------------------------------------------------------------------------------------------------------


def _half_write(ckpt_dir: Path, signals: Path) -> None:
    _HalfWrite(ckpt_dir, signals / "ready")


def _half_write_lightning_copy(tmpdir: str, ckpt_dir: Path, signals: Path) -> None:
    # Lightning's TorchCheckpointIO writes to tempfile.mkstemp() in $TMPDIR and moves it into place: on
    # another filesystem (tmpfs /dev/shm beside the checkpoint directory: seen here) rename(2) fails with
    # EXDEV and shutil.move copies instead, whose open(checkpoint, "wb") has truncated the previous checkpoint
    # before the first byte. The worker's os.rename answers EXDEV for renames out of ``tmpdir`` as the kernel
    # does across filesystems, so this runs on any machine. Python copies with sendfile(2) on Linux, which the
    # harness cannot stop midway; without it, copyfileobj writes the same bytes through the file object.
    tempfile.tempdir = tmpdir
    rename = os.rename

    def cross_device_rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if str(src).startswith(tmpdir):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), None, str(dst))
        rename(src, dst, *args, **kwargs)

    os.rename = cross_device_rename  # type: ignore[assignment]
    shutil._USE_CP_SENDFILE = False  # type: ignore[attr-defined]
    _half_write(ckpt_dir, signals)


FILE_STRATEGIES = {
    "mgpu_ddp": lambda: MGPUDDPStrategy(start_method="fork"),
    "zero3-consolidated": lambda: MGPUShardedStrategy(stage=3, start_method="fork"),
    "mgpu_ddp-async": lambda: MGPUDDPStrategy(start_method="fork", async_checkpoint=True),
    "zero3-consolidated-async": lambda: MGPUShardedStrategy(stage=3, start_method="fork", async_checkpoint=True),
}


@pytest.mark.parametrize("name", FILE_STRATEGIES)
def test_kill_during_a_file_save_keeps_the_previous_checkpoint(tmp_path, name):
    ckpt_dir = tmp_path / "ckpt"
    strategy = FILE_STRATEGIES[name]
    written = int(_kill_during_second_save(_half_write, strategy(), ckpt_dir, tmp_path / "signals"))

    saved = torch.load(ckpt_dir / "last.ckpt", weights_only=False)
    assert (saved["epoch"], saved["global_step"]) == (0, STEPS_PER_EPOCH)  # the first save, whole
    (temp, last) = _entries(ckpt_dir)  # a leftover, hidden and not *.ckpt: never taken for a checkpoint
    assert last == "last.ckpt" and temp.startswith(".last.ckpt.tmp-") and not temp.endswith(".ckpt")
    assert (ckpt_dir / temp).stat().st_size == written  # killed mid-write

    # resume from it; the next save of last.ckpt replaces it and removes the leftover
    assert _fit(strategy(), ckpt_dir, max_epochs=2, ckpt_path=ckpt_dir / "last.ckpt") == 1
    assert _entries(ckpt_dir) == ["last.ckpt"]
    saved = torch.load(ckpt_dir / "last.ckpt", weights_only=False)
    assert (saved["epoch"], saved["global_step"]) == (1, 2 * STEPS_PER_EPOCH)


def test_kill_during_lightnings_plain_save_truncates_the_checkpoint(tmp_path):
    """Negative control: the same kill with Lightning's TorchCheckpointIO, $TMPDIR on another filesystem."""
    ckpt_dir = tmp_path / "ckpt"
    with tempfile.TemporaryDirectory(dir=tmp_path) as tmpdir:
        strategy = MGPUDDPStrategy(start_method="fork", checkpoint_io=TorchCheckpointIO())
        setup = functools.partial(_half_write_lightning_copy, tmpdir)
        written = int(_kill_during_second_save(setup, strategy, ckpt_dir, tmp_path / "signals"))

        assert _entries(ckpt_dir) == ["last.ckpt"]
        assert (ckpt_dir / "last.ckpt").stat().st_size == written  # the previous checkpoint is gone...
        with pytest.raises(RuntimeError, match="zip archive"):
            torch.load(ckpt_dir / "last.ckpt", weights_only=False)  # ...and this one is truncated


# ---------------------------------------------------------------------------------------------------------
# a sharded directory
# ---------------------------------------------------------------------------------------------------------


def _sharded(stage: int = 2, backend: str = "torch", async_checkpoint: bool = False) -> MGPUShardedStrategy:
    return MGPUShardedStrategy(
        stage=stage,  # type: ignore[arg-type]
        backend=backend,  # type: ignore[arg-type]
        checkpoint="sharded",
        start_method="fork",
        async_checkpoint=async_checkpoint,
    )


_RANK1_WROTE = (_hang_before_rank1_writes, ["__0_0.distcp"])
_ALL_WROTE = (_hang_before_the_marker, [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"])


# every stage and backend at the first kill point; the marker is written by the same code for all of them. The slow
# tier: zero2-fsdp2 and its background write at the first point (zero2-fsdp2 meets it at the second, ZeRO-3 and the
# other backend at the first, the background write at the second)
@pytest.mark.parametrize(
    ("stage", "backend", "setup", "staged", "async_checkpoint"),
    tiers(
        {
            "zero2-fsdp2-before-rank1-wrote": (2, "torch", *_RANK1_WROTE, False),
            "zero2-fsdp2-before-the-marker": (2, "torch", *_ALL_WROTE, False),
            "zero1-before-rank1-wrote": (1, "torch", *_RANK1_WROTE, False),
            "zero3-fsdp2-before-rank1-wrote": (3, "torch", *_RANK1_WROTE, False),
            "zero2-fairscale-before-rank1-wrote": (2, "fairscale", *_RANK1_WROTE, False),
            "async-zero2-fsdp2-before-rank1-wrote": (2, "torch", *_RANK1_WROTE, True),
            "async-zero2-fsdp2-before-the-marker": (2, "torch", *_ALL_WROTE, True),
        },
        slow={"zero2-fsdp2-before-rank1-wrote", "async-zero2-fsdp2-before-rank1-wrote"},
    ),
)
def test_kill_during_a_sharded_save_keeps_the_previous_checkpoint(
    tmp_path, stage, backend, setup, staged, async_checkpoint
):
    ckpt_dir = tmp_path / "ckpt"
    _kill_during_second_save(setup, _sharded(stage, backend, async_checkpoint), ckpt_dir, tmp_path / "signals")

    (temp, last) = _entries(ckpt_dir)
    assert last == "last.ckpt" and temp.startswith(".last.ckpt.tmp-")
    marker = check_complete(ckpt_dir / last)  # the first save, whole
    assert (marker["epoch"], marker["global_step"], marker["world_size"]) == (0, STEPS_PER_EPOCH, 2)
    assert _entries(ckpt_dir / temp) == staged  # the interrupted save: no marker
    with pytest.raises(IncompleteCheckpointError, match="save was interrupted") as err:
        _sharded().load_checkpoint(ckpt_dir / temp)
    assert str(ckpt_dir / temp) in str(err.value) and COMPLETE_MARKER in str(err.value)
    assert f"ckpt_path='{ckpt_dir / 'last.ckpt'}'" in str(err.value)  # the fix: the previous checkpoint

    # resume from the previous one; the next save of last.ckpt replaces it and removes the leftover
    assert (
        _fit(_sharded(stage, backend, async_checkpoint), ckpt_dir, max_epochs=2, ckpt_path=ckpt_dir / "last.ckpt") == 1
    )
    assert _entries(ckpt_dir) == ["last.ckpt"]
    marker = check_complete(ckpt_dir / "last.ckpt")
    assert (marker["epoch"], marker["global_step"]) == (1, 2 * STEPS_PER_EPOCH)


# ---------------------------------------------------------------------------------------------------------
# the pieces, in one process
# ---------------------------------------------------------------------------------------------------------


def test_atomic_io_replaces_the_file_and_leaves_nothing_else(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, tmp_path / "sub" / "last.ckpt")
    io.save_checkpoint({"step": 2}, tmp_path / "sub" / "last.ckpt")
    assert _entries(tmp_path / "sub") == ["last.ckpt"]
    assert io.load_checkpoint(tmp_path / "sub" / "last.ckpt") == {"step": 2}


def test_atomic_io_removes_leftovers_of_killed_saves_of_the_same_name_only(tmp_path):
    for name in (".last.ckpt.tmp-1", ".last.ckpt.tmp-999999", ".other.ckpt.tmp-1"):
        (tmp_path / name).write_bytes(b"half")
    AtomicCheckpointIO().save_checkpoint({"step": 1}, tmp_path / "last.ckpt")
    assert _entries(tmp_path) == [".other.ckpt.tmp-1", "last.ckpt"]


def test_a_failing_save_keeps_the_previous_file_and_leaves_no_temporary(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, tmp_path / "last.ckpt")
    with pytest.raises(Exception, match="pickle"):
        io.save_checkpoint({"step": 2, "bad": lambda: None}, tmp_path / "last.ckpt")
    assert _entries(tmp_path) == ["last.ckpt"]
    assert io.load_checkpoint(tmp_path / "last.ckpt") == {"step": 1}


def test_remote_paths_are_saved_by_lightnings_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 3}, "memory://ckpts/last.ckpt")
    assert io.load_checkpoint("memory://ckpts/last.ckpt") == {"step": 3}
    strategy = MGPUShardedStrategy(stage=3)  # consolidated: through the strategy, which kept the URL whole
    strategy.save_checkpoint({"step": 4}, "memory://ckpts/zero3.ckpt")
    assert strategy.load_checkpoint("memory://ckpts/zero3.ckpt") == {"step": 4}
    assert _entries(tmp_path) == []  # nothing written locally (a Path() would have made "memory:/ckpts")
    for name in ("last.ckpt", "zero3.ckpt"):
        io.remove_checkpoint(f"memory://ckpts/{name}")
    # the sharded layout too (through torch.distributed.checkpoint's fsspec writer): the files, then the marker
    import fsspec

    _sharded().save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 0}, "memory://ckpts/sharded.ckpt")
    memory = fsspec.filesystem("memory")
    marker = json.loads(memory.cat_file(f"/ckpts/sharded.ckpt/{COMPLETE_MARKER}"))
    assert sorted(p.rsplit("/", 1)[1] for p in memory.ls("/ckpts/sharded.ckpt", detail=False)) == sorted(
        [*marker["files"], COMPLETE_MARKER]
    )
    assert memory.ls("/ckpts", detail=False) == ["/ckpts/sharded.ckpt"]  # no staging left beside it
    assert _entries(tmp_path) == []
    memory.rm("/ckpts", recursive=True)


@pytest.mark.parametrize("strategy", ["mgpu_ddp_fork", "mgpu_sharded_notebook", "mgpu_zero1", "mgpu_zero3"])
def test_every_strategy_saves_atomically_unless_given_its_own_plugin(strategy):
    def io(**kwargs: Any) -> Any:
        return pl.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, logger=False, **kwargs
        ).strategy.checkpoint_io

    assert type(io()) is AtomicCheckpointIO
    mine = TorchCheckpointIO()
    assert io(plugins=[mine]) is mine  # respected as it is
    wrapped = io(plugins=[AsyncCheckpointIO()])
    assert isinstance(wrapped, AsyncCheckpointIO) and type(wrapped.checkpoint_io) is AtomicCheckpointIO
    assert MGPUShardedStrategy(checkpoint_io=mine).checkpoint_io is mine


def _complete(directory: Path, step: int) -> Path:
    directory.mkdir()
    (directory / COMPLETE_MARKER).write_text(json.dumps({"global_step": step, "files": [COMPLETE_MARKER]}))
    return directory


def test_a_swap_interrupted_between_its_renames_is_finished_on_the_next_load(tmp_path):
    """The one instant with no directory under the name: old set aside, new not yet renamed in."""
    final = tmp_path / "last.ckpt"
    _complete(tmp_path / ".last.ckpt.old-7", step=2)
    _complete(tmp_path / ".last.ckpt.tmp-7", step=4)
    with pytest.raises(FileNotFoundError, match=r"meta\.pt"):  # recovered first; this stand-in holds no state
        _sharded().load_checkpoint(final)
    assert check_complete(final)["global_step"] == 4
    assert _entries(tmp_path) == [".last.ckpt.old-7", "last.ckpt"]  # removed by the next save of the name


def test_recovery_falls_back_to_the_old_directory_and_never_to_an_incomplete_one(tmp_path):
    final = tmp_path / "last.ckpt"
    (tmp_path / ".last.ckpt.tmp-7").mkdir()  # no marker
    _complete(tmp_path / ".last.ckpt.old-7", step=2)
    assert recover_dir(final) == tmp_path / ".last.ckpt.old-7"
    assert check_complete(final)["global_step"] == 2
    shutil.rmtree(final)
    assert recover_dir(final) is None and not final.exists()


def test_loading_a_damaged_directory_is_refused(tmp_path):
    path = _complete(tmp_path / "last.ckpt", step=2)
    (path / COMPLETE_MARKER).write_text(json.dumps({"files": [COMPLETE_MARKER, "__1_0.distcp"]}))
    with pytest.raises(IncompleteCheckpointError, match=r"damaged.*__1_0\.distcp"):
        _sharded().load_checkpoint(path)


def test_removing_a_sharded_checkpoint_leaves_nothing(tmp_path):
    path = _complete(tmp_path / "epoch=0.ckpt", step=2)
    _sharded().remove_checkpoint(path)
    assert _entries(tmp_path) == []


# ---------------------------------------------------------------------------------------------------------
# a checkpoint is data: a poisoned one is refused under the default and weights_only=True, in every layout
# ---------------------------------------------------------------------------------------------------------
# Each test saves a checkpoint with 2 fork-launched ranks, adds an entry whose unpickling creates a marker file
# (as os.system would run a command), and resumes with Trainer.fit(ckpt_path=...): refused, naming the file and
# the call that loads it, without the marker; the negative control resumes with weights_only=False, and the
# marker shows the poison ran.


def _poison_file(file: Path, marker: Path) -> None:
    """An extra top-level entry in a file written by torch.save (a one-file checkpoint, a directory's meta.pt)."""
    checkpoint = torch.load(file, weights_only=True)  # what the pack wrote is data
    checkpoint["extra"] = Poison(marker)
    torch.save(checkpoint, file)


def _poison_metadata(directory: Path, marker: Path) -> None:
    """torch.distributed.checkpoint's metadata file, which torch reads with pickle.load."""
    metadata = pickle.loads((directory / ".metadata").read_bytes())
    metadata.planner_data = Poison(marker, metadata.planner_data)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


class _PoisonTheLearningRate(Callback):
    """At the save: the optimizer's learning rate becomes an object that unpickles to it after running the poison.
    In the sharded layout it is a non-tensor entry of a .distcp file, which torch reads with weights_only=False."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        group = checkpoint["optimizer_states"][0]["param_groups"][0]
        group["lr"] = Poison(self.marker, group["lr"])


def _sharded_dir(async_checkpoint: bool = False, stage: int = 3) -> MGPUShardedStrategy:
    return MGPUShardedStrategy(
        stage=stage, start_method="fork", checkpoint="sharded", async_checkpoint=async_checkpoint
    )  # type: ignore[arg-type]


_LAYOUTS: dict[str, tuple[Callable[[], Any], Callable[[Path, Path], Path]]] = {
    # name: (the strategy, poison(the saved checkpoint, marker) -> the file the refusal names)
    "ddp-file": (lambda: MGPUDDPStrategy(start_method="fork"), lambda p, m: (_poison_file(p, m), p)[1]),
    "async-ddp-file": (
        lambda: MGPUDDPStrategy(start_method="fork", async_checkpoint=True),
        lambda p, m: (_poison_file(p, m), p)[1],
    ),
    "local-sgd-file": (
        lambda: MGPULocalSGDStrategy(sync_every=2, start_method="fork"),
        lambda p, m: (_poison_file(p, m), p)[1],
    ),
    "zero2-consolidated-file": (
        lambda: MGPUShardedStrategy(stage=2, start_method="fork"),  # type: ignore[arg-type]
        lambda p, m: (_poison_file(p, m), p)[1],
    ),
    "zero3-sharded-meta": (_sharded_dir, lambda p, m: (_poison_file(p / "meta.pt", m), p / "meta.pt")[1]),
    "zero3-sharded-metadata": (_sharded_dir, lambda p, m: (_poison_metadata(p, m), p / ".metadata")[1]),
    "zero1-sharded-meta": (
        lambda: _sharded_dir(stage=1),
        lambda p, m: (_poison_file(p / "meta.pt", m), p / "meta.pt")[1],
    ),
    "async-zero3-sharded-meta": (
        lambda: _sharded_dir(async_checkpoint=True),
        lambda p, m: (_poison_file(p / "meta.pt", m), p / "meta.pt")[1],
    ),
    "async-zero3-sharded-metadata": (
        lambda: _sharded_dir(async_checkpoint=True),
        lambda p, m: (_poison_metadata(p, m), p / ".metadata")[1],
    ),
}
_DEFAULT_SUITE = ("ddp-file", "zero3-sharded-meta", "zero3-sharded-metadata")  # async saves load as sync ones


def _assert_refused(
    strategy: Callable[[], Any], ckpt: Path, file: Path, marker: Path, tmp: Path, weights_only: Optional[bool]
) -> None:
    # raised on the ranks; the fork launch raises it in the main process with the rank's traceback
    with pytest.raises(Exception, match="UnpicklingError") as err:
        _fit(strategy(), tmp / f"resume-{weights_only}", max_epochs=2, ckpt_path=ckpt, weights_only=weights_only)
    _assert_names(str(err.value), file, ckpt)
    assert not marker.exists()


def _assert_names(message: str, file: Path, ckpt: Path) -> None:
    assert f"UnpicklingError: {file} was not loaded" in message, message
    assert f"trainer.fit(model, ckpt_path='{ckpt}', weights_only=False)" in message


@pytest.mark.parametrize(
    "layout", [pytest.param(n, marks=() if n in _DEFAULT_SUITE else pytest.mark.slow) for n in _LAYOUTS]
)
def test_a_poisoned_checkpoint_is_refused_and_runs_only_with_weights_only_false(tmp_path, layout):
    strategy, poison = _LAYOUTS[layout]
    marker, ckpt_dir = tmp_path / "poison-ran", tmp_path / "ckpt"
    _fit(strategy(), ckpt_dir, max_epochs=1)
    ckpt = ckpt_dir / "last.ckpt"
    file = poison(ckpt, marker)
    for weights_only in (None, True):  # torch's default, and asked for
        _assert_refused(strategy, ckpt, file, marker, tmp_path, weights_only)
    # negative control: the user trusts the file; the poison runs and training goes on from the checkpoint
    assert _fit(strategy(), tmp_path / "resume-False", max_epochs=2, ckpt_path=ckpt, weights_only=False) == 1
    assert marker.exists()


@pytest.mark.parametrize("async_checkpoint", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sync", "async"])
def test_a_poisoned_entry_of_a_sharded_directorys_shards_is_refused(tmp_path, async_checkpoint):
    """The non-tensor entries of the .distcp files (the optimizer's hyper-parameters)."""
    marker, ckpt_dir = tmp_path / "poison-ran", tmp_path / "ckpt"
    _fit(_sharded_dir(async_checkpoint), ckpt_dir, max_epochs=1, callbacks=[_PoisonTheLearningRate(marker)])
    ckpt = ckpt_dir / "last.ckpt"
    assert not marker.exists()
    for weights_only in (None, True):
        with pytest.raises(Exception, match="UnpicklingError") as err:
            _fit(
                _sharded_dir(async_checkpoint),
                tmp_path / "resume",
                max_epochs=2,
                ckpt_path=ckpt,
                weights_only=weights_only,
            )
        _assert_names(str(err.value), ckpt, ckpt)
        assert "in the entry 'optimizer_0." in str(err.value)
        assert not marker.exists()
    assert (
        _fit(
            _sharded_dir(async_checkpoint), tmp_path / "resume-False", max_epochs=2, ckpt_path=ckpt, weights_only=False
        )
        == 1
    )
    assert marker.exists()


@pytest.mark.parametrize("layout", ["consolidated", "sharded"])
def test_what_the_pack_writes_resumes_with_weights_only_true(tmp_path, layout):
    """Every file of both layouts is plain data: torch.load(weights_only=True) reads it, and a resume with
    weights_only=True goes on from it (async writes included)."""
    strategy = lambda: MGPUShardedStrategy(  # noqa: E731
        stage=3, start_method="fork", checkpoint=layout, async_checkpoint=True
    )  # type: ignore[arg-type]
    ckpt_dir = tmp_path / "ckpt"
    _fit(strategy(), ckpt_dir, max_epochs=1)
    ckpt = ckpt_dir / "last.ckpt"
    for file in [ckpt] if layout == "consolidated" else [ckpt / "meta.pt"]:
        assert isinstance(torch.load(file, weights_only=True), dict)
    assert _fit(strategy(), tmp_path / "resume", max_epochs=2, ckpt_path=ckpt, weights_only=True) == 1


@pytest.mark.parametrize("layout", ["ddp-file", "zero3-sharded-meta"])
def test_a_poisoned_checkpoint_is_refused_in_the_lightning_namespace(tmp_path, layout):
    """The same refusal through ``import lightning as L`` (lightning_mgpu.lightning's strategies)."""
    import lightning as L

    import lightning_mgpu.lightning as mgpu
    from lightning_mgpu.lightning.examples import DigitsCNN, DigitsDataModule

    def fit(ckpt_dir: Path, ckpt_path: Optional[Path] = None, weights_only: Optional[bool] = None) -> int:
        strategy = (
            mgpu.MGPUDDPStrategy(start_method="fork")
            if layout == "ddp-file"
            else mgpu.MGPUShardedStrategy(stage=3, start_method="fork", checkpoint="sharded")
        )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_epochs=1 if ckpt_path is None else 2,
            limit_train_batches=2,
            limit_val_batches=0,
            callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, filename="last")],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(DigitsCNN(), DigitsDataModule(batch_size=8), ckpt_path=ckpt_path, weights_only=weights_only)
        return trainer.global_step

    marker, ckpt = tmp_path / "poison-ran", tmp_path / "ckpt" / "last.ckpt"
    fit(tmp_path / "ckpt")
    file = ckpt if layout == "ddp-file" else ckpt / "meta.pt"
    _poison_file(file, marker)
    for weights_only in (None, True):
        with pytest.raises(Exception, match="UnpicklingError") as err:
            fit(tmp_path / f"resume-{weights_only}", ckpt_path=ckpt, weights_only=weights_only)
        _assert_names(str(err.value), file, ckpt)
        assert not marker.exists()
    fit(tmp_path / "resume-False", ckpt_path=ckpt, weights_only=False)  # negative control
    assert marker.exists()


# ---------------------------------------------------------------------------------------------------------
# checkpoints at an fsspec URL: a real S3 protocol server on loopback (moto's, in this process), s3fs
# ---------------------------------------------------------------------------------------------------------

_S3_TIMEOUTS = {"connect_timeout": 5, "read_timeout": 30, "retries": {"max_attempts": 2}}


@pytest.fixture
def s3_bucket(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``s3://bucket`` on an S3 server on a free loopback port, started for this test and always stopped; every
    process of the test reaches it (fork launches inherit fsspec's configuration and the environment)."""
    import fsspec
    import s3fs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test")):
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": endpoint, "config_kwargs": _S3_TIMEOUTS})
        # moto keeps its buckets in this process: an earlier test's server left its own
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=30)
        s3fs.S3FileSystem.clear_instance_cache()
        fsspec.filesystem("s3").mkdir("bucket")
        yield "s3://bucket"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


class _FinalWeights(Callback):
    """Every rank gathers the weights at the end of fit (a collective under FSDP2); rank 0 saves them to ``out``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from tests.helpers import full

        state = {k: full(v).detach().clone() for k, v in pl_module.state_dict().items()}
        if trainer.is_global_zero:
            torch.save(state, self.out)


def _fit_remote(strategy: Any, dirpath: str, max_epochs: int, out: Path, ckpt_path: Optional[str] = None) -> Any:
    """Fit Adam (its state matters) on 2 fork-launched ranks, ModelCheckpoint saving ``last.ckpt`` under the URL
    ``dirpath`` after every epoch; returns the final weights."""
    from tests.models import OptRegressor

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=max_epochs,
        callbacks=[
            ModelCheckpoint(dirpath=dirpath, filename="last", enable_version_counter=False),
            _FinalWeights(out),
        ],
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(OptRegressor("adam").double(), datamodule=RankData(make_data(n=16), 4), ckpt_path=ckpt_path)
    return torch.load(out, weights_only=True)


_REMOTE_LAYOUTS = {
    # name: (layout, async_checkpoint)
    "sharded-sync": ("sharded", False),
    "sharded-async": ("sharded", True),
    "consolidated-sync": ("consolidated", False),
    "consolidated-async": ("consolidated", True),
}


@pytest.mark.slow
def test_checkpoints_at_an_s3_url_resume_exactly_in_every_layout(tmp_path, s3_bucket):
    """Sharded (a torch.distributed.checkpoint directory under the prefix) and consolidated (one object) checkpoints,
    written synchronously and in the background, at ``s3://bucket/<layout>/last.ckpt``: the fit resumed from there
    for its second epoch ends with exactly the weights of the uninterrupted two-epoch fit. Nothing is written
    locally but the test's own weight files; the sharded prefix holds what the marker lists, and no staging prefix
    is left. Negative control: the resumed fit's weights differ from the checkpoint's (the comparison can fail)."""
    import fsspec

    def strategy(layout: str, async_checkpoint: bool) -> MGPUShardedStrategy:
        return MGPUShardedStrategy(  # type: ignore[arg-type]
            stage=3, start_method="fork", checkpoint=layout, async_checkpoint=async_checkpoint
        )

    reference = _fit_remote(strategy("sharded", False), f"{s3_bucket}/reference", 2, tmp_path / "reference.pt")
    fs = fsspec.filesystem("s3")
    for name, (layout, async_checkpoint) in _REMOTE_LAYOUTS.items():
        url = f"{s3_bucket}/{name}"
        first = _fit_remote(strategy(layout, async_checkpoint), url, 1, tmp_path / f"{name}-first.pt")
        fs.invalidate_cache()
        if layout == "sharded":
            marker = json.loads(fs.cat_file(f"bucket/{name}/last.ckpt/{COMPLETE_MARKER}"))
            assert sorted(marker["files"]) == sorted(
                p.rsplit("/", 1)[1] for p in fs.ls(f"bucket/{name}/last.ckpt") if not p.endswith(COMPLETE_MARKER)
            )
            assert {"meta.pt", ".metadata"} <= set(marker["files"]) and marker["global_step"] == STEPS_PER_EPOCH
        else:
            assert fs.isfile(f"bucket/{name}/last.ckpt")
        assert fs.ls(f"bucket/{name}", detail=False) == [f"bucket/{name}/last.ckpt"], "a staging prefix was left"
        resumed = _fit_remote(
            strategy(layout, async_checkpoint), url, 2, tmp_path / f"{name}-resumed.pt", ckpt_path=f"{url}/last.ckpt"
        )
        for key, value in reference.items():
            torch.testing.assert_close(resumed[key], value, msg=lambda m, k=f"{name} {key}": f"{k}: {m}")
        with pytest.raises(AssertionError):  # negative control: the second epoch moved the weights
            torch.testing.assert_close(first["net.0.weight"], resumed["net.0.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{n}-{k}.pt" for n in _REMOTE_LAYOUTS for k in ("first", "resumed")] + ["reference.pt"]
    )


def test_a_sharded_checkpoint_at_an_s3_url_is_read_as_data_and_refused_incomplete(tmp_path, s3_bucket):
    """The safety checks of the sharded loader hold at a URL: a poisoned ``meta.pt`` is refused under
    ``weights_only=None`` naming the file and the call that loads it once trusted; a prefix without the completion
    marker is refused as incomplete (no rank waits in a collective: every rank raises)."""
    import fsspec

    url = f"{s3_bucket}/ckpt"
    strategy = lambda: MGPUShardedStrategy(stage=3, start_method="fork", checkpoint="sharded")  # noqa: E731
    _fit_remote(strategy(), url, 1, tmp_path / "first.pt")
    fs, ckpt = fsspec.filesystem("s3"), f"{url}/last.ckpt"
    meta = torch.load(io.BytesIO(fs.cat_file(f"{ckpt}/meta.pt")), weights_only=True)
    meta["extra"] = Poison(tmp_path / "poison-ran")
    poisoned = io.BytesIO()
    torch.save(meta, poisoned)
    fs.pipe_file(f"{ckpt}/meta.pt", poisoned.getvalue())
    with pytest.raises(Exception, match="UnpicklingError") as err:
        _fit_remote(strategy(), url, 2, tmp_path / "resumed.pt", ckpt_path=ckpt)
    _assert_names(str(err.value), f"{ckpt}/meta.pt", ckpt)  # type: ignore[arg-type]
    assert not (tmp_path / "poison-ran").exists()
    fs.rm_file(f"{ckpt}/{COMPLETE_MARKER}")
    with pytest.raises(Exception, match="IncompleteCheckpointError"):
        _fit_remote(strategy(), url, 2, tmp_path / "resumed.pt", ckpt_path=ckpt)
