"""The strategies' shape: plain classes (no metaclass, nothing abstract cleared by hand), one MGPUShardedStrategy
for every stage, none of them DDP, and no strategy module branches on the wrapper type."""

from __future__ import annotations

import ast
import contextlib
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_mgpu import MGPUDDPStrategy, MGPUShardedStrategy
from lightning_mgpu.strategies import MGPUParallelStrategy, MGPUStrategyMixin

STRATEGIES = Path(__file__).resolve().parents[2] / "lightning_mgpu" / "strategies"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_sharded_strategy_is_one_plain_class_for_every_stage(stage):
    strategy = MGPUShardedStrategy(stage=stage)
    assert type(strategy) is MGPUShardedStrategy
    assert type(type(strategy)) is type(MGPUParallelStrategy)  # no metaclass of its own
    assert MGPUShardedStrategy.__abstractmethods__ == frozenset()  # concrete by itself, nothing cleared by hand
    assert isinstance(strategy, (MGPUParallelStrategy, MGPUStrategyMixin)) and not isinstance(strategy, MGPUDDPStrategy)
    assert repr(strategy).startswith(f"MGPUShardedStrategy(stage={stage}")
    assert type(pickle.loads(pickle.dumps(strategy))) is MGPUShardedStrategy  # what a spawn launch does


def test_no_strategy_module_defines_a_metaclass_or_clears_abstract_methods():
    for path in STRATEGIES.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                assert not [k for k in node.keywords if k.arg == "metaclass"], f"{path.name}: {node.name}"
            if isinstance(node, ast.Attribute):
                assert node.attr != "__abstractmethods__", f"{path.name}:{node.lineno}"


class _Mine(MGPUShardedStrategy):
    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        yield


@pytest.mark.parametrize("stage", [1, 3])
def test_a_subclass_of_the_sharded_strategy_is_itself_with_its_overrides(stage):
    strategy = _Mine(stage=stage)
    assert type(strategy) is _Mine and strategy.stage == stage
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
