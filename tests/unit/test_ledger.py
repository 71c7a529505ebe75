"""ledger.py: the ledger's inputs, bucket rounds, its logging cadence, and its split of the traffic per group."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu._compat import attached_trainer
from lightning_mgpu.ledger import CommStats, Ledger
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


def test_the_ledger_splits_hybrid_sharding_traffic_by_group_each_against_its_lower_bound():
    """2 replicas x 4 shards, 1000 gradient bytes, 3 steps: each step one reduce-scatter of the gradient within
    the shard group, (s - 1) / s x 1000 = 750 B, plus norm clipping's 8-byte all-reduce there, 2 (s - 1) / s x 8 =
    12 B; across replicas an all-reduce of the 250-byte shard, 2 (r - 1) / r x 250 = 250 B."""
    stats = CommStats(gradient_bytes=1000, world_size=8, replicas=2)
    for _ in range(3):
        stats.record_round([600, 400])
        stats.record(1, 8)
        stats.optimizer_steps += 1
    groups = stats.per_group()
    assert stats.shard_size == 4
    assert (groups["shard_bytes_per_step"], groups["shard_lower_bound_bytes"]) == (762.0, 750.0)
    assert (groups["replica_bytes_per_step"], groups["replica_lower_bound_bytes"]) == (250.0, 250.0)
    assert groups["replica_ratio_to_lower_bound"] == 1.0
    assert "comm/replica_bytes_per_step" in stats.as_metrics()
    assert "across replicas 250 B/step" in stats.summary()
    # a sync on every micro-batch shows in both groups
    stats.record_round([600, 400])
    assert stats.per_group()["replica_ratio_to_lower_bound"] == pytest.approx(4 / 3)
    flat = CommStats(gradient_bytes=1000, world_size=8)
    assert "comm/replica_bytes_per_step" not in flat.as_metrics() and "replicas" not in flat.summary()


def test_the_summary_of_a_pipelined_run_gives_the_bytes_between_stages_not_the_whole_models_ring_bound():
    stats = CommStats(gradient_bytes=1000, world_size=4)
    for _ in range(2):
        stats.record_round([300])
        stats.record_stage_sends(8, 256)
        stats.optimizer_steps += 1
    text = stats.summary()
    assert "pipeline: 8.00 sends/step between stages, 256 B/step" in text and "lower bound" not in text
    assert "lower bound 2(N-1)/N x 1000 B" in CommStats(gradient_bytes=1000, world_size=4).summary()
