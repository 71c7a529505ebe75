"""parts/sharding.py (module mode): the wrapper's own training flag follows the LightningModule's."""

from __future__ import annotations

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
