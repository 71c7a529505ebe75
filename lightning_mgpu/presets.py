"""THE preset table: every strategy name this package registers with Lightning comes from here.

Importing :mod:`lightning_mgpu` calls :func:`register_presets`; calling it again (re-import, reload) is
harmless because entries are registered with ``override=True``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pytorch_lightning.strategies import StrategyRegistry

from lightning_mgpu.strategies.ddp import MGPUDDPStrategy
from lightning_mgpu.strategies.sharded import MGPUShardedStrategy

_LAUNCH = {
    "popen": "re-runs the script per rank (scripts, torchrun, SLURM)",
    "spawn": "fresh interpreters, picklable model",
    "fork": "notebooks and fast CPU runs (CUDA must not be initialised first)",
}


@dataclass(frozen=True)
class Preset:
    name: str
    strategy: type
    description: str
    init_params: dict[str, Any] = field(default_factory=dict)

    @property
    def launch(self) -> str:
        return str(self.init_params.get("start_method", "popen"))


PRESETS: tuple[Preset, ...] = (
    Preset(
        "mgpu_ddp",
        MGPUDDPStrategy,
        "DDP; comm hooks on any device, accumulation without extra syncs",
        {"start_method": "popen"},
    ),
    Preset("mgpu_ddp_spawn", MGPUDDPStrategy, "mgpu_ddp launched with spawn", {"start_method": "spawn"}),
    Preset("mgpu_ddp_fork", MGPUDDPStrategy, "mgpu_ddp launched with fork", {"start_method": "fork"}),
    Preset("mgpu_ddp_notebook", MGPUDDPStrategy, "mgpu_ddp for Jupyter (fork launch)", {"start_method": "fork"}),
    Preset(
        "mgpu_ddp_fp16_compress",
        MGPUDDPStrategy,
        "mgpu_ddp with fp16 gradient compression (half the bytes)",
        {"start_method": "popen", "comm_hook": "fp16"},
    ),
    Preset(
        "mgpu_ddp_powersgd",
        MGPUDDPStrategy,
        "mgpu_ddp with PowerSGD rank-1 gradient compression",
        {"start_method": "popen", "comm_hook": "powersgd"},
    ),
    Preset(
        "mgpu_sharded",
        MGPUShardedStrategy,
        "ZeRO stage 2, torch FSDP2: optimizer state + gradients sharded",
        {"start_method": "popen", "stage": 2},
    ),
    Preset("mgpu_sharded_spawn", MGPUShardedStrategy, "mgpu_sharded launched with spawn", {"start_method": "spawn"}),
    Preset(
        "mgpu_sharded_notebook", MGPUShardedStrategy, "mgpu_sharded for Jupyter (fork launch)", {"start_method": "fork"}
    ),
    Preset(
        "mgpu_zero1",
        MGPUShardedStrategy,
        "ZeRO stage 1: DDP + torch ZeroRedundancyOptimizer (optimizer state sharded)",
        {"start_method": "popen", "stage": 1},
    ),
    Preset(
        "mgpu_zero3",
        MGPUShardedStrategy,
        "ZeRO stage 3, torch FSDP2: + parameters sharded",
        {"start_method": "popen", "stage": 3},
    ),
    Preset(
        "mgpu_sharded_fairscale",
        MGPUShardedStrategy,
        "fairscale OSS + ShardedDataParallel (Lightning 1.x ddp_sharded); needs the [fairscale] extra",
        {"start_method": "popen", "stage": 2, "backend": "fairscale"},
    ),
)


def register_presets(registry: Any = StrategyRegistry) -> list[str]:
    """Register every preset with Lightning's ``StrategyRegistry``; returns the names."""
    for p in PRESETS:
        registry.register(p.name, p.strategy, description=p.description, override=True, **p.init_params)
    return [p.name for p in PRESETS]


def preset_table() -> str:
    """A plain-text table of the presets: name, what it does, launch mode (for ``--list`` and the README)."""
    rows = [("name", "what it does", "launch")]
    rows += [(p.name, p.description, p.launch) for p in PRESETS]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines += [f"launch {k:<5}  {v}" for k, v in _LAUNCH.items()]
    return "\n".join(lines)
