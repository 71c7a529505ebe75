"""THE preset table: every strategy name this package registers with Lightning comes from here.

Importing :mod:`lightning_mgpu` calls :func:`register_presets`; calling it again (re-import, reload) is
harmless because entries are registered with ``override=True``.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass, field
from typing import Any, Optional

from pytorch_lightning.accelerators import AcceleratorRegistry
from pytorch_lightning.strategies import StrategyRegistry

from lightning_mgpu.settings import closest_names
from lightning_mgpu.strategies.auto import MGPUAutoStrategy
from lightning_mgpu.strategies.ddp import MGPUDDPStrategy
from lightning_mgpu.strategies.launchers import set_notebook_advice
from lightning_mgpu.strategies.periodic import MGPUDiLoCoStrategy, MGPULocalSGDStrategy
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


#: The launch variants of a preset family: its popen name plus these suffixes.
LAUNCH_VARIANTS: tuple[str, ...] = ("", "_spawn", "_notebook")

#: Each name suffix of a preset family: its launch, and its description (``{name}``: the popen preset's name,
#: ``{description}``: its description).
_VARIANTS: dict[str, tuple[str, str]] = {
    "": ("popen", "{description}"),
    "_spawn": ("spawn", "{name} launched with spawn"),
    "_fork": ("fork", "{name} launched with fork"),
    "_notebook": ("fork", "{name} for Jupyter (fork launch)"),
}


def _family(
    name: str, strategy: type, description: str, variants: tuple[str, ...] = LAUNCH_VARIANTS, **params: Any
) -> tuple[Preset, ...]:
    """The presets of one family: ``name`` (popen launch) and its launch ``variants``, all of ``strategy`` with
    ``params``."""
    return tuple(
        Preset(
            name + suffix,
            strategy,
            _VARIANTS[suffix][1].format(name=name, description=description),
            {"start_method": _VARIANTS[suffix][0], **params},
        )
        for suffix in variants
    )


#: Every preset name the pack registers with Lightning (both namespaces), with its strategy class, launch mode,
#: description and arguments. Example: ``[p.name for p in lightning_mgpu.PRESETS]``; ``lightning-mgpu --list``
#: prints them as a table.
PRESETS: tuple[Preset, ...] = (
    *_family(
        "mgpu_ddp",
        MGPUDDPStrategy,
        "DDP; comm hooks on any device, accumulation without extra syncs",
        variants=("", "_spawn", "_fork", "_notebook"),
    ),
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
    *_family(
        "mgpu_local_sgd",
        MGPULocalSGDStrategy,
        "local SGD: weights averaged every 8 optimizer steps, no gradient all-reduce (1/8 of the bytes)",
    ),
    *_family(
        "mgpu_diloco",
        MGPUDiLoCoStrategy,
        "DiLoCo: 32 inner steps, then an outer Nesterov step on the averaged weight change (1/32 of the bytes)",
    ),
    *_family(
        "mgpu_sharded", MGPUShardedStrategy, "ZeRO stage 2, torch FSDP2: optimizer state + gradients sharded", stage=2
    ),
    *_family(
        "mgpu_zero1",
        MGPUShardedStrategy,
        "ZeRO stage 1: DDP + torch ZeroRedundancyOptimizer (optimizer state sharded)",
        stage=1,
    ),
    *_family("mgpu_zero3", MGPUShardedStrategy, "ZeRO stage 3, torch FSDP2: + parameters sharded", stage=3),
    Preset(
        "mgpu_zero3_offload",
        MGPUShardedStrategy,
        "ZeRO stage 3 with the shards, gradients and optimizer state in host memory (CPU offload)",
        {"start_method": "popen", "stage": 3, "offload": "cpu"},
    ),
    Preset(
        "mgpu_hsdp",
        MGPUShardedStrategy,
        "hybrid ZeRO stage 3 (HSDP): sharded within each machine, replicated across machines",
        {"start_method": "popen", "stage": 3, "mesh": "hybrid"},
    ),
    Preset(
        "mgpu_tensor_parallel",
        MGPUShardedStrategy,
        "ZeRO stage 3 with tensor parallelism over pairs of ranks (the auto plan): tensor 2 x data world/2",
        {"start_method": "popen", "stage": 3, "tensor_parallel_size": 2},
    ),
    Preset(
        "mgpu_pipeline",
        MGPUShardedStrategy,
        "pipeline parallelism: the model's blocks in 2 stages (1F1B), the ranks left as data replicas",
        {"start_method": "popen", "pipeline_parallel_size": 2},
    ),
    Preset(
        "mgpu_sharded_fairscale",
        MGPUShardedStrategy,
        "fairscale OSS + ShardedDataParallel (Lightning 1.x ddp_sharded); needs the [fairscale] extra",
        {"start_method": "popen", "stage": 2, "backend": "fairscale"},
    ),
    *_family(
        "mgpu_auto",
        MGPUAutoStrategy,
        "the fastest of mgpu_ddp/zero1/sharded/zero3 (+/- activation checkpointing) that the memory plan fits",
    ),
)

#: The presets outside the rule of :data:`LAUNCH_VARIANTS`, and why (``preset_table`` prints it;
#: ``tests/unit/test_presets.py`` checks that every other family has each of the variants).
LAUNCH_EXCEPTIONS: dict[str, str] = {
    "mgpu_ddp_fork": "mgpu_ddp_notebook under Lightning's name ddp_fork",
    "mgpu_ddp_fp16_compress": "popen only: MGPUDDPStrategy(comm_hook='fp16', start_method=...) for another launch",
    "mgpu_ddp_powersgd": "popen only: MGPUDDPStrategy(comm_hook='powersgd', start_method=...) likewise",
    "mgpu_sharded_fairscale": "popen only: MGPUShardedStrategy(backend='fairscale', start_method=...) likewise",
    "mgpu_tensor_parallel": "popen only: MGPUShardedStrategy(stage=3, tensor_parallel_size=N, start_method=...) for "
    "another launch or size",
    "mgpu_hsdp": "popen only: jobs on several machines are started by torchrun or SLURM; "
    "MGPUShardedStrategy(stage=3, mesh='hybrid', start_method=...) for another launch",
    "mgpu_pipeline": "popen only: MGPUShardedStrategy(pipeline_parallel_size=P, start_method=...) for another launch",
    "mgpu_zero3_offload": "popen only: MGPUShardedStrategy(stage=3, offload='cpu', start_method=...) likewise",
}


@dataclass(frozen=True)
class Renamed:
    """A name Lightning 1.x accepted and 2.x dropped (the seeds' code uses them), and what to write now."""

    old: str
    registry: str  # "strategy" or "accelerator": the Trainer argument the old code passed it to
    replacement: str
    why: str

    @property
    def message(self) -> str:
        return f"{self.registry}={self.old!r} is not a Lightning 2 name: {self.why} Write {self.replacement}."


_DDP = "strategy='mgpu_ddp' (one process per device; 'mgpu_ddp_notebook' inside Jupyter)"
_SPLIT = (
    "Lightning 1.x chose the distributed mode with `accelerator`; Lightning 2 splits it into the device kind "
    "and the strategy."
)
RENAMED: tuple[Renamed, ...] = (
    Renamed(
        "dp",
        "strategy",
        _DDP,
        "nn.DataParallel (Lightning 1.x 'dp') was removed in Lightning 2.0; one process scattered every batch "
        "and gathered every output on the first GPU, which made it the slowest and least balanced choice.",
    ),
    Renamed(
        "ddp2",
        "strategy",
        _DDP + "; for statistics over the whole batch, log with sync_dist=True or use self.all_gather",
        "ddp2 (one process per node, DataParallel inside it) was removed in Lightning 1.8.",
    ),
    Renamed(
        "ddp_sharded",
        "strategy",
        "strategy='mgpu_sharded' (ZeRO-2 on torch FSDP2), or 'mgpu_sharded_fairscale' for the same fairscale "
        "OSS + ShardedDataParallel backend (pip install 'lightning-mgpu[fairscale]')",
        "fairscale's sharded DDP was removed in Lightning 2.0.",
    ),
    Renamed(
        "ddp_sharded_spawn",
        "strategy",
        "strategy='mgpu_sharded_spawn' (ZeRO-2 on torch FSDP2, spawn launch)",
        "fairscale's sharded DDP was removed in Lightning 2.0.",
    ),
    Renamed(
        "horovod",
        "strategy",
        _DDP + ", launched on many machines with torchrun or SLURM srun (docs: the multi-node guide)",
        "Horovod support was removed in Lightning 2.0; torch.distributed (NCCL/gloo) does the same ring all-reduce.",
    ),
    Renamed("dp", "accelerator", "accelerator='gpu', " + _DDP, _SPLIT),
    Renamed("ddp", "accelerator", "accelerator='gpu' (or 'cpu'), strategy='mgpu_ddp'", _SPLIT),
    Renamed("ddp_spawn", "accelerator", "accelerator='gpu' (or 'cpu'), strategy='mgpu_ddp_spawn'", _SPLIT),
    Renamed("ddp_cpu", "accelerator", "accelerator='cpu', devices=<processes>, strategy='mgpu_ddp'", _SPLIT),
    Renamed("ddp2", "accelerator", "accelerator='gpu', " + _DDP, _SPLIT),
    Renamed("horovod", "accelerator", "accelerator='gpu', " + _DDP + ", launched with torchrun or SLURM", _SPLIT),
)


def renamed(registry: str, name: str) -> Optional[Renamed]:
    """The :data:`RENAMED` entry for ``name`` passed as ``registry`` (``"strategy"``/``"accelerator"``), if any."""
    return next((r for r in RENAMED if r.registry == registry and r.old == name.lower()), None)


class UnknownPreset(ValueError):
    """A strategy name that looks like a preset of the pack (``"mgpu_pipline"``, ``"mgpu_zero_3"``) but is not
    registered: a ``ValueError``, as Lightning's own refusal of an unknown strategy name, with the closest names and
    the presets in the message. ``import lightning_mgpu`` makes Lightning's ``Trainer`` raise it, before anything
    starts; names Lightning or anyone else registered are passed through untouched.

    Example:

        >>> import lightning_mgpu
        >>> from pytorch_lightning import Trainer
        >>> try:
        ...     Trainer(strategy="mgpu_pipline")
        ... except lightning_mgpu.UnknownPreset as err:
        ...     print(str(err).splitlines()[1])
        did you mean 'mgpu_pipeline'?
    """


def closest_strategy_names(name: str) -> list[str]:
    """The preset names and the names in Lightning's strategy registry closest to ``name`` (difflib, at most three,
    the closest first, none much further than the closest); never a dropped Lightning 1.x name, which is registered
    only to explain itself."""
    dropped = {r.old for r in RENAMED if r.registry == "strategy"}
    names = [n for n in [p.name for p in PRESETS] + StrategyRegistry.available_strategies() if n not in dropped]
    return closest_names(name.lower(), names)


def preset_hint(name: Optional[str] = None) -> str:
    """The presets, one line; with ``name``, the closest preset or Lightning strategy names first (what the Trainer
    and the ``lightning-mgpu`` command say for a name that is not registered)."""
    lines = []
    close = closest_strategy_names(name) if name is not None else []
    if close:
        lines.append(f"did you mean {' or '.join(repr(c) for c in close)}?")
    presets = ", ".join(p.name for p in PRESETS)
    lines.append(f"lightning-mgpu presets: {presets} (`lightning-mgpu --list` describes them).")
    return "\n".join(lines)


def looks_like_preset(name: str) -> bool:
    """Whether ``name`` reads as a preset of the pack: it starts with ``mgpu``, or it is close (difflib) to a preset
    name, with or without its ``mgpu_`` prefix (``"zero_3"``, ``"pipline"``)."""
    name = name.lower()
    presets = [p.name for p in PRESETS] + [p.name.removeprefix("mgpu_") for p in PRESETS]
    return name.startswith("mgpu") or bool(difflib.get_close_matches(name, presets, n=1, cutoff=0.8))


def check_strategy_name(name: str) -> None:
    """Raise :class:`UnknownPreset` for ``Trainer(strategy=name)`` when ``name`` is not registered with Lightning
    (in any case, as Lightning lowers it) and :func:`looks_like_preset`; any other name is left to Lightning."""
    if name.lower() == "auto" or name.lower() in StrategyRegistry or not looks_like_preset(name):
        return
    raise UnknownPreset(f"Trainer(strategy={name!r}): no strategy of that name is registered.\n{preset_hint(name)}")


class _RenamedName:
    """Registered under a dropped Lightning 1.x name so that ``Trainer(strategy='dp')`` (or
    ``accelerator='ddp'``) raises the migration hint instead of Lightning's generic "invalid name". Lightning
    instantiates a registered name only once it has chosen it, so constructing this is the error."""

    def __init__(self, message: str) -> None:
        raise ValueError(message)

    @staticmethod
    def is_available() -> bool:  # Lightning lists available accelerators in some of its own errors
        return False


def register_presets(registry: Any = StrategyRegistry, accelerators: Any = AcceleratorRegistry) -> list[str]:
    """Register every preset with Lightning's ``StrategyRegistry``; returns the names.

    The dropped Lightning 1.x names in :data:`RENAMED` are registered too, each raising its migration hint
    when chosen; a name Lightning itself (or a user) registered is never shadowed. ``import lightning_mgpu`` has
    already called it for both Lightning namespaces; call it again for a registry of your own.

    Example:

        >>> from pytorch_lightning.strategies import StrategyRegistry
        >>> from lightning_mgpu import register_presets
        >>> names = register_presets()
        >>> "mgpu_ddp" in names and "mgpu_ddp" in StrategyRegistry
        True
    """
    for p in PRESETS:
        registry.register(p.name, p.strategy, description=p.description, override=True, **p.init_params)
    for r in RENAMED:
        target = registry if r.registry == "strategy" else accelerators
        if r.old not in target or target[r.old].get(r.registry) is _RenamedName:
            target.register(
                r.old, _RenamedName, description=f"removed: {r.replacement}", override=True, message=r.message
            )
    return [p.name for p in PRESETS]


def _setting(strategy: Any, key: str) -> Any:
    launch = getattr(strategy, "launch_settings", None)
    return getattr(launch, key) if hasattr(launch, key) else getattr(strategy, key, None)


def preset_of(strategy: Any) -> Optional[Preset]:
    """The preset that builds a strategy like ``strategy``: of its class (the nearest in its class's bases) and
    with every argument the preset sets equal to the strategy's; the most specific such preset, else None.

    Example:

        >>> from lightning_mgpu import MGPUDDPStrategy
        >>> from lightning_mgpu.presets import preset_of
        >>> preset_of(MGPUDDPStrategy(comm_hook="fp16")).name
        'mgpu_ddp_fp16_compress'
    """
    bases = type(strategy).__mro__
    matches = [
        p for p in PRESETS if p.strategy in bases and all(_setting(strategy, k) == v for k, v in p.init_params.items())
    ]
    if not matches:
        return None
    return min(matches, key=lambda p: (bases.index(p.strategy), -len(p.init_params)))


def _arguments(preset: Preset) -> dict[str, Any]:
    """The preset's arguments but the launch, each given or the strategy's default for the arguments any preset of
    the same class sets."""
    defaults = inspect.signature(preset.strategy.__init__).parameters  # type: ignore[misc]  # the class, not an instance
    keys = {k for p in PRESETS if p.strategy is preset.strategy for k in p.init_params} - {"start_method"}
    return {k: preset.init_params.get(k, defaults[k].default if k in defaults else None) for k in keys}


def notebook_choice(strategy: Any) -> tuple[str, str]:
    """What a notebook user wrote and what to write instead, as ``Trainer(strategy=...)`` arguments: the
    strategy's preset name (else its class), and the notebook preset of the same strategy and arguments (fork
    launch), else the same class with ``start_method='fork'``."""
    preset = preset_of(strategy)
    name = type(strategy).__name__ if preset is None else preset.strategy.__name__
    if preset is None:
        return f"{name}(...)", f"{name}(..., start_method='fork')"
    args = _arguments(preset)
    for p in PRESETS:
        if p.strategy is preset.strategy and p.name.endswith("_notebook") and _arguments(p) == args:
            return repr(preset.name), repr(p.name)
    spelled = "".join(f"{k}={v!r}, " for k, v in preset.init_params.items() if k != "start_method")
    return repr(preset.name), f"{name}({spelled}start_method='fork')"


set_notebook_advice(notebook_choice)  # a notebook refusal names the notebook preset of the same strategy


def preset_table() -> str:
    """A plain-text table of the presets: name, what it does, launch mode (what ``lightning-mgpu --list`` prints).

    Example:

        >>> from lightning_mgpu import preset_table
        >>> print(preset_table().splitlines()[0])  # then one row per preset
        name what it does launch
    """
    rows = [("name", "what it does", "launch")]
    rows += [(p.name, p.description, p.launch) for p in PRESETS]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines += [f"launch {k:<5}  {v}" for k, v in _LAUNCH.items()]
    lines.append("")
    lines.append("every family: popen, _spawn, _notebook (fork); besides those:")
    lines += [f"  {name}: {why}" for name, why in LAUNCH_EXCEPTIONS.items()]
    return "\n".join(lines)
