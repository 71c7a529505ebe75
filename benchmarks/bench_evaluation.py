"""The cost per step of exact evaluation and of the uneven-input checks, measured side by side in one run.

    python benchmarks/bench_evaluation.py                     # 2 CPU processes (gloo), ~0.9M-parameter MLP
    python benchmarks/bench_evaluation.py --rounds 5 --batches 40

Each pair is the same run (model, data, seed, fork launch) with the guarantee on and off; runners alternate
round by round and the median time from one batch's start to the next on rank 0 is reported (the fetch, where
the per-step agreement runs, included), after warm-up batches.

* ``evaluation, mgpu_ddp`` / ``evaluation, mgpu_zero3``: the validation loop of a fit (the ZeRO-3 model is sharded:
  every forward gathers its parameters) over a set that divides evenly, so that both samplers run the same
  batches: ``exact_evaluation=True`` (the unpadded sampler with equal batch counts, one all-gather of the planned
  counts per loop under the sharded stages) against ``False`` (Lightning's ``DistributedSampler``).
* ``evaluation, mgpu_zero3, uneven counts``: a sampler of the user's giving rank 0 one batch more than rank 1.
  Without the guarantee this loop never returns, so its ratio is against the even ``mgpu_zero3`` run with the
  guarantee on: the parameters are gathered once for the loop instead of in every forward.
* ``training, iterable dataset``: ``check_uneven_inputs=True`` (one all-reduce of one number per step, agreed at
  each fetch) against ``False``, on an ``IterableDataset`` that yields as many batches on each rank.
* ``training, sized loader``: the same for a map-style loader (one all-gather of the batch counts per epoch).
* the checks' own collectives timed alone (``--calls`` calls each on 2 processes, outside a Trainer): what they add
  to a step, free of the step's noise.

Timings are never asserted in tests: these machines are shared.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset, Subset, TensorDataset

from lightning_mgpu import MGPUDDPStrategy, MGPUShardedStrategy

WORLD = 2


class MLP(pl.LightningModule):
    def __init__(self, width: int, hidden: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        dims = [width] + [hidden] * layers
        body: list[nn.Module] = []
        for a, b in zip(dims, dims[1:]):
            body += [nn.Sequential(nn.Linear(a, b), nn.GELU())]
        self.body = nn.Sequential(*body)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def dataset(n: int, width: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, width, generator=g), torch.randint(0, 10, (n,), generator=g))


class Stream(IterableDataset):
    """``batches`` batches per rank (as many on each), sharded by rank."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __iter__(self) -> Iterator[Any]:
        rank = torch.distributed.get_rank()
        for i in range(rank, len(self.data), WORLD):
            yield self.data[i]


class Timer(Callback):
    """The time from one batch's start to the next one's: the fetch (where the per-step agreement runs), the step
    and the hooks."""

    def __init__(self, out: Path, warmup: int, stage: str) -> None:
        self.out, self.warmup, self.stage = out, warmup, stage
        self.times: list[float] = []
        self._last: Optional[float] = None
        self._seen = 0

    def _tick(self) -> None:
        now = time.perf_counter()
        self._seen += 1
        if self._last is not None and self._seen > self.warmup + 1:
            self.times.append(now - self._last)
        self._last = now

    def on_train_batch_start(self, *args: Any) -> None:
        if self.stage == "train":
            self._tick()

    def on_validation_batch_start(self, *args: Any) -> None:
        if self.stage == "val":
            self._tick()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            torch.save(self.times, self.out)


def run(
    make_strategy: Callable[[], Any],
    data: Callable[[], pl.LightningDataModule],
    stage: str,
    args: Any,
    out: Path,
    sampler: bool = True,
) -> list[float]:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=make_strategy(),
        max_epochs=1,
        limit_train_batches=1 if stage == "val" else None,
        num_sanity_val_steps=0,
        limit_val_batches=0 if stage == "train" else None,
        use_distributed_sampler=sampler,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Timer(out, args.warmup, stage)],
    )
    trainer.fit(MLP(args.width, args.hidden, args.layers), datamodule=data())
    return torch.load(out)


class Data(pl.LightningDataModule):
    def __init__(self, args: Any, train: str = "sized", val: Optional[str] = None) -> None:
        super().__init__()
        self.args, self.train, self.val = args, train, val
        self.data = dataset(WORLD * args.batch * args.batches, args.width)

    def train_dataloader(self) -> DataLoader:
        if self.train == "iterable":
            return DataLoader(Stream(self.data), batch_size=self.args.batch)
        return DataLoader(self.data, batch_size=self.args.batch)

    def val_dataloader(self) -> DataLoader:
        if self.val == "uneven":  # rank 0: one batch more than rank 1 (a sampler of the user's)
            b, k = self.args.batch, self.args.batches
            rank = torch.distributed.get_rank()
            part = range(0, (k + 1) * b) if rank == 0 else range((k + 1) * b, 2 * k * b)
            return DataLoader(Subset(self.data, part), batch_size=b)
        return DataLoader(self.data, batch_size=self.args.batch)


def _collective_worker(rank: int, port: int, calls: int, out: str) -> None:
    import os

    import torch.distributed as dist

    from lightning_mgpu import comm
    from lightning_mgpu.parts.uneven_inputs import agree_on_batches

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        timings = {}
        for name, call in (
            ("agreement (per step, iterable datasets)", lambda i: agree_on_batches(True, i)),
            ("planned-count all-gather (per epoch / per evaluation loop)", lambda i: comm.all_gather_object(float(i))),
        ):
            for i in range(calls // 10):  # warm-up
                call(i)
            samples = []
            for i in range(calls):
                start = time.perf_counter()
                call(i)
                samples.append(time.perf_counter() - start)
            timings[name] = statistics.median(samples)
        if rank == 0:
            torch.save(timings, out)
    finally:
        dist.destroy_process_group()


def collective_costs(calls: int, out: Path) -> dict[str, float]:
    """The median time of the checks' own collectives on 2 processes (gloo), outside any Trainer."""
    import torch.multiprocessing as mp
    from lightning_fabric.plugins.environments.lightning import find_free_network_port

    mp.start_processes(
        _collective_worker, nprocs=WORLD, start_method="fork", args=(find_free_network_port(), calls, str(out))
    )
    return torch.load(out)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=24, help="batches per rank and loop")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="loader batch per rank")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--calls", type=int, default=2000, help="timed calls of each check's collective")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    def ddp(**kw: Any) -> Callable[[], Any]:
        return lambda: MGPUDDPStrategy(start_method="fork", **kw)

    def zero3(**kw: Any) -> Callable[[], Any]:
        return lambda: MGPUShardedStrategy(stage=3, start_method="fork", **kw)

    runners: dict[str, tuple[Callable[[], Any], Callable[[], Any], str, bool]] = {
        "evaluation, mgpu_ddp: on": (ddp(), lambda: Data(args), "val", True),
        "evaluation, mgpu_ddp: off": (ddp(exact_evaluation=False), lambda: Data(args), "val", True),
        "evaluation, mgpu_zero3: on": (zero3(), lambda: Data(args), "val", True),
        "evaluation, mgpu_zero3: off": (zero3(exact_evaluation=False), lambda: Data(args), "val", True),
        "evaluation, mgpu_zero3, uneven counts: on": (zero3(), lambda: Data(args, val="uneven"), "val", False),
        "training, iterable dataset: on": (ddp(), lambda: Data(args, train="iterable"), "train", True),
        "training, iterable dataset: off": (
            ddp(check_uneven_inputs=False),
            lambda: Data(args, train="iterable"),
            "train",
            True,
        ),
        "training, sized loader: on": (ddp(), lambda: Data(args), "train", True),
        "training, sized loader: off": (ddp(check_uneven_inputs=False), lambda: Data(args), "train", True),
    }
    times: dict[str, list[float]] = {name: [] for name in runners}
    per_round: dict[str, list[float]] = {name: [] for name in runners}  # each round's median
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for i, (name, (strategy, data, stage, sampler)) in enumerate(runners.items()):
                measured = run(strategy, data, stage, args, Path(tmp) / f"{round_}-{i}.pt", sampler)
                times[name] += measured
                per_round[name].append(statistics.median(measured))
        costs = collective_costs(args.calls, Path(tmp) / "collectives.pt")
    median = {name: statistics.median(t) for name, t in times.items()}

    def round_ratio(on: str, off: str) -> float:
        """The median over rounds of the ratio within a round (neighbouring runs share the machine's load)."""
        return statistics.median(a / b for a, b in zip(per_round[on], per_round[off]))

    params = sum(p.numel() for p in MLP(args.width, args.hidden, args.layers).parameters())
    print(
        f"MLP {params:,} parameters, batch {args.batch} per rank x {WORLD} ranks, {args.batches} batches per loop, "
        f"{args.rounds} rounds (first {args.warmup} batches of each loop not timed)\n"
    )
    print("| guarantee | ms/batch on | ms/batch without | ratio | ratio within a round (median) |")
    print("|---|---|---|---|---|")
    for pair in (
        "evaluation, mgpu_ddp",
        "evaluation, mgpu_zero3",
        "training, iterable dataset",
        "training, sized loader",
    ):
        on, off = median[f"{pair}: on"], median[f"{pair}: off"]
        ratio = round_ratio(f"{pair}: on", f"{pair}: off")
        print(f"| {pair} | {on * 1e3:.2f} | {off * 1e3:.2f} | {on / off:.3f} | {ratio:.3f} |")
    uneven_name, even_name = "evaluation, mgpu_zero3, uneven counts: on", "evaluation, mgpu_zero3: on"
    uneven, even = median[uneven_name], median[even_name]
    print(
        f"| evaluation, mgpu_zero3, uneven counts (gathered once; without it: hangs) | {uneven * 1e3:.2f} | "
        f"{even * 1e3:.2f} (even counts, gathered per forward) | {uneven / even:.3f} | "
        f"{round_ratio(uneven_name, even_name):.3f} |"
    )
    print(
        "\n| the checks' own collective (2 processes, gloo) | median µs per call "
        "| share of a training step (iterable, off) |"
    )
    print("|---|---|---|")
    step = median["training, iterable dataset: off"]
    for name, seconds in costs.items():
        print(f"| {name} | {seconds * 1e6:.0f} | {seconds / step:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
