"""The preset table: registration, re-registration, listing, and that every preset name trains."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import StrategyRegistry

import lightning_mgpu
from lightning_mgpu import PRESETS, preset_table, register_presets
from lightning_mgpu.presets import LAUNCH_EXCEPTIONS, LAUNCH_VARIANTS
from lightning_mgpu.strategies import MGPUStrategyMixin
from tests.helpers import WORLD, Regressor, fit, make_data

NAMES = [p.name for p in PRESETS]


def test_importing_the_package_registers_every_preset_with_its_description():
    for p in PRESETS:
        entry = StrategyRegistry[p.name]
        assert entry["strategy"] is p.strategy
        assert entry["description"] == p.description
        assert entry["init_params"] == p.init_params


def test_registering_twice_is_harmless():
    before = {name: dict(StrategyRegistry[name]) for name in NAMES}
    register_presets()
    importlib.reload(lightning_mgpu)
    after = {name: dict(StrategyRegistry[name]) for name in NAMES}
    assert before.keys() == after.keys()
    for name in NAMES:
        assert after[name]["init_params"] == before[name]["init_params"]
        assert after[name]["description"] == before[name]["description"]


@pytest.mark.compat
@pytest.mark.parametrize("preset", PRESETS, ids=NAMES)
def test_trainer_builds_the_preset_configuration(preset):
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=preset.name, logger=False)
    strategy = trainer.strategy
    assert isinstance(strategy, MGPUStrategyMixin)  # every mgpu strategy (the sharded stages 2/3 are not DDP)
    assert isinstance(strategy, preset.strategy)
    assert strategy.launch_settings.start_method == preset.init_params["start_method"]
    assert getattr(strategy, "comm_hook", None) == preset.init_params.get("comm_hook")
    assert strategy.process_group_backend in (None, "gloo")  # decided at setup; gloo on CPU


def test_list_prints_every_name_description_and_launch_mode():
    out = subprocess.run(
        [sys.executable, "-m", "lightning_mgpu", "--list"], capture_output=True, text=True, check=True
    ).stdout
    assert out == preset_table() + "\n"
    for p in PRESETS:
        line = next(line for line in out.splitlines() if line.startswith(p.name + " "))
        assert p.description in line and line.rstrip().endswith(p.launch)


def test_every_preset_family_has_every_launch_variant_or_says_why_not():
    """Each family (a popen preset outside LAUNCH_EXCEPTIONS) has a _spawn and a _notebook (fork) preset of the
    same class and arguments; every preset is a family member or an exception that the table explains."""
    by_name = {p.name: p for p in PRESETS}
    launches = {"": "popen", "_spawn": "spawn", "_notebook": "fork"}
    assert set(LAUNCH_VARIANTS) == set(launches)
    assert set(LAUNCH_EXCEPTIONS) <= set(by_name)
    families = [p for p in PRESETS if p.launch == "popen" and p.name not in LAUNCH_EXCEPTIONS]
    members = set()
    for family in families:
        args = {k: v for k, v in family.init_params.items() if k != "start_method"}
        for suffix, launch in launches.items():
            variant = by_name.get(family.name + suffix)
            assert variant is not None, f"{family.name}{suffix} is missing"
            assert variant.strategy is family.strategy and variant.launch == launch
            assert {k: v for k, v in variant.init_params.items() if k != "start_method"} == args
            members.add(variant.name)
    assert members | set(LAUNCH_EXCEPTIONS) == set(by_name)
    table = preset_table()
    assert all(f"{name}: {why}" in table for name, why in LAUNCH_EXCEPTIONS.items())


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
def test_popen_presets_train_the_sample(tmp_path, name):
    """popen re-runs the script per rank, so it is tested as users run it: the main job, as a subprocess."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_mgpu.examples.train",
            "--strategy",
            name,
            "--min-accuracy",
            "0.9",
            "--default-root-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
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
