"""How each sharding backend of :class:`~lightning_mgpu.MGPUShardedStrategy` wraps the model and the
optimizers, blocks gradient sync, and reads and writes its state.

Two families:

* **Partitioned optimizer** (stage 1 torch: ``ZeroRedundancyOptimizer``; stage 1/2 fairscale: ``OSS``): each
  rank owns whole parameters' optimizer state and steps only those, then broadcasts them. Parameters stay
  plain, full tensors. Stage 2 fairscale adds ``ShardedDataParallel``, which reduces each gradient to its
  owner only.
* **FSDP2** (stage 2/3 torch: ``fully_shard``): parameters, gradients and optimizer state are ``DTensor``
  shards along dim 0; stage 2 keeps parameters gathered from forward to backward
  (``reshard_after_forward=False``), stage 3 gathers them again for backward.

Both write checkpoints in two layouts that do not depend on the world size:

* *consolidated*: exactly what one process with a plain optimizer saves (``optimizer.state_dict()`` keyed by
  parameter index), so it loads on one device without this package;
* *sharded*: ``torch.distributed.checkpoint`` (DCP) with the optimizer state keyed by parameter name
  (``{"state": {fqn: {...}}, "param_groups": [...]}``, the layout of torch's ``get_optimizer_state_dict`` and
  Lightning's ``ModelParallelStrategy``). DCP re-slices tensors on load, so each rank of any world size reads
  the pieces it now owns.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.optim import Optimizer

from lightning_mgpu._compat import copy_lr_scheduler_step_tracking, init_optimizer_state, sync_param_groups
from lightning_mgpu.comm import full_tensor, local_shard
from lightning_mgpu.ledger import CommStats
from lightning_mgpu.mesh import ParallelMesh
from lightning_mgpu.parts.accumulation import (
    BackwardSyncControl,
    DDPSyncControl,
    FSDP2SyncControl,
    ShardedDDPSyncControl,
)
from lightning_mgpu.parts.activation_checkpointing import classes_present
from lightning_mgpu.parts.clipping import GlobalNormClipping
from lightning_mgpu.parts.tensor_parallel import fsdp_dim
from lightning_mgpu.quantization import check_shardable, has_nf4, is_nf4, refuse_bitsandbytes_shards

# Optimizers whose state is not one elementwise tensor per parameter: no backend can split them.
_UNSHARDABLE = {
    "LBFGS": "its state is one flat history over all parameters and its step re-evaluates the closure",
    "SparseAdam": "it needs sparse gradients, which DDP, ZeRO and FSDP do not reduce",
}
# Optimizers that need whole matrices (factored or orthogonalised updates): fine when a rank owns whole
# parameters (stage 1), wrong on FSDP2's row shards.
_NEEDS_WHOLE_PARAMETERS = {"Adafactor", "Muon"}


def check_optimizer(optimizer: Optimizer, stage: int, backend: str) -> None:
    """Refuse an optimizer this (stage, backend) cannot shard correctly, naming what to use instead."""
    name = type(optimizer).__name__
    bases = {c.__name__ for c in type(optimizer).__mro__}
    for bad, why in _UNSHARDABLE.items():
        if bad in bases:
            raise TypeError(
                f"mgpu_sharded cannot shard {name}: {why}. Use an optimizer with per-parameter state "
                f"(SGD, Adam, AdamW, RMSprop, ...), or train {name} with strategy='mgpu_ddp'."
            )
    if stage >= 2 and backend == "torch" and bases & _NEEDS_WHOLE_PARAMETERS:
        raise TypeError(
            f"{name} computes its update from whole weight matrices, but stage {stage} gives each rank row "
            f"shards of every parameter. Use MGPUShardedStrategy(stage=1) (each rank owns whole parameters), "
            f"or an elementwise optimizer such as AdamW."
        )


def param_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` (the first name of a shared parameter), names as in ``module.state_dict()``."""
    return {id(p): name for name, p in module.named_parameters()}


def optimizer_params(optimizer: Optimizer) -> list[torch.Tensor]:
    """Parameters in ``optimizer.state_dict()`` index order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def rebind_schedulers(lr_scheduler_configs: list[Any], old: Optimizer, new: Optimizer) -> None:
    """Point Lightning's schedulers at the wrapping optimizer (whose ``param_groups`` the step reads), with
    torch's "optimizer.step() was called" tracking carried over, so no spurious ordering warning appears."""
    for config in lr_scheduler_configs:
        if getattr(config.scheduler, "optimizer", None) is old:
            config.scheduler.optimizer = new
    copy_lr_scheduler_step_tracking(old, new)


@dataclass(frozen=True)
class ShardMemory:
    """Bytes this rank holds right now (a DTensor counts its local shard), from
    ``trainer.strategy.memory_report()`` of :class:`~lightning_mgpu.MGPUShardedStrategy` (no communication).

    Example:

        >>> import pytorch_lightning as pl, torch
        >>> from lightning_mgpu import MGPUShardedStrategy
        >>> from lightning_mgpu.examples import DigitsCNN, DigitsDataModule
        >>> class Report(pl.Callback):
        ...     def on_train_end(self, trainer, module):
        ...         memory = trainer.strategy.memory_report()
        ...         print(memory.parameters == sum(p.numel() * 4 for p in module.parameters()))
        >>> trainer = pl.Trainer(strategy=MGPUShardedStrategy(stage=3), accelerator="cpu", devices=1, max_steps=2,
        ...                      callbacks=[Report()], logger=False, enable_checkpointing=False,
        ...                      enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(DigitsCNN(), DigitsDataModule())  # on 1 rank the shard is the whole model
        True
    """

    optimizer_state: int
    gradients: int
    parameters: int


class ShardingBackend:
    """One (stage, backend) pair. The strategy calls these in its own lifecycle hooks."""

    stage: int
    wraps_with_ddp = False
    """Stage 1: the model is wrapped in mgpu_ddp's ``DistributedDataParallel`` (gradients all-reduced)."""
    sync_control: BackwardSyncControl = DDPSyncControl()
    """How accumulation blocks the gradient sync of the wrapped model."""
    keeps_masters = False
    """The backend's own sharded FP32 parameters are the master copy in the precision plugin's master modes (FSDP2
    shards with a ``MixedPrecisionPolicy``): the plugin then neither casts the module nor keeps masters itself."""
    needs_global_norm = False
    """Norm clipping needs :class:`~lightning_mgpu.MGPUPrecision` (a plain plugin would clip each rank's shard by
    its own norm; FSDP2's DTensor gradients are clipped globally by torch's own ``clip_grad_norm_``)."""

    def __init__(self, stage: int) -> None:
        self.stage = stage

    # --- before launch ------------------------------------------------------------------------------
    def check_precision(self, mode: str) -> None:
        """At Trainer construction, with MGPUPrecision's master mode ``mode``: refused where this backend cannot
        keep separate FP32 masters (nothing to refuse here)."""

    def check_before_launch(self, model: nn.Module, precision_plugin: Any, clip_by_norm: Any, shard_ranks: int) -> None:
        """Before launch: what this backend cannot shard or clip, refused with the fix (nothing here).
        ``clip_by_norm``: the Trainer's ``gradient_clip_val`` where it clips by norm, else None; ``shard_ranks``: the
        ranks of one shard group."""

    def memory_report(self, module: nn.Module, optimizers: Any) -> ShardMemory:
        """Optimizer-state, gradient and parameter bytes this rank holds now for ``module`` and ``optimizers`` (a
        ``DTensor`` counts its local shard; no communication)."""
        opt_bytes = 0
        for opt in optimizers:
            local = self.local_optimizer(opt)
            for state in local.state.values():
                opt_bytes += sum(local_bytes(v) for v in state.values())
        grads = sum(local_bytes(p.grad) for p in module.parameters() if p.grad is not None)
        params = sum(local_bytes(p) for p in module.parameters())
        return ShardMemory(optimizer_state=opt_bytes, gradients=grads, parameters=params)

    # --- model and optimizers -----------------------------------------------------------------------
    def is_sharded(self, model: nn.Module) -> bool:
        """Whether ``model`` is sharded in place already (FSDP2 cannot be undone: a later evaluation keeps it)."""
        return False

    @staticmethod
    @torch.no_grad()
    def state_to_device(model: nn.Module, device: torch.device) -> None:
        """Moves what a module sharded in place holds outside its shards to ``device``: every submodule without a
        sharded parameter below it moves whole (its buffers, plain parameters and whatever its own ``_apply`` moves,
        such as a torchmetrics metric's states), and a module above the shards moves its own buffers and plain
        parameters; the sharded parameters (DTensors) stay with FSDP, which owns their storage.

        >>> from lightning_mgpu.parts.sharding import ShardingBackend
        >>> m = nn.Sequential(nn.Module())
        >>> m[0].register_buffer("offset", torch.zeros(2))
        >>> ShardingBackend.state_to_device(m, torch.device("meta"))
        >>> m[0].offset.device.type
        'meta'
        """
        from torch.distributed.tensor import DTensor

        def holds_shards(module: nn.Module) -> bool:
            return any(isinstance(p, DTensor) for p in module.parameters())

        if not holds_shards(model):
            model.to(device)
            return
        for child in model.children():
            ShardingBackend.state_to_device(child, device)
        for name, buffer in list(model.named_buffers(recurse=False)):
            if buffer.device != device:
                setattr(model, name, buffer.to(device))  # stays a buffer (persistent or not) of the module
        for param in model.parameters(recurse=False):
            if not isinstance(param, DTensor) and param.device != device:
                param.data = param.data.to(device)

    def shard_mesh(self, mesh: ParallelMesh) -> Any:
        """The part of the strategy's device mesh the model is sharded over, or None where the backend takes a
        process group."""
        return None

    @property
    def mesh_shape(self) -> Optional[tuple[int, int]]:
        """``(replicas, shard group size)`` of the mesh from :meth:`shard_mesh`; None before, or where the
        backend takes a process group."""
        return None

    def forward_is_collective(self, model: nn.Module) -> bool:
        """Whether every forward of ``model`` is a collective (parameters gathered, buffers broadcast): ranks
        must then run the same number of forwards."""
        return False

    def start_uneven_evaluation(self, model: nn.Module) -> None:
        """Before an evaluation loop whose ranks may run different numbers of batches: do the forward's
        collective once for the loop (FSDP2: gather the parameters and keep them, so every rank holds the whole
        model until :meth:`end_uneven_evaluation`), so that no forward of the loop is a collective."""

    def end_uneven_evaluation(self, model: nn.Module) -> None:
        """After that loop: back to the collective in every forward (FSDP2: the shards)."""

    def mixed_precision_policy(self, policy: Any) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` (``policy``: the precision plugin's, in master modes), or None: only
        FSDP2 takes one."""
        return None

    def shard_model(self, module: nn.Module, mesh: Any, mp_policy: Any = None) -> Optional[nn.Module]:
        """Before the optimizers exist. Returns the module to train, or None to keep the strategy's.
        ``mp_policy``: FSDP2's ``MixedPrecisionPolicy`` from the precision plugin (master modes)."""
        return None

    def wrap_optimizer(self, optimizer: Optimizer, group: Any) -> Optimizer:
        return optimizer

    def wrap_after_optimizers(self, module: nn.Module, optimizers: list[Optimizer], group: Any) -> nn.Module:
        return module

    def local_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """The torch optimizer that holds this rank's share of the state."""
        return optimizer

    def owned_params(self, optimizer: Optimizer) -> list[torch.Tensor]:
        """The parameters (of ``optimizer``) whose state this rank holds."""
        return optimizer_params(optimizer)

    def sync_layout(self, model: nn.Module) -> list[int]:
        """Bytes handed to each gradient collective of one synchronised backward (for the ledger)."""
        return []

    def norm_clipping(self, group: Any, ledger: CommStats) -> Optional[GlobalNormClipping]:
        """Clipping by the global norm where each rank holds a share of the gradients; None where every rank
        holds the whole averaged gradient (its local norm is the global one)."""
        return None

    # --- consolidated state ---------------------------------------------------------------------------
    def full_model_state(self, module: nn.Module, keys: Optional[set[str]] = None) -> dict[str, Any]:
        """The whole module's state (``keys``: only these entries, e.g. the trainable ones), on rank 0 at least."""
        state = module.state_dict()
        return state if keys is None else {k: v for k, v in state.items() if k in keys}

    def load_full_model_state(self, module: nn.Module, state: dict[str, Any], strict: bool) -> None:
        module.load_state_dict(state, strict=strict)

    def full_optimizer_state(self, module: nn.Module, optimizer: Optimizer, is_global_zero: bool) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_full_optimizer_state(self, module: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(copy.deepcopy(state))

    # --- sharded state (DCP, keyed by parameter name) -------------------------------------------------
    def sharded_model_state(self, module: nn.Module) -> dict[str, Any]:
        """This rank's part of the module's state for a sharded checkpoint: ``module.state_dict()`` (FSDP2's
        parameters as their ``DTensor`` shards)."""
        return module.state_dict()

    def sharded_optimizer_state(self, module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's share: ``{"state": {fqn: {...}} for owned parameters, "param_groups": [...]}``."""
        names = param_names(module)
        local = self.local_optimizer(optimizer)
        state = {names[id(p)]: local.state[p] for p in self.owned_params(optimizer) if p in local.state}
        groups = [
            {**_hyperparameters(g), "params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups
        ]
        return {"state": state, "param_groups": groups}

    def optimizer_load_template(self, module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
        """Tensors to load a sharded checkpoint into, in place: this rank's state, created if still empty."""
        init_optimizer_state(self.local_optimizer(optimizer))
        return self.sharded_optimizer_state(module, optimizer)

    def finish_optimizer_load(self, optimizer: Optimizer, loaded: dict[str, Any]) -> None:
        """After DCP filled the template: apply the saved hyper-parameters (lr set by schedulers, ...)."""
        groups = loaded["param_groups"]
        if len(groups) != len(optimizer.param_groups):
            raise ValueError(
                f"The checkpoint's optimizer has {len(groups)} parameter groups, {type(optimizer).__name__} has "
                f"{len(optimizer.param_groups)}: configure_optimizers must build the same groups as when it was saved."
            )
        for saved, group in zip(groups, optimizer.param_groups):
            group.update(_hyperparameters(saved))
        self._sync_local_groups(optimizer)

    def _sync_local_groups(self, optimizer: Optimizer) -> None:
        pass


# ---------------------------------------------------------------------------------------------------------
# Partitioned optimizers: torch ZeroRedundancyOptimizer, fairscale OSS (+ ShardedDataParallel at stage 2)
# ---------------------------------------------------------------------------------------------------------


def _constructor_defaults(optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer.defaults`` restricted to what its ``__init__`` accepts: torch 2.13's ``AdamW`` inherits
    ``decoupled_weight_decay`` from ``Adam``'s defaults but does not take it as an argument. Every key stays
    in the parameter-group dicts handed over, so no hyper-parameter is lost."""
    params = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in params}


def _rebuild_error(optimizer: Optimizer, wrapper: str, error: Exception) -> TypeError:
    return TypeError(
        f"{wrapper} rebuilds each rank's share as `{type(optimizer).__name__}(params, **defaults)`, which "
        f"failed: {error}. Give {type(optimizer).__name__} an __init__ whose arguments have defaults and are "
        f"stored in `self.defaults`, or use MGPUShardedStrategy(stage=2) (FSDP2 keeps your optimizer)."
    )


class TorchZeroBackend(ShardingBackend):
    """Stage 1, torch: DDP all-reduces gradients; ``ZeroRedundancyOptimizer`` keeps 1/N of the state."""

    wraps_with_ddp = True

    def wrap_optimizer(self, optimizer: Optimizer, group: Any) -> Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer
        try:
            # The user's param_group dicts themselves: per-group options are kept.
            return ZeroRedundancyOptimizer(
                optimizer.param_groups,
                optimizer_class=type(optimizer),
                process_group=group,
                **_constructor_defaults(optimizer),
            )
        except TypeError as err:
            raise _rebuild_error(optimizer, "ZeroRedundancyOptimizer", err) from err

    def local_optimizer(self, optimizer: Optimizer) -> Optimizer:
        return optimizer.optim  # type: ignore[attr-defined]

    def owned_params(self, optimizer: Optimizer) -> list[torch.Tensor]:
        return optimizer_params(self.local_optimizer(optimizer))

    def full_optimizer_state(self, module: nn.Module, optimizer: Optimizer, is_global_zero: bool) -> dict[str, Any]:
        optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]
        return optimizer.state_dict() if is_global_zero else {}

    def _sync_local_groups(self, optimizer: Optimizer) -> None:
        # the wrapper's param_groups -> its local optimizer's (what ZeroRedundancyOptimizer.step does first)
        sync_param_groups(optimizer, self.local_optimizer(optimizer))


class FairscaleOSSBackend(TorchZeroBackend):
    """Stage 1 (OSS + DDP) or 2 (OSS + ShardedDataParallel), fairscale: the seeds' ``ddp_sharded``."""

    def __init__(self, stage: int) -> None:
        super().__init__(stage)
        self.wraps_with_ddp = stage == 1
        self.needs_global_norm = stage == 2
        self.sync_control = DDPSyncControl() if stage == 1 else ShardedDDPSyncControl()

    def check_precision(self, mode: str) -> None:
        raise ValueError(
            f"MGPUPrecision({mode!r}) with backend='fairscale': fairscale's ShardedDataParallel reduces each gradient "
            f"to the rank whose optimizer owns that very parameter, so the optimizer cannot hold separate FP32 "
            f"masters. Use strategy='mgpu_sharded' (FSDP2 keeps sharded FP32 masters) or 'mgpu_zero1', or "
            f"MGPUPrecision('{mode.replace('master', 'mixed')}') with fairscale."
        )

    def check_before_launch(self, model: nn.Module, precision_plugin: Any, clip_by_norm: Any, shard_ranks: int) -> None:
        """Stage 2 clips by the norm over all ranks only under MGPUPrecision (the plugin with ``use_norm_clipping``):
        another plugin would clip each rank's shard by its own norm."""
        if clip_by_norm and self.needs_global_norm and not hasattr(precision_plugin, "use_norm_clipping"):
            raise MisconfigurationException(
                f"gradient_clip_val={clip_by_norm} by norm with {type(precision_plugin).__name__}: fairscale's "
                f"ShardedDataParallel leaves each rank the gradients it owns, and only MGPUPrecision clips them by the "
                f"norm over all ranks (this plugin would clip each shard by its own norm). Use precision='32-true', "
                f"'16-mixed' or 'bf16-mixed' (or plugins=[MGPUPrecision(...)]), gradient_clip_algorithm='value', or "
                f"strategy='mgpu_sharded' (FSDP2)."
            )

    def wrap_optimizer(self, optimizer: Optimizer, group: Any) -> Optimizer:
        from fairscale.optim import OSS

        if isinstance(optimizer, OSS):
            return optimizer
        try:
            return OSS(optimizer.param_groups, optim=type(optimizer), group=group, **_constructor_defaults(optimizer))
        except TypeError as err:
            raise _rebuild_error(optimizer, "fairscale OSS", err) from err

    def wrap_after_optimizers(self, module: nn.Module, optimizers: list[Optimizer], group: Any) -> nn.Module:
        if self.stage == 1:
            return module
        from fairscale.nn.data_parallel import ShardedDataParallel

        # reduce_buffer_size=0: one reduce per parameter, to its owner (the ledger counts exactly that);
        # bucketing small parameters together is a latency optimisation that matters on NCCL only.
        return ShardedDataParallel(module, sharded_optimizer=optimizers, process_group=group, reduce_buffer_size=0)

    def sync_layout(self, model: nn.Module) -> list[int]:
        return [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]

    # ShardedDataParallel broadcasts rank 0's buffers in every forward of a model that has buffers
    def forward_is_collective(self, model: nn.Module) -> bool:
        return bool(getattr(model, "_enable_broadcast_buffers", False)) and any(True for _ in model.buffers())

    def start_uneven_evaluation(self, model: nn.Module) -> None:
        model.sync_buffers(blocking=True)  # type: ignore[operator]  # once for the loop, as its first forward would
        model._enable_broadcast_buffers = False  # type: ignore[assignment]  # fairscale's flag (0.4.13 checked)

    def end_uneven_evaluation(self, model: nn.Module) -> None:
        model._enable_broadcast_buffers = True  # type: ignore[assignment]

    def norm_clipping(self, group: Any, ledger: CommStats) -> Optional[GlobalNormClipping]:
        # stage 2: ShardedDataParallel reduced each gradient to its owner only
        return GlobalNormClipping(self.owned_params, group, ledger) if self.stage == 2 else None

    def full_optimizer_state(self, module: nn.Module, optimizer: Optimizer, is_global_zero: bool) -> dict[str, Any]:
        optimizer.consolidate_state_dict(recipient_rank=0)  # type: ignore[attr-defined]
        return optimizer.state_dict() if is_global_zero else {}

    def _sync_local_groups(self, optimizer: Optimizer) -> None:
        sync_param_groups(optimizer, self.local_optimizer(optimizer))


# ---------------------------------------------------------------------------------------------------------
# FSDP2 (torch fully_shard): stages 2 and 3
# ---------------------------------------------------------------------------------------------------------


def _fsdp_units(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def fsdp_unit_roots(module: nn.Module, wrap_modules: Optional[tuple[type[nn.Module], ...]] = None) -> list[nn.Module]:
    """The modules FSDP2 makes units of (the root, a unit too, holds the parameters left over): those of
    ``wrap_modules``; by default every transformer layer when there are any, else each direct child with parameters,
    where a child without a forward of its own (an ``nn.ModuleList``, an ``nn.ModuleDict``: a container the parent
    iterates) gives its members instead, as FSDP2 users shard each block and never the list. The one rule, used by
    the strategy and by the planner. A module holding a tied parameter (one that a module outside it uses too: an
    output projection that is the embedding) is no unit: ``fully_shard`` refuses a parameter shared across units,
    so it stays in an enclosing unit (the root at the latest).

    Example::

        fsdp_unit_roots(model)  # [model.encoder.layers[0], model.encoder.layers[1], ...]
        fsdp_unit_roots(lightning_module)  # [embedding, layers[0], layers[1], head] for self.layers = nn.ModuleList
    """
    if wrap_modules is not None:
        classes: tuple[type[nn.Module], ...] = wrap_modules
    else:
        layers = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
        if not any(isinstance(m, layers) for m in module.modules()):
            return _without_tied(module, _children_with_forward(module))
        classes = layers
    return _without_tied(module, [m for m in module.modules() if m is not module and isinstance(m, classes)])


def _children_with_forward(module: nn.Module) -> list[nn.Module]:
    """The direct children of ``module`` that hold parameters, a child without a forward of its own replaced by its
    own such children: FSDP2 gathers a unit's parameters in the unit's forward hooks, which never run for a container
    (``fully_shard`` refuses an ``nn.ModuleList``; a plain ``nn.Module`` holder would be used sharded)."""
    units = []
    for child in module.children():
        if not any(True for _ in child.parameters()):
            continue
        if type(child).forward is nn.Module.forward:
            units += _children_with_forward(child)
        else:
            units.append(child)
    return units


def _without_tied(root: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """``units`` less those holding a parameter that a module outside them uses too (tied weights, e.g. an output
    projection that is the embedding): ``fully_shard`` refuses a parameter shared across units, so a tied
    parameter stays in an enclosing unit (the root at the latest), which gathers it for both uses."""
    owners: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    names = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}

    def tied(unit: nn.Module) -> bool:
        prefix = names[id(unit)] + "."
        return any(any(not other.startswith(prefix) for other in owners[id(p)]) for p in unit.parameters(recurse=True))

    return [u for u in units if not tied(u)]


class FSDP2Backend(ShardingBackend):
    """Stage 2 (``reshard_after_forward=False``) or 3 (``True``) with torch's ``fully_shard``.

    ``wrap_modules``: module classes that get their own FSDP unit (gathered and freed one at a time), applied
    innermost first; the root is always a unit. ``None``: every ``nn.TransformerEncoderLayer`` /
    ``nn.TransformerDecoderLayer``, and otherwise each direct child of the LightningModule that has
    parameters (one unit per block of the sample models; each member of a child ``nn.ModuleList`` or
    ``nn.ModuleDict``, whose container has no forward for FSDP's hooks). A module holding a tied parameter (one that
    a module outside it uses too) gets no unit of its own: the parameter stays in the enclosing unit.
    """

    keeps_masters = True

    def __init__(
        self,
        stage: int,
        wrap_modules: Optional[tuple[type[nn.Module], ...]] = None,
        offload: Optional[str] = None,
    ) -> None:
        super().__init__(stage)
        self.wrap_modules = wrap_modules
        self.offload = offload
        self.sync_control = FSDP2SyncControl()
        self._mesh: Any = None

    def check_before_launch(self, model: nn.Module, precision_plugin: Any, clip_by_norm: Any, shard_ranks: int) -> None:
        """``wrap_modules`` that match no module of the model (FSDP2 would silently make the whole model one unit,
        all parameters gathered at once), and a 4-bit base whose shards over ``shard_ranks`` would split a block of
        its packed bytes, refused with the fix."""
        wrap = self.wrap_modules
        if wrap is not None and not any(isinstance(m, wrap) for m in model.modules()):
            names = [c.__name__ for c in wrap]
            raise ValueError(
                f"wrap_modules={names} matches no module of {type(model).__name__}, so the whole model would be "
                f"one FSDP unit. Name classes the model has; the module classes present are "
                f"{classes_present(model)}. Or leave wrap_modules=None (the model's blocks are chosen for you)."
            )
        refuse_bitsandbytes_shards(model, f"stage={self.stage}")
        if has_nf4(model):
            check_shardable(model, shard_ranks)

    def _unit_roots(self, module: nn.Module) -> list[nn.Module]:
        return fsdp_unit_roots(module, self.wrap_modules)

    def is_sharded(self, model: nn.Module) -> bool:
        # the module itself, or (Lightning's ModelParallelStrategy style) modules inside it sharded by configure_model
        return bool(_fsdp_units(model))

    def forward_is_collective(self, model: nn.Module) -> bool:
        # stage 2 too: FSDP2 frees the gathered parameters after each backward
        return self.is_sharded(model)

    def start_uneven_evaluation(self, model: nn.Module) -> None:
        for unit in _fsdp_units(model):  # the same order on every rank: each unshard is one all-gather
            unit.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]
            unit.unshard()  # type: ignore[operator]

    def end_uneven_evaluation(self, model: nn.Module) -> None:
        for unit in _fsdp_units(model):
            unit.set_reshard_after_forward(self.stage == 3, recurse=False)  # type: ignore[operator]  # as sharded
            unit.reshard()  # type: ignore[operator]

    def shard_mesh(self, mesh: ParallelMesh) -> Any:
        """1-D ``data_parallel`` (flat), or 2-D ``(data_replicate, data_shard)`` (hybrid, HSDP): FSDP2 then
        reduce-scatters each unit's gradient within the shard group and all-reduces the shards across replicas.
        Rank ``r`` is in shard group ``r // shard`` (the processes of one machine are consecutive ranks)."""
        self._mesh = mesh.data
        return self._mesh

    @property
    def mesh_shape(self) -> Optional[tuple[int, int]]:
        mesh = self._mesh
        if mesh is None:
            return None
        return (1, mesh.size()) if mesh.ndim == 1 else (mesh.size(0), mesh.size(1))

    def mixed_precision_policy(self, policy: Any) -> Any:
        # master modes: FSDP2's sharded FP32 parameters are the master copy, gathered in half for compute
        return policy

    def shard_model(self, module: nn.Module, mesh: Any, mp_policy: Any = None) -> Optional[nn.Module]:
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        if _fsdp_units(module):  # fit() again in the same process, or configure_model applied fully_shard itself
            return module
        shards = mesh.size(mesh.ndim - 1)
        refuse_bitsandbytes_shards(module, f"stage={self.stage}")  # where configure_model built it: here, on each rank
        check_shardable(module, shards)  # a 4-bit base splits into whole blocks, or a clear error
        # one shard (one process, or HSDP with shard_size=1): FSDP2's copy into its single shard turns torchao's
        # 4-bit tensor into a full-precision one; the frozen base stays outside FSDP2 instead, whole on each rank
        whole = {p for p in module.parameters() if is_nf4(p)} if shards == 1 else set()
        ignored: dict[str, Any] = {"ignored_params": whole} if whole else {}
        reshard = self.stage == 3
        policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
        # pinned host memory lets the copies to and from a GPU overlap with compute; without a GPU there is none
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.offload == "cpu" else OffloadPolicy()
        # innermost first: fully_shard on a parent leaves parameters already owned by a child unit alone
        for unit in reversed(self._unit_roots(module)):
            if not isinstance(unit, FSDPModule):
                fully_shard(
                    unit,
                    mesh=mesh,
                    reshard_after_forward=reshard,
                    mp_policy=policy,
                    offload_policy=offload,
                    shard_placement_fn=fsdp_dim,
                    **ignored,
                )
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=reshard,
            mp_policy=policy,
            offload_policy=offload,
            shard_placement_fn=fsdp_dim,
            **ignored,
        )
        return module

    def sync_layout(self, model: nn.Module) -> list[int]:
        # one reduce-scatter (an all-reduce on gloo) per unit: the parameters it owns and no child unit does
        units = _fsdp_units(model)
        nested: set[int] = set()
        sizes = []
        for unit in reversed(units):  # modules() is pre-order: children come later, so walk backwards
            own = [p for p in unit.parameters() if id(p) not in nested and p.requires_grad]
            nested.update(id(p) for p in unit.parameters())
            if own:
                sizes.append(sum(p.numel() * p.element_size() for p in own))
        return sizes

    def norm_clipping(self, group: Any, ledger: CommStats) -> Optional[GlobalNormClipping]:
        # every gradient is a DTensor shard; where ranks hold the same shard (the replicas of the hybrid mesh, the
        # tensor-parallel ranks of a layer left replicated) each copy is weighted 1 / copies, so the squared norms
        # summed over all ranks count each element once
        return GlobalNormClipping(optimizer_params, group, ledger, weight_copies=True)

    def full_model_state(self, module: nn.Module, keys: Optional[set[str]] = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if keys is None and not has_nf4(module):
            return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # only these entries (an adapter-only checkpoint: the frozen base is never gathered), or a 4-bit base, whose
        # packed pieces comm.full_tensor gathers in blocking collectives as FSDP2 does; one tensor at a time
        state = module.state_dict()
        return {k: full_tensor(v).detach().cpu() for k, v in state.items() if keys is None or k in keys}

    def load_full_model_state(self, module: nn.Module, state: dict[str, Any], strict: bool) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(module, dict(state), options=StateDictOptions(full_state_dict=True, strict=strict))

    def full_optimizer_state(self, module: nn.Module, optimizer: Optimizer, is_global_zero: bool) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        by_name: dict[str, Any] = get_optimizer_state_dict(
            module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if not is_global_zero:
            return {}
        # names -> indices: the layout of a plain optimizer.state_dict()
        order = [name for group in by_name["param_groups"] for name in group["params"]]
        index = {name: i for i, name in enumerate(order)}
        state = {index[name]: value for name, value in by_name["state"].items()}
        groups = [{**_hyperparameters(g), "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_full_optimizer_state(self, module: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = param_names(module)
        order = [names[id(p)] for p in optimizer_params(optimizer)]
        saved_count = sum(len(g["params"]) for g in state["param_groups"])
        if saved_count != len(order):
            raise ValueError(
                f"The checkpoint's optimizer state has {saved_count} parameters, {type(optimizer).__name__} has "
                f"{len(order)}: configure_optimizers must build the same optimizer as when it was saved."
            )
        by_name: Any = {
            "state": {order[i]: value for i, value in state["state"].items()},
            "param_groups": [
                {**_hyperparameters(g), "params": [order[i] for i in g["params"]]} for g in state["param_groups"]
            ],
        }
        set_optimizer_state_dict(module, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
        # torch's loader hands hyper-parameters back as lists (betas); keep the saved values as they were
        for saved, group in zip(state["param_groups"], optimizer.param_groups):
            group.update(_hyperparameters(saved))


def make_backend(
    stage: int,
    backend: str,
    wrap_modules: Optional[tuple[type[nn.Module], ...]] = None,
    offload: Optional[str] = None,
) -> ShardingBackend:
    """The backend of ``stage`` and ``backend``; FSDP2 shards over the mesh the strategy hands to
    :meth:`ShardingBackend.shard_mesh` (``offload="cpu"``: its shards in host memory)."""
    if backend == "fairscale":
        return FairscaleOSSBackend(stage)
    if stage == 1:
        return TorchZeroBackend(stage)
    return FSDP2Backend(stage, wrap_modules, offload=offload)


def local_bytes(tensor: Any) -> int:
    """Bytes this rank holds for ``tensor`` (a ``DTensor`` counts its local shard only)."""
    if not isinstance(tensor, torch.Tensor):
        return 0
    local = local_shard(tensor)
    return local.numel() * local.element_size()


# ----------------------------------------------------------------------------------------------------
# The training wrapper follows the LightningModule's train/eval mode.
#
# Lightning's evaluation loop puts ``trainer.model`` (the wrapper) in eval mode and, afterwards, restores the
# mode of the *LightningModule* only (``_ModuleMode`` in its evaluation loop); the wrapper stays in eval mode.
# fairscale's ``ShardedDataParallel`` registers its gradient hooks only while ``self.training`` is true, so after
# any validation during fit (the default sanity check is enough) nothing would be reduced and every rank would
# step its shard with its local gradient.


def follow_module_mode(wrapper: Optional[nn.Module], module: Optional[nn.Module]) -> None:
    """Set the wrapper's own ``training`` flag to the module's (not recursively: submodules a user switched to
    eval mode on purpose, e.g. frozen BatchNorm layers, keep their mode).

    Example::

        follow_module_mode(strategy.model, strategy.lightning_module)  # before each training step
    """
    if wrapper is None or module is None or wrapper is module:
        return
    if wrapper.training != module.training:
        wrapper.training = module.training
