"""Pure analysis of the DeviceMonitor's gathered timestamps: per-rank phase times, time spent waiting for
other ranks, and the straggler. No torch.distributed here: unit-testable on synthetic timelines.

Each training batch contributes six columns per rank (seconds on a clock common to all ranks):
``[prev_end, start, before_backward, grads_ready, after_backward, end]``. ``prev_end`` is the end of the
previous batch (NaN after an interruption such as validation, so that gap is not counted as data time);
``grads_ready`` is when the last parameter gradient was computed (before DDP waits for its all-reduce; NaN
where it cannot be measured); a batch without a backward has NaN in its backward columns.

Why waiting must be estimated: in synchronous data parallelism every rank's step takes as long as the
slowest rank's, because the fast ranks block inside a collective (DDP's gradient all-reduce, its BatchNorm
buffer broadcast at forward start, FSDP's all-gathers) until the slow one arrives. Timing a rank's phases
alone therefore shows the *fast* rank with the longest forward or backward. All ranks leave a collective at
(nearly) the same instant, so the lead a rank had over the last one to arrive is absorbed there. At every
probe we take each rank's lead over the latest rank; a drop in that lead between two probes is time spent
waiting in that segment. Busy time = elapsed time - waiting; the straggler is the rank with the most busy
time, and the straggler ratio is max busy / min busy.

Limit: a lead that shrinks because the leading rank did more local work in a segment without a collective
(for example rank 0 slow in its data path and rank 1 slow in its forward within the same step) is counted
as waiting too. Real stragglers are usually one rank, one cause; the per-phase columns show which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

PREV_END, START, BEFORE_BACKWARD, GRADS_READY, AFTER_BACKWARD, END = range(6)
COLUMNS = 6
_PHASES = ("data", "forward", "backward", "comm", "optimizer")  # the segments between consecutive columns


@dataclass
class IntervalReport:
    """Per-rank figures for one logging interval, in milliseconds per optimizer step."""

    steps: int
    step_ms: list[float]
    data_ms: list[float]
    forward_ms: list[float]
    backward_ms: list[float]
    comm_ms: list[float]
    optimizer_ms: list[float]
    wait_ms: list[float]
    busy_ms: list[float]
    straggler_rank: int
    straggler_ratio: float
    extra: dict[str, list[float]] = field(default_factory=dict)

    def metrics(self, prefix: str = "device") -> dict[str, float]:
        out: dict[str, float] = {}
        per_rank = {
            "step_ms": self.step_ms,
            "data_ms": self.data_ms,
            "forward_ms": self.forward_ms,
            "backward_ms": self.backward_ms,
            "comm_ms": self.comm_ms,
            "optimizer_ms": self.optimizer_ms,
            "wait_ms": self.wait_ms,
            "busy_ms": self.busy_ms,
            **self.extra,
        }
        for name, values in per_rank.items():
            for rank, v in enumerate(values):
                if not math.isnan(v):
                    out[f"{prefix}/rank{rank}/{name}"] = v
        out[f"{prefix}/imbalance/straggler_ratio"] = self.straggler_ratio
        out[f"{prefix}/imbalance/straggler_rank"] = float(self.straggler_rank)
        out[f"{prefix}/imbalance/max_wait_ms"] = max(self.wait_ms)
        mem = [v for v in self.extra.get("mem_peak_mb", []) if not math.isnan(v) and v > 0]
        if len(mem) == len(self.step_ms) and mem:
            out[f"{prefix}/imbalance/memory_ratio"] = max(mem) / min(mem)
        return out


def analyze(times: torch.Tensor, steps: int) -> IntervalReport:
    """``times``: float64 ``(world, batches, 5)`` on a common clock; ``steps``: optimizer steps in it."""
    if times.dim() != 3 or times.shape[2] != COLUMNS:
        raise ValueError(f"expected (world, batches, {COLUMNS}) timestamps, got {tuple(times.shape)}")
    world, batches, _ = times.shape
    steps = max(steps, 1)
    t = times.to(torch.float64)
    # the probe sequence: start, before_backward, after_backward, end of each batch, preceded by the
    # previous end when the gap to it is a data wait; a column is used only if every rank has it
    seq: list[torch.Tensor] = []
    kinds: list[int] = []  # phase of the segment that ends at this probe; -1: no segment (a break before)
    for b in range(batches):
        connected = not torch.isnan(t[:, b, PREV_END]).any()
        for col in (PREV_END, START, BEFORE_BACKWARD, GRADS_READY, AFTER_BACKWARD, END):
            column = t[:, b, col]
            if torch.isnan(column).any():
                continue  # a missing probe (no backward in this batch): the segment spans it
            if col == PREV_END:
                if not (seq and torch.equal(column, seq[-1])):  # not the previous batch's end already in seq
                    seq.append(column)
                    kinds.append(-1)  # the first batch of an interval: its data wait starts here
                continue
            seq.append(column)
            # after an interruption (validation, a checkpoint) the gap before this start is not data time
            kinds.append(_segment_phase(col, t[:, b]) if connected or col != START else -1)
    phase = {name: torch.zeros(world, dtype=torch.float64) for name in _PHASES}
    wait = torch.zeros(world, dtype=torch.float64)
    elapsed = torch.zeros(world, dtype=torch.float64)
    for i in range(1, len(seq)):
        if kinds[i] < 0:
            continue
        duration = seq[i] - seq[i - 1]
        phase[_PHASES[kinds[i]]] += duration
        elapsed += duration
        lead_before = seq[i - 1].max() - seq[i - 1]
        lead_after = seq[i].max() - seq[i]
        wait += (lead_before - lead_after).clamp(min=0.0)
    busy = elapsed - wait
    ms = 1000.0 / steps
    straggler = int(torch.argmax(busy))
    fastest = float(busy.min())
    ratio = float(busy.max()) / fastest if fastest > 0 else math.inf
    return IntervalReport(
        steps=steps,
        step_ms=(elapsed * ms).tolist(),
        data_ms=(phase["data"] * ms).tolist(),
        forward_ms=(phase["forward"] * ms).tolist(),
        backward_ms=(phase["backward"] * ms).tolist(),
        comm_ms=(phase["comm"] * ms).tolist(),
        optimizer_ms=(phase["optimizer"] * ms).tolist(),
        wait_ms=(wait * ms).tolist(),
        busy_ms=(busy * ms).tolist(),
        straggler_rank=straggler,
        straggler_ratio=ratio,
    )


def _segment_phase(col: int, batch: torch.Tensor) -> int:
    """The phase of the segment ending at ``col`` of one batch, given which earlier columns exist."""
    if col == START:
        return 0  # data: previous end -> start
    if col == BEFORE_BACKWARD:
        return 1  # forward
    if col == GRADS_READY:
        return 2  # backward compute
    if col == AFTER_BACKWARD:
        # the gradient all-reduce's tail (and the wait for slower ranks); all of backward if not measured
        return 3 if not torch.isnan(batch[:, GRADS_READY]).any() else 2
    # end: after the last backward -> end is the optimizer step; without a backward the whole batch is
    # counted as forward (an evaluation-like batch or a skipped step)
    return 4 if not torch.isnan(batch[:, AFTER_BACKWARD]).any() else 1
