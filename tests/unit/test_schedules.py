"""warmup_schedule (schedules.py) in one process: its shape, step by step against torch's chainable schedulers,
and its resume from a state dict."""

from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, SequentialLR

import lightning_mgpu
from lightning_mgpu import warmup_schedule

BASE_LR = 0.1


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


def _opt(lr: float = 1.0) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _trainer(steps: float) -> Any:
    return SimpleNamespace(estimated_stepping_batches=steps)
