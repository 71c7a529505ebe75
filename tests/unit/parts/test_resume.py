"""parts/resume.py: the sampler position goes out of Lightning's loop state into the checkpoint and back."""

from __future__ import annotations

from types import SimpleNamespace

from lightning_mgpu.parts.resume import POSITION_KEY, MidEpochResume


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
