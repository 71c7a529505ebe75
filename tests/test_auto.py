"""``strategy="mgpu_auto"`` end to end on 2 gloo ranks: it resolves at set-up to the fastest candidate the memory
plan fits, every rank takes the same one, and it trains to the weights of one process with the whole batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from torch import nn

from lightning_mgpu import PRESETS, MGPUAutoStrategy, plan
from lightning_mgpu.planning import PlanError
from tests.helpers import WORLD, Regressor, fit, make_data, reference_weights

B = 48  # rows per rank: the global batch is the whole dataset (96 rows), one step per epoch
EPOCHS = 2


class Block(nn.Sequential):
    def __init__(self, width: int) -> None:
        super().__init__(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh())


class Deep(Regressor):
    """Residual-free blocks whose activations dominate: checkpointing them lowers the peak."""

    def __init__(self, blocks: int = 4, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, width), *(Block(width) for _ in range(blocks)), nn.Linear(width, 3))


class Chosen(Callback):
    """Per rank: the class the strategy became and the decision it carries."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        s = trainer.strategy
        d = s.auto_decision
        record = {
            "class": type(s).__name__,
            "stage": getattr(s, "stage", None),
            "checkpointing": s.activation_checkpointing is not None,
            "decision": (d.strategy, d.activation_checkpointing),
            "reason": d.reason,
        }
        torch.save(record, self.out_dir / f"chosen{trainer.global_rank}.pt")


def _rows() -> dict[tuple[str, bool], int]:
    batch = tuple(t[:B] for t in make_data().tensors)
    p = plan(Deep().double(), devices=WORLD, device_memory="1TiB", batch=batch, precisions=("32-true",))
    return {(r.strategy, r.activation_checkpointing): r.predicted_peak_bytes_per_rank for r in p.rows}


def _fit_auto(tmp_path: Path, **auto: Any) -> tuple[list[dict[str, Any]], torch.Tensor]:
    model = Deep().double()
    expected = reference_weights(model, make_data(), global_batch=WORLD * B, epochs=EPOCHS)
    strategy = MGPUAutoStrategy(start_method="fork", headroom=0.0, **auto)
    ranks = fit(model, strategy, tmp_path, batch_size=B, max_epochs=EPOCHS, callbacks=[Chosen(tmp_path)])
    for r, record in enumerate(ranks):
        record.update(torch.load(tmp_path / f"chosen{r}.pt", weights_only=False))
    return ranks, expected


def _between(low: int, high: int) -> int:
    assert low < high, "the plan does not separate these candidates: the test would prove nothing"
    return (low + high) // 2


@pytest.mark.slow
@pytest.mark.parametrize(
    ("memory", "strategies", "expected"),
    [
        (lambda rows: 2**40, None, ("MGPUDDPStrategy", None, "mgpu_ddp", False)),
        (
            lambda rows: _between(rows["mgpu_zero1", False], rows["mgpu_ddp", False]),
            None,
            ("MGPUZeRO1Strategy", 1, "mgpu_zero1", False),
        ),
        (
            lambda rows: _between(rows["mgpu_sharded", False], rows["mgpu_ddp", False]),
            ("mgpu_ddp", "mgpu_sharded"),
            ("MGPUFSDPStrategy", 2, "mgpu_sharded", False),
        ),
        (
            lambda rows: _between(rows["mgpu_ddp", True], min(v for (_, ac), v in rows.items() if not ac)),
            None,
            ("MGPUDDPStrategy", None, "mgpu_ddp", True),
        ),
    ],
    ids=["big_memory_ddp", "tight_zero1", "tight_fsdp2", "tighter_checkpointing"],
)
def test_mgpu_auto_takes_the_fastest_candidate_that_fits_and_trains_it(tmp_path, memory, strategies, expected):
    cls, stage, name, checkpointing = expected
    ranks, reference = _fit_auto(tmp_path, device_memory=memory(_rows()), strategies=strategies)
    for r in ranks:
        assert (r["class"], r["stage"], r["decision"]) == (cls, stage, (name, checkpointing))
        assert r["checkpointing"] is checkpointing
        assert f"mgpu_auto chose {name}" in r["reason"]
        torch.testing.assert_close(r["weights"], reference)
    if name != "mgpu_ddp" or checkpointing:
        assert "Faster candidates that do not fit: mgpu_ddp needs" in ranks[0]["reason"]


@pytest.mark.slow
def test_mgpu_auto_refuses_a_device_memory_that_fits_nothing_naming_the_smallest_plan(tmp_path):
    with pytest.raises(Exception, match=r"mgpu_auto: no candidate fits .* The smallest plan, .* misses by"):
        _fit_auto(tmp_path, device_memory="64KiB")


def test_mgpu_auto_presets_and_bad_arguments():
    names = {p.name: p for p in PRESETS}
    for name, start in (("mgpu_auto", "popen"), ("mgpu_auto_spawn", "spawn"), ("mgpu_auto_notebook", "fork")):
        assert names[name].strategy is MGPUAutoStrategy and names[name].launch == start
    with pytest.raises(PlanError, match="device_memory='lots'"):
        MGPUAutoStrategy(device_memory="lots")
    with pytest.raises(ValueError, match="choose from"):
        MGPUAutoStrategy(strategies=("mgpu_fast",))
    with pytest.raises(ValueError, match="micro_batch_size=4 works with mgpu_ddp and mgpu_zero1 only"):
        MGPUAutoStrategy(strategies=("mgpu_zero3",), micro_batch_size=4)
