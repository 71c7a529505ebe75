"""MGPUPrecision: mixed (16-mixed, bf16-mixed) and master-weight (16-master, bf16-master) precision with the
mgpu strategies on 2 gloo processes.

Tolerances (measured here on 2026-11-22, then given 2.5-3x head-room):
* loss curves of the sample CNN (digits) vs FP32 over the same 24 optimizer steps (48 batches): max
  |loss - loss_fp32| per batch below 0.01 for the fp16 modes (measured 0.0021-0.0037) and 0.03 for the bf16
  modes (measured 0.0069-0.0101; bf16 keeps 8 mantissa bits);
* N=2 ranks x batch 8 x accumulation 2 vs one process with batch 32 in the same mode: relative weight
  distance |w - w_1| / |w_1 - w_0| below 3e-3 for fp16 (measured 1.5e-4-1.3e-3) and 2e-2 for bf16 (measured
  1.1e-3-7.3e-3): the runs differ by the order of the half-precision sums.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.nn import functional as F

import lightning_mgpu.plugins.precision as precision_modes
import lightning_mgpu.plugins.precision as precision_module
from lightning_mgpu import MGPUDDPStrategy, MGPUPrecision, MGPUShardedStrategy
from lightning_mgpu.examples.classifier import DigitsCNN
from lightning_mgpu.examples.digits import DigitsDataModule
from lightning_mgpu.plugins.precision import check_device, check_mode
from tests.helpers import WORLD, fit, flat_params, full
from tests.matrix import tiers
from tests.models import Regressor, make_data

HALF_MODES = ["16-mixed", "bf16-mixed", "16-master", "bf16-master"]
MASTER_MODES = ["16-master", "bf16-master"]


def cells(modes: list[str], strategies: list[str], slow: set[str]) -> list[Any]:
    """Every (mode, strategy) cell, id ``mode-strategy``; those named in ``slow`` in the slow tier (each mode and each
    strategy stay in the default suite)."""
    return tiers({f"{m}-{s}": (m, s) for m in modes for s in strategies}, slow)


def strategy(name: str) -> Any:
    if name == "ddp":
        return MGPUDDPStrategy(start_method="fork")
    if name == "zero1":
        return MGPUShardedStrategy(stage=1, start_method="fork")
    return MGPUShardedStrategy(stage=int(name[-1]), start_method="fork")  # "fsdp2" / "fsdp3"


def optimizer_params(trainer: pl.Trainer) -> list[torch.Tensor]:
    return [p for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]]


def relative_distance(w: torch.Tensor, ref: torch.Tensor, w0: torch.Tensor) -> float:
    return float((w - ref).norm() / (ref - w0).norm())


class Track(Callback):
    """Per rank into ``out_dir/prec{rank}.pt``: each batch's loss, the weights before and after each batch,
    the optimizer's (master) parameters' dtypes, the model weight dtype seen inside forward, the plugin's
    counters after each batch and at the end. ``inject``: {batch number (from 0, across epochs): rank} sets
    one gradient element to inf on that rank after that batch's backward (after DDP's all-reduce)."""

    def __init__(self, out_dir: Path, inject: Optional[dict[int, int]] = None) -> None:
        self.out_dir = Path(out_dir)
        self.inject = inject or {}
        self.losses: list[float] = []
        self.before: list[torch.Tensor] = []
        self.after: list[torch.Tensor] = []
        self.skipped: list[int] = []
        self.scales: list[float] = []
        self.forward_dtypes: set[str] = set()
        self.master_dtypes: set[str] = set()
        self._batch = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        first = next(m for m in pl_module.modules() if isinstance(m, (nn.Linear, nn.Conv2d)))

        def seen(module: nn.Module, args: Any) -> None:
            self.forward_dtypes.add(str(module.weight.dtype))

        first.register_forward_pre_hook(seen)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._batch += 1  # counted across epochs
        self.before.append(flat_params(pl_module))

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.inject.get(self._batch) == trainer.global_rank:
            for p in pl_module.parameters():
                if p.grad is not None:
                    local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    if local.numel():
                        local.view(-1)[0] = float("inf")
                        return

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.master_dtypes.update(str(p.dtype) for g in optimizer.param_groups for p in g["params"])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss) if loss is not None else math.nan)
        self.after.append(flat_params(pl_module))
        plugin = trainer.precision_plugin
        if isinstance(plugin, MGPUPrecision):
            self.skipped.append(plugin.skipped_steps)
            self.scales.append(plugin.loss_scale)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plugin = trainer.precision_plugin
        masters = torch.cat([full(p.detach()).flatten().float() for p in optimizer_params(trainer)])
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "losses": self.losses,
                "before": self.before,
                "after": self.after,
                "skipped": self.skipped,
                "scales": self.scales,
                "forward_dtypes": self.forward_dtypes,
                "master_dtypes": self.master_dtypes,
                "final": flat_params(pl_module).float(),
                "masters": masters,
                "plugin": type(plugin).__name__,
                "optimizer_steps": getattr(plugin, "optimizer_steps", None),
                "global_step": trainer.global_step,
                "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            },
            self.out_dir / f"prec{trainer.global_rank}.pt",
        )


def tracked(out_dir: Path, world: int = WORLD) -> list[dict[str, Any]]:
    return [torch.load(Path(out_dir) / f"prec{r}.pt", weights_only=False) for r in range(world)]


def run_digits(out_dir: Path, mode: str, strat: str, steps: int = 24) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = DigitsCNN(lr=0.01, channels=8)
    # fp16 starts at a scale this CNN's fp16 gradients do not overflow: the curves compare the arithmetic,
    # not the dynamic scaler's first back-off steps (the overflow tests cover skipping)
    plugins = [MGPUPrecision(mode, init_scale=2.0**10)] if mode != "32-true" else []  # type: ignore[arg-type]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy(strat),
        plugins=plugins,
        max_steps=steps,
        accumulate_grad_batches=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Track(out_dir)],
    )
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=16))
    return tracked(out_dir)


# --- bad input, before any process starts ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("fp16", "Did you mean '16-mixed'"), ("bf16-true", "Did you mean 'bf16-master'"), ("fp8", "Use one of")],
)
def test_unknown_mode_names_the_modes(mode: str, expected: str) -> None:
    with pytest.raises(ValueError, match=rf"mode='{mode}'.*{expected}"):
        MGPUPrecision(mode)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"init_scale": 0.0}, "init_scale"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
    ],
)
def test_bad_scaler_setting_is_named(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name} must be .*got"):
        MGPUPrecision("16-mixed", **kwargs)


def test_gpu_without_bf16_is_refused_with_the_fp16_alternative(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    with pytest.raises(RuntimeError, match=r"Tesla V100 does not support.*MGPUPrecision\('16-mixed'\)"):
        check_device("bf16-master", "cuda")


def test_autocast_dtype_the_device_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision_modes, "autocast_supported", lambda device, dtype: False)
    with pytest.raises(RuntimeError, match=r"does not support torch.float16.*'bf16-mixed'.*'16-master'"):
        check_device("16-mixed", "cpu")
    check_device("16-master", "cpu")  # no autocast in the master modes: the model itself runs in half


def test_device_mismatch_is_refused_at_trainer_construction() -> None:
    with pytest.raises(ValueError, match=r"device='cuda'\) but the Trainer runs on 'cpu'"):
        pl.Trainer(
            accelerator="cpu", devices=2, strategy="mgpu_ddp_fork", plugins=[MGPUPrecision("bf16-mixed", device="cuda")]
        )


def test_master_mode_with_fairscale_is_refused_at_trainer_construction() -> None:
    with pytest.raises(ValueError, match=r"backend='fairscale'.*'mgpu_sharded'.*'bf16-mixed'"):
        pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=MGPUShardedStrategy(stage=2, backend="fairscale", start_method="fork"),
            plugins=[MGPUPrecision("bf16-master")],
        )


def test_default_precision_runs_as_mgpu_32_true() -> None:
    plugin = pl.Trainer(accelerator="cpu", devices=2, strategy="mgpu_ddp_fork").precision_plugin
    assert isinstance(plugin, MGPUPrecision) and plugin.mode == "32-true" and plugin.state_dict() == {}


def test_check_mode_accepts_every_mode() -> None:
    assert [check_mode(m) for m in ["32-true", *HALF_MODES]] == ["32-true", *HALF_MODES]


@pytest.mark.parametrize("name", ["mgpu_ddp_fork", "mgpu_sharded_notebook"])
@pytest.mark.parametrize("flag", ["16-mixed", "bf16-mixed"])
def test_precision_flag_selects_mgpu_precision(name: str, flag: str) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=name, precision=flag)  # type: ignore[arg-type]
    plugin = trainer.precision_plugin
    assert isinstance(plugin, MGPUPrecision)
    # Lightning turns precision="16-mixed" into bf16 on CPU before any strategy sees it (with a warning);
    # MGPUPrecision("16-mixed") passed as a plugin runs fp16 on CPU.
    assert plugin.mode == "bf16-mixed"


# --- end to end ----------------------------------------------------------------------------------------------

LOSS_TOL = {"16-mixed": 0.01, "16-master": 0.01, "bf16-mixed": 0.03, "bf16-master": 0.03}


@pytest.fixture(scope="module")
def fp32_curves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return {s: run_digits(tmp_path_factory.mktemp(f"fp32-{s}"), "32-true", s) for s in ("ddp", "fsdp2")}


@pytest.mark.parametrize(
    ("mode", "strat"), cells(HALF_MODES, ["ddp", "fsdp2"], {"16-mixed-fsdp2", "bf16-master-fsdp2"})
)
def test_loss_curve_stays_within_tolerance_of_fp32(
    tmp_path: Path, fp32_curves: dict[str, list[dict[str, Any]]], mode: str, strat: str
) -> None:
    ranks = run_digits(tmp_path, mode, strat)
    ref = fp32_curves[strat][0]["losses"]
    got = ranks[0]["losses"]
    assert len(got) == len(ref) == 48  # 24 optimizer steps x accumulation 2
    gaps = [abs(a - b) for a, b in zip(got, ref)]
    assert max(gaps) < LOSS_TOL[mode], (mode, strat, max(gaps))
    assert sum(got[-8:]) / 8 < 0.5 * sum(got[:8]) / 8  # it learns
    assert ranks[0]["plugin"] == "MGPUPrecision" and ranks[0]["optimizer_steps"] == 24
    assert ranks[0]["skipped"][-1] == 0
    torch.testing.assert_close(ranks[0]["final"], ranks[1]["final"], rtol=0, atol=0)  # replicas agree
    half = "torch.bfloat16" if mode.startswith("bf16") else "torch.float16"
    if mode in MASTER_MODES:
        assert ranks[0]["forward_dtypes"] == {half}
        assert ranks[0]["master_dtypes"] == {"torch.float32"}
    else:
        assert ranks[0]["forward_dtypes"] == {"torch.float32"}  # weights FP32, autocast casts per op


def _regressor_run(
    out_dir: Path,
    mode: str,
    strat: Any,
    devices: int,
    batch: int,
    accumulate: int,
    growth_interval: int = 2000,
    model: Optional[pl.LightningModule] = None,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    model = model if model is not None else Regressor(lr=0.05).float()
    fit(
        model,
        strat,
        out_dir,
        dataset=make_data(dtype=torch.float32),
        batch_size=batch,
        accumulate=accumulate,
        devices=devices,
        # a scale the regressor's fp16 gradients never overflow: the only skipped steps are injected ones
        plugins=[MGPUPrecision(mode, init_scale=2.0**10, growth_interval=growth_interval)],  # type: ignore[arg-type]
        callbacks=[Track(out_dir, kwargs.pop("inject", None)), *kwargs.pop("extra", [])],
        **kwargs,
    )
    return tracked(out_dir, devices)


PARITY_TOL = {"16-mixed": 3e-3, "16-master": 3e-3, "bf16-mixed": 2e-2, "bf16-master": 2e-2}


@pytest.mark.parametrize("strat", ["ddp", "zero1", "fsdp2"])
@pytest.mark.parametrize("mode", HALF_MODES)
def test_ranks_times_accumulation_match_one_process(tmp_path: Path, mode: str, strat: str) -> None:
    ranks = _regressor_run(tmp_path / "dist", mode, strategy(strat), WORLD, batch=8, accumulate=2)
    try:
        one = _regressor_run(tmp_path / "one", mode, "auto", 1, batch=32, accumulate=1)
    finally:
        torch.set_num_threads(1)  # an in-process fit raises the thread count; later fork launches deadlock
    w0 = ranks[0]["before"][0]
    w, ref = ranks[0]["final"], one[0]["final"]
    assert (ref - w0).norm() > 0.1  # the weights moved
    assert relative_distance(w, ref, w0) < PARITY_TOL[mode], relative_distance(w, ref, w0)


class ScaledRegressor(Regressor):
    """The regressor with a learned output scale, one element (its ZeRO-3 shard on rank 1 is empty), stepped by
    AdamW's fused kernel (which skips a step whose gradients are not finite on the device, given the flag; torch's
    fused SGD has no DTensor sharding rule)."""

    def __init__(self) -> None:
        super().__init__(lr=0.05)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr / 10, fused=True)


@pytest.mark.parametrize(
    ("mode", "strat"), [(m, s) for m in HALF_MODES for s in ("ddp", "fsdp2")] + [("bf16-mixed", "fsdp2_fused")]
)
def test_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path: Path, mode: str, strat: str) -> None:
    """``fsdp2_fused``: ZeRO-3 with an empty shard on one rank (the check skips it) and a fused optimizer (the flag
    goes to its kernel: no rank waits for the device to decide)."""
    model = ScaledRegressor().float() if strat == "fsdp2_fused" else None
    # batch 3 is the second micro-batch of optimizer step 2 (accumulation 2): the synced backward
    ranks = _regressor_run(
        tmp_path, mode, strategy(strat.removesuffix("_fused")), WORLD, batch=8, accumulate=2, model=model,
        inject={3: 1}, max_epochs=4,
    )  # fmt: skip
    for r in ranks:
        assert torch.equal(r["before"][2], r["after"][3])  # step 2 (batches 2-3) left the weights untouched
        assert not torch.equal(r["before"][0], r["after"][1])  # step 1 moved them
        assert r["skipped"][1] == 0 and r["skipped"][3] == 1 and r["skipped"][-1] == 1
        assert not torch.equal(r["after"][3], r["final"])  # training continued
        losses = r["losses"]  # 6 batches per epoch (96 samples / (2 ranks x 8))
        assert sum(losses[-6:]) < sum(losses[:6])  # and recovered: the last epoch's loss is below the first's
        if mode.startswith("16"):
            assert r["scales"][3] == r["scales"][1] / 2  # the loss scale backed off
        assert r["callback_metrics"]["precision/skipped_steps"] == 1.0
    torch.testing.assert_close(ranks[0]["final"], ranks[1]["final"], rtol=0, atol=0)


def test_overflow_check_not_agreed_lets_replicas_diverge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control for the test above: without the all-reduce of the inf check, rank 0 steps with the
    poisoned (unsynced) gradient's neighbours while rank 1 skips."""
    # inherited by the forked ranks: the inf check and the scaler both see one rank
    monkeypatch.setattr(precision_modes, "world_size", lambda: 1)
    monkeypatch.setattr(precision_module, "world_size", lambda: 1)
    ranks = _regressor_run(tmp_path, "bf16-master", strategy("ddp"), WORLD, batch=8, accumulate=2, inject={3: 1})
    assert ranks[0]["skipped"][-1] == 0 and ranks[1]["skipped"][-1] == 1
    assert not torch.equal(ranks[0]["final"], ranks[1]["final"])


def test_scaler_updates_once_per_optimizer_step_with_accumulation(tmp_path: Path) -> None:
    model = Regressor(lr=0.05).float()
    out = tmp_path
    plugin = MGPUPrecision("16-mixed", init_scale=256.0, growth_interval=2)
    fit(
        model,
        strategy("ddp"),
        out,
        dataset=make_data(dtype=torch.float32),
        batch_size=4,
        accumulate=4,
        max_epochs=1,  # 96 / (2 ranks x 4) = 12 micro-batches = 3 optimizer steps
        plugins=[plugin],
        callbacks=[Track(out)],
    )
    r = tracked(out)[0]
    assert r["global_step"] == r["optimizer_steps"] == 3
    assert r["skipped"][-1] == 0
    assert r["scales"][-1] == 256.0 * 2  # grew once (2 good steps); per micro-batch it would be 256 * 2**6
    assert r["callback_metrics"]["precision/loss_scale"] == 512.0  # logged through self.log


def one_clipped_step(tmp_path: Path, model: pl.LightningModule, mode: str, **trainer_kwargs: Any) -> list[torch.Tensor]:
    """One optimizer step (SGD lr 1) on 2 ranks; returns (step norm on rank 0, each rank's masters after)."""
    w0 = torch.cat([p.detach().flatten() for p in model.parameters()])
    fit(
        model,
        strategy("ddp"),
        tmp_path,
        dataset=make_data(dtype=torch.float32),
        batch_size=8,
        max_steps=1,
        # 32-true: Lightning's default Precision, which mgpu_ddp runs as MGPUPrecision("32-true")
        plugins=[MGPUPrecision(mode, init_scale=2.0**10)] if mode != "32-true" else [],  # type: ignore[arg-type]
        callbacks=[Track(tmp_path)],
        **trainer_kwargs,
    )
    masters = [r["masters"] for r in tracked(tmp_path)]
    return [(masters[0] - w0).norm(), *masters]


class OneStep(Regressor):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1.0)


@pytest.mark.parametrize("mode", ["16-mixed", "16-master"])
def test_clipping_sees_unscaled_gradients(tmp_path: Path, mode: str) -> None:
    step, *_ = one_clipped_step(tmp_path, OneStep().float(), mode, gradient_clip_val=1e-3)
    # clipped to norm 1e-3 after unscaling (lr 1): clipping the scaled gradient would move 1024x less
    assert 0.95e-3 < step < 1.01e-3, step


# --- master weights in checkpoints ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "strat"), cells(MASTER_MODES, ["ddp", "zero1", "fsdp2"], {"bf16-master-ddp", "bf16-master-zero1"})
)
def test_resume_restores_fp32_masters_and_the_scaler(tmp_path: Path, mode: str, strat: str) -> None:
    # growth_interval 5: the fp16 scale grows during both halves, so a resume that lost the scaler's state
    # (scale, growth tracker) would end on another scale
    grow = 5
    whole = _regressor_run(
        tmp_path / "whole", mode, strategy(strat), WORLD, batch=8, accumulate=1, max_epochs=4, growth_interval=grow
    )
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    _regressor_run(
        tmp_path / "first",
        mode,
        strategy(strat),
        WORLD,
        batch=8,
        accumulate=1,
        max_epochs=2,
        growth_interval=grow,
        enable_checkpointing=True,
        extra=[ckpt],
    )
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    weights = saved["state_dict"]["net.0.weight"]
    assert weights.dtype == torch.float32  # the checkpoint holds the masters, not the half weights
    half = torch.bfloat16 if mode.startswith("bf16") else torch.float16
    assert not torch.equal(weights, weights.to(half).float())  # ... with bits the half copy does not have
    assert saved["MGPUPrecision"]["mode"] == mode
    resumed = _regressor_run(
        tmp_path / "resumed",
        mode,
        strategy(strat),
        WORLD,
        batch=8,
        accumulate=1,
        max_epochs=4,
        growth_interval=grow,
        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
    )
    for a, b in zip(whole, resumed):
        assert torch.equal(a["masters"], b["masters"])  # FP32 masters restored exactly
        assert torch.equal(a["final"], b["final"])
        assert a["master_dtypes"] == {"torch.float32"} and a["forward_dtypes"] == {str(half)}
        if mode.startswith("16"):
            assert a["scales"][-1] == b["scales"][-1] == 2.0**10 * 2**4  # 24 good steps: grew 4 times


# --- manual optimization ---------------------------------------------------------------------------------


class TwoOptimizers(pl.LightningModule):
    """Manual optimization in Lightning's documented GAN shape: toggle, backward, step, zero_grad, untoggle.
    B's loss reaches A's weights; with the toggle A must get no gradient from it (as in FP32)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt_a, opt_b = self.optimizers()  # type: ignore[misc]
        self.toggle_optimizer(opt_a)
        self.manual_backward(F.mse_loss(self.a(x)[:, :3], y))
        opt_a.step()
        opt_a.zero_grad()
        self.untoggle_optimizer(opt_a)
        self.toggle_optimizer(opt_b)
        self.manual_backward(20 * F.mse_loss(self.b(torch.tanh(self.a(x))), y))
        opt_b.step()
        opt_b.zero_grad()
        self.untoggle_optimizer(opt_b)

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.a.parameters(), lr=0.05), torch.optim.SGD(self.b.parameters(), lr=0.05)]


class NoMirror(MGPUPrecision):
    """Negative control: the toggle is not mirrored onto the half weights."""

    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        pairs, self._masters.pairs = self._masters.pairs, []
        try:
            return super().pre_backward(tensor, module)
        finally:
            self._masters.pairs = pairs


def _two_opt(out_dir: Path, plugin: Optional[MGPUPrecision]) -> torch.Tensor:
    fit(
        TwoOptimizers(),
        strategy("ddp"),
        out_dir,
        dataset=make_data(dtype=torch.float32),
        batch_size=8,
        max_epochs=2,
        plugins=[plugin] if plugin is not None else [],
        callbacks=[Track(out_dir)],
    )
    return tracked(out_dir)[0]["final"]


def test_manual_optimization_with_toggling_matches_fp32(tmp_path: Path) -> None:
    ref = _two_opt(tmp_path / "fp32", None)
    w0 = flat_params(TwoOptimizers())
    good = relative_distance(_two_opt(tmp_path / "master", MGPUPrecision("bf16-master")), ref, w0)
    bad = relative_distance(_two_opt(tmp_path / "nomirror", NoMirror("bf16-master")), ref, w0)
    assert good < 2e-2, good
    assert bad > 5 * good, (good, bad)  # the comparison can fail: stray gradients reach A's weights


class RankInit(Regressor):
    """Each rank initialises its own weights (no common seed, as under torchrun without seed_everything)."""

    def setup(self, stage: str) -> None:
        with torch.no_grad():
            for p in self.parameters():
                p.add_(0.1 * (self.trainer.global_rank + 1))


@pytest.mark.parametrize("strat", ["ddp", "zero1"])
def test_masters_start_from_rank_zero_weights(tmp_path: Path, strat: str) -> None:
    # DDP copies rank 0's weights into the half parameters; the FP32 masters must follow, or each rank would
    # copy its own masters back after the first step and the replicas would never meet again
    ranks = _regressor_run(
        tmp_path, "bf16-master", strategy(strat), WORLD, batch=8, accumulate=1, model=RankInit(lr=0.05).float()
    )
    assert torch.equal(ranks[0]["before"][0], ranks[1]["before"][0])
    assert torch.equal(ranks[0]["masters"], ranks[1]["masters"])
    assert torch.equal(ranks[0]["final"], ranks[1]["final"])


class PlainSGD(Regressor):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)  # no state: a reload repeats the run exactly


class ReloadAtEpochOne(Callback):
    """Loads the start-of-training weights through the strategy at the start of epoch 1 (what
    LearningRateFinder's restore or a second fit does while the masters exist)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state = {k: v.clone() for k, v in trainer.strategy.lightning_module_state_dict().items()}

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 1:
            trainer.strategy.load_model_state_dict({"state_dict": self.state})


@pytest.mark.parametrize("strat", ["ddp", "zero1"])
def test_weights_loaded_after_setup_reach_the_masters(tmp_path: Path, strat: str) -> None:
    ranks = _regressor_run(
        tmp_path,
        "bf16-master",
        strategy(strat),
        WORLD,
        batch=8,
        accumulate=1,
        model=PlainSGD(lr=0.05).float(),
        extra=[ReloadAtEpochOne()],
    )
    after = ranks[0]["after"]  # 6 batches per epoch
    assert not torch.equal(after[5], ranks[0]["before"][0])  # epoch 0 moved the weights
    for i in range(6):
        assert torch.equal(after[6 + i], after[i])  # epoch 1 restarted from the reloaded FP32 weights


class ManualClip(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(F.mse_loss(self(x), y))
        self.clip_gradients(opt, gradient_clip_val=1e-3, gradient_clip_algorithm="norm")  # type: ignore[arg-type]
        opt.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1.0)


@pytest.mark.parametrize("mode", ["32-true", "16-mixed", "16-master", "bf16-master"])
def test_manual_clip_gradients_acts_on_unscaled_master_gradients(tmp_path: Path, mode: str) -> None:
    step, masters0, masters1 = one_clipped_step(tmp_path, ManualClip().float(), mode)
    # clip_gradients must see the gradient averaged over the ranks (clipping each rank's own and averaging
    # them gives a shorter step), in FP32 in the master modes (else nothing is clipped) and unscaled (else
    # 1024x less)
    assert 0.99e-3 < step < 1.01e-3, step
    assert torch.equal(masters0, masters1)


@pytest.mark.parametrize("strat", ["ddp", "zero1"])
def test_fork_launch_hands_the_fp32_masters_back_to_the_main_process(tmp_path: Path, strat: str) -> None:
    model = Regressor(lr=0.05).float()
    ranks = _regressor_run(tmp_path, "bf16-master", strategy(strat), WORLD, batch=8, accumulate=1, model=model)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert weights.dtype == torch.float32
    assert torch.equal(weights, ranks[0]["masters"])  # not the bf16 rounding of them
    assert not torch.equal(weights, weights.to(torch.bfloat16).float())


def test_gan_sample_trains_with_master_weights_from_a_cli_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The user path: MGPUPrecision chosen in LightningCLI by class_path, the GAN sample (manual optimization, two
    optimizers, accumulation 4) from its config, fit then test and the summary, under a fork launch from this process
    (the config as written, a popen launch, trains in the slow tier: tests/integration/examples/test_gan.py). The fork
    launch's main process tests after the ranks' fit: the untrained generator it compares with is taken when the
    module is built, not when fit starts in the ranks (it was missing here before)."""
    from lightning_mgpu.examples.gan import main

    root = Path(__file__).resolve().parents[3]
    plugin = '{"class_path": "lightning_mgpu.MGPUPrecision", "init_args": {"mode": "bf16-master"}}'
    main(
        [
            "fit", "--config", str(root / "configs" / "gan.yaml"), "--trainer.strategy", "mgpu_ddp_notebook",
            "--trainer.plugins", plugin, "--trainer.max_epochs", "2", "--trainer.default_root_dir", str(tmp_path),
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("test MMD^2"))
    trained, untrained = (float(part.split()[-2]) for part in line.split(":")[1].split(","))
    assert math.isfinite(trained) and math.isfinite(untrained) and trained != untrained
    assert "optimizer steps 40" in out  # 2 epochs x 20 accumulated steps


# ---------------------------------------------------------------------------------------------------------
# bf16 with a fused optimizer under gradient clipping
# ---------------------------------------------------------------------------------------------------------


class FusedAdamW(Regressor):
    """AdamW with ``fused=True`` (one kernel per step, on CPU too) or torch's default (the comparison)."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01, fused=self.fused)


def test_bf16_with_a_fused_optimizer_clips_and_steps_as_the_unfused_one():
    """bf16 (``precision="bf16-mixed"``; ``MGPUPrecision("bf16-master")`` under ZeRO-1) with ``AdamW(fused=True)``
    and ``gradient_clip_val``: on 2 ranks under mgpu_ddp, mgpu_zero3 and mgpu_zero1 the fit clips and steps to the
    weights of the same fit with the unfused AdamW (float32 tolerance; bf16 only in the autocast compute). Lightning
    2.6.6's own mixed-precision plugin refuses the combination ("does not allow for gradient clipping because it
    performs unscaling of gradients internally"), as if bf16 had a loss scaler: shown with Lightning's DDPStrategy.
    The negative control: without clipping the weights differ (the clipping is active)."""
    from pytorch_lightning.strategies import DDPStrategy

    from tests.numerics_harness import fit_job, run_jobs

    def data() -> pl.LightningDataModule:
        from tests.models import RankData

        return RankData(make_data(n=32, dtype=torch.float32), 4)

    flags = {
        "accelerator": "cpu",
        "devices": 2,
        "max_steps": 4,
        "use_distributed_sampler": False,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    families = {
        "ddp": (lambda: MGPUDDPStrategy(), {"precision": "bf16-mixed"}),
        "zero3": (lambda: MGPUShardedStrategy(stage=3), {"precision": "bf16-mixed"}),
        "zero1": (lambda: MGPUShardedStrategy(stage=1), {"plugins": [MGPUPrecision("bf16-master")]}),
    }
    jobs = []
    for make_strategy, precision in families.values():
        for fused, clip in ((True, 0.05), (False, 0.05)):
            kwargs = {**flags, **precision, "gradient_clip_val": clip}
            jobs.append(fit_job(lambda fused=fused: FusedAdamW(fused), make_strategy, data, kwargs))
    jobs.append(fit_job(lambda: FusedAdamW(True), families["ddp"][0], data, {**flags, "precision": "bf16-mixed"}))
    records = run_jobs(jobs)
    for i, name in enumerate(families):
        fused, unfused = records[2 * i], records[2 * i + 1]
        assert fused["global_step"] == unfused["global_step"] == 4, name
        torch.testing.assert_close(fused["weights"], unfused["weights"], msg=lambda m, n=name: f"{n}: {m}")
    with pytest.raises(AssertionError):  # negative control: the same fit unclipped
        torch.testing.assert_close(records[-1]["weights"], records[0]["weights"])
    lightnings = pl.Trainer(
        **{**flags, "devices": 1}, strategy=DDPStrategy(), precision="bf16-mixed", gradient_clip_val=0.05
    )
    try:
        with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
            lightnings.fit(FusedAdamW(True), datamodule=data())
    finally:  # Lightning's one-process group, left up by the failed fit
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
