"""What ``mgpu_auto`` takes from a plan: the strategy to build, why, and the device memory it planned for."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from lightning_mgpu.planning.candidates import STRATEGY_RANK
from lightning_mgpu.planning.layouts import Layout, LayoutPlan, choose, no_layout_fits, short_reason
from lightning_mgpu.planning.request import PRECISIONS, PlanError, format_bytes, parse_memory

__all__ = [
    "AutoDecision",
    "alternatives",
    "choose",
    "decide_layout",
    "device_memory_bytes",
    "device_memory_source",
    "fallback",
    "host_memory_bytes",
    "no_layout_fits",
    "notes",
    "planner_precision",
    "report",
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
    layout: str = ""
    """The chosen layout's label, as every table names it (``"mgpu_sharded 8"``, ``"mgpu_ddp 4 x pp 2 1f1b m=8"``)."""
    strategy_line: str = ""
    """The ``Trainer(...)`` call that builds the chosen layout, as ``lightning-mgpu plan`` prints it."""
    offload: bool = False
    """The chosen layout offloads its shards, gradients and optimizer state to host memory (``offload="cpu"``):
    ``mgpu_auto`` takes it only where nothing fits on the device without it."""

    @property
    def stage(self) -> Optional[int]:
        """The ZeRO stage (None: mgpu_ddp)."""
        return self.strategy_arguments.get("stage", STAGES[self.strategy])

    @property
    def mesh(self) -> str:
        """``"hybrid"`` for ``mgpu_hsdp`` (sharded within a machine), else ``"flat"``."""
        return "hybrid" if self.strategy == "mgpu_hsdp" else "flat"


def decide_layout(
    layouts: LayoutPlan,
    build: Optional[Callable[[Layout], Optional[dict[str, Any]]]] = None,
    memory_source: str = "",
) -> AutoDecision:
    """``mgpu_auto``'s decision: :func:`choose`'s layout, the keywords ``build`` gives for it (default its
    :attr:`~Layout.strategy_arguments`), why, and the whole report (:func:`report`) as ``table``.
    ``memory_source`` says where the device memory came from (``mgpu_auto`` without ``device_memory``)."""
    best = choose(layouts, build)
    arguments = (build or (lambda x: dict(x.strategy_arguments)))(best) or {}
    memory = layouts.memory
    assert memory is not None
    usable = memory.request.usable_bytes
    line = layouts.strategy_line(best)
    why = _why_chosen(layouts, best)
    reason = (
        f"mgpu_auto chose {best.name} (precision {best.precision}, activation checkpointing "
        f"{'on' if best.activation_checkpointing else 'off'}; {line}): predicted peak "
        f"{format_bytes(best.predicted_peak_bytes_per_rank)} per rank of {format_bytes(usable)} usable "
        f"({format_bytes(memory.request.device_memory_bytes)} less {memory.request.headroom:.0%} headroom"
        f"{'; ' + memory_source if memory_source else ''}) on {memory.request.devices} ranks. {why}"
    )
    if best.host_bytes:
        host = memory.request.usable_host_bytes
        reason += (
            f" Offloaded to host memory (offload='cpu'): no candidate fits on the device without it; the host holds "
            f"{format_bytes(best.host_bytes)} per rank"
            f"{f' of {format_bytes(host)} usable' if host is not None else ''}, and each micro-batch moves the shards "
            f"to the device and the gradients back over PCIe."
        )
    return AutoDecision(
        strategy=best.strategy,
        activation_checkpointing=best.activation_checkpointing,
        precision=best.precision,
        predicted_peak_bytes_per_rank=best.predicted_peak_bytes_per_rank,
        usable_bytes=usable,
        reason=reason,
        table=report(layouts, memory_source=memory_source),
        tensor_parallel_size=best.tensor,
        pipeline_parallel_size=best.pipeline,
        strategy_arguments=arguments if best.model_parallel else {},
        layout=best.name,
        strategy_line=line,
        offload=bool(best.host_bytes),
    )


def _why_chosen(layouts: LayoutPlan, best: Layout) -> str:
    memory = layouts.memory
    assert memory is not None
    if not best.model_parallel:
        chosen = memory.row(best.strategy, best.precision, best.activation_checkpointing)
        ahead = [r for r in memory.rows if r.sort_key < chosen.sort_key]
        faster = [r for r in ahead if not r.fits]
        if not ahead:
            return "It is the first data-parallel candidate in the order (the fastest)."
        if not faster:  # the ones ahead fit, in a precision that changes the numerics: the alternatives say so
            return "The candidates before it in the order fit but are not taken (the alternatives below say why)."
        usable = memory.request.usable_bytes
        misses = "; ".join(
            f"{memory.label(r)}{' + AC' if r.activation_checkpointing else ''} ({r.precision}) needs "
            f"{format_bytes(r.predicted_peak_bytes_per_rank)} "
            f"({format_bytes(r.predicted_peak_bytes_per_rank - usable)} over)"
            for r in faster[:3]
        )
        more = f"; and {len(faster) - 3} more (the alternatives below)" if len(faster) > 3 else ""
        return f"Faster candidates that do not fit: {misses}{more}."
    fitting = [x for x in layouts.layouts if x.fits and x.model_parallel and x.buildable]
    smallest = min(memory.rows, key=lambda r: r.predicted_peak_bytes_per_rank)
    return (
        f"No data-parallel candidate fits (the smallest, {memory.label(smallest)}, needs "
        f"{format_bytes(smallest.predicted_peak_bytes_per_rank)}); it is the fastest of the {len(fitting)} buildable "
        f"layouts that split the model and fit (estimated {best.samples_per_second:.4g} samples/s)."
    )


def _lost(layouts: LayoutPlan, x: Layout, best: Layout) -> str:
    """Why ``x`` is not the recommendation, in one clause."""
    usable = layouts.usable_bytes
    if not x.fits:
        over = x.predicted_peak_bytes_per_rank - usable
        return f"does not fit: {format_bytes(x.predicted_peak_bytes_per_rank)} per rank, {format_bytes(over)} over"
    if not x.buildable:
        return f"not buildable: {short_reason(x.not_buildable)}"
    ratio = x.samples_per_second / best.samples_per_second if best.samples_per_second else 1.0
    speed = (
        f"{ratio - 1:.1%} faster" if ratio > 1.0005 else f"{1 - ratio:.1%} slower" if ratio < 0.9995 else "as fast"
    ) + " (estimated)"
    if x.precision != best.precision:
        return f"{speed}, but {x.precision} changes the numerics where {best.precision} fits"
    if x.model_parallel and not best.model_parallel:
        return (
            f"{speed}, but splits the model while a data-parallel layout fits ({x.data_parallel} data ranks, "
            f"the pipeline or tensor code paths): the plan keeps data parallelism then"
        )
    if ratio >= 0.9995 and x.activation_checkpointing == best.activation_checkpointing:
        return f"{speed}, later in the order ({best.strategy} before {x.strategy}: less communication per step)"
    if x.activation_checkpointing and not best.activation_checkpointing:
        return f"{speed}: activation checkpointing runs each checkpointed block's forward twice"
    return speed


def alternatives(layouts: LayoutPlan, best: Layout, limit: int = 8) -> list[str]:
    """The layouts that lost to ``best``, each with why (does not fit, not buildable, slower, splits the model,
    another precision): the faster ones first, then the data-parallel candidates before it in the order, then
    the next slower ones."""
    others = [x for x in layouts.layouts if x is not best]
    faster = [x for x in others if x.fits and x.samples_per_second > best.samples_per_second]
    ordered = [x for x in faster if x.buildable][:3] + [x for x in faster if not x.buildable][:2]
    before = [
        x
        for x in layouts.layouts
        if not x.model_parallel
        and not x.fits
        and x.precision == best.precision
        and (x.activation_checkpointing, STRATEGY_RANK[x.strategy])
        < (best.activation_checkpointing, STRATEGY_RANK[best.strategy])
    ]
    ordered += sorted(before, key=lambda x: (x.activation_checkpointing, STRATEGY_RANK[x.strategy]))[:4]
    slower = [x for x in others if x.fits and x.buildable and x.samples_per_second <= best.samples_per_second]
    ordered += [x for x in slower if x.precision == best.precision][:2]
    lines = []
    for x in ordered[:limit]:
        ac = ", AC" if x.activation_checkpointing else ""
        lines.append(f"- {x.name} ({x.precision}{ac}): {_lost(layouts, x, best)}")
    return lines


def notes(layouts: LayoutPlan, best: Layout, memory_source: str = "") -> list[str]:
    """One line for each figure a reader may find surprising in the report of ``best``."""
    memory = layouts.memory
    assert memory is not None
    lines = []
    if memory_source:
        lines.append(f"- Device memory {format_bytes(memory.request.device_memory_bytes)} per rank: {memory_source}.")
    dp = {(r.strategy, r.precision, r.activation_checkpointing): r for r in memory.rows}
    for r in memory.rows:
        twin = dp.get(("mgpu_ddp", r.precision, r.activation_checkpointing))
        if r.strategy == "mgpu_sharded" and twin and r.parameters_bytes > twin.parameters_bytes:
            n = memory.request.devices
            lines.append(
                f"- {memory.label(r)}'s parameters per rank ({format_bytes(r.parameters_bytes)}) are above "
                f"{memory.label(twin)}'s ({format_bytes(twin.parameters_bytes)}): at its peak a ZeRO-2 rank holds its "
                f"own 1/{n} shard of the parameters and every FSDP unit gathered whole, kept from forward to "
                f"backward (reshard_after_forward=False: one all-gather per step instead of ZeRO-3's two), so "
                f"P/{n} + P."
            )
            break
    if best.pipeline > 1 and best.strategy == "mgpu_ddp" and best.strategy_arguments.get("stage") == 2:
        lines.append(
            f"- {best.name} is built with MGPUShardedStrategy(stage=2, pipeline_parallel_size={best.pipeline}, ...): "
            f"inside a pipeline stage=2 keeps whole replicas of each stage (mgpu_ddp's data layout), not ZeRO-2 "
            f"shards."
        )
    if best.pipeline > 1 and best.microbatches > 1 and best.strategy in ("mgpu_zero3", "mgpu_hsdp"):
        lines.append(
            f"- {best.name}'s parameters include each stage's FSDP units gathered whole: torch's pipelining keeps "
            f"them gathered from the first micro-batch to the last (one all-gather per step)."
        )
    if layouts.tensor_note:
        lines.append(f"- {layouts.tensor_note}")
    if best.data_parallel < layouts.devices:
        d, b = best.data_parallel, layouts.batch_size
        k = layouts.devices // d
        lines.append(
            f"- {best.name} has {d} data ranks: an optimizer step takes {d} x {b} samples where {layouts.devices} "
            f"data ranks take {layouts.devices * b}; accumulate_grad_batches={k} (times any of your own) keeps the "
            f"global batch, at the same samples/s."
        )
    return lines


def report(layouts: LayoutPlan, top: int = 20, memory_source: str = "") -> str:
    """``lightning-mgpu plan``'s text: the one recommendation and the line that builds it, the alternatives and why
    each lost, notes on the figures that may surprise, then the memory plan and the layout table (whose first row
    is the recommendation). Raises :class:`~lightning_mgpu.planning.NoPlanFits` when nothing buildable fits."""
    best = choose(layouts)
    memory = layouts.memory
    assert memory is not None
    ac = "on" if best.activation_checkpointing else "off"
    lines = [
        f"Recommended: {best.name}, precision {best.precision}, activation checkpointing {ac}: "
        f"{format_bytes(best.predicted_peak_bytes_per_rank)} of {format_bytes(layouts.usable_bytes)} usable per "
        f"rank, estimated {best.samples_per_second:.4g} samples/s. {_why_chosen(layouts, best)}",
        "",
        f"    {layouts.strategy_line(best)}",
        "",
        "Alternatives, and why each lost:",
        *alternatives(layouts, best),
        "(every candidate and layout: the tables below)",
    ]
    explained = notes(layouts, best, memory_source)
    if explained:
        lines += ["", "Figures that may surprise:", *explained]
    lines += ["", "Memory plan of the data-parallel candidates:", "", memory.table(recommendation=False)]
    lines += ["", "Layouts (data replicate x data shard x tensor x pipeline) that fit, the recommended first:", ""]
    lines.append(layouts.table(top))
    return "\n".join(lines)


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


def host_memory_bytes() -> Optional[int]:
    """This machine's physical memory (None where the system does not say): what ``mgpu_auto`` checks an
    offloaded plan against.

    >>> (host_memory_bytes() or 1) > 0
    True
    """
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return None


def device_memory_bytes(given: Any, device: torch.device, processes: int) -> int:
    """The memory of one device: ``given`` (bytes or ``"80GiB"``) when set; on CUDA the device's total memory;
    on CPU the machine's available memory shared by the ``processes`` on it."""
    if given is not None:
        return parse_memory(given)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    import psutil

    return int(psutil.virtual_memory().available // max(1, processes))


def device_memory_source(given: Any, device: torch.device, processes: int) -> str:
    """Where :func:`device_memory_bytes` took the device memory from, in words (``""`` where it was given)."""
    if given is not None:
        return ""
    if device.type == "cuda":
        return f"no device_memory given: the total memory of {device}"
    import psutil

    available = int(psutil.virtual_memory().available)
    return (
        f"no device_memory given, and on CPU a rank's device is this machine's memory: the available memory "
        f"({format_bytes(available)}, psutil.virtual_memory().available) shared by the {processes} processes on it; "
        f"pass device_memory='24GiB' to plan for another device"
    )


def planner_precision(plugin: Any) -> str:
    """The planner's name for a Lightning precision plugin (``"32-true"`` for one it does not model: the
    planner then counts the module's own dtypes)."""
    name = str(getattr(plugin, "mode", None) or getattr(plugin, "precision", "32-true"))
    return name if name in PRECISIONS else "32-true"
