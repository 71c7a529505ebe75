"""One replica group of the fault-tolerance tests (``test_fault_tolerance.py``), a script as a user's would be: a
LightningModule trained by ``Trainer(strategy=MGPUDDPStrategy(fault_tolerance=...))`` (``--strategy ddp``; ``zero3``:
``MGPUShardedStrategy(stage=3, ...)``; ``diloco``: ``MGPUDiLoCoStrategy(sync_every=4, ...)``).

``python fault_tolerance_worker.py NAMESPACE OUT GROUP LIGHTHOUSE [--die-after N] [--seed SEED] [--devices N]
[--signal NAME] [--wait NAME:STEP ...]``

Every training batch appends one line to ``OUT/group{GROUP}.jsonl`` as it ends (so a killed group's lines stay): the
step count before and after it, the dataset rows it trained on, a draw of torch's random generator, its accumulation
window (``--accumulate`` micro-batches per optimizer step), the groups in its quorum, this process's pid; under
``diloco`` also the syncs this process took part in so far, how many committed, whether its group contributed to the
last one, and torchft's committed count after it (each rank adds one more such line, ``"final": true``, once fit has
ended: after the last period's sync; the rank that kills itself one, ``"killed": true``, before it does).
With ``--die-after N``, the group's last rank SIGKILLs itself in the forward of its (N+1)-th batch (``--die-in
validation``: in the validation that follows its N-th batch, with ``--validate``; ``--die-in checkpoint``: its
first rank, half-way through writing the checkpoint of step N; the other ranks of the group then fail in their next
collective, and the group ends). The test's choreography: ``--signal NAME`` writes ``OUT/NAME``
when training starts (the group has joined the lighthouse's job); ``--wait NAME:STEP`` holds the group before the
batch that would make step STEP+1 until ``OUT/NAME`` exists (0: when training starts). At the end,
``OUT/weights{GROUP}.pt`` holds the weights and ``OUT/end{GROUP}.json`` the part's counts; ``--log`` adds a CSV
logger (``OUT/logs/group{GROUP}``), ``--checkpoint-every N`` a checkpoint callback (``OUT/checkpoints``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("namespace", choices=("pytorch_lightning", "lightning"))
parser.add_argument("out", type=Path)
parser.add_argument("group", type=int)
parser.add_argument("lighthouse")
parser.add_argument("--die-after", type=int, default=None)
parser.add_argument("--die-in", choices=("training", "validation", "checkpoint"), default="training")
parser.add_argument("--validate", action="store_true")  # 2 validation batches after every 4 training batches
parser.add_argument("--hang-after", type=int, default=None)
parser.add_argument("--signal", default=None)
parser.add_argument("--wait", action="append", default=[])
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--devices", type=int, default=1)
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--strategy", choices=("ddp", "zero3", "diloco"), default="ddp")
parser.add_argument("--start-method", default="fork")
parser.add_argument("--max-steps", type=int, default=24)
parser.add_argument("--pause", type=float, default=0.05)
parser.add_argument("--quorum-timeout", type=float, default=60)
parser.add_argument("--step-timeout", type=float, default=600)
parser.add_argument("--checkpoint-every", type=int, default=None)
parser.add_argument("--log", action="store_true")  # a CSV logger into OUT/logs/group{GROUP}, every step
args = parser.parse_args()

if args.namespace == "lightning":
    import lightning.pytorch as pl

    from lightning_mgpu.lightning import MGPUDDPStrategy, MGPUDiLoCoStrategy, MGPUShardedStrategy
else:
    import pytorch_lightning as pl

    from lightning_mgpu import MGPUDDPStrategy, MGPUDiLoCoStrategy, MGPUShardedStrategy

torch.set_default_dtype(torch.float64)
ROWS, FEATURES, BATCH, GROUPS = 256, 4, 8, 2
LR, MOMENTUM = 0.05, 0.9
SYNC_EVERY, OUTER_LR, OUTER_MOMENTUM = 4, 0.7, 0.9  # diloco


def decay(step: int) -> float:
    return 1.0 / (1.0 + 0.1 * step)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, FEATURES, generator=g)
    return x, x @ torch.randn(FEATURES, 1, generator=g) + 0.1 * torch.randn(ROWS, 1, generator=g)


class Indexed(Dataset):
    def __init__(self) -> None:
        self.x, self.y = data()

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


class Net(pl.LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))

    def on_train_start(self):
        if args.signal is not None:
            (args.out / args.signal).touch()
        self._batches = 0
        self._hold(0)

    def _hold(self, step: int) -> None:
        for name, at in (w.split(":") for w in args.wait):
            while int(at) == step and not (args.out / name).exists():
                time.sleep(0.05)

    def training_step(self, batch, batch_idx):
        rows, x, y = batch
        self._before, self._rows = self.trainer.global_step, rows.tolist()
        self._draw = torch.rand(()).item()  # the random state: a healed group goes on with the live group's
        self._window = self._batches // args.accumulate  # the optimizer step's micro-batches share one window
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        if self._dies("training"):
            if args.strategy == "diloco":  # the sync at this step's start took this rank's period: said before dying
                self._write({"killed": True, "rank": self.global_rank, "pid": os.getpid(), **self._syncs()})
            os.kill(os.getpid(), signal.SIGKILL)  # in the middle of the step: after its forward, before its backward
        if args.hang_after is not None and self._batches == args.hang_after:
            time.sleep(3600)  # stuck in user code, alive: its heartbeats to the lighthouse go on
        self._batches += 1
        return loss

    def _dies(self, where: str) -> bool:
        last = self.global_rank == args.devices - 1
        return args.die_in == where and args.die_after is not None and self._batches == args.die_after and last

    def validation_step(self, batch, batch_idx):
        _, x, y = batch
        if self._dies("validation"):  # in the middle of the validation after its DIE_AFTER-th training batch
            os.kill(os.getpid(), signal.SIGKILL)
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        replicas = self.trainer.strategy.replicas
        line = {
            "before": self._before,
            "after": self.trainer.global_step,
            "rows": self._rows,
            "draw": self._draw,
            "window": self._window,
            "participants": replicas.participants,
            "rank": self.global_rank,
            "pid": os.getpid(),
            **self._syncs(),
        }
        self._write(line)
        time.sleep(args.pause)
        self._hold(self.trainer.global_step)

    def _syncs(self) -> dict:
        replicas = self.trainer.strategy.replicas
        if args.strategy != "diloco":
            return {}
        syncs = replicas.committed_steps + replicas.dropped_steps
        return {"syncs": syncs, "committed": replicas.committed_steps, "contributed": replicas.contributed,
                "participants": replicas.participants,
                "step": replicas.step}  # fmt: skip

    def _write(self, line: dict) -> None:
        with open(args.out / f"group{args.group}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    def on_fit_end(self):
        if args.strategy != "diloco":
            return
        self._write({"final": True, "rank": self.global_rank, "pid": os.getpid(), **self._syncs()})
        if self.global_rank == 0:  # the weights after the last period's sync (at the end of training)
            self._save({k: v.detach().clone() for k, v in self.state_dict().items()})

    def on_train_end(self):
        if args.strategy == "diloco":
            return  # on_fit_end: after the strategy's sync of the last period
        # every rank: ZeRO-3's weights are shards, gathered whole (a collective of the group)
        weights = {k: getattr(v, "full_tensor", v.detach)().detach().clone() for k, v in self.state_dict().items()}
        if self.global_rank == 0:
            self._save(weights)

    def _save(self, weights: dict) -> None:
        strategy = self.trainer.strategy
        torch.save(weights, args.out / f"weights{args.group}.pt")
        end = {
            "global_step": self.trainer.global_step,
            "committed": strategy.replicas.committed_steps,
            "dropped": strategy.replicas.dropped_steps,
            "heals": strategy.replicas.heals,
            "replica_group_bytes": strategy.comm_stats.replica_group_bytes,
            "heal_bytes": strategy.comm_stats.heal_bytes,
        }
        (args.out / f"end{args.group}.json").write_text(json.dumps(end))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)  # steps with committed steps only
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(Indexed(), batch_size=BATCH)

    def val_dataloader(self):
        return DataLoader(Indexed(), batch_size=BATCH)


def _dying_save(save):
    """``torch.save`` that, for the checkpoint of step ``--die-after``, writes part of it and SIGKILLs this process."""

    def dying(obj, f, *rest, **kwargs):
        if isinstance(obj, dict) and obj.get("global_step") == args.die_after and hasattr(f, "write"):
            f.write(b"half a checkpoint")
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return save(obj, f, *rest, **kwargs)

    return dying


if __name__ == "__main__":
    if args.die_in == "checkpoint" and args.die_after is not None:
        torch.save = _dying_save(torch.save)
    options = dict(
        fault_tolerance={
            "lighthouse": args.lighthouse,
            "replica_group": args.group,
            "replica_groups": GROUPS,
            "timeout": 10,
            "quorum_timeout": args.quorum_timeout,
            "step_timeout": args.step_timeout,
        },
        # inside the group: a dead rank ends the others after a 3 s roll call (parts/failures.py), not 10 s
        timeout=timedelta(seconds=12),
        # the group's ranks forked from this process: one import of torch and Lightning per group, not per rank
        start_method=args.start_method,
    )
    # inside a group: DDP, ZeRO-3 (FSDP2) whose shards the groups replicate, or DiLoCo (every rank its own inner steps)
    if args.strategy == "ddp":
        strategy = MGPUDDPStrategy(**options)
    elif args.strategy == "zero3":
        strategy = MGPUShardedStrategy(stage=3, **options)
    else:
        strategy = MGPUDiLoCoStrategy(
            sync_every=SYNC_EVERY, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, **options
        )
    model = Net(args.seed)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        logger=pl.loggers.CSVLogger(args.out / "logs", f"group{args.group}", flush_logs_every_n_steps=1)
        if args.log
        else False,
        log_every_n_steps=1,
        limit_val_batches=2 if args.validate else 0,
        val_check_interval=4 if args.validate else None,
        num_sanity_val_steps=0,
        enable_checkpointing=args.checkpoint_every is not None,
        callbacks=[
            pl.callbacks.ModelCheckpoint(
                args.out / "checkpoints", f"group{args.group}-{{step}}", every_n_train_steps=n, save_top_k=-1
            )
            for n in ([args.checkpoint_every] if args.checkpoint_every else [])
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    sys.exit(0)
