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

Each runner trains ``--warmup`` + ``--steps`` optimizer steps; the step time is the median of the timed steps, over
``--rounds`` rounds that visit the runners in turn. A step's end is a CUDA event recorded on the device's stream
(:class:`StepClock`): nothing waits for the device between steps, as in a real run, so a framework's host work between
two steps overlaps the device's work as it would in training. Results files record it (``"clock": "events"``); those
without the field synchronised the device at each step's end, which laid each runner's host work between two steps
bare. MFU counts model FLOPs
(6 x non-embedding parameters + attention 12 x layers x d_model x seq per token; recomputation is not counted)
against the device's dense bf16 peak. The result is the ratios; absolute figures are reported with the device.

``--profile N`` then runs each of ``--profile-runners`` (default: torch, Lightning's ``ddp`` and ``FSDPStrategy``,
``mgpu_ddp``, ``mgpu_zero3``) once more with N steps under ``torch.profiler`` and prints, per step: the wall time, how
long the device was busy (the union of its kernels and copies) and its share of the wall time, the kernels launched,
the calls that made the host wait for the device (``_local_scalar_dense`` is ``item()`` and its kin; the CUDA
synchronizations), then, for each runner, the operators whose host self time and device time differ most from the
plain loop's: where a runner's step goes beyond plain torch. ``--rounds 0 --profile 5`` runs the profile alone. On
CPU (``--tiny``) the device columns read 0. The profile is not measured on a GPU yet (``python
benchmarks/gpu/bench_throughput.py --rounds 0 --profile 5 --profile-runners torch lightning_ddp mgpu_ddp``).
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
from env import environment, result_name

import lightning_mgpu
from lightning_mgpu.planning.lm import RandomTokens, TransformerLM

PEAK_BF16 = (("H100 PCIe", 756e12), ("H100", 989.4e12), ("H200", 989.4e12), ("A100", 312e12))
LAYER = nn.TransformerEncoderLayer


def peak_flops(device: str) -> float | None:
    return next((v for k, v in PEAK_BF16 if k in device), None)


class StepClock:
    """Each step's end, without making the host wait: on a GPU a CUDA event recorded on the current stream (the
    device's own clock: a step whose host work outlasts its kernels shows as the device waiting), on CPU the host's
    clock. :meth:`stamps` waits for the device once, at the end. ``profiled``: told of each step's end."""

    def __init__(self, profiled: Optional[Profiled] = None) -> None:
        self.marks: list[Any] = []
        self.profiled = profiled

    def tick(self) -> int:
        """Marks a step's end; returns the steps marked so far."""
        if torch.cuda.is_available():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        if self.profiled is not None:
            self.profiled.mark(len(self.marks))
        return len(self.marks)

    def stamps(self) -> list[float]:
        """Each step's end in seconds (from the first mark on a GPU)."""
        if self.marks and isinstance(self.marks[0], torch.cuda.Event):
            torch.cuda.synchronize()
            return [self.marks[0].elapsed_time(e) / 1e3 for e in self.marks]
        return list(self.marks)


class StepTimer(pl.Callback):
    def __init__(self, profiled: Optional[Profiled] = None) -> None:
        self.clock = StepClock(profiled)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.clock.tick()


class Profiled:
    """``torch.profiler`` over ``n`` steps of one run, after ``warmup`` steps: ``mark(done)`` is called as each step
    ends (``done`` steps so far)."""

    def __init__(self, warmup: int, n: int) -> None:
        self.warmup, self.n = warmup, n
        self.prof: Optional[torch.profiler.profile] = None

    def mark(self, done: int) -> None:
        if done == self.warmup:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.start()
        elif done == self.warmup + self.n and self.prof is not None:
            self.prof.stop()


def _model(args: argparse.Namespace) -> TransformerLM:
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # initialised where it trains: fast
        return TransformerLM(vocab=args.vocab, d_model=args.d_model, heads=args.heads, layers=args.layers)


def _data(args: argparse.Namespace) -> RandomTokens:
    total = args.batch * (args.warmup + args.steps + 1)
    return RandomTokens(batch_size=args.batch, seq_len=args.seq, vocab=args.vocab, samples=total)


def run_torch(args: argparse.Namespace, ac: bool, profiled: Optional[Profiled] = None) -> list[float]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = _model(args).to(device)
    if ac:
        lightning_mgpu.apply_activation_checkpointing(model, {LAYER})
    opt = model.configure_optimizers()
    data = _data(args)
    data.setup("fit")
    clock = StepClock(profiled)
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


def run_trainer(
    args: argparse.Namespace,
    strategy: Callable[[], Any],
    model: Callable[[argparse.Namespace], Any] = _model,
    profiled: Optional[Profiled] = None,
) -> list[float]:
    """``Trainer(strategy=strategy()).fit`` of ``model(args)`` on one device, bf16-mixed: each step's end time."""
    timer = StepTimer(profiled)
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
    return timer.clock.stamps()


def runners(tiny: bool) -> dict[str, Callable[..., list[float]]]:
    from pytorch_lightning.strategies import FSDPStrategy

    out: dict[str, Callable[..., list[float]]] = {
        "torch": lambda a, p=None: run_torch(a, ac=False, profiled=p),
        "torch+ac": lambda a, p=None: run_torch(a, ac=True, profiled=p),
        "lightning_ddp": lambda a, p=None: run_trainer(a, profiled=p, strategy=lambda: "ddp"),
        "lightning_fsdp": lambda a, p=None: run_trainer(
            a, profiled=p, strategy=lambda: FSDPStrategy(auto_wrap_policy={LAYER})
        ),
        "lightning_fsdp+ac": lambda a, p=None: run_trainer(
            a,
            profiled=p,
            strategy=lambda: FSDPStrategy(auto_wrap_policy={LAYER}, activation_checkpointing_policy={LAYER}),
        ),
        "mgpu_ddp": lambda a, p=None: run_trainer(a, profiled=p, strategy=lambda: "mgpu_ddp"),
        "mgpu_ddp+ac": lambda a, p=None: run_trainer(
            a, profiled=p, strategy=lambda: lightning_mgpu.MGPUDDPStrategy(activation_checkpointing={LAYER})
        ),
        "mgpu_ddp+sac": lambda a, p=None: run_trainer(
            a,
            profiled=p,
            strategy=lambda: lightning_mgpu.MGPUDDPStrategy(
                activation_checkpointing={LAYER}, activation_checkpointing_save="matmuls"
            ),
        ),
        "mgpu_sharded": lambda a, p=None: run_trainer(a, profiled=p, strategy=lambda: "mgpu_sharded"),
        "mgpu_sharded+ac": lambda a, p=None: run_trainer(
            a,
            profiled=p,
            strategy=lambda: lightning_mgpu.MGPUShardedStrategy(stage=2, activation_checkpointing={LAYER}),
        ),
        "mgpu_zero3": lambda a, p=None: run_trainer(a, profiled=p, strategy=lambda: "mgpu_zero3"),
        "mgpu_zero3+ac": lambda a, p=None: run_trainer(
            a,
            profiled=p,
            strategy=lambda: lightning_mgpu.MGPUShardedStrategy(stage=3, activation_checkpointing={LAYER}),
        ),
    }
    if not torch.cuda.is_available():
        out.pop("lightning_fsdp")  # Lightning's FSDPStrategy runs on CUDA only
        out.pop("lightning_fsdp+ac")
    return out


def parse_arguments(
    description: str, layers: int, warmup: int, steps: int, rounds: Optional[int] = None, profile: bool = False
) -> argparse.Namespace:
    """The language model's shape, the steps, ``--only``, ``--tiny`` (a small model, to check the script) and
    ``--out``, with these defaults; ``rounds``: a ``--rounds`` option too; ``profile``: ``--profile`` and
    ``--profile-runners``."""
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
    if profile:
        ap.add_argument("--profile", type=int, default=0, help="then profile N steps of --profile-runners")
        ap.add_argument("--profile-runners", nargs="*", default=list(PROFILED), help="runners to profile")
    ap.add_argument("--tiny", action="store_true", help="a small model, to check the script")
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON result")
    args = ap.parse_args()
    if args.tiny:
        args.d_model, args.heads, args.layers, args.vocab, args.batch, args.seq = 64, 4, 2, 512, 2, 64
        args.warmup, args.steps = 1, 3
        if rounds is not None:
            args.rounds = 1
    return args


#: the runners ``--profile`` profiles by default: the plain loop and the two strategies each of the pack's presets is
#: measured against
PROFILED = ("torch", "lightning_ddp", "mgpu_ddp", "lightning_fsdp", "mgpu_zero3")
#: the calls that make the host wait for the device, as the profiler names them
WAITS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _busy_us(kernels: list[tuple[float, float]]) -> float:
    """The time covered by the union of the device intervals ``(start, end)``, in microseconds."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(kernels):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def profile_summary(prof: torch.profiler.profile, n: int, wall_s: float) -> dict[str, Any]:
    """Per step of ``n`` profiled steps: wall time, how long the device was busy (the union of its kernels and copies),
    kernels launched, the calls that made the host wait, and each operator's host self time and device time."""
    events = prof.events()
    device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = _busy_us([(e.time_range.start, e.time_range.end) for e in device])
    host: dict[str, float] = {}
    dev: dict[str, float] = {}
    counts: dict[str, int] = {}
    for e in prof.key_averages():
        host[e.key] = e.self_cpu_time_total / n / 1e3
        counts[e.key] = e.count
    for e in device:
        dev[e.name] = dev.get(e.name, 0.0) + (e.time_range.end - e.time_range.start) / n / 1e3
    return {
        "wall_ms": wall_s / n * 1e3,
        "device_busy_ms": busy / n / 1e3,
        "kernels": len(device) / n,
        "waits": {w: counts.get(w, 0) / n for w in WAITS},
        "host_self_ms": host,
        "device_ms": dev,
    }


def print_profiles(profiles: dict[str, dict[str, Any]], top: int = 12) -> None:
    """The profiled runners side by side, then, for each, where its host and device time per step go beyond the plain
    torch loop's (the operators with the largest differences)."""
    print("\nprofile, per step (torch.profiler slows the host: read the figures as shares)")
    waits = " ".join(f"{w.split('::')[-1].replace('cuda', ''):>20}" for w in WAITS)
    print(f"{'runner':<16}{'wall ms':>9}{'device ms':>11}{'busy':>7}{'kernels':>9} {waits}")
    for name, p in profiles.items():
        busy = p["device_busy_ms"] / p["wall_ms"] if p["wall_ms"] else 0.0
        w = " ".join(f"{p['waits'][k]:>20.1f}" for k in WAITS)
        print(f"{name:<16}{p['wall_ms']:>9.1f}{p['device_busy_ms']:>11.1f}{busy:>7.1%}{p['kernels']:>9.0f} {w}")
    ref = profiles.get("torch")
    for name, p in profiles.items():
        if ref is None or name == "torch":
            continue
        for what, key in (("host self ms", "host_self_ms"), ("device ms", "device_ms")):
            diff = {k: v - ref[key].get(k, 0.0) for k, v in p[key].items()}
            diff.update({k: -v for k, v in ref[key].items() if k not in p[key]})
            rows = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]
            print(f"\n{name} vs torch, {what} per step (+: {name} spends more), total {sum(diff.values()):+.2f}")
            for k, v in rows:
                print(f"  {v:>+9.3f}  {k[:110]}")


def profile_runners(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each of ``--profile-runners`` run once more, ``--profile`` steps after the warm-up under ``torch.profiler``."""
    available = runners(args.tiny)
    out = {}
    for name in args.profile_runners:
        if name not in available:
            print(f"profile: {name} skipped (not a runner here: {sorted(available)})")
            continue
        run = argparse.Namespace(**{**vars(args), "steps": args.profile})
        profiled = Profiled(args.warmup, args.profile)
        stamps = available[name](run, profiled)
        assert profiled.prof is not None
        out[name] = profile_summary(profiled.prof, args.profile, stamps[-1] - stamps[args.warmup - 1])
        del profiled
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def main() -> None:
    args = parse_arguments(__doc__.split("\n")[0], layers=24, warmup=5, steps=20, rounds=2, profile=True)
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
    base = statistics.median(times["torch"]) if times.get("torch") else None
    rows = []
    for name, ts in times.items():
        if not ts:  # --rounds 0: the profile alone
            continue
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
    sys.stdout.flush()  # the table first: the profile below takes a while
    profiles = profile_runners(args) if args.profile else {}
    if profiles:
        print_profiles(profiles)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = result_name("throughput", env)
        config = {k: v for k, v in vars(args).items() if k != "out"}
        result = {"environment": env, "config": config, "clock": "events", "rows": rows}
        if profiles:  # the 40 largest operators of each, by host self time and by device time
            result["profiles"] = {
                k: {
                    **p,
                    "host_self_ms": dict(sorted(p["host_self_ms"].items(), key=lambda kv: -kv[1])[:40]),
                    "device_ms": dict(sorted(p["device_ms"].items(), key=lambda kv: -kv[1])[:40]),
                }
                for k, p in profiles.items()
            }
        (args.out / name).write_text(json.dumps(result, indent=1))
        print(f"saved {args.out / name}")


if __name__ == "__main__":
    main()
    # Everything is printed and saved. Skip the interpreter's own teardown: twelve runners' CUDA and NCCL state can
    # keep the process alive past a timed run's budget although it measured everything.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
