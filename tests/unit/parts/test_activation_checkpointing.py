"""parts/activation_checkpointing.py: checked before launch, applied before wrapping, removed at teardown."""

from __future__ import annotations

import copy
import pickle
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_mgpu import MGPUDDPStrategy, apply_activation_checkpointing, checkpointed_modules
from lightning_mgpu.parts.activation_checkpointing import ActivationCheckpointing, budget_choice
from tests.models import Block, BlockRegressor


def test_a_policy_matching_no_module_is_refused_by_the_check():
    with pytest.raises(ValueError, match="'ConvBlock'"):
        ActivationCheckpointing("ConvBlock").check(BlockRegressor())


def test_apply_then_remove_gives_the_module_back_unchanged():
    module = BlockRegressor(blocks=2)
    part = ActivationCheckpointing("Block")
    part.apply(module)
    assert checkpointed_modules(module) == ["net.1", "net.2"]
    part.remove(module)
    assert checkpointed_modules(module) == []


def test_no_policy_does_nothing():
    module = BlockRegressor(blocks=1)
    part = ActivationCheckpointing(None)
    part.check(module)
    part.apply(module)
    assert checkpointed_modules(module) == []


# --- selective checkpointing: what a checkpointed block keeps ---------------------------------------------


def _block_net(width: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, width), Block(width, 0.2), Block(width, 0.2), nn.Linear(width, 3)).double()


def _train(model: nn.Module, steps: int = 3) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(2)
    torch.manual_seed(1)  # dropout
    for _ in range(steps):
        x = torch.randn(16, 6, generator=g, dtype=torch.float64)
        y = torch.randn(16, 3, generator=g, dtype=torch.float64)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return copy.deepcopy(model.state_dict())


class _Ops(TorchDispatchMode):
    """Counts the operators run, and the storages made (weakly: what is still alive after the forward is held
    for backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}
        self.made: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.calls[name] = self.calls.get(name, 0) + 1
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.made.append(weakref.ref(t.untyped_storage()))
        return out


def _held_bytes_and_backward_matmuls(model: nn.Module) -> tuple[int, int]:
    """Bytes of the storages the forward made that live until backward, and the addmm calls backward runs (its
    own gradient matmuls are mm: an addmm in backward is a recompute of a forward one)."""
    x = torch.randn(32, 6, dtype=torch.float64)
    forward = _Ops()
    with forward:
        out = model(x)
    held = sum({s.data_ptr(): s.nbytes() for r in forward.made if (s := r()) is not None}.values())
    backward = _Ops()
    with backward:
        out.sum().backward()
    return held, backward.calls.get("addmm", 0)


@pytest.mark.parametrize(
    "save", ["matmuls", ["addmm", "relu"], 0.3, 0.9], ids=["matmuls", "ops", "budget0.3", "budget0.9"]
)
def test_selective_checkpointing_trains_exactly_as_without_and_updates_batchnorm_once(save):
    expected = _train(_block_net())
    model = _block_net()
    assert apply_activation_checkpointing(model, Block, save=save) == ["1", "2"]
    state = _train(model)
    assert state.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(state[k], expected[k])] == []
    assert int(state["1.bn.num_batches_tracked"]) == int(state["1.calls"]) == 3


def test_kept_matmuls_are_not_recomputed_and_the_budget_orders_memory():
    """Whole-block checkpointing recomputes both blocks' addmm in backward and holds the least; keeping the
    matmuls recomputes none of them and holds more, still less than no checkpointing; a memory budget holds
    more as it grows (its first training forward measures and keeps nothing)."""
    held: dict[str, int] = {}
    for name, save in [("none", None), ("whole", None), ("matmuls", "matmuls"), ("b0.3", 0.3), ("b0.9", 0.9)]:
        model = _block_net()
        if name != "none":
            apply_activation_checkpointing(model, Block, save=save)
        first, first_recomputed = _held_bytes_and_backward_matmuls(model)
        held[name], recomputed = _held_bytes_and_backward_matmuls(model)
        if name == "none":
            assert recomputed == 0
        elif name in ("whole", "b0.3", "b0.9"):
            assert first_recomputed == 2  # nothing kept while measuring: both blocks' addmm run again
        if name in ("whole",):
            assert recomputed == 2 and held[name] == first
        if name in ("matmuls", "b0.3", "b0.9"):
            assert recomputed == 0, name  # the addmm outputs were kept (the budget keeps the costliest first)
    assert held["whole"] < held["b0.3"] <= held["matmuls"] < held["none"], held
    assert held["b0.3"] < held["b0.9"], held


def test_a_budget_keeps_the_costliest_per_byte_first_within_the_budget():
    mm, add, relu = object(), object(), object()
    costs = {add: [100.0, 25.0], mm: [100.0, 6400.0], relu: [200.0, 50.0]}  # operator -> [bytes, cost]
    assert budget_choice(costs, 0.25) == {mm}  # 100 of 400 bytes
    assert budget_choice(costs, 0.5) == {mm, add}  # relu (200 bytes) would pass 200; add fits
    assert budget_choice(costs, 0.2) == set()


@pytest.mark.parametrize(
    ("save", "reentrant", "error", "match"),
    [
        ("matmul", False, ValueError, r"'matmul' is unknown: pass 'matmuls'"),
        (["mm", "no_such_op"], False, ValueError, r"'no_such_op' is not a torch aten operator"),
        (1.0, False, ValueError, r"budget outside \(0, 1\)"),
        (0.0, False, ValueError, r"budget outside \(0, 1\)"),
        ([], False, ValueError, r"must list operator names"),
        (True, False, TypeError, r"is not a choice"),
        ("matmuls", True, ValueError, r"needs the non-reentrant mode"),
    ],
)
def test_bad_save_choices_are_refused_by_the_strategy_and_the_function(save, reentrant, error, match):
    with pytest.raises(error, match=match):
        MGPUDDPStrategy(
            activation_checkpointing=Block, activation_checkpointing_save=save,
            activation_checkpointing_reentrant=reentrant,
        )  # fmt: skip
    with pytest.raises(error, match=match):
        apply_activation_checkpointing(_block_net(), Block, save=save, use_reentrant=reentrant)


def test_a_selective_model_pickles_with_its_choice_for_a_spawn_launch():
    """A spawn launch pickles the module: torch's operators do not pickle, so the choice travels by name."""
    model = _block_net()
    apply_activation_checkpointing(model, Block, save=0.5)
    _train(model, steps=1)  # the budget's choice is made
    chosen = model[1].forward.selection.ops
    assert chosen and torch.ops.aten.addmm in chosen
    clone = pickle.loads(pickle.dumps(model))
    assert clone[1].forward.selection.ops == chosen and clone[1].forward.module is clone[1]
    assert torch.equal(_train(clone)["1.linear.weight"], _train(model)["1.linear.weight"])
