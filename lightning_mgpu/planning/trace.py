"""Count a model's memory without allocating it: model states and one micro-batch's activations under FakeTensorMode.

Everything here runs under ``torch._subclasses.fake_tensor.FakeTensorMode``: tensors carry shape, dtype and
device but no storage, so a 7B-parameter model is "built", stepped and traced in seconds on a laptop. Memory
is attributed by torch's own ``torch.distributed._tools.mem_tracker.MemTracker`` (a ``TorchDispatchMode`` that
sorts every storage into parameters, buffers, gradients, activations, temporaries and optimizer state), the
tool torchtitan's ``scripts/estimate/estimation.py`` uses the same way.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

import torch
from torch import nn

from lightning_mgpu._compat import fake_tensor_mode, mem_tracker, timeline_mem_tracker, tree_map_tensors
from lightning_mgpu.parts.sharding import fsdp_unit_roots
from lightning_mgpu.parts.tensor_parallel import INPUT_SPLIT
from lightning_mgpu.planning.request import PlanError
from lightning_mgpu.quantization import is_nf4, stored_bytes

__all__ = [
    "ModelStates",
    "StepTrace",
    "TensorSplit",
    "count_model_states",
    "pipeline_blocks",
    "tensor_split",
    "trace_step",
]

#: precision -> (dtype the weights and activations are stored in, autocast dtype or None, FP32 master copy)
PRECISION_LAYOUT: dict[str, tuple[torch.dtype, Optional[torch.dtype], bool]] = {
    "32-true": (torch.float32, None, False),
    "bf16-mixed": (torch.float32, torch.bfloat16, False),
    "16-mixed": (torch.float32, torch.float16, False),
    "bf16-master": (torch.bfloat16, None, True),
    "16-master": (torch.float16, None, True),
}

ModelFactory = Callable[[], nn.Module]


def _fake_batch(batch: Any, mode: Any, dtype: Optional[torch.dtype]) -> Any:
    """``batch`` with every tensor as a fake tensor on CPU (meta tensors too); floats cast to ``dtype``."""

    def convert(t: torch.Tensor) -> torch.Tensor:
        target = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        with mode:
            return torch.empty(t.shape, dtype=target)

    return tree_map_tensors(convert, batch)


def _optimizers(module: nn.Module) -> list[torch.optim.Optimizer]:
    """The optimizers of ``module.configure_optimizers()`` (any form Lightning accepts); Adam on every
    parameter for a plain ``nn.Module``."""
    configure = getattr(module, "configure_optimizers", None)
    if configure is None:
        return [as_stepped_on_cuda(torch.optim.Adam(module.parameters()))]
    found: list[torch.optim.Optimizer] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.optim.Optimizer):
            found.append(x)
        elif isinstance(x, dict):
            walk(x.get("optimizer"))
        elif isinstance(x, (list, tuple)):
            for item in x:
                walk(item)

    walk(configure())
    if not found:
        raise PlanError(
            f"{type(module).__name__}.configure_optimizers() returned no optimizer; the planner steps it to count "
            f"the optimizer state. Return one (e.g. torch.optim.AdamW(self.parameters())) or pass a plain nn.Module."
        )
    return [as_stepped_on_cuda(opt) for opt in found]


def as_stepped_on_cuda(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer set to step as torch steps it on CUDA: where ``foreach`` is left to torch (None, not fused),
    torch picks the foreach kernels for CUDA tensors, and their temporaries (Adam: a parameter-sized list for the
    square root of ``exp_avg_sq``) are part of the step's peak; for the planner's CPU tensors it would pick the
    per-tensor loop, whose temporaries are one parameter's.

    >>> opt = as_stepped_on_cuda(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]))
    >>> opt.param_groups[0]["foreach"]
    True
    >>> kept = as_stepped_on_cuda(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], foreach=False))
    >>> kept.param_groups[0]["foreach"]
    False
    """
    for group in optimizer.param_groups:
        if (
            "foreach" in group
            and group["foreach"] is None
            and not group.get("fused")
            and not group.get("differentiable")
        ):
            group["foreach"] = True
    return optimizer


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # self.log(...) without a Trainer warns once per call; the trace runs training_step outside any Trainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@dataclass(frozen=True)
class ModelStates:
    """Exact model-state bytes of one full (unsharded) replica, counted under FakeTensorMode."""

    parameters: dict[str, int]
    """Parameter bytes by dtype name (``{"float32": ...}``) as the model is built."""
    parameter_count: int
    trainable_count: int
    trainable_bytes: int
    """Bytes of the parameters with ``requires_grad`` as built: the only ones with gradients (FP32 master gradients
    in the master modes)."""
    optimized_bytes: int
    """Bytes of the parameters the optimizers hold as built: the ones the master modes copy to FP32 under DDP."""
    buffers: int
    optimizer_state: int
    """Optimizer state after a real ``optimizer.step()`` (Adam: exp_avg, exp_avg_sq and step per parameter)."""
    optimizer_transient: int
    """Extra bytes the step allocates while it runs (foreach kernels' temporaries), freed after it."""
    optimizer_names: tuple[str, ...]
    four_bit_count: int = 0
    """Parameters held in 4 bits (``quantize_frozen``'s weights: counted at their packed bytes, under ``"nf4"`` in
    :attr:`parameters`)."""


def count_model_states(factory: ModelFactory) -> ModelStates:
    """Build the model and its optimizers under FakeTensorMode, give every trainable parameter a gradient, and
    run two optimizer steps (the second under ``MemTracker``): what the optimizer keeps and what it needs
    while stepping, in FP32 as the model is built."""
    with fake_tensor_mode(), _quiet():
        module = factory()
        params = list(module.parameters())
        by_dtype: dict[str, int] = {}
        for p in params:
            key = "nf4" if is_nf4(p) else str(p.dtype).replace("torch.", "")
            by_dtype[key] = by_dtype.get(key, 0) + stored_bytes(p)
        buffers = sum(b.numel() * b.element_size() for b in module.buffers())
        optimizers = _optimizers(module)
        optimized = {id(p): p for opt in optimizers for group in opt.param_groups for p in group["params"]}
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        for opt in optimizers:
            opt.step()  # creates the state
        tracker = mem_tracker()
        tracker.track_external(module, *optimizers)
        before = sum(snap["Total"] for snap in tracker.get_tracker_snapshot().values())
        with tracker:
            for opt in optimizers:
                opt.step()
        peak = sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
        state = 0
        for opt in optimizers:
            for per_param in opt.state.values():
                state += sum(v.numel() * v.element_size() for v in per_param.values() if isinstance(v, torch.Tensor))
    return ModelStates(
        parameters=by_dtype,
        parameter_count=sum(p.numel() for p in params),
        trainable_count=sum(p.numel() for p in params if p.requires_grad),
        trainable_bytes=sum(stored_bytes(p) for p in params if p.requires_grad),
        optimized_bytes=sum(stored_bytes(p) for p in optimized.values()),
        buffers=buffers,
        optimizer_state=state,
        optimizer_transient=max(0, peak - before),
        optimizer_names=tuple(type(o).__name__ for o in optimizers),
        four_bit_count=sum(p.numel() for p in params if is_nf4(p)),
    )


@dataclass(frozen=True)
class StepTrace:
    """One micro-batch's forward + backward under one precision, with or without activation checkpointing."""

    precision: str
    activation_checkpointing: bool
    parameters: int
    """Parameter bytes as the step sees them (half for the master modes)."""
    gradients: int
    """Gradient bytes once backward has finished (dtype of the parameters)."""
    activations: int
    """Peak of activations + temporaries (gradients of activations, recomputation) during the step."""
    checkpointed: tuple[str, ...]
    timeline: tuple[tuple[int, int], ...] = field(default=(), repr=False)
    """(activations + temporaries, gradients) after every op of the step."""
    flops: int = 0
    """Floating-point operations of the step (forward, backward and any recomputation), counted by torch's
    ``FlopCounterMode`` (attention's fused kernels included)."""
    blocks: int = 0
    """The model's blocks (:func:`pipeline_blocks`): what a pipeline splits into stages, a tensor split splits."""
    block_output_bytes: int = 0
    """The largest output of one block for this micro-batch: what a pipeline stage sends to the next, and the
    activation a tensor-parallel block all-reduces."""
    rowwise_layers: int = 0
    """Calls, in the traced forward, of the layers of the blocks that tensor parallelism's auto plan splits by
    input row (attention's output, the MLP's down projection): each all-reduces its output, one block output's
    worth."""
    rowwise_recomputed: int = 0
    """Their calls that activation checkpointing runs again in backward (counted in the traced step: torch's
    recomputation stops once every tensor the backward keeps is back, so a block's last row-wise layer, whose
    output only the residual sum reads, is usually not run again)."""
    colwise_layers: int = 0
    """Calls, in the traced forward, of the layers of the blocks it splits by output column (query, key, value; the
    MLP's gate and up): each all-reduces its input's gradient, one block output's worth, in backward."""
    tensor_split_bytes: int = 0
    """Parameter bytes (as the step sees them) that the auto plan of tensor parallelism shards across the tensor
    group (:meth:`~lightning_mgpu.parts.tensor_parallel.TensorParallelPlan.split_parameters`); the rest (embedding,
    norms, head, an attention it does not split, row-wise biases) stays whole on each rank of the group."""
    tensor_split_activations: int = 0
    """Bytes of the outputs, in the traced forward, of the column-wise layers the auto plan splits (first call of
    each): the block intermediates (the MLP's hidden activations, the split attention's query, key and value) a rank
    of a tensor split holds ``1 / T`` of; every other activation (residual stream, norms, logits) stays whole
    without sequence parallelism."""
    outside_parameters: int = 0
    """Parameter bytes (as the step sees them) outside the blocks: the embeddings, the final norm, the head. A
    pipeline holds them whole on every rank, with their gradients and optimizer state (only the blocks are split
    into stages)."""
    outside_tensor_split: int = 0
    """Of :attr:`outside_parameters`, the bytes the auto plan of tensor parallelism shards (a model's own plan may
    split its embedding or head)."""
    tensor_refused: str = ""
    """Why the auto plan of tensor parallelism would be refused for this model (it splits too little of the linear
    layers' parameters: :func:`~lightning_mgpu.parts.tensor_parallel.refuse_unsplit`), in words; ``""`` where it
    splits enough. No tensor split is proposed then (:attr:`TensorSplit.refused`)."""
    tensor_divisor: int = 0
    """:attr:`TensorSplit.divisor`: a tensor size is proposed only where it divides this (0: nothing split)."""

    def peak_with_gradients(self, fraction: float) -> int:
        """The largest ``activations(t) + fraction * gradients(t)``: a rank that keeps ``fraction`` of each
        gradient as it is produced (``1/N`` under FSDP)."""
        return int(max((a + fraction * g for a, g in self.timeline), default=self.activations))


def _forward_loss(module: nn.Module, batch: Any) -> torch.Tensor:
    """The outputs of ``module(batch)`` summed: ``module(*batch)`` for a tuple or list, ``module(**batch)`` for a
    dict (as Lightning calls ``forward`` with ``example_input_array``)."""
    if isinstance(batch, (tuple, list)):
        out = module(*batch)
    elif isinstance(batch, dict):
        out = module(**batch)
    else:
        out = module(batch)
    tensors: list[torch.Tensor] = []
    tree_map_tensors(tensors.append, out)
    if not tensors:
        raise PlanError(f"{type(module).__name__}.forward returned no tensor to sum as the loss.")
    return sum(t.float().sum() for t in tensors if t.is_floating_point() or t.is_complex())  # type: ignore[return-value]


def _loss(module: nn.Module, batch: Any, forward: bool = False) -> torch.Tensor:
    # duck-typed: a LightningModule of either namespace (pytorch_lightning or lightning.pytorch)
    if forward:
        return _forward_loss(module, batch)
    if hasattr(module, "training_step") and hasattr(module, "automatic_optimization"):
        if not module.automatic_optimization:
            raise PlanError(
                f"{type(module).__name__} uses manual optimization (automatic_optimization=False): its "
                f"training_step steps optimizers itself, which the planner cannot trace. Plan a module with "
                f"automatic optimization, or a plain nn.Module with a sample batch (plan(model, batch=...))."
            )
        out = module.training_step(batch, 0)  # type: ignore[operator]
        loss = out["loss"] if isinstance(out, dict) else out
    else:
        out = module(*batch) if isinstance(batch, (tuple, list)) else module(batch)
        loss = out.float().sum() if isinstance(out, torch.Tensor) else sum(o.float().sum() for o in out)
    if not isinstance(loss, torch.Tensor):
        raise PlanError(f"{type(module).__name__}.training_step returned {type(loss).__name__}, not a loss tensor.")
    return loss


def trace_step(
    factory: ModelFactory,
    batch: Any,
    precision: str,
    policy: Any = None,
    forward: bool = False,
    split: Optional[TensorSplit] = None,
    save: Any = None,
) -> StepTrace:
    """Forward + backward of one micro-batch of ``batch`` (a sample batch: real, meta or fake tensors) under
    FakeTensorMode and ``TimelineTracker``; ``policy``: checkpoint these blocks (None: no checkpointing);
    ``forward``: ``batch`` is the input of ``module(...)`` (``example_input_array``), not of ``training_step``;
    ``split``: what tensor parallelism's auto plan splits, derived before on the model's real weights
    (:func:`tensor_split`; None: derived here, on the fake build, by the name rules only); ``save``: what each
    checkpointed block keeps (selective checkpointing; a memory budget is chosen in an untracked step first)."""
    from lightning_mgpu.parts.activation_checkpointing import apply_activation_checkpointing

    dtype, autocast, _ = PRECISION_LAYOUT[precision]
    with fake_tensor_mode() as mode, _quiet():
        module = factory()
        if dtype != torch.float32:
            _cast(module, dtype)
        module.train()
        blocks = pipeline_blocks(module)
        outputs: dict[int, int] = {}  # a block's first call (a checkpointed block runs again in backward)

        def record(block: nn.Module, inputs: Any, out: Any) -> None:
            outputs.setdefault(id(block), _tensor_bytes(out))

        handles = [block.register_forward_hook(record) for block in blocks]
        # the split layers' calls: row-wise in forward and in the recomputation, column-wise in forward (each
        # call's input gradient is all-reduced once in backward)
        calls = {("rowwise", "forward"): 0, ("rowwise", "backward"): 0, ("colwise", "forward"): 0}
        phase = ["forward"]
        plan = split if split is not None else tensor_split(module, real=False)
        inside_blocks = {id(m) for block in blocks for m in block.modules()}
        split_layers = [
            (layer, kind) for name, kind in plan.kinds if id(layer := module.get_submodule(name)) in inside_blocks
        ]
        split_names = plan.parameters
        for layer, kind in split_layers:  # one split by input column with its input whole: both collectives
            for k in ("rowwise", "colwise") if kind == INPUT_SPLIT else (kind,):
                handles.append(layer.register_forward_hook(lambda *_, k=k: _count(calls, (k, phase[0]))))
        intermediates: dict[int, int] = {}  # the column-wise layers' outputs, first call each

        def intermediate(layer: nn.Module, inputs: Any, out: Any) -> None:
            intermediates.setdefault(id(layer), _tensor_bytes(out))

        handles += [layer.register_forward_hook(intermediate) for layer, kind in split_layers if kind == "colwise"]
        checkpointed = tuple(apply_activation_checkpointing(module, policy, save=save)) if policy is not None else ()
        fake = _fake_batch(batch, mode, dtype if dtype != torch.float32 else None)
        if isinstance(save, float) and checkpointed:  # a memory budget chooses what to keep in a first forward
            with torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext():
                _loss(module, fake, forward).backward()
            module.zero_grad(set_to_none=True)
            for key in calls:
                calls[key] = 0
            outputs.clear()
            intermediates.clear()
        tracker = timeline_mem_tracker()
        tracker.track_external(module)
        with tracker, flop_counter() as flops:
            with torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext():
                loss = _loss(module, fake, forward)
            phase[0] = "backward"
            loss.backward()
        for handle in handles:
            handle.remove()
        params = list(module.parameters())
        named = dict(module.named_parameters())
        shards = {id(named[n]): named[n] for n in split_names if n in named}  # a tied parameter once
        inside = {id(p) for block in blocks for p in block.parameters()}
        return StepTrace(
            precision=precision,
            activation_checkpointing=policy is not None,
            parameters=sum(stored_bytes(p) for p in params),
            gradients=sum(stored_bytes(p) for p in params if p.requires_grad),
            activations=max((a for a, _ in tracker.timeline), default=0),
            checkpointed=checkpointed,
            timeline=tuple(tracker.timeline),
            flops=int(flops.get_total_flops()),
            blocks=len(blocks),
            block_output_bytes=max(outputs.values(), default=0),
            rowwise_layers=calls["rowwise", "forward"],
            rowwise_recomputed=calls["rowwise", "backward"],
            colwise_layers=calls["colwise", "forward"],
            tensor_split_bytes=sum(stored_bytes(p) for p in shards.values()),
            tensor_split_activations=sum(intermediates.values()),
            outside_parameters=sum(stored_bytes(p) for p in params if id(p) not in inside),
            outside_tensor_split=sum(stored_bytes(p) for i, p in shards.items() if i not in inside),
            tensor_refused=plan.refused,
            tensor_divisor=plan.divisor,
        )


def _count(calls: dict[tuple[str, str], int], key: tuple[str, str]) -> None:
    if key in calls:
        calls[key] += 1


#: the tensor size the planner derives the auto plan at: the smallest split. The pairs the plan finds do not depend
#: on the size but through what it divides (:attr:`TensorSplit.divisor` says which larger sizes keep them all).
PLANNED_TENSOR_SIZE = 2


@dataclass(frozen=True)
class TensorSplit:
    """What tensor parallelism's auto plan splits of a model, derived once for a plan (:func:`tensor_split`)."""

    kinds: tuple[tuple[str, str], ...] = ()
    """``(layer name, "colwise" | "rowwise" | INPUT_SPLIT)`` of each layer the plan splits (INPUT_SPLIT: by input
    column with its input whole, an attention whose heads stay whole: its output all-reduced in forward, its input's
    gradient gathered in backward)."""
    parameters: tuple[str, ...] = ()
    """The names of the parameters the plan shards (within the blocks or not)."""
    refused: str = ""
    """Why the plan would be refused (it splits too little:
    :func:`~lightning_mgpu.parts.tensor_parallel.splits_too_little`), in words; ``""`` where it splits enough."""
    divisor: int = 0
    """The greatest common divisor of the widths the plan splits (each split layer's output, or input where it is
    split by row) and of the head counts it makes local: a tensor size that divides it keeps every pair split, one
    that does not would leave some whole. 0 where it splits nothing."""


def _real_weights(module: nn.Module) -> bool:
    return not any(p.device.type == "meta" for p in module.parameters())


def tensor_split(module: nn.Module, real: bool) -> TensorSplit:
    """What the auto plan of tensor parallelism splits of ``module`` at :data:`PLANNED_TENSOR_SIZE` ranks, as the
    launch derives it (:func:`~lightning_mgpu.parts.tensor_parallel.derive_plan`), and whether it splits too little
    (the launch's condition: :func:`~lightning_mgpu.parts.tensor_parallel.splits_too_little`). ``real``: the
    parameters hold real numbers (not fake, not on the meta device): the layers no name rule matches are paired by
    the model's structure, one forward on a small random input with each pair checked, as at launch; else by the
    name rules only (a forward of fake or meta tensors proves no split), and a refusal says so."""
    from lightning_mgpu.parts.tensor_parallel import (
        MIN_SPLIT_SHARE,
        _widths,
        derive_plan,
        split_share,
        splits_too_little,
    )

    structure = real and _real_weights(module)
    size = PLANNED_TENSOR_SIZE
    try:
        plan = derive_plan(module, tensor_size=size, structure=structure)
    except ValueError as err:  # a model's own plan that names what this module does not have: no split
        return TensorSplit(refused=f"its auto plan cannot be derived ({str(err).splitlines()[0]})")
    kinds = {n: "colwise" if k.startswith("colwise") else k for n, k in plan.kinds().items()}  # packed: colwise
    divisor = 0
    for name, kind in kinds.items():
        width_in, width_out = _widths(module.get_submodule(name))
        divisor = math.gcd(divisor, width_in if kind in ("rowwise", INPUT_SPLIT) else width_out)
    for _, _, count in plan.heads:
        divisor = math.gcd(divisor, count)
    done, total = split_share(module, plan)
    refused = ""
    if splits_too_little(plan, done, total):
        share = f"{done / total:.0%}" if total else "none"
        needs = (
            f"{share} of {type(module).__name__}'s linear layers' parameters, under the {MIN_SPLIT_SHARE:.0%} it needs"
        )
        if structure:
            more = "neither its name rules nor its structure pair more"
            refused = f"the auto plan at tensor size {size} splits {needs} ({more})"
        else:
            built = "on the meta device" if real else "under fake tensors"
            refused = (
                f"the auto plan's name rules split {needs}; the pairs its structure gives could not be checked "
                f"without real weights (the model was built {built}). Plan an instance built with real weights "
                f"(plan(model, ...)) to have them checked as at start-up, or pass a tensor_parallel_plan of your own"
            )
    return TensorSplit(tuple(kinds.items()), tuple(plan.split_parameters(module)), refused, divisor)


def pipeline_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks of ``module`` a pipeline splits into stages (and a tensor split splits): its transformer layers
    when it has any (``nn.TransformerEncoderLayer``/``DecoderLayer``), else the children of its outermost
    ``nn.Sequential``/``nn.ModuleList`` (the blocks activation checkpointing's ``EveryNth(1)`` selects); none for a
    model whose layers are plain attributes."""
    from lightning_mgpu.parts.activation_checkpointing import EveryNth, select_modules

    layers = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
    found: list[nn.Module] = [m for m in module.modules() if isinstance(m, layers)]
    if found:
        return found
    try:
        return [block for _, block in select_modules(module, EveryNth(1))]
    except ValueError:
        return []


def _tensor_bytes(out: Any) -> int:
    tensors: list[torch.Tensor] = []
    tree_map_tensors(tensors.append, out)
    return sum(t.numel() * t.element_size() for t in tensors)


def flop_counter() -> Any:
    """torch's ``FlopCounterMode`` (quiet), taught the fused attention kernel torch runs on CPU (the planner traces on
    CPU; on CUDA the flash and memory-efficient kernels are counted by torch itself) with torch's own formulas."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten

    def forward(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return int(fc.sdpa_flop_count(query, key, value))

    def backward(grad: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return int(fc.sdpa_backward_flop_count(grad, query, key, value))

    mapping: dict[Any, Callable[..., int]] = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu] = forward
        mapping[aten._scaled_dot_product_flash_attention_for_cpu_backward] = backward
    counter = fc.FlopCounterMode(display=False, custom_mapping=mapping)
    # its module tracker (for counts per module, which the planner does not read) hooks every module's outputs for
    # backward and so keeps alive the activations activation checkpointing frees: count the whole step only
    counter.mod_tracker = _WholeStep()  # type: ignore[assignment]  # the counter only enters it and reads parents
    return counter


class _WholeStep:
    """Stands in for ``FlopCounterMode``'s module tracker: every operation counts towards the whole step."""

    parents: ClassVar[set[str]] = {"Global"}

    def __enter__(self) -> _WholeStep:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _cast(module: nn.Module, dtype: torch.dtype) -> None:
    """``module.to(dtype)`` for fake tensors (``Module.to`` swaps tensors in place, which fake tensors refuse)."""
    for m in module.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            if p.is_floating_point() and not is_nf4(p):  # setattr keeps the registration; a 4-bit weight stays
                setattr(m, name, nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad))
        for name, buf in list(m.named_buffers(recurse=False)):
            if buf.is_floating_point():  # and a buffer keeps its persistence
                setattr(m, name, buf.to(dtype))


def unit_fractions(factory: ModelFactory) -> tuple[float, float]:
    """The largest FSDP unit's share of the parameter bytes, and the root unit's (the parameters no other unit holds;
    FSDP2 keeps the root gathered between forward and backward). Bytes as stored: a 4-bit weight at its packed
    bytes, which is what FSDP2 gathers."""
    with fake_tensor_mode(), _quiet():
        module = factory()
        total = sum(stored_bytes(p) for p in module.parameters()) or 1
        units = fsdp_unit_roots(module)
        owned: set[int] = set()
        sizes = []
        for unit in units:
            ps = [p for p in unit.parameters() if id(p) not in owned]
            owned.update(id(p) for p in ps)
            sizes.append(sum(stored_bytes(p) for p in ps))
        root = sum(stored_bytes(p) for p in module.parameters() if id(p) not in owned)
    return max([*sizes, root]) / total, root / total
