"""Bytes per step, step time and loss: mgpu_ddp against local SGD and DiLoCo at H = 8, 32, 128, in one run.

    python benchmarks/bench_local_sgd.py                    # 2 CPU processes (gloo), ~3 minutes on 2 cores
    python benchmarks/bench_local_sgd.py --plot loss_vs_bytes.png

Every run trains the sample transformer (:class:`lightning_mgpu.examples.DigitsTransformer`, width 32, 2 encoder
layers, AdamW 3e-3, BatchNorm stem) from the same initial weights on the same data order for the same number of
optimizer steps (so the same number of tokens: 64 pixel tokens per image), a multiple of every H so that each run
ends on a sync. Reported per run, on rank 0:

* bytes per optimizer step from the communication ledger (what each sync or gradient all-reduce handed to the
  collective), against mgpu_ddp's, and whether it is within 1/H + 2% of it;
* mean wall time per optimizer step (syncs included), after 5 warm-up steps;
* the final model's loss on the whole training split and on the validation split (evaluation mode).

``--plot PATH`` draws loss against total bytes sent per rank. The docs draw the same plot from
``docs/_data/benchmarks.json`` (``docs/_scripts/plots.py``); ``--json`` prints that entry.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from torch.nn import functional as F

import lightning_mgpu
from lightning_mgpu import MGPUDDPStrategy, MGPUDiLoCoStrategy, MGPULocalSGDStrategy
from lightning_mgpu.examples import DigitsDataModule, DigitsTransformer

WIDTH, LAYERS, HEADS = 32, 2, 4


class Measure(Callback):
    """Rank 0: wall time per optimizer step and the ledger, saved to ``path`` at the end of fit."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            stats = trainer.strategy.comm_stats  # type: ignore[attr-defined]
            torch.save({"times": self.times, "stats": stats}, self.path)


def run(name: str, strategy: Any, steps: int, batch: int, out: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DigitsTransformer(d_model=WIDTH, heads=HEADS, layers=LAYERS)
    data = DigitsDataModule(batch_size=batch)
    path = out / f"{name.replace(' ', '_')}.pt"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[Measure(path)],
    )
    trainer.fit(model, data)  # fork launch: rank 0's final weights come back into `model`
    record = torch.load(path, weights_only=False)
    stats, times = record["stats"], record["times"]
    data.setup("fit")
    model.eval()
    losses = {}
    with torch.no_grad():
        for split, loader in (("train", data._loader(0, False)), ("val", data._loader(1, False))):
            total = count = 0.0
            for x, y in loader:
                total += float(F.cross_entropy(model(x), y, reduction="sum"))
                count += len(y)
            losses[split] = total / count
    return {
        "name": name,
        "bytes_per_step": stats.bytes_per_step,
        "total_bytes": stats.allreduce_bytes,
        "syncs": stats.sync_rounds,
        "steps": stats.optimizer_steps,
        "step_ms": 1000 * sum(times[5:]) / max(len(times) - 5, 1),
        "train_loss": losses["train"],
        "val_loss": losses["val"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=384, help="optimizer steps per run (a multiple of 128)")
    parser.add_argument("--batch", type=int, default=16, help="images per rank per step")
    parser.add_argument("--plot", type=Path, default=None, help="save loss against bytes sent to this PNG")
    parser.add_argument("--json", action="store_true", help="print the docs' benchmarks.json entry")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    runs: list[tuple[str, int, Any]] = [("mgpu_ddp", 1, MGPUDDPStrategy(start_method="fork"))]
    for h in (8, 32, 128):
        runs.append((f"local SGD H={h}", h, MGPULocalSGDStrategy(sync_every=h, start_method="fork")))
    for h in (8, 32, 128):
        runs.append((f"DiLoCo H={h}", h, MGPUDiLoCoStrategy(sync_every=h, start_method="fork")))

    tokens = args.steps * 2 * args.batch * 64
    n_params = sum(p.numel() for p in DigitsTransformer(d_model=WIDTH, heads=HEADS, layers=LAYERS).parameters())
    print(
        f"torch {torch.__version__}, pytorch-lightning {pl.__version__}, lightning-mgpu {lightning_mgpu.__version__}; "
        f"2 CPU processes (gloo), fork launch; DigitsTransformer width {WIDTH}, {LAYERS} layers ({n_params} "
        f"parameters); AdamW 3e-3; {args.steps} steps x 2 ranks x {args.batch} images = {tokens} tokens per run"
    )
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, h, strategy in runs:
            r = run(name, strategy, args.steps, args.batch, Path(tmp))
            r["H"] = h
            results.append(r)
            print(f"done: {name} ({r['step_ms']:.1f} ms/step)", flush=True)

    ddp = results[0]
    print("\n| run | bytes/step (KiB) | vs mgpu_ddp | within 1/H + 2% | syncs | step (ms) | train loss | vs mgpu_ddp "
          "| val loss |")  # fmt: skip
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in results:
        ratio = r["bytes_per_step"] / ddp["bytes_per_step"]
        r["bytes_ratio"] = ratio
        r["loss_ratio"] = r["train_loss"] / ddp["train_loss"]
        within = "-" if r is ddp else ("yes" if ratio <= 1 / r["H"] + 0.02 else "NO")
        print(
            f"| {r['name']} | {r['bytes_per_step'] / 1024:.1f} | {ratio:.4f} (1/{1 / ratio:.1f}) | {within} | "
            f"{r['syncs']} | {r['step_ms']:.1f} | {r['train_loss']:.4f} | {r['loss_ratio']:.3f}x | "
            f"{r['val_loss']:.4f} |"
        )
    if args.plot is not None:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        entry = {
            "command": "python benchmarks/bench_local_sgd.py",
            "tokens": tokens,
            "runs": {
                r["name"]: {
                    "total_mib": round(r["total_bytes"] / 2**20, 2),
                    "bytes_ratio": round(r["bytes_ratio"], 4),
                    "step_ms": round(r["step_ms"], 1),
                    "train_loss": round(r["train_loss"], 4),
                    "val_loss": round(r["val_loss"], 4),
                }
                for r in results
            },
        }
        print(json.dumps(entry, indent=1))


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for family, marker in (("mgpu_ddp", "s"), ("local SGD", "o"), ("DiLoCo", "^")):
        rows = [r for r in results if r["name"].startswith(family)]
        ax.plot([r["total_bytes"] / 2**20 for r in rows], [r["train_loss"] for r in rows], marker=marker, label=family)
        for r in rows:
            ax.annotate(f" H={r['H']}" if r["H"] > 1 else " ", (r["total_bytes"] / 2**20, r["train_loss"]), fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("MiB sent per rank (whole run)")
    ax.set_ylabel("training loss after the run (log)")
    ax.set_title("loss against bytes sent, same tokens (2 CPU ranks)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
