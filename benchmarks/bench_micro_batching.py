"""The cost of ``micro_batch_size`` when nothing runs out of memory, measured side by side in one run.

    python benchmarks/bench_micro_batching.py                      # 2 CPU processes (gloo), ~1M-parameter MLP
    python benchmarks/bench_micro_batching.py --rounds 5 --steps 40 --hidden 1024

Runners (same model, data and seed; fork launches; runners alternate round by round):

* ``mgpu_ddp``: no micro-batching (DDP's reducer all-reduces in its buckets during backward);
* ``fixed = batch``: ``micro_batch_size`` = the loader batch: one micro-batch, i.e. the same compute, plus one
  agreement all-reduce per micro-batch and the gradient all-reduce after backward instead of DDP's overlapped one;
* ``auto``: ``micro_batch_size="auto"`` (no out-of-memory error: it stays at the whole batch);
* ``fixed = batch/4``: four micro-batches per loader batch (what a back-off to a quarter costs).

Reported: the median time per optimizer step on rank 0 (after warm-up steps), its ratio to ``mgpu_ddp`` and to
``fixed = batch``, and ``gloo:all_reduce`` calls per step (torch.profiler, one profiled step). Every runner ends
with the same weights up to float32 rounding (the largest difference to ``mgpu_ddp`` is printed). Timings are
never asserted in tests: these machines are shared.
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
from pytorch_lightning.callbacks import Callback
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_mgpu import MGPUDDPStrategy

WORLD = 2


class MLP(pl.LightningModule):
    def __init__(self, width: int, hidden: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        dims = [width] + [hidden] * layers
        body: list[nn.Module] = []
        for a, b in zip(dims, dims[1:]):
            body += [nn.Linear(a, b), nn.GELU()]
        self.net = nn.Sequential(*body, nn.Linear(hidden, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Data(pl.LightningDataModule):
    def __init__(self, n: int, width: int, batch: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.dataset = TensorDataset(torch.randn(n, width, generator=g), torch.randint(0, 10, (n,), generator=g))
        self.batch = batch

    def train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(self.dataset, shuffle=False) if torch.distributed.is_initialized() else None
        return DataLoader(self.dataset, batch_size=self.batch, sampler=sampler)


class Timer(Callback):
    def __init__(self, out: Path, warmup: int) -> None:
        self.out, self.warmup = out, warmup
        self.times: list[float] = []
        self.allreduces = 0
        self._start = 0.0
        self._prof: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup - 1:  # profile one step, before the timed ones
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._prof.__enter__()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        elapsed = time.perf_counter() - self._start
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self.allreduces = sum(1 for e in self._prof.events() if e.name == "gloo:all_reduce")
            self._prof = None
        elif trainer.global_step > self.warmup:
            self.times.append(elapsed)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            weights = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
            torch.save({"times": self.times, "allreduces": self.allreduces, "weights": weights}, self.out)


def run(micro: Any, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=MGPUDDPStrategy(start_method="fork", micro_batch_size=micro),
        max_steps=args.steps,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Timer(out, args.warmup)],
    )
    data = Data(WORLD * args.batch * args.steps, args.width, args.batch)
    trainer.fit(MLP(args.width, args.hidden, args.layers), datamodule=data)
    return torch.load(out, weights_only=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64, help="loader batch per rank")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    runners = {"mgpu_ddp": None, "fixed = batch": args.batch, "auto": "auto", "fixed = batch/4": args.batch // 4}
    times: dict[str, list[float]] = {name: [] for name in runners}
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, micro in runners.items():
                results[name] = run(micro, args, Path(tmp) / f"{round_}-{name.replace(' ', '_').replace('/', '_')}.pt")
                times[name] += results[name]["times"]
    base = statistics.median(times["mgpu_ddp"])
    fixed = statistics.median(times["fixed = batch"])
    params = sum(p.numel() for p in MLP(args.width, args.hidden, args.layers).parameters())
    print(
        f"MLP {params:,} parameters, loader batch {args.batch} per rank x {WORLD} ranks, {args.rounds} rounds x "
        f"{args.steps - args.warmup - 1} timed steps per runner\n"
    )
    head = ("runner", "ms/step (median)", "ratio to mgpu_ddp", "ratio to fixed = batch", "all-reduce/step")
    print("| " + " | ".join(head) + " | max weight diff |")
    print("|---|---|---|---|---|---|")
    for name in runners:
        median = statistics.median(times[name])
        diff = (results[name]["weights"] - results["mgpu_ddp"]["weights"]).abs().max().item()
        print(
            f"| {name} | {median * 1e3:.1f} | {median / base:.3f} | {median / fixed:.3f} | "
            f"{results[name]['allreduces']} | {diff:.1e} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
