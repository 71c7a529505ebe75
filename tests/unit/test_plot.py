"""The dashboard (lightning_mgpu/plot.py) drawn from a DeviceMonitor-style CSV log: every panel has a title, and the
time breakdown's legend covers no rank's bar (rank 1, the straggler, has the tallest)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from lightning_mgpu import plot  # noqa: E402  (after choosing the backend)

PHASES = {"data_ms": 2.0, "forward_ms": 10.0, "backward_ms": 20.0, "comm_ms": 25.0, "optimizer_ms": 3.0}


def _log(folder: Path) -> Path:
    keys = [f"device/rank{r}/{k}" for r in (0, 1) for k in (*PHASES, "busy_ms", "mem_peak_mb")]
    keys += ["device/imbalance/straggler_ratio", "device/imbalance/straggler_rank"]
    with (folder / "metrics.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, ["step", "epoch", *keys])
        writer.writeheader()
        for step in range(1, 6):
            row: dict[str, float] = {"step": step, "epoch": 0}
            for rank in (0, 1):
                slow = 20.0 * rank  # rank 1 computes longer, rank 0 waits for it in the all-reduce
                phases = {**PHASES, "forward_ms": 10.0 + slow, "backward_ms": 20.0 + slow, "comm_ms": 25.0 - 19 * rank}
                row.update({f"device/rank{rank}/{k}": v for k, v in phases.items()})
                row[f"device/rank{rank}/busy_ms"] = 35.0 + 2 * slow
                row[f"device/rank{rank}/mem_peak_mb"] = 400.0 + rank
            row["device/imbalance/straggler_ratio"] = 75.0 / 35.0
            row["device/imbalance/straggler_rank"] = 1
            writer.writerow(row)
    return folder


def test_every_dashboard_panel_has_a_title(tmp_path):
    fig = plot.dashboard(_log(tmp_path))
    titles = [ax.get_title() for ax in fig.axes]
    assert len(titles) == 4 and all(titles), titles
    assert titles[1] == "Each rank's own work per step (busy_ms)"
    assert titles[3] == "Straggler ratio (label: the slowest rank)"


def test_the_breakdown_legend_covers_no_bar(tmp_path):
    fig = plot.dashboard(_log(tmp_path))
    fig.canvas.draw()
    breakdown = fig.axes[0]
    legend = breakdown.get_legend().get_window_extent()
    bars = [patch.get_window_extent() for container in breakdown.containers for patch in container]
    assert len(bars) == 10  # 5 phases x 2 ranks
    assert not [bar for bar in bars if bar.overlaps(legend)]
