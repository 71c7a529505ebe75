"""Exact mid-epoch resume of stateful loaders: what it costs per step, against the same run without it.

    python benchmarks/bench_loader_resume.py            # 2 CPU ranks (gloo), fork launch
    python benchmarks/bench_loader_resume.py --steps 256 --every 16

For each loader (``stateful``: torchdata ``StatefulDataLoader(shuffle=True)`` with Lightning's automatic sampler,
which gets the pack's resumable sampler; ``stateful-own``: the same with a ``DistributedSampler`` of the user's,
whose state is kept per rank; ``streaming``: litdata ``StreamingDataLoader`` over a folder written by
``litdata.optimize``) two fits of ``mgpu_ddp`` on 2 ranks, side by side: ``with`` the mid-epoch resume part, and
``without`` it (the strategy's resume part replaced by one that does nothing: the loader as Lightning builds it,
Lightning's own loader state in checkpoints). Both save a checkpoint every ``--every`` steps
(``ModelCheckpoint(every_n_train_steps=...)``), so the per-rank loader states gathered at each save are counted.

Printed per loader (``--repeats`` pairs, run alternately, so that load on the machine hits both alike; the
smallest over the pairs, the least disturbed): the median step time (rank 0, batch start to the next batch
start, data loading included) of the steps without a save and of the steps with one, and the ratios
with/without. ``--clock cpu`` counts rank 0's CPU time instead of wall time (a shared machine disturbs it far
less). The model is tiny on purpose (a 2-layer MLP on 32 features): the loader's share of a step is as large as
it gets.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from lightning_mgpu import MGPUDDPStrategy
from lightning_mgpu.parts.resume import MidEpochResume

FEATURES = 32
# wall time, or the CPU time of rank 0's process (all its threads): far less disturbed by other work on the machine
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, FEATURES, generator=g), torch.randn(n, 1, generator=g))


_ROWS: dict[int, TensorDataset] = {}


def _sample(i: int, n: int) -> dict[str, Any]:
    if n not in _ROWS:
        _ROWS[n] = _data(n)
    x, y = _ROWS[n][i]
    return {"x": x, "y": y}


class Data(pl.LightningDataModule):
    def __init__(self, kind: str, n: int, batch_size: int, folder: Path) -> None:
        super().__init__()
        self.kind, self.n, self.batch_size, self.folder = kind, n, batch_size, folder

    def train_dataloader(self) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        if self.kind == "streaming":
            from litdata import StreamingDataLoader, StreamingDataset

            dataset = StreamingDataset(str(self.folder), shuffle=True, seed=0, drop_last=True)
            return StreamingDataLoader(dataset, batch_size=self.batch_size)
        data = _data(self.n)
        if self.kind == "stateful":
            return StatefulDataLoader(data, batch_size=self.batch_size, shuffle=True)
        return StatefulDataLoader(data, batch_size=self.batch_size, sampler=DistributedSampler(data, seed=0))


class _NoResume(MidEpochResume):
    """The part switched off: the loader as Lightning built it, checkpoints as Lightning writes them."""

    def process_dataloader(self, dataloader: object, trainer: Any) -> object:
        self._injected = False
        return dataloader

    def before_save(self, checkpoint: Any, trainer: Any = None) -> None:
        pass

    def after_load(self, checkpoint: Any, world_size: int = 1, rank: int = 0) -> None:
        pass

    def batch_started(self, trainer: Any) -> None:
        pass


class WithoutLoaderResume(MGPUDDPStrategy):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._resume = _NoResume()


class Timer(Callback):
    """Rank 0: the time from each batch start to the next, and which steps ended with a save."""

    def __init__(self, out: Path, every: int, clock: Any) -> None:
        self.out, self.every, self.clock = out, every, clock
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.starts.append(self.clock())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.starts.append(self.clock())
        if trainer.global_rank == 0:
            times = [b - a for a, b in zip(self.starts, self.starts[1:])]
            torch.save(times, self.out)


def run(kind: str, with_part: bool, args: argparse.Namespace, tmp: Path) -> tuple[float, float]:
    out = tmp / f"{kind}-{with_part}.pt"
    strategy = (MGPUDDPStrategy if with_part else WithoutLoaderResume)(start_method="fork")
    ckpt = ModelCheckpoint(dirpath=tmp / f"ckpt-{kind}-{with_part}", every_n_train_steps=args.every, save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Timer(out, args.every, CLOCKS[args.clock]), ckpt],
    )  # fmt: skip
    trainer.fit(MLP(), datamodule=Data(kind, args.samples, args.batch_size, tmp / "streaming"))
    times = torch.load(out)[args.warmup :]
    first = args.warmup
    # step i (0-based, counted from the fit's start) ends with a save when (i + 1) % every == 0
    saving = [t for i, t in enumerate(times, start=first) if (i + 1) % args.every == 0]
    plain = [t for i, t in enumerate(times, start=first) if (i + 1) % args.every != 0]
    return statistics.median(plain), statistics.median(saving)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--every", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--kinds", nargs="+", default=["stateful", "stateful-own", "streaming"])
    parser.add_argument("--repeats", type=int, default=5, help="with/without pairs, run alternately")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = parser.parse_args()
    args.samples = args.steps * args.batch_size * 2  # one epoch: the resume part's per-epoch work is counted once
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if "streaming" in args.kinds:
            from litdata import optimize

            optimize(
                fn=functools.partial(_sample, n=args.samples),
                inputs=list(range(args.samples)),
                output_dir=str(tmp / "streaming"),
                chunk_bytes="1MB",
                num_workers=1,
            )
        rows = []
        for kind in args.kinds:
            pairs = [(run(kind, False, args, tmp), run(kind, True, args, tmp)) for _ in range(args.repeats)]
            without = tuple(min(p[0][i] for p in pairs) for i in (0, 1))
            with_ = tuple(min(p[1][i] for p in pairs) for i in (0, 1))
            rows.append((kind, with_, without))
    header = ("step with", "without", "ratio", "save step with", "without", "ratio")
    print(f"\n{'loader':<14}" + "".join(f"{h:>{w}}" for h, w in zip(header, (12, 12, 8, 16, 12, 8))))
    for kind, (w, ws), (o, os_) in rows:
        print(
            f"{kind:<14}{w * 1e3:>10.2f}ms{o * 1e3:>10.2f}ms{w / o:>8.3f}{ws * 1e3:>14.2f}ms{os_ * 1e3:>10.2f}ms"
            f"{ws / os_:>8.3f}"
        )


if __name__ == "__main__":
    main()
