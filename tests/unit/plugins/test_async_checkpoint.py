"""plugins/async_checkpoint.py in one process: staging copies, one write in flight, failures kept with their path,
removals deferred until the replacement is written."""

from __future__ import annotations

import pickle
import threading
from collections import OrderedDict

import torch

from lightning_mgpu.plugins.async_checkpoint import AsyncCheckpointWriter, describe_error, failure_message


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
