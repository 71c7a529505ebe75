"""Named DDP communication hooks, and the pack's own gradient all-reduce for manual optimization.

The hooks themselves are torch's (``torch.distributed.algorithms.ddp_comm_hooks``); this module gives them
names usable from a string or a YAML file (``comm_hook=`` of the mgpu strategies, :data:`COMM_HOOKS`), checks that
the process-group backend can run them before any process starts, and wraps each one so that every all-reduce it
hands to the collective is counted in the ledger (:class:`~lightning_mgpu.CommStats`). DDP issues their collectives
inside its ``GradBucket`` machinery; :func:`allreduce_gradients`, for manual optimization, issues its own through
:mod:`lightning_mgpu.comm`.

Example::

    from lightning_mgpu import MGPUDDPStrategy

    strategy = MGPUDDPStrategy(comm_hook="powersgd", comm_state={"matrix_approximation_rank": 2})
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy)
    trainer.fit(model)
    print(strategy.comm_stats)  # all-reduce calls, bytes, optimizer steps, ring lower bound
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from lightning_mgpu._compat import patch_batched_powersgd
from lightning_mgpu.comm import all_reduce
from lightning_mgpu.ledger import CommStats

HookFn = Callable[[Any, dist.GradBucket], torch.futures.Future]


# ---------------------------------------------------------------------------------------------------------
# Hook table: one row per name: torch's hook, a description, the backends that cannot run it (with the
# alternative to suggest), and the keyword arguments its state accepts (``comm_state``).
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _HookSpec:
    hook: HookFn
    description: str
    unsupported_backends: dict[str, str] = field(default_factory=dict)
    """backend -> the alternative to suggest."""
    state_keys: tuple[str, ...] = ()


def _powersgd_state_keys() -> tuple[str, ...]:
    import inspect

    params = inspect.signature(powersgd.PowerSGDState.__init__).parameters
    return tuple(p for p in params if p not in ("self", "process_group"))


#: The named gradient-communication hooks (``comm_hook=`` of the mgpu strategies): name -> torch's hook, its
#: state, and the backends that can run it. ``"fp16"`` / ``"bf16"`` halve the bytes, ``"powersgd"`` /
#: ``"batched_powersgd"`` send a low-rank approximation. Example: ``sorted(lightning_mgpu.COMM_HOOKS)``.
COMM_HOOKS: dict[str, _HookSpec] = {
    "fp16": _HookSpec(
        default_hooks.fp16_compress_hook,
        "gradients cast to float16 for the all-reduce (half the bytes), averaged, cast back",
    ),
    "bf16": _HookSpec(
        default_hooks.bf16_compress_hook,
        "gradients cast to bfloat16 for the all-reduce (half the bytes), averaged, cast back",
        unsupported_backends={"gloo": "comm_hook='fp16'"},
    ),
    "powersgd": _HookSpec(
        powersgd.powerSGD_hook,
        "PowerSGD low-rank compression per layer, with error feedback (torch's powerSGD_hook)",
        state_keys=_powersgd_state_keys(),
    ),
    "batched_powersgd": _HookSpec(
        powersgd.batched_powerSGD_hook,
        "PowerSGD on each whole flattened bucket (fewer, larger all-reduces; torch's batched_powerSGD_hook)",
        state_keys=_powersgd_state_keys(),
    ),
}

_POWERSGD_DEFAULTS: dict[str, Any] = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
"""Compression from the second synchronisation on, unless ``comm_state`` says otherwise. torch's own
default (1000 iterations of plain all-reduce first) would leave a short job uncompressed, with no saving
in the ledger; pass ``comm_state={"start_powerSGD_iter": 1000}`` to get it back."""


def check_comm_hook(name: Optional[str], state: Optional[dict[str, Any]]) -> None:
    """Validate a hook name and its state dict; raises ``ValueError`` naming the bad value and the fix."""
    if name is None:
        if state:
            raise ValueError(
                f"comm_state={state!r} was given without a comm_hook. Pass comm_hook='powersgd' (or another of "
                f"{sorted(COMM_HOOKS)}) or drop comm_state."
            )
        return
    if not isinstance(name, str) or name not in COMM_HOOKS:
        raise ValueError(f"Unknown comm_hook={name!r}. Choose one of {sorted(COMM_HOOKS)} or None (plain all-reduce).")
    spec = COMM_HOOKS[name]
    if state is None:
        return
    if not isinstance(state, dict):
        raise TypeError(f"comm_state must be a dict of keyword arguments, got {type(state).__name__}: {state!r}.")
    unknown = sorted(set(state) - set(spec.state_keys))
    if unknown:
        allowed = ", ".join(spec.state_keys) or "none (this hook takes no state)"
        raise ValueError(f"comm_state keys {unknown} are not accepted by comm_hook={name!r}; accepted: {allowed}.")
    rank = state.get("matrix_approximation_rank")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 1):
        raise ValueError(
            f"comm_state['matrix_approximation_rank']={rank!r} must be a positive int "
            f"(1 is the usual choice; 2-4 trade bandwidth for accuracy)."
        )
    start = state.get("start_powerSGD_iter")
    if start is not None and (not isinstance(start, int) or isinstance(start, bool) or start < 1):
        raise ValueError(f"comm_state['start_powerSGD_iter']={start!r} must be an int >= 1.")
    if start is not None and start <= 1 and state.get("use_error_feedback", True):
        raise ValueError(
            f"comm_state['start_powerSGD_iter']={start!r} needs to be >= 2 while error feedback or warm start "
            f"is on (torch's rule): use start_powerSGD_iter=2."
        )


def check_backend(name: Optional[str], backend: str) -> None:
    """Raise before any process starts when ``backend`` cannot run the hook."""
    if name is None:
        return
    alternative = COMM_HOOKS[name].unsupported_backends.get(backend)
    if alternative is not None:
        raise ValueError(
            f"comm_hook={name!r} cannot run on the {backend!r} process-group backend (torch's hook raises "
            f"there). Use {alternative} on {backend}, or run on CUDA devices with the 'nccl' backend."
        )


@dataclass
class _LedgerState:
    """What our wrapper hook carries: the inner hook, its state, and the ledger to write into."""

    hook: HookFn
    inner: Any
    ledger: CommStats
    serialize: bool = False
    """Finish one bucket's hook chain before the next bucket's starts (see ``register_comm_hook``)."""
    pending: Optional[torch.futures.Future] = None


def _counting_hook(state: _LedgerState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Call the named hook and count what it handed to ``all_reduce`` for this bucket."""
    buffer = bucket.buffer()
    inner = state.inner
    esize = buffer.element_size()
    if isinstance(inner, powersgd.PowerSGDState):
        if state.serialize and state.pending is not None:
            state.pending.wait()
        vanilla = inner.iter < inner.start_powerSGD_iter
        before = inner.total_numel_after_compression
        fut = state.hook(inner, bucket)
        state.pending = None if bucket.is_last() else fut
        if vanilla:
            state.ledger.record(1, buffer.numel() * esize)
        else:
            # torch adds exactly the elements it all-reduces (uncompressed tensors + P + Q) to this counter
            calls = 3 if state.hook is powersgd.powerSGD_hook else 2
            state.ledger.record(calls, (inner.total_numel_after_compression - before) * esize)
    else:
        fut = state.hook(inner, bucket)
        if state.hook is default_hooks.fp16_compress_hook or state.hook is default_hooks.bf16_compress_hook:
            esize = 2
        state.ledger.record(1, buffer.numel() * esize)
    if bucket.is_last():
        state.ledger.sync_rounds += 1
    return fut


def register_comm_hook(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    name: Optional[str],
    state: Optional[dict[str, Any]],
    ledger: CommStats,
) -> Any:
    """Register the named hook (or plain averaging all-reduce) on ``ddp_model`` on any device type.

    Returns the inner hook state (a ``PowerSGDState`` for PowerSGD) so callers can checkpoint it.
    """
    process_group = ddp_model.process_group
    inner: Any
    if name is None:
        hook: HookFn = default_hooks.allreduce_hook
        inner = process_group
    elif name in ("powersgd", "batched_powersgd"):
        if name == "batched_powersgd":
            patch_batched_powersgd()
        hook = COMM_HOOKS[name].hook
        kwargs = {**_POWERSGD_DEFAULTS, **(state or {})}
        inner = powersgd.PowerSGDState(process_group=process_group, **kwargs)
    else:
        hook = COMM_HOOKS[name].hook
        inner = process_group
    # PowerSGD issues its P and Q all-reduces from future callbacks, on gloo's threads: with several buckets,
    # one bucket's P/Q and the next bucket's first all-reduce reach the process group in a different order
    # on different ranks, and gloo (which pairs collectives by order) fails with "Received data size doesn't
    # match expected size" (reproduced: 5M-parameter MLP, 2 buckets, torch 2.13). On gloo each bucket's
    # chain is finished before the next bucket starts; NCCL is left to overlap.
    serialize = name in ("powersgd", "batched_powersgd") and dist.get_backend(process_group) == "gloo"
    ddp_model.register_comm_hook(_LedgerState(hook, inner, ledger, serialize=serialize), _counting_hook)
    return inner


_FLOAT_COMPRESSION = {"fp16": torch.float16, "bf16": torch.bfloat16}


def allreduce_gradients(
    params: Sequence[torch.Tensor],
    *,
    group: Optional[dist.ProcessGroup] = None,
    compress: Optional[str] = None,
    ledger: Optional[CommStats] = None,
    bucket_cap_mb: float = 25.0,
) -> None:
    """Average ``params``' gradients over the ranks of ``group``, in flat buckets of at most
    ``bucket_cap_mb`` (one ``all_reduce`` per bucket, all in flight together).

    Used for manual optimization, where each optimizer's gradients are synchronised once, when it steps.
    ``compress`` is ``None``, ``"fp16"`` or ``"bf16"`` (cast for the collective, as torch's compress hooks
    do). A parameter with no gradient on this rank contributes zeros; one with no gradient on any rank keeps
    ``grad=None``, as in a single process (one extra element per parameter carries that flag).

    Example (one process here; with N ranks each gradient becomes the mean over them):

        >>> import tempfile, torch, torch.distributed as dist
        >>> from lightning_mgpu import CommStats, allreduce_gradients
        >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
        >>> net = torch.nn.Linear(4, 2)
        >>> net(torch.ones(3, 4)).sum().backward()
        >>> allreduce_gradients(list(net.parameters()), ledger=CommStats())  # then optimizer.step()
        >>> net.bias.grad
        tensor([3., 3.])
        >>> dist.destroy_process_group()
    """
    world = dist.get_world_size(group)
    if world == 1 or not params:
        return
    comm_dtype_override = _FLOAT_COMPRESSION.get(compress) if compress else None
    cap = int(bucket_cap_mb * 2**20)
    buckets: list[list[torch.Tensor]] = []
    key: Any = None
    size = 0
    for p in params:
        k = (p.device, p.dtype)
        nbytes = p.numel() * p.element_size()
        if not buckets or k != key or (size + nbytes > cap and buckets[-1]):
            buckets.append([])
            key, size = k, 0
        buckets[-1].append(p)
        size += nbytes
    pending = []
    for bucket in buckets:
        dtype = comm_dtype_override or bucket[0].dtype
        device = bucket[0].device
        pieces = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype) for p in bucket]
        pieces.append(torch.tensor([float(p.grad is not None) for p in bucket], dtype=dtype, device=device))
        flat = torch.cat(pieces)
        flat.div_(world)  # before the sum, as torch's hooks do: keeps fp16 in range
        work = all_reduce(flat, group=group, ledger=ledger, async_op=True)
        pending.append((bucket, flat, work))
    for bucket, flat, work in pending:
        work.wait()
        flags = flat[-len(bucket) :]
        offset = 0
        for i, p in enumerate(bucket):
            n = p.numel()
            if flags[i] > 0:
                avg = flat[offset : offset + n].view_as(p)
                if p.grad is None:
                    p.grad = avg.to(p.dtype).clone()
                else:
                    p.grad.copy_(avg)
            offset += n
    if ledger is not None:
        ledger.sync_rounds += 1
        ledger.synced_gradient_bytes += sum(p.numel() * p.element_size() for p in params)
