"""comm.py: the ledger's inputs, bucket rounds and its logging cadence."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu.comm import Ledger, attached_trainer
from tests.parts_harness import in_one_rank_group


class _Logger:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        assert "comm/optimizer_steps" in metrics
        self.steps.append(step)


class _Module(nn.Linear):
    def __init__(self, trainer: Any) -> None:
        super().__init__(2, 2)
        self._attached = trainer

    @property
    def trainer(self) -> Any:
        return self._attached


def test_start_reads_the_trainable_gradient_bytes_and_the_world_size():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model[1].requires_grad_(False)
    ledger = Ledger()
    ledger.start(model, world_size=4)
    assert (ledger.stats.world_size, ledger.stats.gradient_bytes) == (4, (16 + 4) * 4)


def test_metrics_are_logged_every_log_every_n_steps_on_rank_zero_only():
    logger = _Logger()
    trainer = SimpleNamespace(loggers=[logger], log_every_n_steps=2, global_step=0)
    module = _Module(trainer)
    ledger = Ledger(log=True)
    for step in range(1, 5):
        trainer.global_step = step
        ledger.optimizer_stepped(module, is_global_zero=True)
    ledger.optimizer_stepped(module, is_global_zero=False)
    assert logger.steps == [2, 4]


def test_nothing_is_logged_when_logging_is_off_or_no_trainer_is_attached():
    logger = _Logger()
    module = _Module(SimpleNamespace(loggers=[logger], log_every_n_steps=1, global_step=1))
    Ledger(log=False).optimizer_stepped(module, is_global_zero=True)
    Ledger(log=True).optimizer_stepped(nn.Linear(1, 1), is_global_zero=True)  # a plain module: no trainer
    assert logger.steps == []
    assert attached_trainer(None) is None


def _a_synchronised_backward_records_one_round_of_the_bucket_bytes() -> None:
    ddp = DistributedDataParallel(nn.Linear(3, 2), gradient_as_bucket_view=True)
    ddp(torch.ones(1, 3)).sum().backward()
    ledger = Ledger()
    ledger.record_buckets(ddp)
    assert (ledger.stats.sync_rounds, ledger.stats.allreduce_calls) == (1, 1)  # one bucket
    assert ledger.stats.allreduce_bytes == (3 * 2 + 2) * 4


def test_a_synchronised_backward_records_one_round_of_the_bucket_bytes():
    in_one_rank_group(_a_synchronised_backward_records_one_round_of_the_bucket_bytes)
