"""The strategies' shape: the sharded stages 2/3 are not DDP, MGPUShardedStrategy(stage=...) builds the stage's
class, and no strategy module branches on the wrapper type."""

from __future__ import annotations

import ast
import contextlib
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch import nn

from lightning_mgpu import MGPUDDPStrategy, MGPUShardedStrategy
from lightning_mgpu.strategies import MGPUFSDPStrategy, MGPUParallelStrategy, MGPUStrategyMixin, MGPUZeRO1Strategy

STRATEGIES = Path(__file__).resolve().parents[2] / "lightning_mgpu" / "strategies"


@pytest.mark.parametrize(("stage", "cls", "is_ddp"), [(1, MGPUZeRO1Strategy, True), (2, MGPUFSDPStrategy, False)])
def test_the_sharded_strategy_builds_the_stages_class(stage, cls, is_ddp):
    strategy = MGPUShardedStrategy(stage=stage)
    assert type(strategy) is cls
    assert isinstance(strategy, (MGPUShardedStrategy, MGPUStrategyMixin))
    assert isinstance(strategy, MGPUDDPStrategy) is is_ddp
    assert isinstance(strategy, MGPUParallelStrategy) is not is_ddp
    assert repr(strategy).startswith(f"MGPUShardedStrategy(stage={stage}")


def test_stage_3_is_not_a_ddp_strategy_and_pickles_as_its_class():
    strategy = MGPUShardedStrategy(stage=3, wrap_modules=[nn.Linear])
    assert not issubclass(type(strategy), MGPUDDPStrategy)
    assert type(pickle.loads(pickle.dumps(strategy))) is MGPUFSDPStrategy  # what a spawn launch does


class _Mine(MGPUShardedStrategy):
    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        yield


def test_a_subclass_of_the_sharded_strategy_keeps_its_overrides_over_the_stages_class():
    strategy = _Mine(stage=2)
    assert isinstance(strategy, (_Mine, MGPUFSDPStrategy))
    assert type(strategy).block_backward_sync is _Mine.block_backward_sync


def _wrapper_type_checks(path: Path) -> list[str]:
    wrappers = {"DistributedDataParallel", "FSDPModule", "ShardedDataParallel", "FSDP2Backend"}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            if names & wrappers:
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_strategy_branches_on_the_wrapper_type():
    """Which wrapper a strategy uses is decided by its class (and its sharding backend), not by isinstance."""
    files = list(STRATEGIES.glob("*.py"))  # the backends (parts/sharding.py) own their wrappers
    assert [hit for p in files for hit in _wrapper_type_checks(p)] == []
