"""Step time compiled against eager, side by side in one run: ``compile=True`` on mgpu_ddp (the LightningModule's
forward compiled after the DDP wrap) and mgpu_zero3 (each transformer layer compiled after sharding), beside
Lightning's ddp with a model the user compiled before the Trainer (``trainer.fit(torch.compile(model))``).

    python benchmarks/bench_compile.py                                  # 2 CPU processes (gloo), inductor
    python benchmarks/bench_compile.py --steps 30 --layers 4 --d-model 128
    python benchmarks/bench_compile.py --accelerator gpu --devices 1 --out benchmarks/results   # the GPU tier

The model is the sample transformer (``lightning_mgpu.examples.DigitsTransformer``: a BatchNorm conv stem, then
the 64 pixels as tokens through ``nn.TransformerEncoderLayer`` s; its ``training_step`` without ``self.log``, see
``QuietTransformer``) on random 8x8 digits, AdamW, fp32 on CPU (bf16-mixed on a GPU). Each runner trains
``--warmup`` optimizer steps (compilation happens there) and then ``--steps`` timed steps; the step time is rank 0's
median over the timed steps (CUDA synchronised at each step's end on a GPU), the lowest of ``--rounds`` rounds that
visit the runners in turn, eager then compiled. Printed: each runner's eager and compiled step time and their ratio
(compiled / eager: below 1 is faster), and the compile time (the first round's extra warm-up seconds; inductor's
on-disk cache makes a second run of the script compile faster). The machines are shared: timings are never
asserted in tests.
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
from typing import Any, Callable

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import DDPStrategy
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUDDPStrategy, MGPUShardedStrategy
from lightning_mgpu.examples import DigitsTransformer


class StepTimes(Callback):
    """Rank 0's time per optimizer step (accumulate 1: a batch), written to ``path`` at the end of fit."""

    def __init__(self, path: Path, warmup: int) -> None:
        self.path = path
        self.warmup = warmup
        self.times: list[float] = []
        self.start = 0.0
        self.fit_start = 0.0

    def _sync(self, trainer: pl.Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.fit_start = time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._sync(trainer)
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._sync(trainer)
        self.times.append(time.perf_counter() - self.start)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            timed = self.times[self.warmup :]
            record = {"step_s": statistics.median(timed), "warmup_s": sum(self.times[: self.warmup])}
            self.path.write_text(json.dumps(record))


class QuietTransformer(DigitsTransformer):
    """The sample transformer whose ``training_step`` does not call ``self.log``: a model compiled by the user is
    compiled by Lightning as a whole ``training_step``, and with torch 2.13 and Lightning 2.6 dynamo fails inside
    ``self.log`` there (``InternalTorchDynamoError``, printed by the last row). Every timed runner uses this one."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)


def data(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))


def run(
    name: str, strategy: Any, compile_user: bool, args: argparse.Namespace, out: Path, logs: bool = False
) -> dict[str, float]:
    path = out / f"{name}.json"
    torch.manual_seed(0)
    kind = DigitsTransformer if logs else QuietTransformer
    model: Any = kind(d_model=args.d_model, heads=4, layers=args.layers, dropout=0.0)
    if compile_user:
        model = torch.compile(model)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        max_steps=args.warmup + args.steps,
        precision="bf16-mixed" if args.accelerator == "gpu" else "32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[StepTimes(path, args.warmup)],
    )
    n = args.batch_size * args.devices * (args.warmup + args.steps)
    trainer.fit(model, train_dataloaders=DataLoader(data(n), batch_size=args.batch_size, drop_last=True))
    if not path.exists():  # another rank's process of a popen launch (several GPUs): rank 0 reports
        return {"step_s": float("nan"), "warmup_s": float("nan")}
    return json.loads(path.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the runners (each: eager, then compiled)")
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON result")
    args = ap.parse_args()
    gpu = args.accelerator == "gpu"
    # CPU: fork the ranks; GPU: popen (each rank re-runs this script, as torchrun would; one device runs in-process)
    launch = "popen" if gpu else "fork"
    runners: list[tuple[str, Callable[[Any], Any], bool]] = [
        ("mgpu_ddp", lambda c: MGPUDDPStrategy(start_method=launch, compile=c), False),
        ("mgpu_zero3", lambda c: MGPUShardedStrategy(stage=3, start_method=launch, compile=c), False),
        ("Lightning ddp, user-compiled", lambda c: DDPStrategy(start_method=launch), True),
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        # rounds visit eager and compiled in turn (the machine's load drifts); a configuration's step time is its
        # lowest median over the rounds, its compile time the first round's extra warm-up seconds
        times: dict[tuple[str, bool], list[dict[str, float]]] = {}
        for _ in range(args.rounds):
            for name, make, user in runners:
                for compiled in (False, True):
                    label = f"{name}-{'compiled' if compiled else 'eager'}".replace(" ", "_")
                    strategy = make(compiled and not user)
                    times.setdefault((name, compiled), []).append(run(label, strategy, compiled and user, args, out))
        for name, _, _ in runners:
            eager = min(r["step_s"] for r in times[(name, False)])
            compiled_s = min(r["step_s"] for r in times[(name, True)])
            rows.append(
                {
                    "runner": name,
                    "eager_step_ms": 1e3 * eager,
                    "compiled_step_ms": 1e3 * compiled_s,
                    "ratio": compiled_s / eager,
                    "compile_s": times[(name, True)][0]["warmup_s"] - times[(name, False)][0]["warmup_s"],
                }
            )
        # the sample's own training_step (self.log) with the user's torch.compile under Lightning's ddp
        try:
            run("user-compiled-logging", DDPStrategy(start_method=launch), True, args, out, logs=True)
            outcome = "trains"
        except Exception as err:  # the worker's error, re-raised by the launcher
            text = str(err).strip().splitlines()
            outcome = "fails: " + next((ln for ln in reversed(text) if "Error" in ln), text[-1] if text else "")[:150]
    device = torch.cuda.get_device_name() if gpu else f"CPU, {args.devices} processes (gloo)"
    print(
        f"\ncompiled / eager step time, inductor, DigitsTransformer(d_model={args.d_model}, layers={args.layers}), "
        f"batch {args.batch_size} per rank, {args.steps} timed steps after {args.warmup}, "
        f"best of {args.rounds} rounds; {device}"
    )
    print(f"{'runner':<30} {'eager ms':>9} {'compiled ms':>12} {'ratio':>6} {'compile s':>10}")
    for r in rows:
        print(
            f"{r['runner']:<30} {r['eager_step_ms']:>9.1f} {r['compiled_step_ms']:>12.1f} {r['ratio']:>6.2f} "
            f"{r['compile_s']:>10.1f}"
        )
    print(f"Lightning ddp, user-compiled, the sample's training_step (with self.log): {outcome}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        prefix = "gpu-" if gpu else ""
        stamp = time.strftime("%Y-%m-%dT%H%M", time.gmtime())  # UTC, as the GPU benchmarks' result_name
        name = f"{prefix}compile-{device.split(',')[0].replace(' ', '_')}-{stamp}.json"
        config = {k: v for k, v in vars(args).items() if k != "out"}
        result = {"device": device, "config": config, "rows": rows, "user_compiled_with_log": outcome}
        (args.out / name).write_text(json.dumps(result, indent=1))
        print(f"saved {args.out / name}")


if __name__ == "__main__":
    main()
    # Everything is printed and saved. Skip the interpreter's own teardown: inductor's pool of compile workers and
    # the CUDA/NCCL state can keep the process alive for tens of seconds after the table (a timed run then ends
    # after its budget although it measured everything).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
