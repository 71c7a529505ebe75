"""The planner and ``mgpu_auto`` on models written the way users write them: layers kept as plain attributes,
``self.double()`` in ``__init__``, the data in the module's own ``train_dataloader()``, an
``example_input_array``. Each trains under plain ``mgpu_ddp``, so each must be planned too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_mgpu import MGPUAutoStrategy, plan
from lightning_mgpu.cli import main as cli_main
from lightning_mgpu.planning import PlanError
from tests.helpers import WORLD, fit, make_data
from tests.integration.strategies.test_auto import Chosen


class TwoLayer(pl.LightningModule):
    """Layers as plain attributes: no Sequential, no ModuleList, nothing to checkpoint block by block."""

    def __init__(self, d_in: int = 6, hidden: int = 16, d_out: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class DoubleWithOwnData(TwoLayer):
    """``self.double()`` in ``__init__`` (fails under fake tensors) and its data in its own train_dataloader()."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__(hidden=hidden)
        self.double()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(), batch_size=8)


class WithExampleInput(TwoLayer):
    """No data of its own: only ``example_input_array`` (what Lightning's model summary uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.zeros(8, 6)


class ItemInInit(TwoLayer):
    """Reads a tensor's value in ``__init__``: neither fake nor meta tensors have one, a CPU build does."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = float(torch.ones(1).sum().item())


class Unbuildable(TwoLayer):
    def __init__(self) -> None:
        super().__init__()
        raise RuntimeError("weights file not found")


def _batch(rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(t[:rows].float() for t in make_data().tensors)  # type: ignore[return-value]


def test_layers_as_plain_attributes_are_planned_without_activation_checkpointing():
    p = plan(TwoLayer, devices=WORLD, device_memory="1GiB", batch=_batch(), precisions=("32-true",))
    assert p.rows and not any(r.activation_checkpointing for r in p.rows)
    assert (p.recommended.strategy, p.recommended.activation_checkpointing) == ("mgpu_ddp", False)
    assert {r.strategy for r in p.rows} == {"mgpu_ddp", "mgpu_zero1", "mgpu_sharded", "mgpu_zero3"}


def test_a_model_that_casts_itself_in_init_is_planned_with_its_own_dtype():
    p = plan(DoubleWithOwnData, devices=WORLD, device_memory="1GiB", precisions=("32-true",))
    params = sum(q.numel() for q in TwoLayer().parameters())
    assert p.states.parameters == {"float64": params * 8}
    assert p.recommended.strategy == "mgpu_ddp"


def test_the_sample_batch_comes_from_the_modules_own_train_dataloader_then_example_input_array():
    own = plan(DoubleWithOwnData, devices=WORLD, device_memory="1GiB", precisions=("32-true",))
    given = plan(
        DoubleWithOwnData,
        devices=WORLD,
        device_memory="1GiB",
        batch=tuple(t[:8] for t in make_data().tensors),
        precisions=("32-true",),
    )
    assert own.row("mgpu_ddp").activations_bytes == given.row("mgpu_ddp").activations_bytes > 0
    example = plan(WithExampleInput, devices=WORLD, device_memory="1GiB", precisions=("32-true",))
    assert example.row("mgpu_ddp").activations_bytes > 0
    with pytest.raises(PlanError, match=r"no train_dataloader\(\) of its own and no example_input_array"):
        plan(TwoLayer, devices=WORLD, device_memory="1GiB")


def test_the_build_falls_back_from_fake_tensors_to_meta_then_to_cpu_and_the_plan_says_so():
    built = {}
    for cls in (TwoLayer, DoubleWithOwnData, ItemInInit):
        p = plan(cls, devices=WORLD, device_memory="1GiB", batch=_batch(), precisions=("32-true",))
        built[cls.__name__] = p.built
        assert p.recommended.strategy == "mgpu_ddp"
    # `.double()` under fake tensors fails in a fresh interpreter only (once torch has built other modules under
    # fake tensors it passes): the fresh case runs in a subprocess below
    assert (built["TwoLayer"], built["ItemInInit"]) == ("fake", "cpu")
    assert built["DoubleWithOwnData"] in ("fake", "meta")
    assert "built once on CPU" in p.table()
    script = (
        f"from {__name__} import DoubleWithOwnData\n"
        "from lightning_mgpu import plan\n"
        "print('built:', plan(DoubleWithOwnData, devices=2, device_memory='1GiB', precisions=('32-true',)).built)\n"
    )
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "built: meta" in proc.stdout


def test_a_model_that_builds_nowhere_is_refused_naming_each_failure():
    with pytest.raises(PlanError, match=r"cannot be built to plan it: under fake tensors: RuntimeError: weights"):
        plan(Unbuildable, devices=WORLD, device_memory="1GiB", batch=_batch())


def test_lightning_mgpu_plan_takes_a_config_without_data_whose_model_casts_itself(tmp_path, capsys):
    config = tmp_path / "cfg.yaml"
    config.write_text(f"model:\n  class_path: {__name__}.DoubleWithOwnData\n  init_args: {{hidden: 32}}\n")
    assert cli_main(["plan", "--config", str(config), "--devices", "2", "--device-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "DoubleWithOwnData" in out and "**<- recommended**" in out


@pytest.mark.slow
def test_mgpu_auto_trains_a_model_with_layers_as_plain_attributes(tmp_path: Path):
    strategy = MGPUAutoStrategy(start_method="fork", device_memory="1GiB")
    fit(TwoLayer().double(), strategy, tmp_path, max_epochs=1, callbacks=[Chosen(tmp_path)])
    for r in range(WORLD):
        record = torch.load(tmp_path / f"chosen{r}.pt", weights_only=False)
        assert (record["class"], record["decision"], record["checkpointing"]) == (
            "MGPUDDPStrategy",
            ("mgpu_ddp", False),
            False,
        )


def test_lightning_mgpu_plan_takes_devices_nodes_precision_and_memory_from_the_config(tmp_path, capsys):
    config = tmp_path / "cfg.yaml"
    model = f"model:\n  class_path: {__name__}.DoubleWithOwnData\n"
    config.write_text(
        "trainer:\n  devices: 2\n  num_nodes: 2\n  precision: bf16-mixed\n  strategy:\n"
        "    class_path: lightning_mgpu.MGPUAutoStrategy\n    init_args: {device_memory: 1GiB, micro_batch_size: 4}\n"
        + model
    )
    assert cli_main(["plan", "--config", str(config), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["strategy"], r["precision"]) for r in rows} == {("mgpu_ddp", "bf16-mixed"), ("mgpu_zero1", "bf16-mixed")}
    # 2 devices per machine x 2 machines: 4 ranks in all; a flag overrides the config
    assert cli_main(["plan", "--config", str(config)]) == 0
    assert "4 ranks x 1.00 GiB" in capsys.readouterr().out
    assert cli_main(["plan", "--config", str(config), "--devices", "2", "--num-nodes", "1"]) == 0
    assert "2 ranks x 1.00 GiB" in capsys.readouterr().out
    # a strategy that offloads to host memory: the plan models it (host bytes per rank, the transfers), and the
    # host memory given is checked
    for strategy in (
        "mgpu_zero3_offload",
        "{class_path: lightning_mgpu.MGPUShardedStrategy, init_args: {offload: cpu}}",
    ):
        config.write_text(f"trainer:\n  devices: 2\n  strategy: {strategy}\n" + model)
        assert cli_main(["plan", "--config", str(config), "--device-memory", "1GiB"]) == 0
        out = capsys.readouterr().out
        assert "| host/rank | host<->device | fits |" in out and "Offloaded (offload='cpu')" in out, out
        assert "host memory not checked (give host_memory)" in out
        for host, fits in (("1KiB", False), ("1GiB", True)):
            flags = ["--device-memory", "1GiB", "--host-memory", host, "--json"]
            assert cli_main(["plan", "--config", str(config), *flags]) == 0
            rows = json.loads(capsys.readouterr().out)
            assert {r["strategy"] for r in rows if r["host_bytes"]} == {"mgpu_sharded", "mgpu_zero3"}
            assert all(r["fits"] == fits for r in rows if r["host_bytes"]), rows
    config.write_text("trainer:\n  devices: 2\n  strategy: mgpu_zero3\n" + model)
    assert cli_main(["plan", "--config", str(config), "--device-memory", "1GiB"]) == 0
    assert "offload" not in capsys.readouterr().out
    with pytest.raises(SystemExit):  # host memory is checked against offload only: given without it, refused
        cli_main(["plan", "--config", str(config), "--device-memory", "1GiB", "--host-memory", "1GiB"])
    assert "this plan does not offload: add --offload" in capsys.readouterr().err
    config.write_text("trainer:\n  devices: auto\n" + model)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["plan", "--config", str(config), "--device-memory", "1GiB"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "trainer.devices is 'auto'" in err and "Pass --devices N" in err
    config.write_text("trainer:\n  devices: 2\n" + model)
    with pytest.raises(SystemExit):
        cli_main(["plan", "--config", str(config)])
    assert "--device-memory not given" in capsys.readouterr().err


class LayersInConfigureModel(TwoLayer):
    """Its layers made in ``configure_model``: the instance lacks them until Lightning calls it."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)

    def configure_model(self) -> None:
        if not hasattr(self, "fc1"):
            self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)


def test_the_source_keeps_the_model_with_real_weights_for_the_tensor_plan_where_there_is_one():
    """Tensor parallelism's auto plan is derived on real weights (its structure checked as at launch) where the
    planner has them: an instance as it trains, or the one build on CPU; none where every build is fake or meta, or
    where the instance's configure_model has still to make its layers."""
    from lightning_mgpu.planning.source import resolve_source

    instance = TwoLayer()
    assert resolve_source(instance, batch=_batch()).real is instance
    cpu = resolve_source(ItemInInit, batch=_batch())
    assert cpu.how_built == "cpu" and cpu.real is not None and isinstance(cpu.real, ItemInInit)
    assert all(p.device.type == "cpu" and not p.is_meta for p in cpu.real.parameters())
    assert resolve_source(TwoLayer, batch=_batch()).real is None  # built under fake tensors
    assert resolve_source(LayersInConfigureModel(), batch=_batch()).real is None
