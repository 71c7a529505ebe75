"""Two "nodes" on one machine, as a cluster launches them: torchrun ``--nnodes 2`` on loopback (Lightning's
TorchElasticEnvironment) and a simulated ``srun`` (the variables SLURM sets, Lightning's SLURMEnvironment),
1 process per node, each running ``python -m lightning_mgpu fit --config configs/ddp.yaml``. Lightning must
detect the cluster, not relaunch (the cluster made the processes), and the two nodes must train one model."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning_fabric.plugins.environments.lightning import find_free_network_port

ROOT = Path(__file__).resolve().parents[1]

PROBE = '''
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
    (tmp_path / "probe.py").write_text(PROBE)
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
