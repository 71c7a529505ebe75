"""What offloading to host memory costs and saves on one GPU, side by side in one run: step time and the device's
peak allocated bytes of ZeRO-3 with and without ``offload="cpu"``, under our strategy, under a plain torch loop with
the same FSDP2 offload policy, and under Lightning's ``FSDPStrategy(cpu_offload=True)``.

    python benchmarks/gpu/bench_offload.py [--out benchmarks/results]   # ~150M parameters, seq 1024
    python benchmarks/gpu/bench_offload.py --tiny                       # a check of the script (CPU works)

Runners (one GPU, world size 1, ``bf16-mixed`` (autocast in the plain loops), AdamW as the module configures it, each
transformer layer an FSDP unit, the same data):

  torch_zero3           a plain loop over ``fully_shard`` (FSDP2)
  torch_zero3_offload   the same with FSDP2's ``CPUOffloadPolicy(pin_memory=True)``
  mgpu_zero3            Trainer(strategy="mgpu_zero3")
  mgpu_zero3_offload    Trainer(strategy="mgpu_zero3_offload")
  lightning_fsdp_offload  Trainer(strategy=FSDPStrategy(auto_wrap_policy={layer}, cpu_offload=True)) (FSDP1; CUDA)

Offload moves every shard to the device and every gradient shard back each step, and the optimizer steps on the host:
it is slower by what the transfers and the host's AdamW cost. What the Trainer may add to that is the ratio
``mgpu_zero3_offload / torch_zero3_offload`` (1.00x: nothing). The step time is the median of the timed steps, each
step's end a CUDA event on the device's stream (``bench_throughput.StepClock``: no wait between steps); the peak is
``torch.cuda.max_memory_allocated`` over the whole run (-1 on CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_throughput import LAYER, StepClock, _data, parse_arguments, run_trainer
from env import environment, result_name

import lightning_mgpu
from lightning_mgpu.planning.lm import TransformerLM

CUDA = torch.cuda.is_available()


def _model(args: argparse.Namespace) -> TransformerLM:
    """Built on the host, as a model too large for the device is: each strategy moves to the device what it keeps
    there (offloaded, one unit at a time)."""
    torch.manual_seed(0)
    return TransformerLM(vocab=args.vocab, d_model=args.d_model, heads=args.heads, layers=args.layers)


def run_torch(args: argparse.Namespace, offload: bool) -> list[float]:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    device = torch.device("cuda" if CUDA else "cpu")
    started = not dist.is_initialized()
    if started:  # FSDP2 needs a process group: one rank
        store = f"file://{tempfile.mktemp()}"
        dist.init_process_group("nccl" if CUDA else "gloo", init_method=store, rank=0, world_size=1)
    try:
        model = _model(args)
        policy = CPUOffloadPolicy(pin_memory=CUDA) if offload else OffloadPolicy()
        for layer in [m for m in model.modules() if isinstance(m, LAYER)]:
            fully_shard(layer, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
        opt = model.configure_optimizers()
        data = _data(args)
        data.setup("fit")
        clock = StepClock()
        for tokens, targets in data.train_dataloader():
            tokens, targets = tokens.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(tokens)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if clock.tick() == args.warmup + args.steps:
                break
        return clock.stamps()
    finally:
        if started:
            dist.destroy_process_group()


def runners() -> dict[str, Callable[[argparse.Namespace], list[float]]]:
    from pytorch_lightning.strategies import FSDPStrategy

    out: dict[str, Callable[[argparse.Namespace], list[float]]] = {
        "torch_zero3": lambda a: run_torch(a, offload=False),
        "torch_zero3_offload": lambda a: run_torch(a, offload=True),
        "mgpu_zero3": lambda a: run_trainer(a, lambda: lightning_mgpu.MGPUShardedStrategy(stage=3), _model),
        "mgpu_zero3_offload": lambda a: run_trainer(
            a, lambda: lightning_mgpu.MGPUShardedStrategy(stage=3, offload="cpu"), _model
        ),
        "lightning_fsdp_offload": lambda a: run_trainer(
            a, lambda: FSDPStrategy(auto_wrap_policy={LAYER}, cpu_offload=True), _model
        ),
    }
    if not CUDA:
        out.pop("lightning_fsdp_offload")  # Lightning's FSDPStrategy runs on CUDA only
    return out


def main() -> None:
    args = parse_arguments(__doc__.split("\n")[0], layers=8, warmup=2, steps=6)
    torch.backends.cuda.matmul.allow_tf32 = True
    env = environment()
    rows = []
    for name, fn in runners().items():
        if args.only and name not in args.only:
            continue
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        stamps = fn(args)
        peak = torch.cuda.max_memory_allocated() if CUDA else -1
        steps = [b - a for a, b in zip(stamps[args.warmup - 1 :], stamps[args.warmup :])]
        rows.append({"runner": name, "step_ms": statistics.median(steps) * 1e3, "peak_bytes": peak})
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
    params = sum(p.numel() for p in _model(args).parameters())
    print(
        f"{params / 1e6:.0f}M parameters, batch {args.batch} x seq {args.seq}, bf16-mixed, AdamW, on {env['device']} "
        f"(torch {env['torch']}, Lightning {env['pytorch_lightning']})"
    )
    print(f"{'runner':<24}{'step ms':>10}{'peak MiB':>11}")
    for r in rows:
        peak = f"{r['peak_bytes'] / 2**20:.0f}" if r["peak_bytes"] >= 0 else "-"
        print(f"{r['runner']:<24}{r['step_ms']:>10.1f}{peak:>11}")
    by = {r["runner"]: r for r in rows}
    pairs = (
        ("mgpu_zero3_offload", "torch_zero3_offload", "the Trainer's cost on offload (ours / plain torch)"),
        ("mgpu_zero3", "torch_zero3", "the Trainer's cost without offload (ours / plain torch)"),
        ("torch_zero3_offload", "torch_zero3", "offload's cost, plain torch (offload / none)"),
        ("mgpu_zero3_offload", "mgpu_zero3", "offload's cost, ours (offload / none)"),
        ("lightning_fsdp_offload", "mgpu_zero3_offload", "Lightning's FSDP offload / ours"),
    )
    for a, b, label in pairs:
        if a in by and b in by:
            line = f"{label}: step time x{by[a]['step_ms'] / by[b]['step_ms']:.3f}"
            if by[b]["peak_bytes"] > 0:
                line += f", device peak x{by[a]['peak_bytes'] / by[b]['peak_bytes']:.3f}"
            print(line)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = result_name("offload", env)
        config = {k: v for k, v in vars(args).items() if k != "out"}
        (args.out / name).write_text(
            json.dumps({"environment": env, "config": config, "clock": "events", "rows": rows}, indent=1)
        )
        print(f"saved {args.out / name}")


if __name__ == "__main__":
    main()
