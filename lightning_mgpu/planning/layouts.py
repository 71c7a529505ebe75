"""The layout plan: every way to lay a model over ``devices`` ranks, data replicate x data shard x tensor x pipeline
(with the ZeRO stage of the data dimension), with its memory per rank, its communication per step on each link,
an estimated step time, and the ones that fit, fastest first.

The memory per rank is the memory plan's (:mod:`~lightning_mgpu.planning.candidates`), applied to the piece of the
model one rank holds. A tensor split of ``T`` splits what the auto plan of tensor parallelism
(``tensor_parallel_plan="auto"``, :func:`~lightning_mgpu.parts.tensor_parallel.derive_plan`, read from the traced
model) splits: ``S`` of the ``W`` parameter bytes (torch's ``nn.TransformerEncoderLayer``: its MLP only; a Llama-style
block: its attention and MLP), ``1 / T`` of them on a rank, the rest (embedding, norms, head, row-wise biases, an
attention it does not split) whole; the gradients and optimizer state follow the parameters: ``W - S + S / T`` per
rank, which the data dimension then shards or replicates as its strategy does. A pipeline of ``P`` stages splits the
blocks only (``B`` of the ``W`` bytes): a rank holds ``(B - S + S / T) / P``, which the data dimension shards or
replicates, and the ``O = W - B`` bytes outside the blocks (embeddings, final norm, head) whole, with their whole
gradients and optimizer state, whatever the data dimension's strategy (the pipeline keeps them on every rank; at
``stage=3`` only the stages' blocks are FSDP units). Activations (traced for the loader's batch ``b`` of one
data-parallel rank): without sequence parallelism (the auto plan) the split layers' intermediates are ``1 / T`` on a
rank and the residual stream, the norms and the logits whole; the planner counts ``A_s``, the column-wise split
layers' outputs in the traced forward, and takes them as the same share of the activations throughout the step (an
approximation: the gradients of those intermediates in backward are split alike, the temporaries of the unsplit parts
are not). A stage holds ``1 / P`` of the blocks, and a pipeline of ``m`` micro-batches keeps ``k`` of them in flight
on its first stage: ``k = m`` under GPipe (every forward before any backward), ``k = min(P, m)`` under 1F1B.
Per rank::

    activations = A * k / (m P) * (1 - (A_s / A) (1 - 1/T))

Communication per optimizer step, bytes one rank sends (ring collectives over ``n`` ranks: an all-reduce of ``S``
bytes sends ``2 (n-1)/n S``, an all-gather or a reduce-scatter ``(n-1)/n S``; ``W`` and ``G`` the parameter and
gradient bytes of the rank's model piece, ``X`` one block's output for the batch ``b``, ``L`` the blocks):

====================  ======================================================================================
data, mgpu_ddp        all-reduce of ``G`` over the ``D`` data ranks
data, mgpu_zero1      reduce-scatter of ``G`` + all-gather of ``W`` (the updated shards)
data, mgpu_sharded    all-gather of ``W`` once (kept from forward to backward) + reduce-scatter of ``G``
data, mgpu_zero3      all-gather of ``W`` in forward and again in backward + reduce-scatter of ``G``
data, mgpu_hsdp       mgpu_zero3 over the ``S`` ranks of a machine + all-reduce of ``G / S`` over the replicas
tensor                per micro-batch, torch's split layers (the auto plan's): each row-wise layer
                      (attention's output, the MLP's down) all-reduces its output in forward, and again where
                      activation checkpointing's recomputation runs it (counted in the traced step), each
                      column-wise layer (query, key, value; the MLP's gate and up) its input's gradient in
                      backward, one block output ``X`` each: ``(R + R' + C) / P * 2 (T-1)/T * X`` per step, ``R``,
                      ``R'`` and ``C`` the traced step's calls of the blocks' row-wise layers, of those recomputed
                      and of the column-wise layers (a Llama block: ``R = 2``, ``R' = 1`` with checkpointing,
                      ``C = 5``)
pipeline              per micro-batch, a stage sends its output forward and its input's gradient backward:
                      ``2 X`` per step (each of the ``T`` ranks of a stage sends it); after the schedule, the
                      gradients of the weights outside the blocks are all-reduced over the ranks of a tensor
                      coordinate (over the stages, then the data ranks, with a tensor split), counted with the data
                      dimension's bytes and not overlapped
====================  ======================================================================================

Each group's link: the ranks are laid out pipeline (outermost), data replicate, data shard, tensor (innermost,
consecutive ranks), as the mesh builds them; a group whose ranks fit in one machine uses the link within a machine,
any other the link across machines. The step time: ``F`` the traced floating-point operations for the batch ``b``
(recomputation included), ``R`` the device's rate::

    compute = F / (T P R)                            bubble = (P-1) / (m+P-1)
    step = (compute + tensor + pipeline) / (1 - bubble) + max(0, data - compute)

(the data dimension's collectives overlap the compute, the tensor all-reduces and the stage sends do not). The
layouts that fit are ranked by samples per second, ``b D / step``: each data-parallel rank's loader yields ``b``
samples, so a layout with fewer data ranks trains with a smaller global batch, and the rate is what compares.

Each layout also says whether the strategy builds it (:attr:`Layout.buildable`): :func:`sharded_arguments` maps it
to the keywords of :class:`~lightning_mgpu.MGPUShardedStrategy` and constructs its settings
(:class:`~lightning_mgpu.settings.ShardedSettings`, nothing starts), whose refusal is :attr:`Layout.not_buildable`.
:attr:`LayoutPlan.best` and the table's rows are buildable layouts.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, Optional, Union

from lightning_mgpu.parts.pipeline import master_precision_refusal
from lightning_mgpu.planning.candidates import PRECISION_RANK, STRATEGY_RANK, NoPlanFits, Plan, candidate_row, no_fit
from lightning_mgpu.planning.request import LINK_SPEEDS, PlanError, PlanRequest, format_bytes, layout_label
from lightning_mgpu.planning.trace import PRECISION_LAYOUT, ModelStates, StepTrace
from lightning_mgpu.settings import ShardedSettings

__all__ = [
    "DEFAULT_DEVICE_TFLOPS",
    "SCHEDULES",
    "Layout",
    "LayoutPlan",
    "Links",
    "choose",
    "estimate_layouts",
    "group_link",
    "layout_label",
    "no_layout_fits",
    "sharded_arguments",
    "short_reason",
]

#: The rate a device sustains, TFLOP/s: an assumption (about a third of a current data-centre GPU's dense
#: half-precision peak); pass the one you measure (``device_tflops``)
DEFAULT_DEVICE_TFLOPS = 300.0
#: Pipeline schedules, as the sharded strategy names them: the first stage keeps ``m`` (GPipe) or ``min(P, m)``
#: (1F1B) micro-batches' activations
SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe")


def _speed(value: Union[str, float, int], name: str) -> float:
    if isinstance(value, str):
        if value.lower() not in LINK_SPEEDS:
            raise PlanError(
                f"{name}={value!r} is not a known link: use one of {', '.join(map(repr, LINK_SPEEDS))} or a number "
                f"of GB/s per device in each direction, e.g. {name}=25."
            )
        return LINK_SPEEDS[value.lower()]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise PlanError(f"{name}={value!r} must be a link name ({', '.join(LINK_SPEEDS)}) or a positive GB/s.")
    return float(value)


@dataclass(frozen=True)
class Links:
    """The bandwidth one device gets within a machine and across machines, GB/s in each direction.

    >>> Links.of("pcie", "ethernet")
    Links(intra=32.0, inter=12.5)
    """

    intra: float = LINK_SPEEDS["nvlink"]
    inter: float = LINK_SPEEDS["infiniband"]

    @classmethod
    def of(cls, intra: Union[str, float] = "nvlink", inter: Union[str, float] = "infiniband") -> Links:
        """From link names (:data:`LINK_SPEEDS`) or GB/s."""
        return cls(_speed(intra, "intra_node_link"), _speed(inter, "inter_node_link"))

    def speed(self, link: str) -> float:
        """Bytes per second on ``"intra"`` or ``"inter"``."""
        return (self.intra if link == "intra" else self.inter) * 1e9


def group_link(stride: int, size: int, per_node: int) -> str:
    """``"intra"`` when a group of ``size`` ranks spaced ``stride`` apart fits in one machine of ``per_node``
    ranks, else ``"inter"`` (a ring over ranks of several machines runs at the speed of the link between them).

    >>> group_link(1, 8, 8), group_link(8, 4, 8), group_link(2, 4, 8)
    ('intra', 'inter', 'intra')
    """
    return "intra" if size == 1 or stride * size <= per_node else "inter"


def _all_reduce(nbytes: float, n: int) -> float:
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def _gather(nbytes: float, n: int) -> float:
    """An all-gather or a reduce-scatter of ``nbytes`` (the whole) over ``n`` ranks."""
    return (n - 1) / n * nbytes if n > 1 else 0.0


@dataclass(frozen=True)
class Layout:
    """One layout: its sizes, its predicted peak per rank by component, its communication per step and its
    estimated step time."""

    data_replicate: int
    data_shard: int
    tensor: int
    pipeline: int
    strategy: str
    """The data dimension's strategy (``mgpu_ddp``, ``mgpu_zero1``, ``mgpu_sharded``, ``mgpu_zero3``, ``mgpu_hsdp``)."""
    precision: str
    activation_checkpointing: bool
    microbatches: int
    """Pipeline micro-batches per loader batch (1 without a pipeline)."""
    schedule: str
    """``"1f1b"`` or ``"gpipe"`` (``"-"`` without a pipeline)."""
    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    """Activations and temporaries, the pipeline's in-flight micro-batches included."""
    communication_bytes: int
    """Communication buffers (a DDP bucket, FSDP's gathered units)."""
    model_states_bytes: int
    """The parameters, gradients and optimizer state one rank holds once the optimizer has stepped: of its piece
    of the model, as the data dimension shards it (what it keeps between steps)."""
    predicted_peak_bytes_per_rank: int
    fits: bool
    data_bytes: int
    """Bytes one rank sends per step for the data dimension (all-reduce, all-gather, reduce-scatter)."""
    tensor_bytes: int
    pipeline_bytes: int
    data_link: str
    """``"intra"`` or ``"inter"`` (mgpu_hsdp: the replicas' all-reduce; its shards' collectives stay in a machine)."""
    tensor_link: str
    pipeline_link: str
    intra_bytes: int
    """Per step, sent within a machine."""
    inter_bytes: int
    """Per step, sent across machines."""
    compute_seconds: float
    communication_seconds: float
    """Exposed: the tensor and pipeline sends, and the data collectives beyond the compute they overlap."""
    bubble: float
    """``(P-1)/(m+P-1)``: the fraction of the step a stage idles (0 without a pipeline)."""
    step_seconds: float
    samples_per_second: float
    """The loader batch times the data ranks, per step second: what the layouts are ranked by."""
    strategy_arguments: dict[str, Any] = field(default_factory=dict, hash=False)
    """The keywords of :class:`~lightning_mgpu.MGPUShardedStrategy` that build the layout (:func:`sharded_arguments`:
    ``stage``, ``mesh``, the sizes, the pipeline's micro-batches and schedule); empty for ``mgpu_ddp`` without a
    split (``MGPUDDPStrategy``) and for a layout that is not buildable."""
    not_buildable: str = ""
    """Why the strategy does not build the layout (its settings' refusal), or ``""`` where it does."""
    host_bytes: int = 0
    """Offloaded (:attr:`PlanRequest.offload`, the sharded data dimensions): host memory per rank (its shards,
    gradients and optimizer state); its transfers over the host link are in :attr:`step_seconds`."""

    @property
    def buildable(self) -> bool:
        """Whether :class:`~lightning_mgpu.MGPUShardedStrategy` (or ``MGPUDDPStrategy``) builds this layout."""
        return not self.not_buildable

    @property
    def data_parallel(self) -> int:
        return self.data_replicate * self.data_shard

    @property
    def stage(self) -> Optional[int]:
        """The ZeRO stage of the data dimension (None: DDP)."""
        return {"mgpu_ddp": None, "mgpu_zero1": 1, "mgpu_sharded": 2}.get(self.strategy, 3)

    @property
    def name(self) -> str:
        """The layout's label, the same in every table, the JSON and ``mgpu_auto``'s message: the data dimension's
        preset and its ranks, then the splits above 1 (``"mgpu_sharded 8"``, ``"mgpu_ddp 4 x pp 2 1f1b m=8"``,
        ``"mgpu_hsdp 2x8 x tp 2"``: 2 replicas of 8 shards; ``"tp 2 x pp 4 gpipe m=4"``: one data rank)."""
        return layout_label(
            self.strategy,
            self.data_replicate,
            self.data_shard,
            self.tensor,
            self.pipeline,
            self.schedule,
            self.microbatches,
        )

    @property
    def model_parallel(self) -> bool:
        """Whether the layout splits the model (tensor or pipeline above 1)."""
        return self.tensor > 1 or self.pipeline > 1


@dataclass
class LayoutPlan:
    """Every layout for one model and request: those that fit, fastest first, then those that do not."""

    model: str
    devices: int
    num_nodes: int
    usable_bytes: int
    links: Links
    device_tflops: float
    batch_size: int
    layouts: list[Layout]
    memory: Optional[Plan] = None
    """The memory plan of the data-parallel candidates (:func:`~lightning_mgpu.planning.plan`), from the same
    trace (set by :func:`~lightning_mgpu.planning.plan_layouts`)."""
    checkpointing_source: str = ""
    """The "with AC" candidates' policy as Python source for the strategy line (``'["TransformerEncoderLayer"]'``,
    ``"EveryNth(1)"``); set by :func:`~lightning_mgpu.planning.plan_layouts`."""
    checkpointing_save: Any = None
    """What the "with AC" candidates' blocks keep (``activation_checkpointing_save``), for the strategy line; set by
    :func:`~lightning_mgpu.planning.plan_layouts`."""
    tensor_note: str = ""
    """Why no layout splits the model by tensor where the devices would allow one (the auto plan of tensor
    parallelism splits too little of it: :attr:`~lightning_mgpu.planning.trace.StepTrace.tensor_refused`);
    ``""`` otherwise."""

    @property
    def recommended(self) -> Optional[Layout]:
        """The one recommendation (:func:`choose`, what ``lightning-mgpu plan``
        prints first and ``mgpu_auto`` builds), or None where nothing buildable fits."""
        try:
            return choose(self)
        except PlanError:
            return None

    def strategy_line(self, layout: Layout) -> str:
        """The ``Trainer(...)`` call that builds ``layout`` (a preset name where a preset builds it), to paste;
        ``""`` for a layout the strategy does not build."""
        if not layout.buildable:
            return ""
        arguments = dict(layout.strategy_arguments)
        presets: dict[tuple[tuple[str, Any], ...], str] = {
            (): "mgpu_ddp",
            (("stage", 1),): "mgpu_zero1",
            (("stage", 2),): "mgpu_sharded",
        }
        presets[(("stage", 3),)] = "mgpu_zero3"
        presets[(("offload", "cpu"), ("stage", 3))] = "mgpu_zero3_offload"
        preset = presets.get(tuple(sorted(arguments.items())))
        if layout.activation_checkpointing:
            arguments["activation_checkpointing"] = _Source(self.checkpointing_source or "<your policy>")
            if self.checkpointing_save is not None:
                arguments["activation_checkpointing_save"] = self.checkpointing_save
        if preset is not None and not layout.activation_checkpointing:
            strategy = repr(preset)
        else:
            cls = "MGPUDDPStrategy" if "stage" not in arguments else "MGPUShardedStrategy"
            strategy = f"{cls}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"
        trainer = [f"strategy={strategy}", f"devices={self.devices // self.num_nodes}"]
        trainer += [f"num_nodes={self.num_nodes}"] if self.num_nodes > 1 else []
        if PRECISION_LAYOUT[layout.precision][2]:  # the master modes are a plugin
            trainer.append(f"plugins=[MGPUPrecision({layout.precision!r})]")
        else:
            trainer.append(f"precision={layout.precision!r}")
        if layout.data_parallel < self.devices:  # fewer data ranks: accumulate to keep the global batch
            trainer.append(f"accumulate_grad_batches={self.devices // layout.data_parallel}")
        return f"Trainer({', '.join(trainer)})"

    @property
    def best(self) -> Optional[Layout]:
        """The fastest layout that fits and that the strategies build (:attr:`Layout.buildable`)."""
        return self.best_where(data_parallel_only=False)

    def best_where(self, data_parallel_only: bool) -> Optional[Layout]:
        """The fastest buildable layout that fits, among the pure data-parallel layouts when
        ``data_parallel_only``."""
        return next(
            (x for x in self.layouts if x.fits and x.buildable and not (data_parallel_only and x.model_parallel)),
            None,
        )

    def to_json(self) -> str:
        """Every layout as JSON, with its label (``name``), whether it is the recommendation and the
        ``strategy_line`` that builds it."""
        chosen = self.recommended
        return json.dumps(
            [
                {**asdict(x), "name": x.name, "recommended": x is chosen, "strategy_line": self.strategy_line(x)}
                for x in self.layouts
            ],
            indent=2,
        )

    def table(self, top: int = 20, refused: int = 5) -> str:
        """A markdown table of ``top`` buildable layouts that fit: the recommendation (:attr:`recommended`) first,
        marked, then the others fastest first (when none fits, the smallest first), then a note naming up to
        ``refused`` layouts that fit and would be faster than the first row but that the strategy does not build,
        each with the short reason its settings give."""
        built = [x for x in self.layouts if x.buildable]
        fitting = [x for x in built if x.fits]
        chosen = self.recommended
        if chosen is not None:
            fitting = [chosen] + [x for x in fitting if x is not chosen]
        shown = fitting[:top] if fitting else sorted(built, key=lambda x: x.predicted_peak_bytes_per_rank)[:top]
        first = min((self.layouts.index(x) for x in fitting), default=len(self.layouts))
        passed_over = [x for x in self.layouts[:first] if x.fits and not x.buildable]
        head = (
            "| # | layout | precision | AC | params | grads | optimizer | activations | comm buf | peak/rank | "
            "intra/step | inter/step | bubble | step (s) | samples/s | fits |"
        )
        lines = [head, "|" + "---|" * 16]
        for i, x in enumerate(shown, 1):
            cells = [str(i), x.name, x.precision, "yes" if x.activation_checkpointing else "no"]
            cells += [
                format_bytes(v)
                for v in (
                    x.parameters_bytes,
                    x.gradients_bytes,
                    x.optimizer_state_bytes,
                    x.activations_bytes,
                    x.communication_bytes,
                    x.predicted_peak_bytes_per_rank,
                    x.intra_bytes,
                    x.inter_bytes,
                )
            ]
            cells += [f"{x.bubble:.1%}", f"{x.step_seconds:.3g}", f"{x.samples_per_second:.4g}"]
            cells.append(("yes" if x.fits else "no") + (" **<- recommended**" if x is chosen else ""))
            lines.append("| " + " | ".join(cells) + " |")
        per_node = self.devices // self.num_nodes
        fit = sum(x.fits for x in self.layouts)
        if passed_over:
            lines.append("")
            lines.append(
                f"Not buildable (left out above): {len(passed_over)} layout(s) that fit"
                + (" and rank above the first row (as fast or faster)" if fitting else "")
                + "; MGPUShardedStrategy refuses them:"
            )
            lines += [
                f"- {x.name} ({x.strategy}{', AC' if x.activation_checkpointing else ''}, "
                f"{x.samples_per_second:.4g} samples/s): not buildable: {short_reason(x.not_buildable)}"
                for x in passed_over[:refused]
            ]
            if len(passed_over) > refused:
                lines.append(f"- and {len(passed_over) - refused} more (`--layouts --json`: `not_buildable`).")
        lines.append("")
        lines.append(
            f"{self.model}: {fit} of {len(self.layouts)} layouts fit and {len(fitting)} of those are buildable, "
            f"on {self.devices} ranks ({self.num_nodes} "
            f"machine(s) of {per_node}) x {format_bytes(self.usable_bytes)} usable; links {self.links.intra:g} GB/s "
            f"within a machine, {self.links.inter:g} GB/s across; {self.device_tflops:g} TFLOP/s per device; loader "
            f"batch {self.batch_size} per data-parallel rank. Step times are estimates from bytes and FLOPs "
            f"(not measured)."
        )
        return "\n".join(lines)


class _Source(str):
    """Text shown as is by ``repr`` (a policy's Python source in the strategy line)."""

    def __repr__(self) -> str:
        return str(self)


def _split_request(request: PlanRequest, strategy: str, data: int, replicas: int) -> PlanRequest:
    """The memory plan's request for the data dimension of a layout: ``data`` ranks, ``replicas`` machines' worth
    of replicas for mgpu_hsdp."""
    return PlanRequest(
        devices=data,
        device_memory=request.device_memory_bytes,
        headroom=request.headroom,
        precisions=request.precisions,
        strategies=(strategy,),
        bucket_cap_mb=request.bucket_cap_mb,
        num_nodes=replicas,
        offload=request.offload,
        host_memory=None if request.usable_host_bytes is None else _host_per_machine(request, data, replicas),
    )


def _host_per_machine(request: PlanRequest, data: int, replicas: int) -> int:
    """The host memory to give a layout's data request so that each of its ranks may use what one rank of the whole
    request may use (the data request counts ``data / replicas`` ranks a machine)."""
    per_rank = request.usable_host_bytes or 0
    return int(per_rank * max(1, data // replicas) / (1 - request.headroom)) + 1


def _piece(
    states: ModelStates, trace: StepTrace, tensor: int, pipeline: int, in_flight: float
) -> tuple[ModelStates, StepTrace]:
    """What one rank of a model split ``tensor`` x ``pipeline`` ways holds: of the parameters, gradients and
    optimizer state, ``1 / tensor`` of the share the auto plan splits (``trace.tensor_split_bytes``) and the rest
    whole, over ``pipeline`` stages (buffers: ``1 / pipeline``); of the activations, ``1 / tensor`` of the split
    layers' outputs (``trace.tensor_split_activations``, taken as the same share of the activations throughout the
    step), the rest whole, times ``in_flight`` (the pipeline's micro-batches in flight over ``m P``)."""
    whole_bytes = trace.parameters
    # a pipeline splits the blocks only: what is outside them is every rank's (:func:`_outside`), not the piece's
    outside = min(trace.outside_parameters, whole_bytes) if pipeline > 1 else 0
    split_bytes = min(trace.tensor_split_bytes, whole_bytes) - (min(trace.outside_tensor_split, outside))

    def held(v: int, buffers: bool = False) -> int:
        if buffers or not whole_bytes:
            return v // pipeline
        inner = v - v * outside // whole_bytes  # the same share of every state as of the parameters
        if tensor == 1:
            return inner // pipeline
        split = v * split_bytes // whole_bytes
        return (inner - split + split // tensor) // pipeline

    sizes: dict[str, Any] = {  # every byte count of the states (the counts of parameters stay the model's)
        f.name: held(getattr(states, f.name), buffers=f.name == "buffers")
        for f in fields(states)
        if f.name.endswith("_bytes") or f.name in ("buffers", "optimizer_state", "optimizer_transient")
    }
    piece = replace(states, parameters={k: held(v) for k, v in states.parameters.items()}, **sizes)
    share = min(1.0, trace.tensor_split_activations / trace.activations) if trace.activations else 0.0
    activations = in_flight * (1.0 - share * (1.0 - 1.0 / tensor))
    timeline = tuple((int(a * activations), held(g)) for a, g in trace.timeline)
    scaled = replace(
        trace,
        parameters=held(trace.parameters),
        gradients=held(trace.gradients),
        activations=int(trace.activations * activations),
        timeline=timeline,
    )
    return piece, scaled


def _outside(states: ModelStates, trace: StepTrace, tensor: int, pipeline: int) -> tuple[int, int, int]:
    """The parameter (with the master copies of the master precisions), gradient and optimizer-state bytes of the
    parameters outside the blocks (embeddings, final norm, head), which every rank of a pipeline holds whole,
    whatever the data dimension's strategy (the pipeline splits and shards the blocks only; ``1 / tensor`` of what
    the auto plan splits of them); none without a pipeline (they are then part of the piece the data dimension
    shards)."""
    whole = trace.parameters
    outside = min(trace.outside_parameters, whole) if pipeline > 1 else 0
    if not outside:
        return 0, 0, 0
    split = min(trace.outside_tensor_split, outside)

    def held(v: int) -> int:
        part, shard = v * outside // whole, v * split // whole
        return part - shard + shard // tensor

    master = PRECISION_LAYOUT[trace.precision][2]
    parameters = held(trace.parameters) + (held(states.optimized_bytes) if master else 0)
    return parameters, held(trace.gradients), held(states.optimizer_state)


#: How each data strategy of a layout is built with MGPUShardedStrategy: the ZeRO stages tried, in order, and the
#: data sharding (:attr:`~lightning_mgpu.settings.ShardedSettings.data_sharding`) the built one must have
_BUILT_AS: dict[str, tuple[tuple[int, ...], tuple[Optional[int], ...]]] = {
    "mgpu_ddp": ((1, 2), (None, 1)),  # whole replicas, or ZeRO-1 (the same bytes sent, no more memory per rank)
    "mgpu_zero1": ((1,), (1,)),
    "mgpu_sharded": ((2,), (2,)),
    "mgpu_zero3": ((3,), (3,)),
    "mgpu_hsdp": ((3,), (3,)),
}


def _sharding_words(sharding: Optional[int]) -> str:
    return "whole replicas" if sharding is None else f"ZeRO-{sharding} shards"


def sharded_arguments(layout: Layout) -> dict[str, Any]:
    """The keywords of :class:`~lightning_mgpu.MGPUShardedStrategy` that build ``layout``: ``stage`` (and
    ``mesh="hybrid"`` for mgpu_hsdp), ``tensor_parallel_size``, ``pipeline_parallel_size``,
    ``pipeline_microbatches`` and ``pipeline_schedule`` where the layout splits the model; ``{}`` for mgpu_ddp
    without a split (``MGPUDDPStrategy``). The strategy's settings (:class:`~lightning_mgpu.settings.ShardedSettings`)
    are constructed with them (nothing starts): raises their ``ValueError`` where they refuse the combination, or
    where what they build shards the data dimension otherwise than the layout does (inside a pipeline ``stage=2``
    holds whole replicas of each stage, which is mgpu_ddp's layout, not mgpu_sharded's)."""
    if layout.strategy == "mgpu_ddp" and not layout.model_parallel:
        return {}
    if layout.pipeline > 1 and PRECISION_LAYOUT[layout.precision][2]:  # the FP32 masters of the master modes
        raise ValueError(master_precision_refusal(layout.precision, layout.pipeline))
    sizes: dict[str, Any] = {"offload": "cpu"} if layout.host_bytes else {}
    if layout.strategy == "mgpu_hsdp":  # the planner's shard group, not the strategy's default
        sizes.update(mesh="hybrid", shard_size=layout.data_shard)
    if layout.tensor > 1:
        sizes["tensor_parallel_size"] = layout.tensor
    if layout.pipeline > 1:
        sizes.update(
            pipeline_parallel_size=layout.pipeline,
            pipeline_microbatches=layout.microbatches,
            pipeline_schedule=layout.schedule,
        )
    stages, wanted = _BUILT_AS[layout.strategy]
    refusals = []
    for stage in stages:
        arguments = {"stage": stage, **sizes}
        try:
            settings = ShardedSettings(**arguments)
        except ValueError as err:
            refusals.append(str(err))
            continue
        if settings.data_sharding in wanted or layout.data_parallel == 1:  # one data rank: no data sharding
            return arguments
        call = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
        refusals.append(
            f"stage={stage} builds {_sharding_words(settings.data_sharding)} over the data dimension here, not "
            f"{_sharding_words(wanted[0])}; MGPUShardedStrategy({call}) is not the layout {layout.name}."
        )
    raise ValueError(" Also: ".join(refusals))


def short_reason(reason: str, width: int = 100) -> str:
    """The first clause of a refusal (up to its first ``:``, ``;`` or sentence end), at most ``width`` characters.

    >>> short_reason("pipeline_parallel_size=2 with stage=1 is not supported yet: with pipeline stages ...")
    'pipeline_parallel_size=2 with stage=1 is not supported yet'
    """
    ends = [i for i in (reason.find(": "), reason.find("; "), reason.find(". ")) if i > 0]
    text = reason[: min(ends, default=len(reason))].rstrip(".")
    return text if len(text) <= width else text[: width - 3] + "..."


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def estimate_layouts(
    name: str,
    request: PlanRequest,
    states: ModelStates,
    traces: list[StepTrace],
    units: tuple[float, float],
    batch_size: int,
    links: Optional[Links] = None,
    device_tflops: float = DEFAULT_DEVICE_TFLOPS,
    microbatches: Optional[int] = None,
    schedules: tuple[str, ...] = SCHEDULES,
    tensor_across_machines: bool = False,
    max_tensor: Optional[int] = None,
    max_pipeline: Optional[int] = None,
) -> LayoutPlan:
    """Every layout of ``request.devices`` ranks over ``request.num_nodes`` machines, from the counted states and
    traced steps of the memory plan (:func:`lightning_mgpu.planning.plan`'s inputs).

    ``batch_size``: the loader's batch per data-parallel rank (the traced batch). ``microbatches``: the pipeline's
    micro-batches per batch (default: the batch size, micro-batches of one sample; a count that does not divide the
    batch is skipped). ``tensor_across_machines``: allow tensor groups wider than a machine (default no: a tensor
    group all-reduces every block's activations, which only the link within a machine carries well).
    ``max_tensor``/``max_pipeline`` cap the sizes tried."""
    links = links or Links()
    if not isinstance(batch_size, int) or batch_size < 1:
        raise PlanError(f"batch_size={batch_size!r} must be the loader's batch per rank, a whole number >= 1.")
    bad = [s for s in schedules if s not in SCHEDULES]
    if bad or not schedules:
        raise PlanError(f"schedules={schedules!r}: {bad or 'none given'}; choose from {SCHEDULES}.")
    if microbatches is not None and (isinstance(microbatches, bool) or not isinstance(microbatches, int)):
        raise PlanError(f"microbatches={microbatches!r} must be a whole number >= 1 that divides the batch.")
    n, per_node = request.devices, request.devices // request.num_nodes
    usable = request.usable_bytes
    layouts: list[Layout] = []
    tensor_note = ""
    for trace in traces:
        blocks, divisor = trace.blocks, trace.tensor_divisor
        possible = _divisors(n if tensor_across_machines else math.gcd(n, per_node))
        if trace.tensor_refused and len(possible) > 1:
            tensor_note = f"No tensor-parallel layout: {trace.tensor_refused}."
        # a tensor size that divides every width and head count the auto plan splits (it keeps every pair split)
        tensor_sizes = [
            t
            for t in possible
            if t == 1
            or (divisor and divisor % t == 0 and not trace.tensor_refused and (max_tensor is None or t <= max_tensor))
        ]
        for t in tensor_sizes:
            for p in _divisors(n // t):
                if p > 1 and (p > blocks or (max_pipeline is not None and p > max_pipeline)):
                    continue
                d = n // (t * p)
                # one data rank: the strategies are the same (no data dimension); mgpu_ddp stands for them
                flat = [s for s in request.strategies if s != "mgpu_hsdp"][:1]
                for strategy in request.strategies if d > 1 else flat:
                    replicas = _replicas(strategy, d, t, per_node)
                    if replicas is None:
                        continue
                    for schedule in schedules if p > 1 else ("-",):
                        m = 1 if p == 1 else (microbatches or batch_size)
                        if m > batch_size or batch_size % m or (schedule == "1f1b" and m < p):
                            continue
                        sizes = (replicas, d, t, p, m, schedule, per_node, usable)
                        layouts.append(
                            _layout(strategy, trace, states, units, request, links, device_tflops, batch_size, *sizes)
                        )
    layouts.sort(
        key=lambda x: (
            not x.fits,
            -float(f"{x.samples_per_second:.6g}"),  # equal to 6 digits: the cheaper first
            PRECISION_RANK[x.precision],
            x.activation_checkpointing,
            STRATEGY_RANK[x.strategy],
            x.predicted_peak_bytes_per_rank,
        )
    )
    done = LayoutPlan(name, n, request.num_nodes, usable, links, device_tflops, batch_size, layouts)
    done.tensor_note = tensor_note
    return done


def _replicas(strategy: str, data: int, tensor: int, per_node: int) -> Optional[int]:
    """The replicas of the data dimension: 1 for a flat one; mgpu_hsdp's machines' worth (shards of the data
    ranks in one machine), or None where it has no replica or no shard to split."""
    if strategy != "mgpu_hsdp":
        return 1
    shard = math.gcd(data, max(per_node // tensor, 1))
    if shard < 2 or data // shard < 2:
        return None
    return data // shard


def _layout(
    strategy: str,
    trace: StepTrace,
    states: ModelStates,
    units: tuple[float, float],
    request: PlanRequest,
    links: Links,
    device_tflops: float,
    batch: int,
    replicas: int,
    d: int,
    t: int,
    p: int,
    m: int,
    schedule: str,
    per_node: int,
    usable: int,
) -> Layout:
    in_flight = m if schedule == "gpipe" else min(p, m)
    piece_states, piece_trace = _piece(states, trace, t, p, in_flight / (m * p))
    largest, root = units
    piece_units = (min(1.0, largest * p), min(1.0, root * p))
    outside = min(trace.outside_parameters, trace.parameters) if p > 1 else 0
    if outside:  # the piece is the stage's blocks: the units' shares of it (the root unit's weights are outside)
        blocks = trace.parameters - outside
        piece_units = (min(1.0, largest * p * trace.parameters / blocks), 0.0) if blocks else (1.0, 0.0)
    data_request = _split_request(request, strategy, d, replicas)
    # the memory plan's row for the data dimension, on the rank's piece of the model
    row = candidate_row(strategy, piece_states, piece_trace, piece_units, data_request, usable, rebuilt_buckets=p == 1)
    w, g = piece_trace.parameters, piece_trace.gradients
    shard = d // replicas
    # Under a pipeline of several micro-batches, torch's pipelining keeps each FSDP unit gathered and its gradients
    # unsharded from the first micro-batch to the last (one reduce-scatter per step): ZeRO-3 holds what ZeRO-2 holds
    # over its shard group, plus the stage's whole gradients.
    pipelined_fsdp = p > 1 and m > 1 and strategy in ("mgpu_sharded", "mgpu_zero3", "mgpu_hsdp")
    if pipelined_fsdp:
        over_shards = _split_request(request, "mgpu_sharded", shard, 1)
        kept = candidate_row("mgpu_sharded", piece_states, piece_trace, piece_units, over_shards, usable)
        extra = max(0, g - kept.gradients_bytes) if kept.phase == "forward/backward" else 0
        peak = kept.predicted_peak_bytes_per_rank + extra
        row = replace(kept, gradients_bytes=kept.gradients_bytes + extra, predicted_peak_bytes_per_rank=peak)
        row = replace(row, fits=peak <= usable and request.host_holds(row.host_bytes))
    # the weights outside the blocks: whole on every rank of a pipeline, with their gradients and optimizer state
    out_params, out_grads, out_optimizer = _outside(states, trace, t, p)
    if out_params or out_grads or out_optimizer:
        extra = out_params + out_grads + out_optimizer
        peak = row.predicted_peak_bytes_per_rank + extra
        row = replace(
            row,
            parameters_bytes=row.parameters_bytes + out_params,
            gradients_bytes=row.gradients_bytes + out_grads,
            optimizer_state_bytes=row.optimizer_state_bytes + out_optimizer,
            predicted_peak_bytes_per_rank=peak,
            fits=peak <= usable and request.host_holds(row.host_bytes),
            states_bytes=row.states_bytes + extra,
        )
    # communication per step, bytes one rank sends
    if strategy == "mgpu_ddp":
        data_bytes, shard_bytes = _all_reduce(g, d), 0.0
    elif strategy == "mgpu_zero1":
        data_bytes, shard_bytes = _gather(g, d) + _gather(w, d), 0.0
    elif strategy == "mgpu_sharded" or (pipelined_fsdp and strategy == "mgpu_zero3"):
        data_bytes, shard_bytes = _gather(w, d) + _gather(g, d), 0.0
    elif strategy == "mgpu_zero3":
        data_bytes, shard_bytes = 2 * _gather(w, d) + _gather(g, d), 0.0
    else:  # mgpu_hsdp: ZeRO-3 within the shard group, the shards' all-reduce across the replicas
        shard_bytes = (1 if pipelined_fsdp else 2) * _gather(w, shard) + _gather(g, shard)
        data_bytes = _all_reduce(g / shard, replicas)
    # all-reduces per micro-batch of the auto plan's split layers: each row-wise one's output in forward (and in the
    # recomputed forward where it runs again), each column-wise one's input gradient in backward; a stage holds 1 / P
    calls = (trace.rowwise_layers + trace.rowwise_recomputed + trace.colwise_layers) / p
    tensor_bytes = calls * _all_reduce(trace.block_output_bytes, t) if t > 1 else 0.0
    pipeline_bytes = 2.0 * trace.block_output_bytes if p > 1 else 0.0
    # the outside weights' gradients, summed over the stages and averaged over the data ranks after the schedule:
    # one all-reduce over the ranks of a tensor coordinate (with a tensor split: over the pipeline, then the data)
    shared = (
        [(_all_reduce(out_grads, d * p), group_link(t, d * p, per_node))]
        if t == 1
        else [
            (_all_reduce(out_grads, p), group_link(t * d, p, per_node)),
            (_all_reduce(out_grads, d), group_link(t, d, per_node)),
        ]
    )
    tensor_link = group_link(1, t, per_node)
    shard_link = group_link(t, shard if strategy == "mgpu_hsdp" else d, per_node)
    data_link = group_link(t * shard, replicas, per_node) if strategy == "mgpu_hsdp" else shard_link
    pipeline_link = group_link(t * d, p, per_node)
    intra = inter = 0.0
    for nbytes, link in (
        (data_bytes, data_link),
        (shard_bytes, shard_link),
        (tensor_bytes, tensor_link),
        (pipeline_bytes, pipeline_link),
        *shared,
    ):
        if link == "intra":
            intra += nbytes
        else:
            inter += nbytes
    compute = trace.flops / (t * p) / (device_tflops * 1e12)
    data_seconds = data_bytes / links.speed(data_link) + shard_bytes / links.speed(shard_link)
    exposed = tensor_bytes / links.speed(tensor_link) + pipeline_bytes / links.speed(pipeline_link)
    exposed += sum(nbytes / links.speed(link) for nbytes, link in shared)  # after the schedule: not overlapped
    exposed += row.transfer_seconds  # offload: the shards to the device and back, counted as not overlapped
    bubble = (p - 1) / (m + p - 1)
    step = (compute + exposed) / (1 - bubble) + max(0.0, data_seconds - compute)
    layout = Layout(
        data_replicate=replicas,
        data_shard=shard,
        tensor=t,
        pipeline=p,
        strategy=strategy,
        precision=trace.precision,
        activation_checkpointing=trace.activation_checkpointing,
        microbatches=m,
        schedule=schedule,
        parameters_bytes=row.parameters_bytes,
        gradients_bytes=row.gradients_bytes,
        optimizer_state_bytes=row.optimizer_state_bytes,
        activations_bytes=row.activations_bytes,
        communication_bytes=row.communication_bytes,
        model_states_bytes=row.states_bytes,
        predicted_peak_bytes_per_rank=row.predicted_peak_bytes_per_rank,
        fits=row.fits,
        data_bytes=int(data_bytes + shard_bytes + sum(nbytes for nbytes, _ in shared)),
        tensor_bytes=int(tensor_bytes),
        pipeline_bytes=int(pipeline_bytes),
        data_link=data_link,
        tensor_link=tensor_link,
        pipeline_link=pipeline_link,
        intra_bytes=int(intra),
        inter_bytes=int(inter),
        compute_seconds=compute,
        communication_seconds=(step - compute / (1 - bubble)),
        bubble=bubble,
        step_seconds=step,
        samples_per_second=batch * d / step if step > 0 else math.inf,
        host_bytes=row.host_bytes,
    )
    try:
        return replace(layout, strategy_arguments=sharded_arguments(layout))
    except ValueError as err:
        return replace(layout, not_buildable=str(err))


def choose(layouts: LayoutPlan, build: Optional[Callable[[Layout], Optional[dict[str, Any]]]] = None) -> Layout:
    """The one recommendation, for ``lightning-mgpu plan`` and ``mgpu_auto`` alike: the memory plan's candidate
    (:data:`~lightning_mgpu.planning.ORDER`: precision first, no activation checkpointing before it, mgpu_ddp before
    the ZeRO stages) as its data-parallel layout when one fits; else, in the first precision of that order where
    one fits, the fastest layout that splits the model among those ``build`` builds (default: the buildable ones,
    :attr:`Layout.buildable`). A data-parallel layout is kept over a faster split: a split trains fewer data ranks
    per step and runs the pipeline or tensor code paths the model does not need. Raises the memory plan's
    :class:`~lightning_mgpu.planning.NoPlanFits` when nothing buildable fits."""
    memory = layouts.memory
    assert memory is not None, "plan_layouts sets the memory plan"
    arguments = build or (lambda x: dict(x.strategy_arguments) if x.buildable else None)
    row = memory.recommended
    if row is not None:
        same = next(
            (
                x
                for x in layouts.layouts
                if not x.model_parallel
                and (x.strategy, x.precision, x.activation_checkpointing)
                == (row.strategy, row.precision, row.activation_checkpointing)
            ),
            None,
        )
        if same is not None and arguments(same) is not None:
            return same
    fitting = [x for x in layouts.layouts if x.fits and x.model_parallel]
    built = [x for x in fitting if arguments(x) is not None]
    if not built:
        raise no_layout_fits(memory, fitting)
    return min(built, key=lambda x: PRECISION_RANK[x.precision])  # stable: the fastest of the first precision


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
