"""The device mesh: the named dimensions of parallelism, their sizes checked together against the world size, and
the one ``torch.distributed.device_mesh.DeviceMesh`` a strategy builds from them.

The dimensions, outermost first (consecutive ranks vary fastest in the innermost one, so an inner dimension stays
within a machine where it fits):

* ``pipeline``: pipeline stages (``MGPUShardedStrategy(pipeline_parallel_size=P)``,
  :mod:`lightning_mgpu.parts.pipeline`);
* ``data_replicate``: copies of the sharded state (HSDP's replicas, one per machine by default; 1 when sharding is
  flat);
* ``data_shard``: ranks that split the parameters, gradients and optimizer state (FSDP2's shard group);
* ``tensor_parallel``: ranks that split each layer (tensor parallelism: they see the same batch).

The ranks that see different batches, ``data_replicate x data_shard``, form the dimension ``"data_parallel"``. The
mesh a LightningModule sees (``self.device_mesh`` in ``configure_model``) is shaped as Lightning's
``ModelParallelStrategy`` shapes its own, ``("data_parallel", "tensor_parallel")``, ``tensor_parallel`` of size 1
included, so that a module written for that strategy finds what it expects; ``"pipeline"`` leads where there are
several stages. Where the data is replicated too (HSDP), ``"data_parallel"`` is split into ``("data_replicate",
"data_shard")`` for the 2-D mesh FSDP2 shards over (:attr:`ParallelMesh.data`).

Example:

    >>> dims = ParallelDims(world_size=16, data_replicate=2)   # HSDP: 2 replicas of 8 shards
    >>> dims.data_shard, dims.data_parallel, dims.shape, dims.names
    (8, 16, (16, 1), ('data_parallel', 'tensor_parallel'))
    >>> ParallelDims.hybrid(world_size=16, num_nodes=2).data_replicate   # one replica per machine
    2
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, Optional

from lightning_mgpu import _compat, comm

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

PIPELINE = "pipeline"
DATA_REPLICATE = "data_replicate"
DATA_SHARD = "data_shard"
TENSOR_PARALLEL = "tensor_parallel"
#: ``data_replicate x data_shard``: the name Lightning's ``ModelParallelStrategy`` gives it
DATA_PARALLEL = "data_parallel"
_DATA_DIMS = (DATA_REPLICATE, DATA_SHARD)


@dataclass(frozen=True)
class ParallelDims:
    """The size of each dimension of the device mesh, checked together against the world size at construction.

    ``data_shard=-1`` (the default) takes the ranks the other dimensions leave:
    ``world_size // (data_replicate x tensor x pipeline)``. Each error names the value to change and the corrected
    call.
    """

    world_size: int
    """Ranks in all (processes per machine x machines)."""
    data_replicate: int = 1
    """Copies of the sharded state (HSDP's replicas); 1: sharding is flat."""
    data_shard: int = -1
    """Ranks that split the parameters, gradients and optimizer state; -1: what the other dimensions leave."""
    tensor: int = 1
    """Ranks that split each layer (``"tensor_parallel"``)."""
    pipeline: int = 1
    """Pipeline stages."""

    def __post_init__(self) -> None:
        for name in ("world_size", "data_replicate", "tensor", "pipeline"):
            _check_size(name, getattr(self, name))
        if self.data_shard != -1:
            _check_size("data_shard", self.data_shard, ", or -1 (the ranks the other dimensions leave)")
        world = self.world_size
        others = self.data_replicate * self.tensor * self.pipeline
        if world % others:
            fixed = self._dividing(world)
            raise ValueError(
                f"{self._call()}: data_replicate x tensor x pipeline = {self.data_replicate} x {self.tensor} x "
                f"{self.pipeline} = {others} does not divide the world size {world}, so no data_shard completes "
                f"the mesh. Change {_changed(self, fixed)} so that the product divides {world}: "
                f"{fixed._call(data_shard=-1)}."
            )
        if self.data_shard == -1:
            object.__setattr__(self, "data_shard", world // others)
        elif others * self.data_shard != world:
            fixed_shard = world // others
            raise ValueError(
                f"{self._call()}: data_replicate x data_shard x tensor x pipeline = {self.data_replicate} x "
                f"{self.data_shard} x {self.tensor} x {self.pipeline} = {others * self.data_shard} ranks, but the "
                f"world size is {world}. data_shard must be {world} // {others} = {fixed_shard}: "
                f"{self._call(data_shard=fixed_shard)} (or data_shard=-1, the ranks the other dimensions leave)."
            )

    @classmethod
    def hybrid(
        cls,
        world_size: int,
        num_nodes: int = 1,
        shard_size: Optional[int] = None,
        tensor: int = 1,
        pipeline: int = 1,
    ) -> ParallelDims:
        """HSDP's shape: shard within groups of ``shard_size`` ranks (by default the data ranks of one machine,
        ``world_size // num_nodes // tensor``, at most the data ranks of one pipeline stage), replicate across the
        groups.

        Example:

            >>> ParallelDims.hybrid(world_size=16, num_nodes=4, pipeline=2)   # each stage spans 2 machines
            ParallelDims(world_size=16, data_replicate=2, data_shard=4, tensor=1, pipeline=2)
        """
        if tensor != 1 or pipeline != 1:
            _check_size("tensor", tensor)
            _check_size("pipeline", pipeline)
            # the world must split into tensor groups and pipeline stages
            data = cls(world_size=world_size, tensor=tensor, pipeline=pipeline).data_parallel
            nodes = max(int(num_nodes), 1)
            if shard_size is None and (world_size // tensor) % nodes:
                raise ValueError(
                    f"mesh='hybrid' shards within each machine, but the {world_size // tensor} ranks of each tensor "
                    f"coordinate (world size {world_size} / tensor {tensor}) do not split evenly over "
                    f"num_nodes={nodes}. Pass shard_size=N (a divisor of {data})."
                )
            size = shard_size if shard_size is not None else min(data, world_size // nodes // tensor)
            if size < 1 or data % size:
                given = f"shard_size={size}" if shard_size is not None else f"The default shard group ({size} ranks)"
                raise ValueError(
                    f"{given} does not divide the {data} data ranks of each "
                    f"{'pipeline stage' if pipeline > 1 else 'tensor coordinate'} (world size {world_size} / tensor "
                    f"{tensor} / pipeline {pipeline}): the hybrid mesh needs data ranks = replicas x shard size. Pass "
                    f"a shard_size that divides {data}, or mesh='flat'."
                )
            return cls(
                world_size=world_size, data_replicate=data // size, data_shard=size, tensor=tensor, pipeline=pipeline
            )
        nodes = max(int(num_nodes), 1)
        if shard_size is None and world_size % nodes:
            raise ValueError(
                f"mesh='hybrid' shards within each machine, but {world_size} ranks do not split evenly over "
                f"num_nodes={nodes}. Launch the same number of processes on every machine, or pass shard_size=N."
            )
        size = shard_size if shard_size is not None else world_size // nodes
        if size < 1 or world_size % size:
            raise ValueError(
                f"shard_size={size} does not divide the world size {world_size}: the hybrid mesh needs "
                f"world size = replicas x shard size. Pass a shard_size that divides {world_size} (e.g. the "
                f"processes of one machine, {world_size // nodes}), or mesh='flat'."
            )
        return cls(world_size=world_size, data_replicate=world_size // size, data_shard=size)

    @property
    def data_parallel(self) -> int:
        """Ranks that see different batches: ``data_replicate x data_shard``."""
        return self.data_replicate * self.data_shard

    @property
    def is_hybrid(self) -> bool:
        """Whether the sharded state has several replicas (HSDP: FSDP2 gets a 2-D mesh)."""
        return self.data_replicate > 1

    @property
    def names(self) -> tuple[str, ...]:
        """The dimensions of the mesh the LightningModule sees, outermost first: Lightning's
        ``("data_parallel", "tensor_parallel")``, after ``"pipeline"`` where there are several stages."""
        return ((PIPELINE,) if self.pipeline > 1 else ()) + (DATA_PARALLEL, TENSOR_PARALLEL)

    @property
    def shape(self) -> tuple[int, ...]:
        """The sizes of :attr:`names`."""
        return ((self.pipeline,) if self.pipeline > 1 else ()) + (self.data_parallel, self.tensor)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Each dimension's index of global ``rank`` in the mesh :meth:`build` makes: ``rank = ((pipeline *
        data_parallel) + data_parallel_index) * tensor + tensor_index``, ``data_parallel_index = data_replicate_index
        x data_shard + data_shard_index``. The ranks of one pipeline share their ``"data_parallel"`` index (they
        see the same batch).

        Example:

            >>> ParallelDims(world_size=4, pipeline=2).coordinates(3)
            {'pipeline': 1, 'data_parallel': 1, 'data_replicate': 0, 'data_shard': 1, 'tensor_parallel': 0}
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"{self._call()}: rank={rank!r} is not a global rank (0 to {self.world_size - 1}).")
        rest, tensor_index = divmod(rank, self.tensor)
        pipeline_index, data_index = divmod(rest, self.data_parallel)
        replicate_index, shard_index = divmod(data_index, self.data_shard)
        return {
            PIPELINE: pipeline_index,
            DATA_PARALLEL: data_index,
            DATA_REPLICATE: replicate_index,
            DATA_SHARD: shard_index,
            TENSOR_PARALLEL: tensor_index,
        }

    def build(self, device_type: str) -> ParallelMesh:
        """The device mesh over the current default process group: a collective, every rank calls it at the same
        point. ``device_type``: the type of the strategy's root device (``"cuda"`` under NCCL, ``"cpu"`` under
        gloo). The package's one call to ``init_device_mesh``."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=self.names)
        if not self.is_hybrid:
            return ParallelMesh(self, mesh, mesh[DATA_PARALLEL])
        split = _compat.unflatten_mesh(mesh, DATA_PARALLEL, (self.data_replicate, self.data_shard), _DATA_DIMS)
        return ParallelMesh(self, mesh, split[_DATA_DIMS])

    def _call(self, **changes: int) -> str:
        values = {f.name: changes.get(f.name, getattr(self, f.name)) for f in fields(self)}
        shown = [f"world_size={values['world_size']}"]
        shown += [f"{name}={value}" for name, value in values.items() if name != "world_size" and value not in (1, -1)]
        return f"ParallelDims({', '.join(shown)})"

    def _dividing(self, world: int) -> ParallelDims:
        """The nearest sizes that divide ``world``: each of pipeline, tensor, data_replicate (in that order) cut to
        the largest divisor of the ranks still free."""
        free = world
        sizes: dict[str, int] = {}
        for name in ("pipeline", "tensor", "data_replicate"):
            sizes[name] = math.gcd(getattr(self, name), free)
            free //= sizes[name]
        return ParallelDims(world_size=world, data_shard=-1, **sizes)


def _check_size(name: str, value: Any, alternative: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ParallelDims: {name}={value!r} must be a whole number of ranks >= 1{alternative}.")


def _changed(given: ParallelDims, fixed: ParallelDims) -> str:
    names = [n for n in ("pipeline", "tensor", "data_replicate") if getattr(given, n) != getattr(fixed, n)]
    return " and ".join(f"{n}={getattr(given, n)} to {getattr(fixed, n)}" for n in names)


@dataclass(frozen=True)
class ParallelMesh:
    """What :meth:`ParallelDims.build` returns: the sizes, the mesh the LightningModule sees and the mesh the data
    is sharded over."""

    dims: ParallelDims
    device_mesh: DeviceMesh
    """Lightning's shape: ``mesh["data_parallel"]``, ``mesh["tensor_parallel"]`` (``"pipeline"`` with several
    stages)."""
    data: DeviceMesh
    """What FSDP2's ``fully_shard`` takes: 1-D ``"data_parallel"`` (flat sharding), or 2-D ``("data_replicate",
    "data_shard")`` (HSDP: reduce-scatter within the shard group, all-reduce across the replicas)."""

    @property
    def tensor(self) -> DeviceMesh:
        """The 1-D ``"tensor_parallel"`` mesh (what ``parallelize_module`` takes): the ranks that split each
        layer, which see the same batch."""
        return self.device_mesh[TENSOR_PARALLEL]


def expose_to_module(module: Any, mesh: Optional[DeviceMesh]) -> None:
    """Make ``mesh`` the LightningModule's ``self.device_mesh`` (read in ``configure_model``), as Lightning's
    ``ModelParallelStrategy`` does."""
    if module is not None:
        _compat.set_module_device_mesh(module, mesh)


class GroupMesh:
    """The :class:`ParallelMesh` of the current process group, built once per group: fit, then validate, test or
    predict in the same processes keep the mesh the module was sharded over (another would only add process groups); a
    new process group (a later fit in new processes) gets a new one, the old mesh's groups having ended with the old
    group."""

    def __init__(self) -> None:
        self._mesh: Optional[ParallelMesh] = None
        self._built_over: Any = None  # the default process group the mesh was built over

    def forget_if_new_group(self) -> None:
        if self._built_over is not comm.default_group():
            self._mesh = None

    def get(self, build: Callable[[], ParallelMesh], strategy_name: str) -> ParallelMesh:
        """The mesh of the current group: ``build()``'s, called now if it has none yet."""
        if self._mesh is None:
            if not comm.group_is_up():
                raise RuntimeError(
                    f"{strategy_name}.device_mesh is built at set-up, once the processes have started: read it in the "
                    f"LightningModule's configure_model (self.device_mesh) or any hook after it."
                )
            self._mesh = build()
            self._built_over = comm.default_group()
        return self._mesh
