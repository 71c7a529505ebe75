"""Manual optimization (a GAN, two optimizers) with gradient accumulation, measured side by side in one run.

    python benchmarks/bench_manual_accum.py                   # 2 CPU processes (gloo), k=4, ~4.5M parameters
    python benchmarks/bench_manual_accum.py --rounds 5 --windows 12 --hidden 1024 --k 4

Runners (same DigitsGAN, same data and noise, each window = k micro-batches, both optimizers step once):

* ``mgpu_ddp``: ``ManualAccumulation`` + ``mgpu_ddp`` -- each optimizer's gradients all-reduced once per
  window, DDP's reducer out of the way, no ``find_unused_parameters``;
* ``ddp+find_unused``: ``ManualAccumulation`` on Lightning's ``DDPStrategy(find_unused_parameters=True)``
  -- the mixin blocks the sync on accumulating micro-batches; toggled-off parameters need the flag;
* ``ddp+find_unused naive``: Lightning's DDP with the flag and accumulation by hand without blocking the
  sync (what most users write: every backward all-reduces);
* ``plain DDP+find_unused``: a hand-written torch loop, one DDP over both models with the flag,
  ``no_sync`` on accumulating micro-batches, ``requires_grad`` toggled by hand.

Reported: the median time per window on rank 0 (after warm-up windows; runners alternate round by round),
ratios to mgpu_ddp, ``gloo:all_reduce`` calls per window from torch.profiler, and the largest weight
difference to mgpu_ddp after the same windows (all runners compute the same thing in float32). Launch cost
is excluded (all fork). Timings are never asserted in tests: these machines are shared.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning_fabric.plugins.environments.lightning import find_free_network_port
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_mgpu import MGPUDDPStrategy
from lightning_mgpu.examples.gan import DigitsGAN

WORLD = 2


class FixedNoiseGAN(DigitsGAN):
    """Noise comes with the batch, so every runner (and the hand-written loop) sees the same noise."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, noise = batch
        g_opt, d_opt = self.optimizers()
        self.losses(real, noise, d_opt, g_opt, scale=1.0)
        for opt in (d_opt, g_opt):
            opt.step()
            opt.zero_grad()

    def losses(self, real: torch.Tensor, noise: torch.Tensor, d_opt: Any, g_opt: Any, scale: float) -> tuple:
        fake = self.generator(noise)
        with d_opt.toggle_model():
            d_loss = self.discriminator_loss(real, fake.detach())
            self.manual_backward(d_loss * scale)
        with g_opt.toggle_model():
            g_loss = self.generator_loss(fake)
            self.manual_backward(g_loss * scale)
        return d_loss, g_loss


class NaiveGAN(FixedNoiseGAN):
    """Accumulation by hand, sync never blocked (Trainer k=1)."""

    k = 4

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, noise = batch
        g_opt, d_opt = pl.LightningModule.optimizers(self)
        self.losses(real, noise, d_opt, g_opt, scale=1.0 / self.k)
        if (batch_idx + 1) % self.k == 0:
            for opt in (d_opt, g_opt):
                opt.step()
                opt.zero_grad()


def make_data(n: int, noise_dim: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(n, 64, generator=g), torch.randn(n, noise_dim, generator=g))


class Timer(Callback):
    def __init__(self, out: Path, k: int, warmup: int, profile_windows: int = 2) -> None:
        self.out, self.k, self.warmup, self.profile_windows = out, k, warmup, profile_windows
        self.starts: list[float] = []
        self.prof: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        if idx % self.k == 0:
            self.starts.append(time.perf_counter())
            window = idx // self.k
            if window == self.warmup:
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.prof.__enter__()
            if window == self.warmup + self.profile_windows and self.prof is not None:
                self.prof.__exit__(None, None, None)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.starts.append(time.perf_counter())
        if trainer.global_rank == 0:
            calls = sum(1 for e in self.prof.events() if e.name == "gloo:all_reduce") / self.profile_windows
            windows = [b - a for a, b in zip(self.starts, self.starts[1:])][self.warmup + self.profile_windows :]
            weights = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
            torch.save({"window_s": windows, "calls": calls, "weights": weights}, self.out)


def run_lightning(name: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    model_cls = NaiveGAN if "naive" in name else FixedNoiseGAN
    if name == "mgpu_ddp":
        strategy: Any = MGPUDDPStrategy(start_method="fork")
    else:
        strategy = DDPStrategy(start_method="fork", find_unused_parameters=True)
    k = 1 if "naive" in name else args.k
    torch.manual_seed(0)
    model = model_cls(hidden=args.hidden)
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_epochs=1, accumulate_grad_batches=k,
        use_distributed_sampler=False, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Timer(out, args.k, args.warmup)],
    )  # fmt: skip
    trainer.fit(model, DataLoaderModule(args))
    return torch.load(out)


class DataLoaderModule(pl.LightningDataModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args

    def train_dataloader(self) -> DataLoader:
        a = self.args
        data = make_data(WORLD * a.batch * a.k * (a.windows + a.warmup + 2), 16)
        return DataLoader(data, batch_size=a.batch, sampler=DistributedSampler(data, shuffle=False))


class _Phases(torch.nn.Module):
    """One DDP forward per optimizer phase: returns the discriminator's or the generator's loss."""

    def __init__(self, gan: DigitsGAN) -> None:
        super().__init__()
        self.gan = gan

    def forward(self, real: torch.Tensor, fake: torch.Tensor, phase: str) -> torch.Tensor:
        if phase == "d":
            return self.gan.discriminator_loss(real, fake.detach())
        return self.gan.generator_loss(fake)


def _plain_worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // WORLD))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    gan = DigitsGAN(hidden=args.hidden)
    ddp = DDP(_Phases(gan), find_unused_parameters=True)
    g_opt = torch.optim.Adam(gan.generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
    d_opt = torch.optim.Adam(gan.discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999))
    data = make_data(WORLD * args.batch * args.k * (args.windows + args.warmup + 2), 16)
    loader = DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data, shuffle=False))
    starts, prof = [], None
    for i, (real, noise) in enumerate(loader):
        if i % args.k == 0:
            starts.append(time.perf_counter())
            if i // args.k == args.warmup:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                prof.__enter__()
            if i // args.k == args.warmup + 2 and prof is not None:
                prof.__exit__(None, None, None)
        boundary = (i + 1) % args.k == 0
        fake = gan.generator(noise)
        for phase, frozen in (("d", gan.generator), ("g", gan.discriminator)):
            frozen.requires_grad_(False)
            with ddp.no_sync() if not boundary else contextlib.nullcontext():
                (ddp(real, fake, phase) / args.k).backward()
            frozen.requires_grad_(True)
        if boundary:
            for opt in (d_opt, g_opt):
                opt.step()
                opt.zero_grad(set_to_none=True)
    starts.append(time.perf_counter())
    if rank == 0:
        calls = sum(1 for e in prof.events() if e.name == "gloo:all_reduce") / 2
        windows = [b - a for a, b in zip(starts, starts[1:])][args.warmup + 2 :]
        torch.save(
            {
                "window_s": windows,
                "calls": calls,
                "weights": torch.cat([p.detach().flatten() for p in gan.parameters()]),
            },
            out,
        )
    del ddp
    dist.barrier()
    dist.destroy_process_group()


def run_plain(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    mp.start_processes(
        _plain_worker, nprocs=WORLD, start_method="fork", args=(args, find_free_network_port(), str(out))
    )
    return torch.load(out)


RUNNERS = ("mgpu_ddp", "ddp+find_unused", "ddp+find_unused naive", "plain DDP+find_unused")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--windows", type=int, default=8, help="timed windows per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed windows per run")
    parser.add_argument("--k", type=int, default=4, help="accumulate_grad_batches")
    parser.add_argument("--batch", type=int, default=32, help="per device")
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    n_params = sum(p.numel() for p in DigitsGAN(hidden=args.hidden).parameters())
    print(
        f"DigitsGAN hidden={args.hidden}: {n_params / 1e6:.2f}M parameters, {WORLD} gloo ranks, batch {args.batch} "
        f"per rank, k={args.k}, {args.rounds} rounds x {args.windows} windows"
    )
    times: dict[str, list[float]] = {r: [] for r in RUNNERS}
    last: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for name in RUNNERS:
                out = Path(tmp) / f"{rnd}_{name.replace(' ', '_')}.pt"
                res = run_plain(args, out) if name.startswith("plain") else run_lightning(name, args, out)
                times[name].append(statistics.median(res["window_s"]))
                last[name] = res
    base = statistics.median(times["mgpu_ddp"])
    ref = last["mgpu_ddp"]["weights"]
    print(f"\n{'runner':<24} {'ms/window':>10} {'vs mgpu_ddp':>12} {'all_reduce/window':>18} {'max |dw| vs mgpu':>17}")
    for name in RUNNERS:
        t = statistics.median(times[name])
        w = last[name]["weights"]
        dw = f"{(w - ref).abs().max().item():.1e}" if w is not None else "n/a"
        print(f"{name:<24} {t * 1e3:>10.1f} {t / base:>11.2f}x {last[name]['calls']:>18.1f} {dw:>17}")
    spread = {n: f"{min(v) * 1e3:.0f}-{max(v) * 1e3:.0f}" for n, v in times.items()}
    print(f"\nper-round medians (ms): {spread}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
