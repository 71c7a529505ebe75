"""plugins/checkpoint_rules.py without a Trainer: the refusal of a save that could not resume, and who writes and
removes a checkpoint (rank 0's file; under fault tolerance, only the group that writes)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import pytest

from lightning_mgpu.parts.resume import MidEpochResume
from lightning_mgpu.plugins.checkpoint_rules import CheckpointRules


def rules(start_method: str = "popen", world: int = 2, writes: Optional[bool] = None) -> CheckpointRules:
    """The rules of a strategy with no module yet, ``world`` processes on one node, synchronous saves; ``writes``: a
    replica group that writes (True) or does not (False), or no fault tolerance (None)."""
    settings: Any = SimpleNamespace(start_method=start_method, checkpoint_params="all", async_checkpoint=False)
    strategy: Any = SimpleNamespace(lightning_module=None, is_global_zero=True, world_size=world)
    replicas: Any = None if writes is None else SimpleNamespace(writes_checkpoints=lambda: writes)
    return CheckpointRules(strategy, settings, MidEpochResume(), replicas, lambda: (world, 1))


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_save_in_the_main_process_after_a_fork_or_spawn_launch_is_refused_naming_the_ways_that_work(start_method):
    with pytest.raises(RuntimeError) as info:
        rules(start_method).before_save({})
    message = str(info.value)
    assert f"after a {start_method!r} launch" in message
    assert "ModelCheckpoint(save_last=True)" in message and "start_method='popen'" in message
    # negative controls: after a popen launch (the main process is rank 0) and with one process, the save goes on
    rules("popen").before_save({})
    rules(start_method, world=1).before_save({})


@pytest.mark.parametrize(("writes", "expected"), [(None, ["save", "remove"]), (True, ["save", "remove"]), (False, [])])
def test_only_a_group_that_writes_checkpoints_writes_and_removes_them(writes, expected):
    done: list[str] = []
    checkpoint_rules = rules(writes=writes)
    checkpoint_rules.write_file({}, "last.ckpt", None, lambda checkpoint, path, options: done.append("save"))
    checkpoint_rules.remove_when_written(lambda: done.append("remove"))
    assert done == expected
    assert not checkpoint_rules.write_in_flight
