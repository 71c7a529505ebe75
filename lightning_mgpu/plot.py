"""Plots of :class:`~lightning_mgpu.DeviceMonitor` logs (needs matplotlib: ``pip install lightning-mgpu[plot]``).

Every function takes a CSVLogger directory (the one holding ``metrics.csv``, e.g. ``trainer.logger.log_dir``)
or the ``metrics.csv`` path, and an optional matplotlib ``Axes``; it returns the ``Axes`` it drew on::

    from lightning_mgpu import plot
    fig = plot.dashboard(trainer.logger.log_dir)   # per-rank time breakdown, busy time, memory, straggler ratio
    fig.savefig("ranks.png")
"""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path
from typing import Any, Optional, Union

__all__ = ["dashboard", "plot_memory", "plot_rank_metric", "plot_straggler", "plot_time_breakdown", "read_metrics"]

PHASES = ("data_ms", "forward_ms", "backward_ms", "comm_ms", "optimizer_ms")
_RANK_KEY = re.compile(r"^(?P<prefix>[^/]+)/rank(?P<rank>\d+)/(?P<name>.+)$")


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError as err:  # an optional extra
        raise ImportError("lightning_mgpu.plot needs matplotlib: `pip install lightning-mgpu[plot]`.") from err
    return plt


def read_metrics(log_dir: Union[str, Path]) -> dict[str, list[tuple[int, float]]]:
    """``{metric: [(step, value), ...]}`` from a CSVLogger's ``metrics.csv`` (empty cells skipped)."""
    path = Path(log_dir)
    if path.is_dir():
        path = path / "metrics.csv"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: pass the CSVLogger's log directory (trainer.logger.log_dir), the one with "
            f"metrics.csv, and log with CSVLogger(...) and DeviceMonitor() in the Trainer."
        )
    series: dict[str, list[tuple[int, float]]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            step = int(float(row.get("step") or 0))
            for key, value in row.items():
                if key in ("step", "epoch") or value in (None, ""):
                    continue
                series.setdefault(key, []).append((step, float(value)))
    return series


def _per_rank(series: dict[str, list[tuple[int, float]]], prefix: str) -> dict[int, dict[str, list[tuple[int, float]]]]:
    ranks: dict[int, dict[str, list[tuple[int, float]]]] = {}
    for key, values in series.items():
        m = _RANK_KEY.match(key)
        if m and m["prefix"] == prefix:
            ranks.setdefault(int(m["rank"]), {})[m["name"]] = values
    if not ranks:
        raise ValueError(f"no {prefix}/rank*/... metrics in this log: was DeviceMonitor(prefix={prefix!r}) a callback?")
    return dict(sorted(ranks.items()))


def _axes(ax: Any) -> Any:
    return ax if ax is not None else _pyplot().subplots(figsize=(6, 3.5))[1]


def _mean(values: list[tuple[int, float]]) -> float:
    finite = [v for _, v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


def plot_time_breakdown(log_dir: Union[str, Path], ax: Any = None, prefix: str = "device") -> Any:
    """Stacked bars, one per rank: mean ms per step in data wait, forward, backward, gradient communication
    and optimizer (together the step time), with a black tick at the rank's own work (``busy_ms``): the gap
    above the tick is time spent waiting for other ranks. The straggler's tick is at the top of its bar."""
    ranks = _per_rank(read_metrics(log_dir), prefix)
    ax = _axes(ax)
    bottoms = [0.0] * len(ranks)
    labels = [f"rank {r}" for r in ranks]
    for phase in PHASES:
        heights = [_mean(m.get(phase, [])) for m in ranks.values()]
        heights = [0.0 if math.isnan(h) else h for h in heights]
        ax.bar(labels, heights, bottom=bottoms, label=phase.removesuffix("_ms"))
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    busy = [_mean(m.get("busy_ms", [])) for m in ranks.values()]
    ax.scatter(labels, busy, marker="_", s=900, color="black", label="busy (own work)", zorder=3)
    ax.set_ylabel("ms per optimizer step (mean)")
    ax.set_title("Where each rank's step goes")
    # the legend in a band above the tallest bar, so that it covers no rank's bar
    top = max([*bottoms, *(b for b in busy if not math.isnan(b))], default=0.0)
    if top > 0:
        ax.set_ylim(0, top * 1.45)
    ax.legend(fontsize="small", loc="upper center", ncol=3)
    return ax


def plot_rank_metric(log_dir: Union[str, Path], metric: str = "busy_ms", ax: Any = None, prefix: str = "device") -> Any:
    """One line per rank of ``{prefix}/rank{r}/{metric}`` against the global step."""
    ranks = _per_rank(read_metrics(log_dir), prefix)
    ax = _axes(ax)
    for rank, metrics in ranks.items():
        if metric not in metrics:
            raise ValueError(f"no {prefix}/rank{rank}/{metric} in this log; available: {sorted(metrics)}")
        steps, values = zip(*metrics[metric])
        ax.plot(steps, values, marker="o", label=f"rank {rank}")
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(_TITLES.get(metric, f"{metric} per rank"))
    ax.legend(fontsize="small")
    return ax


_TITLES = {"busy_ms": "Each rank's own work per step (busy_ms)", "step_ms": "Step time per rank (step_ms)"}


def plot_memory(log_dir: Union[str, Path], ax: Any = None, prefix: str = "device") -> Any:
    """Bars of each rank's largest ``mem_peak_mb`` over the run."""
    ranks = _per_rank(read_metrics(log_dir), prefix)
    ax = _axes(ax)
    peaks = [max((v for _, v in m.get("mem_peak_mb", [])), default=0.0) for m in ranks.values()]
    ax.bar([f"rank {r}" for r in ranks], peaks, color="tab:purple")
    ax.set_ylabel("peak memory (MB)")
    ax.set_title("Peak memory per rank")
    return ax


def plot_straggler(log_dir: Union[str, Path], ax: Any = None, prefix: str = "device") -> Any:
    """The straggler ratio (max/min busy time across ranks) against the step, each point labelled with the
    straggler's rank."""
    series = read_metrics(log_dir)
    key = f"{prefix}/imbalance/straggler_ratio"
    if key not in series:
        raise ValueError(f"no {key} in this log: was DeviceMonitor(prefix={prefix!r}) a callback?")
    ax = _axes(ax)
    steps, ratios = zip(*series[key])
    ax.plot(steps, ratios, marker="o", color="tab:red")
    for (step, rank), ratio in zip(series.get(f"{prefix}/imbalance/straggler_rank", []), ratios):
        ax.annotate(f"r{int(rank)}", (step, ratio), fontsize="x-small")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("slowest / fastest busy time")
    ax.set_title("Straggler ratio (label: the slowest rank)")
    return ax


def dashboard(log_dir: Union[str, Path], prefix: str = "device", figsize: Optional[tuple[float, float]] = None) -> Any:
    """A 2x2 figure: time breakdown, busy time per rank, peak memory, straggler ratio."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=figsize or (11, 7))
    plot_time_breakdown(log_dir, axes[0][0], prefix)
    plot_rank_metric(log_dir, "busy_ms", axes[0][1], prefix)
    plot_memory(log_dir, axes[1][0], prefix)
    plot_straggler(log_dir, axes[1][1], prefix)
    fig.tight_layout()
    return fig
