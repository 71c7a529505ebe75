"""Activation checkpointing that keeps BatchNorm statistics right, under DDP, sharding and accumulation.

Checkpointing frees a block's activations after its forward and recomputes them in backward. torch's
``torch.utils.checkpoint`` (both modes) and ``checkpoint_wrapper`` run the block's forward a second time
with its modules in training mode, so every BatchNorm updates its running statistics twice per step
(``num_batches_tracked`` = 2 after one step; pytorch issue 96136). Here the recompute runs against
throwaway copies of the state it would change:

* BatchNorm / InstanceNorm running statistics and ``num_batches_tracked`` (their kernels update them
  without bumping the tensor version counter, so they are always covered), and any other buffer the
  block's forward changed in place (detected from version counters during the first forward);
* SyncBatchNorm inside a checkpointed block computes its statistics with one all-reduce in forward and one
  in backward, like torch's, and the recompute replays the forward's result instead of communicating
  again. It runs on CPU (gloo) as well, where torch's SyncBatchNorm refuses to.

Random number generators are restored for the recompute by torch (``preserve_rng_state=True``), so dropout
masks and gradients equal the run without checkpointing; autocast state is replayed by torch too.

Example::

    from torch import nn
    from lightning_mgpu import apply_activation_checkpointing, MGPUDDPStrategy

    apply_activation_checkpointing(model, {nn.TransformerEncoderLayer, "ConvBlock"})  # any nn.Module
    Trainer(strategy=MGPUDDPStrategy(activation_checkpointing={nn.TransformerEncoderLayer}))  # or here
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_mgpu import comm
from lightning_mgpu._compat import (
    check_norm_input_dim,
    dispatch_mode_base,
    operator_schema,
    outside_dispatch_modes,
    tensor_version,
)
from lightning_mgpu.comm import group_is_up
from lightning_mgpu.settings import (
    ActivationCheckpointingPolicy,
    CheckpointSave,
    EveryNth,
    import_policy_class,
    resolve_save,
    validate_policy,
    validate_save,
)

# torch's public normalisation layers with running statistics (their common bases _BatchNorm/_InstanceNorm are
# private; a lazy layer becomes its plain class once initialised)
_NORMS = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)

__all__ = [
    "ActivationCheckpointingPolicy",
    "EveryNth",
    "apply_activation_checkpointing",
    "checkpointed_modules",
    "remove_activation_checkpointing",
    "select_modules",
]


def classes_present(model: nn.Module) -> list[str]:
    """The class names of ``model``'s modules, sorted (what an error about a module class lists as choices)."""
    return sorted({type(m).__name__ for m in model.modules()})


def _class_matcher(items: Iterable[Union[type[nn.Module], str]], model: nn.Module) -> Callable[[nn.Module], bool]:
    classes: list[type[nn.Module]] = []
    names: set[str] = set()
    present = {c.__name__ for m in model.modules() for c in type(m).__mro__}  # classes and their bases
    for item in items:
        if isinstance(item, str) and "." in item:
            classes.append(import_policy_class(item))
        elif isinstance(item, str):
            if item not in present:
                raise ValueError(
                    f"activation_checkpointing: no module class named {item!r} in {type(model).__name__}. The "
                    f"module classes present are {classes_present(model)}."
                )
            names.add(item)
        else:
            classes.append(item)
    cls_tuple = tuple(classes)

    def match(m: nn.Module) -> bool:
        # a name matches the class or any base class, like isinstance does for a class
        return isinstance(m, cls_tuple) or any(c.__name__ in names for c in type(m).__mro__)

    return match


def _containers(model: nn.Module, policy: EveryNth) -> list[tuple[str, nn.Module]]:
    if policy.container is not None:
        try:
            container = model.get_submodule(policy.container)
        except AttributeError:
            raise ValueError(
                f"EveryNth(container={policy.container!r}): {type(model).__name__} has no such submodule. "
                f"Its Sequential/ModuleList containers are "
                f"{[n for n, m in model.named_modules() if isinstance(m, (nn.Sequential, nn.ModuleList)) and n]}."
            ) from None
        if not isinstance(container, (nn.Sequential, nn.ModuleList)):
            raise ValueError(
                f"EveryNth(container={policy.container!r}) is a {type(container).__name__}; it must name an "
                f"nn.Sequential or nn.ModuleList whose children are the blocks."
            )
        return [(policy.container, container)]
    found: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.Sequential, nn.ModuleList)) and not any(
            name.startswith(f"{outer}.") or outer == "" for outer, _ in found
        ):
            found.append((name, m))
    return found


def select_modules(model: nn.Module, policy: ActivationCheckpointingPolicy) -> list[tuple[str, nn.Module]]:
    """The ``(name, module)`` pairs ``policy`` checkpoints in ``model``: outermost matches only, never the root.

    Raises ``ValueError`` naming the module classes present when the policy matches nothing, when a class
    name is unknown, or when it matches the root module itself (checkpointing the whole model frees nothing:
    the recompute needs every activation at once).
    """
    validate_policy(policy)
    if policy is None:
        return []
    if isinstance(policy, EveryNth):
        chosen: list[tuple[str, nn.Module]] = []
        for cname, container in _containers(model, policy):
            prefix = f"{cname}." if cname else ""
            chosen += [(f"{prefix}{i}", child) for i, child in enumerate(container.children()) if i % policy.n == 0]
        if not chosen:
            raise ValueError(
                f"activation_checkpointing={policy!r} found no Sequential/ModuleList blocks in "
                f"{type(model).__name__}. Name the blocks' classes instead; the module classes present are "
                f"{classes_present(model)}."
            )
        return chosen
    if isinstance(policy, (str, type)):
        match = _class_matcher([policy], model)
    elif isinstance(policy, (list, tuple, set, frozenset)):
        match = _class_matcher(policy, model)
    else:
        match = policy  # type: ignore[assignment]  # validate_policy left only a callable
    if match(model):
        raise ValueError(
            f"activation_checkpointing={_describe(policy)} matches the root module {type(model).__name__}. "
            f"Checkpointing the whole model frees nothing (the recompute needs all its activations at once) and "
            f"would run Lightning's hooks twice. Checkpoint its blocks instead; the module classes present are "
            f"{classes_present(model)}."
        )
    chosen = []
    for name, m in model.named_modules():
        if name and match(m) and not any(name.startswith(f"{outer}.") for outer, _ in chosen):
            chosen.append((name, m))
    if not chosen:
        raise ValueError(
            f"activation_checkpointing={_describe(policy)} matches no module of {type(model).__name__}, so nothing "
            f"would be checkpointed. The module classes present are {classes_present(model)}."
        )
    return chosen


def _describe(policy: Any) -> str:
    if isinstance(policy, type):
        return policy.__name__
    if isinstance(policy, (set, frozenset)):
        return repr(sorted(p if isinstance(p, str) else p.__name__ for p in policy))
    if callable(policy):
        return getattr(policy, "__name__", repr(policy))
    return repr(policy)


# --- the recompute ------------------------------------------------------------------------------------------

_active = threading.local()  # .region: the _Region whose forward (first run or recompute) is running here


_NORM_STATS = ("running_mean", "running_var", "num_batches_tracked")


def _is_norm_stat(module: nn.Module, name: str) -> bool:
    """A buffer a normalisation layer updates in training mode without bumping its version counter."""
    return isinstance(module, _NORMS) and bool(getattr(module, "track_running_stats", False)) and name in _NORM_STATS


class _Region:
    """One call of a checkpointed module: its first forward, then each recompute of it."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.runs = 0
        self.mutated: list[tuple[nn.Module, str]] = []
        self.stats: list[torch.Tensor] = []  # SyncBatchNorm all-reduce results of the first forward, in call order
        self.cursor = 0

    @property
    def recomputing(self) -> bool:
        return self.runs > 1

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.runs += 1
        previous = getattr(_active, "region", None)
        _active.region = self
        try:
            if self.runs == 1:
                before = [
                    (m, n, b, tensor_version(b))
                    for m in self.module.modules()
                    for n, b in m.named_buffers(recurse=False)
                ]
                out = fn(*args, **kwargs)
                self.mutated = [
                    (m, n)
                    for m, n, b, v in before
                    if _is_norm_stat(m, n) or getattr(m, n) is not b or tensor_version(b) != v
                ]
                return out
            # Recompute: the forward updates throwaway copies of the state; the originals keep the first
            # forward's update and their version counters (the reentrant backward checks them).
            self.cursor = 0
            # (assigning a tensor to a registered buffer's name replaces the buffer: nn.Module.__setattr__)
            # The copies are made past selective checkpointing's replaying mode: it must see the block's own
            # operations only, in the first forward's order.
            originals = [(m, n, b) for m, n in self.mutated if (b := getattr(m, n)) is not None]
            with outside_dispatch_modes():
                for m, n, b in originals:
                    setattr(m, n, b.detach().clone())
            try:
                return fn(*args, **kwargs)
            finally:
                for m, n, b in originals:
                    setattr(m, n, b)
        finally:
            _active.region = previous


class _StatsAllReduce(torch.autograd.Function):
    """``all_reduce(SUM)`` with autograd (backward: all-reduce of the gradient, as torch's
    ``torch.distributed.nn.functional.all_reduce``); given ``cached``, forward returns it instead of
    communicating, so a recompute builds the same graph without a second collective."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any, cached: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.group = group
        if cached is not None:
            return cached.clone()
        out = local.clone()
        comm.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None]:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=ctx.group)
        return grad, None, None


def _sync_batch_norm(bn: nn.SyncBatchNorm, x: torch.Tensor, region: _Region, group: Any) -> torch.Tensor:
    """SyncBatchNorm's training forward from autograd ops: per-channel count, sum and sum of squares (in
    float64) all-reduced once; the backward's one all-reduce comes from :class:`_StatsAllReduce`."""
    c = x.shape[1]
    dims = [0, *range(2, x.dim())]
    xd = x.double()
    count = torch.full((1,), x.numel() // c, dtype=torch.float64, device=x.device)
    local = torch.cat([xd.sum(dims), (xd * xd).sum(dims), count])
    if region.recomputing:
        cached: Optional[torch.Tensor] = region.stats[region.cursor]
        region.cursor += 1
    else:
        cached = None
    total = _StatsAllReduce.apply(local, group, cached)
    if not region.recomputing:
        region.stats.append(total.detach())
    n = total[-1]
    mean = total[:c] / n
    var = (total[c : 2 * c] / n - mean * mean).clamp_min(0)
    shape = [1, c] + [1] * (x.dim() - 2)
    out = (xd - mean.view(shape)) * torch.rsqrt(var + bn.eps).view(shape)
    if bn.weight is not None:
        out = out * bn.weight.double().view(shape) + bn.bias.double().view(shape)
    if bn.track_running_stats and bn.running_mean is not None and bn.running_var is not None:
        with torch.no_grad():
            assert bn.num_batches_tracked is not None
            bn.num_batches_tracked.add_(1)
            factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
            unbiased = var * n / (n - 1).clamp_min(1)
            bn.running_mean.mul_(1 - factor).add_(mean.to(bn.running_mean.dtype), alpha=factor)
            bn.running_var.mul_(1 - factor).add_(unbiased.to(bn.running_var.dtype), alpha=factor)
    return out.to(x.dtype)


class _SyncBNForward:
    """Instance ``forward`` of a SyncBatchNorm inside a checkpointed block: our statistics path while the
    block runs in training mode on several ranks, torch's forward otherwise."""

    def __init__(self, bn: nn.SyncBatchNorm) -> None:
        self.bn = bn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bn, region = self.bn, getattr(_active, "region", None)
        group = bn.process_group or (dist.group.WORLD if group_is_up() else None)
        if region is None or not bn.training or group is None or dist.get_world_size(group) < 2:
            return type(bn).forward(bn, x)
        check_norm_input_dim(bn, x)
        return _sync_batch_norm(bn, x, region, group)


# ----------------------------------------------------------------------------------------------------
# Selective checkpointing: inside a checkpointed block, which operator outputs are kept for backward instead of
# recomputed (torch's ``create_selective_checkpoint_contexts``; torchtitan's per-operator policy keeps the matrix
# multiplications, whose recompute costs the most per byte kept).


def _output_bytes(out: Any) -> int:
    return sum(t.untyped_storage().nbytes() for t in _tensors(out))


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


# Allocations whose memory a later in-place operation fills (dropout's mask: empty_like, then bernoulli_): keeping
# one would keep a tensor the forward mutates after it was kept, which torch's selective checkpointing refuses.
_ALLOCATIONS = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like", "ones",
     "ones_like", "full", "full_like", "new_zeros", "new_ones", "new_full"}
)  # fmt: skip


def _keepable(func: Any) -> bool:
    """An operator whose outputs may be kept: computed from its inputs (not an allocation, not random), neither
    mutating its inputs nor returning a view of them (a view keeps its base alive, counted where the base is made)."""
    schema = operator_schema(func)
    return (
        func.overloadpacket.__name__ not in _ALLOCATIONS
        and torch.Tag.nondeterministic_seeded not in func.tags
        and not schema.is_mutable
        and all(r.alias_info is None for r in schema.returns)
    )


class _OperatorCosts(dispatch_mode_base()):  # type: ignore[misc]
    """Records, for one forward of a block, each operator's output bytes and its cost to recompute (its FLOPs by
    torch's flop counter formulas where it has one, else one per output element: memory-bound)."""

    def __init__(self) -> None:
        super().__init__()
        self.costs: dict[Any, list[float]] = {}  # operator -> [bytes, recompute cost]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _keepable(func):
            size = _output_bytes(out)
            formula = flop_registry.get(func.overloadpacket)
            cost = (
                formula(*args, **kwargs, out_val=out) if formula is not None else sum(t.numel() for t in _tensors(out))
            )
            entry = self.costs.setdefault(func.overloadpacket, [0.0, 0.0])
            entry[0] += size
            entry[1] += float(cost)
        return out


def _operator(name: str) -> Any:
    """The operator (overload packet) named ``"namespace.name"`` (``str`` of one, e.g. ``"aten.mm"``)."""
    namespace, _, op = name.partition(".")
    return getattr(getattr(torch.ops, namespace), op)


def budget_choice(costs: dict[Any, list[float]], budget: float) -> frozenset[Any]:
    """The operators whose outputs a block keeps under ``budget`` (the fraction of its operator outputs' bytes): the
    costliest to recompute per byte first, while the bytes kept stay within the budget."""
    total = sum(size for size, _ in costs.values())
    kept: set[Any] = set()
    used = 0.0
    for op, (size, _) in sorted(costs.items(), key=lambda kv: -kv[1][1] / max(kv[1][0], 1.0)):
        if size and used + size <= budget * total:
            kept.add(op)
            used += size
    return frozenset(kept)


class _Selection:
    """What one checkpointed module keeps: a fixed set of operators, or (a memory budget) the set chosen from the
    costs measured in its first training forward, which itself keeps nothing (whole-block checkpointing, the least
    memory, while it measures)."""

    def __init__(self, save: CheckpointSave) -> None:
        self.budget = save if isinstance(save, float) else None
        self.ops: Optional[frozenset[Any]] = None
        if not isinstance(save, float) and save is not None:
            self.ops = resolve_save(save)

    def context(self) -> Any:
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        ops = self.ops or frozenset()

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            keep = func.overloadpacket in ops and _keepable(func)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    # torch's operators do not pickle (a spawn launch pickles the module): their names do
    def __getstate__(self) -> dict[str, Any]:
        ops = None if self.ops is None else sorted(str(op) for op in self.ops)  # "aten.mm"
        return {"budget": self.budget, "ops": ops}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.budget = state["budget"]
        names = state["ops"]
        self.ops = None if names is None else frozenset(_operator(name) for name in names)

    def measuring(self) -> Optional[_OperatorCosts]:
        return _OperatorCosts() if self.budget is not None and self.ops is None else None

    def measured(self, recorder: _OperatorCosts) -> None:
        assert self.budget is not None
        self.ops = budget_choice(recorder.costs, self.budget)


class _CheckpointedForward:
    """Instance ``forward`` of a checkpointed module. Its class's ``forward`` runs inside
    ``torch.utils.checkpoint.checkpoint``; ``module(...)`` still runs the module's hooks once per call (FSDP's
    unshard/reshard stay outside the recompute, as with torch's ``checkpoint_wrapper`` applied before
    ``fully_shard``). Module structure and state-dict keys are unchanged."""

    def __init__(
        self, module: nn.Module, use_reentrant: bool, preserve_rng_state: bool, save: CheckpointSave = None
    ) -> None:
        self.module = module
        self.use_reentrant = use_reentrant
        self.preserve_rng_state = preserve_rng_state
        self.selection = _Selection(save) if save is not None else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        forward = functools.partial(type(module).forward, module)
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)  # evaluation: nothing is saved for backward anyway
        selection = self.selection
        if torch.compiler.is_compiling():
            # Under torch.compile, AOTAutograd recomputes from the traced graph, where the normalisation
            # layers' buffer updates are applied once, after the graph: torch's checkpoint is already
            # BatchNorm-safe there (checked in tests), and our region's Python bookkeeping would not trace.
            # Selective checkpointing is not applied here: torch.compile runs a block with a selective policy
            # outside its graph, where the recompute would update BatchNorm's statistics a second time (measured:
            # num_batches_tracked doubled); compiled, the block is recomputed whole.
            return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=self.preserve_rng_state, **kwargs)
        region = _Region(module)
        if self.use_reentrant:
            # Reentrant checkpointing returns outputs without a graph when no input requires grad (the
            # first block of a model): a dummy input that does keeps the block's parameters in the graph.
            dummy = torch.empty(0, requires_grad=True)

            def run(_dummy: torch.Tensor, *inner: Any) -> Any:
                return region.run(forward, inner, kwargs)

            return checkpoint(run, dummy, *args, use_reentrant=True, preserve_rng_state=self.preserve_rng_state)

        measure = selection.measuring() if selection is not None else None

        def run_kw(*inner: Any, **inner_kwargs: Any) -> Any:
            if measure is None or region.runs:
                return region.run(forward, inner, inner_kwargs)
            with measure:  # the first forward of a block under a memory budget: its operators' costs
                return region.run(forward, inner, inner_kwargs)

        context: dict[str, Any] = {} if selection is None else {"context_fn": selection.context}
        out = checkpoint(
            run_kw, *args, use_reentrant=False, preserve_rng_state=self.preserve_rng_state, **context, **kwargs
        )
        if measure is not None:
            assert selection is not None
            selection.measured(measure)
        return out


def apply_activation_checkpointing(
    model: nn.Module,
    policy: ActivationCheckpointingPolicy,
    *,
    use_reentrant: bool = False,
    preserve_rng_state: bool = True,
    save: CheckpointSave = None,
) -> list[str]:
    """Checkpoint the blocks of ``model`` that ``policy`` selects, in place; returns their names.

    Works on any ``nn.Module`` (a LightningModule too) without our strategies; apply it before wrapping the
    model in DDP/FSDP (checkpointing before sharding) and before ``torch.compile``. Calling it again
    replaces the settings of modules already checkpointed; :func:`remove_activation_checkpointing` undoes it.

    Args:
        model: the model; its root is never checkpointed.
        policy: see :data:`ActivationCheckpointingPolicy`.
        use_reentrant: torch's reentrant mode (``torch.utils.checkpoint`` with ``use_reentrant=True``). The
            default, non-reentrant, is torch's recommendation and works with DDP without ``static_graph``.
        preserve_rng_state: restore the RNG state for the recompute (dropout masks equal the first forward).
        save: what a checkpointed block keeps for backward (selective checkpointing, non-reentrant mode only):
            ``None`` nothing but its input (the whole block is recomputed); ``"matmuls"`` the outputs of its matrix
            multiplications, convolutions and attention (the costliest to recompute per byte); a list of operator
            names (``["mm", "addmm"]``, torch's ``aten`` operators); or a memory budget, a float between 0 and 1:
            the fraction of the bytes of its operator outputs it may keep, the costliest to recompute per byte
            first (chosen from the block's first training forward, which keeps nothing).

    Example:

        >>> from torch import nn
        >>> from lightning_mgpu import EveryNth, apply_activation_checkpointing
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
        >>> apply_activation_checkpointing(net, EveryNth(2))
        ['0', '2']
    """
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"use_reentrant must be True or False, got {use_reentrant!r}.")
    validate_save(save, use_reentrant)
    chosen = select_modules(model, policy)
    for _, m in chosen:
        m.__dict__["forward"] = _CheckpointedForward(m, use_reentrant, preserve_rng_state, save)
        for sub in m.modules():
            if isinstance(sub, nn.SyncBatchNorm):
                sub.__dict__["forward"] = _SyncBNForward(sub)
    return [name for name, _ in chosen]


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` whose forward is checkpointed.

    Example:

        >>> from torch import nn
        >>> from lightning_mgpu import EveryNth, apply_activation_checkpointing, checkpointed_modules
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
        >>> _ = apply_activation_checkpointing(net, EveryNth(2))
        >>> checkpointed_modules(net)
        ['0', '2']
    """
    return [n for n, m in model.named_modules() if isinstance(m.__dict__.get("forward"), _CheckpointedForward)]


def remove_activation_checkpointing(model: nn.Module) -> int:
    """Undo :func:`apply_activation_checkpointing` on ``model``; returns how many modules were restored.

    Example:

        >>> from torch import nn
        >>> from lightning_mgpu import apply_activation_checkpointing, checkpointed_modules
        >>> from lightning_mgpu import remove_activation_checkpointing
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        >>> apply_activation_checkpointing(net, {nn.Linear})
        ['0', '2']
        >>> remove_activation_checkpointing(net), checkpointed_modules(net)
        (2, [])
    """
    restored = 0
    for m in model.modules():
        patched = m.__dict__.get("forward")
        if isinstance(patched, (_CheckpointedForward, _SyncBNForward)):
            del m.__dict__["forward"]
            restored += isinstance(patched, _CheckpointedForward)
    return restored


# ----------------------------------------------------------------------------------------------------
# Activation checkpointing as a part: checked against the model before launch, applied before the model is
# wrapped (DDP) or sharded (FSDP: its hooks stay outside the recompute), removed at teardown.


class ActivationCheckpointing:
    """Example::

    part = ActivationCheckpointing("Block", reentrant=False)
    part.check(module)   # before launch: a policy that matches nothing raises
    part.apply(module)   # before DDP / fully_shard
    part.remove(module)  # teardown: the user's module back unchanged
    """

    def __init__(
        self, policy: Optional[ActivationCheckpointingPolicy], reentrant: bool = False, save: CheckpointSave = None
    ) -> None:
        self.policy = policy
        self.reentrant = reentrant
        self.save = save

    def check(self, module: nn.Module) -> None:
        if self.policy is not None:
            select_modules(module, self.policy)

    def apply(self, module: Optional[nn.Module]) -> None:
        # Order (torchtitan's parallelize): SyncBatchNorm conversion (Lightning's layer sync, done before the
        # wrapping) -> activation checkpointing -> DDP / sharding. Checkpointing patches the blocks' forward in
        # place, so DDP/FSDP see the same module tree and state-dict keys as without it.
        if self.policy is not None and module is not None:
            apply_activation_checkpointing(module, self.policy, use_reentrant=self.reentrant, save=self.save)

    def remove(self, module: Optional[nn.Module]) -> None:
        if self.policy is not None and module is not None:
            remove_activation_checkpointing(module)
