"""What the DeviceMonitor costs, measured side by side in one run.

    python benchmarks/bench_monitor.py                  # digits CNN, mgpu_ddp, 2 CPU processes, 3 rounds
    python benchmarks/bench_monitor.py --rounds 5 --epochs 3 --every 10

Runners (same model, data and seed; fork launches; runners alternate round by round):

* ``none``: no monitor;
* ``DeviceMonitor``: ours at the default interval (the Trainer's ``log_every_n_steps``, 50) or ``--every``;
* ``DeviceStatsMonitor``: Lightning's own (per-rank CPU stats through psutil when installed, else nothing
  on CPU; each rank logs its own numbers, only rank 0 reaches the logger).

Reported: median fit time per optimizer step on rank 0 and its ratio to ``none`` (noisy on a shared
2-core machine), and, less noisy, the time spent inside the DeviceMonitor's own hooks (all of them, the
interval gathers included) per step as a share of the step time: the overhead target is < 1 %.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, DeviceStatsMonitor
from pytorch_lightning.loggers import CSVLogger

from lightning_mgpu import DeviceMonitor, MGPUDDPStrategy
from lightning_mgpu.examples import DigitsCNN, DigitsDataModule

_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_train_epoch_end",
    "_on_grad",
)


class TimedMonitor(DeviceMonitor):
    """DeviceMonitor that adds up the wall time spent in its own hooks."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spent = 0.0
        for name in _HOOKS:
            setattr(self, name, self._timed(getattr(self, name)))

    def _timed(self, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - start

        return wrapper


class Timer(Callback):
    def __init__(self, out: Path, monitor: Any) -> None:
        self.out, self.monitor = out, monitor

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            elapsed = time.perf_counter() - self.start
            spent = getattr(self.monitor, "spent", 0.0)
            (self.out / "result.txt").write_text(f"{elapsed} {trainer.global_step} {spent}")


def run(variant: str, args: argparse.Namespace, root: Path) -> tuple[float, float]:
    out = Path(tempfile.mkdtemp(dir=root))
    monitor: Any = None
    callbacks: list[Callback] = []
    if variant == "DeviceMonitor":
        monitor = TimedMonitor(every_n_steps=args.every)
        callbacks.append(monitor)
    elif variant == "DeviceStatsMonitor":
        callbacks.append(DeviceStatsMonitor())
    callbacks.append(Timer(out, monitor))
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MGPUDDPStrategy(start_method="fork"),
        max_epochs=args.epochs,
        logger=CSVLogger(out, name="csv"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    trainer.fit(DigitsCNN(), DigitsDataModule(batch_size=args.batch_size))
    elapsed, steps, spent = (float(v) for v in (out / "result.txt").read_text().split())
    return elapsed / steps * 1000, spent / steps * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="per device")
    parser.add_argument("--every", type=int, default=None, help="DeviceMonitor interval (default 50)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import importlib.util

    variants: tuple[str, ...] = ("none", "DeviceMonitor")
    if importlib.util.find_spec("psutil") is not None:  # Lightning's monitor needs it on CPU
        variants += ("DeviceStatsMonitor",)
    else:
        print("psutil is not installed: Lightning's DeviceStatsMonitor is left out (pip install psutil)")
    step: dict[str, list[float]] = {v: [] for v in variants}
    hooks: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for variant in variants:
                ms, spent = run(variant, args, Path(tmp))
                step[variant].append(ms)
                if variant == "DeviceMonitor":
                    hooks.append(spent)
    base = statistics.median(step["none"])
    print(f"digits CNN, mgpu_ddp, 2 CPU processes, batch {args.batch_size}/device, {args.epochs} epochs, "
          f"{args.rounds} rounds, interval {args.every or 50} steps")  # fmt: skip
    print(f"{'runner':20s} {'ms/step':>9s} {'vs none':>8s}")
    for variant in variants:
        ms = statistics.median(step[variant])
        print(f"{variant:20s} {ms:9.2f} {ms / base:8.3f}")
    own = statistics.median(hooks)
    print(f"DeviceMonitor hooks: {own * 1000:.1f} us per step = {100 * own / base:.2f} % of the step (target < 1 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
