"""Both Lightning namespaces: ``import lightning as L`` (what Lightning's docs use) and ``import pytorch_lightning``.

Every preset name works in both Trainers; every public plugin has a copy for each namespace
(``lightning_mgpu.X`` / ``lightning_mgpu.lightning.X``) built from the same source file; the ``lightning-mgpu``
command follows the namespace of the model it is given. The compatibility subset (``-m compat``: parity of every
preset, manual accumulation, sharded resume at another world size, CLI round trip) runs here a second time from
the ``lightning`` copy of the tests (``tests.lightning_ns``, see ``tests/__init__.py``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning as L
import lightning.pytorch
import pytest
import pytorch_lightning as pl
import torch

import lightning_mgpu
import lightning_mgpu.examples
import lightning_mgpu.lightning
import lightning_mgpu.lightning.examples
from lightning_mgpu._namespace import LIGHTNING_RENAMES, rewrite_imports
from tests.scripts import Scripts

ROOT = Path(__file__).resolve().parents[2]
NAMESPACES: dict[str, tuple[ModuleType, ModuleType]] = {
    "pytorch_lightning": (pl, lightning_mgpu),
    "lightning": (lightning.pytorch, lightning_mgpu.lightning),
}
IDS = list(NAMESPACES)


def _public_instances(mgpu: ModuleType) -> dict[str, Any]:
    """One instance of every public plugin class, as a user would pass it to the Trainer."""
    return {
        "MGPUDDPStrategy": mgpu.MGPUDDPStrategy(start_method="fork"),
        "MGPUShardedStrategy": mgpu.MGPUShardedStrategy(stage=3, start_method="fork"),
        "MGPUAutoStrategy": mgpu.MGPUAutoStrategy(device_memory="8GiB", start_method="fork"),
        "MGPULocalSGDStrategy": mgpu.MGPULocalSGDStrategy(sync_every=4, start_method="fork"),
        "MGPUDiLoCoStrategy": mgpu.MGPUDiLoCoStrategy(sync_every=4, start_method="fork"),
        "MGPUPrecision": mgpu.MGPUPrecision("bf16-mixed"),
        "AtomicCheckpointIO": mgpu.AtomicCheckpointIO(),
        "DeviceMonitor": mgpu.DeviceMonitor(),
        "ScaleLR": mgpu.ScaleLR(base_batch_size=32),
        "EMA": mgpu.EMA(decay=0.9),
    }


@pytest.mark.parametrize("namespace", IDS)
def test_every_preset_name_builds_its_strategy_in_the_namespaces_trainer(namespace):
    ns, mgpu = NAMESPACES[namespace]
    for preset in mgpu.PRESETS:
        trainer = ns.Trainer(accelerator="cpu", devices=2, strategy=preset.name, logger=False)
        assert isinstance(trainer.strategy, preset.strategy), preset.name
        assert isinstance(trainer.strategy, ns.strategies.Strategy)
        assert type(trainer.strategy).__module__.startswith(mgpu.__name__ + ".")


@pytest.mark.parametrize("namespace", IDS)
def test_every_public_plugin_is_accepted_by_the_namespaces_trainer(namespace):
    ns, mgpu = NAMESPACES[namespace]
    instances = _public_instances(mgpu)
    lightning_bases = (ns.strategies.Strategy, ns.plugins.Precision, ns.Callback, ns.plugins.CheckpointIO)
    public = {
        name
        for name in mgpu.__all__
        if inspect.isclass(getattr(mgpu, name)) and issubclass(getattr(mgpu, name), lightning_bases)
    }
    assert public == set(instances), "a public plugin class is missing from this test"
    for strategy in (
        "MGPUDDPStrategy",
        "MGPUShardedStrategy",
        "MGPUAutoStrategy",
        "MGPULocalSGDStrategy",
        "MGPUDiLoCoStrategy",
    ):
        trainer = ns.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=instances[strategy],
            plugins=[instances["MGPUPrecision"], instances["AtomicCheckpointIO"]],
            callbacks=[instances["DeviceMonitor"], instances["ScaleLR"], instances["EMA"]],
            logger=False,
        )
        assert trainer.strategy is instances[strategy]
        assert trainer.precision_plugin is instances["MGPUPrecision"]
        assert trainer.strategy.checkpoint_io is instances["AtomicCheckpointIO"]
        assert all(instances[c] in trainer.callbacks for c in ("DeviceMonitor", "ScaleLR", "EMA"))


def test_a_strategy_of_the_other_namespace_is_refused_by_lightning():
    """Negative control: the copies are needed, Lightning checks the class hierarchy of its own namespace."""
    with pytest.raises(ValueError, match="invalid strategy"):
        L.Trainer(accelerator="cpu", devices=2, strategy=lightning_mgpu.MGPUDDPStrategy(), logger=False)
    with pytest.raises(ValueError, match="invalid strategy"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=lightning_mgpu.lightning.MGPUDDPStrategy(), logger=False)


def test_both_copies_come_from_one_source_file():
    for name in ("MGPUDDPStrategy", "MGPUShardedStrategy", "MGPUPrecision", "DeviceMonitor", "DigitsCNN"):
        plain = getattr(lightning_mgpu, name, None) or getattr(lightning_mgpu.examples, name)
        copy = getattr(lightning_mgpu.lightning, name, None) or getattr(lightning_mgpu.lightning.examples, name)
        assert plain is not copy
        assert inspect.getsourcefile(plain) == inspect.getsourcefile(copy)
    assert issubclass(lightning_mgpu.lightning.examples.DigitsCNN, L.LightningModule)
    assert issubclass(lightning_mgpu.examples.DigitsCNN, pl.LightningModule)


def test_only_import_statements_are_rewritten():
    source = (
        "import pytorch_lightning as pl\n"
        "import pytorch_lightning.callbacks\n"
        "import lightning_mgpu\n"
        "from lightning_fabric.plugins import CheckpointIO\n"
        "from lightning_mgpu.lightning import x\n"
        "NAME = 'pytorch_lightning and lightning_mgpu.sharded'\n"
        "pytorch_lightning = pytorch_lightning\n"
    )
    got = ast_unparse(rewrite_imports(source, "<test>"))
    assert got.splitlines() == [
        "import lightning.pytorch as pl",
        "import lightning.pytorch.callbacks, lightning.pytorch as pytorch_lightning",
        "import lightning_mgpu.lightning as lightning_mgpu",
        "from lightning.fabric.plugins import CheckpointIO",
        "from lightning_mgpu.lightning import x",
        "NAME = 'pytorch_lightning and lightning_mgpu.sharded'",  # strings (checkpoint keys, messages) unchanged
        "pytorch_lightning = pytorch_lightning",
    ]
    assert LIGHTNING_RENAMES["pytorch_lightning"] == "lightning.pytorch"


def ast_unparse(tree: Any) -> str:
    import ast

    return ast.unparse(tree)


def test_the_lightning_copy_pickles_by_its_own_module_path():
    import pickle

    strategy = lightning_mgpu.lightning.MGPUDDPStrategy(start_method="spawn", comm_hook="fp16")
    clone = pickle.loads(pickle.dumps(strategy))
    assert type(clone) is lightning_mgpu.lightning.MGPUDDPStrategy
    # a fresh interpreter (what a spawn launch starts) unpickles it with no import of its own
    fresh = subprocess.run(
        [sys.executable, "-c", "import pickle, sys; print(type(pickle.loads(sys.stdin.buffer.read())).__module__)"],
        input=pickle.dumps(strategy),
        capture_output=True,
        timeout=120,
        cwd=ROOT,
    )
    assert fresh.returncode == 0, fresh.stderr.decode()[-2000:]
    assert fresh.stdout.decode().strip() == "lightning_mgpu.lightning.strategies.ddp"


# --- the lightning-mgpu command with a model written against `import lightning as L` ----------------------------


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightning_mgpu", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )


def _in_process(*args: str, cwd: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> tuple[Any, str, str]:
    """``lightning-mgpu ARGS`` in this process, for a run that ends before any Trainer (``--print_config``, an error):
    its exit code, stdout and stderr. The user's modules it imports from ``cwd`` are forgotten afterwards."""
    from lightning_mgpu.cli import main

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    capsys.readouterr()
    try:
        code: Any = main(list(args))
    except SystemExit as exit_info:
        code = exit_info.code
    finally:
        for name in set(sys.modules) - before:
            if (getattr(sys.modules[name], "__file__", None) or "").startswith(str(cwd)):
                del sys.modules[name]
    out = capsys.readouterr()
    return code, out.out, out.err


def _lightning_config(tmp_path: Path, strategy: str) -> Path:
    """configs/ddp.yaml with every class of the pack taken from its `lightning` copy."""
    text = (ROOT / "configs" / "ddp.yaml").read_text().replace("lightning_mgpu.", "lightning_mgpu.lightning.")
    text = text.replace("strategy: mgpu_ddp ", f"strategy: {strategy} ")
    path = tmp_path / "ddp_lightning.yaml"
    path.write_text(text)
    return path


@pytest.mark.slow
def test_the_command_trains_a_model_written_against_lightning(tmp_path):
    """``tests/lightning_user_model.py`` imports only ``lightning``; the command picks the `lightning` copy."""
    proc = _cli(
        "fit",
        "--model",
        "tests.lightning_user_model.TinyLightningModel",
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "mgpu_ddp_fork",
        "--trainer.max_steps",
        "4",
        "--trainer.logger",
        "false",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.default_root_dir",
        str(tmp_path),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lightning-mgpu fit: MGPUDDPStrategy on 2 process(es)" in proc.stdout
    assert "4 optimizer step(s)" in proc.stdout


@pytest.mark.compat
def test_a_lightning_config_round_trips_through_print_config(tmp_path, monkeypatch, capsys):
    config = _lightning_config(tmp_path, "mgpu_ddp_fork")
    code, first, err = _in_process(
        "fit", "--config", str(config), "--print_config", cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys
    )
    assert code in (0, None), err[-3000:]
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(first)
    _, second, _ = _in_process(
        "fit", "--config", str(dumped), "--print_config", cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys
    )
    assert second == first
    assert "class_path: lightning_mgpu.lightning.examples.DigitsCNN" in first
    assert "class_path: lightning_mgpu.lightning.DeviceMonitor" in first


def test_the_packs_class_paths_follow_the_models_namespace(monkeypatch, capsys):
    """configs/ddp.yaml as shipped (``lightning_mgpu.DeviceMonitor``, ``lightning_mgpu.examples.DigitsDataModule``)
    with a model written against ``import lightning as L``: the pack's classes resolve to its `lightning` copy."""
    code, out, err = _in_process(
        "fit", "--config", str(ROOT / "configs" / "ddp.yaml"),
        "--model", "tests.lightning_user_model.TinyLightningModel", "--print_config",
        cwd=ROOT, monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    assert code in (0, None), err[-3000:]
    assert "class_path: lightning_mgpu.lightning.DeviceMonitor" in out
    assert "class_path: lightning_mgpu.lightning.ScaleLR" in out
    assert "class_path: lightning_mgpu.lightning.examples.DigitsDataModule" in out
    assert "class_path: tests.lightning_user_model.TinyLightningModel" in out


def test_in_namespace_maps_lightnings_and_the_packs_classes_only():
    from lightning_mgpu.cli import in_namespace

    monitor = "DeviceMonitor"
    assert in_namespace(f"lightning_mgpu.{monitor}", "lightning") == f"lightning_mgpu.lightning.{monitor}"
    assert in_namespace(f"lightning_mgpu.lightning.{monitor}", "lightning") == f"lightning_mgpu.lightning.{monitor}"
    assert in_namespace(f"lightning_mgpu.lightning.{monitor}", "pytorch_lightning") == f"lightning_mgpu.{monitor}"
    ckpt = "callbacks.ModelCheckpoint"
    assert in_namespace(f"pytorch_lightning.{ckpt}", "lightning") == f"lightning.pytorch.{ckpt}"
    assert in_namespace(f"lightning.pytorch.{ckpt}", "pytorch_lightning") == f"pytorch_lightning.{ckpt}"
    io = "plugins.TorchCheckpointIO"
    assert in_namespace(f"lightning_fabric.{io}", "lightning") == f"lightning.fabric.{io}"
    assert in_namespace("mymodel.MyModel", "lightning") == "mymodel.MyModel"  # the user's own: never touched
    assert in_namespace("mymodel.MyModel", "pytorch_lightning") == "mymodel.MyModel"


_SAME_YAML = """
trainer:
  accelerator: cpu
  devices: 2
  strategy:
    class_path: lightning_mgpu.MGPUDDPStrategy
    init_args: {start_method: fork}
  max_steps: 2
  logger: false
  enable_progress_bar: false
  callbacks:
    - class_path: lightning_mgpu.DeviceMonitor
    - class_path: pytorch_lightning.callbacks.ModelCheckpoint
      init_args: {dirpath: ckpts, save_last: true}
"""

_USER_MODULE = """
import {import_line}
import torch
from torch.utils.data import DataLoader, TensorDataset


class UserModel({base}.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)


class UserData({base}.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)
"""


def _user_folder(tmp_path: Path) -> Path:
    (tmp_path / "cfg.yaml").write_text(_SAME_YAML)
    (tmp_path / "with_lightning.py").write_text(_USER_MODULE.format(import_line="lightning as L", base="L"))
    (tmp_path / "with_pl.py").write_text(_USER_MODULE.format(import_line="pytorch_lightning as pl", base="pl"))
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("module", ["with_lightning", "with_pl"])
def test_one_config_trains_a_module_of_either_namespace(module, tmp_path):
    folder = _user_folder(tmp_path)
    proc = _cli("fit", "--config", "cfg.yaml", "--model", f"{module}.UserModel", cwd=folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lightning-mgpu fit: MGPUDDPStrategy on 2 process(es)" in proc.stdout
    assert "2 optimizer step(s)" in proc.stdout
    assert (folder / "ckpts" / "last.ckpt").is_file()  # the ModelCheckpoint of the model's own namespace ran
    assert "Traceback" not in proc.stderr


def test_a_class_of_the_other_namespace_that_cannot_be_resolved_is_named_on_the_first_line(
    tmp_path, monkeypatch, capsys
):
    """The user's own data module written with `pytorch_lightning` beside a `lightning` model: the pack cannot map a
    user's class, so it says so first, before jsonargparse's usage text."""
    folder = _user_folder(tmp_path)
    code, _, err = _in_process(
        "fit", "--config", "cfg.yaml", "--model", "with_lightning.UserModel", "--data", "with_pl.UserData",
        "--print_config", cwd=folder, monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    assert code == 2
    first = err.splitlines()[0]
    assert first.startswith("lightning-mgpu: error: with_pl.UserData is built on `pytorch_lightning`, but this run "
                            "uses `lightning`"), err[:2000]  # fmt: skip
    assert "with `import lightning as L` (as the model is)" in first


# --- the compatibility subset again, from the `lightning` copy of the tests ----------------------------------------

# test_cli is left out: its configs name pytorch_lightning classes; the lightning CLI has its own tests above
_COMPAT_MODULES = (
    "integration.strategies.test_ddp",
    "integration.strategies.test_sharded",
    "integration.parts.test_accumulation",
    "unit.test_presets",
    "integration.test_presets",
)


#: the cells of a matrix whose `lightning` copy stays in the default suite: each layout once (the namespace changes
#: which Trainer runs the pack, not what a layout computes); the copy's other cells run in the slow tier and in the
#: compatibility tiers
_DEFAULT_COPY_CELLS = {
    "integration.strategies.test_sharded": {
        "test_sharded_training_equals_single_process_with_global_batch": {
            "zero1-torch-2-adam", "zero2-fsdp2-1-adam", "zero3-fsdp2-2-sgd", "zero3-fsdp2-1-adamw",
            "zero1-fairscale-1-adam", "zero2-fairscale-2-adam",
        },
        "test_checkpoint_resumes_at_another_world_size": {
            "zero1-torch-consolidated-2to1,2to3", "zero3-fsdp2-sharded-1to2", "zero2-fairscale-sharded-1to2",
        },
    },
}  # fmt: skip


def _is_compat(obj: Any) -> bool:
    return any(mark.name == "compat" for mark in getattr(obj, "pytestmark", []))


def _default_cells_only(test: Any, kept: set[str]) -> Any:
    """``test`` with the cells of its parametrization not in ``kept`` marked ``slow`` (those already marked
    ``full_matrix`` left as they are)."""
    marks = []
    for mark in test.pytestmark:
        if mark.name == "parametrize":
            names, values = mark.args[:2]
            found = {v.id for v in values}
            assert kept <= found, f"{test.__name__}: no cell {sorted(kept - found)}"
            values = [
                v
                if v.id in kept or any(m.name == "full_matrix" for m in v.marks)
                else pytest.param(*v.values, id=v.id, marks=(*v.marks, pytest.mark.slow))
                for v in values
            ]
            mark = pytest.mark.parametrize(names, values, **mark.kwargs).mark
        marks.append(mark)

    @functools.wraps(test)
    def copy(*args: Any, **kwargs: Any) -> Any:
        return test(*args, **kwargs)

    copy.pytestmark = marks  # type: ignore[attr-defined]
    return copy


def _collect_lightning_copies() -> dict[str, Any]:
    """The compat tests of ``_COMPAT_MODULES`` loaded from ``tests.lightning_ns`` (their fixtures too), under names
    that say where they come from: ``test_lightning__<folder>_<module>__<test>`` (``integration_strategies_ddp``)."""
    found: dict[str, Any] = {}
    for name in _COMPAT_MODULES:
        module = importlib.import_module(f"tests.lightning_ns.{name}")
        for attr, obj in vars(module).items():
            if attr.startswith("test_") and callable(obj) and _is_compat(obj):
                where = name.replace(".test_", "_").replace(".", "_")
                kept = _DEFAULT_COPY_CELLS.get(name, {}).get(attr)
                copy = _default_cells_only(obj, kept) if kept is not None else obj
                found[f"test_lightning__{where}__{attr.removeprefix('test_')}"] = copy
            elif hasattr(obj, "_fixture_function_marker") or type(obj).__name__ == "FixtureFunctionDefinition":
                found.setdefault(attr, obj)
    return found


globals().update(_collect_lightning_copies())


def test_the_lightning_copies_run_on_lightning():
    copies = _collect_lightning_copies()
    tests = [name for name in copies if name.startswith("test_lightning__")]
    assert len(tests) >= 8
    module = importlib.import_module("tests.lightning_ns.helpers")
    assert module.pl is lightning.pytorch
    assert issubclass(module.Regressor, L.LightningModule)
    assert torch.equal(torch.ones(1), torch.ones(1))


@pytest.mark.timeout(300)
def test_the_tensor_parallel_families_equal_one_process_in_the_lightning_namespace(tmp_path):
    # litgpt, nanoGPT, timm's ViT and a plain MLP split by their structure, torchtitan's Llama by its names (tensor 2
    # x data 2), each one process's weights with the global batch and its negative control: the parity test, from the
    # lightning copy
    module = importlib.import_module("tests.lightning_ns.integration.parts.test_tensor_parallel")
    assert module.pl is lightning.pytorch and module.MGPUShardedStrategy is lightning_mgpu.lightning.MGPUShardedStrategy
    module.test_the_families_found_by_their_structure_equal_one_process_each(tmp_path)


@pytest.mark.parametrize("name", ["DeviceMonitor", "ScaleLR"])
def test_a_callback_given_to_the_other_namespaces_trainer_says_which_to_use(name, tmp_path):
    """Lightning takes any object with hook methods as a callback; ours refuse the other namespace's Trainer."""
    callback = getattr(lightning_mgpu, name)(**({"base_batch_size": 32} if name == "ScaleLR" else {}))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, callbacks=[callback])
    with pytest.raises(TypeError) as info:
        trainer.fit(importlib.import_module("tests.lightning_user_model").TinyLightningModel())
    assert f"lightning_mgpu.{name} serves `pytorch_lightning`, but this Trainer is `lightning`'s" in str(info.value)
    assert f"Use lightning_mgpu.lightning.{name}" in str(info.value)


@pytest.mark.slow
def test_the_main_job_trains_the_sample_in_the_lightning_namespace(tmp_path: Path, scripts: Scripts) -> None:
    """``python -m lightning_mgpu.lightning.examples.train``: the sample module and the popen launch (each rank
    re-runs the module) from the `lightning` copy; rank 0 forked from an interpreter that has imported torch and
    nothing of Lightning or the pack (``tests/scripts.py``)."""
    module, args = (
        "lightning_mgpu.lightning.examples.train",
        ["--min-accuracy", "0.9", "--default-root-dir", str(tmp_path)],
    )
    proc = scripts.run_module(module, args, cwd=tmp_path, output=tmp_path / "train", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "strategy mgpu_ddp" in proc.stdout and "on 2 x CPUAccelerator" in proc.stdout
    assert float(proc.stdout.split("held-out test accuracy ")[1].split()[0]) >= 0.9


# one Lightning distribution: a missing one is simulated as Python does for a module known to be absent
_ONLY_LIGHTNING = """
import sys
sys.modules["pytorch_lightning"] = None
sys.modules["lightning_fabric"] = None
import lightning as L
import lightning_mgpu
from lightning_mgpu import MGPUDDPStrategy
from lightning_mgpu.lightning import MGPUDDPStrategy as Same
from lightning_mgpu.lightning.examples import DigitsCNN, DigitsDataModule
import lightning_mgpu.lightning.cli

assert Same is MGPUDDPStrategy and lightning_mgpu.lightning is lightning_mgpu
assert lightning_mgpu.lightning.cli is lightning_mgpu.cli
assert isinstance(MGPUDDPStrategy(), L.pytorch.strategies.Strategy) and isinstance(DigitsCNN(), L.LightningModule)
assert "pytorch_lightning" not in {m.split(".")[0] for m, v in sys.modules.items() if v is not None}
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="mgpu_ddp", logger=False)
print("preset:", type(trainer.strategy).__module__, type(trainer.strategy).__name__)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MGPUDDPStrategy(start_method="fork"), max_steps=2,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(DigitsCNN(), DigitsDataModule())
"""


@pytest.mark.slow
def test_with_only_the_lightning_distribution_lightning_mgpu_serves_lightning(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _ONLY_LIGHTNING], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "preset: lightning_mgpu.strategies.ddp MGPUDDPStrategy" in proc.stdout
    assert "`Trainer.fit` stopped: `max_steps=2` reached" in proc.stderr  # in the forked ranks


def test_with_no_lightning_distribution_the_import_names_both_install_lines(tmp_path):
    script = (
        "import sys\n"
        "for name in ('lightning', 'pytorch_lightning', 'lightning_fabric'):\n"
        "    sys.modules[name] = None\n"
        "import lightning_mgpu\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1
    assert "ImportError: lightning-mgpu needs one Lightning distribution, and neither is installed" in proc.stderr
    assert "pip install 'lightning-mgpu[lightning]'" in proc.stderr
    assert "pip install 'lightning-mgpu[pytorch-lightning]'" in proc.stderr
