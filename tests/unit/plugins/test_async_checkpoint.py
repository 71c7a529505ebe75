"""plugins/async_checkpoint.py in one process: staging copies, one write in flight, failures kept with their path,
removals deferred until the replacement is written. The GPU path of staging (copies queued on a side stream,
ordered by events) is checked here for its order of calls, with CPU tensors standing in for GPU ones; that the
copies land where they should on a GPU is the GPU tier's (``tests/gpu/test_gpu_parts.py``)."""

from __future__ import annotations

import contextlib
import copy
import pickle
import threading
from collections import OrderedDict
from typing import Any

import pytest
import torch

from lightning_mgpu.plugins import async_checkpoint
from lightning_mgpu.plugins.async_checkpoint import AsyncCheckpointWriter, CudaStreams, describe_error, failure_message
from tests.parts_harness import in_one_rank_group


def test_staged_state_does_not_change_when_training_changes_the_live_state():
    weight = torch.arange(6.0).reshape(2, 3)
    moments = {"exp_avg": torch.ones(3), "step": torch.tensor(4.0)}
    checkpoint = {"state_dict": OrderedDict(w=weight), "optimizer_states": [{"state": {0: moments}}], "epoch": 1,
                  "callbacks": {"best_k_models": {"a.ckpt": torch.tensor(0.5)}}}  # fmt: skip
    writer = AsyncCheckpointWriter()
    staged = writer.stage(checkpoint)

    weight.add_(1)  # an optimizer step, in place
    moments["exp_avg"].mul_(2)
    moments["step"] += 1
    checkpoint["callbacks"]["best_k_models"]["b.ckpt"] = torch.tensor(0.1)  # ModelCheckpoint's dict, mutated

    assert torch.equal(staged["state_dict"]["w"], torch.arange(6.0).reshape(2, 3))
    assert isinstance(staged["state_dict"], OrderedDict)
    assert torch.equal(staged["optimizer_states"][0]["state"][0]["exp_avg"], torch.ones(3))
    assert staged["optimizer_states"][0]["state"][0]["step"].item() == 4.0
    assert list(staged["callbacks"]["best_k_models"]) == ["a.ckpt"]
    assert staged["epoch"] == 1


def test_no_copy_means_the_staged_state_changes_negative_control():
    weight = torch.zeros(3)
    staged = {"w": weight}  # what handing the live dict to a thread amounts to
    weight.add_(1)
    assert not torch.equal(staged["w"], torch.zeros(3))


def test_shared_tensors_stay_shared_and_buffers_are_reused_across_saves():
    tied = torch.randn(4)
    writer = AsyncCheckpointWriter()
    first = writer.stage({"encoder": tied, "decoder": tied})
    assert first["encoder"] is first["decoder"]
    pointer = first["encoder"].data_ptr()
    tied.add_(1)
    second = writer.stage({"encoder": tied, "decoder": tied})
    assert second["encoder"].data_ptr() == pointer  # the same staging buffer, refreshed
    assert torch.equal(second["encoder"], tied)
    assert not AsyncCheckpointWriter(keep_buffers=False).stage({"t": tied})["t"].data_ptr() == tied.data_ptr()


def test_objects_deepcopy_cannot_copy_are_kept_as_they_are():
    lock = threading.Lock()  # deepcopy raises on locks
    staged = AsyncCheckpointWriter().stage({"w": torch.ones(2), "odd": lock})
    assert staged["odd"] is lock and torch.equal(staged["w"], torch.ones(2))


def test_at_most_one_write_in_flight_a_new_save_waits_for_the_previous():
    writer = AsyncCheckpointWriter()
    release = threading.Event()
    order: list[str] = []

    def first() -> None:
        assert release.wait(10)
        order.append("first")

    writer.submit("a.ckpt", first)
    assert writer.in_flight
    threading.Timer(0.05, release.set).start()
    writer.submit("b.ckpt", lambda: order.append("second"))  # blocks until the first write finished
    assert order[0] == "first"
    assert writer.finish() == []
    assert order == ["first", "second"] and not writer.in_flight


def test_a_failure_is_kept_with_its_path_and_cause_until_finish():
    writer = AsyncCheckpointWriter(rank=3)

    def fail() -> None:
        raise PermissionError(13, "Permission denied", "/ckpt/last.ckpt")

    writer.submit("/ckpt/last.ckpt", fail)
    failures = writer.finish()
    assert failures == ["/ckpt/last.ckpt: on rank 3, PermissionError: [Errno 13] Permission denied: '/ckpt/last.ckpt'"]
    assert isinstance(writer.take_causes()[0], PermissionError)
    assert writer.finish() == []  # reported once
    message = failure_message(failures + failures)  # two ranks saw the same failure: named once
    assert message.count("/ckpt/last.ckpt: on rank 3") == 1 and "async_checkpoint=False" in message


def test_removals_wait_for_the_write_in_flight_and_never_follow_a_failed_one():
    writer = AsyncCheckpointWriter()
    removed: list[str] = []
    release = threading.Event()
    writer.submit("new.ckpt", lambda: release.wait(10) and None)
    writer.remove_after_write(lambda: removed.append("old.ckpt"))
    assert removed == []  # the replacement is still being written
    release.set()
    writer.finish()
    assert removed == ["old.ckpt"]

    writer.remove_after_write(lambda: removed.append("idle.ckpt"))  # nothing in flight: at once
    assert removed == ["old.ckpt", "idle.ckpt"]

    failing = threading.Event()

    def fail() -> None:
        failing.wait(10)
        raise OSError("disk full")

    writer.submit("newer.ckpt", fail)
    writer.remove_after_write(lambda: removed.append("kept.ckpt"))
    failing.set()
    assert len(writer.finish()) == 1
    assert "kept.ckpt" not in removed  # the old checkpoint stays: its replacement failed
    writer.remove_after_write(lambda: removed.append("asked-late.ckpt"))  # asked after the failure
    assert "asked-late.ckpt" not in removed


def test_a_distributed_checkpoint_failure_names_the_ranks_it_happened_on():
    class FakeCheckpointException(Exception):
        failures = {1: (OSError(28, "No space left on device"), None)}

    assert describe_error(FakeCheckpointException("long remote traceback"), rank=0) == (
        "on rank 1, OSError: [Errno 28] No space left on device"
    )


def test_the_writer_pickles_for_a_spawn_launch_without_its_thread_or_buffers():
    writer = AsyncCheckpointWriter(rank=1)
    writer.stage({"w": torch.ones(2)})
    writer.submit("a.ckpt", lambda: None)
    copy = pickle.loads(pickle.dumps(writer))
    assert copy.rank == 1 and not copy.in_flight and copy.finish() == []
    copy.submit("b.ckpt", lambda: None)  # works in the new process
    assert copy.finish() == []


# ---------------------------------------------------------------------------------------------------------
# staging on a side stream (the GPU path), and on the CPU
# ---------------------------------------------------------------------------------------------------------


class _Recorded:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, other: _Recorded) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: _Recorded) -> None:
        self.log.append(("wait_event", self.name, event.name))

    def record(self, stream: _Recorded) -> None:
        self.log.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))


class _RecordingStreams(CudaStreams):
    """What staging asks of ``torch.cuda``, recorded instead of done (the copies themselves are real)."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.events = 0

    def current_stream(self, device: torch.device) -> Any:
        return _Recorded(self.log, "current")

    def new_stream(self, device: torch.device) -> Any:
        self.log.append(("new_stream", device.type))
        return _Recorded(self.log, "side")

    def use(self, stream: Any) -> Any:
        log = self.log

        class Context:
            def __enter__(self) -> None:
                log.append(("enter", stream.name))

            def __exit__(self, *exc: Any) -> None:
                log.append(("exit", stream.name))

        return Context()

    def new_event(self) -> Any:
        self.events += 1
        return _Recorded(self.log, f"event{self.events}")

    def record_use(self, tensor: torch.Tensor, stream: Any) -> None:
        self.log.append(("record_use", stream.name))

    def writing_on(self, device: torch.device, stream: Any) -> Any:
        self.log.append(("writing_on", device.type, stream.name))
        return contextlib.nullcontext()


def test_gpu_staging_queues_the_copies_after_training_and_training_after_them_and_the_host_waits_for_nothing(
    monkeypatch,
):
    monkeypatch.setattr(async_checkpoint, "SIDE_STREAM_DEVICES", ("cpu",))  # CPU tensors take the GPU's path
    log: list = []
    writer = AsyncCheckpointWriter()
    writer._cuda = _RecordingStreams(log)
    weight, momentum = torch.arange(3.0), torch.ones(2)
    staged = writer.stage({"state_dict": {"w": weight}, "optimizer": {"m": momentum}, "epoch": 1})
    copy_on_side = [("enter", "side"), ("exit", "side"), ("record_use", "side")]
    assert log == [
        ("new_stream", "cpu"),
        ("wait_stream", "side", "current"),  # the copies read the sources as the queued training work leaves them
        *copy_on_side,  # w, on the side stream; the allocator keeps a freed source until the copy ran
        *copy_on_side,  # m
        ("record", "event1", "side"),  # after the last copy
        ("wait_event", "current", "event1"),  # training's next kernels (the optimizer step) wait for the copies
    ]  # and no synchronize: stage returned without waiting
    assert writer.copies_pending and staged["epoch"] == 1
    assert torch.equal(staged["state_dict"]["w"], torch.arange(3.0))

    writer.submit("a.ckpt", lambda: log.append(("write",)))
    assert writer.finish() == []
    assert log[-3:] == [
        ("synchronize", "event1"),  # the write reads the copies once they landed
        ("writing_on", "cpu", "side"),  # on the training's device; DCP syncs the idle side stream, not training's
        ("write",),
    ]
    assert not writer.copies_pending

    del log[:]
    writer.stage({"w": weight})  # the next save: the same side stream
    assert ("new_stream", "cpu") not in log and log[0] == ("wait_stream", "side", "current")
    writer.wait_staged()
    assert log[-1] == ("synchronize", "event2") and not writer.copies_pending


class _NoCuda(CudaStreams):
    def __getattribute__(self, name: str) -> Any:
        raise AssertionError(f"staging CPU tensors asked torch.cuda for {name}")


def test_cpu_staging_copies_before_it_returns_and_never_asks_for_streams():
    writer = AsyncCheckpointWriter()
    writer._cuda = _NoCuda()
    live = torch.ones(3)
    staged = writer.stage({"w": live})
    live.add_(1)
    assert torch.equal(staged["w"], torch.ones(3)) and not writer.copies_pending
    writer.submit("a.ckpt", lambda: None)
    assert writer.finish() == []


def _gpu_mesh_dtensor() -> tuple[Any, Any]:
    """A one-rank ``DTensor`` and the same one on a mesh that says it is of GPUs (as FSDP2's on CUDA), whose
    local shard is a CPU tensor (here no GPU: the mesh's device type is set through torch's private field)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    live = distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh, [Shard(0)])
    gpu_mesh = copy.copy(mesh)
    gpu_mesh._device_type = "cuda"
    spec = copy.copy(live._spec)
    spec.mesh = gpu_mesh
    return live, DTensor(live.to_local(), spec, requires_grad=False)


def _a_staged_gpu_shard_stays_in_cpu_memory() -> None:
    from torch.distributed.tensor import DTensor

    _, on_gpu_mesh = _gpu_mesh_dtensor()
    writer = AsyncCheckpointWriter()
    staged = writer.stage({"w": on_gpu_mesh})["w"]
    assert isinstance(staged, DTensor) and staged.device_mesh.device_type == "cuda"
    assert staged.placements == on_gpu_mesh.placements and staged.shape == on_gpu_mesh.shape
    assert staged.to_local().device.type == "cpu"
    assert staged.to_local().data_ptr() == writer._buffers[0].data_ptr()  # the staging buffer, not a GPU copy of it
    on_gpu_mesh.to_local().add_(1)  # training goes on
    assert torch.equal(staged.to_local(), torch.arange(6.0).reshape(2, 3))

    # negative control: DTensor.from_local takes the copy to the mesh's device (here there is none)
    try:
        moved = DTensor.from_local(writer._buffers[0], on_gpu_mesh.device_mesh, on_gpu_mesh.placements, run_check=False)
    except (AssertionError, RuntimeError) as err:
        assert "CUDA" in str(err)
    else:
        assert moved.to_local().device.type == "cuda"


def test_a_staged_dtensor_of_a_gpu_mesh_keeps_its_local_copy_in_cpu_memory():
    in_one_rank_group(_a_staged_gpu_shard_stays_in_cpu_memory)


def _a_cpu_dtensor_is_staged_as_before() -> None:
    from torch.distributed.tensor import DTensor

    live, _ = _gpu_mesh_dtensor()
    writer = AsyncCheckpointWriter()
    staged = writer.stage({"w": live})["w"]
    assert isinstance(staged, DTensor) and staged.device_mesh is live.device_mesh
    assert torch.equal(staged.to_local(), live.to_local()) and staged.to_local().device.type == "cpu"


def test_a_dtensor_on_a_cpu_mesh_is_staged_through_from_local_as_before():
    in_one_rank_group(_a_cpu_dtensor_is_staged_as_before)


@pytest.mark.parametrize("keep", [True, False])
def test_cpu_sources_get_unpinned_buffers_reused_across_saves_unless_told_not_to(keep):
    writer = AsyncCheckpointWriter(keep_buffers=keep)
    first = writer.stage({"w": torch.ones(2)})["w"]
    second = writer.stage({"w": torch.zeros(2)})["w"]
    assert (first.data_ptr() == second.data_ptr()) == keep
    assert not second.is_pinned() and torch.equal(second, torch.zeros(2))
