"""The device mesh's sizes (``lightning_mgpu/mesh.py``): checked together against the world size, each error naming
the value to change and a corrected call that builds; and the mesh itself in one process."""

from __future__ import annotations

import re
import tempfile
import warnings

import pytest
import torch.distributed as dist

from lightning_mgpu.mesh import DATA_PARALLEL, TENSOR_PARALLEL, ParallelDims, ParallelMesh
from lightning_mgpu.settings import ShardedSettings
from tests.parts_harness import in_forked_child


def _suggested_call(message: str) -> ParallelDims:
    """The corrected call an error names, built as the user would paste it."""
    calls = re.findall(r"ParallelDims\([^)]*\)", message)
    return eval(calls[-1], {"ParallelDims": ParallelDims})  # the last call in the message is the fix


def test_data_shard_takes_the_ranks_the_other_dimensions_leave():
    assert ParallelDims(world_size=8).data_shard == 8
    hsdp = ParallelDims(world_size=16, data_replicate=2)
    assert (hsdp.data_replicate, hsdp.data_shard, hsdp.data_parallel, hsdp.is_hybrid) == (2, 8, 16, True)
    future = ParallelDims(world_size=16, data_replicate=2, tensor=2, pipeline=2)
    assert future.data_shard == 2
    assert future.names == ("pipeline", "data_parallel", "tensor_parallel")
    assert future.shape == (2, 4, 2)


def test_the_mesh_has_lightnings_dimension_names_with_tensor_parallel_of_size_one():
    dims = ParallelDims(world_size=4, data_replicate=2, data_shard=2)
    assert dims.names == (DATA_PARALLEL, TENSOR_PARALLEL) == ("data_parallel", "tensor_parallel")
    assert dims.shape == (4, 1)
    assert not ParallelDims(world_size=4).is_hybrid


def test_hsdp_is_one_shape_of_the_mesh():
    assert ParallelDims.hybrid(16, num_nodes=2) == ParallelDims(world_size=16, data_replicate=2, data_shard=8)
    assert ParallelDims.hybrid(8, num_nodes=2, shard_size=4) == ParallelDims(world_size=8, data_replicate=2)
    assert ParallelDims.hybrid(4, num_nodes=1).data_replicate == 1  # one machine: one replica, flat
    # the strategy's settings give the same shapes (its options: mesh="hybrid", shard_size)
    assert ShardedSettings(stage=3, mesh="hybrid").parallel_dims(16, 2) == ParallelDims.hybrid(16, 2)
    assert ShardedSettings(stage=3).parallel_dims(16, 2) == ParallelDims(world_size=16)


def test_sizes_that_do_not_multiply_to_the_world_size_name_data_shard_and_the_corrected_call():
    with pytest.raises(ValueError) as info:
        ParallelDims(world_size=8, data_replicate=2, data_shard=3)
    message = str(info.value)
    assert "2 x 3 x 1 x 1 = 6 ranks, but the world size is 8" in message
    assert "data_shard must be 8 // 2 = 4" in message
    fixed = _suggested_call(message)
    assert fixed == ParallelDims(world_size=8, data_replicate=2, data_shard=4)


@pytest.mark.parametrize(
    ("given", "changed"),
    [
        ({"world_size": 8, "data_replicate": 3}, "data_replicate=3 to 1"),
        ({"world_size": 12, "data_replicate": 8, "tensor": 3}, "data_replicate=8 to 4"),
        ({"world_size": 6, "tensor": 4, "pipeline": 4}, "pipeline=4 to 2 and tensor=4 to 1"),
    ],
)
def test_sizes_that_do_not_divide_the_world_size_name_the_values_to_change_and_a_call_that_builds(given, changed):
    with pytest.raises(ValueError) as info:
        ParallelDims(**given)
    message = str(info.value)
    assert f"does not divide the world size {given['world_size']}" in message
    assert f"Change {changed} so that the product divides" in message
    fixed = _suggested_call(message)  # builds: the sizes it names multiply to the world size
    assert fixed.world_size == given["world_size"]
    assert fixed.data_replicate * fixed.data_shard * fixed.tensor * fixed.pipeline == given["world_size"]


@pytest.mark.parametrize(
    ("given", "fragment"),
    [
        ({"world_size": 0}, "world_size=0 must be a whole number of ranks >= 1"),
        ({"world_size": 4, "tensor": 0}, "tensor=0"),
        ({"world_size": 4, "pipeline": True}, "pipeline=True"),
        ({"world_size": 4, "data_replicate": "2"}, "data_replicate='2'"),
        ({"world_size": 4, "data_shard": 0}, "data_shard=0 must be a whole number of ranks >= 1, or -1"),
    ],
)
def test_a_size_that_is_not_a_number_of_ranks_is_refused(given, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        ParallelDims(**given)


def test_a_hybrid_shape_that_cannot_be_built_names_the_fix():
    with pytest.raises(ValueError, match=r"5 ranks do not split evenly over num_nodes=2.*shard_size=N"):
        ParallelDims.hybrid(5, num_nodes=2)
    with pytest.raises(ValueError, match=r"shard_size=3 does not divide the world size 4.*e\.g\. the processes"):
        ParallelDims.hybrid(4, num_nodes=2, shard_size=3)


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_built_mesh_reads_as_lightnings_and_warns_of_nothing(one_process_group):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns where a flattened dimension is sliced from the root mesh
        built = ParallelDims(world_size=1).build("cpu")
        assert isinstance(built, ParallelMesh)
        assert built.device_mesh.mesh_dim_names == ("data_parallel", "tensor_parallel")
        assert built.device_mesh["data_parallel"].size() == built.device_mesh["tensor_parallel"].size() == 1
        assert built.data.mesh_dim_names == ("data_parallel",)  # flat: FSDP2 shards over all data-parallel ranks


def test_the_strategys_mesh_read_before_set_up_says_where_to_read_it():
    from lightning_mgpu import MGPUShardedStrategy

    with pytest.raises(RuntimeError, match=r"built at set-up.*configure_model \(self\.device_mesh\)"):
        MGPUShardedStrategy(stage=3).device_mesh  # noqa: B018


def test_coordinates_index_every_dimension_with_the_tensor_dimension_fastest():
    dims = ParallelDims(world_size=16, data_replicate=2, tensor=2, pipeline=2)  # data_shard = 2
    seen = set()
    for rank in range(16):
        c = dims.coordinates(rank)
        data = c["data_replicate"] * dims.data_shard + c["data_shard"]
        assert c["data_parallel"] == data
        assert rank == (c["pipeline"] * dims.data_parallel + data) * dims.tensor + c["tensor_parallel"]
        seen.add(tuple(c.values()))
    assert len(seen) == 16  # every rank its own place
    assert ParallelDims(world_size=4, tensor=2).coordinates(2) == {
        "pipeline": 0, "data_parallel": 1, "data_replicate": 0, "data_shard": 1, "tensor_parallel": 0,
    }  # fmt: skip
    with pytest.raises(ValueError, match="rank=4 is not a global rank"):
        ParallelDims(world_size=4).coordinates(4)


def test_the_hybrid_shape_with_a_tensor_dimension_shards_the_data_ranks_of_a_machine():
    dims = ParallelDims.hybrid(world_size=16, num_nodes=2, tensor=2)
    assert (dims.data_replicate, dims.data_shard, dims.tensor) == (2, 4, 2)
    assert ParallelDims.hybrid(world_size=4, shard_size=1, tensor=2).data_replicate == 2


def test_the_hybrid_shape_with_pipeline_stages_shards_the_data_ranks_of_a_stage_within_a_machine():
    # 4 machines of 4: each stage spans 2 machines, so 2 replicas of 4 shards
    assert ParallelDims.hybrid(world_size=16, num_nodes=4, pipeline=2).data_replicate == 2
    # one machine holds a whole stage's data ranks: one replica, unless shard_size says otherwise
    assert ParallelDims.hybrid(world_size=8, num_nodes=2, pipeline=2).data_replicate == 1
    assert ParallelDims.hybrid(world_size=8, shard_size=2, pipeline=2).data_replicate == 2
    settings = ShardedSettings(stage=3, mesh="hybrid", shard_size=1, pipeline_parallel_size=2)
    assert settings.parallel_dims(world_size=4) == ParallelDims(world_size=4, data_replicate=2, pipeline=2)
    with pytest.raises(ValueError, match=r"shard_size=3 does not divide the 4 data ranks of each pipeline stage"):
        ParallelDims.hybrid(world_size=8, shard_size=3, pipeline=2)


def test_the_ranks_of_one_pipeline_share_their_data_index():
    flat = ParallelDims(world_size=4, pipeline=2)
    assert [flat.coordinates(r)["data_parallel"] for r in range(4)] == [0, 1, 0, 1]
    assert [flat.coordinates(r)["pipeline"] for r in range(4)] == [0, 0, 1, 1]
    # pipeline x data x tensor (the tensor dimension innermost): the ranks of one pipeline share their data and
    # tensor coordinates, so that each stage sends to the rank holding the same shards in the next stage
    split = ParallelDims(world_size=8, pipeline=2, tensor=2)
    assert (split.names, split.shape) == (("pipeline", "data_parallel", "tensor_parallel"), (2, 2, 2))
    coordinates = [split.coordinates(r) for r in range(8)]
    assert [(c["pipeline"], c["data_parallel"], c["tensor_parallel"]) for c in coordinates] == [
        (p, d, t) for p in range(2) for d in range(2) for t in range(2)
    ]


def _hybrid_meshes() -> None:
    from lightning_mgpu.planning.measure import fake_process_group

    with fake_process_group(8, rank=5):
        hybrid = ParallelDims(world_size=8, data_replicate=2).build("cpu")
        assert hybrid.data.mesh_dim_names == ("data_replicate", "data_shard") and hybrid.data.size() == 8
        split = ParallelDims(world_size=8, data_replicate=2, tensor=2).build("cpu")
        assert split.data.mesh_dim_names == ("data_replicate", "data_shard") and split.data.size() == 4
        assert split.tensor.size() == 2 and split.device_mesh[TENSOR_PARALLEL].size() == 2
        # HSDP inside a pipeline: rank 5 is in stage 1, its data ranks 4-7 split into 2 replicas of 2 shards
        staged = ParallelDims(world_size=8, data_replicate=2, pipeline=2).build("cpu")
        assert staged.data.mesh_dim_names == ("data_replicate", "data_shard") and staged.data.size() == 4
        assert staged.data.mesh.flatten().tolist() == [4, 5, 6, 7]


@pytest.mark.compat
def test_a_hybrid_mesh_is_built_on_every_declared_torch():
    """The hybrid split of the data dimension (``_compat.unflatten_mesh``), flat and beside a tensor dimension, on
    torch's fake process group of 8 ranks, in a forked child (the groups must not reach later forked tests).
    torch 2.11 refused the dimension by name; the compatibility tiers run this on the oldest and newest torch."""
    in_forked_child(_hybrid_meshes, timeout=120)
