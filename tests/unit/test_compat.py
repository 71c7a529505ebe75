"""What ``lightning_mgpu/_compat.py`` does to torch's state where no Lightning object is involved: the DTensor caches a
forked rank must not inherit from its parent."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_mgpu._compat import forget_inherited_dtensor_caches
from lightning_mgpu.planning.measure import fake_process_group
from tests.parts_harness import in_forked_child

ROWS = 5  # over a 2 x 2 mesh: 3 rows on mesh row 0 (then 2 and 1), 2 on mesh row 1 (then 1 and 1)


def _nested_uneven(rank: int) -> Any:
    """Rank ``rank`` of a fake 4-rank group: a ``ROWS`` x 2 tensor sharded by rows over both dimensions of a 2 x 2
    mesh, and the spec of its replicated whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    mesh = init_device_mesh("cpu", (2, 2))
    local_rows = [2, 1, 1, 1][rank]
    tensor = DTensor.from_local(
        torch.zeros(local_rows, 2), mesh, [Shard(0), Shard(0)], run_check=False, shape=(ROWS, 2), stride=(2, 1)
    )
    whole = DTensorSpec(mesh, (Replicate(), Replicate()), tensor_meta=tensor._spec.tensor_meta)
    return tensor, whole


def _plans_of_rank_3(forget: bool) -> tuple[list, list]:
    """In a child: rank 0 redistributes (the plan is cached), then a fork of it is rank 3 and asks the cached plan
    and a fresh one for the same redistribution: the row counts each step gathers."""

    def parent() -> tuple[list, list]:
        with fake_process_group(4, rank=0):
            tensor, _ = _nested_uneven(0)
            tensor.full_tensor()  # the plan for rank 0's coordinate (0, 0) is cached

        def rank_3() -> tuple[list, list]:
            from torch.distributed.tensor._redistribute import _gen_transform_infos, _gen_transform_infos_non_cached

            with fake_process_group(4, rank=3):
                if forget:
                    forget_inherited_dtensor_caches()
                tensor, whole = _nested_uneven(3)
                cached = _gen_transform_infos(tensor._spec, whole)
                fresh = _gen_transform_infos_non_cached(tensor._spec, whole)
                return [list(i.logical_shape) for i in cached], [list(i.logical_shape) for i in fresh]

        assert not dist.is_initialized()
        return in_forked_child(rank_3, timeout=60)

    return in_forked_child(parent, timeout=60)


def test_a_forked_rank_forgets_redistribution_plans_made_at_the_parents_coordinate():
    """The plan to gather a nested, uneven shard is cached with the chunk sizes of the rank that made it, keyed by
    layout-equal specs (the plan) and by a layout-equal mesh (its planner, which even an uncached plan reuses): rank 3
    (coordinate (1, 1)) first gathers its mesh row's 2 rows, rank 0 its 3. Forgotten, rank 3 plans its own; kept (the
    negative control), both ways of asking give rank 0's 3 rows."""
    own = [[2, 2], [ROWS, 2]]  # the inner gather (rank 3's mesh row), then the whole
    assert _plans_of_rank_3(forget=True) == (own, own)
    parents = [[3, 2], [ROWS, 2]]
    assert _plans_of_rank_3(forget=False) == (parents, parents)
