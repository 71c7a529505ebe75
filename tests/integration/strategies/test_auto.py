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

from lightning_mgpu import PRESETS, MGPUAutoStrategy, plan, plan_layouts
from lightning_mgpu.planning import PlanError
from tests.helpers import (
    NODES,
    PER_NODE,
    WORLD,
    RankData,
    Regressor,
    fit,
    full,
    make_data,
    reference_weights,
    run_on_two_machines,
)
from tests.models import ManualRegressor

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


class Stack(Regressor):
    """Wide blocks in an ``nn.ModuleList``: FSDP2 makes a unit of each, so what a rank gathers to compute is one or
    two blocks, and the states offload moves to the host outweigh it (and what a split of the model saves)."""

    def __init__(self, blocks: int = 8, width: int = 256) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(6, width), nn.Linear(width, 3)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


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
            "offload": s.settings.offload if type(s).__name__ == "MGPUShardedStrategy" else None,
            "reason": d.reason,
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(record, self.out_dir / f"chosen{trainer.global_rank}.pt")


def _rows(rows: int = B) -> dict[tuple[str, bool], int]:
    batch = tuple(t[:rows] for t in make_data().tensors)
    p = plan(Deep().double(), devices=WORLD, device_memory="1TiB", batch=batch, precisions=("32-true",))
    return {(r.strategy, r.activation_checkpointing): r.predicted_peak_bytes_per_rank for r in p.rows}


def _fit_auto(tmp_path: Path, module: type = Deep, **auto: Any) -> tuple[list[dict[str, Any]], torch.Tensor]:
    model = module().double()
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
            ("MGPUShardedStrategy", 1, "mgpu_zero1", False),
        ),
        (
            lambda rows: _between(rows["mgpu_sharded", False], rows["mgpu_ddp", False]),
            ("mgpu_ddp", "mgpu_sharded"),
            ("MGPUShardedStrategy", 2, "mgpu_sharded", False),
        ),
        (
            lambda rows: _between(rows["mgpu_ddp", True], rows["mgpu_ddp", False]),
            ("mgpu_ddp",),
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
        assert "Faster candidates that do not fit: mgpu_ddp 2 (32-true) needs" in ranks[0]["reason"]


@pytest.mark.slow
def test_mgpu_auto_offloads_only_where_nothing_fits_on_the_device_and_trains_the_same_weights(tmp_path):
    """A device memory below every layout's peak (a split of the model included) and above the offloaded sharded
    candidates': ``mgpu_auto`` takes the first offloaded candidate of the plan's order, builds it with
    ``offload="cpu"``, says why, and trains to the weights of one process (:class:`Stack`: offload beats every
    split of it). The other cases here, with more memory, are the control: nothing is offloaded there."""
    batch = tuple(t[:B] for t in make_data().tensors)
    model = Stack().double()
    layouts = plan_layouts(model, devices=WORLD, device_memory="1TiB", batch=batch, precisions=("32-true",))
    on_device = min(x.predicted_peak_bytes_per_rank for x in layouts.layouts if x.buildable)
    offloaded = plan(model, devices=WORLD, device_memory="1TiB", batch=batch, precisions=("32-true",), offload=True)
    candidates = [r for r in offloaded.rows if r.host_bytes]  # in the plan's order
    memory = _between(min(r.predicted_peak_bytes_per_rank for r in candidates), on_device)
    first = next(r for r in candidates if r.predicted_peak_bytes_per_rank <= memory)
    ranks, reference = _fit_auto(tmp_path, Stack, device_memory=memory)
    stage = {"mgpu_sharded": 2, "mgpu_zero3": 3}[first.strategy]
    for r in ranks:
        assert (r["class"], r["stage"], r["offload"]) == ("MGPUShardedStrategy", stage, "cpu"), r
        assert r["decision"] == (first.strategy, first.activation_checkpointing)
        assert "Offloaded to host memory (offload='cpu'): no candidate fits on the device without it" in r["reason"]
        torch.testing.assert_close(r["weights"], reference)


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


@pytest.mark.slow
def test_mgpu_auto_gives_manual_optimization_mgpu_ddp_without_a_plan(tmp_path):
    strategy = MGPUAutoStrategy(start_method="fork", device_memory="64KiB")  # would fit nothing if it planned
    fit(ManualRegressor().double(), strategy, tmp_path, max_epochs=1, callbacks=[Chosen(tmp_path)])
    for r in range(WORLD):
        record = torch.load(tmp_path / f"chosen{r}.pt", weights_only=False)
        assert (record["class"], record["decision"]) == ("MGPUDDPStrategy", ("mgpu_ddp", False))
        assert "manual optimization" in record["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("tight", [False, True], ids=["ddp", "zero1"])
def test_mgpu_auto_resumes_from_its_checkpoint_as_the_uninterrupted_run(tmp_path, tight):
    """The checkpoint is restored after set-up (where mgpu_auto has chosen): resuming at epoch 1 of 2 ends with
    the weights of the run that was never stopped."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    peaks = _rows(B // 2)
    memory = _between(peaks["mgpu_zero1", False], peaks["mgpu_ddp", False]) if tight else 2**40

    def run(out: Path, epochs: int, ckpt: Any = None, save: bool = False) -> list[dict[str, Any]]:
        callbacks: list[Callback] = [Chosen(out)]
        if save:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0))
        strategy = MGPUAutoStrategy(start_method="fork", headroom=0.0, device_memory=memory)
        return fit(
            Deep().double(), strategy, out, batch_size=B // 2, max_epochs=epochs, callbacks=callbacks,
            ckpt_path=ckpt, enable_checkpointing=save,
        )  # fmt: skip

    whole = run(tmp_path / "whole", EPOCHS)
    run(tmp_path / "first", 1, save=True)
    resumed = run(tmp_path / "resumed", EPOCHS, ckpt=tmp_path / "ckpt" / "last.ckpt")
    chosen = torch.load(tmp_path / "resumed" / "chosen0.pt", weights_only=False)
    assert chosen["decision"] == ("mgpu_zero1" if tight else "mgpu_ddp", False)
    assert resumed[0]["global_step"] == whole[0]["global_step"] == EPOCHS * 2
    assert (len(resumed[0]["batch_spy"]), len(whole[0]["batch_spy"])) == (2, 4)  # it did start at epoch 1
    torch.testing.assert_close(resumed[0]["weights"], whole[0]["weights"])


class _HybridChoice(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        s = trainer.strategy
        weights = torch.cat([full(p.detach()).flatten() for p in pl_module.parameters()])
        record = {
            "decision": s.auto_decision.strategy,
            "mesh_shape": s._sharded.sharding.mesh_shape,
            "weights": weights,
        }
        torch.save(record, self.out / f"rank{trainer.global_rank}.pt")


def _auto_on_two_machines(out: Path) -> None:
    strategy = MGPUAutoStrategy(device_memory="1TiB", strategies=["mgpu_hsdp", "mgpu_zero3"], start_method="fork")
    trainer = pl.Trainer(
        accelerator="cpu", devices=PER_NODE, num_nodes=NODES, strategy=strategy, max_epochs=EPOCHS,
        use_distributed_sampler=False, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[_HybridChoice(out)],
    )  # fmt: skip
    trainer.fit(Regressor().double(), datamodule=RankData(make_data(), len(make_data()) // (NODES * PER_NODE)))


@pytest.mark.timeout(600)
def test_mgpu_auto_plans_hybrid_sharding_on_several_machines_and_trains_it():
    """2 "machines" x 2 ranks: the plan has an mgpu_hsdp row (memory per rank of a 2-rank shard group), it
    comes before mgpu_zero3 in the order, so with room for both mgpu_auto builds the hybrid mesh (2 x 2)."""
    ranks = run_on_two_machines([_auto_on_two_machines])[0]
    expected = reference_weights(Regressor().double(), make_data(), len(make_data()), EPOCHS)
    for r in ranks:
        assert (r["decision"], r["mesh_shape"]) == ("mgpu_hsdp", (2, 2))
        torch.testing.assert_close(r["weights"], expected)


class ReadsTheLoss(Regressor):
    """Reads a value in training_step (``loss.item()``): fake tensors have none, so no plan can trace it."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if loss.item() > 1e6:
            raise RuntimeError("diverged")
        return loss


class BrokenStep(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        raise ValueError("the user's own bug in training_step")


def test_a_module_the_planner_cannot_trace_trains_under_mgpu_auto_as_mgpu_ddp_and_says_why_in_one_line(tmp_path):
    refusal = r"ReadsTheLoss could not be stepped on fake tensors \(DataDependentOutputException"
    with pytest.raises(Exception, match=refusal):  # the planner alone refuses, naming why
        plan(ReadsTheLoss().double(), devices=WORLD, device_memory="1GiB", batch=tuple(make_data().tensors))
    model = ReadsTheLoss().double()
    expected = reference_weights(ReadsTheLoss().double(), make_data(), global_batch=WORLD * B, epochs=1)
    strategy = MGPUAutoStrategy(start_method="fork", device_memory="1GiB")
    ranks = fit(model, strategy, tmp_path, batch_size=B, max_epochs=1, callbacks=[Chosen(tmp_path)])
    for r, rank in enumerate(ranks):
        record = torch.load(tmp_path / f"chosen{r}.pt", weights_only=False)
        assert (record["class"], record["decision"]) == ("MGPUDDPStrategy", ("mgpu_ddp", False))
        assert record["reason"].startswith("mgpu_auto chose mgpu_ddp without a memory plan: ReadsTheLoss could not")
        assert "\n" not in record["reason"]
        torch.testing.assert_close(rank["weights"], expected)
    assert strategy.auto_decision.table == ""  # no plan to print: the one line is all


def test_a_bug_in_training_step_surfaces_under_mgpu_auto_as_under_mgpu_ddp(tmp_path):
    errors = []
    for strategy in ("mgpu_ddp_fork", MGPUAutoStrategy(start_method="fork", device_memory="1GiB")):
        with pytest.raises(Exception) as info:
            fit(BrokenStep().double(), strategy, tmp_path, batch_size=B, max_epochs=1)
        errors.append(info.value)
    last = [str(e).strip().splitlines()[-1] for e in errors]  # the worker's traceback differs in its line numbers
    assert "the user's own bug in training_step" in last[0]
    assert (type(errors[1]), last[1]) == (type(errors[0]), last[0])


def test_mgpu_auto_plans_a_lightning_module_that_keeps_its_datasets_and_plan_agrees(tmp_path):
    """The first-hour module, written with ``import lightning as L``: its datasets and a lock as attributes, its
    own train_dataloader(), self.log in training_step. Planning on rank 0 leaves torch's random generator as it found
    it (it draws a sample batch, and a loader's iterator draws its seed from the generator): at the start of training
    both ranks hold the same random state, as under the strategy chosen run by name, so dropout masks and loader
    workers' seeds do not depend on whether mgpu_auto planned (the negative control is
    tests/unit/strategies/test_auto.py's)."""
    import threading

    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_mgpu.lightning as mgpu_lightning

    class FirstHour(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()
            self.lock = threading.Lock()
            self.train_ds = TensorDataset(*make_data().tensors)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.train_ds, batch_size=B)

    class RandomState(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            torch.save(torch.random.get_rng_state(), tmp_path / f"rng{trainer.global_rank}.pt")

    model = FirstHour()
    strategy = mgpu_lightning.MGPUAutoStrategy(start_method="fork", device_memory="1GiB")
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, callbacks=[RandomState()],
    )  # fmt: skip
    trainer.fit(model)
    assert torch.equal(torch.load(tmp_path / "rng0.pt"), torch.load(tmp_path / "rng1.pt"))
    decision = trainer.strategy.auto_decision
    assert decision.strategy == "mgpu_ddp" and "without a memory plan" not in decision.reason
    assert "FirstHour" in decision.table
    planned = mgpu_lightning.plan(model, devices=WORLD, device_memory="1GiB", precisions=("32-true",))
    assert planned.recommended.predicted_peak_bytes_per_rank == decision.predicted_peak_bytes_per_rank > 0


def test_mgpu_auto_splits_the_model_when_no_data_parallel_candidate_fits_where_the_strategy_builds_it(tmp_path):
    """Device memory between the smallest split layout's peak and the smallest data-parallel one's: mgpu_auto trains
    the fastest split layout MGPUShardedStrategy builds (its stage and sizes passed on), or, where this strategy
    takes no tensor/pipeline option, every rank refuses naming the layout that would fit."""
    from lightning_mgpu import plan_layouts
    from lightning_mgpu.planning.lm import RandomTokens, TransformerLM
    from lightning_mgpu.strategies.auto import layout_arguments

    def model() -> TransformerLM:
        return TransformerLM(vocab=256, d_model=32, heads=4, layers=4)

    def data() -> RandomTokens:
        return RandomTokens(batch_size=4, seq_len=16, vocab=256, samples=64)

    sample = data()
    sample.setup("fit")
    planned = plan_layouts(model, devices=2, device_memory="8GiB", batch=next(iter(sample.train_dataloader())),
                           precisions=("32-true",))  # fmt: skip
    assert planned.memory is not None
    data_parallel = min(r.predicted_peak_bytes_per_rank for r in planned.memory.rows)
    split = [x for x in planned.layouts if x.model_parallel]
    smallest = min(x.predicted_peak_bytes_per_rank for x in split)
    assert smallest < data_parallel
    memory = int((smallest + data_parallel) / 2 / 0.9)  # 10% headroom
    built = [x for x in split if x.predicted_peak_bytes_per_rank <= memory * 0.9 and layout_arguments(x) is not None]
    strategy = MGPUAutoStrategy(device_memory=memory, start_method="fork")
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    assert built, "a split layout the strategy builds fits between the two peaks"
    trainer.fit(model(), data())
    decision = trainer.strategy.auto_decision
    assert decision.tensor_parallel_size * decision.pipeline_parallel_size > 1
    assert decision.strategy_arguments == layout_arguments(built[0])
    assert decision.predicted_peak_bytes_per_rank == built[0].predicted_peak_bytes_per_rank
    assert "No data-parallel candidate fits" in decision.reason and decision.layout == built[0].name
