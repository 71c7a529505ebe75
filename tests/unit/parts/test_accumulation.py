"""parts/accumulation.py: the sync control (a context manager that blocks the gradient sync, does nothing when
disabled, and refuses a module that is not its wrapper), and manual optimization's gradient sync (each
optimizer's gradients averaged once, at its step)."""

from __future__ import annotations

import pytest
import torch
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu.ledger import CommStats
from lightning_mgpu.parts import accumulation as manual_sync
from lightning_mgpu.parts.accumulation import DDPSyncControl, FSDP2SyncControl, ManualGradientSync
from tests.parts_harness import in_one_rank_group


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


# --- the sync control: no_backward_sync on the DDP and FSDP2 wrappers ---


@pytest.mark.parametrize("control", [DDPSyncControl(), FSDP2SyncControl()], ids=["ddp", "fsdp2"])
def test_disabled_control_does_nothing_even_on_a_plain_module(control):
    module = nn.Linear(2, 2)
    with control.no_backward_sync(module, enabled=False):
        module(torch.ones(1, 2)).sum().backward()
    assert module.weight.grad is not None


@pytest.mark.parametrize("control", [DDPSyncControl(), FSDP2SyncControl()], ids=["ddp", "fsdp2"])
def test_enabled_control_refuses_a_module_that_is_not_its_wrapper(control):
    with pytest.raises(TypeError, match="Linear"):
        control.no_backward_sync(nn.Linear(2, 2), enabled=True)


def _ddp_sync_is_blocked_inside_and_restored_after() -> None:
    ddp = DistributedDataParallel(nn.Linear(2, 2))
    with DDPSyncControl().no_backward_sync(ddp, enabled=True):
        assert not ddp.require_backward_grad_sync
    assert ddp.require_backward_grad_sync


def test_ddp_sync_is_blocked_inside_and_restored_after():
    in_one_rank_group(_ddp_sync_is_blocked_inside_and_restored_after)


def _fsdp2_sync_is_blocked_inside_and_restored_after() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    fully_shard(model[0], mesh=init_device_mesh("cpu", (1,)))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    states = lambda: [m._get_fsdp_state()._fsdp_param_group.reduce_grads for m in (model, model[0])]  # noqa: E731
    with FSDP2SyncControl().no_backward_sync(model, enabled=True):
        assert states() == [False, False]
    assert states() == [True, True]


def test_fsdp2_sync_is_blocked_inside_and_restored_after():
    in_one_rank_group(_fsdp2_sync_is_blocked_inside_and_restored_after)
