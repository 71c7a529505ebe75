"""Asynchronous checkpoints: how long a save stops training, and how much slower steps are while a write runs.

    python benchmarks/bench_async_checkpoint.py                      # mgpu_ddp, ~103M parameters, 2 CPU ranks
    python benchmarks/bench_async_checkpoint.py --strategy zero3-sharded --width 3584 --layers 8
    python benchmarks/bench_async_checkpoint.py --accelerator gpu     # the same on 2 GPUs (NCCL)

For each mode (``sync``: ``async_checkpoint=False``; ``async``: ``async_checkpoint=True``) one fit on 2
fork-launched ranks (``--accelerator gpu``: spawn) trains a stack of ``--layers`` Linear(width, width) layers
(8 x 3584^2 = 103M parameters; SGD with momentum, so a checkpoint holds 2 x 411 MB) and calls
``trainer.save_checkpoint`` every ``--every`` steps to ``last.ckpt`` (the usual "save last" pattern).

* blocking: the wall time of ``trainer.save_checkpoint`` on rank 0, i.e. the time training stops. For async
  it is the staging copy (plus waiting for the previous write if it has not finished: see "waited").
* step: the time of one training step (batch start to batch end, rank 0). "no write": no write in flight at the
  step's start; "during a write": a background write was running (async only), compared with the same run's
  steps without a write (they interleave, so load on the machine hits both alike) and with the sync run's.

Targets: async blocking <= 10% of the synchronous save; steps during a write within 15% of normal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUDDPStrategy, MGPUShardedStrategy


class Stack(pl.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.layers(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6, momentum=0.9)


class Timer(Callback):
    """Rank 0: step times (with whether a write was in flight at the step's start) and save times."""

    def __init__(self, out: Path, ckpt: Path, every: int, warmup: int) -> None:
        self.out, self.ckpt, self.every, self.warmup = out, ckpt, every, warmup
        self.steps: list[tuple[float, bool]] = []
        self.saves: list[float] = []
        self._start = 0.0
        self._writing = False

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._writing = bool(getattr(trainer.strategy, "checkpoint_write_in_flight", False))
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            self.steps.append((time.perf_counter() - self._start, self._writing))
        if trainer.global_step > self.warmup and trainer.global_step % self.every == 0:
            start = time.perf_counter()
            trainer.save_checkpoint(self.ckpt)
            self.saves.append(time.perf_counter() - start)

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.is_global_zero:
            torch.save({"steps": self.steps, "saves": self.saves}, self.out)


def strategy_for(name: str, asynchronous: bool, start_method: str) -> Any:
    if name == "mgpu_ddp":
        return MGPUDDPStrategy(start_method=start_method, async_checkpoint=asynchronous)  # type: ignore[arg-type]
    if name == "zero3-sharded":
        return MGPUShardedStrategy(
            stage=3,
            checkpoint="sharded",
            start_method=start_method,
            async_checkpoint=asynchronous,  # type: ignore[arg-type]
        )
    raise ValueError(f"--strategy {name!r}: choose mgpu_ddp or zero3-sharded")


def run(args: argparse.Namespace, asynchronous: bool, directory: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(args.batch * 2 * (args.steps + 1), args.width))
    model = Stack(args.width, args.layers)
    out = directory / f"times-{asynchronous}.pt"
    timer = Timer(out, directory / f"last-{asynchronous}.ckpt", args.every, args.warmup)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=2,
        strategy=strategy_for(args.strategy, asynchronous, "spawn" if args.accelerator == "gpu" else "fork"),
        max_steps=args.steps,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=args.batch))
    return torch.load(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="mgpu_ddp", choices=["mgpu_ddp", "zero3-sharded"])
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--width", type=int, default=3584)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=6, help="save every N steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    params = args.layers * (args.width * args.width + args.width)
    print(f"{args.strategy}, {params / 1e6:.0f}M parameters, 2 {args.accelerator} ranks, save every {args.every} steps")

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        results = {mode: run(args, mode == "async", Path(tmp)) for mode in ("sync", "async")}
    sync_block = statistics.median(results["sync"]["saves"])
    sync_step = statistics.median(t for t, writing in results["sync"]["steps"])
    rows = []
    for mode, r in results.items():
        block = statistics.median(r["saves"])
        during = [t for t, writing in r["steps"] if writing]
        steady = statistics.median(t for t, writing in r["steps"] if not writing)
        if during:
            d = statistics.median(during)
            step = f"{d:7.3f} | {d / steady:5.2f} | {d / sync_step:5.2f} |"
        else:
            step = "      - |     - |     - |"
        saves = ", ".join(f"{t:.2f}" for t in r["saves"])
        rows.append(f"| {mode:5} | {block:7.3f} | {block / sync_block:5.2f} | {steady:7.3f} | {step} {saves} |")
    print("| mode | blocking per save (s, median) | vs sync save | step, no write (s) | step during a write (s) "
          "| vs same run's steps without a write | vs sync run's steps | each save (s) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
