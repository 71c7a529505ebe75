"""Tensor x data parallelism against ZeRO-3 and against Lightning's ModelParallelStrategy on 4 CPU processes,
measured side by side in one run.

    python benchmarks/bench_tensor_parallel.py                       # gloo, 4 processes, a ~3M-parameter Llama-style
    python benchmarks/bench_tensor_parallel.py --width 512 --layers 6 --steps 10 --out results/

Three runners train the same Llama-style transformer (grouped-query attention, SwiGLU MLP, RMSNorm) with AdamW on
the same global batch, one micro-batch per step, each on 4 processes launched as a cluster launches them
(``LOCAL_RANK`` set in each):

* ``mgpu tensor 2 x data 2``: ``MGPUShardedStrategy(stage=3, tensor_parallel_size=2)``, the auto plan (attention
  and MLP split, Megatron's pairing), FSDP2 over the 2 data ranks;
* ``mgpu_zero3 (data 4)``: ``MGPUShardedStrategy(stage=3)``, FSDP2 over 4 ranks, no tensor parallelism;
* ``Lightning ModelParallelStrategy 2 x 2``: the same split written by hand in ``configure_model``
  (``parallelize_module`` then ``fully_shard`` on ``self.device_mesh``), as Lightning's documentation shows it.

Reported per optimizer step on rank 0: the median wall time after warm-up, and the bytes handed to collectives,
counted by a ``TorchDispatchMode`` around the training steps that sees every collective op (FSDP2's all-gathers and
reduce-scatters, DTensor's all-reduces of tensor parallelism), independently of the pack's ledger: for each call, the
largest tensor it takes (the unsharded buffer). The two tensor-parallel runners should agree (the same plan), and
tensor parallelism moves activations where ZeRO-3 moves weights: which costs less depends on width, sequence length
and batch. On CPU the step time mostly measures gloo and the 2 shared cores, not the links of a GPU machine.

    python benchmarks/bench_tensor_parallel.py --rounds 5 --compare /path/to/another/checkout

``--rounds N`` runs every runner N times, alternating, each run its own interpreter, and prints the median and best
over the rounds; ``--compare PATH`` adds ``mgpu tensor 2 x data 2 @ PATH``, the same runner with the pack of another
checkout (its ``PYTHONPATH``), in every round: before and after in one table, with the median of the rounds' ratios
(paired) beside the ratio of the medians.

GPU: not measured on a GPU yet. ``--accelerator gpu`` runs the same on 4 GPUs (NCCL); on a GPU machine, compare the
step times there, with the tensor group inside one machine's NVLink domain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import pytorch_lightning as pl
import torch
import torch.multiprocessing as mp
from lightning_fabric.plugins.environments.lightning import find_free_network_port
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader, TensorDataset

WORLD = 4
RUNNERS = ("mgpu tensor 2 x data 2", "mgpu_zero3 (data 4)", "Lightning ModelParallelStrategy 2 x 2")
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")


class CollectiveBytes(TorchDispatchMode):
    """Counts each collective op's largest tensor argument while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if func.namespace in ("c10d", "_c10d_functional") and not any(n in name for n in _NOT_COLLECTIVES):
            sizes = [t.numel() * t.element_size() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            self.calls += 1
            self.bytes += max(sizes, default=0)
        return func(*args, **(kwargs or {}))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = heads, heads // 2, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim // 2, bias=False)
        self.wv = nn.Linear(dim, dim // 2, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2).repeat_interleave(2, dim=1)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2).repeat_interleave(2, dim=1)
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, 3 * dim, bias=False)
        self.w2 = nn.Linear(3 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention, self.feed_forward = Attention(dim, heads), FeedForward(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(pl.LightningModule):
    def __init__(self, args: argparse.Namespace, hand_plan: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(args.vocab, args.width)
        self.layers = nn.ModuleList(Block(args.width, args.heads) for _ in range(args.layers))
        self.norm, self.output = nn.RMSNorm(args.width), nn.Linear(args.width, args.vocab, bias=False)
        self.hand_plan = hand_plan

    def configure_model(self) -> None:
        if not self.hand_plan:
            return
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        for block in self.layers:
            plan = {f"attention.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")}
            plan |= {"attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()}
            plan |= {"feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel()}
            block.attention.n_heads //= tp.size()
            block.attention.n_kv_heads //= tp.size()
            parallelize_module(block, tp, plan)
        for block in self.layers:
            fully_shard(block, mesh=dp)
        fully_shard(self, mesh=dp)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens = batch[0]
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Clock(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.stamps, self.counter = out, [], CollectiveBytes()

    def on_train_batch_start(self, trainer: pl.Trainer, *rest: Any) -> None:
        self.counter.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, *rest: Any) -> None:
        self.counter.__exit__(None, None, None)
        self.stamps.append(time.perf_counter())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            record = {"stamps": self.stamps, "calls": self.counter.calls, "bytes": self.counter.bytes}
            self.out.write_text(json.dumps(record))


def _rank(rank: int, port: int, job: Callable[[], None]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", LOCAL_RANK=str(rank))
    os.environ["WORLD_SIZE"] = str(WORLD)
    torch.set_num_threads(1)
    job()


def run(runner: str, args: argparse.Namespace) -> dict[str, float]:
    from pytorch_lightning.strategies import ModelParallelStrategy

    from lightning_mgpu import MGPUShardedStrategy

    data_ranks = WORLD if runner == RUNNERS[1] else WORLD // 2
    tokens = torch.randint(args.vocab, (args.batch * WORLD * (args.steps + args.warmup), args.seq + 1))
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rank0.json"

        def job() -> None:
            if runner == RUNNERS[0]:
                strategy: Any = MGPUShardedStrategy(stage=3, tensor_parallel_size=2, wrap_modules=[Block])
            elif runner == RUNNERS[1]:
                strategy = MGPUShardedStrategy(stage=3, wrap_modules=[Block])
            else:
                strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
            trainer = pl.Trainer(
                accelerator=args.accelerator, devices=WORLD, strategy=strategy, max_steps=args.steps + args.warmup,
                logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                callbacks=[Clock(out)],
            )  # fmt: skip
            # the same global batch: batch x 4 samples, split over the data ranks
            loader = DataLoader(TensorDataset(tokens), batch_size=args.batch * WORLD // data_ranks)
            trainer.fit(Llama(args, hand_plan=runner == RUNNERS[2]), loader)

        mp.start_processes(_rank, nprocs=WORLD, start_method="fork", args=(find_free_network_port(), job))
        record = json.loads(out.read_text())
    stamps = record["stamps"]
    steps = len(stamps)
    times = [b - a for a, b in zip(stamps[args.warmup :], stamps[args.warmup + 1 :])]
    return {
        "step_s": statistics.median(times),
        "bytes_per_step": record["bytes"] / steps,
        "collectives_per_step": record["calls"] / steps,
    }


def run_alone(runner: str, args: argparse.Namespace, package: Path) -> dict[str, float]:
    """``runner`` in a fresh interpreter, with the pack of the checkout at ``package`` first on its path."""
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--one", runner, "--result", str(result)]
        for name in ("width", "heads", "layers", "vocab", "seq", "batch", "steps", "warmup", "accelerator"):
            command += [f"--{name}", str(getattr(args, name))]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{runner} @ {package} failed:\n{done.stderr[-3000:]}")
        return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="samples per rank of the 4 (global batch: 4 x this)")
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps after --warmup")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every runner, alternating")
    parser.add_argument("--compare", type=Path, default=None, help="another checkout: its tensor runner beside ours")
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSON result")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:  # one run, in this interpreter, for --rounds / --compare
        args.result.write_text(json.dumps(run(args.one, args)))
        return
    here = Path(__file__).resolve().parents[1]
    runners: list[tuple[str, str, Path]] = [(r, r, here) for r in RUNNERS]
    if args.compare is not None:
        args.compare = args.compare.resolve()
        runners.insert(1, (f"{RUNNERS[0]} @ {args.compare.name}", RUNNERS[0], args.compare))
    rounds: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in runners}
    alone = args.rounds > 1 or args.compare is not None  # each run in its own interpreter
    for r in range(args.rounds):
        for label, runner, package in runners:
            rounds[label].append(run_alone(runner, args, package) if alone else run(runner, args))
        if args.rounds > 1:
            print(
                f"round {r + 1}/{args.rounds} (s/step): "
                + ", ".join(f"{k} {v[-1]['step_s']:.3f}" for k, v in rounds.items())
            )
    results = {
        label: {
            "step_s": statistics.median(x["step_s"] for x in runs),
            "best_step_s": min(x["step_s"] for x in runs),
            "bytes_per_step": runs[-1]["bytes_per_step"],
            "collectives_per_step": runs[-1]["collectives_per_step"],
            "rounds_step_s": [x["step_s"] for x in runs],
        }
        for label, runs in rounds.items()
    }
    base = results[RUNNERS[1]]
    print(
        f"{'runner':48s} {'step (s)':>9s} {'best (s)':>9s} {'MB/step':>9s} {'calls/step':>10s} {'time vs zero3':>13s}"
    )
    for runner, r in results.items():
        mb = r["bytes_per_step"] / 2**20
        ratio = r["step_s"] / base["step_s"]
        print(
            f"{runner:48s} {r['step_s']:9.3f} {r['best_step_s']:9.3f} {mb:9.2f} {r['collectives_per_step']:10.1f} "
            f"{ratio:13.2f}"
        )
    if args.compare is not None:
        ours, other = rounds[RUNNERS[0]], rounds[runners[1][0]]
        paired = statistics.median(a["step_s"] / b["step_s"] for a, b in zip(ours, other))
        median = results[RUNNERS[0]]["step_s"] / results[runners[1][0]]["step_s"]
        print(f"{RUNNERS[0]}: this checkout / {args.compare.name}: median {median:.2f}x, paired {paired:.2f}x")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        record = {"args": vars(args) | {"out": str(args.out), "compare": str(args.compare)}, "results": results}
        (args.out / "tensor_parallel.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
