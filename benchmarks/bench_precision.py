"""Precision modes side by side: training-state memory, step time and accuracy of the sample CNN.

    python benchmarks/bench_precision.py                 # digits CNN, 2 CPU processes (fork), 4 epochs
    python benchmarks/bench_precision.py --epochs 8 --channels 64

Runners (same model, data, seed and strategy settings; one fit each, in this order):

* ours, ``mgpu_ddp`` + ``MGPUPrecision(mode)`` for ``32-true`` (Lightning's plain Precision), ``16-mixed``,
  ``bf16-mixed``, ``16-master`` and ``bf16-master``;
* Lightning's built-in ``ddp`` with ``precision="bf16-mixed"`` (MixedPrecision) and ``"bf16-true"``
  (HalfPrecision: half weights, no FP32 copy).

Reported per rank (rank 0), in KiB of tensor bytes counted exactly (not process RSS, which on CPU is
dominated by the interpreter and libraries): model weights, gradients at their peak (in the master modes
the larger of the half gradients after backward and the FP32 master gradients plus what is left of the half
ones before the step), FP32 masters, optimizer state, and their total; the activations autograd saves for
one micro-batch's backward (``saved_tensors_hooks``), where half precision saves most; median time per
optimizer step and its ratio to 32-true; validation accuracy after the last epoch. On CPU, half precision
is emulated and slower than FP32; GPU figures need a GPU (``--accelerator gpu``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import DDPStrategy

from lightning_mgpu import MGPUDDPStrategy, MGPUPrecision
from lightning_mgpu.examples import DigitsCNN, DigitsDataModule

MODES = ["32-true", "16-mixed", "bf16-mixed", "16-master", "bf16-master"]


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class Measure(Callback):
    """Rank 0 writes to ``out`` (JSON): tensor bytes of the training state, and the median optimizer-step time."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.grads = self.activations = self.masters = 0
        self.step_times: list[float] = []
        self._start: Optional[float] = None
        self._saved = 0
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._saved += t.numel() * t.element_size()
        return t

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._start is None:
            self._start = time.perf_counter()
        # activations: the bytes autograd saves for the backward of one micro-batch
        self._saved = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        self.activations = max(self.activations, self._saved)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.grads = max(self.grads, nbytes(p.grad for p in pl_module.parameters()))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # master modes: the half gradients have been moved (one tensor at a time) into FP32 master gradients
        own = {id(p) for p in pl_module.parameters()}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        masters = [p for p in params if id(p) not in own]
        self.masters = nbytes(masters)
        live = nbytes(p.grad for p in pl_module.parameters()) + nbytes(p.grad for p in masters)
        self.grads = max(self.grads, live)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.fit_loop._should_accumulate():
            return
        assert self._start is not None
        now = time.perf_counter()
        self.step_times.append(now - self._start)
        self._start = now

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        result = {
            "weights": nbytes(pl_module.parameters()),
            "grads": self.grads,
            "activations": self.activations,
            "masters": self.masters,
            "state": sum(nbytes(s.values()) for opt in trainer.optimizers for s in opt.state.values()),
            "step_ms": 1e3 * statistics.median(self.step_times[5:] or self.step_times),
        }
        self.out.write_text(json.dumps(result))


def run(label: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DigitsCNN(lr=0.01, channels=args.channels)
    plugins: list[Any] = []
    precision: Any = None
    if label.startswith("lightning "):
        strategy: Any = DDPStrategy(start_method="fork")
        precision = label.split()[1]
    else:
        strategy = MGPUDDPStrategy(start_method="fork")
        if label != "32-true":
            plugins = [MGPUPrecision(label)]  # type: ignore[arg-type]
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=2,
        strategy=strategy,
        precision=precision,
        plugins=plugins,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Measure(out)],
    )
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=args.batch_size))
    result = json.loads(out.read_text())
    result["val_acc"] = float(trainer.callback_metrics.get("val_acc", float("nan")))
    return result


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label in [*MODES, "lightning bf16-mixed", "lightning bf16-true"]:
            rows.append((label, run(label, args, Path(tmp) / "r.json")))
    base = rows[0][1]
    print(
        f"digits CNN (channels {args.channels}), 2 {args.accelerator} processes, batch {args.batch_size}/rank, "
        f"{args.epochs} epochs; KiB per rank"
    )
    head = f"{'runner':<22}{'weights':>9}{'grads':>8}{'masters':>9}{'opt st':>8}{'total':>8}{'x32':>6}"
    head += f"{'activ.':>8}{'x32':>6}{'ms/step':>9}{'x32':>6}{'val_acc':>9}"
    print(head)
    for label, r in rows:
        total = r["weights"] + r["grads"] + r["masters"] + r["state"]
        base_total = base["weights"] + base["grads"] + base["masters"] + base["state"]
        print(
            f"{label:<22}{r['weights'] / 1024:>9.1f}{r['grads'] / 1024:>8.1f}{r['masters'] / 1024:>9.1f}"
            f"{r['state'] / 1024:>8.1f}{total / 1024:>8.1f}{total / base_total:>6.2f}"
            f"{r['activations'] / 1024:>8.0f}{r['activations'] / base['activations']:>6.2f}"
            f"{r['step_ms']:>9.2f}{r['step_ms'] / base['step_ms']:>6.2f}{r['val_acc']:>9.3f}"
        )


if __name__ == "__main__":
    main()
