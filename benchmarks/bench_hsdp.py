"""Hybrid sharding (HSDP) against flat sharding on 2 "machines" x 2 processes, measured side by side in one run.

    python benchmarks/bench_hsdp.py                                  # CPU, gloo, 4 processes, ~1.1M parameters
    python benchmarks/bench_hsdp.py --link-mb-s 100 --latency-ms 0.2 --layers 6 --width 512 --steps 12

Each "machine" is a process with ``NODE_RANK`` set, as a cluster sets it, running ``Trainer(num_nodes=2,
devices=2)``; Lightning's fork launch starts its 2 ranks. Both runners train the same MLP with Adam, ZeRO stage 3
on torch FSDP2, one micro-batch per step:

* ``flat``: ``mgpu_zero3``, one shard group of all 4 ranks: every all-gather and reduce-scatter spans both
  machines;
* ``hsdp``: ``mgpu_hsdp`` (``mesh="hybrid"``), shard groups {0, 1} and {2, 3} (one per machine), replicas {0, 2}
  and {1, 3}: the gathers and reduce-scatters stay inside a machine, one all-reduce of the gradient shards per step
  crosses.

Reported, per optimizer step on rank 0, and as ratios hsdp / flat: bytes this rank sends in collectives whose group
lies within one machine and in those whose group spans machines (ring model: an all-gather or reduce-scatter over
``g`` ranks sends ``(g - 1) / g`` of the whole tensor, an all-reduce ``2 (g - 1) / g``; counted by wrapping
``torch.distributed``'s all-gather, reduce-scatter and all-reduce in each rank, independently of the ledger), and
the median time per optimizer step after warm-up.

The link between the machines. On one machine every rank talks over loopback, and the kernel here has neither
``netem`` nor ``prio`` queueing disciplines (``tc qdisc add ... netem`` fails with "Specified qdisc kind is
unknown"), and ``tc`` would slow all of loopback, not one group. So the slow link is simulated in the ranks: with
``--link-mb-s B`` each rank sleeps, after each collective whose group spans machines, for the bytes it sent in it
divided by ``B`` MB/s plus ``--latency-ms``. The benchmark runs every runner on plain loopback and on the
simulated link. A real network also has contention and overlap that this does not model: the figures show how the
bytes crossing machines turn into time, not what a given cluster will measure.

GPU: ``--accelerator gpu`` runs the same on 4 GPUs of one machine as 2 x 2 (NCCL, each "machine" seeing 2 of them,
spawned workers); ``make bench-gpu`` runs it, and it says so and measures nothing on fewer than 4 GPUs. Not measured
on a GPU yet.
"""

from __future__ import annotations

import argparse
import json
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
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_mgpu import MGPUShardedStrategy

NODES, PER_NODE = 2, 2


class MLP(pl.LightningModule):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)])
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Data(pl.LightningDataModule):
    def __init__(self, width: int, batch: int, steps: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        n = batch * NODES * PER_NODE * steps
        self.dataset = TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, width, generator=g))
        self.batch = batch

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch, sampler=DistributedSampler(self.dataset, shuffle=False))


class LinkSpy(Callback):
    """Wraps ``torch.distributed``'s all-gather, reduce-scatter and all-reduce in this rank: counts the bytes sent
    per kind of group (within a machine, spanning machines) and, with a simulated link, sleeps after each
    collective that spans machines. Writes bytes and step times per optimizer step at the end of fit."""

    NAMES = (
        "all_gather_single",
        "all_gather_into_tensor",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "all_reduce",
    )

    def __init__(self, out: str, link_mb_s: float, latency_ms: float, warmup: int) -> None:
        self.out, self.link_mb_s, self.latency_ms, self.warmup = out, link_mb_s, latency_ms, warmup
        self.sent = {"within": 0.0, "across": 0.0}
        self.calls = {"within": 0, "across": 0}
        self.times: list[float] = []
        self._originals: dict[str, Any] = {}
        self._start = 0.0

    def _sent(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, bool]:
        group = kwargs.get("group")
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        g = len(ranks)
        if name.startswith("all_gather"):
            tensor = kwargs.get("output_tensor", args[0] if args else None)
            factor = (g - 1) / g
        elif name.startswith("reduce_scatter"):
            tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
            factor = (g - 1) / g
        else:
            tensor = kwargs.get("tensor", args[0] if args else None)
            factor = 2 * (g - 1) / g
        nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
        spans = len({r // PER_NODE for r in ranks}) > 1
        return factor * nbytes, spans

    def _wrap(self, name: str, original: Any) -> Any:
        def spy(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            sent, spans = self._sent(name, args, kwargs)
            kind = "across" if spans else "within"
            self.sent[kind] += sent
            self.calls[kind] += 1
            if spans and self.link_mb_s > 0:
                time.sleep(sent / (self.link_mb_s * 1e6) + self.latency_ms / 1e3)
            return result

        return spy

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for name in self.NAMES:
            if hasattr(dist, name):
                self._originals[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._originals[name]))

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self.sent = {"within": 0.0, "across": 0.0}
            self.calls = {"within": 0, "across": 0}
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._start)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        steps = max(len(self.times), 1)
        record = {
            "within_bytes_per_step": self.sent["within"] / steps,
            "across_bytes_per_step": self.sent["across"] / steps,
            "within_calls_per_step": self.calls["within"] / steps,
            "across_calls_per_step": self.calls["across"] / steps,
            "step_s": statistics.median(self.times) if self.times else float("nan"),
            "mesh_shape": list(trainer.strategy._sharding.mesh_shape),  # type: ignore[attr-defined]
            "ledger": trainer.strategy.comm_stats.summary(),  # type: ignore[attr-defined]
        }
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _machine(node: int, args: argparse.Namespace, mesh: str, link: float, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(node))
    gpu = args.accelerator == "gpu"
    if gpu:  # each "machine" sees its own 2 GPUs, as on two machines (NCCL needs a device per rank)
        os.environ["CUDA_VISIBLE_DEVICES"] = f"{PER_NODE * node},{PER_NODE * node + 1}"
    start = "spawn" if gpu else "fork"  # CUDA in the workers: a fresh interpreter each
    strategy = MGPUShardedStrategy(stage=3, mesh=mesh, start_method=start, log_comm_stats=False)  # type: ignore[arg-type]
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=PER_NODE, num_nodes=NODES, strategy=strategy,
        max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
        callbacks=[LinkSpy(out, link, args.latency_ms if link > 0 else 0.0, args.warmup)],
    )  # fmt: skip
    trainer.fit(MLP(args.layers, args.width), datamodule=Data(args.width, args.batch, args.warmup + args.steps))


def run(args: argparse.Namespace, mesh: str, link: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        port = find_free_network_port()
        mp.start_processes(_machine, nprocs=NODES, start_method="fork", args=(args, mesh, link, port, out))
        return json.loads(Path(out, "rank0.json").read_text())


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--link-mb-s", type=float, default=100.0, help="simulated link between machines, MB/s")
    parser.add_argument("--latency-ms", type=float, default=0.2, help="simulated latency per collective, ms")
    args = parser.parse_args(argv)
    if args.accelerator == "gpu" and torch.cuda.device_count() < NODES * PER_NODE:
        print(
            f"bench_hsdp: {NODES} 'machines' x {PER_NODE} GPUs need {NODES * PER_NODE} GPUs, this machine has "
            f"{torch.cuda.device_count()}: not measured (run it on a machine with 4 GPUs, or on 2 machines)."
        )
        return
    params = sum(p.numel() for p in MLP(args.layers, args.width).parameters())
    print(
        f"HSDP vs flat ZeRO-3 on {NODES} 'machines' x {PER_NODE} processes ({args.accelerator}), MLP "
        f"{args.layers}x{args.width} ({params:,} parameters, {4 * params / 1e6:.2f} MB of FP32 gradients), Adam, "
        f"batch {args.batch} per rank, median of {args.steps} steps after {args.warmup}; rank 0's bytes sent per step"
    )
    links = [("loopback", 0.0), (f"simulated {args.link_mb_s:g} MB/s + {args.latency_ms:g} ms", args.link_mb_s)]
    head = f"{'link':<32} {'runner':<6} {'mesh':<6} {'within machine':>15} {'across machines':>16} {'step ms':>9}"
    print(head)
    print("-" * len(head))
    ratios = []
    for link_name, link in links:
        results = {mesh: run(args, mesh, link) for mesh in ("flat", "hybrid")}
        for mesh, r in results.items():
            name = "flat" if mesh == "flat" else "hsdp"
            shape = "x".join(str(d) for d in r["mesh_shape"])
            print(
                f"{link_name:<32} {name:<6} {shape:<6} {r['within_bytes_per_step'] / 1e6:>12.2f} MB "
                f"{r['across_bytes_per_step'] / 1e6:>13.2f} MB {r['step_s'] * 1e3:>9.1f}"
                f"   calls {r['within_calls_per_step']:.1f} / {r['across_calls_per_step']:.1f}"
            )
        flat, hsdp = results["flat"], results["hybrid"]
        ratios.append((link_name, hsdp["across_bytes_per_step"] / flat["across_bytes_per_step"],
                       hsdp["step_s"] / flat["step_s"]))  # fmt: skip
        print(f"  ledger (hsdp): {hsdp['ledger']}")
    print()
    for link_name, across, step in ratios:
        print(f"hsdp / flat, {link_name}: bytes across machines {across:.2f}x, step time {step:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
