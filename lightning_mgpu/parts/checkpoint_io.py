"""Which checkpoint IO plugin a strategy uses: atomic file writes unless the user chose a plugin."""

from __future__ import annotations

from typing import Optional

from lightning_fabric.plugins import CheckpointIO

from lightning_mgpu._compat import is_wrapping_checkpoint_io
from lightning_mgpu.checkpoint_io import AtomicCheckpointIO


def choose_checkpoint_io(current: Optional[CheckpointIO]) -> CheckpointIO:
    """:class:`~lightning_mgpu.AtomicCheckpointIO` for ``None``; a plugin that was given is used as it is; a
    wrapping plugin without a base (e.g. ``AsyncCheckpointIO()``) gets ``AtomicCheckpointIO`` as its base.

    Example::

        io = choose_checkpoint_io(None)  # AtomicCheckpointIO()
    """
    if current is None:
        return AtomicCheckpointIO()
    if is_wrapping_checkpoint_io(current):
        current.checkpoint_io = AtomicCheckpointIO()  # type: ignore[attr-defined]  # ignored when it has a base
    return current
