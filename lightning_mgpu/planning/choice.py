"""What ``mgpu_auto`` takes from a plan: the strategy to build, why, and the device memory it planned for."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from lightning_mgpu.planning.candidates import NoPlanFits, Plan, no_fit
from lightning_mgpu.planning.layouts import Layout, LayoutPlan, short_reason
from lightning_mgpu.planning.request import PRECISIONS, PlanError, format_bytes, parse_memory

__all__ = [
    "AutoDecision",
    "decide",
    "decide_layout",
    "device_memory_bytes",
    "fallback",
    "no_layout_fits",
    "planner_precision",
]

#: the arguments that build each candidate from :class:`~lightning_mgpu.MGPUShardedStrategy` (None: mgpu_ddp)
STAGES: dict[str, Optional[int]] = {
    "mgpu_ddp": None,
    "mgpu_zero1": 1,
    "mgpu_sharded": 2,
    "mgpu_hsdp": 3,
    "mgpu_zero3": 3,
}


@dataclass(frozen=True)
class AutoDecision:
    """The candidate ``mgpu_auto`` resolved to (the same on every rank: rank 0 decides and broadcasts it)."""

    strategy: str
    """``"mgpu_ddp"``, ``"mgpu_zero1"``, ``"mgpu_sharded"``, ``"mgpu_hsdp"`` or ``"mgpu_zero3"``."""
    activation_checkpointing: bool
    precision: str
    predicted_peak_bytes_per_rank: int
    usable_bytes: int
    reason: str
    """One paragraph: what was chosen, its predicted peak, and the faster candidates that do not fit."""
    table: str = ""
    """The whole plan (markdown), as ``lightning-mgpu plan`` prints it."""
    tensor_parallel_size: int = 1
    """Above 1: the chosen layout splits each block over this many ranks (no data-parallel candidate fit)."""
    pipeline_parallel_size: int = 1
    """Above 1: the chosen layout runs the model as this many pipeline stages."""
    strategy_arguments: dict[str, Any] = field(default_factory=dict)
    """A chosen layout's keywords for :class:`~lightning_mgpu.MGPUShardedStrategy` (``stage``, the sizes, the
    pipeline's micro-batches and schedule); empty for a data-parallel candidate."""

    @property
    def stage(self) -> Optional[int]:
        """The ZeRO stage (None: mgpu_ddp)."""
        return self.strategy_arguments.get("stage", STAGES[self.strategy])

    @property
    def mesh(self) -> str:
        """``"hybrid"`` for ``mgpu_hsdp`` (sharded within a machine), else ``"flat"``."""
        return "hybrid" if self.strategy == "mgpu_hsdp" else "flat"


def decide(plan: Plan) -> AutoDecision:
    """The plan's recommendation (the fastest candidate that fits, in :data:`~lightning_mgpu.planning.ORDER`) and
    the reason, naming the faster candidates that miss and by how much."""
    best = plan.recommended
    if best is None:  # plan(require_fit=True) raised already; a plan made without it
        raise ValueError("the plan recommends nothing: no candidate fits")
    usable = plan.request.usable_bytes
    faster = [r for r in plan.rows if r.sort_key < best.sort_key and not r.fits]
    misses = "; ".join(
        f"{r.strategy}{' + AC' if r.activation_checkpointing else ''} needs "
        f"{format_bytes(r.predicted_peak_bytes_per_rank)} ({format_bytes(r.predicted_peak_bytes_per_rank - usable)} "
        f"over)"
        for r in faster
    )
    reason = (
        f"mgpu_auto chose {best.strategy} (precision {best.precision}, activation checkpointing "
        f"{'on' if best.activation_checkpointing else 'off'}): predicted peak "
        f"{format_bytes(best.predicted_peak_bytes_per_rank)} per rank of {format_bytes(usable)} usable "
        f"({format_bytes(plan.request.device_memory_bytes)} less {plan.request.headroom:.0%} headroom) on "
        f"{plan.request.devices} ranks. "
        + (f"Faster candidates that do not fit: {misses}." if misses else "It is the fastest candidate.")
    )
    return AutoDecision(
        strategy=best.strategy,
        activation_checkpointing=best.activation_checkpointing,
        precision=best.precision,
        predicted_peak_bytes_per_rank=best.predicted_peak_bytes_per_rank,
        usable_bytes=usable,
        reason=reason,
        table=plan.table(),
    )


def decide_layout(layouts: LayoutPlan, build: Callable[[Layout], Optional[dict[str, Any]]]) -> AutoDecision:
    """The memory plan's decision when a data-parallel candidate fits; else the fastest layout that fits among those
    ``build`` can build (it returns the sharded strategy's keywords for a layout, or None). Raises the memory plan's
    :class:`~lightning_mgpu.planning.NoPlanFits` when none fits, naming in one line the layout that would fit where
    the strategy cannot build it."""
    memory = layouts.memory
    assert memory is not None, "plan_layouts sets the memory plan"
    if memory.recommended is not None:
        return decide(memory)
    fitting = [x for x in layouts.layouts if x.fits and x.model_parallel]
    best, arguments = next(((x, a) for x in fitting for a in (build(x),) if a is not None), (None, None))
    if best is None or arguments is None:
        raise no_layout_fits(memory, fitting)
    usable = memory.request.usable_bytes
    smallest = min(memory.rows, key=lambda r: r.predicted_peak_bytes_per_rank)
    strategy = {1: "mgpu_zero1", 2: "mgpu_sharded"}.get(arguments.get("stage", 3), best.strategy)
    call = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
    reason = (
        f"mgpu_auto chose the layout {best.name} (MGPUShardedStrategy({call}), "
        f"precision {best.precision}, activation checkpointing {'on' if best.activation_checkpointing else 'off'}): "
        f"predicted peak {format_bytes(best.predicted_peak_bytes_per_rank)} per rank of {format_bytes(usable)} "
        f"usable; no data-parallel candidate fits (the smallest, {smallest.strategy}, needs "
        f"{format_bytes(smallest.predicted_peak_bytes_per_rank)}). It is the fastest of {len(fitting)} layouts that "
        f"fit (estimated {best.samples_per_second:.3g} samples/s) that this strategy builds."
    )
    return AutoDecision(
        strategy=strategy,
        activation_checkpointing=best.activation_checkpointing,
        precision=best.precision,
        predicted_peak_bytes_per_rank=best.predicted_peak_bytes_per_rank,
        usable_bytes=usable,
        reason=reason,
        table=memory.table() + "\n\n" + layouts.table(),
        tensor_parallel_size=best.tensor,
        pipeline_parallel_size=best.pipeline,
        strategy_arguments=arguments,
    )


def no_layout_fits(memory: Plan, fitting: list[Layout]) -> NoPlanFits:
    """The memory plan's error where no data-parallel candidate fits and no layout that fits is built, with one line
    naming the first of the layouts that would fit (``fitting``) and why the strategy does not build it."""
    err = no_fit(memory)
    if fitting:
        why = short_reason(fitting[0].not_buildable) if fitting[0].not_buildable else "not in that combination"
        err.args = (
            f"{err.args[0]} The layout {fitting[0].name} would fit, but MGPUShardedStrategy here cannot build it "
            f"({why}): only the layouts it builds are chosen.",
        )
    return err


def fallback(err: BaseException, model: str, usable: int) -> AutoDecision:
    """mgpu_ddp without a plan, when none could be made (``err``): the strategy every model that trains under
    the pack trains with, and the reason in one line. An error of the model's own (a bug in ``training_step``)
    then surfaces in training, as it would under ``mgpu_ddp``."""
    lines = str(err).strip().splitlines()
    first = lines[0] if lines else ""
    why = first if isinstance(err, PlanError) else f"{model} could not be planned ({type(err).__name__}: {first})"
    reason = (
        f"mgpu_auto chose mgpu_ddp without a memory plan: {why.rstrip('.')}. mgpu_ddp trains every model the other "
        f"candidates train; to see the plan: lightning_mgpu.plan(model, devices=..., device_memory=..., batch=...)."
    )
    return AutoDecision("mgpu_ddp", False, "32-true", 0, usable, reason)


def device_memory_bytes(given: Any, device: torch.device, processes: int) -> int:
    """The memory of one device: ``given`` (bytes or ``"80GiB"``) when set; on CUDA the device's total memory;
    on CPU the machine's available memory shared by the ``processes`` on it."""
    if given is not None:
        return parse_memory(given)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    import psutil

    return int(psutil.virtual_memory().available // max(1, processes))


def planner_precision(plugin: Any) -> str:
    """The planner's name for a Lightning precision plugin (``"32-true"`` for one it does not model: the
    planner then counts the module's own dtypes)."""
    name = str(getattr(plugin, "mode", None) or getattr(plugin, "precision", "32-true"))
    return name if name in PRECISIONS else "32-true"
