"""Micro-batching that survives out-of-memory errors: split each loader batch into micro-batches, accumulate their
gradients, and when any rank runs out of memory, let every rank back off together and redo the step.

The gradient is that of the whole loader batch: micro-batch ``i`` of ``r_i`` rows out of ``n`` contributes its
loss times ``r_i / n`` (exact for a loss that is a mean over rows, the usual case). After every micro-batch
attempt the ranks agree, with one small all-reduce, on whether any of them ran out of memory and whether any
has micro-batches left (ranks whose loader batches differ in size stay in step). On an out-of-memory error
anywhere, every rank restores the gradients it had at the start of the step, halves the micro-batch and redoes
the step from its first row: no row is used twice or lost, no rank waits for another. After ``grow_after``
clean steps the micro-batch grows again (towards the last size that failed, or doubling), so it adapts when
memory pressure changes mid-run. A micro-batch of one row that still does not fit raises
:class:`MicroBatchTooSmall` on every rank.

Example::

    mb = MicroBatching("auto")
    output = mb.run(batch, forward=step, backward=lambda loss: loss.backward(), params=model.parameters())
    output.backward()  # as Lightning's closure does: adds the step's gradients in
    mb.size, mb.backoffs  # the micro-batch in use, and every back-off with the ranks that hit it
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from lightning_mgpu import comm

__all__ = ["BackOff", "MicroBatchTooSmall", "MicroBatching", "batch_rows", "is_out_of_memory", "slice_batch"]

log = logging.getLogger(__name__)

MicroBatchSize = Union[int, str]


class MicroBatchTooSmall(RuntimeError):
    """A micro-batch of one row ran out of memory: there is nothing smaller to back off to."""


@dataclass(frozen=True)
class BackOff:
    """One back-off: at which loader batch (counted from the first one this part ran), from which micro-batch size
    to which, and the ranks that ran out of memory."""

    step: int
    from_size: int
    to_size: int
    ranks: tuple[int, ...]


def is_out_of_memory(err: BaseException) -> bool:
    """``torch.OutOfMemoryError`` (CUDA), or the CPU allocator's "can't allocate memory"."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and ("out of memory" in str(err) or "can't allocate memory" in str(err))


def batch_rows(batch: Any) -> int:
    """The number of rows of ``batch``: the first dimension of its first tensor (tuples, lists, dicts nest)."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise ValueError("micro_batch_size cannot split a batch whose first tensor is a scalar (no rows).")
        return int(batch.shape[0])
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, Sequence) else ()
    for item in items:
        if isinstance(item, (torch.Tensor, Mapping)) or (isinstance(item, Sequence) and not isinstance(item, str)):
            try:
                return batch_rows(item)
            except ValueError:
                continue
    raise ValueError(
        f"micro_batch_size cannot split a batch of type {type(batch).__name__}: it splits tensors (in tuples, lists "
        f"or dicts) along their first dimension, and found none. Leave micro_batch_size=None for this model."
    )


def slice_batch(batch: Any, start: int, stop: int, rows: int) -> Any:
    """Rows ``[start, stop)`` of every tensor of ``batch`` whose first dimension is ``rows``; anything else (other
    tensors, strings, numbers) is passed whole. Named tuples and dict subclasses keep their type."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() > 0 and batch.shape[0] == rows else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: slice_batch(v, start, stop, rows) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(slice_batch(v, start, stop, rows) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(slice_batch(v, start, stop, rows) for v in batch)
    return batch


def _loss_of(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"With micro_batch_size set, training_step must return the loss (a tensor) or a dict with 'loss'; it "
            f"returned {type(output).__name__}. Skipping a batch by returning None is not supported with "
            f"micro-batching."
        )
    return loss


class _SetAside:
    """The step's own gradients, kept apart from the ones already there. Lightning zeroes gradients *after*
    ``training_step`` and before its backward, so the micro-batches' gradients are computed from ``None``, put
    aside when the step is done (the earlier gradients go back in place for Lightning's ``zero_grad``), and
    added in when Lightning runs backward on the returned loss. A redo only drops the step's own: no copy."""

    def __init__(self, params: Sequence[torch.Tensor], keep: bool) -> None:
        self.params = list(params)
        # not kept: they were about to be zeroed anyway, and the step never holds two sets of gradients
        self.before = [p.grad if keep else None for p in self.params]
        self.own: list[Optional[torch.Tensor]] = []
        self.drop()

    def drop(self) -> None:
        for p in self.params:
            p.grad = None

    def put_aside(self) -> None:
        self.own = [p.grad for p in self.params]
        for p, grad in zip(self.params, self.before):
            p.grad = grad

    def add_in(self) -> None:
        for p, grad in zip(self.params, self.own):
            if grad is None:
                continue
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)
        self.own = []


def no_agreement(oom: bool, left: int) -> tuple[tuple[int, ...], int]:
    """The agreement of a single process: its own flag and count."""
    return ((0,) if oom else ()), left


def agree_across_ranks(group: Any, rank: int, world: int, device: torch.device) -> Callable[[bool, int], Any]:
    """The agreement of ``world`` ranks: one all-reduce (MAX) of ``[oom flag per rank..., micro-batches left]``.
    Returns ``(ranks that ran out of memory, most micro-batches any rank has left)``."""

    def agree(oom: bool, left: int) -> tuple[tuple[int, ...], int]:
        flags = torch.zeros(world + 1, dtype=torch.int64, device=device)
        flags[rank] = int(oom)
        flags[world] = left
        comm.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=group)
        values = flags.tolist()
        return tuple(r for r in range(world) if values[r]), int(values[world])

    return agree


class MicroBatching:
    """The micro-batch size and the loop that runs one loader batch as micro-batches (see the module docstring).

    Args:
        size: an int (rows per micro-batch; it may back off below this and grows back up to it) or ``"auto"``
            (start with the whole loader batch, halve on out-of-memory errors, grow back after clean steps).
        grow_after: clean steps at a backed-off size before trying a larger one.
        rank: this process's global rank (rank 0 logs the back-offs).
    """

    def __init__(self, size: MicroBatchSize, grow_after: int = 50, rank: int = 0) -> None:
        if size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"micro_batch_size={size!r} must be a positive int or 'auto'.")
        self.setting = size
        self.grow_after = grow_after
        self.rank = rank
        self.size: Optional[int] = None if size == "auto" else int(size)
        self.backoffs: list[BackOff] = []
        self.steps = 0
        self._ceiling: Optional[int] = None  # the smallest size known to have failed
        self._clean = 0

    def _cap(self, rows: int) -> int:
        return rows if self.setting == "auto" else min(rows, int(self.setting))

    def _size_for(self, rows: int) -> int:
        if self.size is None:
            self.size = rows
        return max(1, min(self.size, self._cap(rows)))

    def _grow(self, rows: int) -> None:
        assert self.size is not None
        self._clean += 1
        cap = self._cap(rows)
        if self.size >= cap or self._clean < self.grow_after:
            return
        self._clean = 0
        if self._ceiling is not None and self._ceiling - self.size > 1:
            target = (self.size + self._ceiling) // 2  # bisect towards the size that failed
        else:
            self._ceiling = None  # next to the failed size: probe past it (memory pressure may have eased)
            target = self.size * 2
        self.size = min(cap, target)

    def _back_off(self, size: int, ranks: tuple[int, ...]) -> None:
        if size <= 1:
            raise MicroBatchTooSmall(
                f"rank(s) {list(ranks)} ran out of memory with a micro-batch of 1 row, so there is nothing smaller to "
                f"back off to. The model states and one row's activations do not fit: shard them "
                f"(strategy='mgpu_sharded' or 'mgpu_zero3'), checkpoint activations (activation_checkpointing=...), "
                f"use a lower precision, or more devices (`lightning-mgpu plan` says which fits)."
            )
        smaller = max(1, size // 2)
        self.backoffs.append(BackOff(self.steps, size, smaller, ranks))
        if self.rank == 0:  # every rank backs off together: said once, by rank 0, naming the ranks that ran out
            log.warning(
                "micro-batching: rank(s) %s ran out of memory at micro_batch_size=%d (step %d); every rank redoes the "
                "step at micro_batch_size=%d",
                list(ranks),
                size,
                self.steps,
                smaller,
            )
        self.size = smaller
        self._ceiling = size
        self._clean = 0
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give the failed attempt's blocks back before the retry

    def run(
        self,
        batch: Any,
        *,
        forward: Callable[[Any], Any],
        backward: Callable[[torch.Tensor], Any],
        no_sync: Callable[[], AbstractContextManager] = contextlib.nullcontext,
        agree: Callable[[bool, int], tuple[tuple[int, ...], int]] = no_agreement,
        params: Sequence[torch.Tensor] = (),
        after_backward: Callable[[], None] = lambda: None,
        keep_gradients: bool = True,
    ) -> Any:
        """Forward and backward every micro-batch of ``batch`` (each under ``no_sync()``), retrying on
        out-of-memory errors; returns the last micro-batch's output with its loss replaced by the whole batch's:
        a leaf tensor whose backward adds the step's gradients into ``params``' ``.grad`` and then calls
        ``after_backward``. ``keep_gradients=False``: the gradients already there are dropped at the start (the
        first batch of an accumulation window, where Lightning zeroes them anyway)."""
        rows = batch_rows(batch)
        grads = _SetAside(params, keep_gradients)
        while True:
            size = self._size_for(rows)
            bounds = [(s, min(s + size, rows)) for s in range(0, rows, size)]
            total: Optional[torch.Tensor] = None
            last_output: Any = None
            failed: tuple[int, ...] = ()
            i = 0
            while True:
                oom = False
                output: Any = None
                loss: Optional[torch.Tensor] = None
                if i < len(bounds):
                    start, stop = bounds[i]
                    try:
                        with no_sync():
                            output = forward(slice_batch(batch, start, stop, rows))
                            loss = _loss_of(output) * ((stop - start) / rows)
                            backward(loss)
                        part = loss.detach()
                        total = part if total is None else total + part
                        last_output = output
                    except Exception as err:
                        if not is_out_of_memory(err):
                            raise
                        oom = True
                    output = loss = None  # the graph and the failed attempt's tensors go now
                failed, left = agree(oom, max(0, len(bounds) - i - 1))
                if failed or left == 0:
                    break
                i += 1
            if not failed:
                break
            grads.drop()
            self._back_off(size, failed)
        self.steps += 1
        self._grow(rows)
        assert total is not None
        grads.put_aside()
        # A leaf: the loss Lightning logs and runs backward on; that backward adds the step's gradients in (after
        # Lightning's zero_grad), then ``after_backward`` runs (the strategy's gradient sync).
        total = total.detach().requires_grad_(True)

        def deliver(grad: torch.Tensor) -> None:
            grads.add_in()
            after_backward()

        total.register_hook(deliver)
        if isinstance(last_output, Mapping):
            return {**last_output, "loss": total}
        return total
