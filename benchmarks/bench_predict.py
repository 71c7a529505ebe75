"""``trainer.predict`` on 2 fork-launched CPU ranks: what returning every prediction, in order, costs.

    python benchmarks/bench_predict.py                       # 20000 samples, outputs of 512 float32 per sample
    python benchmarks/bench_predict.py --samples 2000 --width 64 --repeats 1

Three runs of the same predict, interleaved ``--repeats`` times so that load on the machine hits all alike:

* ``gathered``: ``trainer.predict(...)`` under ``mgpu_ddp_fork``: the main process gets every prediction once, in
  dataset order (each rank's batches gathered to rank 0, cut into samples, ordered, batched again, sent as bytes);
* ``not returned``: the same with ``return_predictions=False`` (nothing kept, gathered or sent back);
* ``one process``: ``Trainer(devices=1)``, for scale.

It prints the median wall time of each and the ratio gathered / not returned, and the time of the reassembly alone
(``parts/predictions.assemble`` on the same outputs, one process). No target: the figure says what the default
costs, which ``return_predictions=False`` saves.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu  # noqa: F401  (registers the presets)
from lightning_mgpu.parts.predictions import assemble


class Head(pl.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(16, width)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])


def timed_predict(devices: int, strategy: str, data: TensorDataset, width: int, batch: int, **kwargs: Any) -> float:
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    start = time.perf_counter()
    out = trainer.predict(Head(width), DataLoader(data, batch_size=batch), **kwargs)
    took = time.perf_counter() - start
    if kwargs.get("return_predictions", True) is not False:
        assert out is not None and sum(len(b) for b in out) == len(data)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    data = TensorDataset(torch.randn(args.samples, 16, generator=torch.Generator().manual_seed(0)))
    times: dict[str, list[float]] = {"gathered": [], "not returned": [], "one process": []}
    for _ in range(args.repeats):
        times["gathered"].append(timed_predict(2, "mgpu_ddp_fork", data, args.width, args.batch))
        times["not returned"].append(
            timed_predict(2, "mgpu_ddp_fork", data, args.width, args.batch, return_predictions=False)
        )
        times["one process"].append(timed_predict(1, "auto", data, args.width, args.batch))
    median = {k: statistics.median(v) for k, v in times.items()}
    mbytes = args.samples * args.width * 4 / 2**20

    head = Head(args.width)
    ranks = []
    with torch.no_grad():
        for r in range(2):
            idx = list(range(r, args.samples, 2))
            ranks.append([(idx[s : s + args.batch], head.net(data.tensors[0][idx[s : s + args.batch]]))
                          for s in range(0, len(idx), args.batch)])  # fmt: skip
    start = time.perf_counter()
    assemble(ranks, args.batch)
    reassembly = time.perf_counter() - start

    print(f"{args.samples} samples x {args.width} float32 ({mbytes:.1f} MiB of predictions), batch {args.batch}, "
          f"2 fork ranks on CPU, median of {args.repeats}")  # fmt: skip
    for name, value in median.items():
        print(f"  {name:13s} {value:7.2f} s")
    print(f"  gathered / not returned: {median['gathered'] / median['not returned']:.2f}x")
    print(f"  reassembly alone (one process): {reassembly * 1000:.0f} ms")


if __name__ == "__main__":
    main()
