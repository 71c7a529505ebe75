"""The fault-tolerance option (``fault_tolerance``): where its settings come from, what is refused before anything
starts, and each group's share of the data. The kill-and-rejoin proof is
``tests/integration/parts/test_fault_tolerance.py``."""

from __future__ import annotations

import importlib.util
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_mgpu import (
    FaultTolerance,
    MGPUDDPStrategy,
    MGPUDiLoCoStrategy,
    MGPULocalSGDStrategy,
    MGPUShardedStrategy,
)
from lightning_mgpu.comm import replica_group_mean
from lightning_mgpu.ledger import CommStats
from lightning_mgpu.parts.fault_tolerance import ReplicaGroups
from lightning_mgpu.parts.periodic_sync import PeriodicSync
from lightning_mgpu.settings import LocalSGDSettings, check_fault_tolerance

ENV = {"TORCHFT_LIGHTHOUSE": "http://lighthouse:29510", "MGPU_REPLICA_GROUP": "1", "MGPU_REPLICA_GROUPS": "3"}


def test_true_reads_the_lighthouse_group_and_groups_from_the_environment_and_arguments_win():
    assert check_fault_tolerance(True, ENV) == FaultTolerance(
        lighthouse="http://lighthouse:29510", replica_group=1, replica_groups=3
    )
    given = check_fault_tolerance({"replica_group": 2, "min_replicas": 2}, ENV)
    assert (given.replica_group, given.replica_groups, given.min_replicas) == (2, 3, 2)
    assert check_fault_tolerance(None, ENV) is None and check_fault_tolerance(False, ENV) is None


@pytest.mark.parametrize(
    ("value", "environ", "message"),
    [
        (True, {}, "fault_tolerance needs lighthouse: pass fault_tolerance={'lighthouse': ...} or set "
                   "TORCHFT_LIGHTHOUSE; start one with `torchft_lighthouse --min_replicas 1"),
        (True, {"TORCHFT_LIGHTHOUSE": "http://h:1"}, "fault_tolerance needs replica_group: pass fault_tolerance="
                                                      "{'replica_group': ...} or set MGPU_REPLICA_GROUP"),
        (True, {**ENV, "MGPU_REPLICA_GROUP": "one"}, "MGPU_REPLICA_GROUP='one' must be a whole number."),
        ({"min_replicas": 4}, ENV, "min_replicas=4 is more than replica_groups=3: no step could ever commit"),
        ({"replica_group": 3}, ENV, "replica_group=3 is outside 0..2 (replica_groups=3): number the groups from 0."),
        ({"timeout": 0}, ENV, "fault_tolerance timeout=0 must be a positive number of seconds."),
        ({"lighthose": "x"}, ENV, "fault_tolerance does not take ['lighthose']; its fields are ['lighthouse', "),
        ("yes", ENV, "fault_tolerance='yes' must be True (settings from the environment), a dict of"),
    ],
)  # fmt: skip
def test_a_bad_or_missing_setting_is_refused_naming_it_and_the_fix(value, environ, message):
    with pytest.raises((ValueError, TypeError)) as err:
        check_fault_tolerance(value, environ)
    assert message in str(err.value)


def test_without_torchft_the_option_names_the_extra_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(ImportError, match=r"fault_tolerance needs torchft, which is not installed: pip install "
                                          r"'lightning-mgpu\[torchft\]'"):  # fmt: skip
        check_fault_tolerance(True, ENV)


def test_the_strategies_take_it_at_construction_the_periodic_ones_sync_at_the_next_step_and_refuse_a_warmup(
    monkeypatch,
):
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    strategy = MGPUDDPStrategy(fault_tolerance=True)
    assert strategy.settings.fault_tolerance.replica_groups == 3 and strategy.replicas is not None
    assert MGPUDDPStrategy().replicas is None and strategy.replicas.periodic is None
    for cls in (MGPULocalSGDStrategy, MGPUDiLoCoStrategy):
        periodic = cls(sync_every=2, fault_tolerance=True)
        assert periodic.replicas.periodic is periodic.periodic_sync and periodic.periodic_sync.deferred
        assert not cls(sync_every=2).periodic_sync.deferred and cls().replicas is None
        with pytest.raises(TypeError, match=f"{cls.__name__} does not take fault_tolerance with warmup_steps=3: "):
            cls(fault_tolerance=True, warmup_steps=3)


class _Manager:
    """torchft's manager as the weighted mean sees it: this group's part, summed with the other groups' parts."""

    def __init__(self, others: list[torch.Tensor]) -> None:
        self.others = others

    def num_participants(self) -> int:
        return 1 + len(self.others)

    def allreduce(self, flat: torch.Tensor, reduce_op: object = None) -> Any:
        for other in self.others:
            flat.add_(other)
        return SimpleNamespace(wait=lambda: None)


def test_the_periodic_sync_across_groups_averages_the_contributing_groups_and_a_listener_or_a_drop_moves_nothing():
    """Local SGD on one rank of a group (world size 1): ``anchor - weights`` averaged with another group's
    difference (weight 1 each); a group that listens (weight 0) takes the others' mean; 0 contributors leave the
    anchor; a dropped sync leaves the weights where they are (the next sync carries the period)."""
    weight = torch.nn.Parameter(torch.tensor([4.0]))
    sync = PeriodicSync(LocalSGDSettings(sync_every=1))
    sync.setup([weight], group=None, world_size=1)
    sync.deferred = True
    stats = CommStats()
    with torch.no_grad():
        weight.sub_(1.0)  # this rank's period: anchor 4 -> weights 3 (difference 1)
    assert sync.after_optimizer_step(stats) is False and sync.due  # deferred to the next step's start
    other = _Manager([torch.tensor([3.0, 1.0])])  # another group's difference 3, weight 1
    assert sync.sync(stats, lambda t: replica_group_mean(other, t, stats, weight=1.0)) is True
    assert weight.item() == sync.anchor[0].item() == 2.0 and not sync.due  # 4 - mean(1, 3)
    with torch.no_grad():
        weight.sub_(5.0)  # a joining group's garbage difference, weight 0: it takes the other's mean
    assert sync.sync(stats, lambda t: replica_group_mean(other, t, stats, weight=0.0)) is True
    assert weight.item() == -1.0  # 2 - 3
    alone = _Manager([])
    with torch.no_grad():
        weight.sub_(1.0)
    assert sync.sync(stats, lambda t: replica_group_mean(alone, t, stats, weight=0.0)) is True
    assert weight.item() == sync.anchor[0].item() == -1.0  # nobody contributed: the anchor stays
    with torch.no_grad():
        weight.sub_(1.0)
    assert sync.sync(stats, lambda t: None) is False  # not committed: the weights stay, the anchor too
    assert (weight.item(), sync.anchor[0].item(), sync.syncs, stats.replica_group_calls) == (-2.0, -1.0, 3, 3)
    assert sync.sync(stats, lambda t: replica_group_mean(alone, t, stats, weight=1.0)) is True
    assert weight.item() == -2.0  # both periods' difference, carried to this sync


@pytest.mark.parametrize(
    ("layout", "named"),
    [
        ({"stage": 1}, "stage=1"),
        ({"stage": 3, "mesh": "hybrid"}, "mesh='hybrid'"),
        ({"stage": 3, "tensor_parallel_size": 2}, "tensor_parallel_size=2"),
        ({"stage": 2, "offload": "cpu"}, "offload='cpu'"),
    ],
)  # fmt: skip
def test_the_sharded_strategy_takes_it_over_a_flat_zero_stage_and_refuses_the_layouts_not_built(
    monkeypatch, layout, named
):
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    assert MGPUShardedStrategy(stage=3, fault_tolerance=True).replicas is not None
    with pytest.raises(
        ValueError, match=f"fault_tolerance with {re.escape(named)} is not built yet: the replica groups "
    ):
        MGPUShardedStrategy(fault_tolerance=True, **layout)


def test_each_group_draws_its_own_block_of_the_data():
    """3 groups of 2 ranks: Lightning's sampler sees 6 replicas; group 1's ranks are replicas 2 and 3."""
    replicas = ReplicaGroups(check_fault_tolerance(True, ENV), CommStats())
    kwargs = {"num_replicas": 2, "rank": 1, "shuffle": True}
    assert replicas.sampler_kwargs(kwargs) == {"num_replicas": 6, "rank": 3, "shuffle": True}
