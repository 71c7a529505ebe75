"""What ``mgpu_auto`` takes from a plan: the strategy to build, why, and the device memory it planned for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_mgpu.planning.candidates import Plan
from lightning_mgpu.planning.request import PRECISIONS, PlanError, format_bytes, parse_memory

__all__ = ["AutoDecision", "decide", "device_memory_bytes", "fallback", "planner_precision"]

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

    @property
    def stage(self) -> Optional[int]:
        """The ZeRO stage (None: mgpu_ddp)."""
        return STAGES[self.strategy]

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
