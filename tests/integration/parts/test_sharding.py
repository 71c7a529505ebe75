"""Hybrid sharding (HSDP) on 4 gloo processes as 2 "machines" x 2: each machine is a process of its own with
``NODE_RANK`` set, as a cluster sets it, running ``Trainer(num_nodes=2, devices=2)``, whose fork launch starts its
2 ranks (Lightning's environment: global rank = node rank x 2 + local rank). By default the shard group is the
processes of one machine: ranks {0, 1} and {2, 3} hold the shards, {0, 2} and {1, 3} are replicas.

What is checked: float64 parity with one process (stage 3 at k = 1 and 3, stage 2 at k = 3, with norm clipping that
bites), the collectives per group counted by torch.profiler (FSDP2's reduce-scatter within the shard group, its
all-reduce of the shards across replicas, none of either on a non-stepping micro-batch; the flat mesh and an
accumulation that forgets to block the sync as negative controls), the ledger's split of the traffic, and
checkpoints that resume at other mesh shapes (2 x 2 -> 1 x 4 -> 4 x 1; the consolidated layout in the slow tests),
and one mesh per process group across Trainer calls in the same processes (2 processes started as torchrun does).

Tolerance: ``assert_close`` defaults in float64, as in ``tests/integration/strategies/test_sharded.py``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.multiprocessing as mp
from lightning_fabric.plugins.environments.lightning import find_free_network_port
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_mgpu import MGPUShardedStrategy, _compat, comm
from tests.helpers import NODES, PER_NODE, Job, full, run_on_two_machines
from tests.models import OptRegressor, RankData, configure, make_data, reference_run

WORLD = NODES * PER_NODE
CLIP = 0.05
B = 2  # per rank


class GroupCollectives(Callback):
    """Per training batch, from torch.profiler (independent of the ledger): FSDP2's reduce-scatters as
    ``(input elements, output elements)`` (input / output = the ranks of the group it ran over) and its
    all-reduces of gradient shards (elements); the scalar all-reduce of norm clipping is counted apart."""

    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []
        self._prof: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        self._prof.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._prof.__exit__(None, None, None)
        seen: dict[str, Any] = {"reduce_scatter": [], "all_reduce": [], "scalar_all_reduce": 0}
        c10d_all_reduces, gloo_all_reduces = 0, []
        for e in self._prof.events():
            if e.name == "c10d::_reduce_scatter_base_":  # (output, input, ...)
                seen["reduce_scatter"].append((_numel(e.input_shapes[1]), _numel(e.input_shapes[0])))
            elif e.name == "c10d::allreduce_":  # its tensor list has no shapes in the profile: gloo's event has
                c10d_all_reduces += 1
            elif e.name == "gloo:all_reduce":  # gloo runs a reduce-scatter as an all-reduce of its input
                gloo_all_reduces.append(e.input_shapes[0])
        for shape in gloo_all_reduces:
            if not shape:
                seen["scalar_all_reduce"] += 1
            else:
                seen["all_reduce"].append(_numel(shape))
        for whole, _ in seen["reduce_scatter"]:
            seen["all_reduce"].remove(whole)
        assert len(seen["all_reduce"]) + seen["scalar_all_reduce"] == c10d_all_reduces
        self.batches.append(seen)
        self._prof = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the profilers' shape records hold weak references to the parameters, which Lightning's teardown
        # (module.cpu(), swapping FSDP2's tensors) refuses: free them once before it (a collection per batch cost
        # about a second each in a process that has imported torch and Lightning)
        gc.collect()


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class Record(Callback):
    """At the end of fit, every rank: the full weights, the mesh, the ledger and the profiler's counts."""

    def __init__(self, out: Path, collectives: GroupCollectives) -> None:
        self.out = out
        self.collectives = collectives

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = {k: full(v).detach().clone() for k, v in pl_module.state_dict().items()}
        strategy = trainer.strategy
        torch.save(
            {
                "weights": torch.cat([state[name].flatten() for name, _ in pl_module.named_parameters()]),
                "mesh_shape": strategy._sharded.sharding.mesh_shape,  # type: ignore[attr-defined]
                "ledger": strategy.comm_stats,  # type: ignore[attr-defined]
                "batches": self.collectives.batches,
                "global_step": trainer.global_step,
                "node_rank": trainer.node_rank,
                "seen_mesh": pl_module.seen_mesh,  # type: ignore[attr-defined]
            },
            self.out / f"rank{trainer.global_rank}.pt",
        )


class MeshRegressor(OptRegressor):
    """Keeps what ``configure_model`` finds in ``self.device_mesh`` (Lightning's dimension names)."""

    seen_mesh: dict[str, Any] | None = None

    @override
    def configure_model(self) -> None:
        mesh = self.device_mesh
        assert mesh is not None, "configure_model saw no device mesh"
        dp, tp = mesh["data_parallel"], mesh["tensor_parallel"]
        self.seen_mesh = {
            "names": mesh.mesh_dim_names,
            "data_parallel": (dp.size(), dp.get_local_rank(), dp.mesh.tolist()),
            "tensor_parallel": (tp.size(), tp.get_local_rank()),
        }


def fit_job(
    strategy: Callable[[], MGPUShardedStrategy],
    *,
    accumulate: int = 1,
    epochs: int = 1,
    optimizer: str = "sgd",
    n: int = 48,
    batch: int = B,
    resume_from: str = "",
    save_to: str = "",
    **trainer_kwargs: Any,
) -> Job:
    def job(out: Path) -> None:
        collectives = GroupCollectives()
        callbacks: list[Callback] = [collectives, Record(out, collectives)]
        if save_to:
            callbacks.append(ModelCheckpoint(dirpath=save_to, filename="saved", save_top_k=-1))
        trainer = pl.Trainer(
            accelerator="cpu", devices=PER_NODE, num_nodes=NODES, strategy=strategy(), max_epochs=epochs,
            accumulate_grad_batches=accumulate, use_distributed_sampler=False, logger=False,
            enable_checkpointing=bool(save_to), enable_progress_bar=False, enable_model_summary=False,
            callbacks=callbacks, **trainer_kwargs,
        )  # fmt: skip
        model = MeshRegressor(optimizer).double()
        trainer.fit(model, datamodule=RankData(make_data(n=n), batch), ckpt_path=resume_from or None)

    return job


class AlwaysSyncSharded(MGPUShardedStrategy):
    """Negative control: accumulation that forgets to block the gradient sync."""

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        yield None


def hybrid(stage: int = 3, cls: type = MGPUShardedStrategy, **kwargs: Any) -> Callable[[], MGPUShardedStrategy]:
    return lambda: cls(
        stage=stage,
        mesh=kwargs.pop("mesh", "hybrid"),
        start_method="fork",
        wrap_modules=[nn.Linear],  # two units: two reduce-scatters and two shard all-reduces per step
        **kwargs,
    )


def reference(k: int, clip: float, steps: int, norm_scale: float = 1.0) -> tuple[torch.Tensor, list[float]]:
    """One process, plain torch, the global batch (``WORLD * B * k``) per step, clipped by the global norm
    (``norm_scale``: a negative control that takes the norm ``norm_scale`` times too large, what summing the
    squared norms over replicas as well as shards computes with ``norm_scale = sqrt(replicas)``)."""
    model = OptRegressor("sgd").double()
    cfg = configure("sgd", model.parameters(), model.lr)
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
    norms = []
    loader = DataLoader(make_data(n=48), batch_size=WORLD * B * k, shuffle=False)
    for x, y in list(loader)[:steps]:
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        params = list(model.parameters())
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        norms.append(float(norm))
        coef = torch.clamp(clip / (norm * norm_scale + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef)
        opt.step()
        sched.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]), norms


# ---------------------------------------------------------------------------------------------------------
# parity, collectives per group, ledger
# ---------------------------------------------------------------------------------------------------------


CLIPPED = {"gradient_clip_val": CLIP, "gradient_clip_algorithm": "norm"}


@pytest.fixture(scope="module")
def hybrid_runs() -> list[list[dict[str, Any]]]:
    return run_on_two_machines(
        [
            fit_job(hybrid(), accumulate=3, **CLIPPED),
            fit_job(hybrid(mesh="flat"), accumulate=3),  # the flat mesh, for comparison
            fit_job(hybrid(cls=AlwaysSyncSharded), accumulate=3),  # negative control
            fit_job(hybrid(stage=2), accumulate=3, **CLIPPED),  # hybrid ZeRO-2
        ]
    )


@pytest.fixture(scope="module")
def hybrid_k1_run() -> list[dict[str, Any]]:
    """k = 1 (the slow tier: every step of it is what the stepping micro-batch of k = 3 does)."""
    return run_on_two_machines([fit_job(hybrid(), accumulate=1, **CLIPPED)])[0]


@pytest.mark.parametrize(("job", "shape"), [(0, (2, 2)), (1, (1, 4)), (3, (2, 2))], ids=["hybrid", "flat", "stage2"])
def test_configure_model_sees_every_rank_of_the_mesh_as_data_parallel(hybrid_runs, job, shape):
    """HSDP is one shape of the device mesh: the module sees Lightning's 2-D mesh, all ranks data-parallel
    (replicas x shards), whatever the split FSDP2 shards over."""
    for rank, record in enumerate(hybrid_runs[job]):
        assert record["mesh_shape"] == shape
        assert record["seen_mesh"] == {
            "names": ("data_parallel", "tensor_parallel"),
            "data_parallel": (WORLD, rank, list(range(WORLD))),
            "tensor_parallel": (1, 0),
        }


def _assert_hybrid_equals_one_process(ranks: list[dict[str, Any]], k: int) -> None:
    steps = 48 // (WORLD * B * k)
    expected, norms = reference(k, CLIP, steps)
    assert min(norms) > CLIP  # clipping bites on every step
    for r, record in enumerate(ranks):
        assert record["node_rank"] == r // PER_NODE
        assert record["mesh_shape"] == (2, 2)  # replicate across the 2 machines, shard within each
        assert record["global_step"] == steps
        torch.testing.assert_close(record["weights"], expected)
    # negative control: a norm summed over replicas as well as shards (sqrt(2) too large) gives other weights
    wrong, _ = reference(k, CLIP, steps, norm_scale=2**0.5)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ranks[0]["weights"], wrong)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("job", [0, 3], ids=["k3", "stage2-k3"])
def test_hybrid_training_equals_one_process_with_norm_clipping(hybrid_runs, job):
    _assert_hybrid_equals_one_process(hybrid_runs[job], 3)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hybrid_training_without_accumulation_equals_one_process_and_the_ledger_counts_it(hybrid_k1_run):
    _assert_hybrid_equals_one_process(hybrid_k1_run, 1)
    _assert_ledger(hybrid_k1_run[0]["ledger"], 1)


@pytest.mark.timeout(600)
def test_accumulation_reduce_scatters_and_all_reduces_across_replicas_once_per_step(hybrid_runs):
    """k = 3: micro-batches 1 and 2 send no gradient at all; micro-batch 3 reduce-scatters each unit's gradient
    within the shard group (input / output = 2 ranks) and all-reduces each resulting shard across the 2 replicas,
    and clipping adds one scalar all-reduce (over the shard group)."""
    for record in hybrid_runs[0]:
        batches = record["batches"]
        assert len(batches) == 48 // (WORLD * B)
        for i, seen in enumerate(batches):
            if i % 3 != 2:
                assert seen == {"reduce_scatter": [], "all_reduce": [], "scalar_all_reduce": 0}, i
                continue
            assert len(seen["reduce_scatter"]) == 2  # one per FSDP unit (the two Linear layers)
            assert [i // o for i, o in seen["reduce_scatter"]] == [2, 2]  # over the shard group of 2 ranks
            assert sorted(seen["all_reduce"]) == sorted(o for _, o in seen["reduce_scatter"])  # the shards
            assert seen["scalar_all_reduce"] == 1


@pytest.mark.timeout(600)
def test_the_collective_count_check_can_fail(hybrid_runs):
    """The same count on the flat mesh (reduce-scatter over all 4 ranks, no all-reduce across replicas) and with
    an accumulation that forgets to block the sync (gradients sent on every micro-batch) breaks the checks above."""
    flat, always = hybrid_runs[1][0], hybrid_runs[2][0]
    assert flat["mesh_shape"] == (1, 4)
    stepping = flat["batches"][2]
    assert [i // o for i, o in stepping["reduce_scatter"]] == [4, 4] and stepping["all_reduce"] == []
    assert all(len(seen["reduce_scatter"]) == 2 and len(seen["all_reduce"]) == 2 for seen in always["batches"])


@pytest.mark.timeout(600)
def test_ledger_reports_the_shard_group_and_the_replicas_against_their_lower_bounds(hybrid_runs):
    _assert_ledger(hybrid_runs[0][0]["ledger"], 3)


def _assert_ledger(stats: Any, k: int) -> None:
    assert (stats.world_size, stats.replicas, stats.shard_size) == (WORLD, 2, 2)
    assert stats.sync_rounds == stats.optimizer_steps == 48 // (WORLD * B * k)
    groups = stats.per_group()
    g = stats.gradient_bytes
    # per step: one reduce-scatter of the whole gradient within the shard group, plus the 8-byte scalar
    # all-reduce of norm clipping there; one all-reduce of the gradient's shard across the replicas
    assert stats.round_bytes == g * stats.sync_rounds
    assert stats.allreduce_bytes - stats.round_bytes == 8 * stats.optimizer_steps
    assert groups["shard_lower_bound_bytes"] == g / 2  # (s - 1) / s x G
    assert groups["shard_bytes_per_step"] == g / 2 + 8  # + 2 (s - 1) / s x 8
    assert groups["replica_lower_bound_bytes"] == groups["replica_bytes_per_step"] == g / 2  # 2 (r-1)/r x G/s
    assert groups["replica_ratio_to_lower_bound"] == 1.0
    assert "across replicas" in stats.summary()


# ---------------------------------------------------------------------------------------------------------
# checkpoints at another mesh shape
# ---------------------------------------------------------------------------------------------------------

RESUME_N, RESUME_GLOBAL = 24, 12  # 2 steps per epoch at global batch 12 (3 per rank)


def _resume_chain(tmp: Path, layout: str) -> list[list[dict[str, Any]]]:
    """Save at 2 x 2 after epoch 1, resume at 1 x 4 for epoch 2 and save, resume at 4 x 1 for epoch 3."""
    first, second = str(tmp / "a"), str(tmp / "b")
    common: dict[str, Any] = {"optimizer": "adam", "n": RESUME_N, "batch": RESUME_GLOBAL // WORLD}
    return run_on_two_machines(
        [
            fit_job(hybrid(checkpoint=layout), epochs=1, save_to=first, **common),
            fit_job(
                hybrid(checkpoint=layout, shard_size=4),
                epochs=2, resume_from=first + "/saved.ckpt", save_to=second, **common,
            ),
            fit_job(hybrid(checkpoint=layout, shard_size=1), epochs=3, resume_from=second + "/saved.ckpt", **common),
        ]
    )  # fmt: skip


def _assert_resumed_like_straight(runs: list[list[dict[str, Any]]]) -> None:
    shapes = [run[0]["mesh_shape"] for run in runs]
    assert shapes == [(2, 2), (1, 4), (4, 1)]
    for run, epochs in zip(runs, (1, 2, 3)):
        expected, _ = reference_run(
            OptRegressor("adam").double(), make_data(n=RESUME_N), RESUME_GLOBAL, 2 * epochs, "adam"
        )
        for record in run:
            assert record["global_step"] == 2 * epochs
            torch.testing.assert_close(record["weights"], expected)


@pytest.mark.slow  # resharding on resume is proved at another world size in the default suite (test_sharded.py)
@pytest.mark.timeout(600)
def test_sharded_checkpoint_resumes_at_other_mesh_shapes(tmp_path):
    _assert_resumed_like_straight(_resume_chain(tmp_path, "sharded"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_consolidated_checkpoint_resumes_at_other_mesh_shapes(tmp_path):
    _assert_resumed_like_straight(_resume_chain(tmp_path, "consolidated"))


# ---------------------------------------------------------------------------------------------------------
# one mesh per process group: several Trainer calls in the same processes (as under torchrun)
# ---------------------------------------------------------------------------------------------------------


class ValidatedRegressor(MeshRegressor):
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)


def _fit_then_validate(rank: int, port: int, out: str) -> None:
    # what torchrun sets for each process: Lightning starts no process of its own, the process group stays up
    # from one Trainer call to the next
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", LOCAL_RANK=str(rank))
    os.environ["WORLD_SIZE"] = "2"
    torch.set_num_threads(1)
    try:
        strategy = MGPUShardedStrategy(stage=3, mesh="hybrid", shard_size=1)  # 2 replicas of 1 shard
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        )  # fmt: skip
        model, data = ValidatedRegressor("sgd").double(), RankData(make_data(n=16), B)
        trainer.fit(model, datamodule=data)
        mesh, groups_after_fit = strategy.device_mesh, len(_compat.process_groups())
        data_mesh = strategy._sharded.device_mesh().data  # HSDP's (data_replicate, data_shard)
        trainer.validate(model, dataloaders=DataLoader(make_data(n=8), batch_size=B))
        trainer.validate(model, dataloaders=DataLoader(make_data(n=8), batch_size=B))
        record = {
            "same_mesh": strategy.device_mesh is mesh and model.device_mesh is mesh,
            "groups": (groups_after_fit, len(_compat.process_groups())),
        }
        mesh_groups = [*mesh.get_all_groups(), *data_mesh.get_all_groups()]
        comm.destroy_group()  # the process group's end
        record["left_behind"] = [g for g in mesh_groups if g in _compat.process_groups()]
        torch.save(record, Path(out) / f"rank{rank}.pt")
    except BaseException:
        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.mark.timeout(300)
def test_the_mesh_is_built_once_per_process_group_and_ends_with_it():
    """fit, then validate twice, with the same strategy in the same processes: one mesh (the one the module was
    sharded over), no new process groups (before, each call built another hybrid mesh: 2 more groups per call on 2
    processes, never destroyed); the mesh's groups end with the process group."""
    with tempfile.TemporaryDirectory() as out:
        try:
            mp.start_processes(_fit_then_validate, nprocs=2, start_method="fork", args=(find_free_network_port(), out))
        except Exception as err:
            errors = "\n".join(p.read_text() for p in sorted(Path(out).glob("*.err")))
            raise AssertionError(f"a rank failed:\n{errors}") from err
        ranks = [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for record in ranks:
        assert record["same_mesh"]
        after_fit, after_validate = record["groups"]
        assert after_validate == after_fit
        assert record["left_behind"] == []
