"""The memory plan: every candidate's predicted peak per rank, whether it fits, and the one to use.

Per rank, for a data-parallel world of ``N`` ranks (``P`` parameters, ``G`` gradients, ``O`` optimizer state
of one full replica, counted exactly under FakeTensorMode; ``A(t)`` and ``G(t)`` the activations and gradients
traced op by op through one micro-batch; ``U`` the largest FSDP unit's share of the parameters, ``R`` the
root unit's):

==============  ==========================  ==================  =========  =====================================
strategy        parameters                  gradients           optimizer  communication buffers
==============  ==========================  ==================  =========  =====================================
mgpu_ddp        P                           G (bucket views)    O          one gradient bucket (bucket_cap_mb),
                                                                           and G while the buckets are rebuilt
mgpu_zero1      P                           G                   O / N      likewise
mgpu_sharded    P / N + P (all gathered     G(t) / N            O / N      reduce-scatter of the largest unit
                from forward to backward)                                  (U G (1 + 1/N))
mgpu_zero3      P / N + R P (root stays     G(t) / N            O / N      max(all-gather of two units, 2 U P
                gathered)                                                  in forward; one unit + reduce-scatter
                                                                           in backward)
mgpu_hsdp       as mgpu_zero3 with N the    G(t) / S            O / S      as mgpu_zero3 with S (the shard's
                shard group S (the ranks                                   all-reduce across machines reuses the
                of one machine)                                            reduce-scatter's output)
==============  ==========================  ==================  =========  =====================================

DDP's reducer counts G once more: it rebuilds its buckets once, in the order the first backward produced the
gradients, at the start of the second step, and may allocate the new buckets before the first ones are freed
(PyTorch's reducer says so where it does it). On one H100 the CUDA allocator's peak over the second step was one G
above the model states and activations in all five DDP rows of the planner benchmark, and in one of three runs of
the same row it was not; from the third step on one G is held.

plus ``A(t)`` in forward/backward (the sharded rows take the largest ``A(t) + G(t) / N``). The optimizer step
is a second phase (no activations, but the step's own temporaries); the peak is the larger phase. Master-weight
precisions hold half weights and gradients and an FP32 master copy (under FSDP the master *is* the sharded
parameter, and the sharded gradients are FP32).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Optional

from lightning_mgpu.planning.request import LINK_SPEEDS, PlanError, PlanRequest, format_bytes, layout_label
from lightning_mgpu.planning.trace import PRECISION_LAYOUT, ModelStates, StepTrace

__all__ = ["ORDER", "NoPlanFits", "Plan", "PlanRow", "candidate_row", "estimate", "no_fit"]

STRATEGY_RANK = {"mgpu_ddp": 0, "mgpu_zero1": 1, "mgpu_sharded": 2, "mgpu_hsdp": 3, "mgpu_zero3": 4}
PRECISION_RANK = {"32-true": 0, "bf16-mixed": 1, "16-mixed": 2, "bf16-master": 3, "16-master": 4}
ORDER = (
    "precision first (32-true, bf16-mixed, 16-mixed, bf16-master, 16-master: a plan never changes the numerics "
    "when the model fits without), then no activation checkpointing before checkpointing (it costs a second "
    "forward), then mgpu_ddp, mgpu_zero1, mgpu_sharded, mgpu_hsdp (several machines only: sharded within a machine, "
    "one all-reduce of the shards between machines per step), mgpu_zero3 (less communication first)"
)


@dataclass(frozen=True)
class PlanRow:
    """One candidate: its predicted peak per rank, split by component, and whether it fits."""

    strategy: str
    activation_checkpointing: bool
    precision: str
    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    communication_bytes: int
    predicted_peak_bytes_per_rank: int
    phase: str
    """``"forward/backward"`` or ``"optimizer step"``: where the peak is."""
    fits: bool
    recommended: bool = False
    states_bytes: int = 0
    """The parameters, gradients and optimizer state a rank holds once the optimizer has stepped (its shards under
    FSDP; the step's temporaries freed): what it keeps between steps. Offloaded: what it keeps on the device."""
    host_bytes: int = 0
    """Offloaded (:attr:`PlanRequest.offload`): the host memory one rank holds, its parameter shards, gradient shards
    and optimizer state (with the step's temporaries: the optimizer steps on the host); 0 otherwise."""
    transfer_bytes: int = 0
    """Offloaded: the bytes one rank moves between host and device per micro-batch (its parameter shards to the
    device for the forward's and the backward's all-gathers, its gradient shards back); 0 otherwise."""

    @property
    def transfer_seconds(self) -> float:
        """:attr:`transfer_bytes` over the host link at its nominal speed (``LINK_SPEEDS["pcie"]``, one direction at a
        time): what offload adds to each micro-batch where the transfers do not overlap compute (the layouts' step
        time counts it so)."""
        return self.transfer_bytes / (LINK_SPEEDS["pcie"] * 1e9)

    @property
    def model_states_and_activations(self) -> int:
        """The peak less the communication buffers."""
        return self.predicted_peak_bytes_per_rank - self.communication_bytes

    @property
    def measurable_bytes(self) -> int:
        """What :func:`~lightning_mgpu.planning.measure.measure_step` can check: the model states and activations
        for mgpu_ddp / mgpu_zero1 (one process, no DDP reducer), the whole peak for the FSDP stages (on the fake
        process group the collectives' buffers are allocated for real)."""
        if self.strategy in ("mgpu_ddp", "mgpu_zero1"):
            return self.model_states_and_activations
        return self.predicted_peak_bytes_per_rank

    @property
    def one_device_bytes(self) -> int:
        """What the CUDA allocator can show on one device (DDP at world size 1): for mgpu_ddp / mgpu_zero1 the
        model states and activations plus the first buckets held while DDP rebuilds them on the second step (a
        single rank's gradients are its buckets: no bucket in flight beside them); for the FSDP stages the whole
        peak."""
        return (
            self.model_states_and_activations + self.rebuilt_buckets_bytes
            if self._ddp_peak
            else self.predicted_peak_bytes_per_rank
        )

    @property
    def rebuilt_buckets_bytes(self) -> int:
        """The first gradient buckets DDP may still hold beside the rebuilt ones at the start of the second step (0
        for the FSDP stages). Whether it does depends on when the allocator gets them back, so the plan counts them
        (a bound); on one device a measured peak lies between ``one_device_bytes - rebuilt_buckets_bytes`` and
        ``one_device_bytes``."""
        return self.gradients_bytes if self._ddp_peak else 0

    @property
    def _ddp_peak(self) -> bool:
        return self.strategy in ("mgpu_ddp", "mgpu_zero1") and self.phase == "forward/backward"

    @property
    def sort_key(self) -> tuple[int, int, int]:
        return (PRECISION_RANK[self.precision], int(self.activation_checkpointing), STRATEGY_RANK[self.strategy])


_BUILT = {
    "fake": "FakeTensorMode, nothing allocated",
    "meta": "built once on the meta device, then FakeTensorMode: nothing allocated",
    "cpu": "built once on CPU (its constructor fails under fake tensors and on the meta device), then FakeTensorMode",
}


class NoPlanFits(PlanError):
    """No candidate fits the device memory; ``.plan`` holds the table."""

    def __init__(self, message: str, plan: Plan) -> None:
        super().__init__(message)
        self.plan = plan


def candidate_row(
    strategy: str,
    states: ModelStates,
    trace: StepTrace,
    units: tuple[float, float],
    request: PlanRequest,
    usable: int,
    rebuilt_buckets: bool = True,
) -> PlanRow:
    """The predicted peak per rank of ``strategy`` over ``request.devices`` ranks (the table above); the layout plan
    calls it with the piece of the model one rank of a tensor/pipeline split holds. ``rebuilt_buckets``: the data
    dimension is DDP's reducer, which rebuilds its buckets on the second step (a pipeline's replicas are not)."""
    # mgpu_hsdp: the states are sharded over the ranks of one machine only (the replicas hold the same shards)
    n = request.shard_size if strategy == "mgpu_hsdp" else request.devices
    _, _, master = PRECISION_LAYOUT[trace.precision]
    fp32 = sum(states.parameters.values())
    p_c, g, a, b = trace.parameters, trace.gradients, trace.activations, states.buffers
    p_m = fp32 if master else 0
    # only the trainable parameters have gradients: FP32 ones of their masters in the master modes
    g_m = states.trainable_bytes if master else 0
    opt, opt_tmp = states.optimizer_state, states.optimizer_transient
    bucket = min(int(request.bucket_cap_mb * 2**20), g)
    largest, root = units
    if strategy in ("mgpu_ddp", "mgpu_zero1"):
        o = opt if strategy == "mgpu_ddp" else opt // n
        tmp = opt_tmp if strategy == "mgpu_ddp" else opt_tmp // n
        params = p_c + (states.optimized_bytes if master else 0) + b  # masters of the optimizers' parameters
        # gradient_as_bucket_view (mgpu_ddp's default): every gradient lives in its bucket from the first step on;
        # the second step rebuilds the buckets and may hold the first ones beside the new (the docstring above)
        fb = (params, g, o, a, bucket + (g if rebuilt_buckets else 0))
        # the step: FP32 gradients of the masters (master modes) and the optimizer's temporaries, no activations
        step = (params, g + g_m, o + tmp, 0, 0)
        held = params + g + o
    else:
        shard_p = (p_m if master else p_c) // n
        shard_g = (g_m if master else g) // n
        # gradients are reduce-scattered unit by unit as backward produces them: a rank keeps 1/N of each
        acts_and_grads = trace.peak_with_gradients(shard_g / g if g else 0.0)
        grads_at_peak = max(0, acts_and_grads - a)
        reduce_scatter = int(largest * g) + int(largest * g) // n  # the largest unit's unsharded gradient + shard
        if strategy == "mgpu_sharded":  # reshard_after_forward=False: every unit stays gathered until backward
            fb = (shard_p + p_c + b, grads_at_peak, opt // n, a, reduce_scatter)
        else:
            # The root stays gathered (FSDP2). Forward: the current unit and the prefetched next one are gathered.
            # Backward: a unit is resharded before its gradients are reduce-scattered, so one gathered unit (the
            # prefetched next) sits beside the reduce-scatter buffers.
            unit_p = int(largest * p_c)
            buffers = max(2 * unit_p, unit_p + reduce_scatter)
            fb = (shard_p + int(root * p_c) + b, grads_at_peak, opt // n, a, buffers)
        step = (shard_p + b, shard_g, opt // n + opt_tmp // n, 0, 0)
        held = shard_p + b + shard_g + opt // n
        if request.offload:  # FSDP2's CPUOffloadPolicy: the shards, their gradients and the optimizer on the host
            # a 4-bit base over one shard stays outside FSDP2, whole on the device (parts/sharding.py): not offloaded
            kept = states.parameters.get("nf4", 0) if n == 1 else 0
            offloaded = shard_p - kept
            host = offloaded + shard_g + opt // n + opt_tmp // n
            # each all-gather copies the rank's shards to the device (forward, and backward where stage 3 freed
            # them), each reduce-scatter's output goes back; the gathered units and activations stay on the device
            gathers = 2 if strategy != "mgpu_sharded" else 1
            parts = (fb[0] - offloaded, 0, 0, fb[3], fb[4])  # the optimizer steps on the host: no device phase
            peak = sum(parts)
            return PlanRow(
                strategy, trace.activation_checkpointing, trace.precision, *parts, peak, "forward/backward",
                peak <= usable and request.host_holds(host), False, b + kept, host, gathers * offloaded + shard_g,
            )  # fmt: skip
    phase, parts = ("forward/backward", fb) if sum(fb) >= sum(step) else ("optimizer step", step)
    peak = sum(parts)
    return PlanRow(
        strategy, trace.activation_checkpointing, trace.precision, *parts, peak, phase, peak <= usable, False, held
    )


@dataclass
class Plan:
    """Every candidate for one model and request, fastest first (:data:`ORDER`), and the recommendation."""

    model: str
    request: PlanRequest
    states: ModelStates
    rows: list[PlanRow]
    seconds: float = 0.0
    checkpointed: tuple[str, ...] = field(default_factory=tuple)
    built: str = "fake"
    """How the model was built to plan it: ``"fake"`` (under FakeTensorMode), or once on ``"meta"`` or ``"cpu"``
    when its constructor fails under fake tensors (then traced as fake copies of that build)."""

    @property
    def recommended(self) -> Optional[PlanRow]:
        return next((r for r in self.rows if r.recommended), None)

    def row(self, strategy: str, precision: str = "32-true", activation_checkpointing: bool = False) -> PlanRow:
        """The row of one candidate."""
        for r in self.rows:
            if (r.strategy, r.precision, r.activation_checkpointing) == (strategy, precision, activation_checkpointing):
                return r
        raise KeyError((strategy, precision, activation_checkpointing))

    def label(self, row: PlanRow) -> str:
        """The row's layout label, as the layout plan names the same layout (``"mgpu_sharded 8"``,
        ``"mgpu_hsdp 2x8"``: :func:`~lightning_mgpu.planning.request.layout_label`)."""
        req = self.request
        if row.strategy == "mgpu_hsdp":
            return layout_label(row.strategy, req.num_nodes, req.shard_size)
        return layout_label(row.strategy, 1, req.devices)

    def to_json(self) -> str:
        """The rows as a JSON list (``lightning-mgpu plan --json``), each with its ``layout`` label."""
        return json.dumps([{**asdict(r), "layout": self.label(r)} for r in self.rows], indent=2)

    def _cell(self, row: PlanRow, column: int, size: int) -> str:
        """A size, and why when it is zero (a zero reads as a component the planner missed otherwise)."""
        if size:
            return format_bytes(size)
        why = {
            1: "no trainable parameter" if not self.states.trainable_count else "none yet at the peak",
            2: f"{'+'.join(self.states.optimizer_names)} keeps no state",
            4: "no gradient to sync",
        }.get(column)
        if column in (0, 1, 2) and row.host_bytes:  # offloaded: the shards, gradients and optimizer state
            why = "on the host"
        if column == 3:  # activations
            why = "the traced step kept none"
        if column in (3, 4) and row.phase == "optimizer step":
            why = "the peak is the optimizer step: none is live then"
        return f"0 B ({why})" if why else format_bytes(size)

    def table(self, recommendation: bool = True) -> str:
        """A markdown table of every candidate (by its layout label), then the recommendation (not with
        ``recommendation=False``: ``lightning-mgpu plan`` states its one recommendation above the tables)."""
        offload = self.request.offload
        head = "| layout | AC | precision | params | grads | optimizer | activations | comm | peak/rank |"
        head += " host/rank | host<->device | fits |" if offload else " fits |"
        lines = [head, "|" + "---|" * (12 if offload else 10)]
        for r in self.rows:
            mark = " **<- recommended**" if r.recommended else ""
            sizes = [
                r.parameters_bytes,
                r.gradients_bytes,
                r.optimizer_state_bytes,
                r.activations_bytes,
                r.communication_bytes,
                r.predicted_peak_bytes_per_rank,
            ]
            cells = [self.label(r), "yes" if r.activation_checkpointing else "no", r.precision]
            cells += [self._cell(r, i, s) for i, s in enumerate(sizes)]
            if offload:  # mgpu_ddp and mgpu_zero1 do not offload
                moved = f"{format_bytes(r.transfer_bytes)} ({r.transfer_seconds * 1e3:.1f} ms)"
                cells += [format_bytes(r.host_bytes), moved] if r.host_bytes else ["-", "-"]
            cells += [("yes" if r.fits else "no") + mark]
            lines.append("| " + " | ".join(cells) + " |")
        s, req = self.states, self.request
        lines.append("")
        if offload:
            host = (
                f"{format_bytes(req.usable_host_bytes)} usable per rank ({format_bytes(req.host_memory_bytes or 0)} "
                f"per machine less {req.headroom:.0%}, over its {req.devices // req.num_nodes} ranks)"
                if req.usable_host_bytes is not None
                else "not checked (give host_memory)"
            )
            lines.append(
                f"Offloaded (offload='cpu'): the sharded rows keep their shards, gradients and optimizer state in host "
                f"memory (host/rank; host memory {host}); host<->device: the bytes a rank moves per micro-batch, and "
                f"their time at {LINK_SPEEDS['pcie']:g} GB/s (PCIe 4.0 x16) where they do not overlap compute."
            )
        lines.append(
            f"{self.model}: {s.parameter_count:,} parameters ({s.trainable_count:,} trainable"
            f"{f', {s.four_bit_count:,} in 4 bits' if s.four_bit_count else ''}), optimizer "
            f"{'+'.join(s.optimizer_names)}; {req.devices} ranks x {format_bytes(req.device_memory_bytes)}, "
            f"{req.headroom:.0%} headroom -> {format_bytes(req.usable_bytes)} usable per rank; planned in "
            f"{self.seconds:.2f} s ({_BUILT[self.built]})."
        )
        best = self.recommended
        if best is not None and recommendation:
            lines.append(
                f"Recommended: strategy={best.strategy!r}, precision={best.precision!r}, activation_checkpointing="
                f"{best.activation_checkpointing} ({format_bytes(best.predicted_peak_bytes_per_rank)} per rank). "
                f"Order: {ORDER}."
            )
        return "\n".join(lines)


def estimate(
    name: str,
    request: PlanRequest,
    states: ModelStates,
    traces: list[StepTrace],
    units: tuple[float, float],
    seconds: float = 0.0,
    require_fit: bool = True,
    built: str = "fake",
) -> Plan:
    """Combine the counted states and traces into one row per candidate and pick the recommendation."""
    usable = request.usable_bytes
    rows = sorted(
        (candidate_row(s, states, t, units, request, usable) for t in traces for s in request.candidates()),
        key=lambda r: r.sort_key,
    )
    best = next((r for r in rows if r.fits), None)
    rows = [PlanRow(**{**asdict(r), "recommended": r is best}) for r in rows]
    checkpointed = next((t.checkpointed for t in traces if t.checkpointed), ())
    result = Plan(name, request, states, rows, seconds, checkpointed, built)
    if best is None and require_fit:
        raise no_fit(result)
    return result


def no_fit(result: Plan) -> NoPlanFits:
    """The error of a plan where nothing fits: the smallest candidate and its shortfall (of host memory where an
    offloaded candidate fits the device but not the host)."""
    request, usable = result.request, result.request.usable_bytes
    smallest = min(result.rows, key=lambda r: r.predicted_peak_bytes_per_rank)
    host = request.usable_host_bytes
    if smallest.predicted_peak_bytes_per_rank <= usable and host is not None:  # the device holds it: the host not
        return NoPlanFits(
            f"no candidate fits host_memory={request.host_memory!r} with {request.headroom:.0%} headroom "
            f"({format_bytes(host)} usable per rank, over {request.devices // request.num_nodes} ranks a machine) "
            f"offloaded on {request.devices} ranks. The smallest offloaded plan, strategy={smallest.strategy!r} "
            f"precision={smallest.precision!r} activation_checkpointing={smallest.activation_checkpointing}, fits "
            f"the device but holds {format_bytes(smallest.host_bytes)} per rank in host memory, "
            f"{format_bytes(smallest.host_bytes - host)} over. Use machines with more host memory, more of them "
            f"(the shards shrink with the ranks), or fewer ranks per machine.",
            result,
        )
    miss = smallest.predicted_peak_bytes_per_rank - usable
    return NoPlanFits(
        f"no candidate fits device_memory={request.device_memory!r} with {request.headroom:.0%} headroom "
        f"({format_bytes(usable)} usable per rank) on {request.devices} ranks. The smallest plan, "
        f"strategy={smallest.strategy!r} precision={smallest.precision!r} activation_checkpointing="
        f"{smallest.activation_checkpointing}, needs {format_bytes(smallest.predicted_peak_bytes_per_rank)} per "
        f"rank and misses by {format_bytes(miss)}. Use more devices (sharded states shrink with --devices), a "
        f"smaller micro-batch, devices with more memory, or a layout that splits the model (lightning-mgpu plan "
        f"lists them: tensor and pipeline splits).",
        result,
    )
