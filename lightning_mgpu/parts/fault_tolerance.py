"""Fault-tolerant replica groups: a group of ranks dies, the other groups keep training, the group is started again
and heals from a live peer, without any rank of the others restarting. Built on torchft (PyTorch's
fault-tolerance library; the ``torchft`` extra), not on a quorum of our own.

The layout: the job is ``replica_groups`` independent launches (a script, ``torchrun`` or SLURM each, any number of
processes per group), and a *lighthouse* (torchft's ``torchft_lighthouse``) that every group's first rank talks to.
Inside a group, the strategy is what it is without fault tolerance (``mgpu_ddp``: DDP over the group's ranks).
Across groups, each optimizer step is a transaction:

1. before the step's first micro-batch, the groups agree on a *quorum* through the lighthouse (who is alive, at
   which step); a group that is behind (started again after a failure, or new) first loads the weights, optimizer
   and scheduler state, the loop's step count and the random states from a live group (torchft sends them; this
   is *healing*). A group's first quorum comes before its first batch is drawn (``on_train_start``): healed there,
   it takes the live group's whole fit loop state, so that its training loader goes on at the live group's place
   in the epoch (in its own share of the data);
2. after the step's last backward, the gradients (already averaged inside the group) are averaged over the groups
   of the quorum through torchft's reconfigurable process group;
3. the optimizer steps only if every group of the quorum says the step succeeded (``should_commit``); otherwise
   the step is dropped on every group: no optimizer step, no scheduler step, and Lightning's ``global_step``
   (so ``max_steps``, checkpoints' step and the progress bar) does not move. A group whose peer died in the
   middle of the all-reduce drops the step and carries on with the next quorum.

With local SGD or DiLoCo (``mgpu_local_sgd``, ``mgpu_diloco``) the transaction is a *sync*, not a step: every rank
takes its ``sync_every`` inner steps alone, and at the start of the step after a period the groups agree on a quorum
(a group started again heals there: weights, last synced weights, outer and inner optimizer state, counters), the
weight differences, averaged inside each group, are averaged over the groups that trained the period (a group that
has just joined or healed listens: it counts with weight 0), and the outer step is taken only if every group commits;
a sync that is not committed leaves every group's weights as they are, and the next sync carries that period too.
A group's first sync (before its first batch) is its joining; a fit's last period is synced when training ends.

Checkpoints are written, and Lightning's loggers write, on the lowest group of the last quorum only (group 0
before the first): every group runs the same callbacks and loggers, one writes. Between a writer's death and the
next quorum (a step; under local SGD / DiLoCo, up to a period) no group writes.

What a failure costs: the steps the failed group had taken since it last committed, and the batches the survivors
were on when their all-reduce failed (those batches are skipped, not retried). ``min_replicas`` groups must take
part in a step for it to commit; with fewer alive, the survivors wait for the quorum (up to ``quorum_timeout``).

Each group draws its own share of the data: Lightning's distributed sampler sees ``replica_groups x group size``
replicas, and this group's ranks are the ``replica_group``-th block of them.

Example (two groups of one process each on one machine, after starting ``torchft_lighthouse --min_replicas 1``)::

    # shell 1: MGPU_REPLICA_GROUP=0 MGPU_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
    #          MASTER_PORT=29600 python train.py
    # shell 2: the same with MGPU_REPLICA_GROUP=1 and MASTER_PORT=29700
    trainer = Trainer(strategy=MGPUDDPStrategy(fault_tolerance=True), devices=1, max_steps=1000)
    trainer.fit(model)
    trainer.strategy.replicas.committed_steps
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
from lightning_utilities.core.rank_zero import rank_zero_only

from lightning_mgpu import _compat, comm
from lightning_mgpu.ledger import CommStats
from lightning_mgpu.parts.periodic_sync import PeriodicSync
from lightning_mgpu.settings import LIGHTHOUSE_COMMAND, FaultTolerance


class ReplicaGroups:
    """The replica-group part of a strategy: torchft's manager, the per-step quorum, the cross-group gradient
    average and the commit gate, the state a healing group receives, and Lightning's loop kept to committed steps.

    Read after fit: :attr:`committed_steps`, :attr:`dropped_steps` (steps this group took part in; with
    :attr:`periodic`, syncs), :attr:`heals` (times this group loaded the state of a live group: the first quorum's
    start sync of a group other than the first counts), :attr:`participants` (groups in the last quorum) and, with
    :attr:`periodic`, :attr:`contributors` (groups whose period the last sync averaged) and :attr:`contributed`;
    :attr:`step`.
    """

    def __init__(self, config: FaultTolerance, stats: CommStats) -> None:
        self.config = config
        self.stats = stats
        self.manager: Any = None
        self.committed_steps = 0
        self.dropped_steps = 0
        self.heals = 0
        self.participants = 0
        self.periodic: Optional[PeriodicSync] = None
        """Local SGD / DiLoCo (set by the runtime): the transaction is then the periodic sync."""
        self.contributors = 0
        self.contributed = False
        self.step = 0
        """torchft's count of the steps (syncs) the replica groups committed, as of this group's last transaction:
        the same in every group that took part in it (a healed group takes it from the live one)."""
        self.trainer: Any = None
        self.module: Any = None
        self._undo: Optional[Callable[[], None]] = None
        self._deadline: Optional[float] = None  # the running step's end by step_timeout (monotonic); None between steps
        self._watch: Optional[threading.Event] = None  # set: the watchdog stops
        self._quorums = 0  # quorums this group took part in
        self._rank, self._size = 0, 1  # this rank in its group, the group's size
        self._joining = False  # inside join(): a heal then restarts Lightning's fit loop where the live group is
        self._joined = False  # join() formed the quorum of the first step: its begin_step forms none
        self._rng: Optional[dict[str, Any]] = None  # a heal's random states, set where the live group took them

    @property
    def group(self) -> int:
        assert self.config.replica_group is not None  # resolved
        return self.config.replica_group

    @property
    def groups(self) -> int:
        assert self.config.replica_groups is not None  # resolved
        return self.config.replica_groups

    def sampler_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Lightning's sampler arguments for one group's ranks -> this group's block of every group's ranks."""
        per_group = int(kwargs["num_replicas"])
        return {**kwargs, "num_replicas": per_group * self.groups, "rank": self.group * per_group + int(kwargs["rank"])}

    def setup(self, trainer: Any, module: Any, group_rank: int, group_size: int, address: str, port: int) -> None:
        """Join the replica groups (fit only): torchft's manager over this group's store (``address:port``, the
        store Lightning's process group was made on), a cross-group process group on the gradients' device."""
        from torchft import Manager

        if not module.automatic_optimization:
            raise RuntimeError(
                "fault_tolerance supports automatic optimization only: a dropped step must be one optimizer step "
                "Lightning takes. Remove fault_tolerance, or use automatic optimization."
            )
        self.trainer, self.module = trainer, module
        self._rank, self._size = group_rank, group_size
        timeout = timedelta(seconds=self.config.timeout)
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        self.manager = Manager(
            pg=comm.replica_process_group(device, timeout),
            load_state_dict=self.load_heal_state,
            state_dict=self.heal_state,
            min_replica_size=self.config.min_replicas,
            use_async_quorum=False,  # a healing group loads its state before the step's forward and takes part in it
            timeout=timeout,
            quorum_timeout=timedelta(seconds=self.config.quorum_timeout),
            connect_timeout=timeout,
            rank=group_rank,
            world_size=group_size,
            store_addr=address,
            store_port=port,
            lighthouse_addr=self.config.lighthouse,
            replica_id=f"mgpu_group_{self.group}",
            hostname=socket.gethostname(),
        )
        self._route_logging()
        self._watch = threading.Event()
        threading.Thread(
            target=self._watchdog, args=(self._watch, group_rank), name="mgpu-step-watchdog", daemon=True
        ).start()

    def join(self) -> None:
        """Before the first batch is drawn (``on_train_start``): the first quorum (with local SGD / DiLoCo, the
        joining sync). A group that heals here takes the live group's whole fit loop state, the data position of its
        training loader included, so that it goes on with the live group's next batch of its share of the data."""
        if self.manager is None:
            return
        self._joining = True
        try:
            self.sync() if self.periodic is not None else self._quorum()
        finally:
            self._joining = False
        self._joined = True

    def begin_step(self, accumulating_before: bool) -> None:
        """Before a training batch: a batch that starts an optimizer step (``accumulating_before`` False: no
        micro-batch of this step ran yet) starts the quorum, healing this group first if it is behind (the first
        step's was formed by :meth:`join`); with :attr:`periodic`, only the step after a completed period does
        (:meth:`sync`)."""
        self.settle()
        if self.manager is None or accumulating_before:
            return
        periodic = self.periodic
        joined, self._joined = self._joined, False
        if joined:  # the quorum (or sync) of this step was formed before the first batch
            rng, self._rng = self._rng, None
            if rng is not None:  # here, as the live group's were taken: its loader's iterator drew from them since
                _compat.set_rng_states(rng)
        elif periodic is None:
            self._quorum()
        elif periodic.due:
            self.sync()
        self._deadline = time.monotonic() + self.config.step_timeout

    def _quorum(self) -> None:
        try:
            self.manager.start_quorum()  # bounded by quorum_timeout
        except Exception as err:  # torchft's quorum RPC: a TimeoutError, or a RuntimeError when it cannot connect
            config = self.config
            raise RuntimeError(
                f"lightning-mgpu: replica group {self.group} got no quorum from the lighthouse at {config.lighthouse} "
                f"within quorum_timeout={config.quorum_timeout:g} s ({type(err).__name__}: {err}). Is the lighthouse "
                f"still running? Start it again (`{LIGHTHOUSE_COMMAND}`), then this group: it heals from a group "
                f"still training or, where none is, resume it from its last checkpoint (trainer.fit(..., "
                f"ckpt_path=...)). With fewer than min_replicas={config.min_replicas} groups alive no step can commit "
                f"either. This group's weights are those of its last committed step, {self.trainer.global_step}; "
                f"its checkpoints so far are whole."
            ) from err
        self._quorums += 1
        self.step = self.manager.current_step()
        self._route_logging()

    def _route_logging(self) -> None:
        """Lightning's loggers (and its rank-zero messages) on the first rank of the group that writes checkpoints
        only: the other groups' ranks count as ranks above the writer's for ``rank_zero_only``."""
        writes = self.writes_checkpoints()
        rank_zero_only.rank = self._rank if writes else self._rank + self._size  # type: ignore[attr-defined]

    def sync(self) -> None:
        """The periodic sync as a transaction over the groups (local SGD, DiLoCo): the quorum (healing this group
        first if it is behind), the period's weight differences averaged over the groups that trained it (a group
        that joins or has just healed counts with weight 0), the outer step only if every group commits."""
        periodic = self.periodic
        assert periodic is not None and self.manager is not None
        joining, heals = self._quorums == 0, self.heals
        self._quorum()
        self.contributed = not joining and self.heals == heals
        contributors: list[Optional[int]] = [None]

        def across(tensors: list[torch.Tensor]) -> Optional[int]:
            weight = 1.0 if self.contributed else 0.0
            count = comm.replica_group_mean(self.manager, tensors, self.stats, weight=weight, dtype=periodic.comm_dtype)
            self.participants = self.manager.num_participants()
            contributors[0] = count if self.manager.should_commit() else None
            return contributors[0]

        committed = periodic.sync(self.stats, across)
        self.step = self.manager.current_step()
        if committed:
            self.committed_steps += 1
            self.contributors = int(contributors[0] or 0)
        else:
            self.dropped_steps += 1

    def finish(self) -> None:
        """When training ends: the last period's sync, if it is complete (every group ends at the same step)."""
        if self.manager is not None and self.periodic is not None and self.periodic.due:
            self.sync()

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], step: Callable[[Callable[[], Any]], Any]
    ) -> Any:
        """One optimizer step as a transaction: the closure (the step's last forward and backward), the gradients
        averaged over the quorum's groups, then Lightning's ``step`` only if every group commits."""
        if self.manager is None:
            return step(closure)
        if self.periodic is not None:  # a step inside a period: this rank's own; the sync is the transaction
            output = step(closure)
            self._deadline = None
            return output
        output = closure()
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        comm.replica_group_mean(self.manager, [comm.local_shard(p.grad) for p in params], self.stats)
        self.participants = self.manager.num_participants()
        committed = self.manager.should_commit()
        self.step = self.manager.current_step()
        self._deadline = None
        if committed:
            self.committed_steps += 1
            return step(lambda: output)
        self.dropped_steps += 1
        self._undo = _compat.drop_optimizer_step(self.trainer)
        return output

    def writes_checkpoints(self) -> bool:
        """Whether this group writes (and removes) the checkpoints Lightning asks for: the lowest group of the
        last quorum, group 0 before the first; the others hold the same weights at every committed step."""
        if self.manager is None:
            return True
        if self._quorums == 0:
            return self.group == 0
        return bool(self.manager.participating_rank() == 0)

    def settle(self) -> None:
        """After a dropped step, once Lightning's loop has finished it: its scheduler step and logging step undone."""
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()

    def heal_state(self) -> dict[str, Any]:
        """What a healing group receives from this rank: this rank's part of the weights and of the optimizer state
        (its shards under ZeRO; the rank of the same number in the healing group takes it), the schedulers, the
        loop's counters and the random states."""
        trainer, module = self.trainer, self.module
        return {
            "module": _local(module.state_dict()),
            "optimizers": [_local(o.state_dict()) for o in trainer.optimizers],
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "loop": _compat.committed_loop_state(trainer),
            "fit_loop": _compat.fit_loop_state(trainer),
            "periodic": self.periodic.heal_state() if self.periodic is not None else None,
            "rng": _compat.rng_states(),  # dropout and the like go on as on the live group's rank
        }

    @torch.no_grad()
    def load_heal_state(self, state: dict[str, Any]) -> None:
        """:meth:`heal_state` of the same rank of a live group, copied into this rank's tensors in place (the
        weights stay the parameters the optimizer holds, shards stay shards)."""
        trainer, module = self.trainer, self.module
        for name, tensor in module.state_dict().items():
            comm.local_shard(tensor).copy_(state["module"][name])
        for optimizer, saved in zip(trainer.optimizers, state["optimizers"]):
            _load_optimizer_in_place(optimizer, saved)
        for config, saved in zip(trainer.lr_scheduler_configs, state["schedulers"]):
            config.scheduler.load_state_dict(saved)
        if self._joining and state["loop"]["global_step"] > 0:  # before the first batch: where the live group is
            _compat.restart_fit_loop(trainer, state["fit_loop"])
        else:
            _compat.load_committed_loop_state(trainer, state["loop"])
        if self.periodic is not None:
            self.periodic.load_heal_state(state["periodic"])
        if self._joining:
            self._rng = state["rng"]
        else:
            _compat.set_rng_states(state["rng"])
        self.heals += 1
        self.stats.heal_bytes += _nbytes(state)

    def _watchdog(self, stop: threading.Event, rank: int) -> None:
        """A daemon thread: a step past its deadline ends this process (the others of the group end alike, or with
        the failure of their next collective inside the group)."""
        while not stop.wait(0.25):
            deadline = self._deadline
            if deadline is None or time.monotonic() < deadline:
                continue
            step = self.trainer.global_step + 1 if self.trainer is not None else "?"
            vote = "commit vote" if self.periodic is None else "optimizer step"
            print(
                f"lightning-mgpu: replica group {self.group}, rank {rank}: step {step} has run for "
                f"step_timeout={self.config.step_timeout:g} s without reaching its {vote}; the group is stuck "
                f"(user code, a data loader, a collective inside the group) and leaves the job so that the other "
                f"groups can go on. Start it again: it heals from a live group.",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)  # the main thread is stuck: nothing else can end it

    def teardown(self) -> None:
        if self._watch is not None:
            self._watch.set()
        self._deadline = None
        self.settle()
        manager, self.manager = self.manager, None
        if manager is not None:
            manager.shutdown(wait=False)


def _local(tree: Any) -> Any:
    """``tree`` with every tensor replaced by this rank's part of it (a DTensor's local shard), detached."""
    return _compat.tree_map_tensors(lambda t: comm.local_shard(t).detach(), tree)


def _nbytes(tree: Any) -> int:
    sizes: list[int] = []
    _compat.tree_map_tensors(lambda t: sizes.append(t.numel() * t.element_size()), tree)
    return sum(sizes)


def _load_optimizer_in_place(optimizer: Any, saved: dict[str, Any]) -> None:
    """``saved`` (an optimizer's :func:`_local` state dict) into ``optimizer``'s own state tensors: created first
    where it has none (a group started again), then each copied in place, so that a sharded state stays sharded."""
    _compat.init_optimizer_state(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entries in saved["state"].items():
        state = optimizer.state[params[int(index)]]
        for key, value in entries.items():
            if isinstance(value, torch.Tensor) and isinstance(state.get(key), torch.Tensor):
                comm.local_shard(state[key]).copy_(value)
            else:
                state[key] = value
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
