"""Adapter-only checkpoints (``checkpoint_params="trainable"``): a checkpoint that keeps the module's trainable
parameters and buffers (with the optimizer state, which only trainable parameters have, and the loop state) and
leaves out the frozen parameters, recording instead a fingerprint of the frozen base; and loading one back onto
the same base, refused with the reason on any other.

The fingerprint of each frozen parameter is its name, global shape, dtype and a SHA-256 of the exact bytes of its
first row (``tensor[0]``; the element itself for a 1-D tensor). It is cheap and needs no communication under any
layout: a sharded parameter's first row lives on the rank that holds the first shard (FSDP2 shards dimension 0,
global rank 0 holds the first chunk), so global rank 0 computes it from its own shard and the other ranks take its
verdict. A base that differs only outside the first rows of all its tensors is not detected; one from another
checkpoint, another seed or another fine-tune differs in every row. A 4-bit base (torchao's ``NF4Tensor``) is
fingerprinted by its dequantised first row: the values the layers compute with, under any layout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_mgpu._compat import is_strided_shard
from lightning_mgpu.quantization import dequantized, has_nf4, is_nf4
from lightning_mgpu.settings import CheckpointParams

#: the checkpoint's entry that marks it adapter-only: ``{"frozen": {name: {"shape", "dtype", "first_row"}}}``
KEY = "mgpu_frozen_base"

#: ``"auto"`` saves trainable-only when the frozen parameters hold more than this share of the parameter elements
AUTO_FROZEN_SHARE = 0.5


def frozen_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's frozen parameters by their state-dict key (``requires_grad=False``; tied names each)."""
    return {
        name: value
        for name, value in module.state_dict(keep_vars=True).items()
        if isinstance(value, nn.Parameter) and not value.requires_grad
    }


def saves_trainable_only(module: nn.Module, setting: CheckpointParams) -> bool:
    """Whether a save under ``setting`` leaves the frozen parameters out: ``"trainable"`` when any is frozen,
    ``"auto"`` when the frozen ones hold most of the parameter elements or the base is 4-bit, ``"all"`` never."""
    if setting == "all":
        return False
    if has_nf4(module):
        return True
    frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    if setting == "trainable":
        return frozen > 0
    total = sum(p.numel() for p in module.parameters())
    return total > 0 and frozen / total > AUTO_FROZEN_SHARE


def check_sharded_save(module: nn.Module, setting: CheckpointParams) -> None:
    """Refuse, before launch, a sharded checkpoint directory that would hold a 4-bit base (``checkpoint_params="all"``
    with torchao's ``NF4Tensor`` weights): ``torch.distributed.checkpoint`` has no plan for torchao's tensor and its
    writer corrupts the process's memory (torchao 0.18.0, torch 2.13). A consolidated file holds the packed base and
    loads back; an adapter-only checkpoint leaves it out."""
    if setting == "all" and has_nf4(module):
        names = [n for n, p in module.named_parameters() if is_nf4(p)]
        raise ValueError(
            f"checkpoint='sharded' with checkpoint_params='all' would write {type(module).__name__}'s 4-bit base "
            f"({names[0]} and {len(names) - 1} more NF4 weights) into a torch.distributed.checkpoint directory, which "
            "cannot hold torchao's NF4 tensors. Use checkpoint_params='trainable' (or 'auto': the adapters, their "
            "optimizer state and the loop state; the base, built and quantised again from its source, checked by "
            "fingerprint), or checkpoint='consolidated' (one file that holds the packed base)."
        )


def _first_row(value: torch.Tensor) -> Optional[torch.Tensor]:
    """The first row of ``value`` as this rank holds it; None where this rank does not hold it whole."""
    from torch.distributed.tensor import DTensor

    local = value.detach()
    if isinstance(value, DTensor):
        if any((p.is_shard() or is_strided_shard(p)) and getattr(p, "dim", 0) != 0 for p in value.placements):
            return None  # sharded along another dimension: the first row is split over ranks
        local = value.to_local().detach()
    if is_nf4(local):
        local = dequantized(local)  # the values the layer computes with, whatever the packing
    if local.dim() == 0:
        return local
    if local.shape[0] == 0:
        return None
    return local[0]


def _digest(row: Optional[torch.Tensor]) -> Optional[str]:
    if row is None:
        return None
    data = row.contiguous().reshape(-1).cpu().view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:32]


def fingerprint(frozen: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """``{name: {"shape": [...], "dtype": "float32", "first_row": hex digest or None}}`` of the frozen parameters
    (the digest is meaningful on global rank 0, which holds every parameter's first row)."""
    return {
        name: {
            "shape": list(value.shape),
            "dtype": str(value.dtype).replace("torch.", ""),
            "first_row": _digest(_first_row(value)),
        }
        for name, value in frozen.items()
    }


def trainable_only(checkpoint: dict[str, Any], module: nn.Module) -> None:
    """Turn ``checkpoint`` (as Lightning dumps it) into an adapter-only one in place: the frozen parameters out of
    its ``state_dict``, the base's fingerprint in."""
    frozen = frozen_parameters(module)
    state = checkpoint.get("state_dict")
    if isinstance(state, dict):
        checkpoint["state_dict"] = {k: v for k, v in state.items() if k not in frozen}
    checkpoint[KEY] = {"frozen": fingerprint(frozen)}


def differences(saved: Mapping[str, Mapping[str, Any]], now: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """How the frozen base of the model now differs from the one the checkpoint was saved on (empty: the same)."""
    found = []
    for name, was in saved.items():
        if name not in now:
            found.append(f"{name}: frozen at save, now absent or trainable")
            continue
        is_ = now[name]
        if (was["shape"], was["dtype"]) != (is_["shape"], is_["dtype"]):
            found.append(
                f"{name}: {was['dtype']}{tuple(was['shape'])} at save, {is_['dtype']}{tuple(is_['shape'])} now"
            )
        elif was["first_row"] is not None and is_["first_row"] is not None and was["first_row"] != is_["first_row"]:
            found.append(f"{name}: different values (its first row)")
    found.extend(f"{name}: frozen now, not frozen (so saved) at save" for name in now if name not in saved)
    return found


def check_base(
    checkpoint: Mapping[str, Any], module: nn.Module, is_global_zero: bool, broadcast: Callable[[Any], Any]
) -> Optional[set[str]]:
    """For an adapter-only ``checkpoint``: raise the same ``ValueError`` on every rank when ``module``'s frozen
    base is not the one it was saved on (the verdict of global rank 0, broadcast); else return the frozen names
    the checkpoint leaves out. None for a full checkpoint. Call on every rank."""
    entry = checkpoint.get(KEY)
    if entry is None:
        return None
    frozen = frozen_parameters(module)
    problem = ""
    if is_global_zero:
        found = differences(entry["frozen"], fingerprint(frozen))
        if found:
            shown = "; ".join(found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
            problem = (
                f"This checkpoint holds only the trainable parameters (checkpoint_params='trainable' or 'auto') "
                f"and was saved on another frozen base than the model's now ({len(found)} of "
                f"{len(entry['frozen'])} frozen parameters differ: {shown}). Build the model on the same base "
                f"weights as when it was saved (the same pretrained checkpoint, loaded the same way, with the same "
                f"parameters frozen), then load it again."
            )
    problem = broadcast(problem)
    if problem:
        raise ValueError(problem)
    return set(entry["frozen"])


def check_keys(state: Mapping[str, Any], module: nn.Module, left_out: set[str]) -> None:
    """A strict load of an adapter-only state: every key of the module's state is in ``state`` or was left out as
    frozen, and ``state`` has no key the module lacks (what ``load_state_dict(strict=True)`` checks)."""
    expected = set(module.state_dict().keys())
    missing = sorted(expected - set(state) - left_out)
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise RuntimeError(
            f"Error loading the adapter-only checkpoint into {type(module).__name__}: missing keys {missing}, "
            f"unexpected keys {unexpected}. Build the model with the same adapters as when it was saved, or set "
            f"the LightningModule's strict_loading=False."
        )
