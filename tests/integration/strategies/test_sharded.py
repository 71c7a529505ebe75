"""mgpu_sharded: ZeRO stages 1/2/3 (torch) and 1/2 (fairscale) on 2 gloo processes.

Tolerance: float64 with ``assert_close`` defaults (rtol 1e-7, atol 1e-7), tighter than torch's own ZeRO and
FSDP tests (which compare float32 runs with atol/rtol around 1e-5): the sharded runs differ from one
process only by the order of floating-point sums.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_mgpu import MGPUDDPStrategy, MGPUShardedStrategy
from lightning_mgpu.comm import full_tensor
from lightning_mgpu.strategies.runtime import Runtime
from tests.helpers import WORLD, fit, flat_params
from tests.matrix import pairwise
from tests.models import OptRegressor, Regressor, make_data, reference_run
from tests.tensor_parallel_models import ListTPModule, token_data

CONFIGS = [(1, "torch"), (2, "torch"), (3, "torch"), (1, "fairscale"), (2, "fairscale")]
IDS = ["zero1-torch", "zero2-fsdp2", "zero3-fsdp2", "zero1-fairscale", "zero2-fairscale"]
B = 4
# the collectives that carry gradients: DDP's all-reduce, FSDP2's reduce-scatter (an all-reduce on gloo),
# ShardedDataParallel's reduce to the owner. Parameter broadcasts and all-gathers are not gradient syncs.
GRAD_COLLECTIVES = ("gloo:all_reduce", "gloo:reduce", "gloo:reduce_scatter")


def sharded(stage: int, backend: str, **kwargs: Any) -> MGPUShardedStrategy:
    return MGPUShardedStrategy(stage=stage, backend=backend, start_method="fork", **kwargs)  # type: ignore[arg-type]


class FinalState(Callback):
    """At the end of fit, on every rank (the gathers are collectives): rank 0 writes the consolidated
    optimizer state; every rank writes its memory report."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, MGPUShardedStrategy)
        optim = [strategy.consolidated_optimizer_state(o) for o in trainer.optimizers]
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"optim": optim, "memory": strategy.memory_report()}, self.out_dir / f"final{trainer.global_rank}.pt"
        )


def final(out_dir: Path, rank: int = 0) -> dict[str, Any]:
    return torch.load(Path(out_dir) / f"final{rank}.pt", weights_only=False)


def assert_same_optimizer_state(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert sorted(got["state"]) == sorted(expected["state"])
    for index, state in expected["state"].items():
        assert sorted(got["state"][index]) == sorted(state)
        for name, value in state.items():
            torch.testing.assert_close(torch.as_tensor(got["state"][index][name]), torch.as_tensor(value))
    assert len(got["param_groups"]) == len(expected["param_groups"])
    for g, e in zip(got["param_groups"], expected["param_groups"]):
        for key, value in e.items():
            assert g[key] == value, key


# ---------------------------------------------------------------------------------------------------------
# parity
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.compat
@pytest.mark.parametrize(
    ("stage", "backend", "k", "optimizer"), pairwise(dict(zip(IDS, CONFIGS)), [1, 2], ["sgd", "adam", "adamw"])
)
def test_sharded_training_equals_single_process_with_global_batch(tmp_path, stage, backend, k, optimizer):
    dataset = make_data()
    model = OptRegressor(optimizer).double()
    initial = flat_params(model)
    steps = 2 * len(dataset) // (WORLD * B * k)
    expected, expected_optim = reference_run(model, dataset, WORLD * B * k, steps, optimizer)

    ranks = fit(
        model,
        sharded(stage, backend),
        tmp_path,
        dataset=dataset,
        batch_size=B,
        accumulate=k,
        max_epochs=2,
        callbacks=[FinalState(tmp_path)],
    )

    for r in ranks:
        assert r["global_step"] == steps
        torch.testing.assert_close(r["weights"], expected)
    assert (expected - initial).abs().max() > 1e-2, "weights did not move: the comparison would prove nothing"
    assert_same_optimizer_state(final(tmp_path)["optim"][0], expected_optim)


@pytest.mark.compat
def test_sharded_parity_check_can_fail(tmp_path):
    """Negative control: the same comparison fails against a reference that ignores accumulation."""
    dataset = make_data()
    model = OptRegressor("adam").double()
    wrong, _ = reference_run(model, dataset, WORLD * B, 2 * len(dataset) // (WORLD * B * 2), "adam")
    ranks = fit(model, sharded(2, "torch"), tmp_path, dataset=dataset, batch_size=B, accumulate=2)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ranks[0]["weights"], wrong)


def test_offload_to_the_host_trains_the_weights_and_optimizer_state_of_one_process(tmp_path):
    """``offload="cpu"`` at stage 3 with accumulation and activation checkpointing gives the weights and the optimizer
    state of one process with the global batch (float64). Here the host is the device, so this proves the offloaded
    path's arithmetic and bookkeeping under the Trainer; that the shards, gradients and optimizer state really live
    in host memory while a GPU computes is the GPU tier's check (``tests/gpu/test_gpu_features.py``). The negative
    control of the comparison: ``test_sharded_parity_check_can_fail``."""
    dataset = make_data()
    model = OptRegressor("adam").double()
    initial = flat_params(model)
    k = 2
    steps = 2 * len(dataset) // (WORLD * B * k)
    expected, expected_optim = reference_run(model, dataset, WORLD * B * k, steps, "adam")
    strategy = sharded(3, "torch", offload="cpu", activation_checkpointing="Linear")
    ranks = fit(
        model, strategy, tmp_path, dataset=dataset, batch_size=B, accumulate=k, callbacks=[FinalState(tmp_path)]
    )
    for r in ranks:
        assert r["global_step"] == steps
        torch.testing.assert_close(r["weights"], expected)
    assert (expected - initial).abs().max() > 1e-2, "weights did not move: the comparison would prove nothing"
    assert_same_optimizer_state(final(tmp_path)["optim"][0], expected_optim)


# ---------------------------------------------------------------------------------------------------------
# the device mesh, as a module written for Lightning's ModelParallelStrategy reads it
# ---------------------------------------------------------------------------------------------------------


class MeshReader(Regressor):
    """``configure_model`` reads ``self.device_mesh`` by the names Lightning's ``ModelParallelStrategy`` gives its
    dimensions, uses the data-parallel group (each rank's global rank gathered over it) and writes what it saw."""

    def __init__(self, out_dir: Path) -> None:
        super().__init__()
        self.out_dir = Path(out_dir)

    @override
    def configure_model(self) -> None:
        mesh = self.device_mesh
        assert mesh is not None, "configure_model saw no device mesh"
        dp, tp = mesh["data_parallel"], mesh["tensor_parallel"]
        rank = self.trainer.global_rank
        gathered: list[Any] = [None] * dp.size()
        torch.distributed.all_gather_object(gathered, rank, group=dp.get_group())
        seen = {
            "names": mesh.mesh_dim_names,
            "data_parallel": (dp.size(), dp.get_local_rank(), dp.mesh.tolist(), gathered),
            "tensor_parallel": (tp.size(), tp.get_local_rank(), tp.mesh.tolist()),
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(seen, self.out_dir / f"mesh{rank}.pt")


@pytest.mark.compat
@pytest.mark.parametrize(("stage", "backend"), CONFIGS, ids=IDS)
def test_configure_model_reads_the_device_mesh_by_lightnings_dimension_names(tmp_path, stage, backend):
    fit(MeshReader(tmp_path).double(), sharded(stage, backend), tmp_path, max_epochs=1, limit_train_batches=1)
    for rank in range(WORLD):
        seen = torch.load(tmp_path / f"mesh{rank}.pt", weights_only=False)
        assert seen["names"] == ("data_parallel", "tensor_parallel")
        assert seen["data_parallel"] == (WORLD, rank, list(range(WORLD)), list(range(WORLD)))
        assert seen["tensor_parallel"] == (1, 0, [rank])


# ---------------------------------------------------------------------------------------------------------
# gradient sync only on stepping micro-batches
# ---------------------------------------------------------------------------------------------------------


def _grad_collectives(record: dict[str, Any]) -> list[int]:
    return [sum(n for name, n in events.items() if name in GRAD_COLLECTIVES) for events in record["batch_events"]]


@pytest.mark.parametrize(("stage", "backend"), CONFIGS, ids=IDS)
def test_accumulation_reduces_gradients_only_when_the_optimizer_steps(tmp_path, stage, backend):
    ranks = fit(OptRegressor("sgd").double(), sharded(stage, backend), tmp_path, accumulate=2, profile=True)
    for r in ranks:
        seen = _grad_collectives(r)
        assert len(seen) == len(make_data()) // (WORLD * B) * 2
        assert seen[0::2] == [0] * len(seen[0::2]), "a non-stepping micro-batch reduced gradients"
        assert all(n > 0 for n in seen[1::2])
        # the ledger counts exactly what the profiler saw, on every stepping micro-batch
        assert r["batch_ledger_calls"][1::2] == seen[1::2]
        ledger = r["ledger"]
        assert ledger.sync_rounds == ledger.optimizer_steps == r["global_step"]


class AlwaysSyncSharded(MGPUShardedStrategy):
    """Negative control: accumulation that forgets to block the gradient sync."""

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        yield None


def test_sync_count_check_can_fail(tmp_path):
    ranks = fit(
        OptRegressor("sgd").double(),
        AlwaysSyncSharded(stage=2, start_method="fork"),
        tmp_path,
        accumulate=2,
        profile=True,
    )
    assert all(n > 0 for n in _grad_collectives(ranks[0])[0::2])


def test_wrap_modules_sets_the_fsdp_units(tmp_path):
    """One FSDP unit per Linear: two gradient reductions per synchronised backward instead of one."""
    default = fit(OptRegressor("sgd").double(), sharded(2, "torch"), tmp_path / "default", profile=True)
    per_linear = fit(
        OptRegressor("sgd").double(),
        sharded(2, "torch", wrap_modules=[torch.nn.Linear]),
        tmp_path / "linear",
        profile=True,
    )
    assert set(_grad_collectives(default[0])) == {1}
    assert set(_grad_collectives(per_linear[0])) == {2}
    torch.testing.assert_close(default[0]["weights"], per_linear[0]["weights"])


# ---------------------------------------------------------------------------------------------------------
# memory: each rank holds a shard
# ---------------------------------------------------------------------------------------------------------


def _state_bytes(state_dict: dict[str, Any]) -> int:
    return sum(
        v.numel() * v.element_size() for s in state_dict["state"].values() for v in s.values() if torch.is_tensor(v)
    )


@pytest.mark.parametrize(("stage", "backend"), CONFIGS, ids=IDS)
def test_each_rank_holds_only_its_share_of_optimizer_state_and_gradients(tmp_path, stage, backend):
    # four parameters of two equal sizes: whole-parameter partitions (ZeRO, OSS) can split them evenly
    dataset = make_data(d_in=32, d_out=32)
    model = OptRegressor("adam", d_in=32, hidden=32, d_out=32).double()
    _, ddp_optim = reference_run(model, dataset, WORLD * B, 1, "adam")
    ddp_bytes = _state_bytes(ddp_optim)  # what DDP keeps on every rank
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    fit(model, sharded(stage, backend), tmp_path, dataset=dataset, callbacks=[FinalState(tmp_path)])

    reports = [final(tmp_path, r)["memory"] for r in range(WORLD)]
    for m in reports:
        assert 0 < m.optimizer_state <= (1 / WORLD + 0.02) * ddp_bytes
    assert sum(m.optimizer_state for m in reports) >= ddp_bytes  # nothing is missing: it is a partition
    for m in reports:
        if stage == 1:
            assert m.gradients == param_bytes  # stage 1: DDP leaves every gradient on every rank
        else:
            assert 0 < m.gradients <= (1 / WORLD + 0.02) * param_bytes
        if backend == "torch" and stage >= 2:
            assert m.parameters <= (1 / WORLD + 0.02) * param_bytes  # FSDP2 reshards after backward
        else:
            assert m.parameters == param_bytes


# ---------------------------------------------------------------------------------------------------------
# checkpoints resume at another world size
# ---------------------------------------------------------------------------------------------------------

RESUME_DATA = 24  # 2 steps per epoch at global batch 12, which 1, 2 and 3 ranks all divide
GLOBAL = 12


def _run(tmp: Path, strategy: Any, world: int, epochs: int, **kwargs: Any) -> list[dict[str, Any]]:
    return fit(
        OptRegressor("adam").double(),
        strategy,
        tmp,
        dataset=make_data(n=RESUME_DATA),
        batch_size=GLOBAL // world,
        devices=world,
        max_epochs=epochs,
        callbacks=[FinalState(tmp), *kwargs.pop("callbacks", [])],
        **kwargs,
    )


def _save(tmp: Path, strategy: Any, world: int) -> Path:
    ckpt = ModelCheckpoint(dirpath=tmp / "ckpt", filename="saved", save_top_k=-1)
    _run(tmp / f"save{world}", strategy, world, epochs=1, callbacks=[ckpt], enable_checkpointing=True)
    path = tmp / "ckpt" / "saved.ckpt"
    assert path.exists()
    return path


def _assert_resumed_like_straight(tmp: Path, ranks: list[dict[str, Any]]) -> None:
    expected, expected_optim = reference_run(OptRegressor("adam").double(), make_data(n=RESUME_DATA), GLOBAL, 4, "adam")
    for r in ranks:
        assert r["global_step"] == 4
        torch.testing.assert_close(r["weights"], expected)
    assert_same_optimizer_state(final(tmp)["optim"][0], expected_optim)


@pytest.mark.compat
@pytest.mark.parametrize(
    ("stage", "backend", "layout", "save_world", "resume_worlds"),
    pairwise(dict(zip(IDS, CONFIGS)), ["consolidated", "sharded"], {"2to1,2to3": (2, (1, 3)), "1to2": (1, (2,))}),
)
def test_checkpoint_resumes_at_another_world_size(tmp_path, stage, backend, layout, save_world, resume_worlds):
    """2 steps, save, resume at another N for 2 steps == 4 steps straight: weights, optimizer state and the
    learning-rate schedule."""
    path = _save(tmp_path, sharded(stage, backend, checkpoint=layout), save_world)
    assert path.is_dir() == (layout == "sharded")
    for world in resume_worlds:
        out = tmp_path / f"resume{world}"
        ranks = _run(out, sharded(stage, backend, checkpoint=layout), world, epochs=2, ckpt_path=str(path))
        _assert_resumed_like_straight(out, ranks)


@pytest.mark.parametrize(
    ("saver", "resumer", "world"),
    [
        (dict(stage=3, backend="torch", checkpoint="sharded"), dict(stage=1, backend="fairscale"), 3),
        (dict(stage=2, backend="fairscale"), dict(stage=3, backend="torch", checkpoint="sharded"), 1),
        (dict(stage=1, backend="torch", checkpoint="sharded"), dict(stage=2, backend="torch"), 2),
        # offloaded states: written from host memory, read back into it
        (dict(stage=3, backend="torch", checkpoint="sharded", offload="cpu"), dict(stage=2, backend="torch"), 1),
        (dict(stage=3, backend="torch", offload="cpu"), dict(stage=3, backend="torch", offload="cpu"), 3),
    ],
    ids=[
        "fsdp2-sharded-to-oss",
        "oss-consolidated-to-fsdp2",
        "zero-sharded-to-fsdp2",
        "offload-sharded-to-fsdp2",
        "offload-consolidated-to-offload",
    ],
)
def test_either_layout_resumes_under_another_stage_and_backend(tmp_path, saver, resumer, world):
    path = _save(tmp_path, sharded(**saver), 2)
    out = tmp_path / "resume"
    _assert_resumed_like_straight(out, _run(out, sharded(**resumer), world, epochs=2, ckpt_path=str(path)))


_PLAIN_RESUME = """
import sys
sys.modules["lightning_mgpu"] = None  # importing it would fail: this run must not need it
import torch, pytorch_lightning as pl
from tests.models import OptRegressor, RankData, make_data
for ckpt, out in zip(sys.argv[1::2], sys.argv[2::2]):
    model = OptRegressor("adam").double()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(model, datamodule=RankData(make_data(n={n}), {batch}), ckpt_path=ckpt)
    torch.save({{"weights": torch.cat([p.detach().flatten() for p in model.parameters()]),
                 "optim": trainer.optimizers[0].state_dict(), "step": trainer.global_step}}, out)
"""
PLAIN_RESUME_CONFIGS = CONFIGS[:3]  # ZeRO-1, ZeRO-2 and ZeRO-3 of torch (IDS[:3])


@pytest.fixture(scope="module")
def plain_resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, str], Path]:
    """Each stage's consolidated checkpoint resumed by plain Lightning in one interpreter without this package (one
    interpreter for the three: a fresh one costs seconds, and what it proves is the same for each file)."""
    tmp = tmp_path_factory.mktemp("plain")
    args, outs = [], {}
    for stage, backend in PLAIN_RESUME_CONFIGS:
        path = _save(tmp / f"zero{stage}", sharded(stage, backend), 2)
        outs[(stage, backend)] = tmp / f"plain{stage}.pt"
        args += [str(path), str(outs[(stage, backend)])]
    proc = subprocess.run(
        [sys.executable, "-c", _PLAIN_RESUME.format(n=RESUME_DATA, batch=GLOBAL), *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=Path(__file__).parents[3],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return outs


@pytest.mark.parametrize(("stage", "backend"), PLAIN_RESUME_CONFIGS, ids=IDS[:3])
def test_consolidated_checkpoint_resumes_in_plain_lightning_without_this_package(plain_resumed, stage, backend):
    got = torch.load(plain_resumed[(stage, backend)], weights_only=False)
    expected, expected_optim = reference_run(OptRegressor("adam").double(), make_data(n=RESUME_DATA), GLOBAL, 4, "adam")
    assert got["step"] == 4
    torch.testing.assert_close(got["weights"], expected)
    assert_same_optimizer_state(got["optim"], expected_optim)


# ---------------------------------------------------------------------------------------------------------
# launches
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["mgpu_sharded_notebook", "mgpu_ddp_fork"])
def test_saving_in_the_main_process_after_a_fork_launch_is_refused(tmp_path, strategy):
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False
    )
    from tests.models import RankData

    trainer.fit(OptRegressor("adam").double(), datamodule=RankData(make_data(), B))
    with pytest.raises(RuntimeError, match="main process after a 'fork' launch") as err:
        trainer.save_checkpoint(tmp_path / "after.ckpt")
    assert "ModelCheckpoint" in str(err.value)
    assert not (tmp_path / "after.ckpt").exists()


@pytest.mark.slow
def test_spawn_preset_hands_the_gathered_weights_back_to_the_main_process(tmp_path):
    """Under FSDP2 rank 0's own state_dict() holds only shards; the main process must get whole weights."""
    model = OptRegressor("adam").double()
    before = flat_params(model)
    ranks = fit(model, "mgpu_sharded_spawn", tmp_path, accumulate=2)
    torch.testing.assert_close(ranks[0]["weights"], ranks[1]["weights"])
    torch.testing.assert_close(flat_params(model), ranks[0]["weights"])
    assert not torch.allclose(ranks[0]["weights"], before)


# ---------------------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "exc", "fragments"),
    [
        (dict(stage=0), ValueError, ["stage=0", "stage=1", "3"]),
        (dict(stage=4), ValueError, ["stage=4"]),
        (dict(stage=True), ValueError, ["stage=True"]),
        (dict(stage="2"), ValueError, ["stage='2'"]),
        (dict(backend="deepspeed"), ValueError, ["backend='deepspeed'", "'fairscale'"]),
        (dict(stage=3, backend="fairscale"), ValueError, ["stage=3", "mgpu_zero3"]),
        (dict(checkpoint="zip"), ValueError, ["checkpoint='zip'", "'sharded'"]),
        (dict(wrap_modules=[int]), TypeError, ["wrap_modules", "nn.Module"]),
        (dict(stage=1, wrap_modules=[torch.nn.Linear]), ValueError, ["wrap_modules", "stages 2 and 3"]),
        (dict(stage=2, comm_hook="fp16"), ValueError, ["comm_hook", "stage=1"]),
    ],
    ids=lambda v: str(v) if not isinstance(v, (dict, list)) else None,
)
def test_bad_argument_is_refused_with_value_and_fix(kwargs, exc, fragments):
    with pytest.raises(exc) as err:
        MGPUShardedStrategy(**kwargs)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_missing_fairscale_fails_at_trainer_construction_with_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fairscale" else real(name, *a))
    with pytest.raises(ModuleNotFoundError) as err:
        pl.Trainer(accelerator="cpu", devices=WORLD, strategy="mgpu_sharded_fairscale", logger=False)
    assert "pip install 'lightning-mgpu[fairscale]'" in str(err.value)
    assert "mgpu_sharded" in str(err.value)


class LBFGSRegressor(OptRegressor):
    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.1)


class AdafactorRegressor(OptRegressor):
    def configure_optimizers(self) -> Any:
        return torch.optim.Adafactor(self.parameters(), lr=0.01)


@pytest.mark.parametrize(
    ("model", "stage", "fragments"),
    [
        (LBFGSRegressor, 1, ["cannot shard LBFGS", "mgpu_ddp"]),
        (LBFGSRegressor, 3, ["cannot shard LBFGS"]),
        (AdafactorRegressor, 2, ["Adafactor", "stage=1"]),
    ],
    ids=["lbfgs-zero1", "lbfgs-zero3", "adafactor-zero2"],
)
def test_optimizer_the_backend_cannot_shard_is_refused(tmp_path, model, stage, fragments):
    with pytest.raises(Exception) as err:  # torch's ProcessRaisedException carries the worker's message
        fit(model().double(), sharded(stage, "torch"), tmp_path)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_adafactor_trains_at_stage_1_where_ranks_own_whole_parameters(tmp_path):
    ranks = fit(AdafactorRegressor().double(), sharded(1, "torch"), tmp_path)
    torch.testing.assert_close(ranks[0]["weights"], ranks[1]["weights"])


class ManualRegressor(OptRegressor):
    def __init__(self) -> None:
        super().__init__("sgd")
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()


def test_manual_optimization_is_refused_before_launch_pointing_to_mgpu_ddp(tmp_path):
    with pytest.raises(pl.utilities.exceptions.MisconfigurationException) as err:
        fit(ManualRegressor().double(), sharded(2, "torch"), tmp_path)
    assert "manual optimization" in str(err.value) and "mgpu_ddp" in str(err.value)
    assert not (tmp_path / "rank0.pt").exists()  # no worker ran


def test_presets_build_the_documented_configuration():
    expected = {
        "mgpu_sharded": (2, "torch", "popen"),
        "mgpu_sharded_spawn": (2, "torch", "spawn"),
        "mgpu_sharded_notebook": (2, "torch", "fork"),
        "mgpu_zero1": (1, "torch", "popen"),
        "mgpu_zero3": (3, "torch", "popen"),
        "mgpu_sharded_fairscale": (2, "fairscale", "popen"),
    }
    for name, (stage, backend, launch) in expected.items():
        strategy = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=name, logger=False).strategy
        assert isinstance(strategy, MGPUShardedStrategy) and isinstance(strategy._runtime, Runtime)
        # one class for every stage, none of them a DDP strategy (stage 1 composes mgpu_ddp's DDP wrapping)
        assert type(strategy) is MGPUShardedStrategy and not isinstance(strategy, MGPUDDPStrategy)
        assert (strategy.stage, strategy.backend, strategy.launch_settings.start_method) == (stage, backend, launch)


@pytest.mark.parametrize("stage", [1, 3])
def test_the_save_preamble_runs_once_per_save(tmp_path, stage):
    """Refusal, settling the previous background write and the mid-epoch position run once, then one write (the
    consolidated layout used to run them twice: in the sharded strategy and again in the base it handed to)."""
    strategy = MGPUShardedStrategy(stage=stage)
    calls: list[str] = []
    strategy._runtime.checkpoints.before_save = lambda checkpoint: calls.append("before")  # type: ignore[method-assign]
    strategy._runtime.checkpoints.write_file = lambda checkpoint, path, options, save: calls.append("write")  # type: ignore[method-assign]
    strategy.save_checkpoint({"state_dict": {}}, str(tmp_path / "last.ckpt"))
    assert calls == ["before", "write"]


# --- every rank starts from rank 0's weights -----------------------------------------------------------------------


class RankSeeded(ListTPModule):
    """A module each process builds from its own random state, as a script run once per process does (torchrun,
    SLURM, the popen launcher) without a common seed: ``configure_model`` draws every parameter again from a seed
    of the process's rank, and keeps what it drew."""

    def configure_model(self) -> None:
        g = torch.Generator().manual_seed(100 + self.global_rank)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        self.drawn = {n: p.detach().clone() for n, p in self.named_parameters()}


class StartWeights(Callback):
    """At the start of training, on every rank: what ``configure_model`` drew and the whole weights the rank trains
    from (a split or sharded parameter gathered: a collective every rank makes in the same order)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        start = {n: full_tensor(p).detach().clone() for n, p in pl_module.named_parameters()}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"drawn": pl_module.drawn, "start": start}, self.out_dir / f"start{trainer.global_rank}.pt")


@pytest.mark.parametrize(
    "layout",
    [
        {"stage": 3, "tensor_parallel_size": 2},  # tensor 2 x data 2
        {"pipeline_parallel_size": 2},  # pipeline 2 x data 2
        {"stage": 3, "mesh": "hybrid", "shard_size": 2},  # replicas of a shard group
    ],
    ids=["tensor", "pipeline", "hybrid"],
)
def test_every_rank_trains_from_rank_0s_weights_when_each_process_drew_its_own(tmp_path: Path, layout: Any) -> None:
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=sharded(layout.pop("stage", 2), "torch", **layout), max_steps=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[StartWeights(tmp_path)],
    )  # fmt: skip
    trainer.fit(RankSeeded(), DataLoader(token_data(), batch_size=2))
    ranks = [torch.load(tmp_path / f"start{r}.pt", weights_only=False) for r in range(WORLD)]
    drawn = ranks[0]["drawn"]
    # the processes drew different weights (without the broadcast the ranks would train from these) ...
    for other in ranks[1:]:
        assert not torch.equal(other["drawn"]["output.weight"], drawn["output.weight"])
    # ... and every rank trains from rank 0's, split or sharded as the layout says
    for r, record in enumerate(ranks):
        assert set(record["start"]) == set(drawn), r
        for name, value in drawn.items():
            torch.testing.assert_close(record["start"][name], value, msg=f"rank {r}: {name}")
