"""The typed settings behind the strategies' keyword arguments (lightning_mgpu/settings.py)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
from torch import nn

from lightning_mgpu import MGPUDDPStrategy, MGPUShardedStrategy
from lightning_mgpu.settings import DDPSettings, ShardedSettings, check_keywords, split_ddp_kwargs


def test_a_single_wrap_modules_class_is_taken_as_a_one_element_list():
    assert ShardedSettings(wrap_modules=nn.Linear).wrap_modules == (nn.Linear,)  # type: ignore[arg-type]
    strategy = MGPUShardedStrategy(stage=3, wrap_modules=nn.Linear)  # type: ignore[arg-type]
    assert strategy.settings.wrap_modules == (nn.Linear,)


def test_ddp_keywords_of_torch_are_accepted_and_reach_distributed_data_parallel():
    strategy = MGPUDDPStrategy(bucket_cap_mb=10, broadcast_buffers=False)
    assert strategy.settings.all_ddp_kwargs == {
        "find_unused_parameters": False,
        "gradient_as_bucket_view": True,
        "bucket_cap_mb": 10,
        "broadcast_buffers": False,
    }


def test_ddp_keywords_at_their_default_count_as_not_given():
    """LightningCLI passes every DistributedDataParallel argument it finds, at its default value."""
    assert split_ddp_kwargs("S", {"dim": 0, "broadcast_buffers": None, "check_reduction": False}, []) == {}


def test_an_unknown_keyword_names_the_closest_valid_one():
    with pytest.raises(TypeError, match=r"'statc_graph' \(did you mean 'static_graph'\?\)"):
        check_keywords("MGPUDDPStrategy", ["statc_graph"], DDPSettings.keywords())


def test_settings_are_frozen_and_keep_the_values_given():
    settings = DDPSettings(comm_hook="fp16", timeout=timedelta(seconds=5))
    assert (settings.comm_hook, settings.timeout) == ("fp16", timedelta(seconds=5))
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.comm_hook = None  # type: ignore[misc]


def test_a_none_timeout_leaves_torch_its_default():
    assert DDPSettings(timeout=None).timeout is None


def test_the_hybrid_mesh_shards_within_a_machine_by_default_and_replicates_across():
    hybrid = ShardedSettings(stage=3, mesh="hybrid")
    assert hybrid.mesh_shape(world_size=4, num_nodes=2) == (2, 2)
    assert hybrid.mesh_shape(world_size=16, num_nodes=2) == (2, 8)
    assert hybrid.mesh_shape(world_size=4, num_nodes=1) == (1, 4)  # one machine: one replica
    assert ShardedSettings(stage=2, mesh="hybrid", shard_size=1).mesh_shape(4, 2) == (4, 1)
    assert ShardedSettings(stage=3, mesh="hybrid", shard_size=4).mesh_shape(8, 2) == (2, 4)
    assert ShardedSettings(stage=3).mesh_shape(world_size=4, num_nodes=2) == (1, 4)  # flat


def test_a_hybrid_mesh_that_cannot_be_built_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"5 ranks do not split evenly over num_nodes=2.*shard_size=N"):
        ShardedSettings(stage=3, mesh="hybrid").mesh_shape(world_size=5, num_nodes=2)
    with pytest.raises(ValueError, match=r"shard_size=3 does not divide the world size 4"):
        ShardedSettings(stage=3, mesh="hybrid", shard_size=3).mesh_shape(world_size=4, num_nodes=2)
