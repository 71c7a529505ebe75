"""The planner's stand-in of a model instance: its module tree with fake tensors, sharing every other object it
holds, never a copy of them, and the user's module left exactly as it was."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_mgpu import plan
from lightning_mgpu._compat import fake_tensor_mode
from lightning_mgpu.planning.stand_in import lazy_parameters, stand_in
from tests.corpus import UNFRIENDLY, build

BATCH = 4


def _batch(name: str) -> Any:
    return next(iter(torch.utils.data.DataLoader(UNFRIENDLY[name][1](), batch_size=BATCH)))


def _state(module: nn.Module) -> dict[str, Any]:
    """What planning must leave as it was: every attribute of every submodule (by identity), the contents of its
    containers, and the parameters' values."""
    return {
        "attributes": [{k: id(v) for k, v in vars(m).items()} for m in module.modules()],
        "containers": [
            {k: [id(x) for x in (v.values() if isinstance(v, dict) else v)] for k, v in vars(m).items()
             if isinstance(v, (list, dict, set))}
            for m in module.modules()
        ],
        "values": [p.detach().clone() for p in module.parameters() if not lazy_parameters(module)],
        "classes": [type(m) for m in module.modules()],
    }  # fmt: skip


def test_a_stand_in_shares_what_the_module_holds_and_fakes_its_tensors():
    model = build("datasets")
    model.tied = model.fc1.weight  # a parameter kept twice
    model.lock = threading.Lock()
    model.history = [torch.zeros(3)]
    with fake_tensor_mode():
        shell = stand_in(model)
    assert shell is not model and type(shell) is type(model)
    assert shell.train_ds is model.train_ds and shell.lock is model.lock  # shared, not copied
    assert shell.fc1 is not model.fc1 and shell.tied is shell.fc1.weight  # the module tree is new, tied stays tied
    assert shell.history is not model.history and shell.history[0] is not model.history[0]
    from torch._subclasses.fake_tensor import FakeTensor

    assert all(isinstance(p, FakeTensor) for p in shell.parameters())
    assert [p.shape for p in shell.parameters()] == [p.shape for p in model.parameters()]
    assert not any(isinstance(p, FakeTensor) for p in model.parameters())


@pytest.mark.parametrize("name", list(UNFRIENDLY))
def test_planning_an_unfriendly_module_leaves_it_as_it_was(name):
    if name.startswith("hf_") or name == "tokenizer":
        pytest.importorskip("transformers")
    model = build(name)
    before = _state(model)
    hooks = [dict(m._forward_pre_hooks) for m in model.modules()]
    batch = _batch(name)
    rng = torch.get_rng_state()
    result = plan(model, devices=2, device_memory="1GiB", batch=batch, precisions=("32-true",))
    assert result.recommended is not None and result.recommended.strategy == "mgpu_ddp"
    after = _state(model)
    assert after["attributes"] == before["attributes"] and after["containers"] == before["containers"]
    assert after["classes"] == before["classes"]
    for a, b in zip(after["values"], before["values"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert [dict(m._forward_pre_hooks) for m in model.modules()] == hooks
    assert torch.equal(torch.get_rng_state(), rng)  # planning draws nothing from the user's generator


def test_a_lazy_module_is_planned_as_its_materialized_self_and_stays_lazy():
    model = build("lazy_layers")
    assert lazy_parameters(model)
    batch = _batch("lazy_layers")
    lazy = plan(model, devices=2, device_memory="1GiB", batch=batch, precisions=("32-true",))
    assert lazy.built == "meta" and lazy_parameters(model)  # planned on a stand-in: the module is still lazy
    model.configure_model()  # what Lightning does before the strategy sets up
    assert not lazy_parameters(model)
    ready = plan(model, devices=2, device_memory="1GiB", batch=batch, precisions=("32-true",))
    assert ready.built == "fake"
    assert lazy.states == ready.states and lazy.rows == ready.rows
    assert lazy.states.parameter_count == sum(p.numel() for p in model.parameters()) == 6 * 16 + 16 + 16 * 3 + 3


def test_layers_made_in_configure_model_are_planned_and_the_module_keeps_none():
    model = build("layers_in_configure_model")
    result = plan(model, devices=2, device_memory="1GiB", batch=_batch("layers_in_configure_model"))
    assert result.states.parameter_count == 6 * 16 + 16 + 16 * 3 + 3
    assert model.net is None


class _Scheduled(pl.LightningModule):
    """Sizes its scheduler from the Trainer, logs in training_step: the stand-in steps without the Trainer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.seen_trainer: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen_trainer.append(self._trainer is not None)
        self.log("loss", 1.0)
        return self.fc(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters())
        steps = self.trainer.estimated_stepping_batches
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=steps)}


def test_an_attached_trainer_is_seen_by_configure_optimizers_only():
    model = _Scheduled()

    class Attached:
        estimated_stepping_batches = 10

    model.trainer = Attached()  # type: ignore[assignment]
    with fake_tensor_mode():
        shell = stand_in(model)
        opt = shell.configure_optimizers()["optimizer"]
        shell.training_step((torch.zeros(2, 6),), 0)
    assert isinstance(opt, torch.optim.AdamW) and shell.seen_trainer == [False]
    assert model.seen_trainer == [] and model.trainer is not None


def test_zero_sizes_in_the_table_say_why():
    model = build("datasets")  # SGD with momentum, tiny: the peak of mgpu_ddp in bf16-master is the optimizer step
    result = plan(model, devices=2, device_memory="1GiB", batch=_batch("datasets"), precisions=("bf16-master",))
    rows = [line for line in result.table().splitlines() if line.startswith("| mgpu_")]
    step = [r for r in result.rows if r.phase == "optimizer step"]
    assert step, "no row peaks at the optimizer step: the test would prove nothing"
    assert all(r.activations_bytes == 0 for r in step)
    zero_cells = [cell for row in rows for cell in row.split(" | ") if cell.startswith("0 B")]
    assert zero_cells and all(cell.startswith("0 B (") for cell in zero_cells)
    assert any("the peak is the optimizer step" in cell for cell in zero_cells)


class _TutorialModule(pl.LightningModule):
    """The module of a first hour: its datasets as attributes, its loader from them, no data module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        g = torch.Generator().manual_seed(0)
        self.train_ds = torch.utils.data.TensorDataset(torch.randn(32, 6, generator=g), torch.randn(32, 3, generator=g))
        self.val_ds = torch.utils.data.TensorDataset(torch.randn(8, 6), torch.randn(8, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.fc(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters())

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self.train_ds, batch_size=8)


def test_a_module_that_keeps_its_datasets_is_planned_from_its_own_loader_as_instance_and_class():
    model = _TutorialModule()
    from_instance = plan(model, devices=2, device_memory="1GiB", precisions=("32-true",))
    from_class = plan(_TutorialModule, devices=2, device_memory="1GiB", precisions=("32-true",))
    assert from_instance.rows == from_class.rows and from_instance.recommended.strategy == "mgpu_ddp"
    assert from_instance.row("mgpu_ddp").activations_bytes > 0
    assert from_instance.model == "_TutorialModule"
