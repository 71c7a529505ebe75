"""Launches as clusters and users make them: two "nodes" on loopback, an elastic restart, and fork launches in a
process torch marks as a bad fork.

* Multi-node. Two "nodes" on one machine, as a cluster launches them: torchrun ``--nnodes 2`` on loopback
(Lightning's TorchElasticEnvironment) and a simulated ``srun`` (the variables SLURM sets, Lightning's
SLURMEnvironment), 1 process per node, each running ``python -m lightning_mgpu fit --config configs/ddp.yaml``.
Lightning must detect the cluster, not relaunch (the cluster made the processes), and the two nodes must train one
model.

* Elastic. Elastic restart under ``torchrun --max-restarts 1`` on loopback: one worker is SIGKILLed in the middle of
epoch 2; torchrun restarts the group, the restarted run resumes from ``last.ckpt`` by itself (configs/elastic.yaml:
``ckpt_path: last``, ``ModelCheckpoint(dirpath fixed, save_last)``), and the final weights and optimizer step count
equal an uninterrupted run of the same config (``lightning-mgpu fit`` under a fork launch of the same strategy: the
same ranks, seeds and samplers, so the same weights to the bit as an uninterrupted torchrun job, in a fraction of its
time).

What makes it work: the killed rank's peer ends at once and names it (tests/integration/parts/test_failures.py) so
torchrun sees the failure without waiting for a timeout; ``last.ckpt`` is written atomically, so a kill during a
save cannot leave a half file for the restart to load (tests/integration/plugins/test_checkpoint_io.py); an epoch
that restarts from its beginning replays the same data order (the sampler is seeded by seed and epoch).

* Fork in a bad fork. torch's CUDA wheel without a GPU: every ``Trainer`` asks CUDA for the device count, and torch
then marks each process forked afterwards as a "bad fork" (``torch.cuda._is_in_bad_fork()``). Lightning's fork
launcher refuses to start in such a process, even for CPU workers that never touch CUDA; the mgpu fork presets start
(their CPU workers are safe), and keep Lightning's refusal on CUDA. On the CPU wheel the state is simulated the way
torch reports it; on the CUDA wheel (``make test-compat``) it is real.

* Fork after the parent's thread pools. A fork launch from a process that compiled with inductor, or that ran a
parallel CPU operator with more than one thread, starts ranks that inherit pools without their threads: each mgpu
fork launch ends, where Lightning's ``ddp_notebook`` (the negative control) hangs.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.environments.lightning import find_free_network_port
from pytorch_lightning.strategies import DDPStrategy

from lightning_mgpu import MGPUDDPStrategy, MGPUShardedStrategy
from tests.helpers import RankData, Regressor, make_data, run_isolated

ROOT = Path(__file__).resolve().parents[3]

MULTINODE_PROBE = '''
import torch
from pytorch_lightning.callbacks import Callback


class Probe(Callback):
    """Saves what this process saw of the cluster, and its weights, after fit."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_fit_end(self, trainer, pl_module) -> None:
        torch.save(
            {
                "env": type(trainer.strategy.cluster_environment).__name__,
                "strategy": type(trainer.strategy).__name__,
                "external": trainer.strategy.cluster_environment.creates_processes_externally,
                "node_rank": trainer.node_rank,
                "global_rank": trainer.global_rank,
                "local_rank": trainer.local_rank,
                "world_size": trainer.world_size,
                "num_nodes": trainer.num_nodes,
                "steps": trainer.global_step,
                "weights": torch.cat([p.detach().flatten() for p in pl_module.parameters()]),
            },
            f"{self.out}/rank{trainer.global_rank}.pt",
        )
'''


def fit_args(out: Path) -> list[str]:
    return [
        "-m", "lightning_mgpu", "fit", "--config", str(ROOT / "configs" / "ddp.yaml"),
        "--trainer.devices", "1", "--trainer.num_nodes", "2", "--trainer.max_epochs", "1",
        "--trainer.limit_train_batches", "8", "--trainer.limit_val_batches", "2",
        "--trainer.default_root_dir", str(out), "--trainer.callbacks+=probe.Probe", f"--trainer.callbacks.out={out}",
    ]  # fmt: skip


def launch(commands: list[tuple[list[str], dict[str, str]]], cwd: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(cwd), str(ROOT), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            cmd, env={**env, **extra}, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )
        for cmd, extra in commands
    ]  # fmt: skip
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:  # a hung node must not outlive the test, nor the ranks it launched
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]


def torchrun_nodes(out: Path) -> list[tuple[list[str], dict[str, str]]]:
    port = str(find_free_network_port())
    return [
        (
            [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port, *fit_args(out),
            ],
            {},
        )
        for node in (0, 1)
    ]  # fmt: skip


def slurm_nodes(out: Path) -> list[tuple[list[str], dict[str, str]]]:
    """What ``srun --nodes 2 --ntasks-per-node 1`` sets in each task's environment (hosts on loopback)."""
    common = {
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "mgpu-test", "SLURM_NTASKS": "2", "SLURM_NNODES": "2",
        "SLURM_NTASKS_PER_NODE": "1", "SLURM_NODELIST": "127.0.0.1", "MASTER_PORT": str(find_free_network_port()),
    }  # fmt: skip
    return [
        (
            [sys.executable, *fit_args(out)],
            {**common, "SLURM_PROCID": str(node), "SLURM_NODEID": str(node), "SLURM_LOCALID": "0"},
        )
        for node in (0, 1)
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nodes", "environment"),
    [(torchrun_nodes, "TorchElasticEnvironment"), (slurm_nodes, "SLURMEnvironment")],
    ids=["torchrun", "slurm"],
)
def test_two_nodes_on_loopback_train_one_model(nodes, environment, tmp_path):
    (tmp_path / "probe.py").write_text(MULTINODE_PROBE)
    launch(nodes(tmp_path), tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for r, seen in enumerate(ranks):
        assert seen["env"] == environment
        assert seen["strategy"] == "MGPUDDPStrategy"
        assert seen["external"]  # the cluster made the processes: the popen launcher re-runs nothing
        assert (seen["node_rank"], seen["global_rank"], seen["local_rank"]) == (r, r, 0)
        assert (seen["world_size"], seen["num_nodes"]) == (2, 2)
        assert seen["steps"] == 4  # 8 batches, accumulate_grad_batches 2
    assert torch.equal(ranks[0]["weights"], ranks[1]["weights"])  # one model: the nodes' replicas agree


# --- elastic restart: torchrun --max-restarts 1 ---

ELASTIC_PROBE = '''
import os, signal, torch
from pytorch_lightning.callbacks import Callback


class KillOnce(Callback):
    """SIGKILLs global rank 1 at (epoch, batch) on torchrun's first attempt only."""

    def __init__(self, epoch: int = 2, batch: int = 3) -> None:
        self.epoch, self.batch = epoch, batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        at = (trainer.current_epoch, batch_idx) == (self.epoch, self.batch)
        if first_attempt and at and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)


class Final(Callback):
    """Rank 0 saves the final weights, the step count and the attempt that finished."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.start_epoch = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.start_epoch = trainer.current_epoch  # 0 for a fresh run; the resumed epoch after a restart

    def on_fit_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            torch.save(
                {
                    "weights": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                    "steps": trainer.global_step,
                    "start_epoch": self.start_epoch,
                    "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                },
                f"{self.out}/final.pt",
            )
'''


def torchrun(workdir: Path, kill: bool) -> dict:
    """The elastic config under ``torchrun --max-restarts 1`` (rank 1 killed once in epoch 2 with ``kill``)."""
    workdir.mkdir()
    (workdir / "probe.py").write_text(ELASTIC_PROBE)
    callbacks = ["--trainer.callbacks+=probe.Final", f"--trainer.callbacks.out={workdir}"]
    if kill:
        callbacks += ["--trainer.callbacks+=probe.KillOnce"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(workdir), str(ROOT), env.get("PYTHONPATH", "")])
    proc, _ = run_isolated(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "1", "-m", "lightning_mgpu", "fit", "--config", str(ROOT / "configs" / "elastic.yaml"),
            "--trainer.max_epochs", "3", *callbacks,
        ],
        timeout=300, cwd=workdir, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = torch.load(workdir / "final.pt")
    result["log"] = proc.stdout + proc.stderr
    return result


def uninterrupted(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """The reference: the same config, probe and data, fit uninterrupted by ``lightning-mgpu fit`` in this process
    under a fork launch of the same strategy (``mgpu_ddp_notebook``): the same two gloo ranks, seeds and samplers as
    torchrun's, so the same weights to the bit (a straight torchrun run of it gave them), without a torchrun job's
    three interpreters."""
    from lightning_mgpu.cli import main

    workdir.mkdir()
    (workdir / "probe.py").write_text(ELASTIC_PROBE)
    monkeypatch.chdir(workdir)  # the config's checkpoint folder is relative, as torchrun's workers see it
    monkeypatch.syspath_prepend(str(workdir))
    main(
        [
            "fit", "--config", str(ROOT / "configs" / "elastic.yaml"), "--trainer.max_epochs", "3",
            "--trainer.strategy", "mgpu_ddp_notebook",
            "--trainer.callbacks+=probe.Final", f"--trainer.callbacks.out={workdir}",
        ]
    )  # fmt: skip
    sys.modules.pop("probe", None)
    return torch.load(workdir / "final.pt")


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_run_resumes_to_the_same_weights(tmp_path, monkeypatch):
    restarted = torchrun(tmp_path / "restarted", kill=True)
    straight = uninterrupted(tmp_path / "straight", monkeypatch)
    assert straight["attempt"] == 0
    assert restarted["attempt"] == 1  # torchrun restarted the group once
    assert "rank 1 of 2 is gone" in restarted["log"]  # rank 0 named the killed worker before the restart
    assert "Restored all states from the checkpoint" in restarted["log"]
    assert (straight["start_epoch"], restarted["start_epoch"]) == (0, 2)  # resumed after epoch 1's last.ckpt
    assert restarted["steps"] == straight["steps"]
    for name, value in straight["weights"].items():
        torch.testing.assert_close(restarted["weights"][name], value, rtol=0, atol=0, msg=name)


# --- fork launches in a process torch marks as a bad fork ---


def _fit_two_steps(strategy: Any, module: Regressor, out: Path) -> None:
    """Two steps of ``module`` on 2 CPU ranks; writes "ok" to ``out``, or the traceback of what failed."""
    try:
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        )  # fmt: skip
        trainer.fit(module.double(), datamodule=RankData(make_data(n=16), 4))
        out.write_text("ok")
    except BaseException:
        out.write_text(traceback.format_exc())


def _fit_in_a_fork_child(strategy: Any, out: Path) -> None:
    torch.cuda._is_in_bad_fork = lambda: True  # what torch reports here on its CUDA wheel after a device-count query
    _fit_two_steps(strategy, Regressor(), out)


def _run(strategy: Any, tmp_path: Path, target: Any = None, hang_s: float | None = None) -> str | None:
    """``target(strategy, out)`` (default: the bad-fork fit) in a fork child of this process, bounded; what it wrote.
    A child still running after 120 s fails the test; with ``hang_s``, a child still running then is the expected
    outcome and the call returns ``None``. Either way the child is killed, with its session where the target made
    one (and so the ranks it forked)."""
    out = tmp_path / "result.txt"
    child = multiprocessing.get_context("fork").Process(target=target or _fit_in_a_fork_child, args=(strategy, out))
    child.start()
    child.join(timeout=hang_s or 120)
    if child.is_alive():
        with contextlib.suppress(ProcessLookupError):
            if os.getsid(child.pid) == child.pid:
                os.killpg(child.pid, signal.SIGKILL)
            else:
                child.kill()
        child.join()
        if hang_s is None:
            pytest.fail("the forked fit did not end")
        return None
    return out.read_text()


def test_a_cpu_fork_launch_starts_in_a_process_torch_marks_as_a_bad_fork(tmp_path):
    assert _run(MGPUDDPStrategy(start_method="fork"), tmp_path) == "ok"


def test_lightnings_own_fork_launcher_refuses_there(tmp_path):
    """Negative control: the state the test above starts in is the one Lightning refuses."""
    assert "Cannot re-initialize CUDA in forked subprocess" in _run(DDPStrategy(start_method="fork"), tmp_path)


HSDP_PROBE = '''
import torch
from pytorch_lightning.callbacks import Callback


class Probe(Callback):
    """Saves the mesh this rank trained on (from the ledger) and the full weights, after fit."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_fit_end(self, trainer, pl_module) -> None:
        stats = trainer.strategy.comm_stats
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in pl_module.state_dict().items()}
        torch.save(
            {
                "env": type(trainer.strategy.cluster_environment).__name__,
                "node_rank": trainer.node_rank,
                "mesh": (stats.replicas, stats.shard_size),
                "syncs": (stats.sync_rounds, stats.optimizer_steps),
                "weights": torch.cat([state[n].flatten() for n, _ in pl_module.named_parameters()]),
            },
            f"{self.out}/rank{trainer.global_rank}.pt",
        )
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hsdp_under_torchrun_on_two_nodes_shards_within_each_node(tmp_path):
    """configs/hsdp.yaml under ``torchrun --nnodes 2 --nproc-per-node 2`` on loopback: the shard group is the 2
    processes of a node (from ``--trainer.num_nodes 2`` and TorchElasticEnvironment), 2 replicas, one gradient sync
    per optimizer step under accumulation 2, and the 4 ranks end with the same weights."""
    (tmp_path / "probe.py").write_text(HSDP_PROBE)
    port = str(find_free_network_port())
    args = [
        "-m", "lightning_mgpu", "fit", "--config", str(ROOT / "configs" / "hsdp.yaml"),
        "--trainer.devices", "2", "--trainer.num_nodes", "2", "--trainer.max_epochs", "1",
        "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "1",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.callbacks+=probe.Probe",
        f"--trainer.callbacks.out={tmp_path}",
    ]  # fmt: skip
    launch(
        [
            (
                [
                    sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                    "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", port, *args,
                ],
                {},
            )
            for node in (0, 1)
        ],
        tmp_path,
    )  # fmt: skip
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    for r, seen in enumerate(ranks):
        assert (seen["env"], seen["node_rank"]) == ("TorchElasticEnvironment", r // 2)
        assert seen["mesh"] == (2, 2)  # 2 replicas (the nodes) of shard groups of 2 (the processes of a node)
        assert seen["syncs"] == (2, 2)  # 4 batches, accumulate_grad_batches 2: one sync per optimizer step
        torch.testing.assert_close(seen["weights"], ranks[0]["weights"], rtol=0, atol=0)


# --- fork launches after inductor compiled in the parent ---


WAIT_S = 5  # a live pool answers in milliseconds; a pool without a thread never does


class _CompilesInItsRanks(Regressor):
    """Each training step hands a task to inductor's compile thread pool, as compiling a kernel does, and waits a
    bounded time for it: a rank whose pool has no thread raises ``TimeoutError`` instead of hanging."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        from torch._inductor.async_compile import AsyncCompile

        assert AsyncCompile.submit(lambda: 7).result(timeout=WAIT_S) == 7
        return super().training_step(batch, batch_idx)


def _fit_after_compiling(strategy: Any, out: Path) -> None:
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile

    config.compile_threads = 2  # inductor's pool path, as on any machine of 2 cores or more
    AsyncCompile.pool().submit(lambda: None).result()  # what compiling a model here leaves: a pool with a thread
    _fit_two_steps(strategy, _CompilesInItsRanks(), out)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["mgpu_ddp_notebook", "lightning_ddp_notebook"])
def test_a_fork_launch_after_inductor_compiled_in_the_parent_does_not_hang(strategy, tmp_path):
    """A notebook that compiled a model with inductor, then ``Trainer(strategy="mgpu_ddp_notebook")``: torch's
    at-fork hook resets inductor's compile process pool but not its thread pool, so each fork child inherits an
    executor whose threads do not exist, and its first kernel compile waits for ever (reproduced with
    ``torch.compile`` and a bare ``os.fork``). The pack's fork launch gives each rank a pool of its own
    (``_compat.forget_inherited_compile_threads``); Lightning's ``ddp_notebook`` is the negative control, its ranks
    bounded here by the step's wait (``WAIT_S``). The whole is run in a fork child, so this process keeps no pool."""
    result = _run(strategy.removeprefix("lightning_"), tmp_path, _fit_after_compiling)  # Lightning's: "ddp_notebook"
    if strategy == "mgpu_ddp_notebook":
        assert result == "ok"
    else:
        assert "TimeoutError" in result


# --- fork launches after the parent ran a parallel CPU operator ---


HANG_S = 15  # Lightning's run of the same two steps ends in about 2 s when it does not hang


def _parallel_op() -> torch.Tensor:
    """A matrix product large enough that torch runs it on its OpenMP thread pool (with more than one thread)."""
    x = torch.randn(512, 512, dtype=torch.float32)
    return x @ x


class _ThreadsInItsRanks(Regressor):
    """Each training step runs a parallel CPU operator, as a user's step or collate does; rank 0 writes its thread
    count to ``threads_out`` at the end."""

    def __init__(self, threads_out: Path) -> None:
        super().__init__()
        self.threads_out = threads_out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _parallel_op()
        return super().training_step(batch, batch_idx)

    def on_train_end(self) -> None:
        if self.trainer.is_global_zero:
            self.threads_out.write_text(str(torch.get_num_threads()))


def _fit_after_a_parallel_op(strategy: Any, out: Path) -> None:
    os.setsid()  # a session of its own: a hung run is killed with its ranks
    torch.set_num_threads(2)  # a notebook's kernel on a machine of several cores: torch's default
    os.environ["OMP_NUM_THREADS"] = "2"  # Lightning's fork launcher keeps this count in each rank
    _parallel_op()  # what any CPU work in the kernel leaves: an OpenMP pool whose threads live in this process only
    _fit_two_steps(strategy, _ThreadsInItsRanks(out.with_name("threads.txt")), out)


@pytest.mark.slow
def test_a_fork_launch_after_a_parallel_cpu_operator_in_the_parent_does_not_hang(tmp_path):
    """torch runs CPU operators on an OpenMP pool (libgomp) whose threads a fork child does not have: a forked rank
    that runs a parallel operator with more than one thread waits for them for ever. Lightning's fork launcher
    gives each rank ``cpu_count() // devices`` threads (or ``OMP_NUM_THREADS``), so a notebook that ran a forward
    pass on the CPU before ``ddp_notebook`` hangs on a machine of more than two cores; the pack's fork launch gives
    each rank one thread (``launchers._one_intra_op_thread``). Lightning's ``ddp_notebook`` is the negative control,
    where torch's parallel backend is OpenMP: its run has not ended after ``HANG_S`` (a run that ends takes about
    2 s), and is killed with its ranks. Each run is in a fork child of this process, whose threads stay as they
    are."""
    assert _run("mgpu_ddp_notebook", tmp_path, _fit_after_a_parallel_op) == "ok"
    assert (tmp_path / "threads.txt").read_text() == "1"
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():  # another backend has no such pool
        assert _run("ddp_notebook", tmp_path, _fit_after_a_parallel_op, hang_s=HANG_S) is None


# --- fork launches after the parent ran DTensor operators ---


class _MeshCoordinates(Regressor):
    """Each rank writes, at the end, where the mesh of its first sharded parameter places it."""

    def __init__(self, out_dir: Path) -> None:
        super().__init__()
        self.out_dir = out_dir

    def on_train_end(self) -> None:
        coordinate = next(iter(self.parameters())).device_mesh.get_coordinate()
        (self.out_dir / f"coordinate{self.trainer.global_rank}.txt").write_text(str(coordinate))


def _fit_after_dtensor_ops(strategy: Any, out: Path, forget: bool = True) -> None:
    """Rank 0 of a fake two-rank group in this process shards a layer and runs it (as the planner's measurements do),
    then a fork launch trains ``strategy``; ``forget=False`` keeps the caches the fork inherits (negative control)."""
    from torch.distributed.fsdp import fully_shard

    from lightning_mgpu.mesh import ParallelDims
    from lightning_mgpu.planning.measure import fake_process_group
    from lightning_mgpu.strategies import launchers

    with fake_process_group(2):  # the same model as the fit's: the cached specs are per operator and shape
        fully_shard(Regressor().double(), mesh=ParallelDims(world_size=2).build("cpu").data)
    if not forget:
        launchers.forget_inherited_dtensor_caches = lambda: None
    _fit_two_steps(strategy, _MeshCoordinates(out.parent), out)


def _fit_keeping_the_caches(strategy: Any, out: Path) -> None:
    _fit_after_dtensor_ops(strategy, out, forget=False)


@pytest.mark.slow
def test_a_fork_launch_after_dtensor_operators_in_the_parent_places_each_rank_at_its_own_coordinate(tmp_path):
    """torch caches the output specs of DTensor operators keyed by the device mesh's layout, not by the rank that
    built it; a rank forked from a process that ran DTensor operators over a two-rank mesh as rank 0 reused specs
    placing it at coordinate 0, and a sharded checkpoint then held half of every tensor. Each rank of the pack's fork
    launch forgets those caches (``_compat.forget_inherited_dtensor_caches``); kept (the negative control), rank 1's
    parameters say they are rank 0's shard."""
    strategy = lambda: MGPUShardedStrategy(stage=3, start_method="fork")  # noqa: E731
    (tmp_path / "kept").mkdir()
    assert _run(strategy(), tmp_path, _fit_after_dtensor_ops) == "ok"
    assert [(tmp_path / f"coordinate{r}.txt").read_text() for r in range(2)] == ["(0,)", "(1,)"]
    assert _run(strategy(), tmp_path / "kept", _fit_keeping_the_caches) == "ok"
    assert [(tmp_path / "kept" / f"coordinate{r}.txt").read_text() for r in range(2)] == ["(0,)", "(0,)"]
