"""ScaleLR and the effective batch size on 2 fork-launched ranks: the scaled LR, its warmup and a schedule whose
length follow devices and accumulation, and a resume on another world size; bad input to ScaleLR, the schedules
and the distributed helpers, named with its fix."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint

import lightning_mgpu
from lightning_mgpu import MGPUDDPStrategy, ScaleLR, effective_batch_size, warmup_schedule
from lightning_mgpu import distributed as mdist
from tests.helpers import WORLD, Regressor, fit, make_data

B, BASE_LR = 4, 0.1


class ScheduledRegressor(Regressor):
    """SGD with lightning_mgpu.warmup_schedule (2 warmup steps, linear decay to 0 at the run's last step)."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": warmup_schedule(opt, self.trainer, warmup=2, decay="linear")}


class LRProbe(Callback):
    """Saves, per rank: effective batch size, the schedule's total steps, and the LR of every optimizer step
    (read in on_before_optimizer_step, i.e. what the step uses)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.lrs: list[float] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.effective = effective_batch_size(trainer)
        self.total = trainer.estimated_stepping_batches

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save(
            {"effective": self.effective, "total": self.total, "lrs": self.lrs, "steps": trainer.global_step},
            self.out / f"lr{trainer.global_rank}.pt",
        )


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("devices", [1, 2])
def test_effective_batch_scaled_lr_and_schedule_length_follow_devices_and_accumulation(tmp_path, devices, k):
    base = 8  # the batch the LR is tuned for
    probe = LRProbe(tmp_path)
    fit(
        ScheduledRegressor(lr=BASE_LR).double(), MGPUDDPStrategy(start_method="fork"), tmp_path, devices=devices,
        accumulate=k, max_epochs=2, callbacks=[ScaleLR(base_batch_size=base), probe],
    )  # fmt: skip
    record = torch.load(tmp_path / "lr0.pt")
    effective = B * devices * k
    assert record["effective"] == effective
    batches_per_epoch = len(make_data()) // (B * devices)
    expected_steps = 2 * math.ceil(batches_per_epoch / k)
    assert record["total"] == expected_steps == record["steps"] == len(record["lrs"])
    peak = BASE_LR * effective / base
    # warmup over 2 steps to the scaled peak, then linear decay that reaches 0 exactly at the last step
    expected = [peak * (s + 1) / 2 if s < 2 else peak * (1 - (s - 2) / (expected_steps - 3)) for s in range(2)]
    assert record["lrs"][:2] == pytest.approx(expected)
    assert max(record["lrs"]) == pytest.approx(peak)
    assert record["lrs"][-1] == pytest.approx(0.0, abs=1e-12)


def test_scale_lr_warmup_ramps_from_the_unscaled_lr(tmp_path):
    probe = LRProbe(tmp_path)
    fit(
        Regressor(lr=BASE_LR).double(), MGPUDDPStrategy(start_method="fork"), tmp_path, max_epochs=1,
        callbacks=[ScaleLR(base_batch_size=2, warmup_steps=4), probe],
    )  # fmt: skip
    lrs = torch.load(tmp_path / "lr0.pt")["lrs"]
    factor = B * WORLD / 2  # 4
    assert lrs[:6] == pytest.approx([BASE_LR * (1 + (factor - 1) * s / 4) for s in range(4)] + [BASE_LR * factor] * 2)


def test_sqrt_rule():
    trainer = pl.Trainer(accelerator="cpu", devices=1, accumulate_grad_batches=4, logger=False)
    callback = ScaleLR(base_batch_size=8, rule="sqrt", batch_size=8)
    assert callback.compute_factor(trainer) == pytest.approx(2.0)  # sqrt(32 / 8)


def test_resume_on_another_world_size_rescales_instead_of_scaling_twice(tmp_path):
    """Trained on 2 ranks (lr x 2 with base 4), resumed on 1 rank: the restored LR must be BASE x 1, not
    BASE x 2 x 1 (the checkpoint's param groups carry the factor they were scaled by)."""
    ckpt_dir = tmp_path / "ckpt"
    fit(
        Regressor(lr=BASE_LR).double(), MGPUDDPStrategy(start_method="fork"), tmp_path / "a", max_epochs=1,
        callbacks=[ScaleLR(base_batch_size=4), ModelCheckpoint(dirpath=ckpt_dir, save_last=True)],
        enable_checkpointing=True,
    )  # fmt: skip
    saved = torch.load(ckpt_dir / "last.ckpt", weights_only=False)["optimizer_states"][0]["param_groups"][0]
    assert saved["lr"] == pytest.approx(2 * BASE_LR) and saved["mgpu_lr_scale"] == 2.0
    probe = LRProbe(tmp_path)
    fit(
        Regressor(lr=BASE_LR).double(), MGPUDDPStrategy(start_method="fork"), tmp_path / "b", max_epochs=2,
        devices=1, callbacks=[ScaleLR(base_batch_size=4), probe], ckpt_path=str(ckpt_dir / "last.ckpt"),
    )  # fmt: skip
    record = torch.load(tmp_path / "lr0.pt")
    assert record["effective"] == 4 and len(record["lrs"]) == 24 and record["lrs"] == pytest.approx([BASE_LR] * 24)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: ScaleLR(base_batch_size=0), ValueError, r"base_batch_size=0.*int >= 1"),
        (lambda: ScaleLR(base_batch_size=256, rule="cubic"), ValueError, r"rule='cubic'.*'linear'.*'sqrt'"),
        (lambda: ScaleLR(base_batch_size=256, warmup_steps=-1), ValueError, r"warmup_steps=-1"),
        (lambda: ScaleLR(base_batch_size=256, batch_size=0), ValueError, r"batch_size=0"),
        (lambda: warmup_schedule(_opt(), _trainer(10), warmup=1.5), ValueError, r"warmup=1.5.*\[0, 1\)"),
        (lambda: warmup_schedule(_opt(), _trainer(10), warmup=10), ValueError, r"warmup=10.*\[0, 10\)"),
        (lambda: warmup_schedule(_opt(), _trainer(10), decay="step"), ValueError, r"decay='step'.*'cosine'"),
        (lambda: warmup_schedule(_opt(), _trainer(10), final_lr_ratio=2.0), ValueError, r"final_lr_ratio=2.0"),
        (lambda: lightning_mgpu.total_steps(_trainer(float("inf"))), ValueError, r"unbounded.*max_steps"),
        (lambda: effective_batch_size(_pl_trainer()), ValueError, r"batch_size=32"),
        (lambda: effective_batch_size(_pl_trainer(), batch_size=0), ValueError, r"batch_size=0"),
        (lambda: mdist.mean("loss"), TypeError, r"not str"),
        (lambda: mdist.mean({}), ValueError, r"empty dict"),
        (lambda: mdist.mean(torch.ones(3), weight=2), ValueError, r"per-rank scalars"),
        (lambda: mdist.mean(1.0, dst=3), ValueError, r"dst=3"),
        (lambda: mdist.gather({"a": 1.0}), TypeError, r"key 'a' is a float"),
    ],
)
def test_bad_input_names_the_value_and_the_fix(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _opt(lr: float = 1.0) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _trainer(steps: float) -> Any:
    return SimpleNamespace(estimated_stepping_batches=steps)


def _pl_trainer() -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False)
