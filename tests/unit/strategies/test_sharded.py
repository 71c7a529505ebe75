"""strategies/sharded.py in one process: what ``on_exception`` (Lightning's error handling) does at every stage."""

from __future__ import annotations

import pytest
from lightning_fabric.plugins.environments import LightningEnvironment

from lightning_mgpu import MGPUShardedStrategy
from lightning_mgpu.parts import failures


@pytest.mark.parametrize(
    "kwargs",
    [
        {"stage": 1},
        {"stage": 2},
        {"stage": 3},
        {"stage": 3, "pipeline_parallel_size": 2},
        {"stage": 3, "tensor_parallel_size": 2},
    ],
    ids=["stage1", "stage2", "stage3", "pipeline", "tensor"],
)
def test_a_failed_collective_names_the_rank_that_is_gone_at_every_stage(monkeypatch, kwargs):
    environment = LightningEnvironment()
    environment.set_world_size(2)
    environment.set_global_rank(0)
    strategy = MGPUShardedStrategy(cluster_environment=environment, **kwargs)
    # rank 0 of 2 in a process group (its store gone: the roll call finds no one)
    monkeypatch.setattr(failures, "group_is_up", lambda: True)
    error = RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")
    strategy.on_exception(error)
    assert str(error).startswith("lightning-mgpu: rank 1 of 2 is gone: its connection closed")
    assert str(error).endswith("original error: [gloo] Connection closed by peer [127.0.0.1]:1234")
