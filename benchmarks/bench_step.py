"""Optimizer-step time of ZeRO stage 3 (FSDP2) three ways, side by side in one run, at accumulation k = 1 and 4.

    python benchmarks/bench_step.py                                # 2 CPU processes (gloo), ~3.0M parameters
    python benchmarks/bench_step.py --rounds 5 --steps 10 --layers 6 --width 768 --out benchmarks/results
    python benchmarks/bench_step.py --compare /path/to/another/checkout   # mgpu_zero3 before/after, one run

Runners (the same MLP of ``--layers`` blocks ``Linear(width, width) + GELU`` and a head, float32, Adam, the same
data, every rank seeing its own half of each global batch):

* ``mgpu_zero3``: the pack's ``MGPUShardedStrategy(stage=3)`` through ``Trainer.fit``,
  ``accumulate_grad_batches=k``;
* ``raw FSDP2``: a plain torch loop, ``fully_shard`` on each block and on the root, no Lightning; with k > 1 the
  micro-batches that do not step skip the gradient reduce-scatter (``set_requires_gradient_sync(False)``);
* ``Lightning ModelParallel``: Lightning's ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)``
  with a ``configure_model`` that applies ``fully_shard`` to each block and the root on
  ``self.device_mesh["data_parallel"]``, as Lightning's documentation shows; ``accumulate_grad_batches=k``.

Step time, measured the same way for every runner: rank 0's wall time between the ends of two consecutive optimizer
steps (a callback at ``on_train_batch_end`` when the global step advanced; the loop's own clock for raw torch),
after ``--warmup`` optimizer steps; a run's figure is the median over its ``--steps`` timed steps. Each run is its
own subprocess (its own interpreter, then its own 2 ranks), and the rounds visit every runner and k in turn, so
the machine's drifting load falls on all of them alike. Printed per runner and k: the median over the rounds and
the best round, in ms, and mgpu_zero3's step time as a ratio to each other runner's (below 1: mgpu_zero3 is faster).

``--package PATH`` runs the mgpu runner against the checkout of the pack at PATH (first on ``sys.path`` and on the
workers' ``PYTHONPATH``; default: the checkout this script lives in). ``--compare PATH`` adds a second mgpu runner,
``mgpu_zero3 @ PATH``, from that checkout, in the same alternating rounds: before and after in one table. The
machines are shared: timings are never asserted in tests. Not measured on a GPU yet (the same runners on CUDA need
NCCL and one device per rank; this script runs them on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
CHECKOUT = HERE.parent.parent
WORLD = 2
RAW, LIGHTNING, MGPU = "raw FSDP2", "Lightning ModelParallel", "mgpu_zero3"


def _model(layers: int, width: int) -> Any:
    import pytorch_lightning as pl
    import torch
    from torch import nn
    from torch.nn import functional as F

    class MLP(pl.LightningModule):
        def __init__(self, shard_in_configure_model: bool = False) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)])
            self.head = nn.Linear(width, width)
            self.shard_in_configure_model = shard_in_configure_model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(x))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def configure_model(self) -> None:
            # Lightning's ModelParallelStrategy: the user shards in configure_model (the docs' recipe); the pack's
            # strategy shards the blocks itself, so the other runners leave this hook a no-op
            if not self.shard_in_configure_model:
                return
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self, mesh=mesh)

    return MLP


def _data(args: argparse.Namespace) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1)
    n = args.batch * WORLD * args.k * (args.warmup + args.steps + 1)
    return TensorDataset(torch.randn(n, args.width, generator=g), torch.randn(n, args.width, generator=g))


def _loader(dataset: Any, batch: int, rank: int) -> Any:
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(dataset, num_replicas=WORLD, rank=rank, shuffle=False)
    return DataLoader(dataset, batch_size=batch, sampler=sampler)


def _write(args: argparse.Namespace, stamps: list[float]) -> None:
    times = [b - a for a, b in zip(stamps, stamps[1:])][args.warmup :]
    pack = sys.modules.get("lightning_mgpu")
    Path(args.result).write_text(json.dumps({"times": times, "package": getattr(pack, "__file__", None)}))


def _raw_rank(rank: int, port: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn import functional as F

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    model = _model(args.layers, args.width)()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    stamps: list[float] = []
    for i, (x, y) in enumerate(_loader(_data(args), args.batch, rank)):
        last = (i + 1) % args.k == 0
        if args.k > 1:
            model.set_requires_gradient_sync(last)  # type: ignore[operator]
        (F.mse_loss(model(x), y) / args.k).backward()
        if last:
            opt.step()
            opt.zero_grad(set_to_none=True)
            stamps.append(time.perf_counter())
            if len(stamps) == args.warmup + args.steps + 1:
                break
    if rank == 0:
        _write(args, stamps)
    dist.barrier()
    dist.destroy_process_group()


def _run_raw(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp
    from lightning_fabric.plugins.environments.lightning import find_free_network_port

    mp.start_processes(_raw_rank, nprocs=WORLD, start_method="fork", args=(find_free_network_port(), args))


def _run_lightning(args: argparse.Namespace) -> None:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback

    class StepClock(Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.step = 0

        def on_train_batch_end(self, trainer: pl.Trainer, *rest: Any) -> None:
            if trainer.global_step > self.step:  # an optimizer step happened in this batch
                self.step = trainer.global_step
                self.stamps.append(time.perf_counter())

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.global_rank == 0:
                _write(args, self.stamps)

    if args.worker == LIGHTNING:
        from pytorch_lightning.strategies import ModelParallelStrategy

        strategy: Any = ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    else:
        from lightning_mgpu import MGPUShardedStrategy

        strategy = MGPUShardedStrategy(stage=3, start_method="fork")
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=args.warmup + args.steps + 1,
        accumulate_grad_batches=args.k, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[StepClock()],
    )  # fmt: skip

    class Data(pl.LightningDataModule):
        def train_dataloader(self) -> Any:
            return _loader(_data(args), args.batch, trainer.global_rank)

    trainer.fit(_model(args.layers, args.width)(shard_in_configure_model=args.worker == LIGHTNING), datamodule=Data())


def _spawn(runner: str, package: Path, k: int, args: argparse.Namespace, result: Path) -> list[float]:
    """One run in its own interpreter: the mgpu runner sees only ``package`` (first on ``PYTHONPATH``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(package)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // WORLD)))  # the same threads for all
    command = [sys.executable, str(HERE), "--worker", runner, "--k", str(k), "--result", str(result)]
    command += ["--package", str(package)]
    for flag in ("layers", "width", "batch", "steps", "warmup"):
        command += [f"--{flag}", str(getattr(args, flag))]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0 or not result.exists():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
        raise RuntimeError(f"{runner} (k={k}, package {package}) failed with exit code {done.returncode}:\n{tail}")
    record = json.loads(result.read_text())
    if runner == MGPU and not Path(str(record["package"])).resolve().is_relative_to(package):
        raise RuntimeError(f"{runner} imported lightning_mgpu from {record['package']}, not from {package}")
    return record["times"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--batch", type=int, default=16, help="per rank and micro-batch")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4], help="accumulation micro-batches per step")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each visiting every runner and k in turn")
    parser.add_argument("--package", type=Path, default=CHECKOUT, help="checkout of the pack for the mgpu runner")
    parser.add_argument("--compare", type=Path, default=None, help="another checkout: its mgpu_zero3 beside ours")
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSON result")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run before it counts as hung")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.package = args.package.resolve()
    if args.worker is not None:  # one run, started by _spawn (ModelParallelStrategy's launch re-runs it per rank)
        sys.path.insert(0, str(args.package))
        _run_raw(args) if args.worker == RAW else _run_lightning(args)
        return 0
    for path in [args.package] + ([args.compare] if args.compare else []):
        if not (path / "lightning_mgpu" / "__init__.py").is_file():
            parser.error(f"{path} holds no lightning_mgpu/__init__.py: pass the root of a checkout of the pack")

    mgpu = [(MGPU, MGPU, args.package)]
    if args.compare is not None:
        args.compare = args.compare.resolve()
        mgpu = [
            (f"{MGPU} @ {args.package.name}", MGPU, args.package),
            (f"{MGPU} @ {args.compare.name}", MGPU, args.compare),
        ]
        if args.package.name == args.compare.name:
            mgpu = [(f"{MGPU} @ {p}", MGPU, p) for _, _, p in mgpu]
    runners = [*mgpu, (RAW, RAW, args.package), (LIGHTNING, LIGHTNING, args.package)]
    n_params = (args.layers + 1) * (args.width * args.width + args.width)
    print(
        f"optimizer-step time, ZeRO-3 (FSDP2), {WORLD} CPU processes (gloo), {os.cpu_count()} cores; MLP "
        f"{args.layers + 1} x Linear({args.width}, {args.width}) ({n_params / 1e6:.2f}M parameters), Adam, fp32, "
        f"batch {args.batch} per rank and micro-batch; median of {args.steps} steps after {args.warmup}, rank 0, "
        f"{args.rounds} rounds; mgpu package: {args.package}"
        + (f", compared with {args.compare}" if args.compare else "")
    )
    medians: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            line = []
            for k in args.ks:
                for label, runner, package in runners:
                    result = Path(tmp, f"r{r}-k{k}-{len(medians)}.json")
                    median = statistics.median(_spawn(runner, package, k, args, result))
                    medians.setdefault((label, k), []).append(median)
                    line.append(f"{label} k={k} {median * 1e3:.1f}")
            print(f"round {r + 1}/{args.rounds} (ms): " + ", ".join(line), flush=True)
    rows = []
    head = f"{'runner':<34} {'k':>2} {'median ms':>10} {'best ms':>8}   mgpu_zero3 / this (median, best)"
    print("\n" + head)
    print("-" * len(head))
    for k in args.ks:
        ours = mgpu[0][0]
        for label, _, _ in runners:
            times = medians[(label, k)]
            row = {"runner": label, "k": k, "median_ms": 1e3 * statistics.median(times), "best_ms": 1e3 * min(times)}
            row["rounds_ms"] = [1e3 * t for t in times]
            mine = medians[(ours, k)]
            row["ratio_median"] = statistics.median(mine) / statistics.median(times)
            row["ratio_best"] = min(mine) / min(times)
            rows.append(row)
            ratio = "" if label == ours else f"{row['ratio_median']:.2f}x, {row['ratio_best']:.2f}x"
            print(f"{label:<34} {k:>2} {row['median_ms']:>10.1f} {row['best_ms']:>8.1f}   {ratio}".rstrip())
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = args.out / f"step-cpu-{time.strftime('%Y-%m-%d')}.json"
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("out", "result")}
        name.write_text(
            json.dumps({"device": f"CPU, {WORLD} processes (gloo)", "config": config, "rows": rows}, indent=1)
        )
        print(f"saved {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
