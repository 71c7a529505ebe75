"""Activation checkpointing: BatchNorm-safe recompute, RNG, policies, and parity under our strategies.

Single-process tests use float64 and compare with ``torch.equal`` (the recompute replays the same ops, so
nothing may differ at all); multi-process tests run 2 gloo ranks launched by fork.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_ac
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_mgpu import (
    EveryNth,
    MGPUDDPStrategy,
    MGPUShardedStrategy,
    apply_activation_checkpointing,
    checkpointed_modules,
    remove_activation_checkpointing,
)
from tests.helpers import WORLD, fit, make_data
from tests.models import Block, BlockRegressor
from tests.parts_harness import in_forked_child

STEPS = 3


def block_net(width: int = 16, dropout: float = 0.2) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, width), Block(width, dropout), Block(width, dropout), Block(width, dropout), nn.Linear(width, 3)
    ).double()


def train(
    model: nn.Module, steps: int = STEPS, seed: int = 1, dtype: torch.dtype = torch.float64
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """``steps`` SGD steps on fixed data; returns the state_dict and the last step's gradients."""
    data = make_data(n=16 * steps, dtype=dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(seed)
    grads: list[torch.Tensor] = []
    for x, y in DataLoader(data, batch_size=16):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    return copy.deepcopy(model.state_dict()), grads


def assert_same_state(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    different = [k for k in expected if not torch.equal(actual[k], expected[k])]
    assert not different, f"differs from the run without checkpointing: {different}"


# --- BatchNorm safety -------------------------------------------------------------------------------------


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_state_dict_equals_run_without_checkpointing(reentrant):
    expected, expected_grads = train(block_net())
    model = block_net()
    assert apply_activation_checkpointing(model, Block, use_reentrant=reentrant) == ["1", "2", "3"]
    state, grads = train(model)
    assert_same_state(state, expected)  # running stats, num_batches_tracked, the blocks' call counters
    assert int(state["1.bn.num_batches_tracked"]) == STEPS
    for g, e in zip(grads, expected_grads):
        assert torch.equal(g, e)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_plain_torch_checkpointing_updates_batchnorm_twice(reentrant):
    """Negative control: torch's own wrapper fails the same comparison (pytorch issue 96136)."""
    expected, _ = train(block_net())
    impl = torch_ac.CheckpointImpl.REENTRANT if reentrant else torch_ac.CheckpointImpl.NO_REENTRANT
    model = block_net_with_torch_ac(impl)
    x = torch.randn(16, 6, dtype=torch.float64, requires_grad=reentrant)  # reentrant needs an input with grad
    model(x).sum().backward()
    bn = model[1]._checkpoint_wrapped_module.bn
    assert int(bn.num_batches_tracked) == 2
    state, _ = train(block_net_with_torch_ac(impl))
    with pytest.raises(AssertionError, match="running_mean"):
        assert_same_state(state, expected)


def block_net_with_torch_ac(impl: Any) -> nn.Module:
    model = block_net()
    torch_ac.apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=lambda m: torch_ac.checkpoint_wrapper(m, checkpoint_impl=impl),
        check_fn=lambda m: isinstance(m, Block),
    )
    return model


def test_momentum_none_cumulative_average_is_kept():
    """BatchNorm with momentum=None averages over num_batches_tracked: a double count would change it."""

    def net() -> nn.Module:
        model = block_net()
        for m in model.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.momentum = None
        return model

    expected, _ = train(net())
    model = net()
    apply_activation_checkpointing(model, Block)
    assert_same_state(train(model)[0], expected)


# --- recompute and memory -----------------------------------------------------------------------------------


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward (checkpointed blocks keep their inputs)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out.sum().backward()
    return sum(seen.values())


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_recompute_runs_the_block_again_and_saved_bytes_drop(reentrant):
    x = torch.randn(64, 6, dtype=torch.float64)
    plain = block_net(width=128)
    model = block_net(width=128)
    apply_activation_checkpointing(model, Block, use_reentrant=reentrant)
    calls = []
    model[2].linear.register_forward_hook(lambda *a: calls.append(1))
    baseline = saved_bytes(plain, x)
    measured = saved_bytes(model, x)
    assert len(calls) == 2, "the block's forward ran once: nothing was recomputed"
    assert measured < 0.5 * baseline, (measured, baseline)
    with torch.no_grad():  # evaluation: plain forward, no recompute
        calls.clear()
        model(x)
    assert len(calls) == 1


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_dropout_outputs_and_grads_equal_without_checkpointing(reentrant):
    x = torch.randn(32, 6, dtype=torch.float64)

    def run(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(7)
        out = model(x)
        out.pow(2).sum().backward()
        return out.detach(), [p.grad for p in model.parameters()]

    out, grads = run(block_net(dropout=0.5))
    model = block_net(dropout=0.5)
    apply_activation_checkpointing(model, Block, use_reentrant=reentrant)
    ck_out, ck_grads = run(model)
    assert torch.equal(ck_out, out)
    assert all(torch.equal(a, b) for a, b in zip(ck_grads, grads))
    # negative control: without restoring the RNG state the recompute draws other masks
    model = block_net(dropout=0.5)
    apply_activation_checkpointing(model, Block, use_reentrant=reentrant, preserve_rng_state=False)
    assert not all(torch.equal(a, b) for a, b in zip(run(model)[1], grads))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_bf16_autocast_matches_without_checkpointing(reentrant):
    def run(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        model = model.float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return train(model, dtype=torch.float32)

    expected, expected_grads = run(block_net())
    model = block_net()
    apply_activation_checkpointing(model, Block, use_reentrant=reentrant)
    state, grads = run(model)
    assert_same_state(state, expected)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads))


def test_torch_compile_keeps_batchnorm_state_and_saves_memory():
    """Under torch.compile (aot_eager here; inductor checked by hand, see docs/guides/activation-checkpointing.md)
    the model compiles to one graph, BatchNorm statistics equal the uncompiled run without checkpointing, and less
    is saved; a selective choice compiles to the same state. Runs in a forked child: what torch.compile leaves in a
    process (its caches, threads) stays out of this one, where later fork launches start."""
    in_forked_child(check_compile)


def check_compile() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    expected, expected_grads = train(block_net(dropout=0.0))
    model = block_net(dropout=0.0)
    apply_activation_checkpointing(model, Block)
    compiled = torch.compile(model, backend="aot_eager")
    explanation = torch._dynamo.explain(copy.deepcopy(model))(torch.randn(4, 6, dtype=torch.float64))
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)
    _, grads = train(compiled)
    state = model.state_dict()
    for k in expected:
        torch.testing.assert_close(state[k], expected[k])
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b)
    x = torch.randn(64, 6, dtype=torch.float64)
    plain = torch.compile(block_net(dropout=0.0), backend="aot_eager")
    assert saved_bytes(compiled, x) < saved_bytes(plain, x)
    # selective checkpointing is not applied under torch.compile (the block would run outside the graph and its
    # recompute update BatchNorm twice): compiled, a block with save= is recomputed whole, BatchNorm updated once
    selective = block_net(dropout=0.0)
    apply_activation_checkpointing(selective, Block, save="matmuls")
    train(torch.compile(selective, backend="aot_eager"))
    for k in expected:
        torch.testing.assert_close(selective.state_dict()[k], expected[k])


def test_a_buffer_the_forward_updates_is_updated_once():
    model = block_net()
    apply_activation_checkpointing(model, Block)
    train(model)
    assert [int(model[i].calls) for i in (1, 2, 3)] == [STEPS] * 3


# --- policies ---------------------------------------------------------------------------------------------


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(Block(16, 0.0) for _ in range(5))
        self.head = nn.Sequential(nn.Linear(16, 3))


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (Block, ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "blocks.4"]),
        ("Block", ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "blocks.4"]),
        ("tests.models.Block", ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "blocks.4"]),
        (
            {"Linear"},
            [
                "stem",
                "blocks.0.linear",
                "blocks.1.linear",
                "blocks.2.linear",
                "blocks.3.linear",
                "blocks.4.linear",
                "head.0",
            ],
        ),
        ([Block, nn.Linear], ["stem", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "blocks.4", "head.0"]),
        (lambda m: isinstance(m, nn.BatchNorm1d), [f"blocks.{i}.bn" for i in range(5)]),
        (EveryNth(2, container="blocks"), ["blocks.0", "blocks.2", "blocks.4"]),
        (EveryNth(3), ["blocks.0", "blocks.3", "head.0"]),
    ],
    ids=["class", "name", "dotted", "set", "mixed", "callable", "every2", "every3_all_containers"],
)
def test_policy_selects(policy, expected):
    model = Wrapper()
    assert apply_activation_checkpointing(model, policy) == expected
    assert checkpointed_modules(model) == expected


@pytest.mark.parametrize(
    ("policy", "error", "match"),
    [
        ("ConvBlock", ValueError, r"no module class named 'ConvBlock' in Wrapper.*\['BatchNorm1d', 'Block', 'Dropout'"),
        ("torch.nn.NoSuchLayer", ValueError, r"cannot import 'torch.nn.NoSuchLayer'"),
        (nn.TransformerEncoderLayer, ValueError, r"matches no module.*classes present are \['BatchNorm1d', 'Block'"),
        (lambda m: False, ValueError, r"matches no module"),
        (Wrapper, ValueError, r"matches the root module Wrapper.*Checkpoint its blocks"),
        ("Module", ValueError, r"'Module' matches the root module"),  # a base-class name matches like isinstance
        ([], ValueError, r"empty collection"),
        (EveryNth(1, container="head.0"), ValueError, r"is a Linear; it must name an nn.Sequential"),
        (EveryNth(1, container="trunk"), ValueError, r"has no such submodule.*\['blocks', 'head'\]"),
        (3, TypeError, r"activation_checkpointing=3 is not a policy"),
        ([Block, 3], TypeError, r"3 in .* is not a module class"),
        ("torch.optim.SGD", ValueError, r"not an nn.Module class"),
    ],
    ids=[
        "unknown_name",
        "bad_path",
        "no_match",
        "callable_no_match",
        "root",
        "root_by_base_class",
        "empty",
        "not_container",
        "no_container",
        "bad_type",
        "bad_item",
        "not_module",
    ],
)
def test_bad_policy_is_refused_with_the_classes_present(policy, error, match):
    with pytest.raises(error, match=match):
        apply_activation_checkpointing(Wrapper(), policy)


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_every_nth_needs_a_positive_int(n):
    with pytest.raises(ValueError, match=f"EveryNth\\(n={n!r}\\)"):
        EveryNth(n)


def test_remove_restores_and_apply_twice_does_not_nest():
    model = Wrapper()
    apply_activation_checkpointing(model, Block)
    apply_activation_checkpointing(model, Block, use_reentrant=True)
    calls = []
    model.blocks[0].linear.register_forward_hook(lambda *a: calls.append(1))
    model.blocks[0](torch.randn(4, 16)).sum().backward()
    assert len(calls) == 2  # one forward + one recompute, not two levels of checkpointing
    assert remove_activation_checkpointing(model) == 5
    assert checkpointed_modules(model) == [] and "forward" not in model.blocks[0].__dict__


def test_checkpointed_model_pickles_and_copies():
    """spawn launches pickle the LightningModule; deepcopy is used by EMA/SWA callbacks."""
    model = Wrapper()
    apply_activation_checkpointing(model, EveryNth(2, container="blocks"))
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert checkpointed_modules(clone) == ["blocks.0", "blocks.2", "blocks.4"]
        assert clone.blocks[0].forward.module is clone.blocks[0]


# --- through the Trainer, 2 ranks ---------------------------------------------------------------------------


def _states_equal(ranks: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    for r, e in zip(ranks, expected):
        assert_same_state(r["state"], e["state"])
        assert r["global_step"] == e["global_step"] > 0
    assert int(ranks[0]["state"]["net.1.bn.num_batches_tracked"]) == len(ranks[0]["batch_spy"])


@pytest.mark.parametrize(
    ("reentrant", "static_graph", "save"),
    [(False, False, None), (False, True, None), (True, False, None), (True, True, None), (False, False, 0.5)],
    ids=["non_reentrant-dynamic", "non_reentrant-static_graph", "reentrant-dynamic", "reentrant-static_graph",
         "selective_budget"],
)  # fmt: skip
def test_mgpu_ddp_with_accumulation_matches_no_checkpointing(tmp_path, reentrant, static_graph, save):
    def run(policy: Any, out: str) -> list[dict[str, Any]]:
        strategy = MGPUDDPStrategy(
            start_method="fork",
            static_graph=static_graph,
            activation_checkpointing=policy,
            activation_checkpointing_reentrant=reentrant,
            activation_checkpointing_save=save if policy is not None else None,
        )
        torch.manual_seed(3)
        return fit(BlockRegressor().double(), strategy, tmp_path / out, accumulate=2, max_epochs=1, grads=True)

    expected = run(None, "plain")
    ranks = run("Block", "checkpointed")
    _states_equal(ranks, expected)
    for r, e in zip(ranks, expected):  # every micro-batch's gradient, not only the final weights
        assert len(r["batch_grads"]) == len(e["batch_grads"]) > 2
        assert all(torch.equal(a, b) for a, b in zip(r["batch_grads"], e["batch_grads"]))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"stage": 1},
        {"stage": 2},
        {"stage": 3},
        {"stage": 3, "save": "matmuls"},
        {"stage": 2, "backend": "fairscale"},
    ],
    ids=["zero1", "stage2", "stage3", "stage3-selective", "fairscale2"],
)
def test_sharded_stages_match_no_checkpointing(tmp_path, kwargs):
    """Stage 3 keeps each block's matmuls (selective checkpointing): FSDP2's unshard stays outside the recompute."""
    kwargs = dict(kwargs)
    save = kwargs.pop("save", None)

    def run(policy: Any, out: str) -> list[dict[str, Any]]:
        torch.manual_seed(3)
        strategy = MGPUShardedStrategy(
            start_method="fork",
            activation_checkpointing=policy,
            activation_checkpointing_save=save if policy is not None else None,
            **kwargs,
        )
        return fit(BlockRegressor().double(), strategy, tmp_path / out, accumulate=2, max_epochs=1)

    _states_equal(run(EveryNth(1, container="net"), "checkpointed"), run(None, "plain"))


def test_bf16_mixed_under_mgpu_ddp_matches_no_checkpointing(tmp_path):
    def run(policy: Any, out: str) -> list[dict[str, Any]]:
        torch.manual_seed(3)
        strategy = MGPUDDPStrategy(start_method="fork", activation_checkpointing=policy)
        return fit(
            BlockRegressor(), strategy, tmp_path / out, dataset=make_data(dtype=torch.float32), precision="bf16-mixed"
        )

    _states_equal(run(Block, "checkpointed"), run(None, "plain"))


class _Listing(Callback):
    def __init__(self) -> None:
        self.during_fit: list[str] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.during_fit = checkpointed_modules(pl_module)


def test_strategy_checkpoints_during_fit_and_hands_the_module_back(tmp_path):
    model = BlockRegressor().double()
    listing = _Listing()
    strategy = MGPUDDPStrategy(activation_checkpointing=EveryNth(2, container="net"))
    try:
        fit(model, strategy, tmp_path, devices=1, max_epochs=1, callbacks=[listing])
    finally:
        # one in-process rank leaves a process group behind, which later fork launches would inherit and hang on
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        # Lightning set this process's intra-op threads for its one rank; later fork launches deadlock in
        # OpenMP unless the test process stays single-threaded (conftest.py)
        torch.set_num_threads(1)
    assert listing.during_fit == ["net.0", "net.2", "net.4"]
    assert checkpointed_modules(model) == []


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"activation_checkpointing": "torch.nn.Nope"}, ValueError, "cannot import 'torch.nn.Nope'"),
        ({"activation_checkpointing": 1.5}, TypeError, "is not a policy"),
        ({"activation_checkpointing": Block, "activation_checkpointing_reentrant": "yes"}, TypeError, "True or False"),
        (
            {
                "activation_checkpointing": Block,
                "activation_checkpointing_reentrant": True,
                "find_unused_parameters": True,
            },
            ValueError,
            "cannot run with find_unused_parameters=True.*activation_checkpointing_reentrant=False",
        ),
    ],
    ids=["bad_path", "bad_type", "bad_flag", "reentrant_find_unused"],
)
def test_bad_strategy_arguments_are_refused_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        MGPUDDPStrategy(**kwargs)
    with pytest.raises(error, match=match):
        MGPUShardedStrategy(stage=1, **kwargs) if "find_unused_parameters" in kwargs else MGPUShardedStrategy(**kwargs)


# --- SyncBatchNorm ------------------------------------------------------------------------------------------


def reference_sync_bn(model: nn.Module, global_batch: int, steps: int) -> dict[str, torch.Tensor]:
    """One process, plain BatchNorm over the global batch: what SyncBatchNorm on 2 ranks must reproduce."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=model.lr, momentum=0.9)
    for i, (x, y) in enumerate(DataLoader(make_data(), batch_size=global_batch)):
        if i == steps:
            break
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize(
    ("reentrant", "save"),
    [(False, None), (True, None), (False, "matmuls")],
    ids=["non_reentrant", "reentrant", "selective"],
)
def test_sync_batchnorm_matches_one_process_and_all_reduces_once(tmp_path, reentrant, save):
    """torch's SyncBatchNorm refuses CPU tensors; inside a checkpointed block ours runs on gloo, equals plain
    BatchNorm over the global batch in one process, and issues per step exactly one all-reduce per layer in
    forward and one in backward (the recompute replays the forward's statistics instead of a third).
    mgpu_sharded (FSDP2): torch's DDP refuses SyncBatchNorm on CPU modules at construction."""
    model = BlockRegressor(dropout=0.0).double()
    initial = copy.deepcopy(model)  # the launcher loads the trained weights back into `model`
    strategy = MGPUShardedStrategy(
        stage=2,
        start_method="fork",
        activation_checkpointing=Block,
        activation_checkpointing_reentrant=reentrant,
        activation_checkpointing_save=save,
    )
    ranks = fit(model, strategy, tmp_path, batch_size=4, max_epochs=1, sync_batchnorm=True, profile=True)
    steps = len(ranks[0]["batch_events"])
    expected = reference_sync_bn(initial, WORLD * 4, steps)
    layers = 3
    for r in ranks:
        assert set(r["state"]) == set(expected)
        for k in expected:
            torch.testing.assert_close(r["state"][k], expected[k], msg=k)
        assert int(r["state"]["net.1.bn.num_batches_tracked"]) == steps > 2
        for events, reductions in zip(r["batch_events"], r["batch_ledger_calls"]):
            assert reductions >= 1  # FSDP2's gradient reduce-scatters (gloo runs them as all-reduces)
            assert events["gloo:all_reduce"] == 2 * layers + reductions


def test_sync_batchnorm_on_cpu_with_ddp_is_refused_before_launch(tmp_path):
    strategy = MGPUDDPStrategy(start_method="fork", activation_checkpointing=Block)
    with pytest.raises(MisconfigurationException, match=r"sync_batchnorm=True.*CPU.*mgpu_sharded"):
        fit(BlockRegressor().double(), strategy, tmp_path, sync_batchnorm=True)
