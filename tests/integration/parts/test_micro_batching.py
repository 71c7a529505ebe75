"""``micro_batch_size`` end to end: 2 gloo ranks, an out-of-memory error raised on purpose on one rank, and the
weights of a single process with the whole global batch (float64, assert_close defaults)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback

from lightning_mgpu import MGPUDDPStrategy, MGPUDiLoCoStrategy, MGPULocalSGDStrategy, MGPUShardedStrategy
from tests.helpers import WORLD, Regressor, fit, make_data, reference_weights
from tests.models import ManualRegressor

B = 8
EPOCHS = 2


class OOMAbove(Regressor):
    """Rank ``rank`` runs out of memory (``torch.OutOfMemoryError``, raised on purpose) on any micro-batch of more
    than ``threshold`` rows; the other rank never does."""

    def __init__(self, threshold: int, rank: int = 1) -> None:
        super().__init__()
        self.threshold = threshold
        self.oom_rank = rank

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_rank == self.oom_rank and batch[0].shape[0] > self.threshold:
            raise torch.OutOfMemoryError(f"out of memory: {batch[0].shape[0]} rows (raised on purpose)")
        return super().training_step(batch, batch_idx)


class BackOffRecorder(Callback):
    """Per rank: the strategy's back-offs and the back-off warnings the log received."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)
        self.records: list[str] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        recorder = self

        class Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                recorder.records.append(record.getMessage())

        logging.getLogger("lightning_mgpu.parts.micro_batching").addHandler(Handler())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        mb = trainer.strategy.micro_batching
        torch.save(
            {
                "backoffs": [(b.from_size, b.to_size, b.ranks) for b in mb.backoffs],
                "size": mb.size,
                "log": self.records,
            },
            self.out_dir / f"backoffs{trainer.global_rank}.pt",
        )


def _fit(tmp_path: Path, model: pl.LightningModule, strategy: Any, accumulate: int) -> list[dict[str, Any]]:
    ranks = fit(
        model,
        strategy,
        tmp_path,
        dataset=make_data(),
        batch_size=B,
        accumulate=accumulate,
        max_epochs=EPOCHS,
        callbacks=[BackOffRecorder(tmp_path)],
    )
    for r, record in enumerate(ranks):
        record.update(torch.load(tmp_path / f"backoffs{r}.pt", weights_only=False))
    return ranks


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """mgpu_ddp, micro_batch_size='auto', accumulation 2; rank 1 fails above 3 rows (the loader gives 8)."""
    tmp_path = tmp_path_factory.mktemp("auto")
    model = OOMAbove(threshold=3).double()
    expected = reference_weights(model, make_data(), global_batch=WORLD * B * 2, epochs=EPOCHS)
    strategy = MGPUDDPStrategy(start_method="fork", micro_batch_size="auto")
    return expected, _fit(tmp_path, model, strategy, accumulate=2)


@pytest.mark.slow
def test_an_oom_on_one_rank_backs_off_every_rank_and_the_weights_match_the_whole_batch(auto_run):
    expected, ranks = auto_run
    for rank, r in enumerate(ranks):
        assert r["global_step"] == EPOCHS * len(make_data()) // (WORLD * B * 2)
        torch.testing.assert_close(r["weights"], expected)
        # both ranks backed off together, 8 -> 4 -> 2, and know that rank 1 hit it
        assert r["backoffs"] == [(8, 4, (1,)), (4, 2, (1,))]
        assert r["size"] == 2
        # said once per job: by rank 0, naming rank 1
        assert len(r["log"]) == (2 if rank == 0 else 0) and all("rank(s) [1] ran out of memory" in m for m in r["log"])


@pytest.mark.slow
def test_the_parity_check_of_the_oom_run_can_fail(auto_run):
    """Negative control: the same run against a reference that ignores accumulation."""
    _, ranks = auto_run
    wrong = reference_weights(OOMAbove(threshold=3).double(), make_data(), global_batch=WORLD * B, epochs=EPOCHS)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ranks[0]["weights"], wrong)


@pytest.mark.slow
def test_a_fixed_micro_batch_at_stage_1_matches_the_whole_batch(tmp_path):
    """micro_batch_size=3 on 8 rows (3 + 3 + 2) with ZeRO-1, no out-of-memory error."""
    model = Regressor().double()
    expected = reference_weights(model, make_data(), global_batch=WORLD * B, epochs=EPOCHS)
    initial = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    ranks = _fit(tmp_path, model, MGPUShardedStrategy(stage=1, start_method="fork", micro_batch_size=3), accumulate=1)
    for r in ranks:
        torch.testing.assert_close(r["weights"], expected)
        assert r["backoffs"] == [] and r["size"] == 3
    assert (expected - initial).abs().max() > 1e-2


@pytest.mark.slow
def test_a_micro_batch_of_one_row_that_does_not_fit_is_a_clear_error(tmp_path):
    with pytest.raises(Exception, match="ran out of memory with a micro-batch of 1 row"):
        _fit(tmp_path, OOMAbove(threshold=0).double(), MGPUDDPStrategy(start_method="fork", micro_batch_size=2), 1)


def test_manual_optimization_is_refused_before_launch(tmp_path):
    with pytest.raises(Exception, match="micro_batch_size=4 needs automatic optimization"):
        _fit(tmp_path, ManualRegressor().double(), MGPUDDPStrategy(start_method="fork", micro_batch_size=4), 1)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: MGPUShardedStrategy(stage=2, micro_batch_size=4), "not yet at stage=2"),
        (lambda: MGPUDDPStrategy(comm_hook="powersgd", micro_batch_size=4), "PowerSGD"),
        (lambda: MGPUDDPStrategy(micro_batch_size=0), "micro_batch_size=0 must be a positive int"),
        (lambda: MGPUDDPStrategy(micro_batch_size=4, loss_normalization="tokens"), "do not compose yet"),
        (lambda: MGPULocalSGDStrategy(micro_batch_size=4), "weight sync every sync_every steps"),
        (lambda: MGPUDiLoCoStrategy(micro_batch_size=4), "weight sync every sync_every steps"),
    ],
    ids=["stage2", "powersgd", "zero", "tokens", "local_sgd", "diloco"],
)
def test_unsupported_micro_batch_settings_are_refused_at_construction(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()
