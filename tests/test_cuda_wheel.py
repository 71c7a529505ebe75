"""torch's CUDA wheel without a GPU: every ``Trainer`` asks CUDA for the device count, and torch then marks each
process forked afterwards as a "bad fork" (``torch.cuda._is_in_bad_fork()``). Lightning's fork launcher refuses
to start in such a process, even for CPU workers that never touch CUDA; the mgpu fork presets start (their CPU
workers are safe), and keep Lightning's refusal on CUDA. On the CPU wheel the state is simulated the way torch
reports it; on the CUDA wheel (``make test-compat``) it is real."""

from __future__ import annotations

import multiprocessing
import traceback
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy

from lightning_mgpu import MGPUDDPStrategy
from tests.helpers import RankData, Regressor, make_data


def _fit_in_a_fork_child(strategy: Any, out: Path) -> None:
    torch.cuda._is_in_bad_fork = lambda: True  # what torch reports here on its CUDA wheel after a device-count query
    try:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
        )
        trainer.fit(Regressor().double(), datamodule=RankData(make_data(n=16), 4))
        out.write_text("ok")
    except BaseException:
        out.write_text(traceback.format_exc())


def _run(strategy: Any, tmp_path: Path) -> str:
    out = tmp_path / "result.txt"
    child = multiprocessing.get_context("fork").Process(target=_fit_in_a_fork_child, args=(strategy, out))
    child.start()
    child.join(timeout=120)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked fit did not end")
    return out.read_text()


def test_a_cpu_fork_launch_starts_in_a_process_torch_marks_as_a_bad_fork(tmp_path):
    assert _run(MGPUDDPStrategy(start_method="fork"), tmp_path) == "ok"


def test_lightnings_own_fork_launcher_refuses_there(tmp_path):
    """Negative control: the state the test above starts in is the one Lightning refuses."""
    assert "Cannot re-initialize CUDA in forked subprocess" in _run(DDPStrategy(start_method="fork"), tmp_path)
