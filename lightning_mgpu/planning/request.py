"""The plan request: a typed, validated description of what to plan for, and memory-size parsing."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from lightning_mgpu.settings import STRATEGIES

__all__ = [
    "DEFAULT_PRECISIONS",
    "PRECISIONS",
    "STRATEGIES",
    "PlanError",
    "PlanRequest",
    "format_bytes",
    "layout_label",
    "parse_memory",
]

#: every precision the planner models; "16-mixed"/"16-master" take the same bytes as their bf16 twins
PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed", "16-mixed", "bf16-master", "16-master")
DEFAULT_PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed", "bf16-master")
#: Nominal bandwidth one device gets on a link, GB/s in each direction (decimal: 1 GB = 10**9 bytes); "pcie" is also
#: the link between host and device that offload's transfers take
LINK_SPEEDS: dict[str, float] = {
    "nvlink": 450.0,  # NVLink 4 (H100 SXM): 900 GB/s per GPU both directions together
    "pcie": 32.0,  # PCIe 4.0 x16
    "infiniband": 50.0,  # 400 Gb/s per GPU (one NDR port per GPU)
    "ethernet": 12.5,  # 100 Gb/s
}

_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_MEMORY = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


class PlanError(ValueError):
    """A plan cannot be made: bad input, an unknown model class, or no candidate fits. Raised before anything runs."""


def parse_memory(value: Union[str, int, float], name: str = "device_memory") -> int:
    """Bytes in ``value``: an int (bytes) or a string with a unit, ``"80GiB"``, ``"80 GB"``, ``"512MiB"``.

    Units: B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024), any case.

    >>> parse_memory("80GiB")
    85899345920
    """
    if isinstance(value, bool):
        raise PlanError(f"{name}={value!r} is not a memory size: write e.g. '80GiB'.")
    if isinstance(value, (int, float)):
        number, unit = float(value), "B"
    else:
        match = _MEMORY.match(str(value))
        if match is None or (match.group(2) or "B").upper() not in _UNITS:
            raise PlanError(
                f"{name}={value!r} is not a memory size. Write a number and a unit, e.g. '80GiB' or '80GB'; "
                f"accepted units: {', '.join(u if len(u) < 3 else u[0] + 'i' + u[2] for u in _UNITS)} "
                f"(KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB of 1024)."
            )
        number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise PlanError(f"{name}={value!r} must be a positive memory size, e.g. '80GiB'.")
    return size


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (``"1.50 GiB"``)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass
class PlanRequest:
    """What to plan for. Every field is validated at construction; errors name the field, the value and the fix.

    >>> PlanRequest(devices=8, device_memory="80GiB").device_memory_bytes
    85899345920
    """

    devices: int
    """Ranks (GPUs) the job runs on: the data-parallel world size."""
    device_memory: Union[str, int]
    """Memory of one device: bytes, or a string with a unit (``"80GiB"``, ``"40GB"``)."""
    headroom: float = 0.10
    """Fraction of ``device_memory`` kept free (allocator fragmentation, CUDA context, kernels' workspaces)."""
    precisions: tuple[str, ...] = DEFAULT_PRECISIONS
    """Precisions to consider, of :data:`PRECISIONS`."""
    strategies: tuple[str, ...] = STRATEGIES
    """Strategies to consider, of :data:`STRATEGIES`."""
    activation_checkpointing: Optional[Any] = None
    """The blocks to checkpoint in the "with AC" candidates (any ``activation_checkpointing`` policy); default:
    ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` when present, else each child of the first
    ``nn.Sequential`` / ``nn.ModuleList`` (``EveryNth(1)``); with neither, no "with AC" candidates."""
    activation_checkpointing_save: Optional[Any] = None
    """What each checkpointed block of the "with AC" candidates keeps (selective checkpointing, as the strategies'
    ``activation_checkpointing_save``); default the config's, else nothing (whole blocks recomputed)."""
    bucket_cap_mb: float = 25.0
    """DDP's ``bucket_cap_mb``: one bucket in flight is counted as a communication buffer."""
    num_nodes: int = 1
    """Machines the ranks are spread over (the same number on each). ``mgpu_hsdp`` shards within a machine
    (``devices / num_nodes`` ranks), so it is a candidate only when ``num_nodes > 1`` (on one machine it is
    ``mgpu_zero3``)."""
    offload: bool = False
    """Plan the sharded candidates (``mgpu_sharded``, ``mgpu_hsdp``, ``mgpu_zero3``) as ``offload="cpu"`` runs them:
    their parameter shards, gradients and optimizer state in host memory, the device holding what is gathered to
    compute; each row's host bytes per rank and bytes moved between host and device per micro-batch are counted.
    ``mgpu_ddp`` and ``mgpu_zero1`` do not offload and are planned as they are."""
    host_memory: Optional[Union[str, int]] = None
    """Host memory of one machine (bytes, or a string with a unit), checked with the same headroom against the
    offloaded rows' host bytes times the ranks of one machine; None: not checked. What is checked is the steady
    state: at set-up each rank builds its whole model on the host before FSDP2 shards it, and with gradient
    accumulation FSDP2 keeps each unit's unsharded gradients on the device between optimizer steps (the offloaded
    rows count the device's gradients once reduced, as without accumulation)."""
    device_memory_bytes: int = field(init=False)
    host_memory_bytes: Optional[int] = field(init=False, default=None)

    def __post_init__(self) -> None:
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 1:
            raise PlanError(f"devices={self.devices!r} must be a positive int (ranks, e.g. devices=8).")
        self.device_memory_bytes = parse_memory(self.device_memory)
        if not isinstance(self.headroom, (int, float)) or not 0 <= self.headroom < 1:
            raise PlanError(f"headroom={self.headroom!r} must be a fraction in [0, 1), e.g. headroom=0.1 for 10%.")
        self.precisions = tuple(self.precisions)
        unknown = [p for p in self.precisions if p not in PRECISIONS]
        if unknown or not self.precisions:
            raise PlanError(f"precisions={self.precisions!r}: {unknown or 'none given'}; choose from {PRECISIONS}.")
        self.strategies = tuple(self.strategies)
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown or not self.strategies:
            raise PlanError(f"strategies={self.strategies!r}: {unknown or 'none given'}; choose from {STRATEGIES}.")
        nodes = self.num_nodes
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or self.devices % nodes:
            raise PlanError(
                f"num_nodes={nodes!r} must be a positive int that divides devices={self.devices} (the same number "
                f"of ranks on every machine), e.g. num_nodes=2 for 2 machines of {max(self.devices // 2, 1)}."
            )
        if not self.candidates():
            raise PlanError(
                f"strategies={self.strategies!r} on num_nodes=1: mgpu_hsdp shards within a machine and replicates "
                f"across machines, so on one machine it is mgpu_zero3. Add 'mgpu_zero3' (or another strategy), or "
                f"plan for num_nodes > 1."
            )
        if not isinstance(self.offload, bool):
            raise PlanError(f"offload={self.offload!r} must be True or False (True: plan offload='cpu').")
        if self.host_memory is not None:
            self.host_memory_bytes = parse_memory(self.host_memory, "host_memory")
        if not isinstance(self.bucket_cap_mb, (int, float)) or self.bucket_cap_mb <= 0:
            raise PlanError(f"bucket_cap_mb={self.bucket_cap_mb!r} must be a positive number of MiB (DDP: 25).")

    @property
    def shard_size(self) -> int:
        """Ranks per shard group of ``mgpu_hsdp``: the processes of one machine."""
        return self.devices // self.num_nodes

    def candidates(self) -> tuple[str, ...]:
        """:attr:`strategies` less ``mgpu_hsdp`` on one machine (where it is ``mgpu_zero3``)."""
        return tuple(s for s in self.strategies if s != "mgpu_hsdp" or self.num_nodes > 1)

    @property
    def usable_bytes(self) -> int:
        """Bytes a plan may use per rank: ``device_memory`` less the headroom."""
        return int(self.device_memory_bytes * (1 - self.headroom))

    @property
    def usable_host_bytes(self) -> Optional[int]:
        """Host bytes a plan may use per rank: ``host_memory`` less the headroom, shared by the ranks of one machine
        (None where ``host_memory`` is not given)."""
        if self.host_memory_bytes is None:
            return None
        return int(self.host_memory_bytes * (1 - self.headroom)) // (self.devices // self.num_nodes)

    def host_holds(self, nbytes: int) -> bool:
        """Whether one rank's share of host memory holds ``nbytes`` (always, where ``host_memory`` is not given)."""
        usable = self.usable_host_bytes
        return usable is None or nbytes <= usable


def layout_label(
    strategy: str,
    replicas: int,
    shards: int,
    tensor: int = 1,
    pipeline: int = 1,
    schedule: str = "-",
    microbatches: int = 1,
) -> str:
    """The label of a layout (:attr:`Layout.name`; the memory plan's rows use it too).

    >>> layout_label("mgpu_sharded", 1, 8), layout_label("mgpu_ddp", 1, 4, pipeline=2, schedule="1f1b", microbatches=8)
    ('mgpu_sharded 8', 'mgpu_ddp 4 x pp 2 1f1b m=8')
    >>> layout_label("mgpu_hsdp", 2, 8), layout_label("mgpu_ddp", 1, 1, tensor=2, pipeline=4, schedule="gpipe")
    ('mgpu_hsdp 2x8', 'tp 2 x pp 4 gpipe m=1')
    """
    split = tensor > 1 or pipeline > 1
    if strategy == "mgpu_hsdp":
        parts = [f"mgpu_hsdp {replicas}x{shards}"]
    else:
        parts = [f"{strategy} {replicas * shards}"] if replicas * shards > 1 or not split else []
    parts += [f"tp {tensor}"] if tensor > 1 else []
    parts += [f"pp {pipeline} {schedule} m={microbatches}"] if pipeline > 1 else []
    return " x ".join(parts)
