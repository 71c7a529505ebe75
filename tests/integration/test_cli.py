"""The ``lightning-mgpu`` command (LightningCLI with the pack imported), every YAML in configs/, and the hints
for unknown or dropped names. Configs are parsed in this process; trainings run as a user runs them, as
``python -m lightning_mgpu`` forked from the session's script runner (the popen presets re-run the command once per
rank)."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import docstring_parser
import pytest
import pytorch_lightning as pl
import torch
import yaml
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

import lightning_mgpu
import lightning_mgpu.cli
from lightning_mgpu.cli import main
from lightning_mgpu.presets import PRESETS, RENAMED

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
# sample modules and the elastic-restart recipe; every other config is named after its preset
EXTRAS = {"gan.yaml", "transformer.yaml", "elastic.yaml"}


def print_config(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(["fit", *args, "--print_config"])
    out = capsys.readouterr().out
    assert info.value.code in (0, None), out
    return out


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run ``lightning-mgpu fit ...`` in this process; it must exit 2 (jsonargparse's usage error) before any
    process group exists. Returns standard error."""
    with pytest.raises(SystemExit) as info:
        main(["fit", *args])
    assert info.value.code == 2
    assert not torch.distributed.is_initialized()
    return capsys.readouterr().err


def strategy_of(config: Path) -> object:
    return yaml.safe_load(config.read_text())["trainer"]["strategy"]


def test_list_prints_the_preset_table_and_version_the_version(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == lightning_mgpu.preset_table().strip()
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"lightning-mgpu {lightning_mgpu.__version__}"


def test_there_is_a_config_per_preset_and_sample():
    names = {c.name for c in CONFIGS}
    assert {f"{p.name.removeprefix('mgpu_')}.yaml" for p in PRESETS} | EXTRAS == names


@pytest.mark.parametrize("preset", PRESETS, ids=[p.name for p in PRESETS])
def test_a_preset_config_selects_its_preset(preset):
    """By name, or spelled out as the class with the preset's arguments (to show options the name hides)."""
    strategy = strategy_of(ROOT / "configs" / f"{preset.name.removeprefix('mgpu_')}.yaml")
    if isinstance(strategy, str):
        assert strategy == preset.name
    else:
        assert strategy["class_path"] == f"lightning_mgpu.{preset.strategy.__name__}"
        assert preset.init_params.items() <= strategy["init_args"].items()


@pytest.mark.compat
@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_config_round_trips_through_print_config(config, capsys, tmp_path):
    first = print_config(capsys, "--config", str(config))
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(first)
    second = print_config(capsys, "--config", str(dumped))
    assert second == first
    parsed = yaml.safe_load(first)
    assert parsed["trainer"]["strategy"] == strategy_of(config) or (
        parsed["trainer"]["strategy"]["class_path"] == strategy_of(config)["class_path"]  # type: ignore[index]
    )
    assert parsed["model"]["class_path"].startswith("lightning_mgpu.examples.")


def launch_of(config: Path) -> str:
    strategy = strategy_of(config)
    if isinstance(strategy, str):
        return str(StrategyRegistry[strategy]["init_params"].get("start_method", "popen"))
    return str(strategy["init_args"].get("start_method", "popen"))  # type: ignore[index]


#: the popen configs run as a user runs them, a new interpreter per rank: one per kind of runtime (data parallel,
#: sharded with a precision plugin, the pipeline, the tensor plan). The popen launch itself is the same for every
#: strategy (tests/integration/test_presets.py launches four more presets so); the other popen configs train under a
#: fork launch of the same strategy and settings (about 17 s less each: no interpreter to start per rank).
POPEN_AS_WRITTEN = {"ddp.yaml", "zero3.yaml", "pipeline.yaml", "tensor_parallel.yaml"}
#: the spawn configs run as written (fresh interpreters that unpickle the Trainer): one per kind of runtime (data
#: parallel, sharded, periodic averaging, the planner's choice); the others (ZeRO-1, ZeRO-2, DiLoCo: a runtime of a
#: kind above with other settings) train under a fork launch of the same strategy and settings (about 20 s less each)
SPAWN_AS_WRITTEN = {"ddp_spawn.yaml", "zero3_spawn.yaml", "local_sgd_spawn.yaml", "auto_spawn.yaml"}


def forked(config: Path, into: Path) -> Path:
    """``config`` with its strategy launched by fork from this process, every other setting as written."""
    data = yaml.safe_load(config.read_text())
    strategy = data["trainer"]["strategy"]
    if isinstance(strategy, str):  # a preset: its class with its settings
        preset = StrategyRegistry[strategy]
        strategy = {"class_path": f"lightning_mgpu.{preset['strategy'].__name__}", "init_args": preset["init_params"]}
    data["trainer"]["strategy"] = {**strategy, "init_args": {**strategy.get("init_args", {}), "start_method": "fork"}}
    into.write_text(yaml.safe_dump(data))
    return into


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_config_trains_with_fast_dev_run(config, tmp_path, capfd, monkeypatch, scripts):
    """As a user runs it: ``python -m lightning_mgpu fit --config ...`` for the popen presets of ``POPEN_AS_WRITTEN``
    (rank 0 forked from the session's script runner, the command re-run per rank by the launch), the other popen
    configs under a fork launch; the fork and spawn presets launch their workers from this process (the spawn configs
    not in ``SPAWN_AS_WRITTEN`` by fork)."""
    as_written = {"popen": POPEN_AS_WRITTEN, "spawn": SPAWN_AS_WRITTEN}.get(launch_of(config))
    run = forked(config, tmp_path / config.name) if as_written is not None and config.name not in as_written else config
    args = [
        "fit",
        "--config",
        str(run),
        "--trainer.fast_dev_run",
        "true",
        "--trainer.default_root_dir",
        str(tmp_path),
    ]
    if launch_of(run) == "popen":  # rank 0 forked from the session's runner (tests/scripts.py), as python -m runs it
        proc = scripts.run_module("lightning_mgpu", args, cwd=tmp_path, output=tmp_path / "fit", timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out = proc.stdout
    else:
        monkeypatch.chdir(tmp_path)
        assert main(args) == 0
        out = capfd.readouterr().out  # printed by rank 0, a forked or spawned worker
    strategy = strategy_of(config)
    name = strategy if isinstance(strategy, str) else strategy["class_path"]  # type: ignore[index]
    expected = StrategyRegistry[name]["strategy"].__name__ if isinstance(strategy, str) else name.rpartition(".")[2]
    assert f"lightning-mgpu fit: {expected} on 2 process(es) (CPUAccelerator, 1 node(s)), 1 epoch(s)" in out
    assert "metrics: " in out and "(none logged)" not in out  # fast_dev_run: one training and validation batch


def test_an_unknown_preset_is_refused_with_the_closest_name_and_the_presets(capsys):
    err = refused(capsys, "--config", str(ROOT / "configs" / "ddp.yaml"), "--trainer.strategy", "mgpu_dpp")
    assert "trainer.strategy: 'mgpu_dpp' is not a registered strategy name" in err
    assert "did you mean 'mgpu_ddp'" in err
    assert all(p.name in err for p in PRESETS)


_TYPO_CONFIG = """
model:
  class_path: {namespace}.demos.boring_classes.BoringModel
data:
  class_path: {namespace}.demos.boring_classes.BoringDataModule
trainer:
  accelerator: cpu
  devices: 2
  strategy: mgpu_pipline
"""


@pytest.mark.parametrize("namespace", ["pytorch_lightning", "lightning.pytorch"])
def test_a_misspelt_preset_in_a_config_is_refused_by_the_command_and_by_a_users_own_lightningcli(
    namespace, capsys, tmp_path
):
    config = tmp_path / "typo.yaml"
    config.write_text(_TYPO_CONFIG.format(namespace=namespace))
    err = refused(capsys, "--config", str(config))  # lightning-mgpu fit: the parser's usage error and the hint
    assert "trainer.strategy: 'mgpu_pipline' is not a registered strategy name" in err
    assert "did you mean 'mgpu_pipeline'?" in err
    # a user's own LightningCLI (the pack imported): the Trainer it builds refuses the name, naming the preset
    cli = importlib.import_module(f"{namespace}.cli")
    with pytest.raises(ValueError) as info:
        cli.LightningCLI(args=["fit", "--config", str(config)], run=True)
    assert type(info.value).__name__ == "UnknownPreset"
    assert "did you mean 'mgpu_pipeline'?" in str(info.value) and "`lightning-mgpu --list`" in str(info.value)
    assert not torch.distributed.is_initialized()


def test_a_misspelled_option_in_a_config_gets_jsonargparse_message_and_the_hint(capsys, tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text("trainer:\n  accelerator: cpu\n  stratgey: mgpu_ddp\n")
    err = refused(capsys, "--config", str(config))
    assert "does not accept option 'trainer.stratgey'" in err  # jsonargparse's own message, first
    assert "did you mean 'trainer.strategy' instead of 'trainer.stratgey'?" in err
    assert all(p.name in err for p in PRESETS)


def test_a_misspelled_strategy_argument_names_the_closest_argument(capsys, tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_mgpu.MGPUDDPStrategy\n    init_args:\n      comm_hok: fp16\n"
    )
    err = refused(capsys, "--config", str(config))
    assert "comm_hok" in err and "did you mean 'comm_hook'" in err


def test_a_misspelled_strategy_argument_in_inline_json_names_the_closest_argument(capsys):
    """On the command line the class comes as JSON; jsonargparse, failing to build it, keeps it as a string."""
    inline = '{"class_path": "lightning_mgpu.MGPUDDPStrategy", "init_args": {"comm_hok": "fp16"}}'
    err = refused(capsys, "--config", str(ROOT / "configs" / "ddp.yaml"), "--trainer.strategy", inline)
    assert "lightning_mgpu.MGPUDDPStrategy does not take 'comm_hok' (did you mean 'comm_hook'?)" in err
    assert "is not a registered strategy name" not in err


def test_a_lightning_1x_trainer_option_names_its_replacement(capsys):
    err = refused(capsys, "--config", str(ROOT / "configs" / "ddp.yaml"), "--trainer.gpus", "2")
    assert "unrecognized arguments: --trainer.gpus 2" in err  # jsonargparse's own message, first
    assert "trainer.gpus was removed in Lightning 2.0: write Trainer(accelerator='gpu', devices=N)" in err
    assert "did you mean 'trainer.plugins'" not in err  # the closest spelling is no help here


@pytest.mark.parametrize("old", RENAMED, ids=[f"{r.registry}={r.old}" for r in RENAMED])
def test_a_dropped_lightning_1x_name_is_refused_with_its_replacement(old):
    with pytest.raises(ValueError) as info:
        pl.Trainer(logger=False, **{old.registry: old.old})
    message = str(info.value)
    assert f"{old.registry}={old.old!r}" in message and f"Write {old.replacement}." in message
    assert "mgpu_" in old.replacement
    assert not torch.distributed.is_initialized()


def test_a_dropped_name_in_a_config_is_refused_before_the_trainer_with_its_replacement(capsys):
    err = refused(capsys, "--config", str(ROOT / "configs" / "ddp.yaml"), "--trainer.accelerator", "ddp")
    assert "trainer.accelerator: accelerator='ddp' is not a Lightning 2 name" in err
    assert "strategy='mgpu_ddp'" in err


def test_lightning_own_names_are_not_shadowed():
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    assert type(trainer.strategy) is DDPStrategy
    assert not any(r.old in ("ddp", "ddp_spawn", "fsdp") for r in RENAMED if r.registry == "strategy")


_USER_SCRIPT = """
import sys
from pytorch_lightning.cli import LightningCLI
from pytorch_lightning.demos.boring_classes import BoringDataModule, BoringModel

def cli(strategy):
    args = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", strategy]
    return LightningCLI(BoringModel, BoringDataModule, args=args, run=False)

assert "lightning_mgpu" not in sys.modules
try:
    cli("mgpu_ddp")
except ValueError as e:
    print("name before import:", str(e).split(":")[0])
assert "lightning_mgpu" not in sys.modules
by_class = cli('{"class_path": "lightning_mgpu.MGPUDDPStrategy", "init_args": {"comm_hook": "fp16"}}')
print("class_path:", repr(by_class.trainer.strategy))
import lightning_mgpu
print("name after import:", type(cli("mgpu_ddp").trainer.strategy).__name__)
"""


@pytest.mark.slow
def test_a_users_own_lightningcli_takes_the_class_path_without_import_and_names_after_import(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _USER_SCRIPT], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "class_path: MGPUDDPStrategy(comm_hook='fp16'" in proc.stdout
    assert "name before import: You selected an invalid strategy name" in proc.stdout  # Lightning's own refusal
    assert "name after import: MGPUDDPStrategy" in proc.stdout


def test_a_dropped_name_that_someone_else_registered_is_left_to_them():
    saved = StrategyRegistry.pop("dp")
    try:
        StrategyRegistry.register("dp", DDPStrategy, description="a user's own 'dp'")
        lightning_mgpu.register_presets()  # as on a re-import
        assert StrategyRegistry["dp"]["strategy"] is DDPStrategy
    finally:
        StrategyRegistry.register(
            "dp", saved["strategy"], description=saved["description"], override=True, **saved["init_params"]
        )


def test_the_hint_never_suggests_a_dropped_name():
    hint = lightning_mgpu.cli.strategy_hint("dp2")
    assert "'dp'" not in hint and "'ddp2'" not in hint
    assert "did you mean 'ddp'" in hint


_MYMODEL = """
import torch
import torch.nn.functional as F
from pytorch_lightning import LightningModule
from torch.utils.data import DataLoader, TensorDataset


class MyModel(LightningModule):
    def __init__(self, hidden: int = 8):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, hidden)
        self.fc2 = torch.nn.Linear(hidden, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8)
"""

# what the `lightning-mgpu` console script does: a file outside the user's folder (pip writes it to the venv's bin/)
_CONSOLE_SCRIPT = """import sys
from lightning_mgpu.cli import main
sys.exit(main())
"""


def test_the_console_script_imports_the_users_module_from_the_current_directory(tmp_path):
    user, bin_dir = tmp_path / "project", tmp_path / "bin"
    user.mkdir()
    bin_dir.mkdir()
    (user / "mymodel.py").write_text(_MYMODEL)
    (user / "cfg.yaml").write_text("model:\n  class_path: mymodel.MyModel\n")
    script = bin_dir / "lightning-mgpu"
    script.write_text(_CONSOLE_SCRIPT)
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(script), "plan", "--config", "cfg.yaml", "--devices", "2", "--device-memory", "1GiB"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=user,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mymodel.MyModel" in proc.stdout and "**<- recommended**" in proc.stdout


@pytest.mark.parametrize(
    "name", ["MGPUDDPStrategy", "MGPUShardedStrategy", "MGPULocalSGDStrategy", "MGPUDiLoCoStrategy", "MGPUAutoStrategy"]
)
def test_fit_help_lists_every_argument_of_a_strategy_with_its_help(capsys, name):
    """``lightning-mgpu fit --trainer.strategy.help CLASS``: each keyword, with the docstring of its settings field
    (the one declaration of the option) as its help."""
    with pytest.raises(SystemExit) as done:
        main(["fit", "--trainer.strategy.help", name])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    cls = getattr(lightning_mgpu, name)
    documented = {p.arg_name: p.description for p in docstring_parser.parse(inspect.getdoc(cls) or "").params}
    for keyword, parameter in inspect.signature(cls.__init__).parameters.items():
        if keyword == "self" or parameter.kind is inspect.Parameter.VAR_KEYWORD:
            continue
        help_text = " ".join((documented.get(keyword) or "").split())
        assert help_text, keyword
        assert f"--trainer.strategy.{keyword} " in text, keyword
        assert " ".join(help_text.split()[:4]) in text, (keyword, help_text)
