"""The EMA callback in one process: the update rule, the swap in place (twice: everything as it was), frozen
parameters left out, and a ``lightning`` Trainer (the other namespace) served by ``lightning_mgpu.lightning.EMA``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_mgpu import EMA
from tests.models import Regressor


def test_update_follows_the_rule_and_leaves_frozen_parameters_out() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double()
    model[0].requires_grad_(False)
    ema = EMA(decay=0.75)
    first = {n: p.detach().clone() for n, p in model.named_parameters()}
    ema.update(model)  # the first update copies
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)
    assert sorted(ema._ema) == ["1.bias", "1.weight"]  # the frozen layer costs nothing
    for name, average in ema._ema.items():
        torch.testing.assert_close(average, 0.75 * first[name] + 0.25 * (first[name] + 1.0))
    with pytest.raises(AssertionError):  # negative control: the other weighting is told apart
        torch.testing.assert_close(ema._ema["1.bias"], 0.25 * first["1.bias"] + 0.75 * (first["1.bias"] + 1.0))


def test_swap_exchanges_in_place_and_twice_restores_everything() -> None:
    model = nn.Linear(3, 2).double()
    ema = EMA(decay=0.5)
    ema.update(model)
    with torch.no_grad():
        model.weight.mul_(3.0)
    ema.update(model)
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    average = {n: t.clone() for n, t in ema._ema.items()}
    storage = model.weight.data_ptr()
    ema.swap(model)
    assert model.weight.data_ptr() == storage  # the same tensors, new values: no copy of the model
    torch.testing.assert_close(dict(model.named_parameters()), average, rtol=0, atol=0)
    ema.swap(model)
    torch.testing.assert_close(dict(model.named_parameters()), trained, rtol=0, atol=0)
    torch.testing.assert_close(ema._ema, average, rtol=0, atol=0)


def test_lightning_namespace_trainer_evaluates_with_the_average(tmp_path: Any) -> None:
    import lightning as L
    from torch.nn import functional as F
    from torch.utils.data import DataLoader

    import lightning_mgpu.lightning as mgpu_l
    from tests.models import make_data

    seen: list[torch.Tensor] = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Regressor().net.double()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return F.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            seen.append(self.net[0].weight.detach().clone())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ema = mgpu_l.EMA(decay=0.5)
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, callbacks=[ema], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path,
    )  # fmt: skip
    data = DataLoader(make_data(n=16), batch_size=8)
    module = Module()
    trainer.fit(module, data, data)
    torch.testing.assert_close(seen[0], ema._ema["net.0.weight"])  # validation saw the average
    assert not torch.equal(seen[0], module.net[0].weight.detach())  # ... and training goes on with its weights
