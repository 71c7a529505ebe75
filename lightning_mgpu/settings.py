"""Typed settings of the strategies, validated at construction, each in one place (see the development page).

The strategies keep their keyword signatures (LightningCLI reads them from ``__init__``) and build one of these
from them; every check of a single argument, or of arguments that only make sense together, lives here, and each
error names the field, the bad value and the fix.

Example::

    from lightning_mgpu.settings import DDPSettings

    DDPSettings(comm_hook="fp16", ddp_kwargs={"bucket_cap_mb": 50})   # valid
    DDPSettings(timeout=30)  # TypeError: timeout=30 must be a datetime.timedelta, e.g. timedelta(minutes=30)
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib
import importlib.util
import inspect
import math
import multiprocessing
import os
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal, Optional, TypeVar, Union, cast

import torch
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu.comm_hooks import check_comm_hook
from lightning_mgpu.mesh import ParallelDims

# --- activation checkpointing: which blocks (applied by lightning_mgpu/parts/activation_checkpointing.py) -------------


@dataclass(frozen=True)
class EveryNth:
    """Checkpoint every ``n``-th block (positions 0, n, 2n, ...) of a ``nn.Sequential`` / ``nn.ModuleList``.

    Example:

        >>> from torch import nn
        >>> from lightning_mgpu import EveryNth, apply_activation_checkpointing
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.stem = nn.Linear(4, 4)
        ...         self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(5))
        >>> apply_activation_checkpointing(Net(), EveryNth(2, container="blocks"))
        ['blocks.0', 'blocks.2', 'blocks.4']

    In a LightningCLI YAML::

        strategy:
          class_path: lightning_mgpu.MGPUDDPStrategy
          init_args:
            activation_checkpointing: {class_path: lightning_mgpu.EveryNth, init_args: {n: 2, container: blocks}}
    """

    n: int
    """1 checkpoints every block; 2 every other block (half the activations freed, half the recompute)."""
    container: Optional[str] = None
    """Dotted name of the container (``"encoder.layers"``); default: the outermost Sequential/ModuleList
    containers of the model (not ones nested inside another)."""

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"EveryNth(n={self.n!r}): n must be a positive int, e.g. EveryNth(2).")
        if self.container is not None and not isinstance(self.container, str):
            raise TypeError(f"EveryNth(container={self.container!r}) must be a dotted module name such as 'blocks'.")


ActivationCheckpointingPolicy = Union[
    type[nn.Module],
    str,
    Iterable[Union[type[nn.Module], str]],
    EveryNth,
    Callable[[nn.Module], bool],
]
"""Which modules to checkpoint: module classes, class names (``"TransformerEncoderLayer"`` or a dotted path
``"torch.nn.TransformerEncoderLayer"``, for YAML), a set/list of those, :class:`EveryNth`, or a callable
``(module) -> bool``. Only the outermost match is checkpointed (a match inside a checkpointed block is
recomputed with it anyway)."""


CheckpointSave = Union[None, str, Sequence[str], float]
"""What a checkpointed block keeps for backward (selective checkpointing): ``None`` its input only (the whole block
is recomputed), ``"matmuls"`` (:data:`MATMUL_OPS`), a list of torch ``aten`` operator names, or a memory budget, a
float strictly between 0 and 1 (the fraction of the bytes of the block's operator outputs kept, the costliest to
recompute per byte first)."""

#: The operators ``save="matmuls"`` keeps: matrix multiplications, convolutions and attention (those present in the
#: installed torch), whose recompute costs the most per byte kept.
MATMUL_OPS = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "convolution",
    "_scaled_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)


def resolve_save(save: Union[str, Sequence[str]]) -> frozenset[Any]:
    """The ``aten`` operators (overload packets) that ``save`` names."""
    import torch

    names = [n for n in MATMUL_OPS if hasattr(torch.ops.aten, n)] if save == "matmuls" else list(save)
    ops = []
    for name in names:
        bare = name.removeprefix("aten.").removeprefix("torch.ops.aten.").split(".")[0]
        if not hasattr(torch.ops.aten, bare):
            raise ValueError(
                f"activation_checkpointing_save: {name!r} is not a torch aten operator. Name operators as torch "
                f"does, e.g. ['mm', 'addmm', 'convolution'], or pass 'matmuls' for {', '.join(MATMUL_OPS[:5])} "
                f"and attention."
            )
        ops.append(getattr(torch.ops.aten, bare))
    return frozenset(ops)


def validate_save(save: Any, reentrant: bool = False) -> None:
    """Check ``activation_checkpointing_save`` without a model."""
    if save is None:
        return
    if reentrant:
        raise ValueError(
            f"activation_checkpointing_save={save!r} needs the non-reentrant mode (torch's selective checkpointing "
            f"runs in it only): drop activation_checkpointing_reentrant=True."
        )
    if isinstance(save, bool) or not isinstance(save, (str, float, list, tuple)):
        raise TypeError(
            f"activation_checkpointing_save={save!r} is not a choice: pass 'matmuls', a list of operator names such "
            f"as ['mm', 'addmm'], or a memory budget between 0 and 1 such as 0.5."
        )
    if isinstance(save, float):
        if not 0.0 < save < 1.0:
            raise ValueError(
                f"activation_checkpointing_save={save!r} is a memory budget outside (0, 1): it is the fraction of a "
                f"block's operator outputs kept for backward. Use e.g. 0.5; None recomputes the whole block, and no "
                f"checkpointing (activation_checkpointing=None) keeps everything."
            )
        return
    if isinstance(save, str) and save != "matmuls":
        raise ValueError(
            f"activation_checkpointing_save={save!r} is unknown: pass 'matmuls', a list of operator names such as "
            f"[{save!r}], or a memory budget between 0 and 1."
        )
    if not isinstance(save, str) and (not save or not all(isinstance(n, str) for n in save)):
        raise ValueError(
            f"activation_checkpointing_save={save!r} must list operator names (strings), e.g. ['mm', 'addmm']."
        )
    resolve_save(save)


def import_policy_class(path: str) -> type[nn.Module]:
    module_name, _, attr = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"activation_checkpointing: cannot import {path!r} ({err}). Give an importable class path such as "
            f"'torch.nn.TransformerEncoderLayer', or the bare class name ('TransformerEncoderLayer')."
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"activation_checkpointing: {path!r} is {cls!r}, not an nn.Module class.")
    return cls


def validate_policy(policy: Any) -> None:
    """Check a policy's form without a model (at strategy construction): types, ``n``, importable paths."""
    if policy is None or isinstance(policy, EveryNth) or (isinstance(policy, type) and issubclass(policy, nn.Module)):
        return
    if isinstance(policy, str):
        if "." in policy:
            import_policy_class(policy)
        elif not policy:
            raise ValueError("activation_checkpointing: an empty class name was given.")
        return
    if isinstance(policy, (list, tuple, set, frozenset)):
        if not policy:
            raise ValueError(
                f"activation_checkpointing={policy!r} is an empty collection: it would checkpoint nothing. Pass None "
                f"to turn checkpointing off, or name module classes, e.g. ['TransformerEncoderLayer']."
            )
        for item in policy:
            if isinstance(item, (list, tuple, set, frozenset, EveryNth)) or not (
                isinstance(item, str) or (isinstance(item, type) and issubclass(item, nn.Module))
            ):
                raise TypeError(
                    f"activation_checkpointing: {item!r} in {policy!r} is not a module class or class name. A "
                    f"collection holds nn.Module classes or their names, e.g. "
                    f"[nn.TransformerEncoderLayer, 'ConvBlock']."
                )
            validate_policy(item)
        return
    if callable(policy):
        return
    raise TypeError(
        f"activation_checkpointing={policy!r} is not a policy. Pass module classes or class names "
        f"({{nn.TransformerEncoderLayer, 'ConvBlock'}}), EveryNth(n), or a callable (module) -> bool."
    )


StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
CommHookName = Literal["fp16", "bf16", "powersgd", "batched_powersgd"]
Stage = Literal[1, 2, 3]
Backend = Literal["torch", "fairscale"]
CheckpointLayout = Literal["consolidated", "sharded"]
MeshLayout = Literal["flat", "hybrid"]
LossNormalization = Literal["tokens"]
NonFinite = Literal["error"]
MicroBatchSetting = Union[int, Literal["auto"]]
CompileSetting = Union[bool, dict[str, Any]]
CheckpointParams = Literal["all", "trainable", "auto"]
CHECKPOINT_PARAMS = ("all", "trainable", "auto")
#: ``"auto"``, ``"auto+sequence"``, or module-name patterns (``"layers.*.attention.wq"``) -> a ``ParallelStyle`` of
#: ``torch.distributed.tensor.parallel`` or its name (``"colwise"``, ``"rowwise"``, ``"rowwise_rep"``,
#: ``"sequence_parallel"``)
TensorParallelPlanSetting = Union[Literal["auto", "auto+sequence"], dict[str, Any]]
PipelineScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b"]
PipelineSplit = Union[Sequence[str], Literal["auto"]]
Offload = Optional[Literal["cpu"]]
FaultToleranceSetting = Union[bool, Mapping[str, Any], "FaultTolerance"]

START_METHODS = ("popen", "spawn", "fork", "forkserver")
#: the strategies the planner (and mgpu_auto) can choose, fastest first
#: (see :data:`lightning_mgpu.planning.candidates.ORDER`)
STRATEGIES: tuple[str, ...] = ("mgpu_ddp", "mgpu_zero1", "mgpu_sharded", "mgpu_hsdp", "mgpu_zero3")
BACKENDS = ("torch", "fairscale")
LAYOUTS = ("consolidated", "sharded")
MESHES = ("flat", "hybrid")
#: the ``ParallelStyle`` names a tensor-parallel plan may use (Hugging Face's ``base_model_tp_plan`` names;
#: ``"rowwise_rep"``: split by input column with the input whole, the output summed whole again)
TENSOR_PARALLEL_STYLES = ("colwise", "rowwise", "rowwise_rep", "sequence_parallel")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
FAIRSCALE_INSTALL = "pip install 'lightning-mgpu[fairscale]'"

# Arguments of Lightning's DDPStrategy that the mgpu strategies replace with named ones.
REPLACED_KWARGS = {
    "ddp_comm_hook": "comm_hook='fp16' | 'bf16' | 'powersgd' | 'batched_powersgd'",
    "ddp_comm_state": "comm_state={...} (keyword arguments of the hook's state, e.g. PowerSGDState)",
    "ddp_comm_wrapper": "comm_hook='fp16' (compression) or comm_hook='powersgd'",
    "model_averaging_period": "strategy=MGPULocalSGDStrategy(sync_every=...) (or the preset 'mgpu_local_sgd')",
}

_DDP_PARAMETERS = inspect.signature(DistributedDataParallel.__init__).parameters
# DistributedDataParallel keywords a user may pass through the strategy; Lightning sets the others itself.
DDP_KEYWORDS = tuple(
    name
    for name, p in _DDP_PARAMETERS.items()
    if name not in ("self", "module", "device_ids", "output_device", "process_group", "device_mesh")
    and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
)


def is_default_ddp_kwarg(name: str, value: Any) -> bool:
    """Whether ``value`` for DDP keyword ``name`` is what leaving it out gives (None, or DDP's own default).

    LightningCLI (jsonargparse) follows ``**kwargs`` through Lightning's DDPStrategy into
    DistributedDataParallel's signature and passes every argument it finds there with its default value (None
    for Lightning's ``ddp_comm_*`` arguments): those count as not given."""
    if value is None:
        return True
    param = _DDP_PARAMETERS.get(name)
    if param is None or param.default is inspect.Parameter.empty:
        return False
    return type(value) is type(param.default) and value == param.default


def closest_names(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """The ``candidates`` closest to ``name`` (difflib ratio at least 0.6, none much further than the closest; at
    most ``n``, the closest first): what every "did you mean" of the pack names."""
    scored = [(difflib.SequenceMatcher(None, name, c).ratio(), c) for c in dict.fromkeys(candidates)]
    best = max((score for score, _ in scored), default=0.0)
    close = sorted((item for item in scored if item[0] >= max(0.6, best - 0.1)), key=lambda item: -item[0])
    return [c for _, c in close[:n]]


def check_keywords(owner: str, given: Iterable[str], valid: Iterable[str], passed_on: Iterable[str] = ()) -> None:
    """Raise ``TypeError`` for a keyword ``owner`` does not take, naming the closest valid ones (difflib) and the
    valid keywords: ``valid`` (the owner's options) and ``passed_on`` (those it hands to DistributedDataParallel)."""
    options = sorted(set(valid))
    ddp = sorted(set(passed_on) - set(options))
    unknown = sorted(set(given) - set(options) - set(ddp))
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = closest_names(name, [*options, *ddp])
        hints.append(f"{name!r} (did you mean {' or '.join(map(repr, close))}?)" if close else repr(name))
    also = f"; and DistributedDataParallel's: {', '.join(ddp)}" if ddp else ""
    raise TypeError(
        f"{owner} got unknown keyword argument{'s' if len(unknown) > 1 else ''} {', '.join(hints)}. "
        f"Its options: {', '.join(options)}{also}."
    )


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} is not a bool: {name} must be True or False.")


def _check_whole(name: str, value: Any, must: str, minimum: int = 1, optional: bool = False) -> None:
    """Refuse ``value`` unless it is an int (not a bool) >= ``minimum``, or None where ``optional``: raise
    ``ValueError(f"{name}={value!r} must be {must}")``."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be {must}")


def _check_micro_batch_size(value: Any) -> None:
    if value == "auto":
        return
    _check_whole(
        "micro_batch_size",
        value,
        "a positive int (rows per micro-batch, e.g. micro_batch_size=8), 'auto' (the largest micro-batch that "
        "fits, found by backing off on out-of-memory errors) or None (off).",
        optional=True,
    )


# torch.compile's keyword arguments (all but the model): what a ``compile={...}`` dict may hold.
COMPILE_KEYWORDS = tuple(name for name in inspect.signature(torch.compile).parameters if name != "model")


def check_compile(value: Any) -> Union[bool, dict[str, Any]]:
    """``compile=True``/``False``, or a dict of :func:`torch.compile` keyword arguments (``{"mode": ...}``);
    returns the value with a mapping made a plain dict. An unknown key names the valid ones."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(
            f"compile={value!r} must be True, False or a dict of torch.compile keyword arguments, e.g. "
            f"compile={{'mode': 'max-autotune'}} or compile={{'backend': 'aot_eager'}}."
        )
    options = dict(value)
    bad = [k for k in options if not isinstance(k, str) or k not in COMPILE_KEYWORDS]
    if bad:
        hints = []
        for name in bad:
            close = difflib.get_close_matches(str(name), COMPILE_KEYWORDS, n=1)
            hints.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
        raise TypeError(
            f"compile={value!r}: {', '.join(hints)} is not a keyword argument of torch.compile. Valid keys: "
            f"{', '.join(COMPILE_KEYWORDS)}."
        )
    return options


def _check_start_method(start_method: Any) -> None:
    if start_method not in START_METHODS:
        raise ValueError(
            f"Unknown start_method={start_method!r}. Choose one of {list(START_METHODS)}: 'popen' for "
            f"scripts/torchrun/SLURM, 'fork' in notebooks (or the preset 'mgpu_ddp_notebook'), 'spawn' otherwise."
        )
    if start_method != "popen" and start_method not in multiprocessing.get_all_start_methods():
        raise ValueError(
            f"start_method={start_method!r} is not available on this platform; available: "
            f"{multiprocessing.get_all_start_methods()} or 'popen'."
        )


LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""torchft's own variable for the lighthouse's address (``http://host:29510``)."""
GROUP_ENV = "MGPU_REPLICA_GROUP"
"""This launch's replica group, 0 to ``replica_groups - 1``."""
GROUPS_ENV = "MGPU_REPLICA_GROUPS"
"""How many replica groups the job has (the data is split into that many shares)."""
EXTRA = "pip install 'lightning-mgpu[torchft]'"
LIGHTHOUSE_COMMAND = "torchft_lighthouse --min_replicas 1 --bind [::]:29510"


@dataclass(frozen=True)
class FaultTolerance:
    """Where this launch sits among the replica groups, and how long it waits. Each field not given is read from
    the environment when the strategy is built (the names in brackets).

    Example:

        >>> from lightning_mgpu import FaultTolerance
        >>> FaultTolerance(lighthouse="http://localhost:29510", replica_group=1, replica_groups=2).replica_group
        1
    """

    lighthouse: Optional[str] = None
    """The lighthouse's address, ``http://host:port`` (``TORCHFT_LIGHTHOUSE``)."""
    replica_group: Optional[int] = None
    """This launch's group, 0 to ``replica_groups - 1`` (``MGPU_REPLICA_GROUP``)."""
    replica_groups: Optional[int] = None
    """How many groups the job has; each draws its own share of the data (``MGPU_REPLICA_GROUPS``)."""
    min_replicas: int = 1
    """How many groups must take part in a step for it to commit."""
    timeout: float = 60.0
    """Seconds a cross-group all-reduce, a commit vote or a heal may take before the step is dropped."""
    quorum_timeout: float = 60.0
    """Seconds to wait for a quorum of at least ``min_replicas`` groups before failing."""
    step_timeout: float = 600.0
    """Seconds one optimizer step of this group may take, from its quorum (and heal) to its commit vote (its
    micro-batches included), before the group takes itself out of the job: a group stuck in user code or a data
    loader keeps heartbeating, and would hold every other group's next quorum. Its processes then end with an error
    naming the step; started again, the group heals."""

    def __post_init__(self) -> None:
        for name in ("replica_group", "replica_groups", "min_replicas"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"fault_tolerance {name}={value!r} must be an int.")
        for name in ("timeout", "quorum_timeout", "step_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"fault_tolerance {name}={value!r} must be a positive number of seconds.")
        if self.min_replicas < 1:
            raise ValueError(f"fault_tolerance min_replicas={self.min_replicas} must be at least 1.")
        if self.replica_groups is not None and self.replica_groups < 1:
            raise ValueError(f"fault_tolerance replica_groups={self.replica_groups} must be at least 1.")
        if self.replica_groups is not None and self.min_replicas > self.replica_groups:
            raise ValueError(
                f"fault_tolerance min_replicas={self.min_replicas} is more than replica_groups={self.replica_groups}: "
                f"no step could ever commit. Use min_replicas between 1 and {self.replica_groups}."
            )
        groups = self.replica_groups
        if self.replica_group is not None and not 0 <= self.replica_group < (groups or self.replica_group + 1):
            raise ValueError(
                f"fault_tolerance replica_group={self.replica_group} is outside 0..{(self.replica_groups or 1) - 1} "
                f"(replica_groups={self.replica_groups}): number the groups from 0."
            )

    def resolved(self, environ: Mapping[str, str]) -> FaultTolerance:
        """These settings with every field not given read from ``environ``; a field missing in both is an error
        naming the variable and the fix."""
        values: dict[str, Any] = {}
        for name, env in (("lighthouse", LIGHTHOUSE_ENV), ("replica_group", GROUP_ENV), ("replica_groups", GROUPS_ENV)):
            value = getattr(self, name)
            if value is None and env in environ:
                text = environ[env]
                if name == "lighthouse":
                    value = text
                else:
                    try:
                        value = int(text)
                    except ValueError:
                        raise ValueError(f"{env}={text!r} must be a whole number.") from None
            if value is None:
                hint = (
                    f"start one with `{LIGHTHOUSE_COMMAND}` and pass its address, e.g. {env}=http://<its host>:29510"
                    if name == "lighthouse"
                    else f"give every launch its group (0, 1, ...) and the number of groups, e.g. {GROUP_ENV}=0 "
                    f"{GROUPS_ENV}=2"
                )
                raise ValueError(
                    f"fault_tolerance needs {name}: pass fault_tolerance={{{name!r}: ...}} or set {env}; {hint}."
                )
            values[name] = value
        return dataclasses.replace(self, **values)


def check_fault_tolerance(value: Any, environ: Optional[Mapping[str, str]] = None) -> Optional[FaultTolerance]:
    """The strategy's ``fault_tolerance`` argument as settings, resolved against the environment, or None (off):
    ``True`` (everything from the environment), a mapping of :class:`FaultTolerance`'s fields (a LightningCLI
    config gives one), or a :class:`FaultTolerance`. Refused with the fix: torchft missing, an unknown field, a
    field missing in both places."""
    if value is None or value is False:
        return None
    if value is True:
        config = FaultTolerance()
    elif isinstance(value, FaultTolerance):
        config = value
    elif isinstance(value, Mapping):
        names = [f.name for f in dataclasses.fields(FaultTolerance)]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise TypeError(f"fault_tolerance does not take {unknown}; its fields are {names}.")
        config = FaultTolerance(**value)
    else:
        raise TypeError(
            f"fault_tolerance={value!r} must be True (settings from the environment), a dict of {{lighthouse, "
            f"replica_group, replica_groups, min_replicas, timeout, quorum_timeout, step_timeout}}, or None."
        )
    if importlib.util.find_spec("torchft") is None:
        raise ImportError(f"fault_tolerance needs torchft, which is not installed: {EXTRA}")
    return config.resolved(os.environ if environ is None else environ)


@dataclass(frozen=True)
class CommonSettings:
    """What every mgpu strategy has: how it starts and joins its process group, the ledger, and activation
    checkpointing."""

    start_method: StartMethod = "popen"
    """``"popen"`` (re-run the script per rank; scripts, torchrun, SLURM), ``"spawn"``, ``"fork"`` (notebooks; CPU
    or before CUDA is initialised; each rank runs one CPU thread for torch's operators) or ``"forkserver"``."""
    process_group_backend: Optional[str] = None
    """``"gloo"``, ``"nccl"``; ``None``: gloo on CPU, nccl on CUDA."""
    timeout: Optional[timedelta] = default_pg_timeout
    """How long a collective waits for the other ranks, a :class:`datetime.timedelta`."""
    log_comm_stats: bool = True
    """Log the ledger's ``comm/*`` metrics through the Trainer's loggers (every ``log_every_n_steps`` optimizer
    steps)."""
    activation_checkpointing: Optional[ActivationCheckpointingPolicy] = None
    """Which blocks to checkpoint (free activations in forward, recompute them in backward), BatchNorm-safe: module
    classes, class names (for YAML), :class:`~lightning_mgpu.EveryNth` or a callable ``(module) -> bool``; see
    :func:`lightning_mgpu.apply_activation_checkpointing`. Checked against the model before any process starts."""
    activation_checkpointing_reentrant: bool = False
    """Use torch's reentrant checkpointing instead of the non-reentrant default."""
    activation_checkpointing_save: CheckpointSave = None
    """What each checkpointed block keeps for backward instead of recomputing (selective checkpointing):
    ``None`` its input only, ``"matmuls"`` its matrix multiplications, convolutions and attention, a list of
    torch operator names, or a memory budget between 0 and 1; see
    :func:`lightning_mgpu.apply_activation_checkpointing`."""
    loss_normalization: Optional[LossNormalization] = None
    """``None``: Lightning's (the loss of each micro-batch as returned); ``"tokens"``: ``training_step`` returns
    ``{"loss": <sum of per-token losses>, "num_tokens": <count>}`` and the gradient is that of the mean over every
    token of the optimizer step, all micro-batches of all ranks (``lightning_mgpu/parts/token_loss.py``)."""
    nonfinite: Optional[NonFinite] = None
    """``"error"``: a NaN/Inf gradient on any rank makes every rank raise the same ``FloatingPointError`` naming
    the rank and parameter (one small all-reduce per step); under the fp16 scaler every rank skips the step
    instead. ``None``: no check."""
    micro_batch_size: Optional[MicroBatchSetting] = None
    """Split each loader batch into micro-batches of this many rows and accumulate them (the gradient stays the
    whole batch's); ``"auto"``: the largest that fits. An out-of-memory error on any rank makes every rank redo the
    step at half the size (see :doc:`/guides/planning`). Automatic optimization only; the gradients are then
    averaged once after the last micro-batch (``lightning_mgpu/parts/micro_batching.py``)."""
    async_checkpoint: bool = False
    """Save checkpoints during fit without stopping training: the state is copied off the live tensors (pinned CPU
    memory on GPU) and written in a background thread, one write at a time; a failed write raises on every rank at
    the next save or at the end of fit, which waits for the last write (the sharded layout marks a directory
    complete once every rank's part is written). See the reliability guide."""
    checkpoint_params: CheckpointParams = "all"
    """Which parameters a checkpoint holds. ``"all"``: every one (a checkpoint that loads anywhere, e.g. with
    ``LightningModule.load_from_checkpoint``). ``"trainable"``: only those with ``requires_grad`` (adapters such as
    LoRA), with the buffers, the optimizer state and the loop state, and a fingerprint of the frozen base in their
    place: a resume, ``validate``/``test``/``predict(ckpt_path=...)`` onto another base is refused with the reason.
    ``"auto"``: ``"trainable"`` when the frozen parameters hold most of the parameter elements, else ``"all"``.
    See the fine-tuning guide."""
    compile: CompileSetting = False
    """``True`` or a dict of :func:`torch.compile` keyword arguments (``{"mode": "max-autotune"}``): compile the
    model in place once it is wrapped or sharded (state-dict keys unchanged): the LightningModule's ``forward``
    after the DDP wrap, each FSDP unit's block under the sharded stages 2/3, each of the pipeline's blocks under
    ``pipeline_parallel_size > 1`` (see the compilation guide). A model
    compiled with ``torch.compile`` before ``Trainer.fit`` is refused with it; without it, such a model trains as
    under Lightning's DDP. ``False``: eager."""

    exact_evaluation: bool = True
    """Validate, test and predict see every sample once, with the same number of batches on every rank (no padded
    repeats; the epoch value of ``self.log(..., sync_dist=True)`` is the one-process value, each batch weighted by
    its size); sharded stages gather their parameters once for an evaluation loop whose ranks could run different
    numbers of batches (``lightning_mgpu/parts/evaluation.py``). ``False``: Lightning's padded sampler."""
    check_uneven_inputs: bool = True
    """Different numbers of training batches on the ranks raise the same error on every rank before the first step
    that cannot complete, instead of hanging: compared once per epoch for loaders with a length, agreed at every
    step (one all-reduce of one number) for iterable datasets (``lightning_mgpu/parts/uneven_inputs.py``).
    ``False``: Lightning's behaviour."""
    fault_tolerance: Optional[FaultToleranceSetting] = None
    """Fault-tolerant replica groups (torchft; the ``torchft`` extra): the job is several launches, one per replica
    group, that keep training when a group dies and heal it from a live group when it is started again; each
    optimizer step commits only when every group of the step's quorum succeeded. ``True``: the lighthouse's address,
    this group and the number of groups from ``TORCHFT_LIGHTHOUSE``, ``MGPU_REPLICA_GROUP``, ``MGPU_REPLICA_GROUPS``;
    or a dict of :class:`~lightning_mgpu.FaultTolerance`'s fields (``lighthouse``,
    ``replica_group``, ``replica_groups``, ``min_replicas``, ``timeout``, ``quorum_timeout``, ``step_timeout``).
    Inside a group the strategy is what it is without it: ``mgpu_ddp``'s DDP, or the sharded strategy's ZeRO stages
    2/3 (the groups then replicate the shards: HSDP with torchft as its replicate dimension). Automatic
    optimization only. See the fault-tolerance guide."""

    def __post_init__(self) -> None:
        _check_start_method(self.start_method)
        object.__setattr__(self, "compile", check_compile(self.compile))
        if self.nonfinite not in (None, "error"):
            raise ValueError(
                f"nonfinite={self.nonfinite!r} is unknown. Use nonfinite='error' (every rank raises the same error "
                f"on a NaN/Inf gradient) or None (no check)."
            )
        if self.loss_normalization not in (None, "tokens"):
            raise ValueError(
                f"loss_normalization={self.loss_normalization!r} is unknown. Use loss_normalization='tokens' (the "
                f"mean over every token of the optimizer step; training_step returns {{'loss': <sum>, "
                f"'num_tokens': <count>}}) or None (Lightning's per-micro-batch loss)."
            )
        _check_micro_batch_size(self.micro_batch_size)
        if self.micro_batch_size is not None and self.loss_normalization == "tokens":
            raise ValueError(
                f"micro_batch_size={self.micro_batch_size!r} with loss_normalization='tokens': micro-batching weights "
                f"each micro-batch's loss by its share of rows, the token mode by its tokens; the two do not compose "
                f"yet. Use one of them (with tokens, a smaller loader batch and accumulate_grad_batches)."
            )
        if self.process_group_backend is not None and not isinstance(self.process_group_backend, str):
            raise TypeError(
                f"process_group_backend={self.process_group_backend!r} must be a string ('gloo', 'nccl') or None."
            )
        if self.timeout is not None and not isinstance(self.timeout, timedelta):
            raise TypeError(
                f"timeout={self.timeout!r} must be a datetime.timedelta, not a number of seconds: write "
                f"timeout=datetime.timedelta(seconds={self.timeout!r}) (or timedelta(minutes=30))."
            )
        _check_bool("log_comm_stats", self.log_comm_stats)
        validate_policy(self.activation_checkpointing)
        _check_bool("activation_checkpointing_reentrant", self.activation_checkpointing_reentrant)
        validate_save(self.activation_checkpointing_save, self.activation_checkpointing_reentrant)
        _check_bool("async_checkpoint", self.async_checkpoint)
        if self.checkpoint_params not in CHECKPOINT_PARAMS:
            raise ValueError(
                f"checkpoint_params={self.checkpoint_params!r} is unknown. Use 'all' (every parameter, the default), "
                f"'trainable' (only the parameters with requires_grad, e.g. adapters) or 'auto' ('trainable' when "
                f"most parameters are frozen)."
            )
        _check_bool("exact_evaluation", self.exact_evaluation)
        _check_bool("check_uneven_inputs", self.check_uneven_inputs)
        object.__setattr__(self, "fault_tolerance", check_fault_tolerance(self.fault_tolerance))

    @classmethod
    def keywords(cls) -> tuple[str, ...]:
        """The strategy keywords these settings take (``ddp_kwargs`` is the ``**`` remainder, not a keyword)."""
        return tuple(f.name for f in fields(cls) if f.name != "ddp_kwargs")


@dataclass(frozen=True)
class DDPSettings(CommonSettings):
    """Settings of :class:`~lightning_mgpu.MGPUDDPStrategy` (and of stage 1 of the sharded strategy)."""

    comm_hook: Optional[CommHookName] = None
    """``None`` (plain averaging all-reduce), ``"fp16"``, ``"bf16"`` (NCCL only), ``"powersgd"`` or
    ``"batched_powersgd"``; registered on every device type, and a hook the backend cannot run is refused at
    ``Trainer(...)`` construction (the sharded strategy: stage 1 only)."""
    comm_state: Optional[dict[str, Any]] = None
    """Keyword arguments for the hook's state, e.g. ``{"matrix_approximation_rank": 2}`` for PowerSGD (defaults:
    rank 1, compression from the 2nd synchronisation)."""
    static_graph: bool = False
    """Tell DDP the graph is the same every iteration (faster; see torch's DDP docs); works with
    ``accumulate_grad_batches``."""
    find_unused_parameters: bool = False
    """DDP's flag; costs a graph traversal per step, leave off unless needed."""
    gradient_as_bucket_view: bool = True
    """DDP's flag, on by default here (off in torch): gradients are views into the all-reduce buckets, which saves
    one gradient-sized buffer and one copy per step, and lets the ledger count plain all-reduce from the buckets
    without a Python comm hook. Set it to False if your code replaces ``param.grad`` tensors or calls ``detach_()``
    on them (the ledger then counts through a Python hook, one extra pass over the gradients per step)."""
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments of :class:`torch.nn.parallel.DistributedDataParallel` (``bucket_cap_mb``...)."""

    def __post_init__(self) -> None:
        state = self.comm_state  # a mapping (LightningCLI gives a dict) as a plain dict; an empty one: none
        object.__setattr__(self, "comm_state", dict(state) if isinstance(state, Mapping) and state else state or None)
        replaced = sorted(set(self.ddp_kwargs) & set(REPLACED_KWARGS))
        if replaced:
            hints = "; ".join(f"{k} -> {REPLACED_KWARGS[k]}" for k in replaced)
            raise TypeError(f"MGPUDDPStrategy does not take {replaced}. Use instead: {hints}.")
        super().__post_init__()
        check_comm_hook(self.comm_hook, self.comm_state)
        if self.micro_batch_size is not None and self.comm_hook in ("powersgd", "batched_powersgd"):
            raise ValueError(
                f"micro_batch_size={self.micro_batch_size!r} with comm_hook={self.comm_hook!r}: with micro-batching "
                f"the gradients are averaged once after the last micro-batch, outside DDP's buckets, where PowerSGD "
                f"cannot run. Use comm_hook='fp16' (half the bytes) or None."
            )
        for name in ("static_graph", "find_unused_parameters", "gradient_as_bucket_view"):
            _check_bool(name, getattr(self, name))
        if (
            self.activation_checkpointing_reentrant
            and self.find_unused_parameters
            and self.activation_checkpointing is not None
        ):
            raise ValueError(
                "activation_checkpointing_reentrant=True cannot run with find_unused_parameters=True: DDP marks a "
                "parameter ready once in the forward's graph and again in the reentrant recompute's backward "
                "(torch: 'Expected to mark a variable ready only once'). Use the default non-reentrant "
                "checkpointing (activation_checkpointing_reentrant=False), which works with both."
            )

    @property
    def all_ddp_kwargs(self) -> dict[str, Any]:
        """Every keyword argument handed to torch's DistributedDataParallel (the named ones and the rest)."""
        return {
            "find_unused_parameters": self.find_unused_parameters,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            **self.ddp_kwargs,
        }

    @property
    def count_from_buckets(self) -> bool:
        """Plain all-reduce with bucket views runs DDP's built-in C++ path (no Python in the reduction); the
        ledger then counts from the bucket storages after each synchronised backward instead of in a hook."""
        return self.comm_hook is None and self.gradient_as_bucket_view


CommDtype = Literal["fp16", "bf16"]
COMM_DTYPES = ("fp16", "bf16")


def _check_int(name: str, value: Any, minimum: int, hint: str) -> None:
    _check_whole(name, value, f"an int >= {minimum}: {hint}", minimum)


@dataclass(frozen=True)
class LocalSGDSettings:
    """What :class:`~lightning_mgpu.MGPULocalSGDStrategy` adds to DDP: how often the ranks average their weights."""

    sync_every: int = 8
    """H: optimizer steps between two weight averages (accumulated micro-batches count as one step)."""
    warmup_steps: int = 0
    """Optimizer steps with DDP's gradient all-reduce on every step before the periodic averaging starts."""
    comm_dtype: Optional[CommDtype] = None
    """``None`` (the parameters' dtype), ``"fp16"`` or ``"bf16"``: the dtype the weight differences are averaged in
    (half the bytes)."""

    def __post_init__(self) -> None:
        _check_int("sync_every", self.sync_every, 1, "the number of optimizer steps between syncs (1 = every step).")
        _check_int("warmup_steps", self.warmup_steps, 0, "0 starts the periodic averaging at the first step.")
        if self.comm_dtype is not None and self.comm_dtype not in COMM_DTYPES:
            raise ValueError(
                f"comm_dtype={self.comm_dtype!r} is unknown. Use None (average in the parameters' dtype), 'fp16' or "
                f"'bf16' (half the bytes)."
            )

    @staticmethod
    def ddp_kwargs(owner: str, given: Mapping[str, Any], warmup_steps: int = 0) -> dict[str, Any]:
        """The DistributedDataParallel keywords of a periodic-sync strategy (``owner``): the DDP options it has no use
        for are refused, naming why; buffers are averaged by the sync, so DDP's buffer broadcast is turned off.
        ``fault_tolerance`` passes through (to :class:`~lightning_mgpu.MGPUDDPStrategy`), without a warm-up."""
        kwargs = dict(given)
        if kwargs.get("micro_batch_size") is not None:
            raise TypeError(
                f"{owner} does not take micro_batch_size={kwargs['micro_batch_size']!r}: micro-batching averages the "
                f"gradients across ranks after every step, which this strategy replaces by a weight sync every "
                f"sync_every steps. Use a smaller loader batch with accumulate_grad_batches."
            )
        kwargs.pop("micro_batch_size", None)
        if kwargs.get("fault_tolerance") not in (None, False) and warmup_steps:
            raise TypeError(
                f"{owner} does not take fault_tolerance with warmup_steps={warmup_steps}: across replica groups a "
                f"period is the unit that commits, and a warm-up step all-reduces gradients every step. Use "
                f"warmup_steps=0, or warm up with MGPUDDPStrategy(fault_tolerance=...) and resume from its checkpoint."
            )
        for name in ("comm_hook", "comm_state", "static_graph"):
            if kwargs.get(name) not in (None, False):
                raise TypeError(
                    f"{owner} does not take {name}={kwargs[name]!r}: it never all-reduces gradients after the warm-up "
                    f"(comm_dtype='fp16' halves the bytes of its weight syncs). Remove {name}."
                )
            kwargs.pop(name, None)
        # DDP would broadcast rank 0's buffers (BatchNorm statistics) before every forward: the sync averages them
        # instead, in the same round as the weights
        # (torch 2.13 renamed DDP's flag forward_sync_buffers; both still sync the buffers once, when DDP is built)
        # Only None means "not given" here: a True or False the user wrote is kept, also where it equals DDP's
        # default (broadcast_buffers=True before torch 2.13, whose DDP takes None as "not given")
        flags = [k for k in ("broadcast_buffers", "forward_sync_buffers") if k in kwargs]
        if all(kwargs[k] is None for k in flags):
            for k in flags:
                del kwargs[k]
            flag = "forward_sync_buffers" if "forward_sync_buffers" in DDP_KEYWORDS else "broadcast_buffers"
            kwargs[flag] = False
        return kwargs


@dataclass(frozen=True)
class DiLoCoSettings(LocalSGDSettings):
    """What :class:`~lightning_mgpu.MGPUDiLoCoStrategy` adds: the outer optimizer (SGD, Nesterov by default) that
    steps the last synced weights along the averaged difference every ``sync_every`` inner steps."""

    sync_every: int = 32
    """H: inner optimizer steps between outer steps (the DiLoCo paper uses hundreds)."""
    outer_lr: float = 0.7
    """Learning rate of the outer SGD (the DiLoCo paper's 0.7)."""
    outer_momentum: float = 0.9
    """Momentum of the outer SGD, in ``[0, 1)``."""
    nesterov: bool = True
    """Nesterov momentum for the outer SGD (needs ``outer_momentum > 0``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        lr = self.outer_lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0 or lr != lr or lr == float("inf"):
            raise ValueError(f"outer_lr={lr!r} must be a finite number > 0 (the DiLoCo paper uses 0.7).")
        m = self.outer_momentum
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m < 1:
            raise ValueError(f"outer_momentum={m!r} must be a number in [0, 1) (the DiLoCo paper uses 0.9).")
        _check_bool("nesterov", self.nesterov)
        if self.nesterov and m == 0:
            raise ValueError(
                "nesterov=True needs outer_momentum > 0 (Nesterov momentum without momentum is undefined in torch's "
                "SGD). Pass nesterov=False with outer_momentum=0, or an outer_momentum such as 0.9."
            )


# --- the strategies' keywords: each option declared once, as a field above ------------------------------------------

LIGHTNING_KEYWORDS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")
"""The keywords of every mgpu strategy that are Lightning's: what the Trainer hands the strategy."""

_LIGHTNING_DOCS = {
    "accelerator": "Lightning's accelerator (the Trainer sets it).",
    "parallel_devices": "the devices, one per process (the Trainer sets them).",
    "cluster_environment": "Lightning's cluster environment (the Trainer chooses it).",
    "checkpoint_io": "how checkpoint files are written; default :class:`~lightning_mgpu.AtomicCheckpointIO`. A "
    "plugin you pass is used as it is (atomic saves are then up to it).",
    "precision_plugin": "Lightning's precision plugin (``Trainer(precision=...)`` sets it).",
}

S = TypeVar("S")


def from_arguments(settings: type[S], arguments: Mapping[str, Any], **given: Any) -> S:
    """``settings`` built from a strategy constructor's arguments (its ``locals()``): each field from the argument
    of the same name, ``given`` overriding. The constructor restates no option."""
    names = {f.name for f in fields(cast(Any, settings)) if f.init}
    return settings(**{**{k: v for k, v in arguments.items() if k in names}, **given})


def arguments_of(settings: type, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments (of ``arguments``, a constructor's ``locals()``) that are fields of ``settings``, as keywords
    to hand on to another constructor."""
    names = {f.name for f in fields(settings) if f.init}
    return {k: v for k, v in arguments.items() if k in names}


def lightning_arguments(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """Lightning's keywords (:data:`LIGHTNING_KEYWORDS`) of a strategy constructor's ``locals()``."""
    return {k: arguments[k] for k in LIGHTNING_KEYWORDS if k in arguments}


@functools.cache
def _field_docs() -> dict[str, dict[str, str]]:
    """Class name -> field -> the docstring under the field, read from this module's source."""
    docs: dict[str, dict[str, str]] = {}
    for node in ast.parse(Path(__file__).read_text()).body:
        if not isinstance(node, ast.ClassDef):
            continue
        mine = docs.setdefault(node.name, {})
        for field_node, doc in zip(node.body, node.body[1:]):
            if (
                isinstance(field_node, ast.AnnAssign)
                and isinstance(field_node.target, ast.Name)
                and isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)
            ):
                mine[field_node.target.id] = inspect.cleandoc(doc.value.value)
    return docs


def option_doc(name: str, settings: Iterable[type]) -> Optional[str]:
    """The docstring of option ``name``: that of its field in the first of ``settings`` (or their bases) that
    documents it."""
    for cls in settings:
        for klass in cls.__mro__:
            doc = _field_docs().get(klass.__name__, {}).get(name)
            if doc is not None:
                return doc
    return None


_OPTIONS = "_mgpu_options"  # the class attribute holding the keywords a decorated strategy's constructor takes


def _keywords_of(cls: type) -> tuple[frozenset[str], frozenset[str]]:
    """The keywords ``cls(...)`` takes: its constructor's named arguments, plus (for a ``**`` remainder) those of the
    nearest decorated base it hands them to, else DistributedDataParallel's keywords and the Lightning names refused
    further on with their replacement (:data:`REPLACED_KWARGS`). Returned as (options, DDP keywords)."""
    parameters = inspect.signature(cast(Any, cls).__init__).parameters
    named = {n for n, p in parameters.items() if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return frozenset(named), frozenset()
    base = next((vars(b)[_OPTIONS] for b in cls.__mro__[1:] if _OPTIONS in vars(b)), None)
    if base is not None:
        return frozenset(named | base[0]), base[1]
    return frozenset(named | set(REPLACED_KWARGS)), frozenset(DDP_KEYWORDS)


def strategy_options(*settings: type, var_keyword: str) -> Callable[[type[S]], type[S]]:
    """Class decorator of every strategy, the one place its keywords are documented and checked.

    Documents: its docstring's ``Args:`` section, one entry per keyword of its ``__init__`` (what LightningCLI's
    ``--help`` prints), each the docstring of the settings field that keyword sets (from the first of ``settings``
    that documents it), Lightning's plugins, and ``var_keyword`` for ``**kwargs``. A keyword without a documented
    field fails here, at import.

    Checks: ``cls(...)`` with a keyword it does not take (``pipline_parallel_size=2``) raises ``TypeError`` naming
    the closest options and every option (:func:`check_keywords`), before the constructor runs, instead of Python's
    bare "unexpected keyword argument"; a ``**`` remainder takes what the base it is handed to takes, else
    DistributedDataParallel's keywords."""

    def decorate(cls: type[S]) -> type[S]:
        entries = []
        for name, parameter in inspect.signature(cast(Any, cls).__init__).parameters.items():
            if name == "self":
                continue
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                name, doc = f"**{name}", var_keyword
            else:
                found = _LIGHTNING_DOCS.get(name) or option_doc(name, settings)
                if found is None:
                    raise TypeError(f"{cls.__name__}.__init__({name}=...): no settings field documents it.")
                doc = found
            text = " ".join(doc.split())
            entries.append(
                textwrap.fill(
                    text,
                    116,
                    initial_indent=f"        {name}: ",
                    subsequent_indent=" " * 12,
                    break_on_hyphens=False,
                    break_long_words=False,
                )
            )
        cls.__doc__ = f"{cls.__doc__ or ''}\n\n    Args:\n" + "\n".join(entries) + "\n"
        options, ddp = _keywords_of(cast(type, cls))
        setattr(cls, _OPTIONS, (options, ddp))
        init = vars(cls)["__init__"]
        shown = sorted(options - set(REPLACED_KWARGS))  # refused further on, naming their replacement

        @functools.wraps(init)  # keeps the signature (``__wrapped__``) that LightningCLI reads
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            if any(k not in options and k not in ddp for k in kwargs):
                check_keywords(type(self).__name__, [k for k in kwargs if k not in options], shown, ddp)
            init(self, *args, **kwargs)

        setattr(cls, "__init__", __init__)  # noqa: B010 (a class attribute: mypy refuses the assignment)
        return cls

    return decorate


def split_ddp_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments meant for torch's DistributedDataParallel, with the ones LightningCLI passes at
    their default value dropped (an unknown keyword was refused by :func:`strategy_options` already)."""
    return {k: v for k, v in kwargs.items() if not is_default_ddp_kwarg(k, v)}


def _wrap_classes(value: Any) -> Optional[tuple[type[nn.Module], ...]]:
    if value is None:
        return None
    # A single class is accepted as a one-element list (the common case: one block type per model).
    classes = (value,) if isinstance(value, type) else tuple(value)
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if bad or not classes:
        raise TypeError(
            f"wrap_modules must be nn.Module classes, e.g. [nn.TransformerEncoderLayer]; got {bad or value!r}."
        )
    return classes


@dataclass(frozen=True)
class ShardedSettings:
    """What :class:`~lightning_mgpu.MGPUShardedStrategy` adds to the launch (and, at stage 1, DDP) settings."""

    stage: Stage = 2
    """1: optimizer state sharded; 2: + gradients; 3: + parameters."""
    backend: Backend = "torch"
    """``"torch"`` (ZeroRedundancyOptimizer / FSDP2) or ``"fairscale"`` (OSS / ShardedDataParallel; optional
    extra: ``pip install 'lightning-mgpu[fairscale]'``; stages 1 and 2)."""
    checkpoint: CheckpointLayout = "consolidated"
    """``"consolidated"`` (one file, gathered on rank 0) or ``"sharded"`` (a DCP directory)."""
    wrap_modules: Optional[Sequence[type[nn.Module]]] = None
    """Stages 2/3 torch: module classes that each become an FSDP unit (gathered one at a time); a single class is
    taken as ``[cls]``. Default: transformer layers if the model has any, else each direct child with
    parameters (each member of an ``nn.ModuleList`` or ``nn.ModuleDict`` child, never the container)."""
    micro_batch_size: Optional[MicroBatchSetting] = None
    """Stage 1 only (as for :class:`~lightning_mgpu.MGPUDDPStrategy`); checked with the launch settings."""
    mesh: MeshLayout = "flat"
    """Stages 2/3 torch: ``"flat"`` shards over all ranks; ``"hybrid"`` (HSDP) shards within groups of
    ``shard_size`` ranks and replicates across them (one all-reduce of the shards between replicas per step)."""
    shard_size: Optional[int] = None
    """``mesh="hybrid"`` only: ranks per shard group; ``None``: the processes of one machine (world size /
    ``num_nodes``). Must divide the world size."""
    tensor_parallel_size: int = 1
    """Stages 2/3 torch: ranks that split each layer (tensor parallelism, Lightning's ``"tensor_parallel"`` mesh
    dimension; they see the same batch); the data is sharded over world size / ``tensor_parallel_size`` ranks.
    1: no tensor parallelism."""
    tensor_parallel_plan: TensorParallelPlanSetting = "auto"
    """With ``tensor_parallel_size`` > 1: ``"auto"`` derives the plan for the attention and MLP blocks (the
    model's own ``base_model_tp_plan`` where a Hugging Face model ships one); ``"auto+sequence"`` adds, for a
    Llama-style model, sequence parallelism of the norms and the head split by vocabulary with the loss computed over
    the sharded vocabulary (the logits a step sees are a ``DTensor``; see the tensor-parallel guide); or a dict of
    module-name patterns (``*`` for any one name) to ``"colwise"``, ``"rowwise"``, ``"rowwise_rep"`` (by input
    column with the input whole: any linear layer, one all-reduce of its output), ``"sequence_parallel"`` or a
    ``ParallelStyle``. A ``configure_model`` that applies tensor parallelism itself overrides any of them. An auto
    plan that splits nothing or under half of the linear layers' parameters is refused, with a plan to paste; a dict
    is your choice, never refused for its share: ``{}`` splits nothing (each rank of the tensor group computes the
    whole model)."""
    tensor_comm_stats: bool = False
    """Count in the ledger (``comm_stats.tensor_*``, logged as ``comm/tensor_*``) the collectives that tensor
    parallelism issues over the ``"tensor_parallel"`` group in each training step, measured as they are dispatched:
    their payload and the bytes this rank sends. Off by default: the count passes every operation of the step
    through a Python call (a few microseconds each). With ``tensor_parallel_size=1`` the count stays 0."""
    pipeline_parallel_size: int = 1
    """Pipeline stages: the model's blocks are split into consecutive stages, each trained on its own ranks, the
    batch flowing through them in micro-batches (see the pipeline guide). Must divide the world size; the ranks
    left form the data dimension of each stage: whole replicas at ``stage=2``, the stage's blocks sharded over them
    with FSDP2 at ``stage=3`` (HSDP's shard groups and replicas with ``mesh="hybrid"``). 1: no pipeline."""
    pipeline_schedule: PipelineScheduleName = "1f1b"
    """``"gpipe"`` (all forwards, then all backwards), ``"1f1b"`` (one forward, one backward: fewer activations
    in flight) or ``"interleaved_1f1b"`` (several stages per rank, a smaller bubble)."""
    pipeline_microbatches: Optional[int] = None
    """Micro-batches each batch is cut into (the batch size must divide by it); ``None``: the number of
    stages. The bubble (idle fraction) of GPipe and 1F1B is ``(P - 1) / (m + P - 1)``."""
    pipeline_split: PipelineSplit = "auto"
    """The names of the modules where stages 1, 2, ... begin (``["blocks.2"]``: stage 0 runs ``blocks.0`` and
    ``blocks.1``), all children of one ``nn.Sequential`` or ``nn.ModuleList``; ``"auto"``: that container's
    children split into stages of balanced parameter count (two stages per rank under ``"interleaved_1f1b"``)."""

    offload: Offload = None
    """``"cpu"``: the sharded parameters, their gradients and the optimizer state live in host memory (FSDP2's
    ``CPUOffloadPolicy``, pinned where a GPU exists); each unit's shards are copied to the device for its all-gather,
    the gradients' shards back to the host after its reduce-scatter, and the optimizer steps on the host. Stage 3
    frees the gathered parameters after each forward and backward; stage 2 keeps them gathered on the device from
    the forward to the backward (only the shards, gradients and optimizer state are on the host). Stages 2/3 torch;
    ``None``: everything stays on the device."""

    def __post_init__(self) -> None:
        stage = self.stage
        if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (1, 2, 3):
            raise ValueError(
                f"stage={stage!r} is not a ZeRO stage. Use stage=1 (optimizer state sharded), 2 (+ gradients, "
                f"the default) or 3 (+ parameters), as an int."
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is unknown. Use backend='torch' (default) or 'fairscale'.")
        if self.backend == "fairscale":
            if stage == 3:
                raise ValueError(
                    "stage=3 with backend='fairscale' is not supported: fairscale's FullyShardedDataParallel needs "
                    "CUDA and is unmaintained. Use MGPUShardedStrategy(stage=3) (torch FSDP2, any device), or the "
                    "preset 'mgpu_zero3'."
                )
            if importlib.util.find_spec("fairscale") is None:
                raise ModuleNotFoundError(
                    f"backend='fairscale' needs fairscale, which is not installed. Install it with "
                    f"`{FAIRSCALE_INSTALL}`, or use the torch-native backend: strategy='mgpu_sharded' (stage 2) / "
                    f"'mgpu_zero1' (stage 1)."
                )
        if self.checkpoint not in LAYOUTS:
            raise ValueError(
                f"checkpoint={self.checkpoint!r} is unknown. Use 'consolidated' (one file, loads anywhere) or "
                f"'sharded' (a torch.distributed.checkpoint directory written by all ranks)."
            )
        if self.micro_batch_size is not None and stage != 1:
            raise ValueError(
                f"micro_batch_size={self.micro_batch_size!r} is supported at stage 1 (strategy='mgpu_zero1') and by "
                f"mgpu_ddp, not yet at stage={stage!r}: FSDP2 reduce-scatters gradients only inside a backward, so "
                f"an out-of-memory error there on one rank could not be redone by all. Use stage=1, or leave "
                f"micro_batch_size=None and lower the loader's batch size."
            )
        classes = _wrap_classes(self.wrap_modules)
        object.__setattr__(self, "wrap_modules", classes)
        if classes is not None and not self.uses_fsdp2:
            raise ValueError(
                f"wrap_modules chooses FSDP units, which only stages 2 and 3 with backend='torch' have; got "
                f"stage={stage}, backend={self.backend!r}. Use stage=2 or 3 with backend='torch', or remove "
                f"wrap_modules."
            )
        self._check_mesh()
        self._check_tensor_parallel()
        _check_bool("tensor_comm_stats", self.tensor_comm_stats)
        self._check_pipeline()
        self._check_offload()

    def _check_offload(self) -> None:
        offload = self.offload
        if offload is None:
            return
        if offload != "cpu":
            raise ValueError(
                f"offload={offload!r} is unknown. Use offload='cpu' (parameters, gradients and optimizer state in "
                f"host memory) or None (everything on the device)."
            )
        if not self.uses_fsdp2:
            raise ValueError(
                f"offload='cpu' moves FSDP2's shards to the host, which only stages 2 and 3 with backend='torch' have; "
                f"got stage={self.stage}, backend={self.backend!r}. Use MGPUShardedStrategy(stage=3, offload='cpu') "
                f"(the preset 'mgpu_zero3_offload'), or offload=None."
            )
        for name, size in (
            ("tensor_parallel_size", self.tensor_parallel_size),
            ("pipeline_parallel_size", self.pipeline_parallel_size),
        ):
            if size > 1:
                raise ValueError(
                    f"offload='cpu' with {name}={size} is not built yet: the split layers' collectives run on the "
                    f"device, and the offloaded shards are on the host. Use offload='cpu' with {name}=1, or "
                    f"offload=None."
                )

    def _check_tensor_parallel(self) -> None:
        size, plan = self.tensor_parallel_size, self.tensor_parallel_plan
        _check_whole(
            "tensor_parallel_size",
            size,
            "a whole number of ranks >= 1 (e.g. 2 or the GPUs of one machine); 1 turns tensor parallelism off.",
        )
        if size > 1 and not self.uses_fsdp2:
            raise ValueError(
                f"tensor_parallel_size={size} needs FSDP2 (stage 2 or 3 with backend='torch'); got stage="
                f"{self.stage}, backend={self.backend!r}. Use MGPUShardedStrategy(stage=3, "
                f"tensor_parallel_size={size}) (the preset 'mgpu_tensor_parallel'), or tensor_parallel_size=1."
            )
        if plan == "auto":
            return
        if plan == "auto+sequence":
            if self.pipeline_parallel_size != 1:
                raise ValueError(
                    f"tensor_parallel_plan='auto+sequence' is not supported with pipeline_parallel_size="
                    f"{self.pipeline_parallel_size} (a stage holds only some of the blocks). Use "
                    f"tensor_parallel_plan='auto', or pipeline_parallel_size=1."
                )
            return
        if not isinstance(plan, Mapping) or not all(isinstance(k, str) for k in plan):
            raise ValueError(
                f"tensor_parallel_plan={plan!r} must be 'auto', 'auto+sequence' or a dict of module-name patterns to "
                f"styles, e.g. {{'layers.*.attention.wq': 'colwise', 'layers.*.attention.wo': 'rowwise'}}."
            )
        from torch.distributed.tensor.parallel import ParallelStyle

        for name, style in plan.items():
            if not isinstance(style, ParallelStyle) and style not in TENSOR_PARALLEL_STYLES:
                raise ValueError(
                    f"tensor_parallel_plan[{name!r}]={style!r} is not a tensor-parallel style. Use one of "
                    f"{list(TENSOR_PARALLEL_STYLES)} or an instance of torch.distributed.tensor.parallel's "
                    f"ColwiseParallel / RowwiseParallel / SequenceParallel / PrepareModuleInput."
                )
        if size == 1:
            raise ValueError(
                f"tensor_parallel_plan is a plan of {len(plan)} module(s) but tensor_parallel_size=1, so nothing is "
                f"split. Pass tensor_parallel_size=2 (or more) with it, or remove tensor_parallel_plan."
            )

    def _check_pipeline(self) -> None:
        size = self.pipeline_parallel_size
        _check_whole(
            "pipeline_parallel_size",
            size,
            "a whole number of stages >= 1 (1: no pipeline), e.g. pipeline_parallel_size=2.",
        )
        schedule = self.pipeline_schedule
        if schedule not in PIPELINE_SCHEDULES:
            raise ValueError(
                f"pipeline_schedule={schedule!r} is unknown. Use one of {', '.join(map(repr, PIPELINE_SCHEDULES))}."
            )
        m = self.pipeline_microbatches
        _check_whole(
            "pipeline_microbatches",
            m,
            "a whole number >= 1 that divides the batch size, or None (the number of stages).",
            optional=True,
        )
        split = self.pipeline_split
        if isinstance(split, str):
            if split != "auto":
                raise ValueError(
                    f"pipeline_split={split!r}: give a list of module names where the stages after the first "
                    f"begin (pipeline_split=[{split!r}]), or 'auto'."
                )
        elif not isinstance(split, Sequence) or not all(isinstance(n, str) and n for n in split):
            raise ValueError(f"pipeline_split={split!r} must be a list of module names (e.g. ['blocks.2']) or 'auto'.")
        else:
            object.__setattr__(self, "pipeline_split", tuple(split))
        if size == 1:
            return
        if m is not None and schedule == "1f1b" and m < size:
            raise ValueError(
                f"pipeline_schedule='1f1b' needs at least one micro-batch per stage: pipeline_microbatches={m} < "
                f"pipeline_parallel_size={size}. Use pipeline_microbatches={size} (or more), or "
                f"pipeline_schedule='gpipe'."
            )
        if m is not None and schedule == "interleaved_1f1b" and m % size:
            raise ValueError(
                f"pipeline_schedule='interleaved_1f1b' runs the micro-batches in rounds of "
                f"pipeline_parallel_size={size}: pipeline_microbatches={m} is not a multiple of it. Use "
                f"pipeline_microbatches={size * max(1, round(m / size))}."
            )
        if not isinstance(split, str):
            stages = len(split) + 1
            per_rank = "a multiple of" if schedule == "interleaved_1f1b" else "equal to"
            if (stages % size if schedule == "interleaved_1f1b" else stages != size) or stages < size:
                raise ValueError(
                    f"pipeline_split={list(split)!r} makes {stages} stages, which must be {per_rank} "
                    f"pipeline_parallel_size={size} under pipeline_schedule={schedule!r}. Give "
                    f"{size - 1 if schedule != 'interleaved_1f1b' else 2 * size - 1} module names where stages begin, "
                    f"or pipeline_split='auto'."
                )
        unsupported = []
        if self.stage not in (2, 3):
            unsupported.append(f"stage={self.stage}")
        if self.backend != "torch":
            unsupported.append(f"backend={self.backend!r}")
        if self.mesh != "flat" and self.stage != 3:
            unsupported.append(f"mesh={self.mesh!r} with stage={self.stage}")
        if self.micro_batch_size is not None:
            unsupported.append(f"micro_batch_size={self.micro_batch_size!r}")
        if self.wrap_modules is not None:
            unsupported.append("wrap_modules")
        if self.checkpoint != "consolidated" and self.stage != 3:
            unsupported.append(f"checkpoint={self.checkpoint!r} with stage={self.stage}")
        if unsupported:
            raise ValueError(
                f"pipeline_parallel_size={size} with {', '.join(unsupported)} is not supported yet: with pipeline "
                f"stages the data dimension holds whole replicas of each stage (stage=2, the default: gradients "
                f"all-reduced across them, as DDP does) or shards them with FSDP2 (stage=3, ZeRO-3 over the data "
                f"dimension, or HSDP with mesh='hybrid'); stage=1 inside it is not implemented yet, sharded "
                f"checkpoints (checkpoint='sharded') are written at stage=3 only. Remove {', '.join(unsupported)} "
                f"(keep stage=2 or 3, backend='torch', mesh='flat' or, at stage=3, 'hybrid', "
                f"checkpoint='consolidated' or, at stage=3, 'sharded'), or train without pipeline_parallel_size."
            )

    @property
    def pipelined(self) -> bool:
        """Whether the model is split into pipeline stages (``pipeline_parallel_size > 1``)."""
        return self.pipeline_parallel_size > 1

    @property
    def data_sharding(self) -> Optional[int]:
        """The ZeRO stage the data dimension applies to the model's states: ``stage``, except inside a pipeline at
        ``stage=2``, where the data ranks of each stage hold whole replicas of it (None: gradients all-reduced, as
        DDP does).

            >>> ShardedSettings(stage=2).data_sharding, ShardedSettings(stage=2, pipeline_parallel_size=2).data_sharding
            (2, None)
        """
        return None if self.pipelined and self.stage == 2 else self.stage

    def _check_mesh(self) -> None:
        if self.mesh not in MESHES:
            raise ValueError(
                f"mesh={self.mesh!r} is unknown. Use mesh='flat' (shard over all ranks, the default) or 'hybrid' "
                f"(shard within each machine, replicate across machines)."
            )
        size = self.shard_size
        _check_whole(
            "shard_size",
            size,
            "a whole number of ranks >= 1 (e.g. the GPUs of one machine), or None for the processes of one machine.",
            optional=True,
        )
        if size is not None and self.mesh != "hybrid":
            raise ValueError(
                f"shard_size={size} sets the shard group of a hybrid mesh, but mesh={self.mesh!r}. Pass "
                f"mesh='hybrid' with it, or remove shard_size."
            )
        if self.mesh == "hybrid" and not self.uses_fsdp2:
            raise ValueError(
                f"mesh='hybrid' (shard within a machine, replicate across machines) needs FSDP2: stage 2 or 3 with "
                f"backend='torch'; got stage={self.stage}, backend={self.backend!r}. Use "
                f"MGPUShardedStrategy(stage=3, mesh='hybrid') (the preset 'mgpu_hsdp'), or mesh='flat'."
            )

    def mesh_shape(self, world_size: int, num_nodes: int = 1) -> tuple[int, int]:
        """``(replicas, shard group size)`` of the device mesh at ``world_size`` ranks on ``num_nodes`` machines:
        ``(1, world_size)`` for the flat mesh; for the hybrid one the shard group is ``shard_size`` ranks, by
        default the processes of one machine.

        Example:

            >>> ShardedSettings(stage=3, mesh="hybrid").mesh_shape(world_size=16, num_nodes=2)
            (2, 8)
            >>> ShardedSettings(stage=3, mesh="hybrid", shard_size=4).mesh_shape(world_size=16, num_nodes=2)
            (4, 4)
        """
        dims = self.parallel_dims(world_size, num_nodes)
        return (dims.data_replicate, dims.data_shard)

    def parallel_dims(self, world_size: int, num_nodes: int = 1) -> ParallelDims:
        """The device mesh's sizes (:mod:`lightning_mgpu.mesh`): flat, or HSDP's shape for ``mesh="hybrid"``, with
        ``tensor_parallel_size`` ranks in the tensor dimension and ``pipeline_parallel_size`` stages."""
        tensor, size = self.tensor_parallel_size, self.pipeline_parallel_size
        if world_size % tensor:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0 and d <= tensor]
            raise ValueError(
                f"tensor_parallel_size={tensor} does not divide the world size {world_size} (devices x num_nodes): "
                f"each tensor-parallel group needs {tensor} ranks. Use tensor_parallel_size={divisors[-1]} (a "
                f"divisor of {world_size}), or launch a multiple of {tensor} processes."
            )
        if world_size % size:
            raise ValueError(
                f"pipeline_parallel_size={size} does not divide the world size {world_size} (devices x num_nodes): "
                f"every data-parallel replica needs all {size} stages. Use pipeline_parallel_size="
                f"{math.gcd(size, world_size)}, or devices x num_nodes a multiple of {size}."
            )
        if self.mesh == "flat":
            return ParallelDims(world_size=world_size, tensor=tensor, pipeline=size)
        return ParallelDims.hybrid(world_size, num_nodes, self.shard_size, tensor=tensor, pipeline=size)

    @property
    def unit_classes(self) -> Optional[tuple[type[nn.Module], ...]]:
        """``wrap_modules`` as the tuple it is normalised to (for ``isinstance``)."""
        return tuple(self.wrap_modules) if self.wrap_modules is not None else None

    @property
    def uses_ddp(self) -> bool:
        """Stage 1 (either backend): the model is wrapped in torch's DistributedDataParallel."""
        return self.stage == 1

    @property
    def uses_fsdp2(self) -> bool:
        return self.stage in (2, 3) and self.backend == "torch"

    def check_fault_tolerance(self, fault_tolerance: Any) -> None:
        """Fault-tolerant replica groups are built over one flat torch-native ZeRO stage 2 or 3 inside each group
        (the groups replicate its shards); refuse the layouts around it that are not built yet, naming them."""
        if fault_tolerance in (None, False):  # off, as CommonSettings reads it
            return
        refused = [
            f"{name}={value!r}"
            for name, value, built in (
                ("stage", self.stage, self.stage != 1),
                ("backend", self.backend, self.backend == "torch"),
                ("mesh", self.mesh, self.mesh == "flat"),
                ("tensor_parallel_size", self.tensor_parallel_size, self.tensor_parallel_size == 1),
                ("pipeline_parallel_size", self.pipeline_parallel_size, self.pipeline_parallel_size == 1),
                ("offload", self.offload, self.offload is None),
            )
            if not built
        ]
        if refused:
            raise ValueError(
                f"fault_tolerance with {', '.join(refused)} is not built yet: the replica groups replicate one flat "
                f"ZeRO stage 2 or 3 (backend='torch', mesh='flat', no tensor or pipeline split, no offload). Use "
                f"MGPUShardedStrategy(stage=3, fault_tolerance=...) or MGPUDDPStrategy(fault_tolerance=...)."
            )

    def check_ddp_settings(self, given: Mapping[str, Any]) -> None:
        """Refuse DDP all-reduce settings (``comm_hook=...``, ``bucket_cap_mb=...``) where the gradients are not
        all-reduced by DDP (stages 2 and 3)."""
        if self.uses_ddp:
            return
        ddp_only = [f"{k}={v!r}" for k, v in given.items() if v not in (None, False)]
        if ddp_only:
            raise ValueError(
                f"{', '.join(ddp_only)}: DDP all-reduce settings, which stage {self.stage} does not use (gradients "
                f"are reduce-scattered). Use stage=1 (the preset 'mgpu_zero1') for them, or remove them."
            )


def sharded_strategy_settings(arguments: Mapping[str, Any]) -> tuple[ShardedSettings, CommonSettings]:
    """:class:`~lightning_mgpu.MGPUShardedStrategy`'s constructor ``arguments`` (its ``locals()``) as its settings: the
    sharding ones, and those every strategy has, which at stage 1 (a DistributedDataParallel model) are mgpu_ddp's
    (:class:`DDPSettings`, with the DDP keyword arguments). Refused with the fix: fault tolerance where the layout
    cannot take it, DDP all-reduce settings at stages 2 and 3."""
    sharded = from_arguments(ShardedSettings, arguments)
    sharded.check_fault_tolerance(arguments["fault_tolerance"])
    ddp_kwargs = split_ddp_kwargs(arguments["ddp_kwargs"])
    ddp_only = {name: arguments[name] for name in ("comm_hook", "static_graph", "find_unused_parameters")}
    sharded.check_ddp_settings({**ddp_only, **ddp_kwargs})
    if sharded.uses_ddp:
        return sharded, from_arguments(DDPSettings, arguments, ddp_kwargs=ddp_kwargs)
    return sharded, from_arguments(CommonSettings, arguments)


@dataclass(frozen=True)
class AutoSettings:
    """What :class:`~lightning_mgpu.MGPUAutoStrategy` plans with (its common options are the strategies' own)."""

    device_memory: Optional[Union[str, int]] = None
    """The memory of one device, bytes or e.g. ``"8GiB"``; ``None``: on CUDA the device's total memory, on CPU
    the machine's available memory divided by the processes on it."""
    headroom: float = 0.10
    """The fraction of ``device_memory`` kept free."""
    strategies: Optional[Sequence[str]] = None
    """The candidates, in the planner's order; ``None``: every strategy the planner knows. Manual optimization
    keeps mgpu_ddp."""
    micro_batch_size: Optional[MicroBatchSetting] = None
    """Passed to the chosen strategy (see :class:`~lightning_mgpu.MGPUDDPStrategy`); given, only the strategies
    that micro-batch (mgpu_ddp, mgpu_zero1) are candidates."""

    def __post_init__(self) -> None:
        # device_memory is parsed by the planner's memory-size parser, in the strategy (settings import no planner)
        h = self.headroom
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 <= h < 1:
            raise ValueError(f"headroom={h!r} must be a fraction in [0, 1), e.g. headroom=0.1 for 10%.")
        given = self.strategies
        candidates = tuple(given) if given is not None else STRATEGIES
        unknown = [s for s in candidates if s not in STRATEGIES]
        if unknown or not candidates:
            raise ValueError(f"strategies={list(candidates)!r}: {unknown or 'none given'}; choose from {STRATEGIES}.")
        if self.micro_batch_size is not None:
            _check_micro_batch_size(self.micro_batch_size)
            candidates = tuple(s for s in candidates if s in ("mgpu_ddp", "mgpu_zero1"))
            if not candidates:
                raise ValueError(
                    f"micro_batch_size={self.micro_batch_size!r} works with mgpu_ddp and mgpu_zero1 only; strategies="
                    f"{list(given or ())!r} names neither. Add one, or leave micro_batch_size=None."
                )
        object.__setattr__(self, "strategies", candidates)
