"""The communication ledger: what one rank handed to the collectives, counted as it goes, and when it is logged.

Every mgpu strategy keeps a :class:`CommStats` as ``trainer.strategy.comm_stats``: the gradient synchronisation's
all-reduce calls and bytes (DDP's buckets, read off the gradients, or what a named comm hook handed on), the pack's
own collectives (:mod:`lightning_mgpu.comm` records each one it is given a ledger for), the sends between pipeline
stages, and, where asked, the tensor dimension's collectives (:class:`CollectiveCounter`). :class:`Ledger` fills it
after each synchronised backward and logs :meth:`CommStats.as_metrics` as ``comm/*`` through the Trainer's loggers.

Example::

    from lightning_mgpu import MGPUDDPStrategy

    strategy = MGPUDDPStrategy(comm_hook="fp16")
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy)
    trainer.fit(model)
    print(strategy.comm_stats.summary())  # all-reduce calls, bytes, optimizer steps, ring lower bound
"""

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_mgpu._compat import attached_trainer, collective_dispatch_mode


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

    replica_group_calls: int = 0
    """Fault tolerance (``fault_tolerance``): the all-reduces that averaged the gradients across replica groups
    (torchft), one per gradient dtype and device per committed or dropped step."""
    replica_group_bytes: int = 0
    """Their payload bytes."""
    heal_bytes: int = 0
    """Fault tolerance: the bytes of the state this rank received from a live group when it healed (weights,
    optimizer and scheduler state)."""

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
# The ledger hooked up to a strategy: what it counts after each synchronised backward, when it logs, and how
# the model's gradient size is read (one place for what both strategy families did).


def trainable_bytes(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad)


class Ledger:
    """A :class:`CommStats` and when to fill and log it.

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
