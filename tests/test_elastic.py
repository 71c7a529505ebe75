"""Elastic restart under ``torchrun --max-restarts 1`` on loopback: one worker is SIGKILLed in the middle of
epoch 2; torchrun restarts the group, the restarted run resumes from ``last.ckpt`` by itself
(configs/elastic.yaml: ``ckpt_path: last``, ``ModelCheckpoint(dirpath fixed, save_last)``), and the final
weights and optimizer step count equal an uninterrupted run of the same command.

What makes it work: the killed rank's peer ends at once and names it (tests/test_failures.py) so torchrun
sees the failure without waiting for a timeout; ``last.ckpt`` is written atomically, so a kill during a save
cannot leave a half file for the restart to load (tests/test_atomic_checkpoints.py); an epoch that restarts
from its beginning replays the same data order (the sampler is seeded by seed and epoch)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import run_isolated

ROOT = Path(__file__).resolve().parents[1]

PROBE = '''
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
    workdir.mkdir()
    (workdir / "probe.py").write_text(PROBE)
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


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_run_resumes_to_the_same_weights(tmp_path):
    straight = torchrun(tmp_path / "straight", kill=False)
    restarted = torchrun(tmp_path / "restarted", kill=True)
    assert straight["attempt"] == 0
    assert restarted["attempt"] == 1  # torchrun restarted the group once
    assert "rank 1 of 2 is gone" in restarted["log"]  # rank 0 named the killed worker before the restart
    assert "Restored all states from the checkpoint" in restarted["log"]
    assert (straight["start_epoch"], restarted["start_epoch"]) == (0, 2)  # resumed after epoch 1's last.ckpt
    assert restarted["steps"] == straight["steps"]
    for name, value in straight["weights"].items():
        torch.testing.assert_close(restarted["weights"][name], value, rtol=0, atol=0, msg=name)
