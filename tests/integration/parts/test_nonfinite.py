"""``nonfinite="error"``: a NaN/Inf gradient on one rank makes every rank raise the same error naming the rank and
the parameter (no hang, no rank stepping alone); under the fp16 scaler every rank skips the same step."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback

from lightning_mgpu import MGPUDDPStrategy, MGPUPrecision, MGPUShardedStrategy
from lightning_mgpu.settings import CommonSettings
from tests.numerics_harness import EPOCHS, B, ValData, ValRegressor, _Weights, dataset, run_jobs

BAD_STEP = 1


class PoisonRankOne(Callback):
    """After the step's backward (gradients synced), rank 1 alone gets a non-finite value in the first gradient it
    holds: what a rank-local fault leaves, and what the agreed check must catch on every rank."""

    def __init__(self, value: float) -> None:
        self.value = value

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != 1 or trainer.global_step != BAD_STEP:
            return
        for name, p in pl_module.named_parameters():
            if p.grad is not None:
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                grad.view(-1)[0] = self.value
                trainer.poisoned = name  # type: ignore[attr-defined]
                return


def job(make_strategy: Callable[[], Any], value: float, **kwargs: Any) -> Callable[[Path], None]:
    def run(path: Path) -> None:
        poison = PoisonRankOne(value)
        trainer = pl.Trainer(
            strategy=make_strategy(),
            callbacks=[_Weights(path), poison],
            accelerator="cpu",
            devices=2,
            max_epochs=EPOCHS,
            use_distributed_sampler=False,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            **kwargs,
        )
        try:
            trainer.fit(ValRegressor().float(), datamodule=ValData(dataset("32"), B))
        except FloatingPointError as err:
            torch.save({"error": str(err), "step": trainer.global_step}, path)
            return
        record = torch.load(path)
        record["poisoned"] = getattr(trainer, "poisoned", None)
        torch.save(record, path)

    return run


STRATEGIES: dict[str, Callable[[], Any]] = {
    "ddp": lambda: MGPUDDPStrategy(start_method="popen", nonfinite="error"),
    "zero1": lambda: MGPUShardedStrategy(stage=1, start_method="popen", nonfinite="error"),
    "zero2": lambda: MGPUShardedStrategy(stage=2, start_method="popen", nonfinite="error"),
    "zero2_fairscale": lambda: MGPUShardedStrategy(
        stage=2, backend="fairscale", start_method="popen", nonfinite="error"
    ),
    "zero3": lambda: MGPUShardedStrategy(stage=3, start_method="popen", nonfinite="error"),
}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    jobs = [job(make, float("nan")) for make in STRATEGIES.values()]
    jobs.append(job(STRATEGIES["ddp"], float("inf"), plugins=[MGPUPrecision("16-mixed")]))
    jobs.append(job(lambda: MGPUDDPStrategy(start_method="popen"), float("nan")))  # negative control: no check
    return run_jobs(jobs, agree=False)


@pytest.mark.parametrize("index", range(len(STRATEGIES)), ids=list(STRATEGIES))
def test_every_rank_raises_the_same_error_naming_rank_and_parameter(index, runs):
    r0, r1 = runs[index]["ranks"]
    assert "error" in r0, "rank 0 went on training although rank 1's gradient held NaN"
    assert r0["error"] == r1["error"]
    assert r0["step"] == r1["step"] == BAD_STEP
    assert "optimizer step 1 (rank 1: parameter 'net." in r0["error"]
    assert "rank 0:" not in r0["error"]


def test_fp16_scaler_skips_the_same_step_on_every_rank(runs):
    r0, r1 = runs[len(STRATEGIES)]["ranks"]
    assert "error" not in r0 and "error" not in r1
    torch.testing.assert_close(r0["weights"], r1["weights"], rtol=0, atol=0)
    assert torch.isfinite(r0["weights"]).all()
    assert r0["metrics"]["precision/skipped_steps"] == r1["metrics"]["precision/skipped_steps"] == 1.0


def test_without_the_check_training_runs_on_and_ends_in_nan(runs):
    """Negative control: with nonfinite=None rank 1 steps with its NaN, nothing is raised, and the NaN reaches
    rank 0 through the next gradient all-reduce: the run ends with NaN weights on every rank."""
    r0, r1 = runs[-1]["ranks"]
    assert "error" not in r0 and "error" not in r1
    assert r0["global_step"] == r1["global_step"] > BAD_STEP + 1
    assert not torch.isfinite(r0["weights"]).all() and not torch.isfinite(r1["weights"]).all()


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="nonfinite='warn' is unknown"):
        CommonSettings(nonfinite="warn")  # type: ignore[arg-type]
