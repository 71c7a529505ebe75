"""The pipeline's bubble, measured beside the formula, and the bytes one step sends between stages.

    python benchmarks/bench_pipeline.py                      # 2 CPU processes (gloo), GPipe and 1F1B, m = 2, 4, 8
    python benchmarks/bench_pipeline.py --width 512 --steps 8

The model: ``--blocks`` equal blocks ``Linear(width, width) + GELU`` in an ``nn.Sequential`` (so the stages are of
equal cost), float32, a batch of ``--batch`` samples; ``MGPUShardedStrategy(pipeline_parallel_size=2)`` through
``Trainer.fit``. Per schedule and number of micro-batches m: the bubble each rank measured (the fraction of the
schedule's wall time its stage did not compute: ``trainer.strategy.pipeline_stats()``), its median over the
``--steps`` steps after the first, averaged over the ranks, beside ``(P - 1) / (m + P - 1)``, and the bytes each
rank sent to the other stage per step. On CPU the sends and the Python overhead of each micro-batch count as
idle time, so the measured bubble sits above the formula, the more so the smaller the blocks. Not measured on a GPU
yet (run this script on a machine with 2 GPUs, ``--accelerator gpu``, to measure it there). The machines are
shared: timings are never asserted in tests.

    python benchmarks/bench_pipeline.py --step-time --compare /path/to/another/checkout

``--step-time``: the host's cost of a pipelined step, where the step is nearly all framework: 4 blocks of width 8,
batch 4 in 2 micro-batches (1F1B), a ``training_step`` that logs its loss every step as users do; rank 0's median
time between the ends of consecutive steps over ``--steps`` steps after 20, per round, each run its own 2-process
fit (fork); ``--compare PATH`` runs the same with the pack of another checkout in every round, and prints the median
of each round's ratio (paired) beside the ratio of the medians.

    python benchmarks/bench_pipeline.py --versus-zero3       # 4 CPU processes: pipeline 2 x data 2 vs ZeRO-3
    python benchmarks/bench_pipeline.py --versus-zero3 --link-mb-s 50 --latency-ms 0.5

``--versus-zero3``: pipeline x data against ZeRO-3 on the same model and global batch, 4 processes taken as 2
"machines" of 2 ranks ({0, 1} and {2, 3}) with a slowed link between them, as ``benchmarks/bench_hsdp.py`` does:

* ``pipeline 2 x data 2``: ``MGPUShardedStrategy(pipeline_parallel_size=2)`` (1F1B, ``--microbatches``): stage 0 on
  ranks 0 and 1, stage 1 on ranks 2 and 3, so the stage boundary (activations forward, their gradients backward)
  crosses the link and each stage's data-parallel all-reduce of gradients stays inside a machine;
* ``zero3 over 4``: ``MGPUShardedStrategy(stage=3)`` (``mgpu_zero3``'s layout) over all 4 ranks: every all-gather
  of parameters and reduce-scatter of gradients spans both machines.

Counted by wrapping ``torch.distributed``'s collectives (all-gather, reduce-scatter, all-reduce, broadcast) and its
point-to-point ``isend``/``irecv`` in each rank, independently of the ledger: the bytes each rank sends per
optimizer step within a machine and across the link (a collective counts as across when its group spans both
machines; ring model: an all-gather or reduce-scatter over ``g`` ranks sends ``(g - 1) / g`` of the whole tensor,
an all-reduce ``2 (g - 1) / g``), averaged over the 4 ranks, and rank 0's median step time after warm-up. The slowed
link is simulated in the ranks (the kernel's ``netem`` is not available, and would slow all of loopback): with
``--link-mb-s B`` a rank sleeps after each collective that spans the machines for the bytes it sent divided by
``B`` MB/s plus ``--latency-ms``, and after posting each receive from the other machine for the bytes received
divided by ``B`` plus the latency (a send is asynchronous: the sender does not wait). Every layout runs on plain
loopback and on the slowed link; the last lines print the ratios pipeline / zero3. The figures show how the bytes
crossing the link turn into time on 4 CPU processes (the direction), not what a given cluster will measure. Not
measured on GPUs yet (``--accelerator gpu`` on a machine with 4 GPUs runs the same with NCCL).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_mgpu import MGPUShardedStrategy


class Stack(pl.LightningModule):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Data(pl.LightningDataModule):
    def __init__(self, data: TensorDataset, batch: int) -> None:
        super().__init__()
        self.data, self.batch = data, batch

    def train_dataloader(self) -> DataLoader:
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        sampler = DistributedSampler(self.data, shuffle=False, **kwargs)  # the stages of a pipeline: the same batch
        return DataLoader(self.data, batch_size=self.batch, sampler=sampler)


class Bubbles(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.bubbles: list[float] = []
        self.stats: Any = None

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.stats = trainer.strategy.pipeline_stats()
        self.bubbles.append(self.stats.bubble)

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        measured = statistics.median(self.bubbles[1:] or self.bubbles)
        torch.save((measured, self.stats), self.out / f"rank{trainer.global_rank}.pt")


def run(args: argparse.Namespace, schedule: str, m: int) -> tuple[float, Any]:
    out = Path(tempfile.mkdtemp())
    data = TensorDataset(
        torch.randn(args.batch * (args.steps + 1), args.width), torch.randn(args.batch * (args.steps + 1), args.width)
    )
    strategy = MGPUShardedStrategy(
        pipeline_parallel_size=2, pipeline_schedule=schedule, pipeline_microbatches=m, start_method="fork"
    )
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=2,
        strategy=strategy,
        max_steps=args.steps + 1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[Bubbles(out)],
    )
    trainer.fit(Stack(args.blocks, args.width), Data(data, args.batch))
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return sum(r[0] for r in ranks) / len(ranks), ranks[0][1]


class LoggingStack(Stack):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True)
        return loss


class StepClock(pl.Callback):
    """Rank 0's median time between the ends of consecutive steps after ``warmup``, in µs, written to ``out``."""

    def __init__(self, out: Path, warmup: int) -> None:
        self.out, self.warmup, self.ends = out, warmup, []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            ends = self.ends[self.warmup :]
            self.out.write_text(str(statistics.median(b - a for a, b in zip(ends, ends[1:])) * 1e6))


def time_one(args: argparse.Namespace) -> None:
    """One ``--step-time`` run, with the pack this process imports (the checkout on ``PYTHONPATH``)."""
    warmup, batch = 20, 4
    torch.manual_seed(0)  # every process builds the same data: the ranks of a pipeline take the same batches
    n = batch * (warmup + args.steps + 2)
    data = TensorDataset(torch.randn(n, 8), torch.randn(n, 8))
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=2,
        strategy=MGPUShardedStrategy(pipeline_parallel_size=2, pipeline_microbatches=2, start_method="fork"),
        max_steps=warmup + args.steps + 1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[StepClock(Path(args.time_one), warmup)],
    )
    trainer.fit(LoggingStack(4, 8), Data(data, batch))


def step_time(args: argparse.Namespace) -> None:
    import subprocess
    import sys

    here = Path(__file__).resolve()
    checkouts = [("this checkout", here.parents[1])]
    if args.compare is not None:
        checkouts.append((str(args.compare), args.compare.resolve()))
    print(
        f"pipelined step, 2 CPU processes (gloo), 4 blocks Linear(8, 8) + GELU, batch 4 in 2 micro-batches (1F1B), "
        f"the loss logged every step; rank 0's median µs per step over {args.steps} steps after 20, {args.rounds} "
        f"rounds"
    )
    times: dict[str, list[float]] = {name: [] for name, _ in checkouts}
    for r in range(args.rounds):
        for name, root in checkouts:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp, "us")
                env = {**os.environ, "PYTHONPATH": str(root)}
                command = [sys.executable, str(here), "--time-one", str(out), "--steps", str(args.steps)]
                command += ["--accelerator", args.accelerator]
                subprocess.run(command, env=env, check=True, capture_output=True, timeout=600)
                times[name].append(float(out.read_text()))
        print(f"round {r + 1}/{args.rounds} (µs): " + ", ".join(f"{n} {t[-1]:.0f}" for n, t in times.items()))
    for name, t in times.items():
        print(f"{name:<40} median {statistics.median(t):>8.0f} µs")
    if args.compare is not None:
        ours, other = times["this checkout"], times[str(args.compare)]
        paired = statistics.median(a / b for a, b in zip(ours, other))
        print(
            f"this checkout / {args.compare}: median {statistics.median(ours) / statistics.median(other):.2f}x, "
            f"paired {paired:.2f}x"
        )


PER_MACHINE = 2  # ranks {0, 1} and {2, 3}: the two "machines" of --versus-zero3
COLLECTIVES = (
    "all_gather_single",  # FSDP2's, on this torch
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_reduce",
    "broadcast",
    "all_gather",
)


class SlowLink(pl.Callback):
    """Wraps ``torch.distributed``'s collectives and ``isend``/``irecv`` in this rank: counts the bytes sent within a
    machine and across the link and, with ``link_mb_s > 0``, sleeps for what crosses the link (see the module's
    docstring). Writes the bytes and step times per optimizer step at the end of fit."""

    def __init__(self, out: Path, link_mb_s: float, latency_ms: float, warmup: int) -> None:
        self.out, self.link_mb_s, self.latency_ms, self.warmup = out, link_mb_s, latency_ms, warmup
        self.sent = {"within": 0.0, "across": 0.0}
        self.times: list[float] = []
        self._originals: dict[str, Any] = {}
        self._start = 0.0

    def _wait(self, nbytes: float) -> None:
        if self.link_mb_s > 0:
            time.sleep(nbytes / (self.link_mb_s * 1e6) + self.latency_ms / 1e3)

    def _collective(self, name: str, original: Any) -> Any:
        def spy(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            group = kwargs.get("group")
            ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
            g = len(ranks)
            if name.startswith("all_gather_"):
                tensor, factor = kwargs.get("output_tensor", args[0] if args else None), (g - 1) / g
            elif name.startswith("reduce_scatter"):
                tensor, factor = kwargs.get("input", args[1] if len(args) > 1 else None), (g - 1) / g
            elif name == "all_gather":  # (tensor_list, tensor): this rank's tensor to each of the others
                tensor, factor = kwargs.get("tensor", args[1] if len(args) > 1 else None), float(g - 1)
            elif name == "broadcast":  # the source sends the tensor; every rank waits for it
                tensor = kwargs.get("tensor", args[0] if args else None)
                src = kwargs.get("src", args[1] if len(args) > 1 else None)
                factor = 1.0 if src == dist.get_rank() else 0.0
            else:
                tensor, factor = kwargs.get("tensor", args[0] if args else None), 2 * (g - 1) / g
            nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
            spans = len({r // PER_MACHINE for r in ranks}) > 1
            self.sent["across" if spans else "within"] += factor * nbytes
            if spans:
                self._wait(nbytes if name == "broadcast" else factor * nbytes)
            return result

        return spy

    def _p2p(self, send: bool, original: Any) -> Any:
        def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            work = original(tensor, *args, **kwargs)
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            peer = kwargs.get("dst" if send else "src", args[0] if args else None)
            group_peer = kwargs.get("group_dst" if send else "group_src")
            if peer is None and group_peer is not None:
                peer = dist.get_global_rank(group if group is not None else dist.group.WORLD, group_peer)
            across = peer // PER_MACHINE != dist.get_rank() // PER_MACHINE
            nbytes = tensor.numel() * tensor.element_size()
            if send:
                self.sent["across" if across else "within"] += nbytes
            elif across:  # the data arrives once the link has carried it
                self._wait(nbytes)
            return work

        return spy

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        spies = {name: self._collective(name, getattr(dist, name)) for name in COLLECTIVES if hasattr(dist, name)}
        spies["isend"], spies["irecv"] = self._p2p(True, dist.isend), self._p2p(False, dist.irecv)
        for name, spy in spies.items():
            # both: P2POp checks its op against distributed_c10d's isend/irecv, the schedules call dist.isend
            self._originals[name] = getattr(dist, name)
            setattr(dist, name, spy)
            if name in ("isend", "irecv"):
                setattr(distributed_c10d, name, spy)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self.sent = {"within": 0.0, "across": 0.0}
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._start)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
            if name in ("isend", "irecv"):
                setattr(distributed_c10d, name, original)
        steps = max(len(self.times), 1)
        record = {
            "within": self.sent["within"] / steps,
            "across": self.sent["across"] / steps,
            "step_s": statistics.median(self.times) if self.times else float("nan"),
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def run_layout(args: argparse.Namespace, layout: str, link: float) -> dict[str, float]:
    """One layout on 4 processes; the bytes averaged over the ranks, rank 0's step time."""
    out = Path(tempfile.mkdtemp())
    world, replicas = 2 * PER_MACHINE, PER_MACHINE if layout == "pipeline" else 2 * PER_MACHINE
    steps = args.warmup + args.steps
    global_batch = args.batch * world
    g = torch.Generator().manual_seed(0)
    n = global_batch * steps
    data = TensorDataset(torch.randn(n, args.width, generator=g), torch.randn(n, args.width, generator=g))
    if layout == "pipeline":
        strategy = MGPUShardedStrategy(
            pipeline_parallel_size=2, pipeline_microbatches=args.microbatches, start_method="fork"
        )
    else:
        strategy = MGPUShardedStrategy(stage=3, start_method="fork")
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=world,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[SlowLink(out, link, args.latency_ms if link > 0 else 0.0, args.warmup)],
    )
    torch.manual_seed(0)
    trainer.fit(Stack(args.blocks, args.width), Data(data, global_batch // replicas))
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    return {
        "within": sum(r["within"] for r in ranks) / world,
        "across": sum(r["across"] for r in ranks) / world,
        "step_s": ranks[0]["step_s"],
    }


def versus_zero3(args: argparse.Namespace) -> None:
    params = sum(p.numel() for p in Stack(args.blocks, args.width).parameters())
    print(
        f"pipeline 2 x data 2 vs ZeRO-3 over 4 on 2 'machines' x {PER_MACHINE} processes ({args.accelerator}), "
        f"{args.blocks} blocks of width {args.width} ({params:,} parameters, float32), SGD, global batch "
        f"{args.batch * 2 * PER_MACHINE}, {args.microbatches} micro-batches (1F1B); median of {args.steps} steps "
        f"after {args.warmup}; bytes sent per step, the mean over the ranks"
    )
    links = [("loopback", 0.0), (f"slowed {args.link_mb_s:g} MB/s + {args.latency_ms:g} ms", args.link_mb_s)]
    head = f"{'link':<28} {'layout':<20} {'within machine':>15} {'across link':>13} {'step ms':>9}"
    print(head)
    print("-" * len(head))
    names = {"pipeline": "pipeline 2 x data 2", "zero3": "zero3 over 4"}
    ratios = []
    for link_name, link in links:
        results = {layout: run_layout(args, layout, link) for layout in ("pipeline", "zero3")}
        for layout, r in results.items():
            print(
                f"{link_name:<28} {names[layout]:<20} {r['within'] / 1e6:>12.3f} MB {r['across'] / 1e6:>10.3f} MB "
                f"{r['step_s'] * 1e3:>9.1f}"
            )
        pipe, zero3 = results["pipeline"], results["zero3"]
        ratios.append((link_name, pipe["across"] / zero3["across"], pipe["step_s"] / zero3["step_s"]))
    print()
    for link_name, across, step in ratios:
        print(f"pipeline / zero3, {link_name}: bytes across the link {across:.3f}x, step time {step:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64, help="per rank with --versus-zero3, else per step")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--versus-zero3", action="store_true", help="pipeline 2 x data 2 vs ZeRO-3, slowed link")
    parser.add_argument("--microbatches", type=int, default=4, help="with --versus-zero3")
    parser.add_argument("--warmup", type=int, default=2, help="with --versus-zero3: steps before timing")
    parser.add_argument("--link-mb-s", type=float, default=100.0, help="with --versus-zero3: the slowed link, MB/s")
    parser.add_argument("--latency-ms", type=float, default=0.2, help="with --versus-zero3: latency per transfer")
    parser.add_argument("--step-time", action="store_true", help="the host's cost of a pipelined step (rounds)")
    parser.add_argument("--rounds", type=int, default=6, help="with --step-time")
    parser.add_argument("--compare", type=Path, default=None, help="with --step-time: another checkout beside this")
    parser.add_argument("--time-one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.time_one is not None:
        time_one(args)
        return
    if args.step_time:
        step_time(args)
        return
    if args.versus_zero3:
        versus_zero3(args)
        return
    print(f"{'schedule':<10} {'m':>3} {'bubble measured':>16} {'(P-1)/(m+P-1)':>14} {'bytes sent/step':>16}")
    for schedule in ("gpipe", "1f1b"):
        for m in (2, 4, 8):
            measured, stats = run(args, schedule, m)
            print(f"{schedule:<10} {m:>3} {measured:>16.3f} {stats.bubble_theory:>14.3f} {stats.bytes_sent:>16,}")


if __name__ == "__main__":
    main()
