"""The preset table: registration, re-registration, listing, and the configuration each preset name builds (in
one process; the trainings are in tests/integration/test_presets.py)."""

from __future__ import annotations

import importlib

import lightning.pytorch
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import StrategyRegistry

import lightning_mgpu
import lightning_mgpu.lightning
from lightning_mgpu import PRESETS, UnknownPreset, preset_table, register_presets
from lightning_mgpu.presets import LAUNCH_EXCEPTIONS, LAUNCH_VARIANTS, preset_hint
from lightning_mgpu.strategies.runtime import Runtime
from tests.helpers import WORLD

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
    assert isinstance(strategy._runtime, Runtime)  # every mgpu strategy holds one (the sharded stages 2/3: not DDP)
    assert isinstance(strategy, preset.strategy)
    assert strategy.launch_settings.start_method == preset.init_params["start_method"]
    assert getattr(strategy, "comm_hook", None) == preset.init_params.get("comm_hook")
    assert strategy.process_group_backend in (None, "gloo")  # decided at setup; gloo on CPU


def test_list_prints_every_name_description_and_launch_mode(capsys: pytest.CaptureFixture[str]) -> None:
    """``lightning-mgpu --list``, in this process: the command ends before any launch (``python -m lightning_mgpu``
    as a fresh interpreter runs it is tested by the 4-bit base's export). Imported here: the command needs
    jsonargparse, which the compatibility tiers' environments leave out."""
    from lightning_mgpu.cli import main

    assert main(["--list"]) == 0
    out = capsys.readouterr().out
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


# --- a misspelt preset name: named by the Trainer of each namespace, before anything starts -------------------------

TRAINERS = {"pytorch_lightning": pl.Trainer, "lightning": lightning.pytorch.Trainer}
UNKNOWN = {"pytorch_lightning": UnknownPreset, "lightning": lightning_mgpu.lightning.UnknownPreset}
REGISTRIES = {"pytorch_lightning": StrategyRegistry, "lightning": lightning.pytorch.strategies.StrategyRegistry}


@pytest.mark.parametrize("namespace", list(TRAINERS))
@pytest.mark.parametrize(
    ("typo", "closest"),
    [
        ("mgpu_pipline", "mgpu_pipeline"),
        ("mgpu_dpp", "mgpu_ddp"),
        ("MGPU_ZERO_3", "mgpu_zero3"),
        ("zero_3", "mgpu_zero3"),
    ],
)
def test_a_misspelt_preset_names_the_closest_presets_and_the_list(namespace, typo, closest):
    with pytest.raises(UNKNOWN[namespace]) as info:
        TRAINERS[namespace](accelerator="cpu", devices=WORLD, strategy=typo, logger=False)
    message = str(info.value)
    assert message.startswith(f"Trainer(strategy={typo!r}): no strategy of that name is registered.")
    assert f"did you mean {closest!r}" in message
    assert all(p.name in message for p in PRESETS) and "`lightning-mgpu --list` describes them" in message
    assert isinstance(info.value, ValueError)  # what Lightning raises for an unknown strategy name
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("namespace", list(TRAINERS))
def test_names_lightning_knows_pass_through_untouched(namespace):
    trainer_class, registry = TRAINERS[namespace], REGISTRIES[namespace]
    for name, expected in (("ddp", "DDPStrategy"), ("DDP_Spawn", "DDPStrategy"), ("mgpu_ddp", "MGPUDDPStrategy")):
        strategy = trainer_class(accelerator="cpu", devices=WORLD, strategy=name, logger=False).strategy
        assert type(strategy).__name__ == expected
    assert type(trainer_class(accelerator="cpu", devices=1, strategy="auto", logger=False).strategy).__name__ == (
        "SingleDeviceStrategy"
    )
    ddp = registry["ddp"]["strategy"]
    registry.register("mgpu_someone_elses", ddp, description="a third party's name that reads like a preset")
    try:
        strategy = trainer_class(accelerator="cpu", devices=WORLD, strategy="mgpu_someone_elses", logger=False).strategy
        assert type(strategy) is ddp
    finally:
        registry.remove("mgpu_someone_elses")
    # negative control: a name that reads like no preset is left to Lightning's own refusal
    with pytest.raises(ValueError, match="You selected an invalid strategy name") as info:
        trainer_class(accelerator="cpu", devices=WORLD, strategy="deepspeedd", logger=False)
    assert not isinstance(info.value, UNKNOWN[namespace])


def test_the_trainer_and_the_command_name_the_same_closest_presets():
    from lightning_mgpu.cli import strategy_hint

    with pytest.raises(UnknownPreset) as info:
        pl.Trainer(strategy="mgpu_shardd", logger=False)
    assert preset_hint("mgpu_shardd") in str(info.value) and preset_hint("mgpu_shardd") in strategy_hint("mgpu_shardd")
    assert "did you mean 'mgpu_sharded'" in preset_hint("mgpu_shardd")
