"""MGPUPrecision: mixed precision and half precision with an FP32 master copy, for every mgpu strategy.

Modes (``MGPUPrecision(mode)``):

* ``"16-mixed"`` / ``"bf16-mixed"``: FP32 weights, ``torch.autocast`` forward (Lightning's mixed precision).
  fp16 gets a dynamic loss scaler; it runs on CPU too (torch's CPU autocast and ``GradScaler("cpu")``), where
  Lightning turns ``precision="16-mixed"`` into bf16.
* ``"16-master"`` / ``"bf16-master"``: the mixed-precision article's recipe. The model's weights and activations
  are half; the optimizer holds an FP32 master copy of every parameter it steps. Half gradients are copied into
  the masters, unscaled in FP32, clipped and stepped in FP32, and copied back to the half weights. Under FSDP2
  (``mgpu_sharded`` / ``mgpu_zero3``) the master copy is FSDP's own sharded FP32 parameter and the gathered
  compute parameters are half (``MixedPrecisionPolicy(param_dtype=half, reduce_dtype=float32)``).
* ``"32-true"``: plain FP32, for side-by-side runs and configs.

In every half mode a step whose gradients hold inf/NaN on *any* rank is skipped on *every* rank (the check
is all-reduced, so a rank-local overflow cannot make the replicas diverge). For fp16 the loss scale then
backs off. ``precision/skipped_steps`` and ``precision/loss_scale`` are logged through ``self.log``.

Example::

    import pytorch_lightning as pl
    from lightning_mgpu import MGPUPrecision

    trainer = pl.Trainer(strategy="mgpu_ddp", devices=2, plugins=[MGPUPrecision("bf16-master")])

``Trainer(strategy="mgpu_*", precision="16-mixed" | "bf16-mixed")`` picks this plugin automatically.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Generator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, Literal, Optional, Union, cast

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.utilities.types import Optimizable
from lightning_utilities.core.apply_func import apply_to_collection
from pytorch_lightning.plugins.precision import MixedPrecision, Precision
from pytorch_lightning.utilities import GradClipAlgorithmType
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_mgpu import comm
from lightning_mgpu._compat import (
    DtypeContextManager,
    attached_trainer,
    convert_fp_tensor,
    foreach_norm,
    in_lightning_hook,
    precision_after_closure,
    scaler_init_scale,
    steps_on_found_inf,
    unwrap_optimizer,
)
from lightning_mgpu.comm import group_is_up
from lightning_mgpu.parts.clipping import GlobalNormClipping
from lightning_mgpu.plugins.master_weights import MasterWeights
from lightning_mgpu.plugins.step_hooks import ListenedHooks

__all__ = [
    "MODES",
    "MGPUPrecision",
    "Mode",
    "adopt",
    "any_nonfinite",
    "autocast_supported",
    "check_device",
    "check_mode",
]


class MGPUPrecision(Precision):
    """Mixed (``16-mixed``, ``bf16-mixed``) and master-weight (``16-master``, ``bf16-master``) precision.

    Args:
        mode: one of :data:`MODES`.
        device: the autocast / loss-scaler device type; ``None`` takes the model's device at set-up.
        init_scale, growth_factor, backoff_factor, growth_interval: the fp16 loss scaler's settings
            (``torch.amp.GradScaler``'s, same defaults).
        log_metrics: log ``precision/skipped_steps`` and ``precision/loss_scale`` each optimizer step.

    Attributes:
        skipped_steps: optimizer steps skipped because a gradient was inf/NaN on some rank (reading it waits for the
            device when a fused optimizer skipped steps there since the last read).
        optimizer_steps: optimizer steps taken or skipped.
        loss_scale: the current fp16 loss scale (1.0 for bf16 and fp32).

    Example (``Trainer(precision="bf16-mixed")`` with an mgpu strategy gets this plugin too):

        >>> from pytorch_lightning import Trainer
        >>> from lightning_mgpu import MGPUPrecision
        >>> precision = MGPUPrecision("bf16-master")
        >>> trainer = Trainer(strategy="mgpu_ddp", plugins=[precision], accelerator="cpu", devices=2, logger=False)
        >>> trainer.precision_plugin is precision, precision.loss_scale
        (True, 1.0)
    """

    def __init__(
        self,
        mode: Mode = "16-mixed",
        device: Optional[str] = None,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        log_metrics: bool = True,
    ) -> None:
        self.mode: str = check_mode(mode)
        if device is not None and not isinstance(device, str):
            raise TypeError(f"device must be a device type such as 'cuda' or 'cpu' (or None), got {device!r}.")
        self._scaler_kwargs = scaler_arguments(init_scale, growth_factor, backoff_factor, growth_interval)
        self.dtype, self.master = MODES[self.mode]
        # Lightning reads `precision` (Trainer.precision, ModelSummary's size estimate: "16"/"bf16" prefix)
        self.precision = cast(Any, self.mode)
        self.device = device
        self.log_metrics = log_metrics
        self.scaler: Optional[torch.amp.GradScaler] = None
        self._scaler_state: Optional[dict[str, Any]] = None
        self._skipped = 0  # skipped steps known on the host
        self._skipped_on_device: Optional[Tensor] = None  # skipped by the optimizer on the device, not read yet
        self.optimizer_steps = 0
        self._scale = float(init_scale) if self.dtype == torch.float16 else 1.0
        # master modes outside FSDP2: the FP32 masters, copied before the module is cast (convert_module ->
        # attach_master_weights)
        self._masters = MasterWeights(self.dtype)
        self._prepared: set[int] = set()  # optimizers whose gradients are in the masters and unscaled
        # given by mgpu_ddp under manual optimization (connect): averages an optimizer's gradients across ranks
        # (once per step), so that gradients are synced before they move into the masters or are clipped
        self._sync_gradients: Optional[Callable[[Optimizer], None]] = None
        self._fsdp_masters = False
        self._norm_clipping: Optional[GlobalNormClipping] = None
        # the step hooks Lightning's plugin dispatches that somebody listens to in this fit (plugins/step_hooks.py)
        self._hooks = ListenedHooks(custom_clipping=type(self).clip_gradients is not MGPUPrecision.clip_gradients)

    def use_norm_clipping(self, clipping: Optional[GlobalNormClipping]) -> None:
        """Called by a sharded strategy at set-up: clip by the norm over all ranks' gradient shares
        (:class:`~lightning_mgpu.parts.clipping.GlobalNormClipping`); None: the local norm is the global one."""
        self._norm_clipping = clipping

    def use_gradient_sync(self, sync_gradients: Optional[Callable[[Optimizer], None]]) -> None:
        """Called by the strategy at set-up: ``sync_gradients(optimizer)`` averages that optimizer's gradients
        across ranks (manual optimization, where the strategy syncs outside DDP's reducer); None: nothing to do.

        Example::

            plugin.use_gradient_sync(None)  # automatic optimization: DDP has synced already
        """
        self._sync_gradients = sync_gradients

    # --- properties -------------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self._scale

    @property
    def uses_scaler(self) -> bool:
        return self.dtype == torch.float16

    @property
    def holds_masters(self) -> bool:
        """Whether the optimizers step FP32 masters this plugin keeps (master modes outside FSDP2, once set up)."""
        return bool(self._masters.pairs)

    def __repr__(self) -> str:
        return f"MGPUPrecision({self.mode!r})"

    # --- set-up -----------------------------------------------------------------------------------------
    def check(self, device_type: str) -> None:
        """Refuses a mode ``device_type`` cannot run (called by the mgpu strategies before launching)."""
        if self.device is not None and self.device != device_type:
            raise ValueError(
                f"MGPUPrecision({self.mode!r}, device={self.device!r}) but the Trainer runs on {device_type!r}. "
                f"Leave device=None (the model's device is used) or pass device={device_type!r}."
            )
        check_device(self.mode, device_type)

    def keep_masters_in_fsdp(self) -> Optional[Any]:
        """Called by the FSDP2 strategies before the module is sharded: in the master modes FSDP's sharded FP32
        parameters become the master copy and this returns the ``MixedPrecisionPolicy`` to shard with
        (half compute parameters, FP32 gradient reduction); ``None`` in the other modes."""
        if not self.master:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        self._fsdp_masters = True
        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if not self.master:
            return module
        if self._fsdp_masters:
            # FSDP2 casts the parameters it gathers, not buffers: the BatchNorm statistics must be half too,
            # as in the DDP master modes (torch's CPU batch_norm refuses half input with FP32 statistics)
            for sub in module.modules():
                for name, buf in sub.named_buffers(recurse=False):
                    if buf.is_floating_point():
                        setattr(sub, name, buf.to(self.dtype))  # replaces the registered buffer
            return module
        return self._masters.convert(module)

    def attach_master_weights(self, optimizers: list[Optimizer]) -> None:
        """Master modes: point every optimizer parameter group at FP32 copies of the half parameters (before a
        strategy wraps the optimizers, e.g. in ``ZeroRedundancyOptimizer``)."""
        if not self.master or self._fsdp_masters:
            return
        for opt in optimizers:
            if isinstance(opt, LBFGS):
                raise MisconfigurationException(
                    f"MGPUPrecision({self.mode!r}) cannot drive LBFGS (it re-evaluates the closure inside step). "
                    f"Use MGPUPrecision('32-true') or another optimizer."
                )
        self._masters.attach(optimizers, world_size())

    def model_parameter(self, param: Tensor) -> Tensor:
        """The half model parameter behind a master (``param`` itself if it is not a master)."""
        return self._masters.model_parameter(param)

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        device = self.device
        if device is None:
            param = next(iter(model.parameters()), None)
            # a DTensor shard computes on its mesh's device, wherever it is stored (offload="cpu": on the host)
            mesh = getattr(param, "device_mesh", None)
            device = mesh.device_type if mesh is not None else param.device.type if param is not None else "cpu"
            self.device = device
        if self.uses_scaler and self.scaler is None:
            self.scaler = self._make_scaler(device)
            if self._scaler_state is not None:
                self.scaler.load_state_dict(self._scaler_state)
                self._scaler_state = None
        if self.master and not self._fsdp_masters:
            # Lightning's own strategies (single device, ...) never call attach_master_weights; the mgpu
            # strategies did already (the masters are skipped here)
            self.attach_master_weights(optimizers)
            for opt in optimizers:
                self._masters.clear_half_grads_on_zero_grad(opt)
        return model, optimizers, lr_schedulers

    def _make_scaler(self, device: str) -> torch.amp.GradScaler:
        if world_size() > 1:
            # All-reduces found_inf in unscale_: every rank skips together, whatever the strategy
            # (DDP, ZeRO, FSDP2 shards); torch's scaler for sharded gradients, usable with any process group.
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(device=device, **self._scaler_kwargs)
        return torch.amp.GradScaler(device=device, **self._scaler_kwargs)

    # --- forward ----------------------------------------------------------------------------------------
    def _autocast(self) -> AbstractContextManager:
        if self.master or self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device or "cpu", dtype=self.dtype, cache_enabled=False)

    # tensor_init_context / module_init_context stay Lightning's FP32 defaults, unlike bf16-true: the masters
    # are copied from the weights as created, so `trainer.init_module()` must not round them to half first.

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if not self.master and self.dtype == torch.float32:  # "32-true": nothing to enter
            yield
            return
        dtype_ctx = DtypeContextManager(self.dtype) if self.master else nullcontext()
        with dtype_ctx, self._autocast():
            yield

    @override
    def convert_input(self, data: Any) -> Any:
        if not self.master:
            return data
        return apply_to_collection(data, function=convert_fp_tensor, dtype=Tensor, dst_type=self.dtype)

    # --- the step hooks Lightning's plugin dispatches, where somebody listens -------------------------------
    def _hooks_after_closure(self, model: pl.LightningModule, optimizer: Optimizer) -> None:
        """``on_before_optimizer_step`` (callbacks, then the module), then clipping, as Lightning's plugin runs them
        after the closure."""
        if self._hooks.after_closure(model):
            precision_after_closure(self, model, optimizer)

    @override
    def teardown(self) -> None:
        self._hooks.forget()
        super().teardown()

    # --- backward and step ------------------------------------------------------------------------------
    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self.master and not self._fsdp_masters and not module.automatic_optimization:
            # toggle_optimizer's requires_grad on the masters mirrored onto the half parameters for this backward;
            # post_backward switches them back
            self._masters.mirror_requires_grad()
        if self.dtype != torch.float32 and tensor.is_floating_point() and tensor.dtype != torch.float32:
            tensor = tensor.float()  # a half loss times 65536 overflows fp16; the backward casts back to half
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        if "on_before_backward" not in self._hooks.of(module):
            return tensor
        return super().pre_backward(tensor, module)

    @override
    def post_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        self._masters.restore_requires_grad()
        if "on_after_backward" not in self._hooks.of(module):
            return tensor.detach()  # what Lightning's plugin returns: the graph is released
        return super().post_backward(tensor, module)

    def _prepare_gradients(self, optimizer: Optimizer) -> None:
        # once per optimizer step: the half gradients into the masters, then unscaled (ShardedGradScaler
        # all-reduces found_inf, so every rank agrees). Manual optimization may get here first through
        # self.clip_gradients(opt, ...), called between manual_backward and opt.step().
        if id(optimizer) in self._prepared:
            return
        if self._sync_gradients is not None:
            self._sync_gradients(optimizer)
        if self.master and not self._fsdp_masters:
            self._masters.grads_to_masters(optimizer)
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        self._prepared.add(id(optimizer))

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val > 0 and self.dtype != torch.float32:
            self._prepare_gradients(unwrap_optimizer(optimizer))
        elif clip_val > 0 and self._sync_gradients is not None:
            self._sync_gradients(unwrap_optimizer(optimizer))
        super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        if self._norm_clipping is None:
            super().clip_grad_by_norm(optimizer, clip_val)
            return
        self._norm_clipping.clip(unwrap_optimizer(optimizer), float(clip_val))

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizable,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if self.dtype == torch.float32:

            def closure_then_hooks() -> Any:  # Lightning's plugin: the closure, then the hooks after it
                result = closure()
                self._hooks_after_closure(model, cast(Optimizer, optimizer))
                return result

            return optimizer.step(closure=closure_then_hooks, **kwargs)
        opt = cast(Optimizer, optimizer)
        if isinstance(opt, LBFGS):
            raise MisconfigurationException(f"MGPUPrecision({self.mode!r}) and the LBFGS optimizer are not compatible.")
        closure_result = closure()
        # automatic optimization with a training_step that returned None: no backward ran, nothing to step
        if closure_result is None and model.automatic_optimization:
            self._hooks_after_closure(model, opt)
            return closure_result
        self._prepare_gradients(opt)
        try:
            skipped, output = self._step_optimizer(opt, model, **kwargs)
        finally:
            self._prepared.discard(id(opt))
        if self.master and not self._fsdp_masters and not skipped:
            self._masters.masters_to_model(opt)
        self.optimizer_steps += 1
        self._skipped += int(skipped)
        self._log_to(model)
        return output

    @property
    def skipped_steps(self) -> int:
        # documented with the class's attributes (a docstring here would describe it twice in the API reference)
        pending, self._skipped_on_device = self._skipped_on_device, None
        if pending is not None:
            self._skipped += int(pending.item())
        return self._skipped

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped, self._skipped_on_device = int(value), None

    def _step_optimizer(self, opt: Optimizer, model: pl.LightningModule, **kwargs: Any) -> tuple[bool, Any]:
        output = None
        if self.scaler is not None:
            before = self._scale
            self._hooks_after_closure(model, opt)  # on_before_optimizer_step, then clipping: on unscaled gradients
            output = self.scaler.step(opt, **kwargs)  # skipped when found_inf
            self.scaler.update()
            self._scale = float(self.scaler.get_scale())
            skipped = self._scale < before
        else:
            grads = [m.grad for group in opt.param_groups for m in group["params"] if m.grad is not None]
            if grads and steps_on_found_inf(opt):
                # a fused optimizer skips on the device: the flag never comes to the host, so the step does not wait
                found = nonfinite_flag(grads)
                self._hooks_after_closure(model, opt)
                output = _step_unless(opt, found, **kwargs)
                pending = self._skipped_on_device
                self._skipped_on_device = found if pending is None else pending + found
                return False, output  # or skipped on the device: its masters then copy back unchanged
            skipped = any_nonfinite(grads)
            self._hooks_after_closure(model, opt)
            if not skipped:
                output = opt.step(**kwargs)
        return skipped, output

    def _log_to(self, model: pl.LightningModule) -> None:
        if not self.log_metrics or not in_lightning_hook(model) or attached_trainer(model) is None:
            return
        pending = self._skipped_on_device  # a tensor is read by Lightning when it logs, not at every step
        skipped = float(self._skipped) if pending is None else pending + self._skipped
        model.log("precision/skipped_steps", skipped, on_step=True, on_epoch=False)
        model.log("precision/loss_scale", self._scale, on_step=True, on_epoch=False)

    # --- checkpoints ------------------------------------------------------------------------------------
    def fp32_state_dict(self, module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (the module's state dict) with each parameter's FP32 master in place of its half value:
        checkpoints hold the weights at full precision, so a resume (or an FP32 user) gets them exactly."""
        return self._masters.fp32_state_dict(module, state)

    def load_masters(self, module: nn.Module, state: dict[str, Any]) -> None:
        """Master modes, model weights loaded while masters exist (a sharded strategy's restore after set-up,
        LearningRateFinder's restore, a second fit): refresh the masters from the checkpoint's FP32 values."""
        self._masters.load(module, state)

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.dtype == torch.float32:
            return {}  # nothing to restore: checkpoints stay what Lightning's own Precision writes
        return {
            "mode": self.mode,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "skipped_steps": self.skipped_steps,
            "optimizer_steps": self.optimizer_steps,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.optimizer_steps = int(state_dict.get("optimizer_steps", 0))
        scaler_state = state_dict.get("scaler")
        if scaler_state and self.uses_scaler:
            if self.scaler is not None:
                self.scaler.load_state_dict(scaler_state)
                self._scale = float(self.scaler.get_scale())
            else:
                self._scaler_state = scaler_state
                self._scale = float(scaler_state.get("scale", self._scale))


def adopt(plugin: Optional[Precision]) -> Optional[Precision]:
    """What an mgpu strategy runs for the plugin Lightning chose: ``precision="16-mixed"/"bf16-mixed"`` (a
    plain :class:`MixedPrecision`) becomes :class:`MGPUPrecision` with the same scaler settings, so the
    overflow check is agreed across ranks and logged; the default ``"32-true"`` (a plain :class:`Precision`)
    becomes ``MGPUPrecision("32-true")``, which behaves the same except that ``self.clip_gradients`` in
    manual optimization clips the gradient averaged over the ranks. Anything else is kept as it is."""
    if type(plugin) is Precision:
        return MGPUPrecision("32-true")
    if type(plugin) is not MixedPrecision:
        return plugin
    kwargs: dict[str, Any] = {}
    scaler = plugin.scaler
    if scaler is not None:
        kwargs = {
            "init_scale": scaler_init_scale(scaler),
            "growth_factor": float(scaler.get_growth_factor()),
            "backoff_factor": float(scaler.get_backoff_factor()),
            "growth_interval": int(scaler.get_growth_interval()),
        }
    return MGPUPrecision(cast(Mode, plugin.precision), device=plugin.device, **kwargs)


# ----------------------------------------------------------------------------------------------------
# The modes of :class:`~lightning_mgpu.MGPUPrecision` and the checks that need no plugin: which mode a string
# means, whether a device can run it, and whether any rank's gradients overflowed.

Mode = Literal["32-true", "16-mixed", "bf16-mixed", "16-master", "bf16-master"]

#: mode -> (compute dtype, FP32 master copy held by the optimizer step)
MODES: dict[str, tuple[torch.dtype, bool]] = {
    "32-true": (torch.float32, False),
    "16-mixed": (torch.float16, False),
    "bf16-mixed": (torch.bfloat16, False),
    "16-master": (torch.float16, True),
    "bf16-master": (torch.bfloat16, True),
}

# what people type, and the mode they most likely mean
_ALIASES = {
    "16": "16-mixed",
    "fp16": "16-mixed",
    "half": "16-mixed",
    "amp": "16-mixed",
    "bf16": "bf16-mixed",
    "bfloat16": "bf16-mixed",
    "16-true": "16-master",
    "bf16-true": "bf16-master",
    "32": "32-true",
    "fp32": "32-true",
    "64-true": "32-true",
    "transformer-engine": "bf16-mixed",
}


def scaler_arguments(init_scale: Any, growth_factor: Any, backoff_factor: Any, growth_interval: Any) -> dict[str, Any]:
    """The fp16 loss scaler's keyword arguments (``torch.amp.GradScaler``'s), checked: a ``ValueError`` names the
    bad value and the default."""
    if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
        raise ValueError(f"init_scale must be a finite number > 0 (default 65536.0), got {init_scale!r}.")
    if not (isinstance(growth_factor, (int, float)) and growth_factor > 1):
        raise ValueError(f"growth_factor must be > 1 (default 2.0), got {growth_factor!r}.")
    if not (isinstance(backoff_factor, (int, float)) and 0 < backoff_factor < 1):
        raise ValueError(f"backoff_factor must be between 0 and 1 (default 0.5), got {backoff_factor!r}.")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
        raise ValueError(f"growth_interval must be an int >= 1 (default 2000), got {growth_interval!r}.")
    return {
        "init_scale": float(init_scale),
        "growth_factor": float(growth_factor),
        "backoff_factor": float(backoff_factor),
        "growth_interval": growth_interval,
    }


def check_mode(mode: Any) -> str:
    """Returns ``mode`` if it is one of :data:`MODES`; otherwise a ``ValueError`` naming the valid modes."""
    if isinstance(mode, str) and mode in MODES:
        return mode
    hint = ""
    if isinstance(mode, (str, int)) and str(mode).lower() in _ALIASES:
        guess = _ALIASES[str(mode).lower()]
        hint = f" Did you mean {guess!r}?"
        if str(mode) in ("16-true", "bf16-true"):
            hint += (
                f" (Lightning's {mode!r} keeps no FP32 copy of the weights; {guess!r} has the same memory for "
                f"the model and keeps FP32 masters in the optimizer step.)"
            )
    raise ValueError(f"MGPUPrecision(mode={mode!r}) is not a mode. Use one of {list(MODES)}.{hint}")


def autocast_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.autocast(device_type, dtype)`` really runs (torch disables itself, with a warning, for
    a dtype the device's autocast lacks)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autocast(device_type, dtype=dtype):
                return torch.is_autocast_enabled(device_type)
    except (RuntimeError, ValueError):
        return False


def check_device(mode: str, device_type: str) -> None:
    """Raises ``RuntimeError`` naming the alternative when ``device_type`` cannot run ``mode``."""
    dtype, master = MODES[mode]
    if dtype == torch.float32:
        return
    half = "bf16" if dtype == torch.bfloat16 else "16"
    other = "16" if half == "bf16" else "bf16"
    if device_type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name()
        raise RuntimeError(
            f"MGPUPrecision({mode!r}) needs bfloat16, which {name} does not support (it needs compute capability "
            f"8.0, Ampere, or newer). Use MGPUPrecision('16-mixed') or '16-master' (fp16 with loss scaling)."
        )
    if not master and not autocast_supported(device_type, dtype):
        raise RuntimeError(
            f"MGPUPrecision({mode!r}): torch.autocast on {device_type!r} does not support {dtype}. Use "
            f"MGPUPrecision('{other}-mixed'), or '{half}-master' (no autocast: the model itself runs in {dtype})."
        )


def world_size() -> int:
    """The default process group's size; 1 without one."""
    return dist.get_world_size() if group_is_up() else 1


def nonfinite_flag(grads: list[Tensor]) -> Tensor:
    """A 0-d float32 tensor on the gradients' device: 1 if any gradient holds inf/NaN on any rank, else 0 (one
    all-reduce when a process group is up; nothing waits for the device)."""
    device = grads[0].device if grads else torch.device("cpu")
    # a rank's shard of a parameter smaller than the world is empty (ZeRO-3: a bias of 1 over 2 ranks), and the
    # infinity norm of an empty tensor is an error
    shards = [shard for shard in (comm.local_shard(g) for g in grads) if shard.numel()]
    if shards:
        norms = [n.to(device) for n in foreach_norm(shards, float("inf"))]
        found = torch.logical_not(torch.stack(norms).isfinite().all()).float().reshape(1)
    else:
        found = torch.zeros(1, device=device)
    if world_size() > 1:
        comm.all_reduce(found, op=dist.ReduceOp.MAX)
    return found.reshape(())


def any_nonfinite(grads: list[Tensor]) -> bool:
    """True if any gradient holds inf/NaN on any rank (:func:`nonfinite_flag`, read on the host: one wait)."""
    return bool(nonfinite_flag(grads).item() > 0)


def _step_unless(opt: Optimizer, found: Tensor, **kwargs: Any) -> Any:
    """``opt.step`` of a fused optimizer given ``found`` as torch's ``GradScaler`` gives it: a step that leaves the
    parameters and the state as they were where ``found`` is 1 (no loss scale: ``grad_scale`` None)."""
    opt.found_inf, opt.grad_scale = found, None  # type: ignore[attr-defined]
    try:
        return opt.step(**kwargs)
    finally:
        del opt.found_inf, opt.grad_scale  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------------------------------
# Precision adoption: the strategy turns Lightning's plugin into :class:`~lightning_mgpu.MGPUPrecision`, and
# hands it what it needs through arguments (never by writing into it at run time).


class PrecisionAdoption:
    """Example::

    part = PrecisionAdoption()
    plugin = part.adopt(Precision())           # MGPUPrecision("32-true")
    part.check(plugin, [torch.device("cpu")])  # before launch
    """

    @staticmethod
    def adopt(plugin: Optional[Precision]) -> Optional[Precision]:
        # precision="16-mixed"/"bf16-mixed" -> MGPUPrecision: overflow agreed across ranks, counted and logged
        return adopt(plugin)

    @staticmethod
    def check(plugin: Optional[Precision], devices: Optional[list[torch.device]]) -> None:
        if isinstance(plugin, MGPUPrecision) and devices:
            plugin.check(devices[0].type)

    @staticmethod
    def attach_masters(plugin: Precision, optimizers: list[Optimizer]) -> None:
        """Before any wrapper (ZeroRedundancyOptimizer) is built around the optimizers."""
        if isinstance(plugin, MGPUPrecision):
            plugin.attach_master_weights(optimizers)

    @staticmethod
    def model_parameter(plugin: Precision) -> Callable[[torch.Tensor], torch.Tensor]:
        """Optimizer parameter -> the parameter backward writes the gradient of (master modes: the half one)."""
        if isinstance(plugin, MGPUPrecision):
            return plugin.model_parameter
        return lambda p: p

    @staticmethod
    def connect_gradient_sync(plugin: Precision, sync: Optional[Callable[[Optimizer], None]]) -> None:
        """Manual optimization: the plugin calls ``sync`` before it moves or clips an optimizer's gradients."""
        if isinstance(plugin, MGPUPrecision):
            plugin.use_gradient_sync(sync)

    @staticmethod
    def fsdp_mixed_precision(plugin: Precision) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` in master modes (its sharded FP32 parameters are the master copy,
        gathered in half for compute), else None."""
        return plugin.keep_masters_in_fsdp() if isinstance(plugin, MGPUPrecision) else None

    @staticmethod
    def loss_scale(plugin: Precision) -> float:
        """The scale the plugin's loss scaler multiplies the next backward's loss by (fp16); 1.0 without one.
        :class:`MGPUPrecision`'s is the value it keeps after each step (read per step, it does not wait for the
        device as ``GradScaler.get_scale`` does)."""
        if isinstance(plugin, MGPUPrecision):
            return plugin.loss_scale
        scaler = getattr(plugin, "scaler", None)
        return float(scaler.get_scale()) if isinstance(scaler, torch.amp.GradScaler) else 1.0

    @staticmethod
    def connect_norm_clipping(plugin: Precision, clipping: Optional[GlobalNormClipping]) -> None:
        """Sharded gradients: norm clipping by the norm over all ranks (``None``: the local norm is global)."""
        if isinstance(plugin, MGPUPrecision):
            plugin.use_norm_clipping(clipping)

    @staticmethod
    def with_masters(plugin: Precision, module: Optional[nn.Module], state: dict[str, Any]) -> dict[str, Any]:
        """The module's state as saved: master modes put their FP32 masters in place of the half weights."""
        if isinstance(plugin, MGPUPrecision) and module is not None:
            return plugin.fp32_state_dict(module, state)
        return state

    @staticmethod
    def load_masters(plugin: Precision, module: Optional[nn.Module], checkpoint: Mapping[str, Any]) -> None:
        # masters that exist already (a restore after set-up: sharded strategies, LearningRateFinder, a second
        # fit) take the checkpoint's FP32 values; otherwise the next step would copy stale ones back
        state = checkpoint.get("state_dict")
        if isinstance(plugin, MGPUPrecision) and module is not None and state is not None:
            plugin.load_masters(module, state)
