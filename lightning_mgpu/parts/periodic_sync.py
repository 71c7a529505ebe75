"""Periodic weight synchronisation: local SGD (average the weights every H optimizer steps) and DiLoCo (an outer
SGD step on the averaged weight difference every H inner steps), with the state a checkpoint needs.

Both are one algorithm here, as in torchft's ``DiLoCo``: every rank keeps the last synced weights (the *anchor*);
at a sync each rank sends ``anchor - local weights`` (the pseudo-gradient), the average comes back, and

* local SGD sets ``anchor -= average`` (exactly the mean of the ranks' weights), which is torch's
  ``PeriodicModelAverager`` / ``PostLocalSGDOptimizer``;
* DiLoCo hands the average to an outer ``torch.optim.SGD`` (Nesterov by default) as the anchor's gradient.

Every rank then copies the anchor into its parameters, so all ranks hold identical weights after a sync.

Why not torch's ``average_parameters``: it averages the weights themselves (so fp16/bf16 communication would round
the weights, not their change since the last sync), replaces each ``param.data`` with a view into its flat buffer,
and keeps no last synced weights, which a resume at another world size needs.

Example::

    sync = PeriodicSync(LocalSGDSettings(sync_every=4))
    sync.setup(list(model.parameters()), group=None, world_size=2)   # ranks hold identical weights here
    for batch in data:
        ...; optimizer.step()
        sync.after_optimizer_step(stats)   # averages every 4th call, counted in ``stats`` (a CommStats)
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.apply_func import move_data_to_device
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_mgpu import comm
from lightning_mgpu.ledger import CommStats
from lightning_mgpu.settings import DiLoCoSettings, LocalSGDSettings

CHECKPOINT_KEY = "lightning_mgpu_periodic_sync"
"""Where a checkpoint keeps the periodic-sync state: the last synced weights, the outer optimizer, the step within
the period and every rank's own weights and inner optimizer states."""

_COMM_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
BUCKET_BYTES = 25 * 1024 * 1024
"""Largest flat buffer one all-reduce of a sync carries (DDP's default bucket size)."""


class PeriodicSync:
    """Local SGD (``LocalSGDSettings``) or DiLoCo (``DiLoCoSettings``): when to sync, the sync, and its state."""

    def __init__(self, settings: LocalSGDSettings) -> None:
        self.settings = settings
        self.params: list[Tensor] = []
        self.buffers: list[Tensor] = []
        self.anchor: list[Tensor] = []
        self.outer: Optional[torch.optim.Optimizer] = None
        self.group: Any = None
        self.world_size = 1
        self.steps = 0
        """Optimizer steps taken (warm-up included)."""
        self.since_sync = 0
        """Optimizer steps since the last sync (or since the end of the warm-up)."""
        self.syncs = 0
        self.deferred = False
        """Fault tolerance: a completed period's sync waits for the start of the next step (:attr:`due`), where the
        replica groups meet (``parts/fault_tolerance.py``)."""
        self.resumed: Optional[str] = None
        """After a restore: ``"exact"`` (same world size: every rank's own weights and inner optimizer state) or
        ``"synced"`` (another world size: every rank starts from the last synced weights)."""
        self._held: Optional[dict[str, Any]] = None  # loaded with the weights, applied with the optimizer states

    # --- set-up -------------------------------------------------------------------------------------------
    def setup(self, params: Iterable[Tensor], group: Any, world_size: int, buffers: Iterable[Tensor] = ()) -> None:
        """The parameters to sync (every rank must hold the same values here: DDP broadcast them), and the buffers
        to average at each sync (floating-point ones: BatchNorm statistics; in their own dtype)."""
        self.params = [p for p in params if p.requires_grad]
        self.buffers = [b for b in buffers if b.is_floating_point()]
        self.group = group
        self.world_size = world_size
        with torch.no_grad():
            self.anchor = [p.detach().clone() for p in self.params]
        s = self.settings
        if isinstance(s, DiLoCoSettings):
            self.outer = torch.optim.SGD(
                self.anchor, lr=s.outer_lr, momentum=s.outer_momentum, nesterov=s.nesterov and s.outer_momentum > 0
            )

    @property
    def is_set_up(self) -> bool:
        return bool(self.params)

    @property
    def in_warmup(self) -> bool:
        """Whether the current step is a warm-up step (gradients all-reduced by DDP, no periodic sync)."""
        return self.steps < self.settings.warmup_steps

    @property
    def due(self) -> bool:
        """Whether a period is complete and not synced yet (a deferred sync, under fault tolerance)."""
        return not self.in_warmup and self.since_sync >= self.settings.sync_every

    @property
    def comm_dtype(self) -> Optional[torch.dtype]:
        """The dtype the weight differences are averaged in (``comm_dtype``); None: their own."""
        return _COMM_DTYPES.get(self.settings.comm_dtype) if self.settings.comm_dtype else None

    # --- the steps ----------------------------------------------------------------------------------------
    def after_optimizer_step(self, stats: CommStats) -> bool:
        """Count one optimizer step; sync when it completes a period. Returns whether it synced."""
        was_warmup = self.in_warmup
        self.steps += 1
        if was_warmup:
            if not self.in_warmup:  # the last warm-up step: the weights all ranks hold are the new anchor
                self._set_anchor_from_params()
            return False
        self.since_sync += 1
        if self.since_sync < self.settings.sync_every or self.deferred:
            return False
        self.sync(stats)
        return True

    @torch.no_grad()
    def sync(self, stats: CommStats, across: Optional[Callable[[list[Tensor]], Optional[int]]] = None) -> bool:
        """Average ``anchor - weights`` across ranks, step the anchor (mean, or the outer optimizer) and copy it into
        every rank's parameters. One all-reduce per bucket of at most :data:`BUCKET_BYTES`, counted in ``stats``.

        ``across`` (fault tolerance) then averages the group's differences and buffers in place over the replica
        groups and returns how many groups contributed, or None where the sync is not committed: the weights and
        buffers then stay as they are, and the next sync carries this period too. With 0 contributors (every group
        only joined) the anchor does not move. Returns whether the sync was committed."""
        deltas = [a - p.detach() for a, p in zip(self.anchor, self.params)]
        calls, nbytes = self._average(deltas, self.comm_dtype)
        buffers = [b.clone() for b in self.buffers] if across is not None else self.buffers
        buffer_calls, buffer_bytes = self._average(buffers, None)
        stats.record(calls + buffer_calls, nbytes + buffer_bytes)
        stats.sync_rounds += 1
        contributors = across([*deltas, *buffers]) if across is not None else self.world_size
        self.since_sync = 0
        if contributors is None:
            return False
        if buffers is not self.buffers:
            for b, averaged in zip(self.buffers, buffers):
                b.copy_(averaged)
        if self.outer is None and contributors:
            for a, d in zip(self.anchor, deltas):
                a.sub_(d)
        elif self.outer is not None and contributors:
            for a, d in zip(self.anchor, deltas):
                a.grad = d
            self.outer.step()
            for a in self.anchor:
                a.grad = None
        for p, a in zip(self.params, self.anchor):
            p.copy_(a)
        self.syncs += 1
        return True

    def _average(self, tensors: list[Tensor], comm_dtype: Optional[torch.dtype]) -> tuple[int, int]:
        """Average ``tensors`` in place across the group (in ``comm_dtype`` if set); returns (calls, payload bytes)."""
        calls = nbytes = 0
        for bucket in _buckets(tensors, comm_dtype):
            dtype = comm_dtype or bucket[0].dtype
            flat = torch.cat([t.reshape(-1).to(dtype) for t in bucket])
            flat.div_(self.world_size)  # before the sum, as torch's hooks do (no fp16 overflow)
            if self.world_size > 1:
                comm.all_reduce(flat, group=self.group)
                calls += 1
                nbytes += flat.numel() * flat.element_size()
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        return calls, nbytes

    @torch.no_grad()
    def _set_anchor_from_params(self) -> None:
        for a, p in zip(self.anchor, self.params):
            a.copy_(p)
        self.since_sync = 0

    # --- checkpoints --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What every rank shares: the last synced weights, the outer optimizer's state and the counters."""
        synced = self.params if self.in_warmup else self.anchor  # in the warm-up DDP keeps the ranks identical
        return {
            "kind": "diloco" if self.outer is not None else "local_sgd",
            "world_size": self.world_size,
            "steps": self.steps,
            "since_sync": self.since_sync,
            "syncs": self.syncs,
            "synced_weights": [t.detach().cpu().clone() for t in synced],
            "outer_optimizer": copy.deepcopy(self.outer.state_dict()) if self.outer is not None else None,
        }

    def heal_state(self) -> dict[str, Any]:
        """What a healing replica group's rank takes from the same rank of a live group (fault tolerance): the last
        synced weights, the outer optimizer and the counters (its own weights travel with the module's)."""
        return {
            "anchor": [a.detach() for a in self.anchor],
            "outer_optimizer": self.outer.state_dict() if self.outer is not None else None,
            "counters": [self.steps, self.since_sync, self.syncs],
        }

    @torch.no_grad()
    def load_heal_state(self, state: Mapping[str, Any]) -> None:
        """:meth:`heal_state` of a live group's rank, copied in place."""
        for a, saved in zip(self.anchor, state["anchor"], strict=True):
            a.copy_(saved)
        if self.outer is not None:
            self.outer.load_state_dict(state["outer_optimizer"])
        self.steps, self.since_sync, self.syncs = (int(n) for n in state["counters"])

    @contextmanager
    def no_sync(self, ddp: Any) -> Iterator[None]:
        """Around a training step of the DDP model ``ddp``: DDP decides in forward whether the backward all-reduces;
        outside the warm-up it never does."""
        if self.in_warmup:
            yield
            return
        with ddp.no_sync():
            yield

    def add_to_checkpoint(self, checkpoint: dict[str, Any], strategy: Any, group: Any) -> None:
        """A collective (Lightning calls ``save_checkpoint`` on every rank): rank 0 puts every rank's own weights and
        optimizer states (``strategy``'s, Lightning's), and this sync's state, into the checkpoint."""
        if not self.is_set_up or not comm.group_is_up():
            return
        mine = {
            "weights": self.local_weights(),
            # on CPU: a CUDA tensor would be unpickled on rank 0 onto the sender's device
            "optimizer_states": move_data_to_device([strategy.optimizer_state(o) for o in strategy.optimizers], "cpu"),
        }
        ranks = comm.gather_object(mine, dst=0, group=group)
        if strategy.is_global_zero:
            checkpoint[CHECKPOINT_KEY] = {**self.state_dict(), "ranks": ranks}

    def hold(self, checkpoint: Mapping[str, Any]) -> None:
        """Loading the weights: the sync's state is applied with the optimizer states (:meth:`restore_held`), after
        set-up (DDP's wrap broadcasts rank 0's weights)."""
        self._held = checkpoint.get(CHECKPOINT_KEY)

    def restore_held(self, rank: int, world_size: int, load_optimizer_states: Callable[[dict[str, Any]], None]) -> None:
        """After the optimizer states: on as many ranks as saved, every rank's own weights and optimizer states
        (``load_optimizer_states``: Lightning's load); on another number, the last synced weights."""
        state, self._held = self._held, None
        if state is None or not self.is_set_up:
            return
        ranks = state.get("ranks") or []
        mine = ranks[rank] if len(ranks) == world_size == state["world_size"] else None
        if mine is not None:
            load_optimizer_states({"optimizer_states": mine["optimizer_states"]})
        self.load_state_dict(state, mine["weights"] if mine is not None else None)

    def check_model(self, model: pl.LightningModule, strategy_name: str, precision_plugin: Any) -> None:
        """Before launch: a period counts the steps of the one optimizer Lightning steps, and the sync sees the
        module's weights, not the FP32 masters a precision plugin may keep (``MGPUPrecision``'s ``master``)."""
        if not model.automatic_optimization:
            raise MisconfigurationException(
                f"{strategy_name} needs automatic optimization: a period is sync_every steps of the one "
                f"optimizer Lightning steps, and {type(model).__name__} steps its optimizers itself "
                f"(automatic_optimization=False). Use strategy='mgpu_ddp', which syncs each optimizer's gradients at "
                f"its step."
            )
        if getattr(precision_plugin, "master", False):
            raise MisconfigurationException(
                f"MGPUPrecision({precision_plugin.mode!r}) keeps FP32 master weights inside the optimizer, which the "
                f"periodic weight sync does not see. Use precision='bf16-mixed' or '16-mixed' with {strategy_name}."
            )

    def local_weights(self) -> list[Tensor]:
        """This rank's own weights and averaged buffers (they differ between ranks inside a period)."""
        return [t.detach().cpu().clone() for t in [*self.params, *self.buffers]]

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any], local_weights: Optional[list[Tensor]]) -> str:
        """Restore from :meth:`state_dict` and, at the world size it was saved at, this rank's own weights.

        Returns ``"exact"`` when ``local_weights`` are given and the world size matches (the run continues as if
        never stopped), else ``"synced"``: every rank starts from the last synced weights and a new period, with a
        warning saying so."""
        kind = "diloco" if self.outer is not None else "local_sgd"
        if state.get("kind") != kind:
            raise ValueError(
                f"This checkpoint was written by the {state.get('kind')!r} strategy, not {kind!r}: its periodic-sync "
                f"state does not apply. Resume it with the strategy that wrote it."
            )
        synced = state["synced_weights"]
        if len(synced) != len(self.anchor):
            raise ValueError(
                f"The checkpoint holds {len(synced)} synced weight tensors, the model has {len(self.anchor)} "
                f"trainable parameters: it belongs to another model."
            )
        for a, s in zip(self.anchor, synced):
            a.copy_(s)
        if self.outer is not None and state.get("outer_optimizer") is not None:
            self.outer.load_state_dict(state["outer_optimizer"])
        self.steps, self.syncs = int(state["steps"]), int(state["syncs"])
        same = int(state["world_size"]) == self.world_size and local_weights is not None
        if same:
            assert local_weights is not None
            for t, w in zip([*self.params, *self.buffers], local_weights, strict=True):
                t.copy_(w)
            self.since_sync = int(state["since_sync"])
            self.resumed = "exact"
            return self.resumed
        for p, a in zip(self.params, self.anchor):
            p.copy_(a)
        self.since_sync = 0
        self.resumed = "synced"
        why = (
            f"written by {state['world_size']} ranks, resumed on {self.world_size}: each rank's own weights and inner "
            f"optimizer state cannot be shared out to another number of ranks"
            if int(state["world_size"]) != self.world_size
            else "without each rank's own weights and inner optimizer states"
        )
        rank_zero_warn(  # every rank resumes so: said once, by rank 0
            f"Resuming a {kind} checkpoint {why}, so every rank resumes from the last synced weights with rank 0's "
            f"inner optimizer state, and a new period starts "
            f"({state['since_sync']} unsynced steps of the saved period are dropped). Resume on "
            f"{state['world_size']} ranks, from a checkpoint this strategy wrote, to continue exactly."
        )
        return self.resumed


def _buckets(tensors: list[Tensor], comm_dtype: Optional[torch.dtype]) -> list[list[Tensor]]:
    """``tensors`` grouped by dtype, in order, each group cut into buckets of at most :data:`BUCKET_BYTES` (a tensor
    larger than that is a bucket of its own)."""
    buckets: dict[torch.dtype, list[list[Tensor]]] = {}
    filled: dict[torch.dtype, int] = {}
    for t in tensors:
        size = t.numel() * torch.empty((), dtype=comm_dtype or t.dtype).element_size()
        groups = buckets.setdefault(t.dtype, [[]])
        if groups[-1] and filled.get(t.dtype, 0) + size > BUCKET_BYTES:
            groups.append([])
            filled[t.dtype] = 0
        groups[-1].append(t)
        filled[t.dtype] = filled.get(t.dtype, 0) + size
    return [b for groups in buckets.values() for b in groups]
