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


def test_the_popen_launcher_keeps_the_weights_only_of_the_call_it_launches():
    """Lightning drops ``weights_only`` for strategies that restore after set-up; the launcher keeps the value of the
    Trainer call it launches (``launched_weights_only``), under the default popen launch too (the script launcher
    replaces the pre-launch check's ``launch``: without this a trusted ``weights_only=False`` was read as None)."""
    from lightning_fabric.plugins.environments import LightningEnvironment

    from lightning_mgpu.strategies.launchers import _CheckedSubprocessScriptLauncher, launched_weights_only

    class _External(LightningEnvironment):
        @property
        def creates_processes_externally(self) -> bool:  # no child scripts are started here
            return True

    def _fit_impl(
        model, train_dataloaders=None, val_dataloaders=None, datamodule=None, ckpt_path=None, weights_only=None
    ):
        return "fitted"

    launcher = _CheckedSubprocessScriptLauncher(lambda trainer: None, _External(), num_processes=1, num_nodes=1)
    assert launched_weights_only(launcher) is None  # nothing launched yet
    assert launcher.launch(_fit_impl, "model", None, None, None, "last.ckpt", False) == "fitted"
    assert launched_weights_only(launcher) is False
    launcher.launch(_fit_impl, "model", ckpt_path="last.ckpt")
    assert launched_weights_only(launcher) is None  # not given: torch's default applies
