"""Asynchronous checkpoints (``async_checkpoint=True``) on 2 fork-launched CPU ranks, through ``Trainer.fit``.

* Exact: the checkpoint holds the weights and optimizer state of the step it names, bit for bit, although
  its write is held back (a gate in the writer thread) until training has taken another optimizer step. The
  negative control, the same save with the staging copy left out (what Lightning's ``AsyncCheckpointIO`` did
  before 2.6), writes the later step's state.
* Errors are never silent: a failing background write raises on every rank, with the path and the cause.
* ``ModelCheckpoint``'s top-k removal waits until the replacement is complete.

The kill tests (a SIGKILL during a background write) are in ``test_atomic_checkpoints.py``; resume tests
in ``test_resume.py``; both are parametrised over synchronous and asynchronous saves.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from pytorch_lightning.plugins.io import AsyncCheckpointIO
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from typing_extensions import override

from lightning_mgpu import AtomicCheckpointIO, CheckpointWriteError, MGPUDDPStrategy, MGPUShardedStrategy
from lightning_mgpu.plugins.async_checkpoint import AsyncCheckpointWriter
from lightning_mgpu.plugins.checkpoint_io import check_complete
from lightning_mgpu.strategies.runtime import Runtime
from tests.models import OptRegressor, RankData, make_data

pytestmark = pytest.mark.slow

SAVE_STEP = 2  # 16 samples, 2 ranks x batch 4: 2 steps per epoch, 3 epochs
_ARMED = threading.Event()  # set at the save: from then on, writes outside the training thread pass the gate
_GATE = threading.Event()  # set one optimizer step after the save (each forked rank has its own events)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _gated(fn: Callable[..., Any], signals: Path) -> Callable[..., Any]:
    """``fn`` that, called outside the training thread once the gate is armed, waits for it to open and then
    leaves ``gated{rank}``: proof that the write ran after training went on."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread() and _ARMED.is_set():
            assert _GATE.wait(120), "the gate was never opened"
            (signals / f"gated{_rank()}").touch()
        return fn(*args, **kwargs)

    return wrapper


def _materialise(obj: Any) -> Any:
    """A deep copy with every tensor cloned and every DTensor gathered whole (a collective)."""
    if hasattr(obj, "full_tensor"):
        return obj.full_tensor().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _materialise(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_materialise(v) for v in obj]
    return obj


def _flat(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flat(v, f"{prefix}/{i}"))
    return out


class _SaveThenTrainOn(Callback):
    """At ``SAVE_STEP``: write the state the strategy would save (weights, optimizer states) to
    ``expected{rank}.pt``, close the gate and ``trainer.save_checkpoint``; one optimizer step later, open it."""

    def __init__(self, out: Path, ckpt: Path) -> None:
        self.out, self.ckpt = out, ckpt

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == SAVE_STEP:
            strategy = trainer.strategy
            state = {
                "state_dict": strategy.lightning_module_state_dict(),
                "optimizer_states": [strategy.optimizer_state(o) for o in trainer.optimizers],
            }
            torch.save(_materialise(state), self.out / f"expected{trainer.global_rank}.pt")
            _ARMED.set()
            trainer.save_checkpoint(self.ckpt)
        elif trainer.global_step == SAVE_STEP + 1:
            _GATE.set()


def _trainer(strategy: Any, callbacks: list[Callback], **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=3,
        callbacks=callbacks,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=bool(kwargs.pop("enable_checkpointing", False)),
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _saved_tensors(ckpt: Path, tmp: Path) -> tuple[dict[str, torch.Tensor], int]:
    """The checkpoint's weights and optimizer states (keyed as the strategy's state), and its global_step."""
    if ckpt.is_file():
        saved = torch.load(ckpt, weights_only=False)
        return _flat({"state_dict": saved["state_dict"], "optimizer_states": saved["optimizer_states"]}), saved[
            "global_step"
        ]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    check_complete(ckpt)
    dcp_to_torch_save(ckpt, tmp / "converted.pt")
    converted = torch.load(tmp / "converted.pt", weights_only=False)
    optimizers = [converted[k] for k in sorted(k for k in converted if k.startswith("optimizer_"))]
    meta = torch.load(ckpt / "meta.pt", weights_only=False)
    return _flat({"state_dict": converted["state_dict"], "optimizer_states": optimizers}), meta["global_step"]


STRATEGIES: dict[str, Callable[[], Any]] = {
    "mgpu_ddp": lambda: MGPUDDPStrategy(start_method="fork", async_checkpoint=True),
    "zero1": lambda: MGPUShardedStrategy(stage=1, start_method="fork", async_checkpoint=True),
    "zero2": lambda: MGPUShardedStrategy(stage=2, start_method="fork", async_checkpoint=True),
    "zero3": lambda: MGPUShardedStrategy(stage=3, start_method="fork", async_checkpoint=True),
    "zero2-fairscale": lambda: MGPUShardedStrategy(
        stage=2, backend="fairscale", start_method="fork", async_checkpoint=True
    ),
    "zero1-sharded_ckpt": lambda: MGPUShardedStrategy(
        stage=1, checkpoint="sharded", start_method="fork", async_checkpoint=True
    ),
    "zero2-sharded_ckpt": lambda: MGPUShardedStrategy(
        stage=2, checkpoint="sharded", start_method="fork", async_checkpoint=True
    ),
    "zero3-sharded_ckpt": lambda: MGPUShardedStrategy(
        stage=3, checkpoint="sharded", start_method="fork", async_checkpoint=True
    ),
}


def _run_exactness(tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> tuple[int, bool, list[int]]:
    """Fit with the gated save; returns (saved global_step, saved == expected on every rank, gated ranks)."""
    signals = tmp_path / "signals"
    signals.mkdir()
    monkeypatch.setattr(torch, "save", _gated(torch.save, signals))
    monkeypatch.setattr(FileSystemWriter, "write_data", _gated(FileSystemWriter.write_data, signals))
    ckpt = tmp_path / "step2.ckpt"
    trainer = _trainer(STRATEGIES[name](), [_SaveThenTrainOn(tmp_path, ckpt)])
    trainer.fit(OptRegressor("adam").double(), datamodule=RankData(make_data(n=16), 4))
    monkeypatch.undo()
    saved, step = _saved_tensors(ckpt, tmp_path)
    exact = True
    for rank in range(2):  # (a consolidated state is on rank 0 only)
        expected = _flat(torch.load(tmp_path / f"expected{rank}.pt", weights_only=False))
        assert expected or rank > 0, "nothing was captured"
        for key, tensor in expected.items():
            assert key in saved, f"{key} of rank {rank} is not in the checkpoint"
            exact &= torch.equal(saved[key], tensor)
    gated = sorted(int(p.name[len("gated") :]) for p in signals.iterdir())
    return step, exact, gated


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_async_checkpoint_holds_exactly_the_state_of_its_step(tmp_path, monkeypatch, name):
    """Weights and optimizer state (Adam's moments, step counts) of the checkpoint equal, bit for bit, those
    at the save step, although the write ran only after the next optimizer step had changed them."""
    step, exact, gated = _run_exactness(tmp_path, name, monkeypatch)
    assert step == SAVE_STEP
    assert 0 in gated, "the write was not held back until training went on: the test would prove nothing"
    assert exact


@pytest.mark.parametrize("name", ["mgpu_ddp", "zero3-sharded_ckpt"])
def test_without_the_staging_copy_the_checkpoint_holds_a_later_state_negative_control(tmp_path, monkeypatch, name):
    """The writer handed the live tensors (no staging copy) writes the state of step 3 under step 2's name."""
    with monkeypatch.context() as patch:
        patch.setattr(AsyncCheckpointWriter, "stage", lambda self, obj: obj)
        step, exact, gated = _run_exactness(tmp_path, name, patch)
    assert step == SAVE_STEP and 0 in gated
    assert not exact


# ---------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------


_ERRORS: list[Path] = []  # where each rank writes the exception that ended its fit


def _record(exception: BaseException, rank: int) -> None:
    # (in a worker, Lightning's callback on_exception never runs; the strategy's failure handling does; the
    # main process, re-raising what a worker raised, has no process group)
    if torch.distributed.is_initialized():
        (_ERRORS[0] / f"error{rank}.txt").write_text(f"{type(exception).__name__}\n{exception}")


_END_GROUP_AFTER = Runtime.end_group_after


def _recording_end_group_after(self: Runtime, exception: BaseException) -> list[int]:
    """The runtime's failure handling (what the launcher calls in a worker whose fit raised), recording first."""
    _record(exception, self.strategy.global_rank)
    return _END_GROUP_AFTER(self, exception)


class _DiskFullIO(AtomicCheckpointIO):
    """Fails to write checkpoints whose name contains ``fail``: the disk is full."""

    def __init__(self, fail: str) -> None:
        super().__init__()
        self.fail = fail

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if self.fail in Path(path).name:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        super().save_checkpoint(checkpoint, path, storage_options)


def _rank1_disk_full(self: Any, plan: Any, planner: Any) -> Any:
    if torch.distributed.get_rank() == 1 and "step=4" in str(self.path):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
    return _ORIGINAL_WRITE_DATA(self, plan, planner)


_ORIGINAL_WRITE_DATA = FileSystemWriter.write_data


@pytest.mark.parametrize(
    ("name", "fail"),
    [("mgpu_ddp", "step=4"), ("mgpu_ddp", "step=6"), ("zero2-sharded", "step=4")],
    ids=["file-at-the-next-save", "file-at-the-end-of-fit", "sharded-on-rank1-only"],
)
def test_a_failing_background_write_raises_on_every_rank_with_the_path(tmp_path, monkeypatch, name, fail):
    ckpt_dir = tmp_path / "ckpt"
    _ERRORS[:] = [tmp_path]
    strategy: Any
    monkeypatch.setattr(Runtime, "end_group_after", _recording_end_group_after)  # the fork workers inherit it
    if name == "mgpu_ddp":
        strategy = MGPUDDPStrategy(start_method="fork", async_checkpoint=True, checkpoint_io=_DiskFullIO(fail))
    else:
        strategy = MGPUShardedStrategy(stage=2, checkpoint="sharded", start_method="fork", async_checkpoint=True)
        monkeypatch.setattr(FileSystemWriter, "write_data", _rank1_disk_full)
    checkpoints = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    trainer = _trainer(strategy, [checkpoints], enable_checkpointing=True)
    with pytest.raises(Exception, match=r"CheckpointWriteError|background write"):
        trainer.fit(OptRegressor("adam").double(), datamodule=RankData(make_data(n=16), 4))

    failed = ckpt_dir / f"{fail}.ckpt"
    for rank in range(2):  # every rank raised, naming the path and the cause
        kind, message = (tmp_path / f"error{rank}.txt").read_text().split("\n", 1)
        assert kind == CheckpointWriteError.__name__
        assert str(failed) in message and "No space left on device" in message
    assert not failed.exists()
    earlier = ckpt_dir / "step=2.ckpt"  # the checkpoint before the failed one is complete
    if earlier.is_dir():
        assert check_complete(earlier)["global_step"] == 2
    else:
        assert torch.load(earlier, weights_only=False)["global_step"] == 2


# ---------------------------------------------------------------------------------------------------------
# ModelCheckpoint's top-k removal
# ---------------------------------------------------------------------------------------------------------


_GATES: dict[str, threading.Event] = {}  # per checkpoint path: its write may start
_NEWEST: list[Path] = []  # the last checkpoint path handed to the strategy
_REPLACED_BY: dict[str, Path] = {}  # a checkpoint ModelCheckpoint removes -> the one saved just before


class _GatedDDP(MGPUDDPStrategy):
    """Holds each background write back until ModelCheckpoint has asked for the removal that goes with it (or
    the next save / the end of fit comes), so a removal that does not wait finds its replacement unwritten."""

    def _open_gates(self) -> None:
        for gate in _GATES.values():
            gate.set()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        self._open_gates()
        _GATES[str(filepath)] = threading.Event()
        _NEWEST[:] = [Path(filepath)]
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        _REPLACED_BY[str(filepath)] = _NEWEST[0]
        super().remove_checkpoint(filepath)
        self._open_gates()

    @override
    def on_train_end(self) -> None:
        self._open_gates()
        super().on_train_end()


class _RecordingIO(AtomicCheckpointIO):
    """Writes wait for their gate; each removal records whether the replacement was complete at that moment."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if str(path) in _GATES:  # (not the launcher's hand-over of the weights to the main process)
            assert _GATES[str(path)].wait(120)
        super().save_checkpoint(checkpoint, path, storage_options)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        if str(path) not in _REPLACED_BY:  # the main process removes the launcher's hand-over file
            super().remove_checkpoint(path)
            return
        newest = _REPLACED_BY[str(path)]
        with open(self.out / "removals.txt", "a") as f:
            f.write(f"{Path(path).name} {newest.name} {newest.is_file()}\n")
        super().remove_checkpoint(path)


@pytest.mark.parametrize("deferred", [True, False], ids=["ours", "removal-not-deferred-negative-control"])
def test_top_k_removal_waits_until_the_replacement_is_complete(tmp_path, monkeypatch, deferred):
    if not deferred:
        monkeypatch.setattr(AsyncCheckpointWriter, "remove_after_write", lambda self, remove: remove())
    checkpoints = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=1, save_top_k=1, monitor="step", mode="max"
    )
    strategy = _GatedDDP(start_method="fork", async_checkpoint=True, checkpoint_io=_RecordingIO(tmp_path))
    trainer = _trainer(strategy, [checkpoints], enable_checkpointing=True)
    trainer.fit(OptRegressor("adam").double(), datamodule=RankData(make_data(n=16), 4))

    removals = [line.split() for line in (tmp_path / "removals.txt").read_text().splitlines()]
    assert [r[:2] for r in removals] == [[f"step={s}.ckpt", f"step={s + 1}.ckpt"] for s in range(1, 6)]
    complete = [r[2] == "True" for r in removals]
    if deferred:
        assert all(complete)
    else:
        assert not any(complete)  # removed while its replacement was still being written
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step=6.ckpt"]


def test_async_checkpoint_is_a_setting_of_every_strategy():
    for preset in ("mgpu_ddp_fork", "mgpu_zero1", "mgpu_sharded", "mgpu_zero3"):
        assert (
            pl.Trainer(accelerator="cpu", devices=2, strategy=preset, logger=False).strategy.async_checkpoint is False
        )
    assert MGPUDDPStrategy(async_checkpoint=True).settings.async_checkpoint
    assert MGPUShardedStrategy(stage=3, async_checkpoint=True).launch_settings.async_checkpoint
    with pytest.raises(ValueError, match=r"async_checkpoint=True with AsyncCheckpointIO.*Remove AsyncCheckpointIO"):
        pl.Trainer(
            accelerator="cpu", devices=2, strategy=MGPUDDPStrategy(start_method="fork", async_checkpoint=True),
            plugins=[AsyncCheckpointIO()], logger=False,
        ).fit(OptRegressor())  # fmt: skip
    with pytest.raises(TypeError, match="async_checkpoint='yes' is not a bool"):
        MGPUShardedStrategy(async_checkpoint="yes")  # type: ignore[arg-type]
