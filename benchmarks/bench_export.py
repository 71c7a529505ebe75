"""``lightning-mgpu export``: the export's peak host memory against the checkpoint's size, and the EMA callback's
cost per optimizer step.

    python benchmarks/bench_export.py                    # GPT-2 width 512, 8 layers (~51M parameters, float32)
    python benchmarks/bench_export.py --width 1024 --layers 12

Export: a transformers GPT-2 from a random configuration (no download) is saved as the pack saves it, once as one
file and once as a sharded directory (torch.distributed.checkpoint, written by one process); each export runs in
its own subprocess, which samples its own ``/proc/self/status`` every 2 ms: the peak increase of the resident set
(``VmRSS``) and of its anonymous part (``RssAnon``: the heap; the rest is mapped file pages, which the kernel can
drop) over the value before the export, printed against the checkpoint's bytes.

EMA: one process, the same model, AdamW steps with and without ``EMA.update`` after each, alternating rounds;
prints the median time of a step and of an update (Linux, CPU; on a GPU: not measured yet, run with
``--device cuda``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

_CHILD = r"""
import json, sys, threading, time
from lightning_mgpu.export import export_checkpoint

def status():
    fields = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            fields[key] = int(value.split()[0]) * 1024
    return fields

before = status()
peak = dict(before)
done = False
def sample():
    while not done:
        for key, value in status().items():
            peak[key] = max(peak[key], value)
        time.sleep(0.002)
thread = threading.Thread(target=sample, daemon=True)
thread.start()
start = time.perf_counter()
export_checkpoint(sys.argv[1], sys.argv[2], format=sys.argv[3])
seconds = time.perf_counter() - start
done = True
thread.join()
for key, value in status().items():
    peak[key] = max(peak[key], value)
print(json.dumps({"seconds": seconds, **{key: peak[key] - before[key] for key in before}}))
"""


def _model(width: int, layers: int) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=8192, n_positions=128, n_embd=width, n_layer=layers, n_head=8)
    return GPT2LMHeadModel(config)


def _save(model: Any, folder: Path) -> dict[str, Path]:
    import torch.distributed.checkpoint as dcp

    from lightning_mgpu.export import HF_MODELS_KEY, hf_models
    from lightning_mgpu.plugins.checkpoint_io import COMPLETE_MARKER

    holder = torch.nn.Module()
    holder.model = model
    state = holder.state_dict()
    meta = {"epoch": 0, "global_step": 1, HF_MODELS_KEY: hf_models(holder)}
    file = folder / "one.ckpt"
    torch.save({"state_dict": state, **meta}, file)
    directory = folder / "sharded.ckpt"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save({"state_dict": state}, checkpoint_id=str(directory), no_dist=True)
    torch.save({**meta, "mgpu_sharded_optimizers": None}, directory / "meta.pt")
    (directory / COMPLETE_MARKER).write_text(json.dumps({"format": "lightning_mgpu.sharded", "version": 1}))
    return {"file": file, "sharded directory": directory}


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def bench_export(width: int, layers: int) -> None:
    model = _model(width, layers)
    params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        sources = _save(model, Path(tmp))
        del model
        print(f"GPT-2 width {width}, {layers} layers: {params / 1e6:.1f}M parameters (float32)")
        print("| checkpoint | format | checkpoint MB | peak RSS increase MB | peak anonymous MB | seconds |")
        print("|---|---|---|---|---|---|")
        for kind, path in sources.items():
            for fmt in ("hf", "torch"):
                out = Path(tmp) / f"out-{kind.replace(' ', '-')}-{fmt}"
                proc = subprocess.run(
                    [sys.executable, "-c", _CHILD, str(path), str(out), fmt], capture_output=True, text=True, check=True
                )
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                mb = 1024 * 1024
                print(
                    f"| {kind} | {fmt} | {_size(path) / mb:.0f} | {row['VmRSS'] / mb:.0f} | {row['RssAnon'] / mb:.0f} "
                    f"| {row['seconds']:.2f} |"
                )


def bench_ema(width: int, layers: int, steps: int, device: str) -> None:
    from lightning_mgpu import EMA

    model = _model(width, layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 8192, (4, 128), device=device)
    ema = EMA(decay=0.999)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    step()
    ema.update(model)  # the first update copies
    plain, with_ema, updates = [], [], []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        step()
        sync()
        t1 = time.perf_counter()
        ema.update(model)
        sync()
        t2 = time.perf_counter()
        with_ema.append(t2 - t0)
        updates.append(t2 - t1)
    step_s, update_s = statistics.median(plain), statistics.median(updates)
    print(
        f"EMA on {device}: step {step_s * 1e3:.1f} ms, step + update {statistics.median(with_ema) * 1e3:.1f} ms, "
        f"update {update_s * 1e3:.1f} ms ({100 * update_s / step_s:.1f}% of a step), medians of {steps} rounds"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="EMA rounds (one step without, one with)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip-export", action="store_true")
    args = parser.parse_args()
    if not args.skip_export:
        bench_export(args.width, args.layers)
    bench_ema(args.width, args.layers, args.steps, args.device)


if __name__ == "__main__":
    main()
