"""parts/manual_sync.py: manual optimization averages each optimizer's gradients once, at its step."""

from __future__ import annotations

import pytest
import torch
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_mgpu.comm import CommStats
from lightning_mgpu.parts import accumulation as manual_sync
from lightning_mgpu.parts.accumulation import ManualGradientSync


def _setup() -> tuple[ManualGradientSync, torch.optim.Optimizer, nn.Module]:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = ManualGradientSync(compress=None)
    sync.setup([opt], world_size=2)
    return sync, opt, model


def test_a_raw_optimizer_step_outside_the_strategys_step_is_refused():
    sync, opt, _ = _setup()
    with pytest.raises(MisconfigurationException, match=r"SGD.step\(\) was called on the raw torch optimizer"):
        opt.step()
    with sync.stepping():
        opt.step()
    sync.teardown()
    opt.step()  # the guard is gone after teardown


def test_an_optimizer_not_from_configure_optimizers_is_refused():
    sync, _, model = _setup()
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(MisconfigurationException, match="not returned by configure_optimizers"):
        sync.wrap_closure(other, lambda: None, None, CommStats())


def test_frozen_parameters_are_not_synced_and_each_optimizer_syncs_once_per_step(monkeypatch):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = ManualGradientSync(compress="fp16", bucket_cap_mb=5.0)
    sync.setup([opt], world_size=2)
    calls: list[tuple[list[torch.Tensor], dict]] = []
    monkeypatch.setattr(manual_sync, "allreduce_gradients", lambda params, **kw: calls.append((params, kw)))
    ledger = CommStats()
    with sync.stepping():
        closure = sync.wrap_closure(opt, lambda: "loss", "group", ledger)
        assert closure() == "loss"
        sync.sync(opt, "group", ledger)  # e.g. clip_gradients asked first: no second all-reduce
    assert len(calls) == 1
    params, kwargs = calls[0]
    assert [id(p) for p in params] == [id(model[1].weight), id(model[1].bias)]
    assert kwargs == {"group": "group", "compress": "fp16", "ledger": ledger, "bucket_cap_mb": 5.0}
    with sync.stepping():
        sync.sync(opt, "group", ledger)  # the next step syncs again
    assert len(calls) == 2
