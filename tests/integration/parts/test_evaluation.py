"""``exact_evaluation``: validate, test and predict on 2 ranks see every sample once and log the one-process epoch
values, under every strategy family; an evaluation whose ranks run different numbers of batches does not hang under
the sharded stages. Negative controls: Lightning's padded sampler (``exact_evaluation=False``) logs another value,
and ZeRO-3 with uneven batch counts and the option off waits until the group's timeout."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import pytorch_lightning as pl
import torch
import torchmetrics
from pytorch_lightning.callbacks import BasePredictionWriter
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import (
    MGPUAutoStrategy,
    MGPUDDPStrategy,
    MGPUDiLoCoStrategy,
    MGPULocalSGDStrategy,
    MGPUShardedStrategy,
    comm,
)
from tests.models import Regressor, make_data
from tests.numerics_harness import run_jobs

N = 37  # divides neither by the world size (2) nor by any batch size used
VAL_BATCH, TEST_BATCH, PREDICT_BATCH = 4, 1, 5  # test: 19 and 18 batches (equal counts impossible)


def indexed(n: int = N) -> TensorDataset:
    x, y = make_data(n=n).tensors
    return TensorDataset(x, y, torch.arange(n))


class EvalRegressor(Regressor):
    """Logs the batch MSE (``sync_dist=True``) and a torchmetrics ``MeanSquaredError``; records the indices seen."""

    def __init__(self) -> None:
        super().__init__(lr=0.0)  # training leaves the weights as they are: every rank evaluates the same model
        self.register_buffer("offset", torch.full((3,), 0.25))  # fairscale's SDP broadcasts buffers every forward
        self.val_metric = torchmetrics.MeanSquaredError()
        self.test_metric = torchmetrics.MeanSquaredError()
        self.val_metric.set_dtype(torch.float64)
        self.test_metric.set_dtype(torch.float64)
        self.seen: dict[str, list[int]] = {"val": [], "test": [], "predict": []}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) + self.offset

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        return F.mse_loss(self(x), y)

    def _evaluate(self, batch: Any, stage: str, metric: torchmetrics.Metric) -> None:
        x, y, idx = batch
        pred = self(x)
        self.log(f"{stage}_mse", F.mse_loss(pred, y), sync_dist=True)
        metric(pred, y)
        self.log(f"{stage}_tm", metric)
        self.seen[stage].extend(idx.tolist())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_metric)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_metric)

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        x, _, idx = batch
        self.seen["predict"].extend(idx.tolist())
        return self(x)


class IndexWriter(BasePredictionWriter):
    """Keeps the indices Lightning hands to prediction writers with each batch."""

    def __init__(self) -> None:
        super().__init__("batch")
        self.indices: list[int] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):  # type: ignore[no-untyped-def]
        self.indices.extend(batch_indices)


def trainer_kwargs(**extra: Any) -> dict[str, Any]:
    return {
        "accelerator": "cpu",
        "devices": 2,
        "max_epochs": 1,
        "limit_train_batches": 2,
        "num_sanity_val_steps": 0,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        **extra,
    }


def _metrics(trainer: pl.Trainer) -> dict[str, float]:
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def every_stage(make_strategy: Callable[[], Any]) -> Callable[[Path], None]:
    """fit (with validation), then validate, test and predict on the fitted (for ZeRO-3: sharded) model."""

    def job(path: Path) -> None:
        model = EvalRegressor().double()
        writer = IndexWriter()
        trainer = pl.Trainer(strategy=make_strategy(), callbacks=[writer], **trainer_kwargs())
        data = indexed()
        trainer.fit(model, DataLoader(indexed(16), batch_size=4), DataLoader(data, batch_size=VAL_BATCH))
        record: dict[str, Any] = {"fit": _metrics(trainer), "fit_seen": list(model.seen["val"])}
        model.seen = {"val": [], "test": [], "predict": []}
        trainer.validate(model, DataLoader(data, batch_size=VAL_BATCH), verbose=False)
        record["validate"] = _metrics(trainer)
        trainer.test(model, DataLoader(data, batch_size=TEST_BATCH), verbose=False)
        record["test"] = _metrics(trainer)
        predictions = trainer.predict(model, DataLoader(data, batch_size=PREDICT_BATCH))
        record["predictions"] = torch.cat(predictions)  # type: ignore[arg-type]
        record["batch_indices"] = writer.indices
        record["seen"] = model.seen
        record["weights"] = torch.zeros(1)  # the ranks' weights are not what these runs compare
        torch.save(record, path)

    return job


FAMILIES: dict[str, Callable[..., Any]] = {
    "ddp": lambda **kw: MGPUDDPStrategy(start_method="popen", **kw),
    "zero1": lambda **kw: MGPUShardedStrategy(stage=1, start_method="popen", **kw),
    "zero2": lambda **kw: MGPUShardedStrategy(stage=2, start_method="popen", **kw),
    "zero2_fairscale": lambda **kw: MGPUShardedStrategy(stage=2, backend="fairscale", start_method="popen", **kw),
    "zero3": lambda **kw: MGPUShardedStrategy(stage=3, start_method="popen", **kw),
    "local_sgd": lambda **kw: MGPULocalSGDStrategy(start_method="popen", **kw),
    "diloco": lambda **kw: MGPUDiLoCoStrategy(start_method="popen", **kw),
    "auto": lambda **kw: MGPUAutoStrategy(start_method="popen", **kw),
}


def one_process_mse() -> float:
    """The value one process logs: the MSE over the whole set (each batch weighted by its size)."""
    x, y, _ = indexed().tensors
    with torch.no_grad():
        return float(F.mse_loss(EvalRegressor().double()(x), y))


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    jobs = [every_stage(make) for make in FAMILIES.values()]
    jobs.append(every_stage(lambda: FAMILIES["ddp"](exact_evaluation=False)))  # negative control
    jobs.append(every_stage(lambda: FAMILIES["zero3"](exact_evaluation=False)))  # negative control
    return run_jobs(jobs, agree=False)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(FAMILIES)), ids=list(FAMILIES))
def test_logged_epoch_values_equal_one_process(index, runs):
    expected = one_process_mse()
    r0, r1 = runs[index]["ranks"]
    for record in (r0, r1):
        for stage, key in (("fit", "val"), ("validate", "val"), ("test", "test")):
            torch.testing.assert_close(record[stage][f"{key}_mse"], expected)  # scalar, sync_dist=True
            torch.testing.assert_close(record[stage][f"{key}_tm"], expected)  # torchmetrics object


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(FAMILIES)), ids=list(FAMILIES))
def test_every_sample_is_evaluated_exactly_once(index, runs):
    r0, r1 = runs[index]["ranks"]
    assert sorted(r0["fit_seen"] + r1["fit_seen"]) == list(range(N))
    for stage in ("val", "test", "predict"):
        assert sorted(r0["seen"][stage] + r1["seen"][stage]) == list(range(N)), stage
    # predictions: each rank's batches are the indices Lightning recorded for them, and trainer.predict returns
    # every rank's rows gathered in dataset order (parts/predictions.py): the whole set, as one process predicts it
    x, _, _ = indexed().tensors
    with torch.no_grad():
        full = EvalRegressor().double()(x)
    for record in (r0, r1):
        assert record["batch_indices"] == record["seen"]["predict"]
        torch.testing.assert_close(record["predictions"], full)


@pytest.mark.timeout(600)
def test_padded_sampler_counts_the_repeats_negative_control(runs):
    """Lightning's DistributedSampler pads 37 samples to 38: the repeated sample is counted in the epoch value."""
    expected = one_process_mse()
    for record in (*runs[-2]["ranks"], *runs[-1]["ranks"]):
        assert len(record["fit_seen"]) in (19,)  # each rank: ceil(37 / 2), one sample twice in all
        with pytest.raises(AssertionError):
            torch.testing.assert_close(record["validate"]["val_mse"], expected)
    r0, r1 = runs[-2]["ranks"]
    assert len(r0["seen"]["val"]) + len(r1["seen"]["val"]) == N + 1


# --- evaluation with uneven batch counts (a sampler of the user's): no hang under the sharded stages -------------


class RankSubsetData(pl.LightningDataModule):
    """Validation: rank 0 gets 3 batches of 4, rank 1 two (``use_distributed_sampler=False``)."""

    def __init__(self) -> None:
        super().__init__()
        self.data = indexed(20)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=4)

    def val_dataloader(self) -> DataLoader:
        rank = torch.distributed.get_rank()
        part = torch.utils.data.Subset(self.data, range(12) if rank == 0 else range(12, 20))
        return DataLoader(part, batch_size=4)


def uneven_validation(make_strategy: Callable[[], Any]) -> Callable[[Path], None]:
    def job(path: Path) -> None:
        model = EvalRegressor().double()
        trainer = pl.Trainer(strategy=make_strategy(), **trainer_kwargs(use_distributed_sampler=False))
        trainer.fit(model, datamodule=RankSubsetData())
        record: dict[str, Any] = {"fit": _metrics(trainer)}
        trainer.validate(model, datamodule=RankSubsetData(), verbose=False)
        record["validate"] = _metrics(trainer)
        record["weights"] = torch.zeros(1)
        torch.save(record, path)

    return job


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["zero2", "zero3", "zero2_fairscale", "ddp"])
def test_uneven_validation_batch_counts_do_not_hang(family):
    runs = run_jobs([uneven_validation(lambda: FAMILIES[family]())], agree=False, timeout=60)
    x, y, _ = indexed(20).tensors
    with torch.no_grad():
        expected = float(F.mse_loss(EvalRegressor().double()(x), y))
    for record in runs[0]["ranks"]:
        torch.testing.assert_close(record["fit"]["val_mse"], expected)  # the shards are disjoint: exact as well
        torch.testing.assert_close(record["validate"]["val_mse"], expected)


@pytest.mark.slow  # its evidence is a wait: the group's timeout, twice
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("family", "waits_in"), [("zero3", "foreach_all_gather"), ("zero2_fairscale", "sync_buffers")])
def test_uneven_validation_hangs_without_it_negative_control(family, waits_in):
    """Lightning's behaviour: the rank with the third batch waits in its forward's collective (FSDP2's parameter
    all-gather, ShardedDataParallel's buffer broadcast) until the group's timeout (5 s here instead of 30 minutes)
    ends the other rank and with it the wait."""
    with pytest.raises(AssertionError, match=rf"(?s)validation_step.*{waits_in}"):
        run_jobs([uneven_validation(lambda: FAMILIES[family](exact_evaluation=False))], agree=False, timeout=5)


# --- the mean of the summed batch sizes: Lightning's integer division truncates it ---------------------------------


def summed_batch_sizes(path: Path) -> None:
    rank = torch.distributed.get_rank()
    sizes = torch.tensor(19 if rank == 0 else 18)  # what _ResultMetric accumulates for 37 samples on 2 ranks
    exact = comm.lightning_reduce(sizes.clone(), reduce_op="mean", exact_mean=True)
    lightning = comm.lightning_reduce(sizes.clone(), reduce_op="mean")
    torch.save({"exact": exact, "lightning": lightning, "weights": torch.zeros(1)}, path)


@pytest.mark.timeout(300)
def test_the_mean_of_integer_batch_sizes_is_not_truncated():
    for record in run_jobs([summed_batch_sizes], agree=False)[0]["ranks"]:
        torch.testing.assert_close(record["exact"], torch.tensor(18.5))  # float32: exact, and Lightning's dtype
        assert int(record["lightning"]) == 18  # negative control: Lightning's in-place integer mean


class InOrder(torch.utils.data.Sampler[int]):
    """A sampler of the user's own (Lightning wraps it in its padding ``DistributedSamplerWrapper``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


def _warnings_of_evaluation(exact: bool, own_sampler: bool) -> Callable[[Path], None]:
    """validate and test on 2 ranks; records the warnings rank 0 raised (Lightning warns on rank 0 only)."""

    def job(path: Path) -> None:
        import warnings

        model = EvalRegressor().double()
        trainer = pl.Trainer(strategy=FAMILIES["ddp"](exact_evaluation=exact), **trainer_kwargs())
        data = indexed()
        sampler = InOrder(len(data)) if own_sampler else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.validate(model, DataLoader(data, batch_size=VAL_BATCH, sampler=sampler), verbose=False)
            trainer.test(model, DataLoader(data, batch_size=TEST_BATCH, sampler=sampler), verbose=False)
        torch.save({"warnings": [str(w.message) for w in caught], "weights": torch.zeros(1)}, path)

    return job


def test_no_padding_warning_where_nothing_is_padded():
    """Lightning warns that its DistributedSampler "replicates some samples" for validate and test on several
    devices; exact evaluation replaces that sampler, so the warning would be wrong. It stays for Lightning's own
    sampler (negative control), and a loader that keeps a padded sampler gets the pack's own warning."""
    exact, lightnings, own = run_jobs(
        [
            _warnings_of_evaluation(exact=True, own_sampler=False),
            _warnings_of_evaluation(exact=False, own_sampler=False),
            _warnings_of_evaluation(exact=True, own_sampler=True),
        ],
        agree=False,
    )
    assert not [w for w in exact["warnings"] if "DistributedSampler" in w], exact["warnings"]
    assert sum("replicates some samples" in w for w in lightnings["warnings"]) == 2, lightnings["warnings"]
    ours = [w for w in own["warnings"] if "keeps Lightning's `DistributedSampler`" in w]
    assert len(ours) == 2 and "repeats 1 sample(s)" in ours[0], own["warnings"]
    assert not [w for w in own["warnings"] if "replicates some samples" in w]


def _logged_dtypes(path: Path) -> None:
    model = EvalRegressor()  # float32, as most users' modules
    trainer = pl.Trainer(strategy=FAMILIES["ddp"](), **trainer_kwargs())
    x, y, idx = indexed().tensors
    data = TensorDataset(x.float(), y.float(), idx)
    trainer.validate(model, DataLoader(data, batch_size=VAL_BATCH), verbose=False)
    dtypes = {k: v.dtype for k, v in trainer.callback_metrics.items()}
    torch.save({"dtypes": dtypes, "value": trainer.callback_metrics["val_mse"], "weights": torch.zeros(1)}, path)


def test_values_logged_with_sync_dist_keep_lightnings_dtype():
    """``self.log(..., sync_dist=True)`` of a float32 value: float32 under plain Lightning and here (the exact mean
    of the batch sizes no longer promotes it to float64), with the one-process value."""
    record = run_jobs([_logged_dtypes], agree=False)[0]
    assert record["dtypes"]["val_mse"] == torch.float32, record["dtypes"]
    x, y, _ = indexed().tensors
    with torch.no_grad():
        expected = F.mse_loss(EvalRegressor()(x.float()), y.float())
    torch.testing.assert_close(record["value"], expected)
