"""parts/sharding.py (module mode): the wrapper's own training flag follows the LightningModule's."""

from __future__ import annotations

import torch
from torch import nn

from lightning_mgpu.parts.sharding import follow_module_mode


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
