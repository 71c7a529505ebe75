"""The pipeline's micro-batches and their logs: a batch cut into micro-batches along the first dimension of every
tensor (its size checked against ``pipeline_microbatches``, the training loader's batches too), the evaluation batch's
fingerprint that the ranks of a pipeline compare, and the ``self.log`` calls of the micro-batches combined into one
per name with their ``reduce_fx``."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_mgpu import comm
from lightning_mgpu.parts.pipeline.plan import PipelineError


def _leaves(batch: Any) -> list[Tensor]:
    if isinstance(batch, Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in _leaves(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _leaves(v)]
    return []


def _split(batch: Any, m: int) -> list[Any]:
    if isinstance(batch, Tensor):
        return list(batch.chunk(m)) if batch.dim() > 0 else [batch] * m
    if isinstance(batch, dict):
        parts = {k: _split(v, m) for k, v in batch.items()}
        return [type(batch)({k: parts[k][i] for k in batch}) for i in range(m)]
    if isinstance(batch, (list, tuple)):
        parts_list = [_split(v, m) for v in batch]
        rows = [[p[i] for p in parts_list] for i in range(m)]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
            return [type(batch)(*row) for row in rows]
        return [type(batch)(row) for row in rows]
    return [batch] * m


def split_batch(batch: Any, m: int) -> list[Any]:
    """``batch`` (tensors, and lists, tuples and dicts of them) cut into ``m`` micro-batches along the first
    dimension of every tensor; anything else is repeated. Raises :class:`PipelineError` where a tensor's first
    dimension does not divide by ``m``."""
    sizes = {t.shape[0] for t in _leaves(batch) if t.dim() > 0}
    bad = sorted(s for s in sizes if s % m)
    if bad:
        raise PipelineError(
            f"A batch of {bad[0]} samples does not divide into pipeline_microbatches={m} equal micro-batches. Use a "
            f"batch size that is a multiple of {m} (and drop_last=True in the DataLoader if the dataset's last batch "
            f"is smaller), or pipeline_microbatches={math.gcd(bad[0], m)}."
        )
    return _split(batch, m)


def check_loader_batches(loader: Any, m: int, batches_run: float) -> None:
    """Refuse, before the first training batch, a training ``loader`` whose batches do not all split into ``m``
    equal micro-batches: its batch size, or its last (smaller) batch where ``batches_run`` (the batches an epoch
    runs: Lightning's ``num_training_batches``, the steps' limit) reaches it, instead of failing at the end of the
    first epoch. A loader whose length is unknown (an iterable dataset, a batch sampler) is checked batch by batch
    (:func:`split_batch`).

    Example:

        >>> from torch.utils.data import DataLoader
        >>> check_loader_batches(DataLoader(range(12), batch_size=4), m=2, batches_run=3)  # 3 batches of 4
        >>> check_loader_batches(DataLoader(range(13), batch_size=4), m=2, batches_run=2)  # the last never runs
    """
    from torch.utils.data import DataLoader

    if not isinstance(loader, DataLoader) or loader.batch_size is None:
        return
    try:
        samples = len(loader.sampler)  # type: ignore[arg-type]  # this data replica's, after Lightning's sampler
    except TypeError:
        return
    size = loader.batch_size
    if samples < size:  # one batch, of every sample (none with drop_last)
        if loader.drop_last or not samples or samples % m == 0:
            return
        size = samples
    last = 0 if loader.drop_last else samples % size
    if size % m == 0 and (not last or last % m == 0 or batches_run < len(loader)):
        return
    bad = size if size % m else last
    raise PipelineError(
        f"The training loader's batches do not all divide into pipeline_microbatches={m} equal micro-batches: "
        f"{samples} samples per data replica in batches of {size} "
        + (f"give a batch of {size}. Use a batch size that is a multiple of {m}" if size % m else "")
        + (
            f"leave a last batch of {last}. Pass drop_last=True to the training DataLoader, or use a batch size and "
            f"dataset size whose remainder divides by {m}"
            if not size % m
            else ""
        )
        + f", or pipeline_microbatches={math.gcd(bad, m)}."
    )


def _first_tensor(value: Any) -> Optional[Tensor]:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], Tensor):
        return value[0]
    return None


def batch_fingerprint(batch: Any) -> list[tuple[tuple[int, ...], float]]:
    """The shapes and sums of ``batch``'s tensors: what the ranks of a pipeline compare to know they hold the same
    batch (every evaluation batch, and the first training batch of a fit)."""
    return [(tuple(t.shape), float(t.detach().double().nan_to_num().sum())) for t in _leaves(batch)]


def check_same_batch(batch: Any, method: str, group: Any, ranks: str, error: type[ValueError] = PipelineError) -> None:
    """Every rank of ``group`` (``ranks``: what they are, for the message) holds the same ``batch`` of ``method``:
    its shapes and sums compared, a collective of the group. One that differs raises ``error`` on every rank of the
    group, with the two causes and their fixes (ranks that must compute on one batch would otherwise train on a mix
    of several, silently)."""
    fingerprints = comm.all_gather_object(batch_fingerprint(batch), group=group)
    if any(f != fingerprints[0] for f in fingerprints):
        raise error(
            f"The ranks of {ranks} got different {method} batches (their shapes and sums: {fingerprints}). They must "
            f"see the same batch: shard the loaders over the data dimension only, with "
            f"trainer.strategy.distributed_sampler_kwargs (Lightning's automatic sampler does), not over the global "
            f"ranks; and build the same data in every process (data drawn at random, in the module's __init__ for "
            f"instance, differs between processes unless seeded: call seed_everything(...) before building it)."
        )


def _to_device(value: Any, device: torch.device) -> Any:
    """``value`` (tensors, and lists, tuples and dicts of them) with its tensors detached and on ``device``."""
    if isinstance(value, Tensor):
        return value.detach().to(device)
    if isinstance(value, dict):
        return type(value)({k: _to_device(v, device) for k, v in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_to_device(v, device) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value


_REDUCE = {"mean": "mean", "sum": "sum", "max": "max", "min": "min"}


def _reduce_name(fx: Any) -> str:
    name = fx if isinstance(fx, str) else getattr(fx, "__name__", repr(fx))
    if name not in _REDUCE:
        raise PipelineError(
            f"self.log(..., reduce_fx={fx!r}) under pipeline parallelism: the micro-batches' values are combined "
            f"with reduce_fx, which must be one of 'mean', 'sum', 'max', 'min'."
        )
    return name


def combine_logs(
    records: list[list[tuple[str, Any, dict[str, Any]]]], device: Optional[torch.device] = None
) -> list[tuple[str, Tensor, dict[str, Any]]]:
    """The ``self.log`` calls of each micro-batch's ``training_step`` (in micro-batch order) as one call per name:
    the values combined with the call's ``reduce_fx`` (a mean of equal micro-batches is the whole batch's value), on
    ``device`` (the CPU by default), where a tensor logged on it stays: nothing is read on the host. A whole number
    (``self.log("seen", x.shape[0])``) is reduced in torch's default float dtype, as Lightning reduces it."""
    combined: dict[str, tuple[list[Tensor], dict[str, Any]]] = {}
    for calls in records:
        for name, value, kwargs in calls:
            if not isinstance(value, (Tensor, int, float)):
                raise PipelineError(
                    f"self.log({name!r}, {type(value).__name__}) under pipeline parallelism: only numbers and "
                    f"tensors can be combined over the micro-batches. Log a tensor (metric.compute()) instead."
                )
            tensor = torch.as_tensor(value, device=device or "cpu").detach()
            if not tensor.is_floating_point():  # as Lightning's self.log: reduced in the default float dtype
                tensor = tensor.to(torch.get_default_dtype())
            combined.setdefault(name, ([], kwargs))[0].append(tensor)
    out = []
    for name, (values, kwargs) in combined.items():
        stacked = torch.stack([v.reshape(()) for v in values])
        fx = _reduce_name(kwargs.get("reduce_fx", "mean"))
        value = getattr(stacked, fx)() if fx in ("mean", "sum") else getattr(stacked, fx)().reshape(())
        out.append((name, value, kwargs))
    return out
