"""Autopilot, part 1: a memory plan before launch.

:func:`plan` predicts, for every candidate (``mgpu_ddp``, ``mgpu_zero1``, ``mgpu_sharded``, ``mgpu_zero3``, and
``mgpu_hsdp`` on several machines; with
and without activation checkpointing; each precision), the peak memory per rank split into parameters,
gradients, optimizer state, activations and communication buffers, says which fit the device with the
headroom kept free, and recommends the fastest that fits. Nothing is allocated and no process is started:
the model is built, stepped and traced under ``FakeTensorMode`` with torch's ``MemTracker``. A model whose
constructor fails under fake tensors (``self.double()`` in ``__init__``, lazy layers) is built once on the meta
device, or failing that for real on CPU, and traced as fake stand-ins of that build. A model instance (and the
module ``mgpu_auto`` is given) is never copied: the planner steps a stand-in of it, its module tree with fake
tensors sharing every other object it holds (:mod:`~lightning_mgpu.planning.stand_in`).

Example::

    >>> import lightning_mgpu
    >>> p = lightning_mgpu.plan("configs/ddp.yaml", devices=2, device_memory="1GiB")  # doctest: +SKIP
    >>> p.recommended.strategy  # doctest: +SKIP
    'mgpu_ddp'

From the shell: ``lightning-mgpu plan --config configs/ddp.yaml --devices 8 --device-memory 80GiB [--json]``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch

from lightning_mgpu._compat import tree_map_tensors
from lightning_mgpu.planning.candidates import ORDER, NoPlanFits, Plan, PlanRow, estimate
from lightning_mgpu.planning.layouts import (
    DEFAULT_DEVICE_TFLOPS,
    SCHEDULES,
    Layout,
    LayoutPlan,
    Links,
    estimate_layouts,
)
from lightning_mgpu.planning.request import (
    DEFAULT_PRECISIONS,
    LINK_SPEEDS,
    PRECISIONS,
    STRATEGIES,
    PlanError,
    PlanRequest,
    format_bytes,
    parse_memory,
)
from lightning_mgpu.planning.source import default_policy, resolve_source
from lightning_mgpu.planning.trace import (
    ModelStates,
    StepTrace,
    count_model_states,
    tensor_split,
    trace_step,
    unit_fractions,
)
from lightning_mgpu.quantization import bitsandbytes_weights
from lightning_mgpu.settings import from_arguments, validate_save

__all__ = [
    "DEFAULT_PRECISIONS",
    "LINK_SPEEDS",
    "ORDER",
    "PRECISIONS",
    "STRATEGIES",
    "Layout",
    "LayoutPlan",
    "Links",
    "NoPlanFits",
    "Plan",
    "PlanError",
    "PlanRequest",
    "PlanRow",
    "format_bytes",
    "parse_memory",
    "plan",
    "plan_layouts",
]


def plan(
    model_or_config: Any,
    devices: int,
    device_memory: Union[str, int],
    batch: Any = None,
    datamodule: Any = None,
    headroom: float = 0.10,
    precisions: Optional[tuple[str, ...]] = None,
    strategies: Optional[tuple[str, ...]] = None,
    activation_checkpointing: Any = None,
    activation_checkpointing_save: Any = None,
    bucket_cap_mb: float = 25.0,
    require_fit: bool = True,
    num_nodes: int = 1,
    offload: bool = False,
    host_memory: Union[str, int, None] = None,
) -> Plan:
    """Plan the memory of training ``model_or_config`` on ``devices`` ranks of ``device_memory`` each.

    Args:
        model_or_config: a ``lightning-mgpu fit`` YAML config path, a model class or its import path (built with
            its defaults), a zero-argument factory, or an instance (never copied nor modified: a stand-in of it
            with fake tensors is stepped; ``configure_model()`` is called on it, lazy layers materialized in it).
        devices: ranks (data-parallel world size).
        device_memory: per device, e.g. ``"80GiB"``.
        batch: one micro-batch per device (real or meta tensors); default: the first batch of ``datamodule``'s
            (or the config's data module's) ``train_dataloader``, else of the module's own
            ``train_dataloader()``, else its ``example_input_array`` (traced through ``forward``), as Lightning
            finds its data.
        headroom: fraction of the device kept free.
        precisions: default ``("32-true", "bf16-mixed", "bf16-master")``.
        strategies: default all four.
        activation_checkpointing: the policy of the "with AC" candidates; default the config's, else the
            transformer layers, else every block of the outermost containers; a model with neither (layers kept
            as plain attributes) gets no "with AC" candidates.
        activation_checkpointing_save: what each checkpointed block keeps (selective checkpointing: ``"matmuls"``,
            operator names or a memory budget, as the strategies' option); default the config's, else nothing
            kept (whole blocks recomputed). The "with AC" candidates' activations are traced with it.
        bucket_cap_mb: DDP's bucket size.
        require_fit: raise :class:`NoPlanFits` (naming the smallest plan and its shortfall) when nothing fits.
        num_nodes: machines the ``devices`` ranks are spread over; with more than one, ``mgpu_hsdp`` (sharded
            within a machine, its memory per rank that of ``devices / num_nodes`` ranks) is a candidate too.
        offload: plan the sharded candidates as ``offload="cpu"`` runs them (shards, gradients and optimizer state
            in host memory; the rows add host bytes per rank and the bytes moved per micro-batch).
        host_memory: one machine's host memory (e.g. ``"512GiB"``), checked against the offloaded rows with the
            same headroom; default not checked.

    Example:

        >>> import torch
        >>> from lightning_mgpu import plan
        >>> from lightning_mgpu.examples import DigitsCNN
        >>> batch = (torch.zeros(32, 1, 8, 8), torch.zeros(32, dtype=torch.long))
        >>> p = plan(DigitsCNN, devices=2, device_memory="1GiB", batch=batch, precisions=("32-true",))
        >>> p.recommended.strategy, p.recommended.activation_checkpointing
        ('mgpu_ddp', False)
    """
    request = _request(locals())
    start = time.perf_counter()
    source, states, traces, units, _, _ = _traced(model_or_config, request, batch, datamodule)
    return estimate(
        source.name,
        request,
        states,
        traces,
        units,
        seconds=time.perf_counter() - start,
        require_fit=require_fit,
        built=source.how_built,
    )


def _traced(
    model_or_config: Any, request: PlanRequest, batch: Any, datamodule: Any
) -> tuple[Any, ModelStates, list[StepTrace], tuple[float, float], Any, Any]:
    """The model's source, its counted states, one traced step per precision (with and without activation
    checkpointing), its FSDP units, the checkpointing policy and what its blocks keep (the request's, else the
    config's): what the memory plan and the layout plan combine."""
    with torch.random.fork_rng(devices=[]):  # the model's initialisation under fake tensors draws nothing real
        source = resolve_source(model_or_config, batch=batch, datamodule=datamodule)
        _refuse_bitsandbytes(source)
        try:
            policy = request.activation_checkpointing or source.policy or default_policy(source.factory)
            save = request.activation_checkpointing_save
            save = save if save is not None else source.save
            validate_save(save)
            states = count_model_states(source.factory)
            # tensor parallelism's auto plan, once, on the real weights where there are any (its structure checked
            # as at start-up, outside FakeTensorMode); else each trace derives it on its fake build by the name rules
            split = tensor_split(source.real, real=True) if source.real is not None else None
            # no policy: the model has no blocks to checkpoint (no transformer layers, no Sequential/ModuleList),
            # so every candidate runs without activation checkpointing
            traces = [
                trace_step(
                    source.factory,
                    source.batch,
                    precision,
                    ac_policy,
                    forward=source.forward,
                    split=split,
                    save=save if ac_policy is not None else None,
                )
                for precision in request.precisions
                for ac_policy in ((None, policy) if policy is not None else (None,))
            ]
            units = unit_fractions(source.factory)
        except PlanError:
            raise
        except Exception as err:
            lines = str(err).strip().splitlines()
            why = f"{type(err).__name__}: {lines[0] if lines else ''}"
            if "DataDependent" in type(err).__name__ or "_local_scalar_dense" in why:
                hint = (
                    "a step that reads a tensor's value (.item(), .tolist(), printing it, a shape that depends on "
                    "the data) cannot be traced without data. Choose the strategy yourself (mgpu_auto takes "
                    "mgpu_ddp), or plan a module without that read."
                )
            else:
                hint = (
                    "if the step fails so on real tensors too, the error is the model's own; else choose the strategy "
                    "yourself (mgpu_auto takes mgpu_ddp)."
                )
            raise PlanError(f"{source.name} could not be stepped on fake tensors ({why}): {hint}") from err
    return source, states, traces, units, policy, save


def _refuse_bitsandbytes(source: Any) -> None:
    """A model with weights bitsandbytes quantized is not planned, with the reason and what it trains under:
    bitsandbytes' 4-bit layers do not step on fake tensors, and the layouts that shard with FSDP2 refuse such a base
    (:func:`~lightning_mgpu.quantization.refuse_bitsandbytes_shards`)."""
    quantized = bitsandbytes_weights(source.real) if source.real is not None else []
    if quantized:
        raise PlanError(
            f"{source.name} has weights quantized by bitsandbytes ({quantized[0]}"
            f"{f' and {len(quantized) - 1} more' if len(quantized) > 1 else ''}), "
            f"which the planner cannot step on fake tensors and the sharded layouts refuse (FSDP2 would split their "
            f"packed bytes without bitsandbytes' quantization state). Train it with strategy='mgpu_ddp' or "
            f"'mgpu_zero1', the base whole on each rank (mgpu_auto takes mgpu_ddp); to plan and shard a 4-bit base, "
            f"load it in full precision and pack its frozen weights with lightning_mgpu.quantize_frozen (torchao's "
            f"NF4)."
        )


def policy_source(policy: Any) -> str:
    """A checkpointing policy as the Python source that names it in a strategy line: the class names of a class or
    a collection of classes and names (``'["TransformerEncoderLayer"]'``), an ``EveryNth``'s ``repr``, else
    ``"<your policy>"`` (a function: pass your own).

    >>> from torch import nn
    >>> policy_source({nn.TransformerEncoderLayer}), policy_source("Block")
    ('["TransformerEncoderLayer"]', '["Block"]')
    """
    from lightning_mgpu.settings import EveryNth

    if isinstance(policy, EveryNth):
        return repr(policy)
    items = [policy] if isinstance(policy, (str, type)) else policy
    if isinstance(items, (list, tuple, set, frozenset)) and all(isinstance(i, (str, type)) for i in items):
        names = sorted(i if isinstance(i, str) else i.__name__ for i in items)
        return "[" + ", ".join(f'"{n}"' for n in names) + "]"
    return "<your policy>"


def plan_layouts(
    model_or_config: Any,
    devices: int,
    device_memory: Union[str, int],
    num_nodes: int = 1,
    batch: Any = None,
    datamodule: Any = None,
    headroom: float = 0.10,
    precisions: Optional[tuple[str, ...]] = None,
    strategies: Optional[tuple[str, ...]] = None,
    activation_checkpointing: Any = None,
    activation_checkpointing_save: Any = None,
    bucket_cap_mb: float = 25.0,
    intra_node_link: Union[str, float] = "nvlink",
    inter_node_link: Union[str, float] = "infiniband",
    device_tflops: float = DEFAULT_DEVICE_TFLOPS,
    pipeline_microbatches: Optional[int] = None,
    pipeline_schedules: tuple[str, ...] = SCHEDULES,
    tensor_across_machines: bool = False,
    offload: bool = False,
    host_memory: Union[str, int, None] = None,
) -> LayoutPlan:
    """Every layout (data replicate x data shard x tensor x pipeline, with the data dimension's ZeRO stage) of
    ``model_or_config`` on ``devices`` ranks over ``num_nodes`` machines, with memory per rank by component,
    communication per step on each link and an estimated step time; those that fit first, fastest first
    (:mod:`~lightning_mgpu.planning.layouts`).

    ``model_or_config``, ``devices``, ``device_memory``, ``num_nodes``, ``batch``, ``datamodule``, ``headroom``,
    ``precisions``, ``strategies``, ``activation_checkpointing``, ``bucket_cap_mb``, ``offload`` and ``host_memory``
    are as in :func:`plan` (``batch``: the loader's batch of one data-parallel rank; offloaded, a layout that splits
    the model is not buildable, and the transfers are added to the step time).

    Args:
        intra_node_link: the link within a machine: a name of
            :data:`~lightning_mgpu.planning.request.LINK_SPEEDS` (``"nvlink"``, ``"pcie"``, ``"infiniband"``,
            ``"ethernet"``) or GB/s per device in each direction.
        inter_node_link: the link across machines, likewise.
        device_tflops: the rate one device sustains (TFLOP/s).
        pipeline_microbatches: micro-batches per batch (default: the batch size).
        pipeline_schedules: of ``("1f1b", "gpipe")``.
        tensor_across_machines: allow tensor groups wider than one machine (default no).

    Example:

        >>> import torch
        >>> from lightning_mgpu import plan_layouts
        >>> from lightning_mgpu.planning.lm import TransformerLM
        >>> tokens = torch.zeros(4, 64, dtype=torch.long)
        >>> p = plan_layouts(lambda: TransformerLM(vocab=256, d_model=32, heads=4, layers=4), devices=4,
        ...                  device_memory="1GiB", batch=(tokens, tokens), precisions=("32-true",))
        >>> p.best.name, p.best.fits
        ('mgpu_ddp 4', True)
        >>> p.memory.recommended.strategy  # the memory plan of the data-parallel candidates, from the same trace
        'mgpu_ddp'
    """
    links = Links.of(intra_node_link, inter_node_link)
    request = _request(locals())
    start = time.perf_counter()
    source, states, traces, units, policy, save = _traced(model_or_config, request, batch, datamodule)
    result = estimate_layouts(
        source.name,
        request,
        states,
        traces,
        units,
        batch_size=batch_rows(source.batch),
        links=links,
        device_tflops=device_tflops,
        microbatches=pipeline_microbatches,
        schedules=tuple(pipeline_schedules),
        tensor_across_machines=tensor_across_machines,
    )
    seconds = time.perf_counter() - start
    result.memory = estimate(
        source.name, request, states, traces, units, seconds=seconds, require_fit=False, built=source.how_built
    )
    result.checkpointing_source = policy_source(policy) if policy is not None else ""
    result.checkpointing_save = save
    return result


def batch_rows(batch: Any) -> int:
    """The rows of a batch: the first dimension of its first tensor (1 when it holds none)."""
    found: list[torch.Tensor] = []
    tree_map_tensors(found.append, batch)
    return int(found[0].shape[0]) if found and found[0].dim() else 1


def _request(arguments: Mapping[str, Any]) -> PlanRequest:
    """The request of :func:`plan`'s or :func:`plan_layouts`'s arguments (its ``locals()``): each field from the
    argument of the same name, with the default precisions and strategies for None."""
    precisions, strategies = arguments["precisions"], arguments["strategies"]
    return from_arguments(
        PlanRequest,
        arguments,
        precisions=precisions if precisions is not None else DEFAULT_PRECISIONS,
        strategies=strategies if strategies is not None else STRATEGIES,
    )
