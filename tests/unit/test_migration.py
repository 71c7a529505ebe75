"""Lightning 1.x Trainer arguments (``gpus=2``, ``resume_from_checkpoint=...``) name their replacement, in the
Trainer of each namespace, instead of Python's bare "unexpected keyword argument"."""

from __future__ import annotations

import inspect

import lightning.pytorch
import pytest
import pytorch_lightning as pl
import torch

import lightning_mgpu  # guards both Trainers
import lightning_mgpu.lightning
from lightning_mgpu.migration import REMOVED_TRAINER_ARGUMENTS, RemovedTrainerArgument

TRAINERS = {"pytorch_lightning": pl.Trainer, "lightning": lightning.pytorch.Trainer}
ERRORS = {"pytorch_lightning": RemovedTrainerArgument, "lightning": lightning_mgpu.lightning.RemovedTrainerArgument}


@pytest.mark.parametrize("namespace", list(TRAINERS))
@pytest.mark.parametrize("name", list(REMOVED_TRAINER_ARGUMENTS))
def test_a_removed_trainer_argument_names_its_replacement(namespace, name):
    with pytest.raises(ERRORS[namespace]) as info:
        TRAINERS[namespace](logger=False, **{name: 3})
    message = str(info.value)
    assert f"Trainer({name}=3) was removed in Lightning 2.0: write " in message
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)  # either `except` catches it
    assert not torch.distributed.is_initialized()


def test_gpus_with_a_dropped_accelerator_names_both_replacements():
    with pytest.raises(ValueError) as info:
        pl.Trainer(gpus=2, accelerator="ddp")
    message = str(info.value)
    assert "Trainer(gpus=2) was removed in Lightning 2.0: write Trainer(accelerator='gpu', devices=2)" in message
    assert "accelerator='ddp' is not a Lightning 2 name" in message and "strategy='mgpu_ddp'" in message


@pytest.mark.parametrize("namespace", list(TRAINERS))
def test_the_guarded_trainer_keeps_its_signature_and_builds(namespace):
    trainer_class = TRAINERS[namespace]
    assert "accelerator" in inspect.signature(trainer_class.__init__).parameters  # what LightningCLI reads
    trainer = trainer_class(accelerator="cpu", devices=1, logger=False, max_steps=1)
    assert trainer.max_steps == 1


def test_without_the_guard_python_gives_no_replacement():
    """Negative control: Lightning's own __init__ (the one the guard wraps)."""
    unguarded = pl.Trainer.__init__.__wrapped__
    with pytest.raises(TypeError, match="unexpected keyword argument 'gpus'") as info:
        unguarded(object.__new__(pl.Trainer), gpus=2)
    assert not isinstance(info.value, RemovedTrainerArgument)
