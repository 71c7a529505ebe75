"""``trainer.predict`` on 2 processes returns, where the call returns, every prediction once and in dataset order:
the list one process returns (37 samples, batches of 4: nine batches of 4 and one of 1), for fork, spawn and popen
launches, compared with a one-process ``Trainer`` in float64 (``assert_close`` defaults).

Plain Lightning (the negative controls): after a fork launch the main process gets ``None`` (0 of 37); under popen
each rank gets its own 19 or 18 samples, in its own batches."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Optional

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler

from tests.models import Predictor, make_data
from tests.scripts import Scripts

ROOT = Path(__file__).resolve().parents[3]
N, BATCH = 37, 4


def trainer(strategy: Any, devices: int = 2) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def loader(n: int = N) -> DataLoader:
    return DataLoader(make_data(n), batch_size=BATCH)


def one_process(output: str = "tensor", loaders: Any = None) -> Any:
    return trainer("auto", devices=1).predict(Predictor(output).double(), loaders or loader())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["mgpu_ddp_notebook", "mgpu_zero3_notebook"])
@pytest.mark.parametrize("return_predictions", [None, True])
def test_fork_main_process_gets_every_prediction_in_dataset_order(strategy, return_predictions):
    got = trainer(strategy).predict(Predictor().double(), loader(), return_predictions=return_predictions)
    expected = one_process()
    assert len(expected) == 10 and sum(len(b) for b in expected) == N
    torch.testing.assert_close(got, expected)


@pytest.mark.timeout(180)
def test_fork_return_predictions_false_returns_none():
    assert trainer("mgpu_ddp_notebook").predict(Predictor().double(), loader(), return_predictions=False) is None


class PaddedPredictData(pl.LightningDataModule):
    """A predict loader with your own torch ``DistributedSampler``, which pads: 38 entries, sample 0 twice."""

    def predict_dataloader(self) -> DataLoader:
        data = make_data(N)
        return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=False))


@pytest.mark.timeout(180)
def test_fork_dict_outputs_and_a_padding_sampler_come_back_once_each():
    got = trainer("mgpu_ddp_notebook").predict(Predictor("dict").double(), datamodule=PaddedPredictData())
    expected = one_process("dict")
    torch.testing.assert_close(got, expected)
    assert sum(len(b["out"]) for b in got) == N and got[0]["none"] is None and isinstance(got[0]["pair"], tuple)


@pytest.mark.timeout(180)
def test_fork_several_predict_loaders_each_come_back_whole():
    got = trainer("mgpu_ddp_notebook").predict(Predictor().double(), [loader(), loader(9)])
    expected = one_process(loaders=[loader(), loader(9)])
    assert [len(e) for e in expected] == [10, 3]
    torch.testing.assert_close(got, expected)


@pytest.mark.timeout(180)
def test_negative_control_plain_lightning_fork_hands_the_main_process_nothing():
    assert trainer("ddp_notebook").predict(Predictor().double(), loader()) is None


@pytest.mark.timeout(180)
def test_negative_control_without_the_gathering_the_main_process_gets_rank_zeros_share(monkeypatch):
    from lightning_mgpu.parts.predictions import PredictionGathering

    monkeypatch.setattr(PredictionGathering, "gather", lambda self, trainer, results, to_all: results)
    got = trainer("mgpu_ddp_notebook").predict(Predictor().double(), loader())
    assert sum(len(b) for b in got) == 19  # samples 0, 2, ..., 36
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, one_process())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_spawn_main_process_gets_every_prediction_in_dataset_order():
    got = trainer("mgpu_ddp_spawn").predict(Predictor().double(), loader())
    torch.testing.assert_close(got, one_process())


POPEN_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import pytorch_lightning as pl
import torch
import lightning_mgpu
from torch.utils.data import DataLoader
from tests.models import Predictor, make_data

trainer = pl.Trainer(accelerator="cpu", devices=2, strategy={strategy!r}, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
got = trainer.predict(Predictor().double(), DataLoader(make_data({n}), batch_size={batch}))
torch.save(got, {out!r} + f"/rank{{trainer.global_rank}}.pt")
"""


def popen_predict(strategy: str, out: Path, scripts: Scripts) -> list[Optional[list[torch.Tensor]]]:
    """Run the script as a user does (rank 0 is its process, forked from the session's script runner; rank 1 a re-run
    of it in a fresh interpreter); each rank's return value."""
    script = out / "predict.py"
    code = POPEN_SCRIPT.format(root=str(ROOT), strategy=strategy, n=N, batch=BATCH, out=str(out))
    script.write_text(textwrap.dedent(code))
    proc = scripts.run(script, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # plain Lightning's child rank may still be exiting when its parent has (the runner ends it)
    assert not proc.leftovers or not strategy.startswith("mgpu")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_popen_every_rank_gets_every_prediction_in_dataset_order(tmp_path, scripts):
    expected = one_process()
    for got in popen_predict("mgpu_ddp", tmp_path, scripts):
        torch.testing.assert_close(got, expected)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_negative_control_plain_lightning_popen_leaves_each_rank_its_own_share(tmp_path, scripts):
    ranks = popen_predict("ddp", tmp_path, scripts)
    assert [sum(len(b) for b in got) for got in ranks] == [19, 18]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ranks[0], one_process())


@pytest.mark.timeout(180)
def test_fork_limit_predict_batches_returns_exactly_the_samples_predicted_in_index_order():
    """Each rank predicts its first 2 batches (samples 0-15 here): one process predicting its first 4 batches."""
    two = trainer("mgpu_ddp_notebook")
    two.limit_predict_batches = 2
    one = trainer("auto", devices=1)
    one.limit_predict_batches = 4
    torch.testing.assert_close(two.predict(Predictor().double(), loader()), one.predict(Predictor().double(), loader()))


class IterPredictor(Predictor):
    """``predict_step(dataloader_iter)``: one batch per call, so outputs and recorded batches pair up."""

    def predict_step(self, dataloader_iter: Any) -> Any:  # type: ignore[override]
        batch, _, _ = next(dataloader_iter)
        return self(batch[0])


@pytest.mark.timeout(180)
def test_fork_predict_step_with_dataloader_iter_comes_back_whole():
    got = trainer("mgpu_ddp_notebook").predict(IterPredictor().double(), loader())
    torch.testing.assert_close(got, one_process())


@pytest.mark.timeout(180)
def test_fork_predict_after_fit_uses_the_trained_weights_and_comes_back_whole():
    import copy

    from tests.models import RankData

    model = Predictor().double()
    fitted = pl.Trainer(
        accelerator="cpu", devices=2, strategy="mgpu_ddp_notebook", max_epochs=1, use_distributed_sampler=False,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    fitted.fit(model, datamodule=RankData(make_data(N), BATCH))
    trained = copy.deepcopy(model)  # the main process's module, with the workers' weights
    assert not torch.equal(trained.net[0].weight, Predictor().double().net[0].weight)
    got = fitted.predict(model, loader())
    torch.testing.assert_close(got, trainer("auto", devices=1).predict(trained, loader()))


class WidePredictor(Predictor):
    """Outputs of 384 float64 per sample: 1000 samples are about 3 MB of predictions."""

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self(batch[0]).repeat(1, 128)


@pytest.mark.timeout(120)
def test_fork_predictions_larger_than_a_pipe_buffer_reach_the_main_process():
    """Lightning's queue is a pipe the main process reads only after every worker has ended: a worker output
    larger than its buffer (64 KiB) would block rank 0 forever. The predictions travel in a file instead."""
    big = DataLoader(make_data(1000), batch_size=BATCH)
    got = trainer("mgpu_ddp_notebook").predict(WidePredictor().double(), big)
    expected = trainer("auto", devices=1).predict(WidePredictor().double(), big)
    assert sum(b.numel() * b.element_size() for b in expected) > 2**20
    torch.testing.assert_close(got, expected)
