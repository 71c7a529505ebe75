"""mgpu_ddp vs Lightning's ``ddp`` vs a plain torch DDP loop, measured side by side in one run.

    python benchmarks/bench_ddp.py                 # defaults: 2 CPU processes (gloo), MLP of ~6.3M parameters
    python benchmarks/bench_ddp.py --rounds 5 --steps 80 --hidden 1024

Part 1, step time: the median time of one training step (forward, backward with the gradient
all-reduce, optimizer step) on rank 0, after warm-up, for the three runners; the runners alternate
round by round so a noisy neighbour hurts all of them alike; the table shows the median over rounds and
the ratios. Lightning's step includes its loop and hook overhead: that is what a Lightning user pays.

Part 2, communication: all-reduce calls and payload per optimizer step, for accumulation k = 1, 2, 4
and with the fp16 and PowerSGD hooks; Lightning's ``ddp`` with torch's fp16 hook passed as
``ddp_comm_hook`` is shown too (on CPU it silently trains without it). Three instruments, side by side:
torch.profiler's ``gloo:all_reduce`` events (calls and elements; sees DDP's built-in C++ all-reduce and
hook calls on the training thread, not calls issued later from future callbacks on gloo threads), a spy
on ``torch.distributed.all_reduce`` (calls and bytes of every Python-issued all-reduce, any thread: all comm
hooks, never DDP's built-in path), and our ledger.

Launch cost is excluded (all runners fork); timings are never asserted anywhere: machines are shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning_fabric.plugins.environments.lightning import find_free_network_port
from lightning_fabric.utilities.distributed import _set_num_threads_if_needed
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_mgpu  # noqa: F401  (registers the presets)
from lightning_mgpu import MGPUDDPStrategy

WORLD = 2


def make_model(d_in: int, hidden: int, classes: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes)
    )


def make_data(n: int, d_in: int, classes: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, d_in, generator=g), torch.randint(0, classes, (n,), generator=g))


class Spy:
    """Counts ``torch.distributed.all_reduce`` calls and payload bytes in this process, from any thread."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self._lock = threading.Lock()
        self._original = dist.all_reduce

        def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.calls += 1
                self.bytes += tensor.numel() * tensor.element_size()
            return self._original(tensor, *args, **kwargs)

        dist.all_reduce = spy

    def close(self) -> None:
        dist.all_reduce = self._original


# ----------------------------------------------------------------------------------------------- Lightning


class Module(pl.LightningModule):
    def __init__(self, model: nn.Module, lr: float) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class Data(pl.LightningDataModule):
    def __init__(self, dataset: TensorDataset, batch: int) -> None:
        super().__init__()
        self.dataset, self.batch = dataset, batch

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.dataset, batch_size=self.batch, sampler=DistributedSampler(self.dataset, shuffle=False), drop_last=True
        )


def _profiled(prof: Optional[torch.profiler.profile]) -> tuple[int, int]:
    """(calls, elements) of the gloo:all_reduce events a profiler recorded."""
    if prof is None:
        return 0, 0
    events = [e for e in prof.events() if e.name == "gloo:all_reduce"]
    return len(events), sum(int(torch.Size(e.input_shapes[0]).numel()) if e.input_shapes else 0 for e in events)


class Probe(Callback):
    """Step times, spy and profiler counts, written by rank 0 to ``out``."""

    def __init__(self, out: str, profile: bool = False) -> None:
        self.out = out
        self.profile = profile
        self.times: list[float] = []
        self._t0 = 0.0
        self._spy: Optional[Spy] = None
        self._prof: Optional[torch.profiler.profile] = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._spy = Spy()
        if self.profile:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
            self._prof.__enter__()

    def on_train_batch_start(self, *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._t0)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._spy is not None
        self._spy.close()
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
        if trainer.is_global_zero:
            stats = getattr(trainer.strategy, "comm_stats", None)
            torch.save(
                {
                    "times": self.times,
                    "calls": self._spy.calls,
                    "bytes": self._spy.bytes,
                    "profiled": _profiled(self._prof),
                    "steps": trainer.global_step,
                    "ledger": stats,
                },
                self.out,
            )


def run_lightning(
    strategy: Any,
    args: argparse.Namespace,
    out: str,
    accumulate: int = 1,
    steps: Optional[int] = None,
    profile: bool = False,
) -> dict:
    module = Module(make_model(args.d_in, args.hidden, args.classes), args.lr)
    data = Data(make_data(args.samples, args.d_in, args.classes), args.batch)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=steps or args.steps,
        accumulate_grad_batches=accumulate,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Probe(out, profile=profile)],
    )
    trainer.fit(module, datamodule=data)
    return torch.load(out, weights_only=False)


# ---------------------------------------------------------------------------------------------- plain DDP


def _plain_worker(rank: int, args: argparse.Namespace, port: int, hook: Optional[str], out: str, profile: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # the thread count Lightning's launcher sets: cores // processes (else 2 processes x 2 threads on 2 cores)
    _set_num_threads_if_needed(WORLD)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    model = make_model(args.d_in, args.hidden, args.classes)
    ddp = DDP(model)
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    dataset = make_data(args.samples, args.d_in, args.classes)
    loader = DataLoader(
        dataset, batch_size=args.batch, sampler=DistributedSampler(dataset, shuffle=False), drop_last=True
    )
    spy = Spy()
    prof = None
    if profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        prof.__enter__()
    times: list[float] = []
    step = 0
    while step < args.steps:
        for x, y in loader:
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            step += 1
            if step == args.steps:
                break
    spy.close()
    if prof is not None:
        prof.__exit__(None, None, None)
    if rank == 0:
        torch.save(
            {
                "times": times,
                "calls": spy.calls,
                "bytes": spy.bytes,
                "profiled": _profiled(prof),
                "steps": step,
                "ledger": None,
            },
            out,
        )
    del ddp, opt
    dist.barrier()
    dist.destroy_process_group()


def run_plain(args: argparse.Namespace, out: str, hook: Optional[str] = None, profile: bool = False) -> dict:
    mp.start_processes(
        _plain_worker, nprocs=WORLD, start_method="fork", args=(args, find_free_network_port(), hook, out, profile)
    )
    return torch.load(out, weights_only=False)


# ------------------------------------------------------------------------------------------------- report


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (k=1)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--d-in", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--skip-comm", action="store_true", help="only the step-time comparison")
    parser.add_argument("--skip-time", action="store_true", help="only the communication table")
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} must be smaller than --steps {args.steps}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

    n_params = sum(p.numel() for p in make_model(args.d_in, args.hidden, args.classes).parameters())
    print(
        f"torch {torch.__version__}, pytorch-lightning {pl.__version__}, {WORLD} CPU processes (gloo), "
        f"{os.cpu_count()} cores; MLP {args.d_in}-{args.hidden}-{args.hidden}-{args.classes} "
        f"({n_params / 1e6:.2f}M params, {n_params * 4 / 2**20:.1f} MiB of fp32 gradients), batch {args.batch}/rank"
    )

    tmp = Path(tempfile.mkdtemp(prefix="mgpu-bench-"))
    runners = {
        "mgpu_ddp": lambda out: run_lightning(MGPUDDPStrategy(start_method="fork"), args, out),
        "lightning ddp": lambda out: run_lightning(DDPStrategy(start_method="fork"), args, out),
        "plain torch DDP": lambda out: run_plain(args, out),
    }
    medians: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(0 if args.skip_time else args.rounds):
        for i, (name, runner) in enumerate(runners.items()):
            os.environ.pop("MASTER_PORT", None)
            result = runner(str(tmp / f"time_{r}_{i}.pt"))
            medians[name].append(statistics.median(result["times"][args.warmup :]))
        print(
            f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {m[-1] * 1e3:.1f} ms" for n, m in medians.items()),
            flush=True,
        )

    med = {name: statistics.median(v) if v else float("nan") for name, v in medians.items()}
    print("\n## Step time (median over rounds of the per-run median, rank 0)\n")
    print("| runner | step time (ms) | per-round medians (ms) |")
    print("|---|---:|---|")
    for name, v in medians.items():
        print(f"| {name} | {med[name] * 1e3:.2f} | {', '.join(f'{x * 1e3:.1f}' for x in v)} |")
    print(
        f"\nmgpu_ddp / lightning ddp = {med['mgpu_ddp'] / med['lightning ddp']:.3f}x   "
        f"mgpu_ddp / plain torch DDP = {med['mgpu_ddp'] / med['plain torch DDP']:.3f}x"
    )

    if args.skip_comm:
        return 0
    grad_bytes = n_params * 4
    bound = 2 * (WORLD - 1) / WORLD * grad_bytes
    comm_steps = 12
    cases: list[tuple[str, Any]] = [
        *[(f"mgpu_ddp k={k}", (MGPUDDPStrategy, {}, k)) for k in (1, 2, 4)],
        *[(f"lightning ddp k={k}", (DDPStrategy, {}, k)) for k in (1, 4)],
        ("mgpu_ddp static_graph k=4", (MGPUDDPStrategy, {"static_graph": True}, 4)),
        ("mgpu_ddp comm_hook=fp16", (MGPUDDPStrategy, {"comm_hook": "fp16"}, 1)),
        ("mgpu_ddp comm_hook=powersgd (rank 1)", (MGPUDDPStrategy, {"comm_hook": "powersgd"}, 1)),
        (
            "lightning ddp + ddp_comm_hook=fp16 (CPU)",
            (DDPStrategy, {"ddp_comm_hook": default_hooks.fp16_compress_hook}, 1),
        ),
    ]
    rows = []
    for i, (name, (cls, kwargs, k)) in enumerate(cases):
        print(f"[comm] {name}", flush=True)
        os.environ.pop("MASTER_PORT", None)
        rows.append(
            (
                name,
                run_lightning(
                    cls(start_method="fork", **kwargs),
                    args,
                    str(tmp / f"comm{i}.pt"),
                    accumulate=k,
                    steps=comm_steps,
                    profile=True,
                ),
            )
        )
    for hook in (None, "fp16"):
        os.environ.pop("MASTER_PORT", None)
        saved, args.steps = args.steps, comm_steps
        rows.append(
            (
                f"plain torch DDP{' + fp16_compress_hook' if hook else ''}",
                run_plain(args, str(tmp / f"plain_{hook}.pt"), hook=hook, profile=True),
            )
        )
        args.steps = saved

    print(f"\n## All-reduce per optimizer step ({comm_steps} steps, rank 0)\n")
    print(
        f"gradients {grad_bytes / 2**20:.2f} MiB; ring lower bound 2(N-1)/N x gradient bytes = "
        f"{bound / 2**20:.2f} MiB per step (N={WORLD})\n"
    )
    print(
        "| run | profiler calls/step | profiler Melem/step | spy calls/step | spy MiB/step "
        "| ledger calls/step | ledger MiB/step | ledger ring/lower bound |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, res in rows:
        steps = res["steps"]
        pc, pe = res["profiled"]
        led = res["ledger"]
        led_txt = (
            f"{led.calls_per_step:.2f} | {led.bytes_per_step / 2**20:.2f} | {led.ratio_to_lower_bound:.2f}x"
            if led is not None
            else "n/a | n/a | n/a"
        )
        print(
            f"| {name} | {pc / steps:.2f} | {pe / steps / 1e6:.2f} | {res['calls'] / steps:.2f} "
            f"| {res['bytes'] / steps / 2**20:.2f} | {led_txt} |"
        )
    print(
        "\nprofiler: DDP's built-in all-reduce and hook calls on the training thread; spy: every Python-issued "
        "all-reduce (comm hooks), any thread. PowerSGD compresses from its 2nd synchronisation on "
        "(start_powerSGD_iter=2); its P and Q all-reduces run in future callbacks, seen by the spy only. "
        "static_graph adds one all-reduce in its first iteration (torch's used-parameter map)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
