"""The modes of :class:`~lightning_mgpu.MGPUPrecision` and the checks that need no plugin: which mode a string
means, whether a device can run it, and whether any rank's gradients overflowed."""

from __future__ import annotations

import warnings
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mgpu._compat import foreach_norm
from lightning_mgpu.parts.process_group import group_is_up

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


def _local(t: Tensor) -> Tensor:
    # a DTensor (FSDP2 shard) -> this rank's shard; a plain tensor -> itself
    to_local = getattr(t, "to_local", None)
    return cast(Tensor, to_local()) if callable(to_local) else t


def world_size() -> int:
    """The default process group's size; 1 without one."""
    return dist.get_world_size() if group_is_up() else 1


def any_nonfinite(grads: list[Tensor]) -> bool:
    """True if any gradient holds inf/NaN on any rank (one all-reduce when a process group is up)."""
    device = grads[0].device if grads else torch.device("cpu")
    if grads:
        norms = [n.to(device) for n in foreach_norm([_local(g) for g in grads], float("inf"))]
        found = torch.logical_not(torch.stack(norms).isfinite().all()).float().reshape(1)
    else:
        found = torch.zeros(1, device=device)
    if world_size() > 1:
        if dist.get_backend() == "nccl" and found.device.type != "cuda":
            found = found.cuda()
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return bool(found.item() > 0)
