"""``check_uneven_inputs``: ranks with different numbers of training batches raise the same error on every rank
before the first step that cannot complete, under every strategy family, instead of hanging; even inputs train as
before. Negative control: with the check off, the rank with more batches waits in its step's collective."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, IterableDataset, Subset

from lightning_mgpu import MGPUDDPStrategy, MGPUDiLoCoStrategy, MGPULocalSGDStrategy, MGPUShardedStrategy
from lightning_mgpu.parts.uneven_inputs import UnevenInputsError
from tests.models import Regressor, make_data
from tests.numerics_harness import run_jobs

FAMILIES: dict[str, Callable[..., Any]] = {
    "ddp": lambda **kw: MGPUDDPStrategy(start_method="popen", **kw),
    "zero1": lambda **kw: MGPUShardedStrategy(stage=1, start_method="popen", **kw),
    "zero2": lambda **kw: MGPUShardedStrategy(stage=2, start_method="popen", **kw),
    "zero2_fairscale": lambda **kw: MGPUShardedStrategy(stage=2, backend="fairscale", start_method="popen", **kw),
    "zero3": lambda **kw: MGPUShardedStrategy(stage=3, start_method="popen", **kw),
    "local_sgd": lambda **kw: MGPULocalSGDStrategy(start_method="popen", sync_every=1, **kw),
    "diloco": lambda **kw: MGPUDiLoCoStrategy(start_method="popen", sync_every=1, **kw),
}


class RankStream(IterableDataset):
    """An iterable dataset sharded by rank: ``batches[rank]`` batches of 4 samples on each rank."""

    def __init__(self, batches: tuple[int, int]) -> None:
        self.batches = batches
        self.data = make_data(n=4 * max(batches))

    def __iter__(self) -> Iterator[Any]:
        rank = torch.distributed.get_rank()
        for i in range(4 * self.batches[rank]):
            yield self.data[i]


def loader(kind: str, batches: tuple[int, int]) -> DataLoader:
    if kind == "iterable":
        return DataLoader(RankStream(batches), batch_size=4)
    rank = torch.distributed.get_rank()
    return DataLoader(Subset(make_data(n=4 * batches[rank]), range(4 * batches[rank])), batch_size=4)  # sized


def training(
    make_strategy: Callable[[], Any], kind: str, batches: tuple[int, int], **extra: Any
) -> Callable[[Path], None]:
    def job(path: Path) -> None:
        trainer = pl.Trainer(
            **extra,
            strategy=make_strategy(),
            accelerator="cpu",
            devices=2,
            max_epochs=2,
            use_distributed_sampler=False,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        record: dict[str, Any] = {"weights": torch.zeros(1)}
        try:
            trainer.fit(Regressor().double(), loader(kind, batches))
        except UnevenInputsError as err:
            record["error"] = str(err)
        record["global_step"] = trainer.global_step
        torch.save(record, path)

    return job


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, Any]]]:
    cases = {f"{family}-{kind}": (family, kind) for family in FAMILIES for kind in ("sized", "iterable")}
    jobs = [training(lambda f=family: FAMILIES[f](), kind, (3, 2)) for family, kind in cases.values()]
    jobs += [training(lambda: FAMILIES["ddp"](), kind, (3, 3)) for kind in ("sized", "iterable")]
    # uneven, but the epoch uses only the batches every rank has (Lightning fetches one more, never used)
    jobs += [training(lambda: FAMILIES["ddp"](), kind, (3, 2), limit_train_batches=2) for kind in ("sized", "iterable")]
    jobs += [training(lambda: FAMILIES["ddp"](), kind, (3, 2), max_steps=2) for kind in ("sized", "iterable")]
    records = run_jobs(jobs, agree=False, timeout=60)
    n = len(cases)
    return {"uneven": records[:n], "even": records[n : n + 2], "bounded": records[n + 2 :]}


CASES = [f"{family}-{kind}" for family in FAMILIES for kind in ("sized", "iterable")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(CASES)), ids=CASES)
def test_uneven_inputs_raise_on_every_rank_before_the_step_that_would_hang(index, runs):
    r0, r1 = runs["uneven"][index]["ranks"]
    assert "error" in r0 and "error" in r1
    assert r0["error"] == r1["error"]
    if CASES[index].endswith("sized"):  # compared before the epoch's first step
        assert r0["global_step"] == r1["global_step"] == 0
        assert "Epoch 0 has 3 training batches on rank 0 and 2 on rank 1" in r0["error"]
    else:  # agreed at each fetch: rank 1 has no third batch; Lightning fetches it while the second step is due
        assert r0["global_step"] == r1["global_step"] == 1
        assert "Rank 1 ran out of training data after 2 batches" in r0["error"]
    assert "limit_train_batches" in r0["error"]  # the fix


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(2), ids=["sized", "iterable"])
def test_even_inputs_train_every_batch(index, runs):
    r0, r1 = runs["even"][index]["ranks"]
    assert "error" not in r0 and "error" not in r1
    assert r0["global_step"] == r1["global_step"] == 6  # 2 epochs of 3 steps: the epochs end together


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("index", "steps"),
    [(0, 4), (1, 4), (2, 2), (3, 2)],
    ids=["limit-sized", "limit-iterable", "max_steps-sized", "max_steps-iterable"],
)
def test_uneven_inputs_past_what_the_epoch_uses_train(index, steps, runs):
    """limit_train_batches=2 (2 epochs) or max_steps=2 with 3 and 2 batches: every step completes in plain Lightning
    too, so nothing is raised."""
    r0, r1 = runs["bounded"][index]["ranks"]
    assert "error" not in r0 and "error" not in r1
    assert r0["global_step"] == r1["global_step"] == steps


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_without_the_check_the_longer_rank_waits_negative_control():
    """Lightning's behaviour: rank 0's third step waits in DDP's gradient all-reduce for rank 1, which has left
    the epoch (until the group's timeout, 10 s here, ends the wait). In the slow tier: the wait is the test."""
    with pytest.raises(AssertionError, match=r"(?s)job 0:.*loss.backward.*run_backward"):  # rank 0, in its step
        run_jobs([training(lambda: FAMILIES["ddp"](check_uneven_inputs=False), "iterable", (3, 2))], timeout=10)
