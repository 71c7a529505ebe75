"""plugins/checkpoint_io.py: atomic writes unless the user chose a plugin."""

from __future__ import annotations

from lightning_fabric.plugins import TorchCheckpointIO
from pytorch_lightning.plugins.io import AsyncCheckpointIO

from lightning_mgpu import AtomicCheckpointIO
from lightning_mgpu.plugins.checkpoint_io import choose_checkpoint_io


def test_no_plugin_gives_atomic_writes():
    assert isinstance(choose_checkpoint_io(None), AtomicCheckpointIO)


def test_a_plugin_the_user_gave_is_kept_as_it_is():
    io = TorchCheckpointIO()
    assert choose_checkpoint_io(io) is io


def test_a_wrapping_plugin_without_a_base_gets_atomic_writes_as_its_base():
    io = AsyncCheckpointIO()
    try:
        assert choose_checkpoint_io(io) is io
        assert isinstance(io.checkpoint_io, AtomicCheckpointIO)
    finally:
        io.teardown()
