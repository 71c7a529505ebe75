"""parts/sharding.py: the wrapper's own training flag follows the LightningModule's (module mode); the default FSDP
units of a module holding containers."""

from __future__ import annotations

import torch
from torch import nn

from lightning_mgpu.parts.sharding import follow_module_mode, fsdp_unit_roots


class Wrapper(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_wrapper_left_in_eval_mode_follows_the_module_back_to_training():
    module = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    wrapper = Wrapper(module)
    wrapper.eval()  # Lightning's validation loop: trainer.model.eval()
    module.train()  # ... and afterwards it restores the LightningModule's mode only
    module[1].eval()  # a layer the user froze on purpose
    follow_module_mode(wrapper, module)
    assert wrapper.training
    assert not module[1].training, "the flag is set on the wrapper only, not recursively"


def test_wrapper_follows_eval_mode_and_nothing_happens_without_a_wrapper():
    module = nn.Linear(2, 2)
    wrapper = Wrapper(module)
    module.eval()
    follow_module_mode(wrapper, module)
    assert not wrapper.training
    follow_module_mode(module, module)
    follow_module_mode(None, module)
    assert not module.training


def test_state_outside_the_shards_goes_to_the_device_whole_including_a_metrics_states():
    """A validate/test/predict after fit under FSDP2: what FSDP does not own (buffers, and submodules such as a
    torchmetrics metric whose states are neither parameters nor buffers) is moved to the root device; a move of
    buffers alone left the metric's states behind (seen on CUDA: "Encountered different devices in metric
    calculation")."""
    import torchmetrics

    from lightning_mgpu.parts.sharding import ShardingBackend

    model = torch.nn.Module()
    model.metric = torchmetrics.MeanSquaredError()
    model.register_buffer("offset", torch.zeros(2))
    ShardingBackend.state_to_device(model, torch.device("meta"))
    assert model.offset.device.type == "meta"
    assert model.metric.sum_squared_error.device.type == "meta"  # the metric's own state, moved by its _apply


def test_default_units_are_the_members_of_containers_never_the_containers():
    # a ModuleList, a ModuleDict and a plain holder have no forward for FSDP's hooks: their members are the units
    holder = nn.Module()
    holder.inner = nn.Linear(2, 2)
    net = nn.Module()
    net.embed, net.empty, net.holder = nn.Embedding(4, 2), nn.ReLU(), holder
    net.layers = nn.ModuleList([nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2)])])
    net.heads = nn.ModuleDict({"a": nn.Linear(2, 2)})
    names = {id(m): n for n, m in net.named_modules()}
    assert [names[id(u)] for u in fsdp_unit_roots(net)] == [
        "embed",
        "holder.inner",
        "layers.0",
        "layers.1.0",
        "heads.a",
    ]
    # named classes are taken as they are
    assert [names[id(u)] for u in fsdp_unit_roots(net, (nn.Embedding,))] == ["embed"]
