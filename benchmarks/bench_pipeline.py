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
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'schedule':<10} {'m':>3} {'bubble measured':>16} {'(P-1)/(m+P-1)':>14} {'bytes sent/step':>16}")
    for schedule in ("gpipe", "1f1b"):
        for m in (2, 4, 8):
            measured, stats = run(args, schedule, m)
            print(f"{schedule:<10} {m:>3} {measured:>16.3f} {stats.bubble_theory:>14.3f} {stats.bytes_sent:>16,}")


if __name__ == "__main__":
    main()
