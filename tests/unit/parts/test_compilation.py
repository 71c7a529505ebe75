"""The compilation part without a Trainer: what it compiles, that module and state-dict keys stay, that it composes
with activation checkpointing (float64, the same values and gradients as eager) and that teardown undoes it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_mgpu import apply_activation_checkpointing
from lightning_mgpu.parts.compilation import Compilation, compile_forward, compiled_modules, remove_compilation
from lightning_mgpu.settings import CommonSettings
from tests.models import Block, BlockRegressor, Regressor

FAST = {"backend": "aot_eager"}  # AOTAutograd's forward/backward graphs, run eagerly: no C++ build


class NoForward(Regressor):
    """A LightningModule without a ``forward`` of its own (``training_step`` calls ``self.net``)."""

    forward = Regressor.__mro__[1].forward  # type: ignore[assignment]  # LightningModule's stub


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(8, 2, 16, 0.0, batch_first=True) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


def test_compile_forward_keeps_the_module_and_its_state_dict_keys_and_teardown_restores_eager():
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    keys = list(net.state_dict())
    x = torch.randn(5, 3, dtype=torch.float64)
    expected = net(x)
    assert compile_forward(net, {"backend": "eager"})
    assert not compile_forward(net, {"backend": "eager"})  # already compiled: left as it is
    assert compiled_modules(net) == [""]
    assert list(net.state_dict()) == keys  # no "_orig_mod." prefix
    torch.testing.assert_close(net(x), expected)
    assert remove_compilation(net) == 1
    assert "forward" not in net.__dict__ and compiled_modules(net) == []


def test_compiled_checkpointed_block_matches_eager_values_gradients_and_batchnorm_statistics():
    torch.manual_seed(0)
    eager = nn.Sequential(Block(6, 0.0), Block(6, 0.0)).double()
    compiled = copy.deepcopy(eager)
    for m in (eager, compiled):
        apply_activation_checkpointing(m, {Block})
    for block in compiled:
        compile_forward(block, FAST)
    x = torch.randn(8, 6, dtype=torch.float64)
    for _ in range(2):  # the second call reuses the compiled graph
        for m in (eager, compiled):
            m.zero_grad()
            m(x).square().sum().backward()
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    torch.testing.assert_close(compiled.state_dict(), eager.state_dict())  # running statistics updated once a call
    # removal gives back activation checkpointing's forward, which its own removal then undoes
    assert remove_compilation(compiled) == 2
    assert all(type(b.__dict__["forward"]).__name__ == "_CheckpointedForward" for b in compiled)


def test_negative_control_a_perturbed_weight_fails_the_gradient_comparison():
    torch.manual_seed(0)
    eager = Block(6, 0.0).double()
    compiled = copy.deepcopy(eager)
    with torch.no_grad():
        compiled.linear.weight[0, 0] += 1e-6
    compile_forward(compiled, FAST)
    x = torch.randn(8, 6, dtype=torch.float64)
    for m in (eager, compiled):
        m(x).square().sum().backward()
    with pytest.raises(AssertionError):
        torch.testing.assert_close(compiled.linear.weight.grad, eager.linear.weight.grad)


def test_ddp_compiles_the_lightning_module_forward_or_its_blocks_without_one():
    part = Compilation(CommonSettings(compile={"backend": "eager"}).compile)
    model = Regressor()
    assert part.compile_model(model) == [""]
    assert list(model.state_dict()) == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    part.remove(model)
    assert compiled_modules(model) == []
    assert part.compile_model(NoForward()) == ["net"]  # the direct children with parameters


def test_sharded_stages_compile_each_block_of_the_fsdp_unit_rule():
    part = Compilation(True)
    encoder = Encoder()
    assert part.compile_blocks(encoder, None) == ["layers.0", "layers.1"]  # the transformer layers
    assert Compilation(True).compile_blocks(BlockRegressor(), (Block,)) == ["net.1", "net.2", "net.3"]


def test_compile_false_does_nothing():
    part = Compilation(False)
    model = Regressor()
    assert not part.enabled
    assert part.compile_model(model) == [] and part.compile_blocks(model, None) == []
    assert "forward" not in model.__dict__


def test_the_graph_counter_sees_a_recompilation():
    """The counter the integration tests read: a new input shape (``dynamic=False``) compiles another graph."""
    from lightning_mgpu import _compat

    torch.compiler.reset()
    net = nn.Linear(3, 2)
    compile_forward(net, {"backend": "eager", "dynamic": False})
    before = _compat.compiled_graph_count()
    net(torch.randn(4, 3))
    net(torch.randn(4, 3))
    once = _compat.compiled_graph_count()
    net(torch.randn(5, 3))
    assert once - before == 1 and _compat.compiled_graph_count() - once == 1


def test_a_copy_of_a_compiled_model_runs_its_own_weights_compiled():
    """``copy.deepcopy`` (weight averaging callbacks) and pickling give a module whose forward is compiled on the
    copy, not a call into the original's graph."""
    import pickle

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 2)).double()
    compile_forward(net[0], {"backend": "eager"})
    x = torch.randn(4, 3, dtype=torch.float64)
    for clone in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        with torch.no_grad():
            clone[0].weight.add_(1.0)
        assert compiled_modules(clone) == ["0"]
        torch.testing.assert_close(clone(x), x @ clone[0].weight.T + clone[0].bias)
        assert not torch.allclose(clone(x), net(x))


def test_the_compile_option_runs_self_log_eagerly_and_teardown_restores_lightnings(monkeypatch):
    """With ``compile=...`` the LightningModule's ``log`` is Lightning's, run outside compiled graphs: the call reaches
    Lightning's method with its arguments, a copy of the module logs through its own ``log``, and teardown puts
    Lightning's back. ``compile=False`` leaves ``log`` alone (the negative control)."""
    calls: list[tuple[int, str, float]] = []
    monkeypatch.setattr(Regressor, "log", lambda self, name, value, **kw: calls.append((id(self), name, value)))
    module = Regressor().double()
    Compilation(False).compile_model(module)
    assert "log" not in module.__dict__
    part = Compilation(FAST)
    part.compile_model(module)
    assert "log" in module.__dict__
    module.log("loss", 1.5)
    twin = copy.deepcopy(module)
    twin.log("loss", 2.5)
    assert calls == [(id(module), "loss", 1.5), (id(twin), "loss", 2.5)]
    part.remove(module)
    assert "log" not in module.__dict__ and compiled_modules(module) == []


def test_a_model_compiled_by_the_user_logs_eagerly_without_the_compile_option():
    """``trainer.fit(torch.compile(model))``: Lightning compiles the model's ``training_step``, which calls
    ``self.log``; with ``compile=False`` the strategy still runs ``log`` outside compiled graphs (the same path as
    ``compile=...``), compiles nothing itself, and teardown puts Lightning's ``log`` back."""
    from pytorch_lightning.utilities.compile import from_compiled

    module = from_compiled(torch.compile(Regressor().double(), **FAST))
    part = Compilation(False)
    assert part.compile_model(module) == []
    assert "log" in module.__dict__
    part.remove(module)
    assert "log" not in module.__dict__
    sharded = from_compiled(torch.compile(Regressor().double(), **FAST))
    assert Compilation(False).compile_blocks(sharded, None) == [] and "log" in sharded.__dict__
