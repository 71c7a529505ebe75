"""The memory planner, predicted vs measured, and how long planning takes for 125M, 1B and 7B parameters.

    python benchmarks/bench_planner.py                    # both tables (markdown), a few minutes on 2 CPU cores
    python benchmarks/bench_planner.py --plot planner.png # + predicted vs measured per component (matplotlib)
    python benchmarks/bench_planner.py --skip-big         # only the measured table
    python benchmarks/bench_planner.py --skip-big --json  # + the plot's points as JSON (docs/_data/benchmarks.json)

Measured: one real training step (the second; the first creates the optimizer state) on CPU under torch's
``MemTracker``, on real tensors, for the sample ``DigitsCNN``, ``DigitsTransformer`` and a wider causal
``TransformerLM`` with an embedding. ``mgpu_ddp`` runs in this process (``zero_grad(set_to_none=False)``: the
gradients stay allocated, as in mgpu_ddp's gradient buckets); ``mgpu_zero1`` / ``mgpu_sharded`` /
``mgpu_zero3`` run as rank 0 of 2 on torch's fake process group in this process (collectives allocate their
outputs, move no data). Compared: model states + activations (the prediction less its communication buffers,
which a single process does not hold) for mgpu_ddp / mgpu_zero1, the whole peak for the FSDP stages (on the fake
process group their collectives' buffers are real allocations). Master-weight precisions are predicted only.

Planner time: ``TransformerLM`` configs under FakeTensorMode (meta batch of 8 x 2048 tokens): nothing is
allocated. Times are wall-clock on whatever machine runs this (this project's: 2 shared CPU cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

import torch
from torch import nn

from lightning_mgpu.examples import DigitsCNN, DigitsDataModule, DigitsTransformer
from lightning_mgpu.planning import format_bytes, plan
from lightning_mgpu.planning.lm import RandomTokens, TransformerLM
from lightning_mgpu.planning.measure import fake_process_group, measure_step

COMPONENTS = ("parameters", "gradients", "optimizer_state", "activations")
BIG = {  # name -> TransformerLM arguments
    "125M": {"d_model": 768, "heads": 12, "layers": 12},
    "1B": {"d_model": 2048, "heads": 16, "layers": 18},
    "7B": {"d_model": 4096, "heads": 32, "layers": 32},
}


def _digits() -> Any:
    data = DigitsDataModule(batch_size=32)
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def _tokens() -> Any:
    data = RandomTokens(batch_size=4, seq_len=64, vocab=512)
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def _lm() -> nn.Module:
    return TransformerLM(vocab=512, d_model=128, heads=4, layers=3)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], Any], Any]] = {
    "DigitsCNN": (DigitsCNN, _digits, {"Conv2d"}),
    "DigitsTransformer": (DigitsTransformer, _digits, {"TransformerEncoderLayer", "ConvBlock"}),
    "TransformerLM (d128, 3 layers)": (_lm, _tokens, {"TransformerEncoderLayer"}),
}


def measured_table() -> list[dict[str, Any]]:
    rows = []
    for name, (factory, batch, policy) in MODELS.items():
        p = plan(factory, devices=2, device_memory="8GiB", batch=batch(), activation_checkpointing=policy)
        for row in p.rows:
            measured = None
            if not row.precision.endswith("master"):
                ac = policy if row.activation_checkpointing else None
                if row.strategy == "mgpu_ddp":
                    measured = measure_step(factory, batch(), row.precision, ac, row.strategy)
                else:
                    with fake_process_group(world_size=2):
                        measured = measure_step(factory, batch(), row.precision, ac, row.strategy)
            rows.append({"model": name, "row": row, "measured": measured})
    return rows


def print_measured(rows: list[dict[str, Any]]) -> None:
    print("| model | strategy | AC | precision | predicted | measured peak | error | within 15% |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        row, m = r["row"], r["measured"]
        predicted = row.measurable_bytes
        cells = [r["model"], row.strategy, "yes" if row.activation_checkpointing else "no", row.precision]
        if m is None:
            cells += [format_bytes(predicted), "not measured", "", ""]
        else:
            error = (predicted - m.peak_bytes) / m.peak_bytes
            ok = "yes" if abs(error) <= 0.15 else "NO"
            cells += [format_bytes(predicted), format_bytes(m.peak_bytes), f"{error:+.1%}", ok]
        print("| " + " | ".join(cells) + " |")


def print_times() -> None:
    tokens = torch.zeros(8, 2048, dtype=torch.long, device="meta")
    print("\n| config | parameters | planner time (s) | recommended on 8 x 80GiB | its peak/rank |")
    print("|---|---|---|---|---|")
    for name, kwargs in BIG.items():
        start = time.perf_counter()
        p = plan(
            lambda kw=kwargs: TransformerLM(**kw),
            devices=8,
            device_memory="80GiB",
            batch=(tokens, tokens),
            require_fit=False,
        )
        seconds = time.perf_counter() - start
        best = p.recommended
        choice = f"{best.strategy}, {best.precision}, AC={best.activation_checkpointing}" if best else "nothing fits"
        peak = format_bytes(best.predicted_peak_bytes_per_rank) if best else ""
        print(f"| {name} | {p.states.parameter_count:,} | {seconds:.1f} | {choice} | {peak} |")
        sys.stdout.flush()


def plot_points(rows: list[dict[str, Any]]) -> dict[str, list[list[float]]]:
    """Per component (and "total"): ``[measured, predicted]`` MiB of every measured candidate."""
    points: dict[str, list[list[float]]] = {}
    for component in (*COMPONENTS, "total"):
        pairs = []
        for r in rows:
            if r["measured"] is None:
                continue
            if component == "total":  # the checked number: the peak (measurable_bytes)
                pair = (r["measured"].peak_bytes, r["row"].measurable_bytes)
            else:  # components as MemTracker splits the peak snapshot
                pair = (getattr(r["measured"], component), getattr(r["row"], f"{component}_bytes"))
            pairs.append([round(pair[0] / 2**20, 4), round(pair[1] / 2**20, 4)])
        points[component] = pairs
    return points


def save_plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (*COMPONENTS, "total")
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4))
    for ax, component in zip(axes, panels):
        xs, ys = [], []
        for r in rows:
            if r["measured"] is None:
                continue
            # components as MemTracker splits the peak snapshot; "total": the checked number (measurable_bytes)
            if component == "total":
                xs.append(r["measured"].peak_bytes / 2**20)
                ys.append(r["row"].measurable_bytes / 2**20)
            else:
                xs.append(getattr(r["measured"], component) / 2**20)
                ys.append(getattr(r["row"], f"{component}_bytes") / 2**20)
        top = max(xs + ys) * 1.1 if xs else 1
        ax.plot([0, top], [0, top], "k-", lw=0.8, label="predicted = measured")
        ax.fill_between([0, top], [0, 0.85 * top], [0, 1.15 * top], color="0.9", label="+/-15%")
        ax.scatter(xs, ys, s=14)
        ax.set_title(component.replace("_", " "))
        ax.set_xlabel("measured at the peak (MiB)")
        ax.set_ylabel("predicted (MiB)")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle("lightning-mgpu plan: predicted vs measured per rank, every measured candidate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plot", help="save predicted vs measured per component to this PNG")
    parser.add_argument("--skip-big", action="store_true", help="skip the 125M/1B/7B planner timings")
    parser.add_argument("--json", action="store_true", help="print the plot's points (MiB) as one JSON object")
    args = parser.parse_args(argv)
    rows = measured_table()
    print_measured(rows)
    if args.plot:
        save_plot(rows, args.plot)
    if args.json:
        print("\n" + json.dumps(plot_points(rows)))
    if not args.skip_big:
        print_times()
    return 0


if __name__ == "__main__":
    sys.exit(main())
