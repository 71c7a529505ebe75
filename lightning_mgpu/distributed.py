"""Cross-rank reductions for values you log yourself, and the effective batch size.

Inside a LightningModule, ``self.log(name, value, sync_dist=True)`` already averages a scalar over ranks and
torchmetrics metrics gather their counts across ranks; use those first. These helpers are for what they do
not cover: a value computed outside ``self.log`` (a custom progress line, a dict of losses written to your
own file, per-sample losses of an uneven last batch). ``mean`` and ``sum`` take **one collective per call**
however many keys the dict has; ``gather`` takes one for the sizes of all keys, then one per key::

    from lightning_mgpu import distributed as mdist

    def training_step(self, batch, batch_idx):
        losses = F.cross_entropy(self(x), y, reduction="none")       # one value per sample
        result = mdist.mean({"loss": losses, "acc": (pred == y).float()})  # exact global means
        if result is not None:                                        # rank 0 only (dst=0)
            print(result["loss"].item())

``mean`` of a tensor averages over *all elements on all ranks*, so a rank whose last batch is shorter counts
for exactly its samples (``sync_dist=True`` averages per-rank means instead: every rank weighs the same).
For per-rank scalars that already are means, pass ``weight=`` (the number of samples behind each).
Without an initialised process group (one process), every helper computes the local result.

Why ``gather`` is not torchmetrics' ``gather_all_tensors`` (torchmetrics 1.9, which also pads uneven sizes):
that function takes one tensor, and for each one runs a ``barrier``, an ``all_gather`` of its shape, then an
``all_gather`` of the padded tensor: 3 collectives per key (2 for a 0-dim tensor), where ``gather`` takes
1 + number of keys, without a barrier (a dict of 3 uneven keys on 2 gloo ranks: 9 against 4, counted with
torch.profiler; ``tests/integration/test_distributed.py`` pins our count). It also pads every dimension, so ranks whose
trailing shapes differ get tensors that cannot be concatenated, where ``gather`` names the key and the shape.
The padding itself is a ``torch.zeros`` and a slice: no code worth a dependency's semantics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional, Union

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.utilities.parsing import lightning_getattr, lightning_hasattr
from torch import Tensor

from lightning_mgpu import comm
from lightning_mgpu.comm import group_is_up

Value = Union[Tensor, float, int]
Values = Union[Value, Mapping[str, Value]]

__all__ = ["effective_batch_size", "gather", "mean", "per_device_batch_size", "sum"]


def _world(group: Optional[Any]) -> int:
    return dist.get_world_size(group) if group_is_up() else 1


def _rank(group: Optional[Any]) -> int:
    return dist.get_rank(group) if group_is_up() else 0


def _comm_device(group: Optional[Any], values: list[Value]) -> torch.device:
    """Where the collective's buffer lives (:func:`lightning_mgpu.comm.collective_device`: CUDA under NCCL, the
    CPU under gloo), given the first tensor among ``values``; without other ranks, that tensor's device."""
    first = next((v for v in values if isinstance(v, Tensor)), None)
    if _world(group) == 1:
        return first.device if first is not None else torch.device("cpu")
    return comm.collective_device(group, first)


def _as_dict(value: Values, name: str) -> tuple[dict[str, Value], bool]:
    if isinstance(value, Mapping):
        if not value:
            raise ValueError(f"{name}() got an empty dict; pass at least one tensor or number.")
        for key, v in value.items():
            if not isinstance(v, (Tensor, float, int)) or isinstance(v, bool):
                raise TypeError(f"{name}(): value for key {key!r} is a {type(v).__name__}; pass tensors or numbers.")
        return dict(value), True
    if not isinstance(value, (Tensor, float, int)) or isinstance(value, bool):
        raise TypeError(f"{name}() takes a tensor, a number or a dict of them, not {type(value).__name__}.")
    return {"": value}, False


def _check_dst(dst: Optional[int], group: Optional[Any], name: str) -> None:
    if dst is not None and not 0 <= dst < _world(group):
        raise ValueError(f"{name}(dst={dst!r}): dst must be a rank in [0, {_world(group)}) or None for every rank.")


def _result(out: dict[str, Any], was_dict: bool) -> Any:
    return out if was_dict else out[""]


def _reduce(
    flat: Tensor, dst: Optional[int], group: Optional[Any]
) -> Tensor:  # one collective whatever the number of keys
    if _world(group) > 1:
        if dst is None:
            comm.all_reduce(flat, group=group)
        else:
            comm.reduce(flat, dst=dist.get_global_rank(group, dst) if group is not None else dst, group=group)
    return flat


def _sums(
    value: Values, weight: Optional[Values], dst: Optional[int], group: Optional[Any], name: str
) -> tuple[dict[str, Value], bool, Tensor]:
    values, was_dict = _as_dict(value, name)
    _check_dst(dst, group, name)
    weights: dict[str, Value] = {}
    if weight is not None:
        weights, weight_dict = _as_dict(weight, f"{name}(weight=...)")
        if not weight_dict:
            weights = {k: weights[""] for k in values}
        elif set(weights) != set(values):
            raise ValueError(f"{name}(): weight keys {sorted(weights)} differ from value keys {sorted(values)}.")
    device = _comm_device(group, list(values.values()))
    parts = []
    for key, v in values.items():
        t = torch.as_tensor(v).detach().to(device=device, dtype=torch.float64)
        if key in weights:
            w = torch.as_tensor(weights[key]).detach().to(device=device, dtype=torch.float64)
            if w.numel() != 1 or t.numel() != 1:
                raise ValueError(
                    f"{name}(): weight= is for per-rank scalars (a mean and the number of samples behind it); "
                    f"key {key!r} has {t.numel()} values. Pass the per-sample tensor without a weight instead."
                )
            if float(w) < 0:
                raise ValueError(f"{name}(): weight for key {key!r} is {float(w)}; weights must be >= 0.")
            parts.append(torch.stack([(t * w).reshape(()), w.reshape(())]))
        else:
            parts.append(torch.stack([t.sum(), torch.tensor(float(t.numel()), dtype=torch.float64, device=device)]))
    return values, was_dict, _reduce(torch.cat(parts), dst, group)


def mean(value: Values, *, weight: Optional[Values] = None, dst: Optional[int] = 0, group: Optional[Any] = None) -> Any:
    """The mean over all ranks of a tensor, a number, or each entry of a dict, in one collective.

    A tensor is averaged over all its elements on all ranks (uneven sizes, even empty ones, count exactly).
    With ``weight`` (a number or a dict with the same keys), each rank's scalar counts ``weight`` times.
    Returns, on rank ``dst`` (``None``: on every rank), 0-dim float tensors on the value's device in the
    structure given; ``None`` on the other ranks. A mean over zero elements is ``nan``.
    """
    values, was_dict, flat = _sums(value, weight, dst, group, "mean")
    if dst is not None and _rank(group) != dst:
        return None
    out = {}
    for i, (key, v) in enumerate(values.items()):
        total, count = flat[2 * i], flat[2 * i + 1]
        m = total / count if float(count) > 0 else torch.tensor(math.nan, dtype=torch.float64, device=flat.device)
        out[key] = _like(m, v)
    return _result(out, was_dict)


def sum(value: Values, *, dst: Optional[int] = 0, group: Optional[Any] = None) -> Any:
    """The sum over all elements on all ranks of a tensor, a number, or each entry of a dict (one
    collective, accumulated in float64). Same return convention as :func:`mean`."""
    values, was_dict, flat = _sums(value, None, dst, group, "sum")
    if dst is not None and _rank(group) != dst:
        return None
    return _result({key: _like(flat[2 * i], v) for i, (key, v) in enumerate(values.items())}, was_dict)


def _like(result: Tensor, original: Value) -> Tensor:
    if isinstance(original, Tensor):
        dtype = original.dtype if original.is_floating_point() else torch.float64
        return result.to(device=original.device, dtype=dtype)
    return result


def gather(value: Union[Tensor, Mapping[str, Tensor]], *, dst: Optional[int] = 0, group: Optional[Any] = None) -> Any:
    """Concatenate a tensor (or each tensor of a dict) from all ranks along dim 0, in rank order.

    Ranks may hold different numbers of rows (an uneven last batch): the sizes are exchanged first (one
    collective for all keys), then each key is padded to the largest size, all-gathered and trimmed (one
    collective per key). The other dimensions must agree across ranks. 0-dim tensors are stacked into
    ``(world,)``. Returns the result on rank ``dst`` (``None``: every rank), ``None`` elsewhere.
    """
    values, was_dict = _as_dict(value, "gather")
    _check_dst(dst, group, "gather")
    for key, v in values.items():
        if not isinstance(v, Tensor):
            raise TypeError(f"gather(): key {key!r} is a {type(v).__name__}; gather takes tensors.")
    tensors = {k: (v if v.dim() > 0 else v.reshape(1)) for k, v in values.items() if isinstance(v, Tensor)}
    world = _world(group)
    if world == 1:
        return _result(dict(tensors), was_dict)
    device = _comm_device(group, list(tensors.values()))
    # sizes and a fingerprint of the trailing shape, to name a mismatch instead of failing inside the backend
    meta = torch.tensor(
        [[t.shape[0], t.dim(), hash(tuple(t.shape[1:])) % (2**31)] for t in tensors.values()],
        dtype=torch.int64,
        device=device,
    )
    metas = all_gather_rows(meta, group).tolist()  # [rank][key][size, dims, fingerprint]
    out: dict[str, Tensor] = {}
    for i, (key, t) in enumerate(tensors.items()):
        sizes = [m[i][0] for m in metas]
        if any(len({m[i][j] for m in metas}) > 1 for j in (1, 2)):
            raise ValueError(
                f"gather(): key {key!r} has shape {tuple(t.shape)} on rank {_rank(group)} but a different number "
                f"of dimensions or trailing shape on another rank; only dim 0 may differ."
            )
        padded = torch.zeros((max(sizes), *t.shape[1:]), dtype=t.dtype, device=device)
        padded[: t.shape[0]] = t.detach().to(device)
        chunks = all_gather_rows(padded, group)
        out[key] = torch.cat([chunks[r, :n] for r, n in enumerate(sizes)]).to(t.device)
    if dst is not None and _rank(group) != dst:
        return None
    return _result(out, was_dict)


def all_gather_rows(tensor: Tensor, group: Optional[Any] = None) -> Tensor:
    """``(world, *tensor.shape)``: every rank's tensor of the same shape, in rank order, in one ``all_gather``
    (moved to CUDA under NCCL, kept on CPU under gloo). Without a process group: ``tensor[None]``."""
    world = _world(group)
    if world == 1:
        return tensor.unsqueeze(0)
    return comm.all_gather(tensor.to(_comm_device(group, [tensor])), group)


def per_device_batch_size(trainer: pl.Trainer) -> int:
    """The batch size of one device's training DataLoader: from the attached train DataLoader once ``fit``
    has started, else from a ``batch_size`` attribute or hyperparameter of the module or datamodule
    (Lightning's ``lightning_getattr``, as its BatchSizeFinder uses)."""
    loader = trainer.train_dataloader
    candidates = list(loader.values()) if isinstance(loader, Mapping) else loader
    if isinstance(candidates, (list, tuple)):
        candidates = candidates[0] if len(candidates) == 1 else None
    if candidates is not None:
        size = getattr(candidates, "batch_size", None)
        if size is None:
            size = getattr(getattr(candidates, "batch_sampler", None), "batch_size", None)
        if isinstance(size, int):
            return size
    module = trainer.lightning_module
    if module is not None and lightning_hasattr(module, "batch_size"):
        size = lightning_getattr(module, "batch_size")
        if isinstance(size, int):
            return size
    raise ValueError(
        "Cannot tell the per-device batch size: the training DataLoader is not attached yet (or is several "
        "loaders) and neither the LightningModule nor the DataModule has a `batch_size` attribute or "
        "hyperparameter. Pass it: effective_batch_size(trainer, batch_size=32) / ScaleLR(..., batch_size=32)."
    )


def effective_batch_size(trainer: pl.Trainer, batch_size: Optional[int] = None) -> int:
    """Samples behind one optimizer step: per-device batch x devices x nodes x ``accumulate_grad_batches``.

    ``batch_size`` is the per-device batch; without it, :func:`per_device_batch_size` finds it. Works under
    :class:`~lightning_mgpu.ManualAccumulation` too (its k is ``accumulate_grad_batches``).

    Example:

        >>> from pytorch_lightning import Trainer
        >>> from lightning_mgpu import effective_batch_size
        >>> trainer = Trainer(strategy="mgpu_ddp", accelerator="cpu", devices=2, num_nodes=2,
        ...                   accumulate_grad_batches=4, logger=False)
        >>> effective_batch_size(trainer, batch_size=16)  # 16 x 2 devices x 2 nodes x 4
        256
    """
    if batch_size is None:
        batch_size = per_device_batch_size(trainer)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: the per-device batch size must be an int >= 1.")
    return batch_size * trainer.num_devices * trainer.num_nodes * trainer.accumulate_grad_batches
