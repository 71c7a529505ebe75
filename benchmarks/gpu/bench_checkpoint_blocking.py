"""How long a checkpoint stops training on a GPU: synchronous vs asynchronous saves, through ``Trainer.fit``.

    python benchmarks/gpu/bench_checkpoint_blocking.py [--out benchmarks/results]   # ~51M parameters, 411 MB
    python benchmarks/gpu/bench_checkpoint_blocking.py --tiny                       # a check of the script (CPU)

One GPU (NCCL, world size 1) trains a stack of ``--layers`` Linear(width, width) layers (4 x 3584^2 = 51M
parameters, SGD with momentum: a checkpoint holds 2 x 205 MB) and calls ``trainer.save_checkpoint`` every
``--every`` steps to ``last.ckpt`` (the usual "save last" pattern), for ``mgpu_ddp`` (one consolidated file) and
``mgpu_zero3`` with ``checkpoint="sharded"`` (a directory), each with ``async_checkpoint=False`` (``sync``) and
``True`` (``async``):

* blocking: the wall time of ``trainer.save_checkpoint``, i.e. the time training stops. A synchronous save copies
  the state to the CPU and writes it; an asynchronous one queues the copy to pinned CPU memory and returns, and a
  background thread writes it (plus, if the previous write has not finished, the wait for it: "waited").
* where an asynchronous save's blocking goes: ``waited`` (for the previous write: at most one write is in flight,
  so saves that come faster than writes wait for them), ``stage`` (``AsyncCheckpointWriter.stage``: queueing the
  copies, the first save's pinned allocation, the deep copy of the rest) and ``rest`` (the state dicts, the
  checks, Lightning's barrier after the save, which on NCCL waits for the queued copies); and ``write``, the
  background write's own time (not blocking).
  The ratio ``vs sync`` counts the whole blocking time; ``no wait vs sync`` leaves ``waited`` out.
* step: the time of a training step with no write in flight, and of one while a background write runs.

On a GPU the training thread only launches kernels, so the CPU is free for the writer thread: the blocking time
of an asynchronous save is what a user sees. The result is saved as JSON under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from env import environment, result_name

from lightning_mgpu import MGPUDDPStrategy, MGPUShardedStrategy
from lightning_mgpu.plugins.async_checkpoint import AsyncCheckpointWriter


class Stack(pl.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.layers(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6, momentum=0.9)


class WriterClock:
    """The time the training thread spends in the background writer's waits and staging, and each background
    write's own time, summed over the writer's calls (its methods timed while :meth:`timing` is entered)."""

    def __init__(self) -> None:
        self.waited = 0.0
        self.staged = 0.0
        self.writes: list[float] = []

    @contextmanager
    def timing(self) -> Iterator[None]:
        wait, stage, submit = AsyncCheckpointWriter.wait, AsyncCheckpointWriter.stage, AsyncCheckpointWriter.submit
        clock = self

        def timed_wait(writer: AsyncCheckpointWriter) -> None:
            if threading.current_thread() is not threading.main_thread():
                return wait(writer)
            start = time.perf_counter()
            try:
                return wait(writer)
            finally:
                clock.waited += time.perf_counter() - start

        def timed_stage(writer: AsyncCheckpointWriter, obj: Any) -> Any:
            start, waited = time.perf_counter(), clock.waited
            try:
                return stage(writer, obj)
            finally:  # (stage first waits for a write in flight: counted as waited)
                clock.staged += time.perf_counter() - start - (clock.waited - waited)

        def timed_submit(writer: AsyncCheckpointWriter, path: str, write: Any) -> None:
            def timed_write() -> None:
                start = time.perf_counter()
                try:
                    write()
                finally:
                    clock.writes.append(time.perf_counter() - start)

            submit(writer, path, timed_write)  # (its wait for a write in flight is counted as waited)

        AsyncCheckpointWriter.wait = timed_wait  # type: ignore[method-assign]
        AsyncCheckpointWriter.stage = timed_stage  # type: ignore[method-assign]
        AsyncCheckpointWriter.submit = timed_submit  # type: ignore[method-assign]
        try:
            yield
        finally:
            AsyncCheckpointWriter.wait, AsyncCheckpointWriter.stage = wait, stage  # type: ignore[method-assign]
            AsyncCheckpointWriter.submit = submit  # type: ignore[method-assign]


class Timer(pl.Callback):
    """Step times (with whether a write was in flight at the step's start), the time of each save and where it
    went (``clock``: the writer's waits and staging)."""

    def __init__(self, ckpt: Path, every: int, warmup: int, clock: WriterClock) -> None:
        self.ckpt, self.every, self.warmup, self.clock = ckpt, every, warmup, clock
        self.steps: list[tuple[float, bool]] = []
        self.saves: list[float] = []
        self.waited: list[float] = []
        self.staged: list[float] = []
        self._start = 0.0
        self._writing = False

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._sync()
        self._writing = bool(getattr(trainer.strategy, "checkpoint_write_in_flight", False))
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._sync()
        if trainer.global_step > self.warmup:
            self.steps.append((time.perf_counter() - self._start, self._writing))
        if trainer.global_step > self.warmup and trainer.global_step % self.every == 0:
            waited, staged = self.clock.waited, self.clock.staged
            start = time.perf_counter()
            trainer.save_checkpoint(self.ckpt)
            self.saves.append(time.perf_counter() - start)
            self.waited.append(self.clock.waited - waited)
            self.staged.append(self.clock.staged - staged)


def strategy_for(name: str, asynchronous: bool) -> Any:
    if name == "mgpu_ddp":
        return MGPUDDPStrategy(async_checkpoint=asynchronous)
    if name == "mgpu_zero3_sharded":
        return MGPUShardedStrategy(stage=3, checkpoint="sharded", async_checkpoint=asynchronous)
    raise ValueError(f"--strategies {name!r}: choose mgpu_ddp or mgpu_zero3_sharded")


def run(args: argparse.Namespace, strategy: str, asynchronous: bool, directory: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(args.batch * (args.steps + 1), args.width))
    clock = WriterClock()
    timer = Timer(directory / f"{strategy}-{asynchronous}-last.ckpt", args.every, args.warmup, clock)
    trainer = pl.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=1,
        strategy=strategy_for(strategy, asynchronous),
        max_steps=args.steps,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    with clock.timing():
        trainer.fit(Stack(args.width, args.layers), DataLoader(data, batch_size=args.batch))
    steady = [t for t, writing in timer.steps if not writing]
    during = [t for t, writing in timer.steps if writing]
    rest = [total - w - s for total, w, s in zip(timer.saves, timer.waited, timer.staged)]
    return {
        "strategy": strategy,
        "mode": "async" if asynchronous else "sync",
        "blocking_s_median": statistics.median(timer.saves),
        "blocking_s": timer.saves,
        # where each save's blocking went (a synchronous save: all of it is "rest")
        "waited_s": timer.waited,
        "stage_s": timer.staged,
        "rest_s": rest,
        "blocking_no_wait_s_median": statistics.median(t - w for t, w in zip(timer.saves, timer.waited)),
        "write_s": clock.writes,  # each background write's own time (async only)
        "step_s_no_write": statistics.median(steady) if steady else None,
        "step_s_during_write": statistics.median(during) if during else None,
        "fit_s": time.perf_counter() - start,  # the fit waits for the last write at its end
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=3584)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=6, help="save every N steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--strategies", nargs="*", default=["mgpu_ddp", "mgpu_zero3_sharded"])
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    ap.add_argument("--tiny", action="store_true", help="a small model, to check the script (CPU works)")
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON result")
    args = ap.parse_args()
    if args.tiny:
        args.width, args.layers, args.batch, args.steps, args.every, args.warmup = 256, 2, 8, 8, 3, 1
    env = environment()
    params = args.layers * (args.width * args.width + args.width)
    print(f"{params / 1e6:.0f}M parameters ({2 * 4 * params / 1e6:.0f} MB a checkpoint), on {env['device']}")
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for strategy in args.strategies:
            for asynchronous in (False, True):
                rows.append(run(args, strategy, asynchronous, Path(tmp)))
    sync = {r["strategy"]: r["blocking_s_median"] for r in rows if r["mode"] == "sync"}
    for r in rows:
        r["vs_sync"] = r["blocking_s_median"] / sync[r["strategy"]] if sync.get(r["strategy"]) else None
        r["no_wait_vs_sync"] = r["blocking_no_wait_s_median"] / sync[r["strategy"]] if sync.get(r["strategy"]) else None
    print("| strategy | mode | blocking per save (s, median) | vs sync | step, no write (s) | step during write (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        during = f"{r['step_s_during_write']:.4f}" if r["step_s_during_write"] is not None else "-"
        steady = f"{r['step_s_no_write']:.4f}" if r["step_s_no_write"] is not None else "-"
        print(
            f"| {r['strategy']} | {r['mode']} | {r['blocking_s_median']:.4f} | {r['vs_sync']:.3f} | {steady} | "
            f"{during} |"
        )
    print()
    print("Where each save's blocking went (s, median over the saves; a synchronous save is all 'rest'):")
    print("| strategy | mode | waited for the previous write | stage | rest | no wait vs sync | background write |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        write = f"{statistics.median(r['write_s']):.4f}" if r["write_s"] else "-"
        print(
            f"| {r['strategy']} | {r['mode']} | {statistics.median(r['waited_s']):.4f} | "
            f"{statistics.median(r['stage_s']):.4f} | {statistics.median(r['rest_s']):.4f} | "
            f"{r['no_wait_vs_sync']:.3f} | {write} |"
        )
    for r in rows:
        waits = sum(w > 0.01 for w in r["waited_s"])
        if waits:
            print(
                f"{r['strategy']} {r['mode']}: {waits} of {len(r['waited_s'])} saves waited for the previous write "
                f"(the saves come every {args.every} steps, faster than a write): their blocking is the write's, "
                f"not the staging's; --every N spaces them out."
            )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = result_name("checkpoint-blocking", env)
        config = {k: v for k, v in vars(args).items() if k != "out"}
        (args.out / name).write_text(json.dumps({"environment": env, "config": config, "rows": rows}, indent=1))
        print(f"saved {args.out / name}")


if __name__ == "__main__":
    main()
