"""Every launch mode of the preset table trains: the fork presets (2 CPU ranks), one spawn launch, and the popen
presets as users run them (the main job as ``python -m``, its rank 0 forked from an interpreter that has imported
torch and nothing of Lightning or the pack, ``tests/scripts.py``; the popen launch re-runs it for rank 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import WORLD, Regressor, fit, make_data
from tests.scripts import Scripts


@pytest.mark.compat
@pytest.mark.parametrize("name", ["mgpu_ddp_fork", "mgpu_ddp_notebook"])
def test_fork_presets_train(tmp_path, name):
    model = Regressor().double()
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    ranks = fit(model, name, tmp_path, accumulate=2)
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 2 * len(make_data()) // (WORLD * 4 * 2)
    torch.testing.assert_close(ranks[0]["weights"], ranks[1]["weights"])
    assert not torch.allclose(ranks[0]["weights"], before)


@pytest.mark.slow
def test_spawn_preset_trains(tmp_path):
    """One spawn launch: the strategy and the model survive pickling, and rank 0's weights come back."""
    model = Regressor().double()
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    ranks = fit(model, "mgpu_ddp_spawn", tmp_path, accumulate=2)
    torch.testing.assert_close(ranks[0]["weights"], ranks[1]["weights"])
    torch.testing.assert_close(torch.cat([p.detach().flatten() for p in model.parameters()]), ranks[0]["weights"])
    assert not torch.allclose(ranks[0]["weights"], before)
    assert ranks[0]["ledger"].optimizer_steps == ranks[0]["global_step"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mgpu_ddp", "mgpu_ddp_fp16_compress", "mgpu_ddp_powersgd", "mgpu_sharded"])
def test_popen_presets_train_the_sample(tmp_path: Path, name: str, scripts: Scripts) -> None:
    """popen re-runs the script per rank, so it is tested as users run it: the main job, as ``python -m``."""
    args = ["--strategy", name, "--min-accuracy", "0.9", "--default-root-dir", str(tmp_path)]
    proc = scripts.run_module(
        "lightning_mgpu.examples.train", args, cwd=tmp_path, output=tmp_path / "train", timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"strategy {name}" in proc.stdout
    accuracy = float(proc.stdout.split("held-out test accuracy ")[1].split()[0])
    assert accuracy >= 0.9
    ledger = proc.stdout.split("comm ledger (rank 0): ")[1]
    ratio = float(ledger.split("(ratio ")[1].split(",")[0])
    # mgpu_sharded: one gradient reduction of the uncompressed gradients per step, as mgpu_ddp
    expected = {"mgpu_ddp": 1.0, "mgpu_ddp_fp16_compress": 0.5, "mgpu_sharded": 1.0}.get(name)
    if expected is not None:
        assert ratio == pytest.approx(expected, abs=0.01)
    else:  # PowerSGD rank 1 on this CNN: far below the uncompressed bound
        assert name == "mgpu_ddp_powersgd" and ratio < 0.5
