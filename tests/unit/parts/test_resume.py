"""parts/resume.py: the sampler position goes out of Lightning's loop state into the checkpoint and back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from lightning_mgpu.parts.resume import (
    LOADER_STATES_KEY,
    POSITION_KEY,
    MidEpochResume,
    ResumableDistributedSampler,
    loader_kind,
    order_sampler,
    resumable_train_loader,
)


def test_a_loaded_position_is_taken_out_of_the_checkpoint_and_kept_for_the_training_loader():
    resume = MidEpochResume()
    checkpoint = {POSITION_KEY: {"complete": False}, "epoch": 0}
    resume.after_load(checkpoint)
    assert POSITION_KEY not in checkpoint
    assert resume._position == {"complete": False}


def test_evaluation_loaders_and_loaders_without_a_trainer_are_left_as_they_are():
    resume = MidEpochResume()
    resume.sampler_requested()
    loader = object()
    assert resume.process_dataloader(loader, None) is loader
    assert resume.process_dataloader(loader, SimpleNamespace(training=False)) is loader
    assert not resume._injected  # the flag is for the one loader Lightning built next


def test_a_checkpoint_without_a_sampler_entry_is_saved_unchanged():
    checkpoint = {"loops": {"fit_loop": {"state_dict": {}}}, "epoch": 1}
    MidEpochResume().before_save(checkpoint)
    assert checkpoint == {"loops": {"fit_loop": {"state_dict": {}}}, "epoch": 1}


def _states_checkpoint(ranks: list, world_size: int, mid_epoch: bool = True) -> dict:
    return {
        "loops": {"fit_loop": {"state_dict": {"combined_loader": ranks[0]}}},
        LOADER_STATES_KEY: {
            "format": "lightning_mgpu.loader_states", "version": 1, "world_size": world_size, "epoch": 1,
            "mid_epoch": mid_epoch, "loaders": [loader_kind(s) for s in ranks[0]], "ranks": ranks,
        },
    }  # fmt: skip


def test_each_rank_gets_its_own_loader_state_back_at_the_same_world_size():
    ranks = [[{"_num_yielded": 2, "rank": r}] for r in range(2)]
    checkpoint = _states_checkpoint(ranks, 2)
    MidEpochResume().after_load(checkpoint, world_size=2, rank=1)
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"_num_yielded": 2, "rank": 1}]
    assert LOADER_STATES_KEY not in checkpoint


def test_a_per_rank_loader_state_at_another_world_size_is_refused_and_a_global_one_kept():
    torchdata_state = {"_num_yielded": 2, "_sampler_iter_state": None}
    with pytest.raises(ValueError, match=r"(?s)at world size 2.*torchdata's StatefulDataLoader.*at world size 1"):
        MidEpochResume().after_load(_states_checkpoint([[torchdata_state]] * 2, 2), world_size=1, rank=0)
    # written at an epoch's end: nothing to carry over, Lightning restarts the loader
    MidEpochResume().after_load(_states_checkpoint([[torchdata_state]] * 2, 2, mid_epoch=False), world_size=1)
    litdata_state = {"dataset": {"sample_in_epoch": 16}, "num_samples_yielded": 8, "current_epoch": 1}
    checkpoint = _states_checkpoint([[litdata_state]] * 2, 2)
    MidEpochResume().after_load(checkpoint, world_size=1, rank=0)
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [litdata_state]  # litdata re-splits


def test_loader_kinds():
    assert loader_kind({"format": "lightning_mgpu.sampler_position"}) == ("lightning_mgpu's resumable sampler", True)
    assert loader_kind({"dataset": {"sample_in_epoch": 0}, "num_samples_yielded": 0})[1] is True
    assert loader_kind({"dataset": {"a": {}}, "num_samples_yielded": {0: [1]}})[1] is False  # combined datasets
    assert loader_kind({"_num_yielded": 0}) == ("torchdata's StatefulDataLoader", False)
    assert loader_kind({"x": 1}) == ("a stateful training loader", False)


def _trainer(resuming: bool = False) -> SimpleNamespace:
    progress = SimpleNamespace(ready=0, started=0, processed=0, completed=0)
    batch_progress = SimpleNamespace(total=progress, current=progress, is_last_batch=False)
    fit_loop = SimpleNamespace(is_resuming=resuming, epoch_loop=SimpleNamespace(batch_progress=batch_progress),
                               epoch_progress=SimpleNamespace(current=progress))  # fmt: skip
    return SimpleNamespace(fit_loop=fit_loop, accumulate_grad_batches=1, training=True)


def test_a_stateful_dataloader_with_lightnings_sampler_gets_the_resumable_sampler_in_its_batch_sampler():
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import BatchSampler as TorchdataBatchSampler

    data = TensorDataset(torch.arange(12))
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    loader = StatefulDataLoader(data, batch_sampler=TorchdataBatchSampler(sampler, 2, False))
    got, took = resumable_train_loader(loader, _trainer(), injected=True, position=None)
    ours = order_sampler(got)
    assert got is loader and not took and isinstance(ours, ResumableDistributedSampler)
    assert (ours.num_replicas, ours.rank, ours.shuffle, ours.seed) == (2, 1, True, 3)
    assert [b[0].tolist() for b in got] == [[i for i in sampler][k : k + 2] for k in (0, 2, 4)]  # torch's order
    assert got.state_dict()["format"] == "lightning_mgpu.sampler_position"  # the position, not torchdata's
    # the user's own sampler (not injected by Lightning) is kept, with the loader's own state
    kept = StatefulDataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    assert resumable_train_loader(kept, _trainer(), injected=False, position=None)[0] is kept
    assert type(order_sampler(kept)) is DistributedSampler and "_num_yielded" in kept.state_dict()


def test_litdata_loaders_are_told_the_resumed_epoch_is_over_at_its_last_batch():
    resume = MidEpochResume()
    trainer = _trainer(resuming=True)
    stream = type("StreamingDataLoader", (), {"__module__": "litdata.streaming.dataloader", "restore": True})()
    resume._resumed_streams.append(stream)
    resume.batch_started(trainer)
    assert stream.restore  # not the last batch yet
    trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True
    resume.batch_started(trainer)
    assert not stream.restore and not resume._resumed_streams
