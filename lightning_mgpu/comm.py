"""The pack's communication: every collective it issues, named DDP communication hooks, and the ledger.

Every ``torch.distributed`` collective of the package goes through the functions of this module
(:func:`all_reduce`, :func:`broadcast`, :func:`reduce`, :func:`all_gather`, the object collectives,
:func:`barrier`, :func:`new_group`, and Lightning's reduce and module-state broadcast); ``tests/unit/test_comm.py``
fails when another module calls one directly. Each puts its buffer on the device the group's backend needs
(:func:`collective_device`: CUDA under NCCL, CPU under gloo, and for a mixed group such as ``"cpu:gloo,cuda:nccl"``
the tensor's own device when that part of the group takes it), copies the result back to the caller's tensor, and
counts the call and its bytes in a :class:`CommStats` when given one. Two kinds of collectives are torch's, not
ours, and do not pass here: those DDP issues for its buckets (the comm hooks below run inside its ``GradBucket``
machinery) and those of FSDP2 and ``torch.distributed.checkpoint``.

The hooks themselves are torch's (``torch.distributed.algorithms.ddp_comm_hooks``); this module gives them
names usable from a string or a YAML file, checks that the process-group backend can run them, and wraps
each one so that every all-reduce it hands to the collective is counted in a :class:`CommStats`.

Example::

    from lightning_mgpu import MGPUDDPStrategy

    strategy = MGPUDDPStrategy(comm_hook="powersgd", comm_state={"matrix_approximation_rank": 2})
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy)
    trainer.fit(model)
    print(strategy.comm_stats)  # all-reduce calls, bytes, optimizer steps, ring lower bound
"""

import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from lightning_mgpu._compat import (
    collective_dispatch_mode,
    dcp_fsspec_storage,
    patch_batched_powersgd,
    sync_ddp_if_available,
    sync_module_states,
)

HookFn = Callable[[Any, dist.GradBucket], torch.futures.Future]


@dataclass
class CommStats:
    """What the gradient synchronisation of one rank handed to the collective, counted by the hook path.

    All counts are cumulative since the strategy was set up. They are the same on every rank for the
    symmetric hooks shipped here, so rank 0's figures describe the job. Every mgpu strategy keeps one as
    ``trainer.strategy.comm_stats`` and logs :meth:`as_metrics` as ``comm/*``.

    Example:

        >>> from lightning_mgpu import CommStats
        >>> # 4 optimizer steps of a 1 MB gradient on 2 ranks, one all-reduce of fp16 (half the bytes) each
        >>> stats = CommStats(allreduce_calls=4, allreduce_bytes=4 * 500_000, sync_rounds=4, optimizer_steps=4,
        ...                   gradient_bytes=1_000_000, world_size=2)
        >>> stats.calls_per_step, stats.bytes_per_step, stats.ratio_to_lower_bound
        (1.0, 500000.0, 0.5)
    """

    allreduce_calls: int = 0
    """``all_reduce`` calls issued by the comm hook (one per bucket without compression; PowerSGD issues
    3 per bucket, batched PowerSGD 2, once compression has started)."""
    allreduce_bytes: int = 0
    """Payload bytes handed to those calls (after compression)."""
    sync_rounds: int = 0
    """Backward passes whose gradients were synchronised (one per optimizer step when accumulation works)."""
    optimizer_steps: int = 0
    """Optimizer steps taken."""
    gradient_bytes: int = 0
    """Bytes of the uncompressed gradients of one synchronisation (all parameters that require grad)."""
    world_size: int = 1
    """Number of ranks in the gradient all-reduce."""
    synced_gradient_bytes: int = 0
    """Manual optimization only: cumulative uncompressed bytes of the gradients each optimizer step needed
    synchronised (that optimizer's parameters). 0 means every step needs all of ``gradient_bytes``."""
    round_bytes: int = 0
    """The part of ``allreduce_bytes`` handed to the gradient collectives of synchronised backwards (the rest:
    the pack's own collectives such as norm clipping's scalar all-reduce)."""
    stage_sends: int = 0
    """Pipeline parallelism: point-to-point sends between stages issued by this rank (an activation forward, or its
    gradient backward, per micro-batch and stage boundary)."""
    stage_bytes: int = 0
    """Their payload bytes, from the shapes of the tensors sent."""
    tensor_calls: int = 0
    """Tensor parallelism, counted where the strategy is asked to (``tensor_comm_stats=True``): collectives that
    the split layers (``DTensor``) issued over this rank's tensor-parallel group during training steps (forward,
    activation checkpointing's recomputation, backward, optimizer step), measured as they are dispatched."""
    tensor_bytes: int = 0
    """Their payload bytes: the bytes of the tensors handed to them, the convention of ``allreduce_bytes``."""
    tensor_sent_bytes: float = 0.0
    """The bytes this rank sends for them in ring collectives over the ``T`` ranks of the group, each from its own
    kind and payload ``S``: an all-reduce ``2 (T-1)/T S``, an all-gather ``(T-1) S``, a reduce-scatter, an
    all-to-all or a broadcast ``(T-1)/T S`` (the convention of ``ring_bytes_per_step`` and of the layout
    planner's ``tensor_bytes``)."""
    replicas: int = 1
    """Hybrid sharding (HSDP): the number of replicas of each shard (the mesh's replicate dimension); 1 otherwise.
    Then each synchronised backward reduce-scatters the gradients (``allreduce_bytes``) within a shard group of
    ``world_size / replicas`` ranks, and all-reduces the resulting shards (1/shard of those bytes) across the
    replicas; :meth:`per_group` splits the traffic, each against its lower bound."""

    @property
    def shard_size(self) -> int:
        """Ranks per shard group (the world size unless sharding is hybrid)."""
        return max(self.world_size // max(self.replicas, 1), 1)

    def per_group(self) -> dict[str, float]:
        """Bytes each rank sends per optimizer step within its shard group and across replicas (ring
        collectives), and each one's lower bound. A reduce-scatter of ``G`` gradient bytes over ``s`` ranks sends
        ``(s - 1) / s x G`` per rank; an all-reduce of the ``G / s`` shard bytes over ``r`` replicas sends
        ``2 (r - 1) / r x G / s``. The bounds take ``G`` as the model's gradient bytes (one sync per step). The
        pack's own all-reduces (norm clipping's scalar) run within the shard group and count there.

        Example:

            >>> stats = CommStats(allreduce_calls=4, allreduce_bytes=4 * 1000, round_bytes=4 * 1000, sync_rounds=4,
            ...                   optimizer_steps=4, gradient_bytes=1000, world_size=4, replicas=2)
            >>> stats.per_group()["replica_bytes_per_step"], stats.per_group()["shard_ratio_to_lower_bound"]
            (500.0, 1.0)
        """
        s, r = self.shard_size, max(self.replicas, 1)
        steps = max(self.optimizer_steps, 1)
        payload, other = self.round_bytes / steps, (self.allreduce_bytes - self.round_bytes) / steps
        needed = float(self.gradient_bytes)
        shard_sent = (s - 1) / s * payload + 2 * (s - 1) / s * other
        shard_bound = (s - 1) / s * needed
        replica_sent = 2 * (r - 1) / r * payload / s
        replica_bound = 2 * (r - 1) / r * needed / s
        return {
            "shard_bytes_per_step": shard_sent,
            "shard_lower_bound_bytes": shard_bound,
            "shard_ratio_to_lower_bound": shard_sent / shard_bound if shard_bound else 0.0,
            "replica_bytes_per_step": replica_sent,
            "replica_lower_bound_bytes": replica_bound,
            "replica_ratio_to_lower_bound": replica_sent / replica_bound if replica_bound else 0.0,
        }

    @property
    def calls_per_step(self) -> float:
        return self.allreduce_calls / self.optimizer_steps if self.optimizer_steps else 0.0

    @property
    def bytes_per_step(self) -> float:
        return self.allreduce_bytes / self.optimizer_steps if self.optimizer_steps else 0.0

    @property
    def ring_lower_bound_bytes(self) -> float:
        """Bytes each rank must send per step in a ring all-reduce of the uncompressed gradients,
        ``2 (N - 1) / N x gradient bytes``: the bandwidth floor of plain data-parallel training. With manual
        optimization the gradient bytes are those of the optimizer that steps (averaged over steps)."""
        n = self.world_size
        needed: float = self.gradient_bytes
        if self.synced_gradient_bytes and self.optimizer_steps:
            needed = self.synced_gradient_bytes / self.optimizer_steps
        return 2 * (n - 1) / n * needed if n > 1 else 0.0

    @property
    def ring_bytes_per_step(self) -> float:
        """Bytes each rank sends per step if the collective is a ring: ``2 (N - 1) / N x payload``."""
        n = self.world_size
        return 2 * (n - 1) / n * self.bytes_per_step if n > 1 else 0.0

    @property
    def ratio_to_lower_bound(self) -> float:
        """``ring_bytes_per_step / ring_lower_bound_bytes``: 1.0 for one uncompressed all-reduce per step,
        about 0.5 with fp16 compression, k with a sync on every one of k micro-batches."""
        bound = self.ring_lower_bound_bytes
        return self.ring_bytes_per_step / bound if bound else 0.0

    def record(self, calls: int, nbytes: int) -> None:
        self.allreduce_calls += calls
        self.allreduce_bytes += nbytes

    def record_stage_sends(self, sends: int, nbytes: int) -> None:
        """One pipeline step's sends between stages (``torch.distributed.pipelining`` issues them)."""
        self.stage_sends += sends
        self.stage_bytes += nbytes

    @property
    def stage_bytes_per_step(self) -> float:
        """Bytes this rank sends to other pipeline stages per optimizer step."""
        return self.stage_bytes / self.optimizer_steps if self.optimizer_steps else 0.0

    def record_tensor(self, calls: int, nbytes: int, sent: float) -> None:
        """Collectives of the tensor-parallel group: their payload and the bytes this rank sends for them."""
        self.tensor_calls += calls
        self.tensor_bytes += nbytes
        self.tensor_sent_bytes += sent

    @property
    def tensor_bytes_per_step(self) -> float:
        """Payload bytes of the tensor-parallel collectives per optimizer step."""
        return self.tensor_bytes / self.optimizer_steps if self.optimizer_steps else 0.0

    @property
    def tensor_sent_bytes_per_step(self) -> float:
        """Bytes this rank sends for the tensor-parallel collectives per optimizer step (ring collectives): what
        the layout planner's ``tensor_bytes`` predicts."""
        return self.tensor_sent_bytes / self.optimizer_steps if self.optimizer_steps else 0.0

    def record_round(self, bucket_bytes: list[int]) -> None:
        """One synchronised backward of DDP's built-in all-reduce: one call per bucket."""
        self.record(len(bucket_bytes), sum(bucket_bytes))
        self.round_bytes += sum(bucket_bytes)
        self.sync_rounds += 1

    def as_metrics(self, prefix: str = "comm/") -> dict[str, float]:
        """Flat metrics for a Lightning logger."""
        return {
            f"{prefix}allreduce_calls": float(self.allreduce_calls),
            f"{prefix}allreduce_bytes": float(self.allreduce_bytes),
            f"{prefix}sync_rounds": float(self.sync_rounds),
            f"{prefix}optimizer_steps": float(self.optimizer_steps),
            f"{prefix}calls_per_step": self.calls_per_step,
            f"{prefix}bytes_per_step": self.bytes_per_step,
            f"{prefix}ring_bytes_per_step": self.ring_bytes_per_step,
            f"{prefix}ring_lower_bound_bytes": self.ring_lower_bound_bytes,
            f"{prefix}ratio_to_lower_bound": self.ratio_to_lower_bound,
            **({f"{prefix}{k}": v for k, v in self.per_group().items()} if self.replicas > 1 else {}),
            **({f"{prefix}stage_bytes_per_step": self.stage_bytes_per_step} if self.stage_sends else {}),
            **(
                {
                    f"{prefix}tensor_calls_per_step": self.tensor_calls / max(self.optimizer_steps, 1),
                    f"{prefix}tensor_bytes_per_step": self.tensor_bytes_per_step,
                    f"{prefix}tensor_sent_bytes_per_step": self.tensor_sent_bytes_per_step,
                }
                if self.tensor_calls
                else {}
            ),
        }

    def summary(self) -> str:
        """One human-readable paragraph, for the end of a job. Under pipeline parallelism the bytes sent between
        stages replace the ring all-reduce's lower bound, which is that of every rank all-reducing the whole
        model (each rank syncs its own stage's gradients and the weights outside the blocks).

        Example:

            >>> CommStats(allreduce_calls=2, allreduce_bytes=80, sync_rounds=2, optimizer_steps=2, gradient_bytes=400,
            ...           world_size=2, stage_sends=16, stage_bytes=512).summary().split("; ")[-1]
            'pipeline: 8.00 sends/step between stages, 256 B/step (this rank sends)'
        """
        return (
            f"all-reduce calls {self.allreduce_calls} ({self.calls_per_step:.2f}/step), "
            f"bytes {self.allreduce_bytes} ({self.bytes_per_step:.0f}/step), "
            f"sync rounds {self.sync_rounds}, optimizer steps {self.optimizer_steps}; "
            + (self._pipeline_summary() if self.stage_sends else self._ring_summary())
            + self._hybrid_summary()
            + self._tensor_summary()
        )

    def _ring_summary(self) -> str:
        return (
            f"ring traffic/step {self.ring_bytes_per_step:.0f} B vs lower bound "
            f"2(N-1)/N x {self.gradient_bytes} B = {self.ring_lower_bound_bytes:.0f} B "
            f"(ratio {self.ratio_to_lower_bound:.2f}, N={self.world_size})"
        )

    def _pipeline_summary(self) -> str:
        steps = max(self.optimizer_steps, 1)
        return (
            f"pipeline: {self.stage_sends / steps:.2f} sends/step between stages, "
            f"{self.stage_bytes_per_step:.0f} B/step (this rank sends)"
        )

    def _tensor_summary(self) -> str:
        if not self.tensor_calls:
            return ""
        steps = max(self.optimizer_steps, 1)
        return (
            f"; tensor parallelism: {self.tensor_calls} collectives ({self.tensor_calls / steps:.2f}/step), "
            f"payload {self.tensor_bytes_per_step:.0f} B/step, sent {self.tensor_sent_bytes_per_step:.0f} B/step"
        )

    def _hybrid_summary(self) -> str:
        if self.replicas <= 1:
            return ""
        g = self.per_group()
        return (
            f"; hybrid {self.replicas} replicas x {self.shard_size} shards: within the shard group "
            f"{g['shard_bytes_per_step']:.0f} B/step (lower bound {g['shard_lower_bound_bytes']:.0f} B, ratio "
            f"{g['shard_ratio_to_lower_bound']:.2f}), across replicas {g['replica_bytes_per_step']:.0f} B/step "
            f"(lower bound {g['replica_lower_bound_bytes']:.0f} B, ratio {g['replica_ratio_to_lower_bound']:.2f})"
        )


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


def buckets_from_grad_views(params: Iterable[torch.Tensor]) -> list[int]:
    """Bytes of each DDP bucket, read off the gradients when they are bucket views
    (``gradient_as_bucket_view=True``): every ``param.grad`` lives in its bucket's storage, so the distinct
    storages *are* the buckets DDP all-reduced. Parameters without a gradient are skipped."""
    storages: dict[int, int] = {}
    for p in params:
        if p.grad is not None:
            storage = p.grad.untyped_storage()
            storages.setdefault(storage.data_ptr(), storage.nbytes())
    return list(storages.values())


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


# ----------------------------------------------------------------------------------------------------
# The one home of the pack's collectives: the device each buffer must be on, and the calls themselves.

#: Device types each single backend takes buffers on, in order of preference. gloo runs some collectives on
#: CUDA tensors too, but not all: the pack gives it CPU buffers. A backend not named here: torch's table.
_BACKEND_DEVICES: dict[str, tuple[str, ...]] = {"nccl": ("cuda",), "gloo": ("cpu",), "xccl": ("xpu",)}


def backend_devices(group: Optional[Any] = None) -> dict[str, str]:
    """Device type -> backend of ``group`` (the default group for ``None``): ``{"cuda": "nccl"}`` for NCCL,
    ``{"cpu": "gloo"}`` for gloo, ``{"cpu": "gloo", "cuda": "nccl"}`` for ``"cpu:gloo,cuda:nccl"``."""
    name = str(dist.get_backend(group)).lower()
    if ":" in name:  # a mixed group: "device:backend" pairs
        pairs = (part.split(":", 1) for part in name.split(",") if part.strip())
        return {device.strip(): backend.strip() for device, backend in pairs}
    devices = _BACKEND_DEVICES.get(name) or tuple(dist.Backend.backend_capability.get(name, ["cpu"]))
    return {device: name for device in devices}


def _current(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type, None)
    current = getattr(module, "current_device", None)
    return torch.device(device_type, current()) if callable(current) else torch.device(device_type)


def collective_device(group: Optional[Any] = None, tensor: Optional[torch.Tensor] = None) -> torch.device:
    """The device a collective's buffer must be on for ``group``'s backend.

    NCCL: the current CUDA device; gloo: the CPU. A group with several backends (``"cpu:gloo,cuda:nccl"``)
    keeps ``tensor`` where it is when its device type has a backend in the group, and otherwise prefers CUDA
    when the group has a CUDA part and CUDA is available, else the CPU. Without a process group: ``tensor``'s
    device, or the CPU.

    Example::

        flags = torch.zeros(2, dtype=torch.int64, device=collective_device(group))
    """
    if not group_is_up():
        return tensor.device if tensor is not None else torch.device("cpu")
    devices = backend_devices(group)
    if tensor is not None and tensor.device.type in devices:
        return tensor.device
    if "cuda" in devices and (len(devices) == 1 or torch.cuda.is_available()):
        return _current("cuda")
    if "cpu" in devices:
        return torch.device("cpu")
    return _current(next(iter(devices)))


def _staged(tensor: torch.Tensor, group: Optional[Any]) -> torch.Tensor:
    """``tensor`` itself when it is on the collective device (and contiguous), else a copy there."""
    device = collective_device(group, tensor)
    if tensor.device == device and tensor.is_contiguous():
        return tensor
    return tensor.to(device=device, memory_format=torch.contiguous_format, copy=True)


class _StagedWork:
    """An asynchronous collective on a staged copy: ``wait()`` also copies the result back."""

    def __init__(self, work: Any, tensor: torch.Tensor, buffer: torch.Tensor) -> None:
        self.work, self.tensor, self.buffer = work, tensor, buffer

    def wait(self) -> bool:
        done = self.work.wait()
        self.tensor.copy_(self.buffer)
        return bool(done) if done is not None else True

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


def _record(ledger: Optional[CommStats], tensor: torch.Tensor) -> None:
    if ledger is not None:
        ledger.record(1, tensor.numel() * tensor.element_size())


def all_reduce(
    tensor: torch.Tensor,
    op: Any = None,
    group: Optional[Any] = None,
    *,
    ledger: Optional[CommStats] = None,
    async_op: bool = False,
) -> Any:
    """``torch.distributed.all_reduce`` of ``tensor`` in place (``op``: ``ReduceOp.SUM`` unless given), on the
    collective device of ``group``; counts one call and the tensor's bytes in ``ledger``. With ``async_op``
    returns a handle whose ``wait()`` leaves the result in ``tensor``; else ``None``."""
    op = dist.ReduceOp.SUM if op is None else op
    buffer = _staged(tensor, group)
    work = dist.all_reduce(buffer, op=op, group=group, async_op=async_op)
    _record(ledger, buffer)
    if buffer is tensor:
        return work
    if async_op:
        return _StagedWork(work, tensor, buffer)
    tensor.copy_(buffer)
    return None


def reduce(
    tensor: torch.Tensor, dst: int, op: Any = None, group: Optional[Any] = None, *, ledger: Optional[CommStats] = None
) -> None:
    """``torch.distributed.reduce`` into ``tensor`` on global rank ``dst`` (the others' ``tensor`` is left as the
    backend leaves it), on the collective device."""
    op = dist.ReduceOp.SUM if op is None else op
    buffer = _staged(tensor, group)
    dist.reduce(buffer, dst=dst, op=op, group=group)
    _record(ledger, buffer)
    if buffer is not tensor:
        tensor.copy_(buffer)


def broadcast(
    tensor: torch.Tensor, src: int, group: Optional[Any] = None, *, ledger: Optional[CommStats] = None
) -> None:
    """``torch.distributed.broadcast`` of global rank ``src``'s ``tensor`` into every rank's, in place, on the
    collective device."""
    buffer = _staged(tensor, group)
    dist.broadcast(buffer, src=src, group=group)
    _record(ledger, buffer)
    if buffer is not tensor:
        tensor.copy_(buffer)


def all_gather(
    tensor: torch.Tensor, group: Optional[Any] = None, *, ledger: Optional[CommStats] = None
) -> torch.Tensor:
    """``(world, *tensor.shape)``: every rank's ``tensor`` (same shape on each), in rank order, in one
    ``torch.distributed.all_gather`` on the collective device; returned on ``tensor``'s device."""
    buffer = _staged(tensor, group)
    out = [torch.empty_like(buffer) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, buffer, group=group)
    _record(ledger, buffer)
    return torch.stack(out).to(tensor.device)


def all_gather_object(obj: Any, group: Optional[Any] = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (torch stages the pickles on the group's device)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def gather_object(obj: Any, dst: int = 0, group: Optional[Any] = None) -> Optional[list[Any]]:
    """Every rank's picklable ``obj`` on global rank ``dst``, in rank order; ``None`` on the other ranks."""
    gathered: Optional[list[Any]] = None
    if dist.get_rank() == dst:
        gathered = [None] * dist.get_world_size(group)
    dist.gather_object(obj, gathered, dst=dst, group=group)
    return gathered


def broadcast_object(obj: Any, src: int = 0, group: Optional[Any] = None) -> Any:
    """Global rank ``src``'s picklable ``obj``, on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(group: Optional[Any] = None, device: Optional[torch.device] = None) -> None:
    """``torch.distributed.barrier``; under NCCL on ``device`` (the current CUDA device unless given), so that
    torch does not have to guess which GPU this rank uses."""
    if str(dist.get_backend(group)).lower() == "nccl":
        index = device.index if device is not None and device.index is not None else _current("cuda").index
        dist.barrier(group=group, device_ids=[index])
    else:
        dist.barrier(group=group)


def _fsspec_storage(path: str, reader: bool) -> Any:
    """torch.distributed.checkpoint's fsspec reader or writer for a URL (``s3://...``), ``None`` for a local path
    (its default file system storage)."""
    from fsspec.core import url_to_fs
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(url_to_fs(path)[0], LocalFileSystem):
        return None
    return dcp_fsspec_storage(path, reader)


def save_sharded(state: dict[str, Any], path: str, group: Optional[Any] = None) -> None:
    """``torch.distributed.checkpoint.save`` of ``state`` into the directory ``path`` (local, or an fsspec URL):
    a collective over ``group`` (every rank writes its shards; the ranks agree on one save plan first). ``state``
    as :func:`dcp_layout` gives it."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path, storage_writer=_fsspec_storage(path, reader=False), process_group=group)


def _scattered_dims(tensor: Any) -> list[int]:
    """The mesh dimensions over which ``tensor`` (a ``DTensor``) holds pieces that are no contiguous block of the
    whole: a strided shard that no later mesh dimension shards again (a packed query/key/value projection's
    ``_StridedShard(1, split_factor=3)``; FSDP2's strided shard under a tensor-parallel ``Shard(0)`` is contiguous).
    ``torch.distributed.checkpoint`` writes a shard as one block, so these dimensions are saved replicated."""
    from lightning_mgpu._compat import is_strided_shard

    placements = getattr(tensor, "placements", None)
    if placements is None:
        return []
    return [
        i
        for i, p in enumerate(placements)
        if is_strided_shard(p) and not any(q.is_shard(p.dim) for q in placements[i + 1 :])
    ]


def _map_tensors(state: Any, fn: Any) -> Any:
    if isinstance(state, dict):
        return {k: _map_tensors(v, fn) for k, v in state.items()}
    if isinstance(state, list):
        return [_map_tensors(v, fn) for v in state]
    return fn(state) if isinstance(state, torch.Tensor) else state


def _any_scattered(state: Any) -> bool:
    if isinstance(state, dict):
        return any(_any_scattered(v) for v in state.values())
    if isinstance(state, list):
        return any(_any_scattered(v) for v in state)
    return bool(_scattered_dims(state))


def _blockwise(tensor: Any) -> Any:
    from torch.distributed.tensor import Replicate

    dims = _scattered_dims(tensor)
    if not dims:
        return tensor
    placements = [Replicate() if i in dims else p for i, p in enumerate(tensor.placements)]
    return tensor.redistribute(tensor.device_mesh, placements)


def dcp_layout(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as ``torch.distributed.checkpoint`` can write it: each ``DTensor`` whose local pieces are no
    contiguous block of the whole (a packed projection split by heads) replicated over those mesh dimensions (a
    collective over them; call it on every rank, on the training thread); everything else as it is."""
    return _map_tensors(state, _blockwise)


def load_sharded(
    template: dict[str, Any],
    path: str,
    group: Optional[Any] = None,
    planner: Optional[Any] = None,
    *,
    local: bool = False,
) -> None:
    """``torch.distributed.checkpoint.load`` into ``template`` in place, from ``path`` (local, or an fsspec URL): a
    collective over ``group`` (every rank reads the slices it owns now, whatever the world size at save time);
    ``planner``: a ``LoadPlanner`` (default: torch's). ``local``: this process alone reads whole tensors, no
    collective even where a process group is up."""
    import torch.distributed.checkpoint as dcp

    reader = _fsspec_storage(path, reader=True)
    with warnings.catch_warnings():
        if local:  # torch warns that it assumes one process: here that is what was asked
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        # a tensor scattered over a mesh dimension is read replicated over it, then copied back into its layout
        blockwise = dcp_layout(template) if _any_scattered(template) else template
        dcp.load(
            blockwise, checkpoint_id=path, storage_reader=reader, process_group=group, planner=planner, no_dist=local
        )
    if blockwise is not template:
        _copy_back(template, blockwise)


def _copy_back(template: Any, loaded: Any) -> None:
    """What DCP read into ``loaded`` (:func:`dcp_layout` of ``template``) put into ``template``: each tensor read
    replicated copied into the split layout, every other entry set as DCP set it."""
    if isinstance(template, (dict, list)):
        keys = list(loaded) if isinstance(loaded, dict) else range(len(loaded))
        for k in keys:
            if isinstance(template[k], (dict, list, torch.Tensor)):
                _copy_back(template[k], loaded[k])
            else:
                template[k] = loaded[k]
    elif loaded is not template:  # a DTensor read replicated over the dimensions it is scattered on
        with torch.no_grad():
            local_shard(template).copy_(local_shard(loaded.redistribute(template.device_mesh, template.placements)))


def _is_mean(reduce_op: Any) -> bool:
    if isinstance(reduce_op, str):
        return reduce_op.lower() in ("mean", "avg")
    return reduce_op == dist.ReduceOp.AVG


def lightning_reduce(
    tensor: torch.Tensor, group: Optional[Any] = None, reduce_op: Any = "mean", *, exact_mean: bool = False
) -> torch.Tensor:
    """A strategy's ``reduce``: Lightning's all-reduce with its ``"mean"`` / ``"sum"`` / ``ReduceOp`` semantics
    (``self.log(..., sync_dist=True)`` comes here), run on the collective device; the result is returned on
    ``tensor``'s device. Without a process group: ``tensor``.

    ``exact_mean``: the mean of an integer tensor is not truncated (a new tensor; ``tensor`` is left as it is).
    Lightning divides integers in place, which truncates: the epoch value of a logged mean divides by the mean of
    the ranks' summed batch sizes, so 19 and 18 samples give 18 instead of 18.5 and the value is 37/36 of the right
    one. The mean is taken in float64 and returned in torch's default float dtype (float32) when that holds it
    exactly, as it does for batch sizes on a power-of-two number of ranks, so that a float32 value divided by it
    stays float32, as under plain Lightning; else in float64."""
    if not group_is_up():
        return tensor
    device = collective_device(group, tensor)
    if exact_mean and _is_mean(reduce_op) and not (tensor.is_floating_point() or tensor.is_complex()):
        total = tensor.to(device=device, dtype=torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        mean = total / dist.get_world_size(group)
        plain = mean.to(torch.get_default_dtype())
        return (plain if torch.equal(plain.to(torch.float64), mean) else mean).to(tensor.device)
    return sync_ddp_if_available(tensor.to(device), group, reduce_op).to(tensor.device)


def broadcast_module_states(module: nn.Module) -> None:
    """Rank 0's parameters and buffers copied into every rank's ``module`` (Lightning's helper: what DDP does at
    construction), for evaluation without a wrapper; they are broadcast where they live (the model's device)."""
    if group_is_up():
        sync_module_states(module)


def broadcast_start_weights(module: nn.Module) -> int:
    """Global rank 0's values of ``module``'s parameters and buffers copied into every rank's, one broadcast per
    device and dtype, before the model is split or sharded: what DDP does at construction, so that the ranks start
    from one model when each process built its own (a script run once per process without a common seed). Tensors
    already split (``DTensor``: the user's ``configure_model`` laid them out) and tensors on the meta device are
    left alone. Returns how many tensors were broadcast; none when no process group is up."""
    if not group_is_up():
        return 0
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.device.type != "meta" and not _is_dtensor(t)]
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    with torch.no_grad():
        for group in by_kind.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            broadcast(flat, src=0)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
    return len(tensors)


def share_random_state(group: Any) -> None:
    """The random state of ``group``'s first rank on each of its ranks: torch's CPU generator and, where it is in
    use, the current accelerator's. The ranks of a tensor-parallel group compute the same replicated activations,
    so a dropout on them must draw the same mask on each (processes that were not given a common seed start from
    different states); the other ranks keep theirs, so data-parallel replicas still draw their own masks."""
    if not group_is_up() or dist.get_world_size(group) == 1:
        return
    accelerator = torch.cuda if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    state = (torch.get_rng_state(), accelerator.get_rng_state() if accelerator is not None else None)
    cpu, device = broadcast_object(state, src=dist.get_global_rank(group, 0), group=group)
    torch.set_rng_state(cpu)
    if accelerator is not None and device is not None:
        accelerator.set_rng_state(device)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return callable(getattr(tensor, "to_local", None))


def new_group(ranks: Optional[Sequence[int]] = None, **kwargs: Any) -> Any:
    """``torch.distributed.new_group`` (a collective: every rank of the default group calls it)."""
    return dist.new_group(ranks=ranks, **kwargs)


def destroy_group(group: Any = None, *, quiet: bool = False) -> None:
    """Leave ``group`` (``None``: the default group, and with it every group) when a process group is up.
    ``quiet``: an error on the way out is swallowed (a peer may be dead or stuck; torch versions differ in what a
    broken group raises)."""
    if not group_is_up():
        return
    try:
        dist.destroy_process_group(group)
    except Exception:
        if not quiet:
            raise


# ----------------------------------------------------------------------------------------------------
# Whether this process is in a torch process group (the one check every part and strategy makes).


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: the local shard of a ``DTensor`` (FSDP2's parameters and gradients), a plain
    tensor itself.

    Example::

        norm_sq = sum(local_shard(p.grad).float().pow(2).sum() for p in params)  # this rank's share only
    """
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of ``tensor``: a ``DTensor`` shard is all-gathered over its mesh (a collective: every rank of the
    mesh calls it), a plain tensor is returned as is."""
    gather = getattr(tensor, "full_tensor", None)
    return gather() if callable(gather) else tensor


def default_group() -> Any:
    """The default process group (``torch.distributed.group.WORLD``) while one is up, else None. A process group
    started again after one ended is another object: what a strategy compares to know whether what it built over
    the group (its device mesh) still holds."""
    return dist.group.WORLD if group_is_up() else None


def group_is_up() -> bool:
    """True when ``torch.distributed`` is built in and the default process group is initialised.

    Example::

        world = dist.get_world_size() if group_is_up() else 1
    """
    return dist.is_available() and dist.is_initialized()


# ----------------------------------------------------------------------------------------------------
# The tensor dimension's collectives: issued by DTensor (torch's functional collectives), not by this module, so
# counted as they are dispatched, where a strategy is asked to (their count costs a Python call per op).


def ring_sent_bytes(kind: str, nbytes: float, ranks: int) -> float:
    """Bytes one rank sends in a ring collective of ``kind`` over ``ranks`` ranks, handed ``nbytes`` per rank:
    an all-reduce ``2 (n-1)/n S``, an all-gather ``(n-1) S`` (its output is ``n S``), a reduce-scatter, an
    all-to-all or a broadcast ``(n-1)/n S``.

    >>> ring_sent_bytes("all_reduce", 768, 2), ring_sent_bytes("all_gather", 768, 4)
    (768.0, 2304.0)
    """
    n = max(ranks, 1)
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if kind == "all_gather":
        return float((n - 1) * nbytes)
    return (n - 1) / n * nbytes


class CollectiveCounter:
    """Counts into ``stats`` (``tensor_calls``, ``tensor_bytes``, ``tensor_sent_bytes``) every functional
    collective dispatched over ``group`` while :meth:`counting` is active; collectives of other groups (the data
    dimension's, FSDP's) are left to their own counts. ``counting`` may nest: only the outermost counts, so that a
    step wrapped whole and its parts wrapped again count once.

    Example::

        counter = CollectiveCounter(stats, mesh["tensor_parallel"].get_group())
        with counter.counting():
            loss = model(batch).sum()   # a row-wise split layer all-reduces its output: counted
            loss.backward()             # a column-wise one all-reduces its input's gradient: counted
    """

    def __init__(self, stats: CommStats, group: Any) -> None:
        self.stats = stats
        self.group_name = group.group_name
        self.ranks = dist.get_world_size(group)
        self._depth = 0

    def _record(self, kind: str, inputs: Sequence[torch.Tensor], group_name: Any) -> None:
        name = getattr(group_name, "group_name", group_name)
        if name != self.group_name:
            return
        nbytes = sum(t.numel() * t.element_size() for t in inputs)
        self.stats.record_tensor(1, nbytes, ring_sent_bytes(kind, nbytes, self.ranks))

    @contextmanager
    def counting(self) -> Iterator[None]:
        """Count the group's collectives within this block (the outermost of nested blocks)."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._depth = 1
        try:
            with collective_dispatch_mode(self._record):
                yield
        finally:
            self._depth = 0


# ----------------------------------------------------------------------------------------------------
# The communication ledger hooked up to a strategy: what it counts after each synchronised backward, when
# it logs, and how the model's gradient size is read (one place for what both strategy families did).


def attached_trainer(module: Optional[nn.Module]) -> Any:
    """The Trainer ``module`` (a LightningModule) is attached to, or None (public ``module.trainer`` raises
    when there is none)."""
    if module is None:
        return None
    try:
        return module.trainer
    except (RuntimeError, AttributeError):
        return None


def trainable_bytes(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad)


class Ledger:
    """A :class:`~lightning_mgpu.comm.CommStats` and when to fill and log it.

    Example::

        ledger = Ledger(log=True)
        ledger.start(model, world_size=2)          # after the model is wrapped
        ledger.record_buckets(ddp_model)            # after each synchronised backward (DDP, bucket views)
        ledger.optimizer_stepped(module, is_global_zero=True)
    """

    def __init__(self, log: bool = True) -> None:
        self.stats = CommStats()
        self.log = log
        self._bucket_layout: list[int] = []

    def start(self, model: nn.Module, world_size: int, mesh_shape: Optional[tuple[int, int]] = None) -> None:
        """The model's trainable gradient bytes and the world size: the ring all-reduce lower bound's inputs.
        ``mesh_shape``: ``(replicas, shard size)`` of a hybrid sharded mesh (the traffic per group)."""
        self.stats.world_size = world_size
        self.stats.replicas = mesh_shape[0] if mesh_shape is not None else 1
        self.stats.gradient_bytes = trainable_bytes(model.parameters())

    def record_round(self, layout: list[int]) -> None:
        self.stats.record_round(layout)

    def record_buckets(self, model: nn.Module) -> None:
        """One synchronised backward of DDP with bucket views: the buckets, read from the gradients' storages.

        DDP re-lays its buckets once, in its first iterations: read the layout then, and re-check it every 100
        rounds (reading walks every parameter: not for every step of a large model)."""
        stats = self.stats
        if not self._bucket_layout or stats.sync_rounds < 16 or stats.sync_rounds % 100 == 0:
            self._bucket_layout = buckets_from_grad_views(model.parameters())
        stats.record_round(self._bucket_layout)

    def optimizer_stepped(self, module: Optional[nn.Module], is_global_zero: bool) -> None:
        self.stats.optimizer_steps += 1
        self.write(module, is_global_zero)

    def write(self, module: Optional[nn.Module], is_global_zero: bool, force: bool = False) -> None:
        """Log ``comm/*`` through the Trainer's loggers every ``log_every_n_steps`` optimizer steps (rank 0)."""
        trainer = attached_trainer(module)
        if not self.log or trainer is None or not trainer.loggers or not is_global_zero:
            return
        # set on the Trainer at runtime by Lightning's logger connector (not a declared attribute)
        every = max(int(getattr(trainer, "log_every_n_steps", 50)), 1)
        if force or self.stats.optimizer_steps % every == 0:
            metrics = self.stats.as_metrics()
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
