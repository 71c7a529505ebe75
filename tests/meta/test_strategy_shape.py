"""The strategies' shape: plain classes (no metaclass, nothing abstract cleared by hand), each a direct subclass of
its Lightning base (MRO = the base's + 1; a public subclass of one of ours: + 1 more), every overridden Lightning
method marked ``@override``, no method defined twice; one MGPUShardedStrategy for every stage, none of them DDP, and
no strategy module branches on the wrapper type."""

from __future__ import annotations

import ast
import contextlib
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
from pytorch_lightning.strategies import DDPStrategy, ParallelStrategy

from lightning_mgpu import (
    MGPUAutoStrategy,
    MGPUDDPStrategy,
    MGPUDiLoCoStrategy,
    MGPULocalSGDStrategy,
    MGPUShardedStrategy,
)
from lightning_mgpu.strategies.runtime import Runtime

STRATEGIES = Path(__file__).resolve().parents[2] / "lightning_mgpu" / "strategies"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_sharded_strategy_is_one_plain_class_for_every_stage(stage):
    strategy = MGPUShardedStrategy(stage=stage)
    assert type(strategy) is MGPUShardedStrategy
    assert type(type(strategy)) is type(ParallelStrategy)  # no metaclass of its own
    assert MGPUShardedStrategy.__abstractmethods__ == frozenset()  # concrete by itself, nothing cleared by hand
    assert isinstance(strategy, ParallelStrategy) and not isinstance(strategy, (DDPStrategy, MGPUDDPStrategy))
    assert isinstance(strategy._runtime, Runtime)
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


# Each public strategy: its Lightning base, or the public strategy of ours it extends (a variant that adds a part
# to the same hooks: the periodic sync, the plan of mgpu_auto).
BASES = {
    MGPUDDPStrategy: DDPStrategy,
    MGPUShardedStrategy: ParallelStrategy,
    MGPULocalSGDStrategy: MGPUDDPStrategy,
    MGPUDiLoCoStrategy: MGPUDDPStrategy,
    MGPUAutoStrategy: MGPUDDPStrategy,
}
LIGHTNING_BASES = (DDPStrategy, ParallelStrategy)


@pytest.mark.parametrize("cls", list(BASES), ids=lambda c: c.__name__)
def test_each_strategy_is_a_direct_subclass_of_its_base(cls):
    """MRO = the Lightning base's + 1 (+ 2 for a public subclass of one of ours): no mixin, no shared base of ours."""
    base = BASES[cls]
    assert cls.__mro__ == (cls, *base.__mro__), [c.__name__ for c in cls.__mro__]
    if base not in LIGHTNING_BASES:
        assert base.__mro__[1] in LIGHTNING_BASES


def _classes() -> list[tuple[Path, ast.ClassDef]]:
    return [
        (path, node)
        for path in sorted(STRATEGIES.glob("*.py"))
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ClassDef)
    ]


def _decorators(node: ast.FunctionDef) -> set[str]:
    names = set()
    for d in node.decorator_list:
        names.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return names


def _methods(node: ast.ClassDef) -> list[ast.FunctionDef]:
    return [f for f in node.body if isinstance(f, ast.FunctionDef)]


def _lightning_base(name: str) -> type | None:
    for cls in BASES:
        if cls.__name__ == name:
            base = BASES[cls]
            return base if base in LIGHTNING_BASES else _lightning_base(base.__name__)
    return None


def test_every_overridden_lightning_method_is_marked_override():
    """A method whose name Lightning's base has (a hook, a property, a setter) carries ``@override``, so that a
    rename in Lightning is caught by the type checker instead of silently never being called."""
    missing = []
    for path, node in _classes():
        base = _lightning_base(node.name)
        if base is None:
            continue
        for f in _methods(node):
            if f.name.startswith("__") or not hasattr(base, f.name):
                continue
            if "override" not in _decorators(f):
                missing.append(f"{path.name}:{f.lineno} {node.name}.{f.name}")
    assert missing == []


def test_the_check_above_sees_a_missing_override():
    """Negative control: a class of the same shape without the decorator is reported."""
    tree = ast.parse("class MGPUDDPStrategy:\n    def teardown(self):\n        pass\n")
    node = tree.body[0]
    assert isinstance(node, ast.ClassDef)
    f = _methods(node)[0]
    assert hasattr(_lightning_base(node.name), f.name) and "override" not in _decorators(f)


def _defined_twice(node: ast.ClassDef) -> list[str]:
    """Names defined twice in one class body (a property's setter is the same property)."""
    seen: dict[str, int] = {}
    twice = []
    for f in _methods(node):
        if "setter" in _decorators(f):
            continue
        if f.name in seen:
            twice.append(f"{node.name}.{f.name}")
        seen[f.name] = f.lineno
    return twice


def test_no_method_is_defined_twice():
    """Within a class, and between a class and the public strategy it extends: no method repeats another's body."""
    classes = _classes()
    assert [t for _, node in classes for t in _defined_twice(node)] == []
    bodies: dict[str, dict[str, str]] = {
        node.name: {f.name: ast.dump(ast.Module(body=f.body, type_ignores=[])) for f in _methods(node)}
        for _, node in classes
    }
    repeated = []
    for cls, base in BASES.items():
        mine, theirs = bodies.get(cls.__name__, {}), bodies.get(base.__name__, {})
        repeated += [f"{cls.__name__}.{n}" for n, body in mine.items() if theirs.get(n) == body]
    assert repeated == []


def test_the_check_above_sees_a_method_defined_twice():
    tree = ast.parse("class C:\n    def reduce(self): pass\n    def reduce(self): pass\n")
    node = tree.body[0]
    assert isinstance(node, ast.ClassDef) and _defined_twice(node) == ["C.reduce"]


_LAYOUT_NAMES = {
    "pipelined",
    "pipeline",
    "pipeline_parallel_size",
    "tensor",
    "tensor_parallel_size",
    "is_tensor_parallel",
}


def _layout_branches(source: str, name: str) -> list[str]:
    """The conditions (``if``, conditional expressions, ``and``/``or``) that read a layout's size, flag or part (an
    attribute: ``self._steps.pipelined``, ``settings.tensor_parallel_size``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            test = node.test
        elif isinstance(node, ast.BoolOp):
            test = node
        else:
            continue
        if {n.attr for n in ast.walk(test) if isinstance(n, ast.Attribute)} & _LAYOUT_NAMES:
            found.append(f"{name}:{node.lineno}")
    return found


def test_no_strategy_branches_on_the_pipeline_or_tensor_parallelism():
    """The step object (``parts/steps.py``) is chosen once at construction; no code in ``strategies/`` asks which
    layout it trains."""
    assert [hit for p in sorted(STRATEGIES.glob("*.py")) for hit in _layout_branches(p.read_text(), p.name)] == []


def test_the_check_above_sees_a_branch_on_the_pipeline():
    source = "def on_validation_start(self):\n    if self._steps.pipelined or exact:\n        start()\n"
    assert _layout_branches(source, "x.py") == ["x.py:2", "x.py:2"]
