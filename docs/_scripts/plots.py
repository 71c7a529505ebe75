"""Draw the benchmark plots of the documentation from the numbers the benchmarks printed.

The benchmarks in ``benchmarks/`` print tables and save no files, so their numbers are kept in
``docs/_data/benchmarks.json`` (copied from those outputs; each entry names the command that printed it). This script
reads that file and writes one PNG per benchmark into ``docs/_generated/``; the docs build runs it (``conf.py``), so
no plot is drawn by hand. Run it alone with ``.venv/bin/python docs/_scripts/plots.py``.

The GPU benchmarks (``make bench-gpu``) save JSON under ``benchmarks/results/``; each ``gpu_*`` plot is drawn from the
newest file of its kind there. Where there is none yet, the plot says "not measured on a GPU yet" and names the
command that measures it, so the page builds either way.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

DOCS = Path(__file__).resolve().parent.parent
RESULTS = DOCS / "_data" / "benchmarks.json"
GPU_RESULTS = DOCS.parent / "benchmarks" / "results"
OUT = DOCS / "_generated"


def _bars(ax, labels: list[str], values: list[float], title: str, xlabel: str, ref: float | None = None) -> None:
    ax.barh(labels, values, color="#4c72b0")
    ax.invert_yaxis()
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:g}", va="center", fontsize=8)
    if ref is not None:
        ax.axvline(ref, color="grey", lw=0.8, ls="--")


def plot_ddp(r: dict, path: Path) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3))
    _bars(a, list(r["step_ms"]), list(r["step_ms"].values()), "step time (median, 2 CPU processes)", "ms")
    ratios = r["ledger_ratio_to_ring_lower_bound"]
    _bars(b, list(ratios), list(ratios.values()), "traffic per step / ring lower bound", "ratio", ref=1.0)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_manual(r: dict, path: Path) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3))
    _bars(a, list(r["ms_per_window"]), list(r["ms_per_window"].values()), "GAN, k=4: time per window", "ms")
    calls = r["all_reduce_per_window"]
    _bars(b, list(calls), list(calls.values()), "all-reduce calls per window", "calls")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_sharded(r: dict, path: Path) -> None:
    rows = r["n2_ratio_to_ddp"]
    runners, kinds = list(rows), list(next(iter(rows.values())))
    fig, ax = plt.subplots(figsize=(10, 3.5))
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        xs = [j + i * width for j in range(len(runners))]
        ax.bar(xs, [rows[n][kind] for n in runners], width, label=kind)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(runners))], runners, fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("x Lightning ddp (per rank)")
    ax.set_title("N = 2: what each rank holds, and step time, relative to DDP", fontsize=10)
    ax.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_checkpointing(r: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, (bytes_ratio, time_ratio) in r["bytes_and_time_vs_none"].items():
        ax.scatter(bytes_ratio, time_ratio)
        ax.annotate(name, (bytes_ratio, time_ratio), fontsize=8, xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("saved activation bytes / no checkpointing")
    ax.set_ylabel("step time / no checkpointing")
    ax.set_title("activation checkpointing: memory against time (CPU)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_precision(r: dict, path: Path) -> None:
    rows = r["ratio_to_32_true"]
    fig, ax = plt.subplots(figsize=(8, 3))
    names = list(rows)
    for i, kind in enumerate(("state bytes", "activation bytes")):
        ax.bar([j + i * 0.4 for j in range(len(names))], [rows[n][kind] for n in names], 0.4, label=kind)
    ax.set_xticks([j + 0.2 for j in range(len(names))], names, fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("x 32-true")
    ax.set_title("bytes per rank: weights + gradients + masters + optimizer state, and activations", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_lr(r: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3))
    for ax, (opt, rows) in zip(axes, r["distance_to_reference"].items()):
        _bars(ax, list(rows), [max(v, 1e-17) for v in rows.values()], f"{opt}: distance to the batch-64 run", "")
        ax.set_xscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_local_sgd(r: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    runs = r["runs"]
    for family, marker in (("mgpu_ddp", "s"), ("local SGD", "o"), ("DiLoCo", "^")):
        names = [n for n in runs if n.startswith(family)]
        xs, ys = [runs[n]["total_mib"] for n in names], [runs[n]["train_loss"] for n in names]
        ax.plot(xs, ys, marker=marker, label=family)
        for n, x, y in zip(names, xs, ys):
            ax.annotate(" " + n.rpartition(" ")[2] if "H=" in n else "", (x, y), fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("MiB sent per rank (whole run)")
    ax.set_ylabel("training loss after the run (log)")
    ax.set_title(f"loss against bytes sent, {r['tokens']} tokens per run (2 CPU ranks)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_planner(r: dict, path: Path) -> None:
    points = r["points_mib_measured_predicted"]
    fig, axes = plt.subplots(1, len(points), figsize=(3.2 * len(points), 3.4))
    for ax, (component, pairs) in zip(axes, points.items()):
        xs, ys = [m for m, _ in pairs], [p for _, p in pairs]
        top = max(xs + ys) * 1.1 if xs else 1.0
        ax.fill_between([0, top], [0, 0.85 * top], [0, 1.15 * top], color="0.9", label="+/-15%")
        ax.plot([0, top], [0, top], "k-", lw=0.8, label="predicted = measured")
        ax.scatter(xs, ys, s=12, color="#4c72b0")
        ax.set_title(component.replace("_", " "), fontsize=10)
        ax.set_xlabel("measured (MiB)")
    axes[0].set_ylabel("predicted (MiB)")
    axes[0].legend(loc="upper left", fontsize=7)
    fig.suptitle("lightning-mgpu plan: predicted vs measured per rank, every measured candidate", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _newest_gpu_result(kind: str, folder: Path) -> dict | None:
    """The newest ``gpu-<kind>-<device>-<date>.json`` measured on a GPU (a ``--tiny`` CPU check is not drawn)."""
    found = []
    for f in sorted(folder.glob(f"gpu-{kind}-*.json")) if folder.is_dir() else []:
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if data.get("environment", {}).get("device", "cpu") != "cpu":
            found.append((data["environment"].get("date", ""), data))
    return max(found, key=lambda t: t[0])[1] if found else None


def _not_measured(path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(8, 1.6))
    ax.axis("off")
    ax.text(0.5, 0.62, title, ha="center", va="center", fontsize=11)
    ax.text(0.5, 0.28, "not measured on a GPU yet: run `make bench-gpu` on a GPU machine", ha="center", fontsize=9)
    fig.savefig(path, dpi=100)


def _device(r: dict) -> str:
    return str(r["environment"].get("device", "?"))


def plot_gpu_throughput(r: dict, path: Path) -> None:
    rows = r["rows"]
    names = [x["runner"] for x in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    _bars(a, names, [round(x["tokens_per_s"]) for x in rows], f"tokens/s, {_device(r)}", "tokens/s")
    mfu = [round(100 * x["mfu"], 1) if x.get("mfu") is not None else 0.0 for x in rows]
    _bars(b, names, mfu, "model FLOPs utilisation", "% of the bf16 peak")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_gpu_memory_per_rank(r: dict, path: Path) -> None:
    rows = r["rows"]
    kinds = list(dict.fromkeys(x["strategy"] for x in rows))
    fig, axes = plt.subplots(1, len(kinds), figsize=(3 * len(kinds), 3.2), sharey=True)
    for ax, kind in zip(axes, kinds):
        mine = [x for x in rows if x["strategy"] == kind]
        worlds = [x["world"] for x in mine]
        ax.plot(worlds, [x["states_bytes"] / 2**30 for x in mine], "o-", label="measured states")
        ax.plot(worlds, [x["fp32_formula_bytes"] / 2**30 for x in mine], "k--", label="FP32 Adam formula")
        if all(math.isfinite(x.get("peak_bytes") or math.nan) for x in mine):
            ax.plot(worlds, [x["peak_bytes"] / 2**30 for x in mine], "s:", label="step peak")
        ax.set_title(kind, fontsize=10)
        ax.set_xlabel("ranks")
        ax.set_xticks(worlds)
    axes[0].set_ylabel("GiB per rank")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"memory per rank, {_device(r)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_gpu_checkpoint_blocking(r: dict, path: Path) -> None:
    rows = r["rows"]
    labels = [f"{x['strategy']} {x['mode']}" for x in rows]
    fig, ax = plt.subplots(figsize=(8, 2.6))
    seconds = [round(x["blocking_s_median"], 4) for x in rows]
    _bars(ax, labels, seconds, f"time a save stops training, {_device(r)}", "s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_gpu_planner(r: dict, path: Path) -> None:
    rows = [x for x in r["rows"] if x.get("measured_bytes", -1) > 0]
    xs = [x["measured_bytes"] / 2**20 for x in rows]
    ys = [x["predicted_measurable_bytes"] / 2**20 for x in rows]
    top = max(xs + ys) * 1.1 if xs else 1.0
    fig, ax = plt.subplots(figsize=(4.5, 4))
    ax.fill_between([0, top], [0, 0.85 * top], [0, 1.15 * top], color="0.9", label="+/-15%")
    ax.plot([0, top], [0, top], "k-", lw=0.8, label="predicted = measured")
    ax.scatter(xs, ys, s=14, color="#4c72b0")
    ax.set_xlabel("torch.cuda.max_memory_allocated (MiB)")
    ax.set_ylabel("predicted (MiB)")
    ax.set_title(f"plan vs the CUDA allocator, {_device(r)}", fontsize=10)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


#: plot name -> (result kind under benchmarks/results, drawing, what the placeholder names)
GPU_PLOTS = {
    "gpu_throughput": ("throughput", plot_gpu_throughput, "tokens/s and MFU of the 370M-parameter language model"),
    "gpu_memory_per_rank": ("memory-per-rank", plot_gpu_memory_per_rank, "memory per rank at 2, 4 and 8 ranks"),
    "gpu_checkpoint_blocking": (
        "checkpoint-blocking",
        plot_gpu_checkpoint_blocking,
        "blocking time of synchronous and asynchronous checkpoints",
    ),
    "gpu_planner": ("planner-vs-allocator", plot_gpu_planner, "the planner's prediction vs the CUDA allocator"),
}


PLOTS = {
    "bench_ddp": plot_ddp,
    "bench_manual_accum": plot_manual,
    "bench_sharded": plot_sharded,
    "bench_checkpointing": plot_checkpointing,
    "bench_precision": plot_precision,
    "bench_lr_recipes": plot_lr,
    "bench_local_sgd": plot_local_sgd,
    "bench_planner": plot_planner,
}


def main(out: Path = OUT, gpu_results: Path = GPU_RESULTS) -> list[Path]:
    results = json.loads(RESULTS.read_text())
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in PLOTS.items():
        path = out / f"{name}.png"
        draw(results[name], path)
        plt.close("all")
        written.append(path)
    for name, (kind, draw_gpu, title) in GPU_PLOTS.items():
        path = out / f"{name}.png"
        result = _newest_gpu_result(kind, gpu_results)
        if result is None:
            _not_measured(path, title)
        else:
            draw_gpu(result, path)
        plt.close("all")
        written.append(path)
    return written


if __name__ == "__main__":
    for p in main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT):
        print(p)
