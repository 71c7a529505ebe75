"""``trainer.predict`` on several processes: every prediction once, in dataset order, where the call returns.

Lightning splits the predict loader across the ranks (its ``UnrepeatedDistributedSampler``, or a
``DistributedSampler`` of yours, which pads with repeated samples) and each rank's ``trainer.predict`` returns
only its own batches; after a spawn or fork launch the main process gets nothing (Lightning refuses
``return_predictions=True`` there). Lightning also records which dataset indices each predict batch holds (it
wraps every predict loader's batch sampler for its prediction writers). This part uses those indices:

* after the predict loop, every rank's ``(indices, batch output)`` pairs are gathered (``comm.py``): to every
  rank under popen/torchrun (each rank's ``trainer.predict`` returns the same list), to rank 0 under spawn and
  fork (only its worker's result reaches the main process);
* each batch output is split along its first dimension into samples (a tensor, or a dict, tuple or list of
  them, nested; ``None`` stays ``None``), a sample predicted twice (the padding) is kept once, the samples are
  put in dataset-index order and batched again with the loader's batch size.

So the list returned is the one a single process returns for the same loader, unshuffled: one entry per batch
of ``batch_size`` samples in index order (the last one shorter), the same structure. With several predict
loaders, one such list per loader. An output that cannot be split (a string, a number, a 0-d tensor, tensors
whose first dimension is not the batch's sample count, batches whose tensors differ beyond the first dimension)
is returned batch by batch instead, each rank's batches ordered by their first dataset index, with a warning
naming the fix. ``trainer.predict(..., return_predictions=False)`` turns all of it off (nothing is kept or
gathered; write predictions with a ``BasePredictionWriter``).

Example (what the strategy and its launchers call)::

    gathering = PredictionGathering()
    args, kwargs = gathering.before_launch(trainer, trainer_fn, args, kwargs)   # main process, spawn/fork
    gathering.on_predict_start(trainer)                                        # every rank
    results = gathering.gather(trainer, results, to_all=False)                 # every rank, after the run
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.combined_loader import CombinedLoader
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from pytorch_lightning.utilities.signature_utils import is_param_in_hook_signature

from lightning_mgpu import _compat, comm

#: one batch of one rank: the dataset indices it holds (``None``: unknown) and what ``predict_step`` returned
Batch = tuple[Optional[list[int]], Any]

FIX = (
    "return from predict_step a tensor with the batch dimension first (one row per sample), or a dict, tuple or "
    "list of such tensors; or write the predictions with a BasePredictionWriter and pass "
    "trainer.predict(..., return_predictions=False)"
)


class Unsplittable(ValueError):
    """A batch output that cannot be cut into one piece per sample (the message says which part and why)."""


class PredictionGathering:
    """The strategy's part for ``trainer.predict`` on several processes (see the module's docstring)."""

    def __init__(self) -> None:
        # spawn/fork only: whether this predict call returns predictions (set in the main process before the
        # workers start, so it travels to them); None: popen, where Lightning's own argument decides
        self.requested: Optional[bool] = None

    def before_launch(
        self, trainer: Optional[pl.Trainer], function: Callable, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict]:
        """Main process of a spawn/fork launch: read ``return_predictions`` of the ``trainer.predict`` call
        (``None`` counts as yes, as in one process). ``True`` is handed on as ``None``: Lightning refuses ``True``
        under a spawn/fork launcher, in the worker; :meth:`on_predict_start` keeps the predictions instead."""
        if trainer is None or trainer.state.fn != TrainerFn.PREDICTING:
            return args, kwargs
        try:
            bound = inspect.signature(function).bind(*args, **kwargs)
        except (TypeError, ValueError):
            return args, kwargs
        if "return_predictions" not in bound.signature.parameters:
            return args, kwargs
        value = bound.arguments.get("return_predictions")
        self.requested = value is not False
        if value is True:
            bound.arguments["return_predictions"] = None
        return tuple(bound.args), dict(bound.kwargs)

    def on_predict_start(self, trainer: Optional[pl.Trainer]) -> None:
        """Every worker of a spawn/fork launch: keep each batch's predictions when the call asked for them."""
        if trainer is not None and self.requested and not trainer.predict_loop.return_predictions:
            _compat.keep_predictions(trainer.predict_loop)

    def gather(self, trainer: pl.Trainer, results: Any, *, to_all: bool) -> Any:
        """Every rank, after the predict loop (a collective): the whole, ordered predictions on every rank
        (``to_all``) or on rank 0 (``None`` on the others). ``results``: what the loop returned on this rank."""
        if trainer.state.fn != TrainerFn.PREDICTING or results is None or trainer.world_size <= 1:
            return results
        if not comm.group_is_up():
            return results
        loaders = CombinedLoader(trainer.predict_dataloaders, "sequential").flattened
        several = len(loaders) > 1
        per_loader = list(results) if several else [results]
        # predict_step(dataloader_iter) may draw any number of batches per call: outputs and batches pair up only
        # when their counts are equal
        module = trainer.lightning_module
        own_iter = module is not None and is_param_in_hook_signature(module.predict_step, "dataloader_iter", True)
        mine = [local_batches(loader, batches, exact=own_iter) for loader, batches in zip(loaders, per_loader)]
        gathered = comm.all_gather_object(mine) if to_all else comm.gather_object(mine, dst=0)
        if gathered is None:
            return None
        ordered = [
            assemble([rank[i][1] for rank in gathered], batch_size(rank[i][0] for rank in gathered), loader=i)
            for i in range(len(per_loader))
        ]
        return ordered if several else ordered[0]


def local_batches(loader: object, batches: Sequence[Any], exact: bool = False) -> tuple[Optional[int], list[Batch]]:
    """This rank's batches of one loader with the dataset indices Lightning recorded for each (``None`` where it
    recorded none: not a ``DataLoader``, or an iterable dataset), and the loader's batch size. The loader may have
    drawn more batches than were predicted (workers prefetch; ``limit_predict_batches``): the first ones pair with
    the outputs. ``exact``: only when as many batches were drawn as there are outputs (``dataloader_iter``)."""
    sampler = getattr(loader, "batch_sampler", None)
    seen = getattr(sampler, "seen_batch_indices", None)
    size = getattr(sampler, "batch_size", None)
    known = isinstance(seen, list) and (len(seen) == len(batches) if exact else len(seen) >= len(batches))
    out: list[Batch] = []
    for j, output in enumerate(batches):
        indices = list(seen[j]) if known else None  # type: ignore[index]  # known: a list
        if indices is not None and not all(isinstance(i, int) for i in indices):
            indices = None
        out.append((indices, output))
    return (size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None), out


def batch_size(sizes: Any) -> Optional[int]:
    """The loader's batch size as the ranks report it (the same on every rank; ``None``: a batch sampler of
    yours without ``batch_size``)."""
    return next((s for s in sizes if s is not None), None)


def assemble(ranks: Sequence[Sequence[Batch]], size: Optional[int], loader: int = 0) -> list[Any]:
    """Every rank's batches of one loader as one process returns them: each sample once, in dataset-index order,
    in batches of ``size`` (without one: of the largest batch any rank had)."""
    batches = [b for rank in ranks for b in rank]
    if not batches:
        return []
    if any(indices is None for indices, _ in batches):
        _warn(loader, "the loader does not say which samples each batch holds (not a DataLoader over a dataset "
              "with indices, e.g. an IterableDataset)", "rank by rank")  # fmt: skip
        return [output for _, output in batches]
    if size is None:
        size = max(len(indices) for indices, _ in batches)  # type: ignore[arg-type]  # checked above
    try:
        return _rebatch(batches, size)
    except Unsplittable as err:
        _warn(loader, str(err), "ordered by each batch's first dataset index, a batch repeated by padding left out")
        return _whole_batches(batches)


def _warn(loader: int, why: str, returned: str) -> None:
    rank_zero_warn(
        f"trainer.predict could not put the predictions of predict loader {loader} back in dataset order: {why}. "
        f"It returns every rank's batch outputs as they are, {returned}. To get the one-process list, {FIX}."
    )


def _whole_batches(batches: list[Batch]) -> list[Any]:
    covered: set[int] = set()
    kept = []
    for indices, output in sorted(batches, key=lambda b: b[0][0] if b[0] else -1):
        if indices and set(indices) <= covered:
            continue
        covered.update(indices or ())
        kept.append(output)
    return kept


def _rebatch(batches: list[Batch], size: int) -> list[Any]:
    flat = [_flatten(output, len(idx or ()), f"batch of {len(idx or ())} samples") for idx, output in batches]
    spec = flat[0][0]
    for other, _ in flat[1:]:
        if other != spec:
            raise Unsplittable(f"the batches' outputs differ in structure ({_describe(spec)} and {_describe(other)})")
    first: dict[int, int] = {}  # dataset index -> its first position among all samples gathered
    position = 0
    for indices, _ in batches:
        for i in indices or ():
            first.setdefault(i, position)
            position += 1
    order = sorted(first)
    columns = []
    for leaf in range(len(flat[0][1])):
        parts = [leaves[leaf] for _, leaves in flat]
        try:
            columns.append(torch.cat(parts))
        except RuntimeError as err:
            raise Unsplittable(f"its tensors cannot be joined across batches ({err})") from None
    out = []
    for start in range(0, len(order), size):
        take = torch.tensor([first[i] for i in order[start : start + size]], dtype=torch.long)
        out.append(_unflatten(spec, iter([c.index_select(0, take) for c in columns])))
    return out


def _flatten(output: Any, n: int, where: str) -> tuple[Any, list[torch.Tensor]]:
    """``output``'s structure and its tensors, each with ``n`` rows; :class:`Unsplittable` otherwise."""
    if output is None:
        return None, []
    if isinstance(output, torch.Tensor):
        if output.dim() == 0 or output.shape[0] != n:
            raise Unsplittable(
                f"a {where} holds a tensor of shape {tuple(output.shape)}, whose first dimension is not the "
                f"batch's {n} samples"
            )
        return "tensor", [output]
    if isinstance(output, Mapping):
        keys = list(output)
        parts = [_flatten(output[k], n, f"{where}'s {k!r}") for k in keys]
        return ("mapping", type(output), tuple(keys), tuple(p[0] for p in parts)), [t for p in parts for t in p[1]]
    if isinstance(output, (tuple, list)):
        parts = [_flatten(v, n, f"{where}'s item {i}") for i, v in enumerate(output)]
        return ("sequence", type(output), tuple(p[0] for p in parts)), [t for p in parts for t in p[1]]
    raise Unsplittable(f"a {where} holds a {type(output).__name__} ({output!r:.60}), which has no row per sample")


def _unflatten(spec: Any, leaves: Any) -> Any:
    if spec is None:
        return None
    if spec == "tensor":
        return next(leaves)
    kind, cls = spec[0], spec[1]
    if kind == "mapping":
        values = {k: _unflatten(s, leaves) for k, s in zip(spec[2], spec[3])}
        try:
            return cls(values)
        except Exception:
            return values
    items = [_unflatten(s, leaves) for s in spec[2]]
    if hasattr(cls, "_fields"):  # a namedtuple
        return cls(*items)
    return cls(items)


def _describe(spec: Any) -> str:
    if spec is None or spec == "tensor":
        return str(spec)
    if spec[0] == "mapping":
        return f"{spec[1].__name__} with keys {list(spec[2])}"
    return f"{spec[1].__name__} of {len(spec[2])}"
