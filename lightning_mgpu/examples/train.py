"""The main job: train the digits CNN with an mgpu strategy and print held-out accuracy and the comm ledger.

    python -m lightning_mgpu.examples.train                      # mgpu_ddp; 2 CPU processes without a GPU
    python -m lightning_mgpu.examples.train --strategy mgpu_ddp_fp16_compress --accumulate 2

On a machine with GPUs it uses every visible GPU (NCCL); otherwise 2 CPU processes (gloo).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

import pytorch_lightning as pl
import torch

import lightning_mgpu
from lightning_mgpu.examples import DigitsCNN, DigitsDataModule
from lightning_mgpu.strategies.launchers import release_process_group


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="mgpu_ddp", help="preset name (see `python -m lightning_mgpu --list`)")
    parser.add_argument("--devices", type=int, default=None, help="default: all GPUs, else 2 CPU processes")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per device")
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-accuracy", type=float, default=0.95, help="exit 1 if held-out accuracy is lower")
    parser.add_argument("--default-root-dir", default="runs/digits")
    args = parser.parse_args(argv)

    if args.strategy not in lightning_mgpu.register_presets():
        parser.error(f"unknown --strategy {args.strategy!r}; presets:\n{lightning_mgpu.preset_table()}")
    gpu = torch.cuda.is_available()
    devices = args.devices or (torch.cuda.device_count() if gpu else 2)
    pl.seed_everything(args.seed, workers=True, verbose=False)
    monitor = lightning_mgpu.DeviceMonitor()
    trainer = pl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=devices,
        strategy=args.strategy,
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        default_root_dir=args.default_root_dir,
        log_every_n_steps=10,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor],
    )
    start = time.perf_counter()
    model = DigitsCNN(lr=args.lr)
    data = DigitsDataModule(batch_size=args.batch_size)
    trainer.fit(model, data)
    fit_s = time.perf_counter() - start
    (result,) = trainer.test(model, data, verbose=False)
    accuracy = result["test_acc"]
    log_dir = trainer.log_dir  # a broadcast: every rank must ask
    if trainer.is_global_zero:
        strategy = trainer.strategy
        print(f"strategy {args.strategy} ({strategy!r}) on {devices} x {trainer.accelerator.__class__.__name__}")
        print(
            f"fit time {fit_s:.1f} s, {args.epochs} epochs, effective batch "
            f"{args.batch_size * devices * args.accumulate}"
        )
        print(f"held-out test accuracy {accuracy:.4f} ({data.hparams['test_size']} images)")
        stats = getattr(strategy, "comm_stats", None)
        if stats is not None:
            print(f"comm ledger (rank 0): {stats.summary()}")
        if monitor.history:
            last = monitor.history[-1]
            ranks = sorted({k.split("/")[1] for k in last if k.startswith("device/rank")})
            busy = ", ".join(f"{r} {last[f'device/{r}/busy_ms']:.1f}" for r in ranks)
            print(
                f"device monitor (last interval): busy ms/step {busy}; straggler ratio "
                f"{last['device/imbalance/straggler_ratio']:.2f} (rank {int(last['device/imbalance/straggler_rank'])})"
            )
        print(f"logs: {log_dir}")
    release_process_group()
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
