"""plugins/checkpoint_io.py: atomic writes unless the user chose a plugin; every read takes the checkpoint for data."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning_fabric.plugins import TorchCheckpointIO
from pytorch_lightning.plugins.io import AsyncCheckpointIO

from lightning_mgpu import AtomicCheckpointIO
from lightning_mgpu.plugins.checkpoint_io import (
    check_sharded_metadata,
    choose_checkpoint_io,
    load_file,
    load_sharded_dir,
)
from tests.helpers import Poison


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


# --- a checkpoint is data --------------------------------------------------------------------------------------


def _refused(err: pytest.ExceptionInfo, file: Path, ckpt_path: Path) -> None:
    message = str(err.value)
    assert message.startswith(f"{file} was not loaded")
    assert "leave_marker" in message  # torch's reason: the global it refused
    assert f"trainer.fit(model, ckpt_path='{ckpt_path}', weights_only=False)" in message


@pytest.mark.parametrize("weights_only", [None, True], ids=["default", "weights_only"])
@pytest.mark.parametrize("reader", ["load_file", "AtomicCheckpointIO"])
def test_a_poisoned_file_is_refused_naming_it_and_the_call_that_loads_it(tmp_path, reader, weights_only):
    marker, path = tmp_path / "ran", tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "extra": Poison(marker)}, path)
    load = load_file if reader == "load_file" else AtomicCheckpointIO().load_checkpoint
    with pytest.raises(pickle.UnpicklingError) as err:
        load(path, weights_only=weights_only)
    _refused(err, path, path)
    assert not marker.exists()
    # negative control: the poison runs when the user asks for an unsafe load
    assert load(path, weights_only=False)["state_dict"]["w"].sum() == 2
    assert marker.exists()


def test_a_damaged_file_read_with_weights_only_false_keeps_torchs_error(tmp_path):
    path = tmp_path / "last.ckpt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(pickle.UnpicklingError) as err:
        load_file(path, weights_only=False)
    assert "was not loaded" not in str(err.value)


def _dcp_dir(tmp_path: Path, extra: object) -> Path:
    """A torch.distributed.checkpoint directory written by one process: a tensor and one non-tensor entry."""
    path = tmp_path / "sharded"
    dcp.save({"w": torch.arange(4.0), "lr": extra}, checkpoint_id=str(path))
    return path


def _template() -> dict:
    return {"w": torch.zeros(4), "lr": 0.0}


def test_a_sharded_directory_as_torch_writes_it_loads_as_data(tmp_path):
    path = _dcp_dir(tmp_path, 0.5)
    check_sharded_metadata(path, weights_only=True)
    template = _template()
    load_sharded_dir(template, path, None, weights_only=True)
    assert template["lr"] == 0.5 and template["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("weights_only", [None, True], ids=["default", "weights_only"])
def test_a_poisoned_entry_of_a_distcp_file_is_refused(tmp_path, weights_only):
    marker = tmp_path / "ran"
    path = _dcp_dir(tmp_path, Poison(marker, 0.5))
    with pytest.raises(pickle.UnpicklingError) as err:
        load_sharded_dir(_template(), path, None, weights_only=weights_only)
    _refused(err, path, path)
    assert "entry 'lr'" in str(err.value)
    assert not marker.exists()
    template = _template()
    load_sharded_dir(template, path, None, weights_only=False)  # negative control
    assert marker.exists() and template["lr"] == 0.5


@pytest.mark.parametrize("weights_only", [None, True], ids=["default", "weights_only"])
def test_a_poisoned_metadata_file_is_refused_before_torch_unpickles_it(tmp_path, weights_only):
    marker = tmp_path / "ran"
    path = _dcp_dir(tmp_path, 0.5)
    metadata = pickle.loads((path / ".metadata").read_bytes())
    metadata.planner_data = Poison(marker, metadata.planner_data)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(pickle.UnpicklingError) as err:
        load_sharded_dir(_template(), path, None, weights_only=weights_only)
    _refused(err, path / ".metadata", path)
    assert not marker.exists()
    load_sharded_dir(_template(), path, None, weights_only=False)  # negative control: torch's pickle.load runs it
    assert marker.exists()


def test_a_module_outside_the_allowed_ones_is_not_even_imported(tmp_path, monkeypatch):
    path = _dcp_dir(tmp_path, 0.5)
    # a GLOBAL opcode naming a module that would run code on import
    (path / ".metadata").write_bytes(b"cantigravity_side_effect\nfly\n.")
    imported: list[str] = []
    real_import = __import__

    def spy(name, *args, **kwargs):
        imported.append(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr("builtins.__import__", spy)
    with pytest.raises(pickle.UnpicklingError, match=r"antigravity_side_effect\.fly"):
        check_sharded_metadata(path)
    assert "antigravity_side_effect" not in imported
