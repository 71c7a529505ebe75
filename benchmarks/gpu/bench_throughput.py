"""Tokens/s and model FLOPs utilisation (MFU) of a transformer language model on one GPU, bf16, side by side:
our presets vs Lightning's built-in strategies vs a plain torch loop, and step time with vs without activation
checkpointing, all in one run.

    python benchmarks/gpu/bench_throughput.py [--out benchmarks/results]   # ~370M parameters, seq 1024
    python benchmarks/gpu/bench_throughput.py --tiny                       # a check of the script (CPU works)

Runners (one GPU, world size 1, ``bf16-mixed``, AdamW as the module configures it, the same data loader):

  torch             a plain loop: autocast bf16, backward, step, zero_grad
  torch+ac          the same with every transformer layer checkpointed (lightning_mgpu.apply_activation_checkpointing)
  lightning_ddp     Trainer(strategy="ddp")
  lightning_fsdp    Trainer(strategy=FSDPStrategy(auto_wrap_policy={TransformerEncoderLayer}))
  mgpu_ddp          Trainer(strategy="mgpu_ddp")
  mgpu_ddp+ac       MGPUDDPStrategy(activation_checkpointing={TransformerEncoderLayer})
  mgpu_ddp+sac      the same keeping each layer's matmuls and attention (activation_checkpointing_save="matmuls")
  lightning_fsdp+ac the same with FSDPStrategy(activation_checkpointing_policy={TransformerEncoderLayer})
  mgpu_sharded      Trainer(strategy="mgpu_sharded")    (FSDP2, gradients sharded: ZeRO-2)
  mgpu_sharded+ac   MGPUShardedStrategy(stage=2, activation_checkpointing={TransformerEncoderLayer})
  mgpu_zero3        Trainer(strategy="mgpu_zero3")      (FSDP2, parameters sharded: ZeRO-3)
  mgpu_zero3+ac     MGPUShardedStrategy(stage=3, activation_checkpointing={TransformerEncoderLayer})

Each runner trains ``--warmup`` + ``--steps`` optimizer steps; the step time is the median of the timed steps (CUDA
synchronised at each step's end), over ``--rounds`` rounds that visit the runners in turn. MFU counts model FLOPs
(6 x non-embedding parameters + attention 12 x layers x d_model x seq per token; recomputation is not counted)
against the device's dense bf16 peak. The result is the ratios; absolute figures are reported with the device.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from env import environment

import lightning_mgpu
from lightning_mgpu.planning.lm import RandomTokens, TransformerLM

PEAK_BF16 = (("H100 PCIe", 756e12), ("H100", 989.4e12), ("H200", 989.4e12), ("A100", 312e12))
LAYER = nn.TransformerEncoderLayer


def peak_flops(device: str) -> float | None:
    return next((v for k, v in PEAK_BF16 if k in device), None)


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())


def _model(args: argparse.Namespace) -> TransformerLM:
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # initialised where it trains: fast
        return TransformerLM(vocab=args.vocab, d_model=args.d_model, heads=args.heads, layers=args.layers)


def _data(args: argparse.Namespace) -> RandomTokens:
    total = args.batch * (args.warmup + args.steps + 1)
    return RandomTokens(batch_size=args.batch, seq_len=args.seq, vocab=args.vocab, samples=total)


def run_torch(args: argparse.Namespace, ac: bool) -> list[float]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = _model(args).to(device)
    if ac:
        lightning_mgpu.apply_activation_checkpointing(model, {LAYER})
    opt = model.configure_optimizers()
    data = _data(args)
    data.setup("fit")
    stamps = []
    for tokens, targets in data.train_dataloader():
        tokens, targets = tokens.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        if len(stamps) == args.warmup + args.steps:
            break
    return stamps


def run_trainer(
    args: argparse.Namespace, strategy: Callable[[], Any], model: Callable[[argparse.Namespace], Any] = _model
) -> list[float]:
    """``Trainer(strategy=strategy()).fit`` of ``model(args)`` on one device, bf16-mixed: each step's end time."""
    timer = StepTimer()
    trainer = pl.Trainer(
        strategy=strategy(),
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=args.warmup + args.steps,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(model(args), _data(args))
    return timer.stamps


def runners(tiny: bool) -> dict[str, Callable[[argparse.Namespace], list[float]]]:
    from pytorch_lightning.strategies import FSDPStrategy

    out: dict[str, Callable[[argparse.Namespace], list[float]]] = {
        "torch": lambda a: run_torch(a, ac=False),
        "torch+ac": lambda a: run_torch(a, ac=True),
        "lightning_ddp": lambda a: run_trainer(a, lambda: "ddp"),
        "lightning_fsdp": lambda a: run_trainer(a, lambda: FSDPStrategy(auto_wrap_policy={LAYER})),
        "lightning_fsdp+ac": lambda a: run_trainer(
            a, lambda: FSDPStrategy(auto_wrap_policy={LAYER}, activation_checkpointing_policy={LAYER})
        ),
        "mgpu_ddp": lambda a: run_trainer(a, lambda: "mgpu_ddp"),
        "mgpu_ddp+ac": lambda a: run_trainer(
            a, lambda: lightning_mgpu.MGPUDDPStrategy(activation_checkpointing={LAYER})
        ),
        "mgpu_ddp+sac": lambda a: run_trainer(
            a,
            lambda: lightning_mgpu.MGPUDDPStrategy(
                activation_checkpointing={LAYER}, activation_checkpointing_save="matmuls"
            ),
        ),
        "mgpu_sharded": lambda a: run_trainer(a, lambda: "mgpu_sharded"),
        "mgpu_sharded+ac": lambda a: run_trainer(
            a, lambda: lightning_mgpu.MGPUShardedStrategy(stage=2, activation_checkpointing={LAYER})
        ),
        "mgpu_zero3": lambda a: run_trainer(a, lambda: "mgpu_zero3"),
        "mgpu_zero3+ac": lambda a: run_trainer(
            a, lambda: lightning_mgpu.MGPUShardedStrategy(stage=3, activation_checkpointing={LAYER})
        ),
    }
    if not torch.cuda.is_available():
        out.pop("lightning_fsdp")  # Lightning's FSDPStrategy runs on CUDA only
        out.pop("lightning_fsdp+ac")
    return out


def parse_arguments(
    description: str, layers: int, warmup: int, steps: int, rounds: Optional[int] = None
) -> argparse.Namespace:
    """The language model's shape, the steps, ``--only``, ``--tiny`` (a small model, to check the script) and
    ``--out``, with these defaults; ``rounds``: a ``--rounds`` option too."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--steps", type=int, default=steps)
    if rounds is not None:
        ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--only", nargs="*", default=None, help="runner names (default: all)")
    ap.add_argument("--tiny", action="store_true", help="a small model, to check the script")
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON result")
    args = ap.parse_args()
    if args.tiny:
        args.d_model, args.heads, args.layers, args.vocab, args.batch, args.seq = 64, 4, 2, 512, 2, 64
        args.warmup, args.steps = 1, 3
        if rounds is not None:
            args.rounds = 1
    return args


def main() -> None:
    args = parse_arguments(__doc__.split("\n")[0], layers=24, warmup=5, steps=20, rounds=2)
    torch.backends.cuda.matmul.allow_tf32 = True
    env = environment()
    todo = {k: v for k, v in runners(args.tiny).items() if not args.only or k in args.only}
    times: dict[str, list[float]] = {k: [] for k in todo}
    for _ in range(args.rounds):
        for name, fn in todo.items():
            stamps = fn(args)
            steps = [b - a for a, b in zip(stamps[args.warmup - 1 :], stamps[args.warmup :])]
            times[name] += steps
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    model = _model(args)
    params = sum(p.numel() for p in model.parameters())
    non_embedding = params - model.embed.weight.numel()
    flops_per_token = 6 * non_embedding + 12 * args.layers * args.d_model * args.seq
    tokens = args.batch * args.seq
    peak = peak_flops(env["device"])
    base = statistics.median(times["torch"]) if "torch" in times else None
    rows = []
    for name, ts in times.items():
        step = statistics.median(ts)
        tps = tokens / step
        rows.append(
            {
                "runner": name,
                "step_ms": step * 1e3,
                "tokens_per_s": tps,
                "mfu": flops_per_token * tps / peak if peak else None,
                "vs_torch": base / step if base else None,
                "timed_steps": len(ts),
            }
        )
    print(
        f"{params / 1e6:.0f}M parameters, batch {args.batch} x seq {args.seq}, bf16-mixed, on {env['device']} "
        f"(torch {env['torch']}, Lightning {env['pytorch_lightning']})"
    )
    print(f"{'runner':<16}{'step ms':>9}{'tokens/s':>11}{'MFU':>7}{'speed vs torch':>16}")
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        rel = f"{r['vs_torch']:.3f}x" if r["vs_torch"] else "-"
        print(f"{r['runner']:<16}{r['step_ms']:>9.1f}{r['tokens_per_s']:>11.0f}{mfu:>7}{rel:>16}")
    by = {r["runner"]: r for r in rows}
    for plain in ("torch", "lightning_fsdp", "mgpu_ddp", "mgpu_sharded", "mgpu_zero3"):
        for kind, label in (("ac", "activation checkpointing"), ("sac", "selective checkpointing (matmuls kept)")):
            ac = f"{plain}+{kind}"
            if plain in by and ac in by:
                print(f"{label}, {plain}: step time x{by[ac]['step_ms'] / by[plain]['step_ms']:.3f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"gpu-throughput-{env['device'].replace(' ', '_')}-{env['date'][:10]}.json"
        config = {k: v for k, v in vars(args).items() if k != "out"}
        (args.out / name).write_text(json.dumps({"environment": env, "config": config, "rows": rows}, indent=1))
        print(f"saved {args.out / name}")


if __name__ == "__main__":
    main()
    # Everything is printed and saved. Skip the interpreter's own teardown: twelve runners' CUDA and NCCL state can
    # keep the process alive past a timed run's budget although it measured everything.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
