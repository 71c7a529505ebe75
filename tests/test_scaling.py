"""Effective batch size, ScaleLR and schedules whose length follows devices and accumulation; cross-rank
gathering helpers with uneven sizes and dicts."""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning_fabric.plugins.environments.lightning import find_free_network_port
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, SequentialLR
from torchmetrics.utilities.distributed import gather_all_tensors

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


def test_warmup_schedule_shapes():
    trainer: Any = SimpleNamespace(estimated_stepping_batches=11)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    config = warmup_schedule(opt, trainer, warmup=0.2, decay="cosine", final_lr_ratio=0.1)
    assert config["interval"] == "step"
    lam = config["scheduler"].lr_lambdas[0]
    values = [lam(s) for s in range(11)]
    assert values[:3] == pytest.approx([0.5, 1.0, 1.0])  # warmup 2 steps (20 % of 11), then the cosine's peak
    assert values[-1] == pytest.approx(0.1) and values == sorted(values[:2]) + sorted(values[2:], reverse=True)
    assert lightning_mgpu.total_steps(trainer) == 11


def _lrs(optimizer: torch.optim.Optimizer, scheduler: Any, steps: int) -> list[float]:
    """The LR of each of ``steps`` optimizer steps (read before the step, as Lightning steps the scheduler after)."""
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def _torchs_schedule(optimizer: torch.optim.Optimizer, warmup: int, total: int, decay: str, final: float) -> Any:
    """The same schedule from torch's chainable schedulers: what schedules.py's docstring compares with."""
    span = total - 1 - warmup
    after: Any = {
        "cosine": lambda: CosineAnnealingLR(optimizer, T_max=span, eta_min=final * BASE_LR),
        "linear": lambda: LinearLR(optimizer, start_factor=1.0, end_factor=final, total_iters=span),
        "constant": lambda: ConstantLR(optimizer, factor=1.0, total_iters=0),
    }[decay]()
    ramp = LinearLR(optimizer, start_factor=1.0 / warmup, end_factor=1.0, total_iters=warmup - 1)
    return SequentialLR(optimizer, [ramp, after], milestones=[warmup])


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_warmup_schedule_follows_torchs_schedulers_and_holds_the_final_lr_exactly(decay):
    """Step by step the LambdaLR schedule equals SequentialLR(LinearLR, CosineAnnealingLR / LinearLR /
    ConstantLR) to float rounding, reaches final_lr_ratio x peak exactly (bitwise) at the last step, and keeps
    it on steps past the estimate, where torch's cosine climbs back towards the peak."""
    total, warmup, final = 23, 4, 0.1
    ours_opt, torchs_opt = _opt(BASE_LR), _opt(BASE_LR)
    ours = warmup_schedule(ours_opt, _trainer(total), warmup=warmup, decay=decay, final_lr_ratio=final)["scheduler"]
    torchs = _torchs_schedule(torchs_opt, warmup, total, decay, final)
    extra = 5  # optimizer steps past the estimated total
    mine, theirs = _lrs(ours_opt, ours, total + extra), _lrs(torchs_opt, torchs, total + extra)
    assert mine[:total] == pytest.approx(theirs[:total], rel=1e-12, abs=0.0)
    assert mine[0] == BASE_LR / warmup  # the ramp's first step is not spent at LR 0
    end = BASE_LR if decay == "constant" else BASE_LR * final
    assert mine[total - 1] == end and mine[total:] == [end] * extra
    if decay == "cosine":  # why schedules.py keeps LambdaLR: torch's cosine is periodic past T_max
        assert theirs[total:] != [end] * extra and max(theirs[total:]) > 2 * end


def test_warmup_schedule_resumes_from_its_state_dict():
    """The state Lightning checkpoints (LambdaLR's state_dict, with the multiplier's fields) continues the
    schedule exactly, also through torch.save/torch.load as in a checkpoint file."""
    total, cut = 17, 7
    straight_opt = _opt(BASE_LR)
    straight = warmup_schedule(straight_opt, _trainer(total), warmup=3, final_lr_ratio=0.05)["scheduler"]
    expected = _lrs(straight_opt, straight, total)
    first_opt = _opt(BASE_LR)
    first = warmup_schedule(first_opt, _trainer(total), warmup=3, final_lr_ratio=0.05)["scheduler"]
    before = _lrs(first_opt, first, cut)
    buffer = io.BytesIO()
    torch.save({"scheduler": first.state_dict(), "optimizer": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_opt = _opt(BASE_LR)
    resumed = warmup_schedule(resumed_opt, _trainer(total), warmup=3, final_lr_ratio=0.05)["scheduler"]
    resumed_opt.load_state_dict(saved["optimizer"])
    resumed.load_state_dict(saved["scheduler"])
    assert before + _lrs(resumed_opt, resumed, total - cut) == expected


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


def test_helpers_without_a_process_group_compute_locally():
    assert not dist.is_initialized()
    assert mdist.mean(torch.tensor([1.0, 2.0, 6.0])).item() == pytest.approx(3.0)
    assert mdist.sum({"a": 2, "b": torch.ones(4)}) == {"a": pytest.approx(2.0), "b": pytest.approx(4.0)}
    assert torch.equal(mdist.gather(torch.arange(3)), torch.arange(3))


# ---------------------------------------------------------------------------------- gathering, 2 ranks
def _gather_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    # uneven: rank 0 holds 3 samples, rank 1 holds 5 (an uneven last batch)
    n = 3 if rank == 0 else 5
    losses = torch.arange(n, dtype=torch.float32) + 10 * rank
    result = {
        "mean_dict": mdist.mean({"loss": losses, "count": float(n)}),
        "mean_all": mdist.mean(losses, dst=None),
        "weighted": mdist.mean(losses.mean(), weight=n, dst=None),
        "unweighted": mdist.mean(losses.mean(), dst=None),
        "sum": mdist.sum({"loss": losses, "n": n}, dst=1),
        "gather": mdist.gather({"loss": losses, "rows": torch.full((n, 2), rank)}),
        "gather_all": mdist.gather(torch.tensor(float(rank)), dst=None),
        "empty": mdist.mean(torch.ones(0) if rank == 0 else torch.ones(2), dst=None),
    }
    try:
        mdist.gather(torch.zeros(2, 3 if rank == 0 else 4))
    except ValueError as err:
        result["shape_error"] = str(err)
    torch.save(result, Path(out) / f"gather{rank}.pt")
    dist.destroy_process_group()


def test_gathering_helpers_with_uneven_sizes_and_dicts(tmp_path):
    args = (find_free_network_port(), str(tmp_path))
    mp.start_processes(_gather_worker, nprocs=WORLD, start_method="fork", args=args)
    r0, r1 = (torch.load(tmp_path / f"gather{r}.pt") for r in range(WORLD))
    everything = torch.cat([torch.arange(3.0), torch.arange(5.0) + 10])
    # exact global mean over all 8 samples (not the mean of the two per-rank means)
    assert r0["mean_dict"]["loss"].item() == pytest.approx(everything.mean().item())
    assert r0["mean_dict"]["loss"].dtype == torch.float32
    assert r0["mean_dict"]["count"].item() == pytest.approx(4.0)
    assert r1["mean_dict"] is None  # dst=0
    for r in (r0, r1):
        assert r["mean_all"].item() == pytest.approx(everything.mean().item())
        assert r["weighted"].item() == pytest.approx(everything.mean().item())
        assert r["unweighted"].item() == pytest.approx((1.0 + 12.0) / 2)  # what sync_dist=True would give
        assert r["empty"].item() == pytest.approx(1.0)  # rank 0's empty tensor counts for nothing
        assert torch.equal(r["gather_all"], torch.tensor([0.0, 1.0]))
        assert "trailing shape" in r["shape_error"]
    assert r0["sum"] is None and r1["sum"]["loss"].item() == pytest.approx(everything.sum().item())
    assert r1["sum"]["n"].item() == 8
    assert torch.equal(r0["gather"]["loss"], everything) and r1["gather"] is None
    assert r0["gather"]["rows"].tolist() == [[0, 0]] * 3 + [[1, 1]] * 5


_COLLECTIVES = ("all_gather", "all_reduce", "reduce", "broadcast", "barrier", "all_gather_object", "gather")


def _count_worker(rank: int, port: int, out: str) -> None:
    """Per helper call, the collectives it issues (a spy on torch.distributed's functions, which the helpers
    look up at call time)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    calls: list[str] = []
    for name in _COLLECTIVES:
        original = getattr(dist, name)

        def spy(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(dist, name, spy)
    n = 3 if rank == 0 else 5  # uneven
    three = {"loss": torch.arange(n, dtype=torch.float32), "rows": torch.ones(n, 4), "mask": torch.ones(n) > 0}
    counts: dict[str, list[str]] = {}
    for label, call in (
        ("mean", lambda: mdist.mean(three)),
        ("mean_everywhere", lambda: mdist.mean(three, dst=None)),
        ("sum", lambda: mdist.sum(three, dst=1)),
        ("gather_one", lambda: mdist.gather(three["rows"], dst=None)),
        ("gather_three", lambda: mdist.gather(three, dst=None)),
        ("torchmetrics_three", lambda: [gather_all_tensors(v) for v in three.values()]),
    ):
        calls.clear()
        call()
        counts[label] = list(calls)
    torch.save(counts, Path(out) / f"count{rank}.pt")
    dist.destroy_process_group()


def test_collectives_per_call_one_for_mean_and_sum_one_plus_keys_for_gather(tmp_path):
    """The module docstring's count, and why gather is not torchmetrics' gather_all_tensors (in 1.9 a barrier
    and two all_gathers per key: 9 collectives for these 3 keys)."""
    mp.start_processes(_count_worker, nprocs=WORLD, start_method="fork", args=(find_free_network_port(), str(tmp_path)))
    for rank in range(WORLD):
        counts = torch.load(tmp_path / f"count{rank}.pt")
        assert counts["mean"] == ["reduce"] and counts["sum"] == ["reduce"]
        assert counts["mean_everywhere"] == ["all_reduce"]
        assert counts["gather_one"] == ["all_gather"] * 2  # the sizes, then the padded rows
        assert counts["gather_three"] == ["all_gather"] * 4  # the sizes of all keys, then one per key
        # the reason to keep our own: torchmetrics (1.9: barrier, shape, tensor per key) takes more
        assert len(counts["torchmetrics_three"]) > len(counts["gather_three"]), counts["torchmetrics_three"]
