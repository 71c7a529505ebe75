"""parts/worker_results.py without a launch: what rank 0's worker hands back reaches the main process's objects."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch

from lightning_mgpu.ledger import CommStats
from lightning_mgpu.parts.worker_results import WorkerResults


@dataclasses.dataclass(frozen=True)
class Decision:
    strategy: str
    stage: int


class History:
    """A callback (or part) that hands its state back, as ``DeviceMonitor`` does."""

    def __init__(self, state: Any = None) -> None:
        self.state = state

    def results_for_main_process(self) -> Any:
        return self.state

    def restore_results_from_worker(self, state: Any) -> None:
        self.state = state


class Other(History):
    """Another kind of callback at the same place in the main process's list."""


def test_the_workers_ledger_decision_callbacks_and_parts_reach_the_main_process():
    module = torch.nn.Linear(2, 1)
    worker_stats, main_stats = CommStats(), CommStats()
    worker_stats.allreduce_calls, worker_stats.world_size = 7, 2
    worker_part, main_part = History({"step": 3}), History()
    worker = WorkerResults(
        SimpleNamespace(auto_decision=Decision("mgpu_zero3", 3), lightning_module=module),
        worker_stats,
        lambda state: {**state, "masters": "put in"},
        hand_back=[worker_part],
    )
    main_strategy = SimpleNamespace(auto_decision=None, lightning_module=module)
    main = WorkerResults(main_strategy, main_stats, lambda state: state, hand_back=[main_part])
    worker_trainer = SimpleNamespace(callbacks=[object(), History([1.0, 2.0]), History("not this one")])
    main_trainer = SimpleNamespace(callbacks=[object(), History(), Other()])

    main.restore(main_trainer, worker.results(worker_trainer))
    assert (main_stats.allreduce_calls, main_stats.world_size) == (7, 2)  # in place: the parts keep their reference
    assert main_strategy.auto_decision == Decision("mgpu_zero3", 3)
    assert main_trainer.callbacks[1].state == [1.0, 2.0]
    assert main_trainer.callbacks[2].state is None  # negative control: another kind of callback there takes nothing
    assert main_part.state == {"step": 3}
    weights = worker.weights()
    assert weights["masters"] == "put in" and torch.equal(weights["weight"], module.weight)
