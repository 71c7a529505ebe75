"""The pack adds no host-device synchronisation to a training step: the same module, the same callbacks (the
``DeviceMonitor``, a logger that the comm ledger writes to, the progress bar showing a logged loss), counted with
:class:`tests.host_syncs.HostSyncs` under Lightning's own ``DDPStrategy`` and under each layout of the pack, in one
2-rank launch. Each layout's count per step is at most Lightning's; a module that reads its loss with ``float``
every step (the negative control) counts one more per step."""

from __future__ import annotations

import collections
import inspect
from pathlib import Path
from typing import Any, Callable

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.strategies import DDPStrategy
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_mgpu import DeviceMonitor, MGPUDDPStrategy, MGPUShardedStrategy
from tests.host_syncs import HostSyncs
from tests.models import Regressor, make_data
from tests.numerics_harness import run_jobs

STEPS = 6  # per rank: 48 samples, 2 ranks (1 data replica under the pipeline and tensor layouts), batch 4
EVERY = 2  # the monitor's interval and log_every_n_steps: the ledger and the monitor write every 2nd step


class LoggingRegressor(Regressor):
    """The tests' MLP, logging its loss on the progress bar every step as users do."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=True, prog_bar=True)
        return loss


class ReadingRegressor(LoggingRegressor):
    """The negative control: reads its loss on the host every step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.last_loss = float(loss)
        return loss


LAYOUTS: dict[str, Callable[[], Any]] = {
    "lightning_ddp": lambda: DDPStrategy(start_method="popen"),
    "mgpu_ddp": lambda: MGPUDDPStrategy(start_method="popen"),
    "zero1": lambda: MGPUShardedStrategy(stage=1, start_method="popen"),
    "zero2": lambda: MGPUShardedStrategy(stage=2, start_method="popen"),
    "zero3": lambda: MGPUShardedStrategy(stage=3, start_method="popen"),
    "pipeline": lambda: MGPUShardedStrategy(pipeline_parallel_size=2, pipeline_microbatches=2, start_method="popen"),
    "tensor": lambda: MGPUShardedStrategy(stage=3, tensor_parallel_size=2, start_method="popen"),
}


def _counted(make_strategy: Callable[[], Any], module: type = LoggingRegressor) -> Callable[[Path], None]:
    def job(path: Path) -> None:
        with HostSyncs() as syncs:
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=2,
                strategy=make_strategy(),
                callbacks=[syncs.callback(), DeviceMonitor(every_n_steps=EVERY)],
                logger=CSVLogger(path.parent / f"{path.stem}_logs"),
                log_every_n_steps=EVERY,
                max_epochs=1,
                limit_train_batches=STEPS,
                limit_val_batches=0,
                num_sanity_val_steps=0,
                enable_checkpointing=False,
                enable_model_summary=False,
            )
            trainer.fit(module(), DataLoader(make_data(48, dtype=torch.float32), batch_size=4))
        ledger = getattr(trainer.strategy, "comm_stats", None)
        torch.save(
            {
                "weights": torch.zeros(1),
                "per_step": [dict(step) for step in syncs.per_step],
                "ledger_steps": ledger.optimizer_steps if ledger is not None else None,
                "intervals": trainer.callbacks[1].intervals,
            },
            path,
        )

    return job


def _steps(record: dict[str, Any]) -> list[collections.Counter]:
    return [collections.Counter(step) for step in record["per_step"]]


def _extra(ours: list[collections.Counter], theirs: list[collections.Counter]) -> collections.Counter:
    """The call sites counted more often in ``ours`` than in ``theirs`` (over the steps given)."""
    return sum(ours, collections.Counter()) - sum(theirs, collections.Counter())


#: what the pipeline layout waits for in its first step only: the comparison of the ranks' first batches and the
#: probe of the model's shape, once per fit (the loss and the logged values of every step reach the other stages
#: by a device broadcast, their names through the store)
PIPELINE = ("lightning_mgpu/parts/pipeline/", "lightning_mgpu/comm.py:")


def test_the_pack_adds_no_host_sync_per_step_to_lightnings():
    names = list(LAYOUTS)
    records = run_jobs(
        [_counted(LAYOUTS[n]) for n in names] + [_counted(LAYOUTS["lightning_ddp"], ReadingRegressor)], agree=False
    )
    runs = dict(zip([*names, "negative_control"], records))
    table = {}
    for name, record in runs.items():
        for rank, ranked in enumerate(record["ranks"]):
            steps, lightning = _steps(ranked), _steps(runs["lightning_ddp"]["ranks"][rank])
            table[f"{name} rank {rank}"] = [sum(s.values()) for s in steps]
            assert len(steps) == STEPS, (name, rank, len(steps))
            if name in ("lightning_ddp", "negative_control"):
                continue
            assert ranked["intervals"] == STEPS // EVERY and ranked["ledger_steps"] == STEPS, name
            # the first step: Lightning's, the pack's once-per-epoch agreement on the number of batches and, where
            # the ranks of a group must hold one batch (pipeline, tensor), its once-per-fit comparison
            first = _extra(steps[:1], lightning[:1])
            once = (" <- lightning_mgpu/parts/uneven_inputs.py:",)
            once += (" <- lightning_mgpu/parts/steps.py:", "lightning_mgpu/parts/pipeline/") if name == "tensor" else ()
            known = PIPELINE if name == "pipeline" else ()
            assert all(any(o in site for o in once) or site.split(" @ ")[1].startswith(known) for site in first), (
                name,
                rank,
                first,
            )
            # every later step: nothing beyond Lightning's
            extra = _extra(steps[1:], lightning[1:])
            counts = [sum(s.values()) for s in steps[1:]]
            assert not extra and all(c <= sum(t.values()) for c, t in zip(counts, lightning[1:])), (
                f"{name}, rank {rank} waits for the device more often per step than Lightning's DDPStrategy; "
                f"the extra call sites:\n" + "\n".join(f"  {n} x {site}" for site, n in extra.items())
            )
    print("\nhost syncs per step:", *(f"  {n}: {c}" for n, c in table.items()), sep="\n")
    # the negative control: one float(loss) per step, named where it is
    for rank in range(2):
        control = _steps(runs["negative_control"]["ranks"][rank])
        lightning = _steps(runs["lightning_ddp"]["ranks"][rank])
        assert [sum(c.values()) - sum(t.values()) for c, t in zip(control, lightning)] == [1] * STEPS
        lines, first = inspect.getsourcelines(ReadingRegressor.training_step)
        line = first + next(i for i, text in enumerate(lines) if "float(loss)" in text)
        extra = _extra(control, lightning)
        assert [site.split(" <- ")[0] for site in extra] == [
            f"__float__ @ tests/integration/strategies/test_host_syncs.py:{line}"
        ], extra
