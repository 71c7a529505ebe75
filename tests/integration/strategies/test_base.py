"""After ``fit`` with every launch kind, the main process reads rank 0's results, as Lightning hands back
``callback_metrics``: ``trainer.strategy.comm_stats``, ``DeviceMonitor``'s history and ``mgpu_auto``'s decision.

fork and spawn run the workers in other processes: the launcher hands the results back. popen runs rank 0 in the
main process, so they are there already; it is tested as users run it, a script in a subprocess."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest
import pytorch_lightning as pl

from lightning_mgpu import DeviceMonitor
from tests.helpers import RankData, Recorder, Regressor, load_ranks, make_data

ROOT = Path(__file__).resolve().parents[3]


def fit_and_read(strategy: str, out_dir: Path) -> tuple[pl.Trainer, DeviceMonitor, list[dict]]:
    monitor = DeviceMonitor(every_n_steps=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Recorder(out_dir), monitor],
    )
    trainer.fit(Regressor().double(), datamodule=RankData(make_data(), 4))
    return trainer, monitor, load_ranks(out_dir)


def check(trainer: pl.Trainer, monitor: DeviceMonitor, ranks: list[dict]) -> None:
    stats = trainer.strategy.comm_stats
    # rank 0's ledger, as its worker saw it at the end of training
    assert dataclasses.asdict(stats) == dataclasses.asdict(ranks[0]["ledger"])
    assert stats.optimizer_steps == ranks[0]["global_step"] == 12  # 96 samples / (2 ranks x 4)
    assert stats.allreduce_calls > 0 and "optimizer steps 12" in stats.summary()
    assert monitor.intervals == len(monitor.history) == 6
    assert [row["step"] for row in monitor.history] == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0]
    assert all("device/rank1/step_ms" in row for row in monitor.history)


@pytest.mark.parametrize("strategy", ["mgpu_ddp_fork", "mgpu_zero1_notebook", "mgpu_sharded_notebook"])
def test_fork_hands_rank_zeros_results_to_the_main_process(strategy, tmp_path):
    check(*fit_and_read(strategy, tmp_path))


def test_fork_hands_mgpu_autos_choice_and_reason_to_the_main_process(tmp_path):
    trainer, monitor, ranks = fit_and_read("mgpu_auto_notebook", tmp_path)
    check(trainer, monitor, ranks)
    decision = trainer.strategy.auto_decision
    assert decision.strategy == "mgpu_ddp" and decision.reason.startswith("mgpu_auto chose mgpu_ddp")
    assert "| mgpu_zero3" in decision.table


@pytest.mark.slow
def test_spawn_hands_rank_zeros_results_to_the_main_process(tmp_path):
    check(*fit_and_read("mgpu_auto_spawn", tmp_path))


@pytest.mark.timeout(120)
def test_fork_hands_back_a_history_larger_than_the_queues_pipe(tmp_path):
    """100 DeviceMonitor rows (about 87 kB pickled): Lightning's queue to the main process is a pipe read only
    once every worker has ended, and rank 0's worker blocked forever writing more than its 64 KiB buffer."""
    monitor = DeviceMonitor(every_n_steps=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="mgpu_ddp_fork", max_epochs=1, use_distributed_sampler=False,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[monitor],
    )  # fmt: skip
    trainer.fit(Regressor().double(), datamodule=RankData(make_data(200), 1))
    assert len(monitor.history) == 100 and monitor.history[-1]["step"] == 100.0


class ManyMetrics(Regressor):
    """Logs 400 metrics: about 100 kB of callback_metrics."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log_dict({f"metric_{i}": float(i) for i in range(400)})
        return loss


@pytest.mark.timeout(120)
def test_fork_hands_back_more_logged_metrics_than_the_queues_pipe_holds():
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="mgpu_ddp_fork", max_steps=1, use_distributed_sampler=False,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(ManyMetrics().double(), datamodule=RankData(make_data(), 4))
    assert len(trainer.callback_metrics) == 400 and float(trainer.callback_metrics["metric_399"]) == 399.0


def test_without_the_hand_back_the_main_process_reads_zeros(tmp_path, monkeypatch):
    """Negative control: the launcher's hand-back removed, the main process keeps its own (empty) ledger."""
    from lightning_mgpu.strategies.launchers import _CheckedMultiProcessingLauncher

    monkeypatch.setattr(_CheckedMultiProcessingLauncher, "update_main_process_results", lambda self, t, e: None)
    trainer, monitor, _ = fit_and_read("mgpu_ddp_fork", tmp_path)
    assert trainer.strategy.comm_stats.optimizer_steps == 0 and monitor.history == []


POPEN_SCRIPT = """
import dataclasses, json, sys
sys.path.insert(0, {root!r})
import pytorch_lightning as pl
import lightning_mgpu
from lightning_mgpu import DeviceMonitor
from tests.helpers import Recorder, RankData, Regressor, make_data

monitor = DeviceMonitor(every_n_steps=2)
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy={strategy!r}, max_epochs=1, use_distributed_sampler=False,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[Recorder({out!r}), monitor])
trainer.fit(Regressor().double(), datamodule=RankData(make_data(), 4))
if trainer.global_rank == 0:
    decision = getattr(trainer.strategy, "auto_decision", None)
    print("RESULT " + json.dumps({{
        "stats": dataclasses.asdict(trainer.strategy.comm_stats), "steps": [r["step"] for r in monitor.history],
        "intervals": monitor.intervals, "auto": decision.strategy if decision else None,
    }}))
"""


@pytest.mark.slow
def test_popen_main_process_is_rank_zero_and_has_its_results(tmp_path, scripts):
    """The script as a user runs it: its process (forked from the session's script runner) is rank 0, its re-run in a
    fresh interpreter rank 1."""
    import json

    import torch

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(POPEN_SCRIPT.format(root=str(ROOT), strategy="mgpu_auto", out=str(tmp_path))))
    proc = scripts.run(script, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not proc.leftovers
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    ledger = torch.load(tmp_path / "rank0.pt", weights_only=False)["ledger"]
    assert result["stats"] == dataclasses.asdict(ledger) and result["stats"]["optimizer_steps"] == 12
    assert result["steps"] == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0] and result["intervals"] == 6
    assert result["auto"] == "mgpu_ddp"
