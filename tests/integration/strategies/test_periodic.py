"""mgpu_local_sgd / mgpu_diloco end to end: 2 CPU ranks (gloo, fork launch), float64.

Exactness where it is defined (H=1 with an SGD inner optimizer equals mgpu_ddp and one process with the whole
batch; H=2 does not), identical weights on every rank after each sync, the bytes counted independently of our
ledger, exact resume mid-period, resume at another world size, and manual optimization refused."""

from __future__ import annotations

import csv
import inspect
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu import DeviceMonitor, MGPUDiLoCoStrategy, MGPULocalSGDStrategy, MGPUPrecision
from lightning_mgpu.settings import DDP_KEYWORDS
from lightning_mgpu.strategies.periodic import CHECKPOINT_KEY
from tests.helpers import WORLD, fit, flat_params, make_data, reference_weights
from tests.models import BlockRegressor, ManualRegressor, OptRegressor, Regressor

STEPS_PER_EPOCH = len(make_data()) // (WORLD * 4)  # 12 optimizer steps per epoch at batch 4 per rank
PARAM_BYTES = (6 * 16 + 16 + 16 * 3 + 3) * 8


def _local_sgd(sync_every: int, **kwargs: Any) -> MGPULocalSGDStrategy:
    return MGPULocalSGDStrategy(sync_every=sync_every, start_method="fork", **kwargs)


def _diloco(sync_every: int, **kwargs: Any) -> MGPUDiLoCoStrategy:
    return MGPUDiLoCoStrategy(sync_every=sync_every, start_method="fork", **kwargs)


def _plain_outer(sync_every: int) -> MGPUDiLoCoStrategy:
    """DiLoCo whose outer step is SGD with learning rate 1 and no momentum: local SGD written as DiLoCo."""
    return _diloco(sync_every, outer_lr=1.0, outer_momentum=0.0, nesterov=False)


class AtSyncs(Callback):
    """Per rank: the flat weights after every optimizer step, and whether that step synced."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.weights: list[torch.Tensor] = []
        self.synced: list[bool] = []
        self._syncs = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        sync = trainer.strategy.periodic_sync
        self.synced.append(sync.syncs > self._syncs)
        self._syncs = sync.syncs
        self.weights.append(flat_params(pl_module))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save({"weights": self.weights, "synced": self.synced}, self.out_dir / f"syncs{trainer.global_rank}.pt")


class AnchorIsWeights(Callback):
    """Rank 0: after each step, whether the strategy's last synced weights equal the module's weights."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.same: list[bool] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        anchor = torch.cat([a.flatten() for a in trainer.strategy.periodic_sync.anchor])
        self.same.append(torch.equal(anchor, flat_params(pl_module)))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save(self.same, self.out_dir / f"anchor{trainer.global_rank}.pt")


class SaveAtEnd(Callback):
    """``trainer.save_checkpoint`` at the end of fit, inside the worker (every rank calls it)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


class AtStart(Callback):
    """Per rank: the weights and the strategy's restore kind when training starts (after a restore)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = {"weights": flat_params(pl_module), "resumed": trainer.strategy.periodic_sync.resumed}
        torch.save(record, self.out_dir / f"start{trainer.global_rank}.pt")


@pytest.mark.compat
@pytest.mark.parametrize("make", [_local_sgd, _plain_outer], ids=["local_sgd", "diloco_outer_sgd_lr1"])
def test_sync_every_step_equals_mgpu_ddp_and_one_process_with_the_whole_batch(tmp_path, make):
    """SGD with momentum is linear in the gradient: averaging the weights after each step averages the momentum
    buffers' updates, which is what DDP's gradient average does."""
    model = Regressor().double()
    before = flat_params(model)
    reference = reference_weights(model, make_data(), global_batch=WORLD * 4, epochs=2)
    ranks = fit(model, make(1), tmp_path / "periodic")
    ddp = fit(Regressor().double(), "mgpu_ddp_fork", tmp_path / "ddp")
    assert not torch.allclose(ranks[0]["weights"], before)  # the weights moved
    for r in ranks:
        torch.testing.assert_close(r["weights"], ddp[0]["weights"])
        torch.testing.assert_close(r["weights"], reference)
    ledger = ranks[0]["ledger"]
    assert ledger.optimizer_steps == ledger.sync_rounds == 2 * STEPS_PER_EPOCH
    # a weight sync sends what a gradient all-reduce sends: the same bytes as mgpu_ddp per step at H=1
    assert ledger.allreduce_bytes == ddp[0]["ledger"].allreduce_bytes == 2 * STEPS_PER_EPOCH * PARAM_BYTES


def test_warmup_steps_all_reduce_gradients_then_the_periodic_sync_starts_from_the_synced_weights(tmp_path):
    """12 warm-up steps with DDP's gradient all-reduce, then local SGD at H=1: still mgpu_ddp's weights (the first
    sync starts from the weights the warm-up left, not from the initial ones)."""
    model = Regressor().double()
    reference = reference_weights(model, make_data(), global_batch=WORLD * 4, epochs=2)
    ranks = fit(model, _local_sgd(1, warmup_steps=STEPS_PER_EPOCH), tmp_path, callbacks=[AnchorIsWeights(tmp_path)])
    torch.testing.assert_close(ranks[0]["weights"], reference)
    # from the last warm-up step on, the last synced weights are the weights (at H=1 every step syncs)
    same = torch.load(tmp_path / "anchor0.pt")
    assert same == [False] * (STEPS_PER_EPOCH - 1) + [True] * (STEPS_PER_EPOCH + 1)
    spy = ranks[0]["batch_spy"]  # torch.distributed.all_reduce calls: none in DDP's C++ reducer, one per sync
    assert [calls for calls, _ in spy] == [0] * STEPS_PER_EPOCH + [1] * STEPS_PER_EPOCH
    ledger = ranks[0]["ledger"]
    assert ledger.sync_rounds == 2 * STEPS_PER_EPOCH  # 12 gradient all-reduce rounds, then 12 weight syncs
    assert ledger.allreduce_bytes == 2 * STEPS_PER_EPOCH * PARAM_BYTES


@pytest.mark.parametrize("make", [_local_sgd, _plain_outer], ids=["local_sgd", "diloco_outer_sgd_lr1"])
def test_negative_control_sync_every_two_steps_differs_from_mgpu_ddp(tmp_path, make):
    model = Regressor().double()
    reference = reference_weights(model, make_data(), global_batch=WORLD * 4, epochs=2)
    ranks = fit(model, make(2), tmp_path)
    torch.testing.assert_close(ranks[0]["weights"], ranks[1]["weights"])  # 24 steps: the last one synced
    assert not torch.allclose(ranks[0]["weights"], reference, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("make", [_local_sgd, _diloco], ids=["local_sgd", "diloco"])
def test_every_rank_holds_identical_weights_after_each_sync_and_different_ones_between(tmp_path, make):
    ranks = fit(Regressor().double(), make(3), tmp_path, callbacks=[AtSyncs(tmp_path)])
    a, b = (torch.load(tmp_path / f"syncs{r}.pt") for r in range(WORLD))
    assert a["synced"] == b["synced"] == [(step + 1) % 3 == 0 for step in range(2 * STEPS_PER_EPOCH)]
    for w0, w1, synced in zip(a["weights"], b["weights"], a["synced"]):
        if synced:
            assert torch.equal(w0, w1)
        else:
            assert not torch.allclose(w0, w1)  # the ranks train on their own between syncs
    assert ranks[0]["ledger"].sync_rounds == 2 * STEPS_PER_EPOCH // 3


def test_sync_every_counts_optimizer_steps_under_accumulation_and_the_bytes_are_measured(tmp_path):
    """accumulate_grad_batches=2, sync_every=2: one sync every 4 micro-batches, no all-reduce in between. Counted by
    a spy on torch.distributed.all_reduce (independent of our ledger) and by the ledger."""
    ranks = fit(Regressor().double(), _diloco(2), tmp_path, accumulate=2)
    spy = ranks[0]["batch_spy"]  # (calls, bytes) per micro-batch
    assert [calls for calls, _ in spy] == [1 if (i + 1) % 4 == 0 else 0 for i in range(2 * STEPS_PER_EPOCH)]
    assert {nbytes for calls, nbytes in spy if calls} == {PARAM_BYTES}
    ledger = ranks[0]["ledger"]
    assert ledger.optimizer_steps == STEPS_PER_EPOCH and ledger.sync_rounds == STEPS_PER_EPOCH // 2
    assert ledger.allreduce_bytes == sum(nbytes for _, nbytes in spy)
    # bytes per optimizer step against mgpu_ddp's (one gradient all-reduce per step): 1/H
    assert ledger.bytes_per_step == PARAM_BYTES / 2
    assert ledger.ratio_to_lower_bound == pytest.approx(0.5)


def test_batchnorm_statistics_are_averaged_at_each_sync_and_not_broadcast_every_step(tmp_path):
    """DDP would broadcast rank 0's buffers before every forward; here the floating-point buffers are averaged in the
    sync round (one more all-reduce), and every rank holds the same statistics after it."""
    ranks = fit(BlockRegressor().double(), _local_sgd(3), tmp_path, profile=True)
    events = ranks[0]["batch_events"]
    assert all(e.get("gloo:broadcast", 0) == 0 for e in events)
    syncs = [(i + 1) % 3 == 0 for i in range(2 * STEPS_PER_EPOCH)]
    assert [calls for calls, _ in ranks[0]["batch_spy"]] == [2 if synced else 0 for synced in syncs]
    for name, value in ranks[0]["state"].items():
        torch.testing.assert_close(ranks[1]["state"][name], value, rtol=0, atol=0)  # the last step synced
    assert ranks[0]["state"]["net.1.bn.running_mean"].abs().sum() > 0


def test_fp16_communication_sends_half_the_bytes(tmp_path):
    ranks = fit(Regressor().double(), _local_sgd(4, comm_dtype="fp16"), tmp_path, max_epochs=1)
    assert ranks[0]["ledger"].allreduce_bytes == (STEPS_PER_EPOCH // 4) * PARAM_BYTES // 4  # float64 -> float16
    assert ranks[0]["weights"].dtype == torch.float64
    torch.testing.assert_close(ranks[0]["weights"], ranks[1]["weights"])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict[str, Any]]:
    """DiLoCo, H=5, AdamW inner optimizer with a step schedule: 2 epochs (24 steps) without a stop."""
    out = tmp_path_factory.mktemp("uninterrupted")
    return fit(OptRegressor("adamw").double(), _diloco(5), out)


@pytest.fixture(scope="module")
def half_way(tmp_path_factory) -> Path:
    """The same run stopped after epoch 1 (step 12: two steps into the third period), checkpoint written in fit."""
    out = tmp_path_factory.mktemp("half")
    ckpt = out / "half.ckpt"
    fit(OptRegressor("adamw").double(), _diloco(5), out, max_epochs=1, callbacks=[SaveAtEnd(ckpt)])
    return ckpt


def test_a_checkpoint_holds_every_ranks_state_the_synced_weights_and_the_step_in_the_period(half_way):
    state = torch.load(half_way, weights_only=False)[CHECKPOINT_KEY]
    assert (state["world_size"], state["steps"], state["since_sync"], state["syncs"]) == (WORLD, 12, 2, 2)
    assert state["outer_optimizer"]["state"]  # the outer Nesterov momentum
    assert len(state["ranks"]) == WORLD
    w0, w1 = (torch.cat([w.flatten() for w in r["weights"]]) for r in state["ranks"])
    assert not torch.allclose(w0, w1)  # mid-period: each rank's own weights
    m0, m1 = (r["optimizer_states"][0]["state"][0]["exp_avg"] for r in state["ranks"])
    assert not torch.allclose(m0, m1)  # and its own inner AdamW state


def test_resume_mid_period_on_the_same_world_size_equals_the_uninterrupted_run(tmp_path, uninterrupted, half_way):
    ranks = fit(
        OptRegressor("adamw").double(), _diloco(5), tmp_path, ckpt_path=str(half_way), callbacks=[AtStart(tmp_path)]
    )
    assert torch.load(tmp_path / "start0.pt")["resumed"] == "exact"
    for resumed, straight in zip(ranks, uninterrupted):
        torch.testing.assert_close(resumed["weights"], straight["weights"], rtol=0, atol=0)
    assert ranks[0]["ledger"].sync_rounds == 24 // 5 - 12 // 5  # the syncs of steps 15 and 20


def test_negative_control_resume_without_the_ranks_own_state_differs(tmp_path, uninterrupted, half_way):
    checkpoint = torch.load(half_way, weights_only=False)
    del checkpoint[CHECKPOINT_KEY]["ranks"]
    stripped = tmp_path / "stripped.ckpt"
    torch.save(checkpoint, stripped)
    ranks = fit(OptRegressor("adamw").double(), _diloco(5), tmp_path, ckpt_path=str(stripped))
    assert not torch.allclose(ranks[0]["weights"], uninterrupted[0]["weights"])


def test_resume_on_another_world_size_starts_from_the_last_synced_weights(tmp_path, half_way):
    """One rank resumes the two ranks' checkpoint: from the synced weights (a warning in the worker says so)."""
    state = torch.load(half_way, weights_only=False)[CHECKPOINT_KEY]
    synced = torch.cat([w.flatten() for w in state["synced_weights"]])
    fit(
        OptRegressor("adamw").double(),
        _diloco(5),
        tmp_path,
        devices=1,
        ckpt_path=str(half_way),
        callbacks=[AtStart(tmp_path)],
    )
    start = torch.load(tmp_path / "start0.pt")
    assert start["resumed"] == "synced"
    torch.testing.assert_close(start["weights"], synced, rtol=0, atol=0)


def test_the_ledger_and_the_device_monitor_log_through_the_trainers_logger(tmp_path):
    logger = CSVLogger(tmp_path, name="log", version=0)
    fit(Regressor().double(), _diloco(4), tmp_path, logger=logger, log_every_n_steps=4, callbacks=[DeviceMonitor(4)])
    rows = list(csv.DictReader(open(tmp_path / "log" / "version_0" / "metrics.csv")))
    syncs = [float(r["comm/sync_rounds"]) for r in rows if r.get("comm/sync_rounds")]
    assert syncs[-1] == 2 * STEPS_PER_EPOCH // 4
    assert float([r for r in rows if r.get("comm/ratio_to_lower_bound")][-1]["comm/ratio_to_lower_bound"]) == 0.25
    assert any(k.startswith("device/") and r[k] for r in rows for k in r)


def test_manual_optimization_is_refused_before_launch_with_the_reason(tmp_path):
    with pytest.raises(MisconfigurationException, match=r"needs automatic optimization.*mgpu_ddp"):
        fit(ManualRegressor().double(), _local_sgd(2), tmp_path)


def test_fp32_master_precision_is_refused_before_launch_with_the_reason(tmp_path):
    with pytest.raises(MisconfigurationException, match=r"FP32 master weights.*bf16-mixed"):
        fit(Regressor(), _diloco(2), tmp_path, plugins=[MGPUPrecision("bf16-master")])


def test_other_gradient_settings_are_refused_naming_the_fix():
    with pytest.raises(TypeError, match=r"comm_hook='fp16'.*comm_dtype='fp16'"):
        MGPULocalSGDStrategy(comm_hook="fp16")


def test_ddp_arguments_left_at_none_do_not_bring_back_the_buffer_broadcast_of_every_step():
    """DistributedDataParallel's other arguments at their defaults and the buffer flags at None ("not given") leave
    the broadcast off; a True the user wrote is kept, also where it equals DDP's default (torch < 2.13)."""
    strategy = MGPULocalSGDStrategy(broadcast_buffers=None, comm_hook=None, static_graph=False, dim=0)
    flag = "forward_sync_buffers" if "forward_sync_buffers" in DDP_KEYWORDS else "broadcast_buffers"
    assert {k: v for k, v in strategy._ddp_kwargs.items() if "buffers" in k} == {flag: False}
    # the user's choice is kept (a value equal to DDP's own default is left to DDP: the same thing)
    default = inspect.signature(DistributedDataParallel.__init__).parameters[flag].default
    assert MGPULocalSGDStrategy(**{flag: True})._ddp_kwargs.get(flag, default) is True
