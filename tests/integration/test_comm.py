"""The ledger (ledger.py) in Trainer.fit on 2 fork-launched gloo ranks: its figures reach the Trainer's logger, and
it counts the hook path (no bucket views) as torch.profiler does."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch

from lightning_mgpu import MGPUDDPStrategy
from tests.helpers import WORLD, Regressor, fit, make_data

B = 4


def test_comm_stats_are_logged_through_the_trainer_logger(tmp_path):
    from pytorch_lightning.loggers import CSVLogger

    from tests.helpers import RankData

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=MGPUDDPStrategy(start_method="fork"),
        max_epochs=1,
        accumulate_grad_batches=2,
        use_distributed_sampler=False,
        logger=CSVLogger(tmp_path, name="csv"),
        log_every_n_steps=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor().double(), datamodule=RankData(make_data(), B))
    import csv

    rows = list(csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")))
    logged = [row for row in rows if row.get("comm/optimizer_steps")]
    steps = [float(row["comm/optimizer_steps"]) for row in logged]
    assert steps[:3] == [2.0, 4.0, 6.0] and steps[-1] == 6.0  # every 2 steps, and once at train end
    last = logged[-1]
    assert float(last["comm/calls_per_step"]) == 1.0
    assert float(last["comm/ratio_to_lower_bound"]) == pytest.approx(1.0)
    grad_bytes = sum(p.numel() * 8 for p in Regressor().parameters())
    assert float(last["comm/ring_lower_bound_bytes"]) == pytest.approx(2 * (WORLD - 1) / WORLD * grad_bytes)
    assert torch.distributed.is_available()


@pytest.mark.parametrize("k", [1, 2])
def test_ledger_counts_in_the_hook_path_without_bucket_views(tmp_path, k):
    """gradient_as_bucket_view=False: plain all-reduce runs through the counting Python hook instead;
    the ledger must agree with both torch.profiler and the all_reduce spy, micro-batch by micro-batch."""
    model = Regressor(hidden=256).double()
    strategy = MGPUDDPStrategy(start_method="fork", gradient_as_bucket_view=False, bucket_cap_mb=0.005)
    ranks = fit(model, strategy, tmp_path, accumulate=k, max_epochs=1, profile=True)
    for r in ranks:
        assert r["batch_ledger"] == r["batch_spy"]
        assert r["batch_ledger_calls"] == r["batch_allreduces"]
        assert max(r["batch_ledger_calls"]) >= 2
        assert r["ledger"].sync_rounds == r["ledger"].optimizer_steps == len(r["batch_allreduces"]) // k
