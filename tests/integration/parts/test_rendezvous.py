"""Start-up without a silent wait (parts/rendezvous.py), as a user meets it: a script run with ``num_nodes=2`` on one
machine, a missing rank under torchrun's variables, and a ``MASTER_PORT`` another process holds. Each job ends
non-zero within a bound, every waiting process names what is missing and how to start it, and nothing is left
running."""

from __future__ import annotations

import os
import socket
import textwrap
from pathlib import Path

import pytest

from tests.scripts import ScriptRun, Scripts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCRIPT = textwrap.dedent(
    """
    import sys
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    import lightning_mgpu  # noqa: F401  (registers the presets)

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)

    devices, num_nodes, strategy = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    trainer = pl.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Model())
    """
)

JOIN_TIMEOUT_S = 15  # short for the test; the default is 30 s after the last rank joined


def _run(tmp_path: Path, args: list[str], env: dict[str, str], scripts: Scripts) -> ScriptRun:
    """The script as a user runs it, in the environment ``env`` adds to: its process (forked from the session's script
    runner, which has imported torch and nothing of Lightning or the pack) is rank 0, a popen launch's re-run of it in a
    fresh interpreter the other local rank."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    full_env = {**os.environ, "LIGHTNING_MGPU_JOIN_TIMEOUT": str(JOIN_TIMEOUT_S), **env}
    return scripts.run(script, timeout=200, args=tuple(args), env=full_env)


def test_num_nodes_2_on_one_machine_says_so_then_names_the_missing_node(tmp_path, scripts):
    proc = _run(tmp_path, ["2", "2", "mgpu_hsdp"], {}, scripts)
    err = proc.stderr
    assert proc.returncode != 0, err[-3000:]
    assert proc.leftovers == []
    # said before any rank waits: the announcement comes before the first rank's join
    announced = err.index("lightning-mgpu: num_nodes=2 but no cluster environment to join")
    assert announced < err.index("MEMBER: 1/4")
    # every waiting process (ranks 0 and 1 of node 0) names node 1, what it expected and how to start it
    for rank in (0, 1):
        line = next(x for x in err.splitlines() if f"rank {rank} of 4 stops waiting" in x)
        assert "node 1 (ranks 2-3)" in line, line
        assert "Expected 4 ranks = num_nodes=2 x 2 process(es) per node" in line, line
    assert err.count("NODE_RANK=1 python") >= 3  # the announcement and both ranks' errors
    assert "torchrun --nnodes 2 --nproc-per-node 2" in err and "srun --nodes 2 --ntasks-per-node 2" in err


def test_a_missing_rank_under_torchrun_variables_is_named(tmp_path, scripts):
    # what torchrun sets for rank 0 of 2 nodes x 1 process (without its agent store); rank 1 never starts
    port = _free_port()
    env = {
        "TORCHELASTIC_RUN_ID": "first-hour", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
    }  # fmt: skip
    proc = _run(tmp_path, ["1", "2", "mgpu_ddp"], env, scripts)
    err = proc.stderr
    assert proc.returncode != 0, err[-3000:]
    assert proc.leftovers == []
    assert "rank 0 of 2 stops waiting" in err, err[-3000:]
    assert "node 1 (rank 1)" in err
    torchrun = "torchrun --nnodes 2 --nproc-per-node 1 --node-rank <node> --master-addr <this machine's address>"
    assert f"{torchrun} --master-port {port} " in err


def test_a_master_port_in_use_is_named_and_the_job_ends(tmp_path, scripts):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = _run(tmp_path, ["2", "1", "mgpu_ddp"], {"MASTER_PORT": str(port)}, scripts)
    err = proc.stderr
    assert proc.returncode != 0, err[-3000:]
    assert proc.leftovers == []
    assert f"rank 0 cannot listen on port {port}: another process holds it" in err, err[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
