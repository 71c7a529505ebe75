"""Counting the calls that make the host wait for the device, on any machine (CPU included).

On CPU nothing really waits, so the calls themselves are counted: those that, with the tensor on a GPU, block
until the device has finished the work queued before them. The list follows what
``torch.cuda.set_sync_debug_mode("warn")`` reports (a device-to-host copy, ``item``, ``nonzero`` and the ops
whose output size depends on the data, ``torch.cuda.synchronize``), plus the Python conversions that go through
``item`` (``bool``, ``float``, ``int``, ``operator.index``, formatting) and ``GradScaler.get_scale``:

* tensor methods and torch functions through a :class:`~torch.overrides.TorchFunctionMode` (nested calls inside
  one counted call, e.g. the ``item`` inside ``__format__``, are not counted again);
* ``torch.cuda.synchronize``, ``Event``/``Stream.synchronize`` and ``GradScaler.get_scale`` through patches
  (the ``item`` inside ``get_scale`` is that one call).

Each call is attributed to its call site: the first frame outside torch and its caller (``path:line``, relative to
their package root), so that a failing test names where a sync comes from.

Usage, inside a worker process (the counter only counts inside the windows its callback opens)::

    with HostSyncs() as syncs:
        trainer = pl.Trainer(..., callbacks=[syncs.callback(), ...])  # first in the list
        trainer.fit(model)
    syncs.per_step  # a Counter of call sites for each training step
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
from torch.overrides import TorchFunctionMode

__all__ = ["SYNCING_NAMES", "HostSyncs"]

#: tensor methods / torch functions that wait for the device whatever their arguments
SYNCING_NAMES = frozenset(
    {
        "item",
        "tolist",
        "__bool__",
        "__float__",
        "__int__",
        "__index__",
        "__complex__",
        "__format__",
        "is_nonzero",
        "nonzero",
        "argwhere",
        "masked_select",
        "unique",
        "unique_consecutive",
        "equal",
        "cpu",
        "numpy",
    }
)
_TORCH_ROOT = os.path.dirname(torch.__file__) + os.sep
_THIS = os.path.abspath(__file__)


def _data_dependent(name: str, args: tuple, kwargs: dict) -> bool:
    """The calls that wait only with some arguments: a boolean-mask index, ``repeat_interleave`` with tensor
    repeats and no ``output_size``, ``to`` the CPU of a tensor on a device."""
    if name == "__getitem__" and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and repeats.numel() > 1 and kwargs.get("output_size") is None
    if name == "to":
        target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        moves = source is not None and source.device.type != "cpu"
        return moves and target is not None and torch.device(target).type == "cpu"
    return False


def call_site() -> str:
    """``path:line <- path:line``: the innermost frame outside torch and this file, and its caller (paths from
    their package's parent), so that a sync inside a helper also names who called the helper."""
    frame = sys._getframe(1)
    sites: list[str] = []
    while frame is not None and len(sites) < 2:
        path = os.path.abspath(frame.f_code.co_filename)
        if sites or (not path.startswith(_TORCH_ROOT) and path != _THIS and "contextlib" not in path):
            sites.append(f"{_short(path)}:{frame.f_lineno}")
        frame = frame.f_back  # type: ignore[assignment]
    return " <- ".join(sites) or "?"


def _short(path: str) -> str:
    parts = path.split(os.sep)
    for root in ("lightning_mgpu", "pytorch_lightning", "lightning_fabric", "lightning", "tests", "torchmetrics"):
        if root in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(root) :])
    return "/".join(parts[-2:])


class _Mode(TorchFunctionMode):
    def __init__(self, record: Callable[[str], None]) -> None:
        super().__init__()
        self.record = record

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in SYNCING_NAMES or _data_dependent(name, args, kwargs):
            self.record(name)
        return func(*args, **kwargs)


class HostSyncs:
    """Counts the calls that wait for the device while a window is open (:meth:`open` / :meth:`close`, or the
    Lightning callback of :meth:`callback`: one window per training step). ``per_step``: one Counter of
    ``"name @ path:line"`` per window; ``total``: their sum."""

    def __init__(self) -> None:
        self.per_step: list[collections.Counter] = []
        self._current: Optional[collections.Counter] = None
        self._inside = 0  # > 0 while a patched function runs: the calls it makes are its own
        self._stack = contextlib.ExitStack()

    # ---------------------------------------------------------------------------------------------- windows
    def open(self) -> None:
        self.close()
        self._current = collections.Counter()

    def close(self) -> None:
        if self._current is not None:
            self.per_step.append(self._current)
            self._current = None

    def record(self, name: str) -> None:
        if self._current is not None and not self._inside:
            self._current[f"{name} @ {call_site()}"] += 1

    @property
    def total(self) -> collections.Counter:
        out: collections.Counter = collections.Counter()
        for step in self.per_step:
            out.update(step)
        return out

    def counts(self) -> list[int]:
        """The number of waiting calls in each window."""
        return [sum(step.values()) for step in self.per_step]

    def callback(self) -> pl.Callback:
        """One window per training step: from the batch's ``on_train_batch_start`` to the next batch's (the
        forward, backward, optimizer step, every ``on_train_batch_end`` hook and Lightning's logging after it);
        closed at the epoch's end, before the epoch-end hooks. Put it first among the callbacks."""
        return _Windows(self)

    # ------------------------------------------------------------------------------------------- counting
    def _patch(self, owner: Any, name: str) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        counter = self

        def patched(*args: Any, **kwargs: Any) -> Any:
            counter.record(name)
            counter._inside += 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._inside -= 1

        setattr(owner, name, patched)
        self._stack.callback(setattr, owner, name, original)

    def __enter__(self) -> HostSyncs:
        self._patch(torch.cuda, "synchronize")
        self._patch(torch.cuda.Event, "synchronize")
        self._patch(torch.cuda.Stream, "synchronize")
        self._patch(torch.amp.GradScaler, "get_scale")
        self._stack.enter_context(_Mode(self.record))
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
        self._stack.close()


class _Windows(pl.Callback):
    def __init__(self, syncs: HostSyncs) -> None:
        self.syncs = syncs

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.syncs.open()

    def on_train_epoch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.syncs.close()

    def on_validation_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.syncs.close()

    def on_exception(self, trainer: pl.Trainer, *args: Any) -> None:
        self.syncs.close()
