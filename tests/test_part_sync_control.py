"""parts/sync_control.py: a context manager that blocks the gradient sync, does nothing when disabled, and
refuses a module that is not its wrapper."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu.parts.accumulation import DDPSyncControl, FSDP2SyncControl
from tests.parts_harness import in_one_rank_group


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
