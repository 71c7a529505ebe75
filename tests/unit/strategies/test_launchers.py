"""strategies/launchers.py, in one process: the files a worker hands its results back in."""

from __future__ import annotations

import os
import stat

import torch

from lightning_mgpu.strategies.launchers import _SavedResults


def test_worker_results_are_private_to_the_user_and_read_once():
    saved = _SavedResults({"predictions": [torch.ones(2)], "note": object.__name__})
    folder = os.path.dirname(saved.path)
    assert stat.S_IMODE(os.stat(saved.path).st_mode) == 0o600  # only the user reads or writes it
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700  # nobody else can put a file in its place
    assert os.listdir(folder) == ["results.pt"]
    loaded = saved.load()
    assert loaded["note"] == "object" and torch.equal(loaded["predictions"][0], torch.ones(2))
    assert not os.path.exists(saved.path) and not os.path.exists(folder)  # read once, then gone
