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
    """``times``: float64 ``(world, batches, 6)`` on a common clock; ``steps``: optimizer steps in it.
    (Plain Python on the few hundred numbers of an interval: faster than torch ops on tiny tensors.)"""
    if times.dim() != 3 or times.shape[2] != COLUMNS:
        raise ValueError(f"expected (world, batches, {COLUMNS}) timestamps, got {tuple(times.shape)}")
    world = times.shape[0]
    steps = max(steps, 1)
    per_batch = times.to(torch.float64).permute(1, 2, 0).tolist()  # [batch][column][rank]
    # the probe sequence: start, before_backward, grads_ready, after_backward, end of each batch, preceded by
    # the previous end when the gap to it is a data wait; a column is used only if every rank has it
    seq: list[list[float]] = []
    kinds: list[int] = []  # phase of the segment that ends at this probe; -1: no segment (a break before)
    for batch in per_batch:
        present = [not any(math.isnan(v) for v in column) for column in batch]
        for col in (PREV_END, START, BEFORE_BACKWARD, GRADS_READY, AFTER_BACKWARD, END):
            if not present[col]:
                continue  # a missing probe (no backward in this batch): the segment spans it
            if col == PREV_END:
                if not (seq and batch[col] == seq[-1]):  # not the previous batch's end already in seq
                    seq.append(batch[col])
                    kinds.append(-1)  # the first batch of an interval: its data wait starts here
                continue
            seq.append(batch[col])
            # after an interruption (validation, a checkpoint) the gap before this start is not data time
            kinds.append(_segment_phase(col, present) if present[PREV_END] or col != START else -1)
    phase = [[0.0] * world for _ in _PHASES]
    wait = [0.0] * world
    elapsed = [0.0] * world
    for i in range(1, len(seq)):
        if kinds[i] < 0:
            continue
        before, after = seq[i - 1], seq[i]
        latest_before, latest_after = max(before), max(after)
        for r in range(world):
            duration = after[r] - before[r]
            phase[kinds[i]][r] += duration
            elapsed[r] += duration
            wait[r] += max((latest_before - before[r]) - (latest_after - after[r]), 0.0)
    busy = [e - w for e, w in zip(elapsed, wait)]
    ms = 1000.0 / steps
    straggler = max(range(world), key=busy.__getitem__)
    fastest = min(busy)
    ratio = max(busy) / fastest if fastest > 0 else math.inf

    def per_step(values: list[float]) -> list[float]:
        return [v * ms for v in values]

    return IntervalReport(
        steps=steps,
        step_ms=per_step(elapsed),
        data_ms=per_step(phase[0]),
        forward_ms=per_step(phase[1]),
        backward_ms=per_step(phase[2]),
        comm_ms=per_step(phase[3]),
        optimizer_ms=per_step(phase[4]),
        wait_ms=per_step(wait),
        busy_ms=per_step(busy),
        straggler_rank=straggler,
        straggler_ratio=ratio,
    )


def _segment_phase(col: int, present: list[bool]) -> int:
    """The phase of the segment ending at ``col`` of one batch, given which of its columns exist."""
    if col == START:
        return 0  # data: previous end -> start
    if col == BEFORE_BACKWARD:
        return 1  # forward
    if col == GRADS_READY:
        return 2  # backward compute
    if col == AFTER_BACKWARD:
        # the gradient all-reduce's tail (and the wait for slower ranks); all of backward if not measured
        return 3 if present[GRADS_READY] else 2
    # end: after the last backward -> end is the optimizer step; without a backward the whole batch is
    # counted as forward (an evaluation-like batch or a skipped step)
    return 4 if present[AFTER_BACKWARD] else 1
