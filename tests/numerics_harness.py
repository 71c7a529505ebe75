"""The numerics matrix's harness: many ``Trainer.fit`` cases in ONE 2-process launch, and a plain-torch reference.

A fork launch costs little, but a Trainer that launches its own workers per case would pay it (and the gloo
set-up) hundreds of times. Here two forked workers join one gloo group and run every case in turn: the
strategies are built with ``start_method="popen"`` and the workers carry ``LOCAL_RANK``, so Lightning treats
them as processes started outside it (as under torchrun) and reuses the group that is already up.
"""

from __future__ import annotations

import copy
import datetime
import os
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning_fabric.plugins.environments.lightning import find_free_network_port
from pytorch_lightning.callbacks import Callback
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import ManualAccumulation, MGPUDDPStrategy, MGPUPrecision, MGPUShardedStrategy
from tests.models import RankData, Regressor, make_data

WORLD = 2
B = 4  # per-rank micro-batch
N = 48  # samples: k=1 -> 6 steps per epoch, k=3 -> 2
EPOCHS = 2
CLIP = {"none": None, "norm": ("norm", 0.05), "value": ("value", 0.01)}


@dataclass(frozen=True)
class Case:
    family: str  # a key of FAMILIES
    k: int = 1
    clip: str = "none"  # a key of CLIP
    precision: str = "64"  # "64" (float64 model and data), "32", "bf16-mixed", "16-mixed"
    val: bool = False  # Lightning's defaults (sanity check, validation every epoch) or none

    @property
    def id(self) -> str:
        return f"{self.family}-k{self.k}-{self.clip}-{self.precision}-{'val' if self.val else 'noval'}"


def _sharded(stage: int, backend: str) -> Callable[[], Any]:
    return lambda: MGPUShardedStrategy(stage=stage, backend=backend, start_method="popen")  # type: ignore[arg-type]


#: every shipped preset family, as the strategy it builds (launch variants share the numerics of their family)
FAMILIES: dict[str, Callable[[], Any]] = {
    "ddp": lambda: MGPUDDPStrategy(start_method="popen"),
    "ddp_manual": lambda: MGPUDDPStrategy(start_method="popen"),
    "zero1": _sharded(1, "torch"),
    "zero1_fairscale": _sharded(1, "fairscale"),
    "zero2": _sharded(2, "torch"),
    "zero2_fairscale": _sharded(2, "fairscale"),
    "zero3": _sharded(3, "torch"),
}


def dataset(precision: str) -> TensorDataset:
    return make_data(n=N, dtype=torch.float64 if precision == "64" else torch.float32)


class ValData(RankData):
    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size)


class ValRegressor(Regressor):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)


class ManualValRegressor(ManualAccumulation, ValRegressor):
    """Manual optimization with the accumulation switch; clips in ``on_before_optimizer_step`` (Lightning's
    ``gradient_clip_val`` is for automatic optimization only), i.e. once per real step on synced gradients."""

    def __init__(self, clip: Optional[tuple[str, float]] = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.clip = clip

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        self.manual_backward(F.mse_loss(self(x), y))
        opt.step()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.clip is not None:
            algorithm, value = self.clip
            self.clip_gradients(optimizer, gradient_clip_val=value, gradient_clip_algorithm=algorithm)


def initial_model(case: Case) -> Regressor:
    model: Regressor = ManualValRegressor(CLIP[case.clip]) if case.family == "ddp_manual" else ValRegressor()
    return model.double() if case.precision == "64" else model.float()


def trainer_kwargs(case: Case) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": WORLD,
        "max_epochs": EPOCHS,
        "accumulate_grad_batches": case.k,
        "use_distributed_sampler": False,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    clip = CLIP[case.clip]
    if clip is not None and case.family != "ddp_manual":
        kwargs.update(gradient_clip_algorithm=clip[0], gradient_clip_val=clip[1])
    if not case.val:
        kwargs.update(limit_val_batches=0, num_sanity_val_steps=0)
    if case.precision == "16-mixed":
        kwargs["plugins"] = [MGPUPrecision("16-mixed")]  # fp16 with the loss scaler on CPU too
    elif case.precision == "bf16-mixed":
        kwargs["precision"] = "bf16-mixed"
    return kwargs


class _Weights(Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = pl_module.state_dict()
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}
        flat = torch.cat([full[name].flatten() for name, _ in pl_module.named_parameters()])
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        ledger = getattr(trainer.strategy, "comm_stats", None)
        calls = ledger.allreduce_calls if ledger is not None else 0
        record = {"weights": flat, "global_step": trainer.global_step, "metrics": metrics, "allreduce_calls": calls}
        torch.save(record, self.path)


def fit_case(case: Case, make_strategy: Callable[[], Any]) -> Callable[[Path], None]:
    """A job for :func:`run_jobs`: fit ``case`` with the strategy ``make_strategy`` builds."""
    return fit_job(
        lambda: initial_model(case), make_strategy, lambda: ValData(dataset(case.precision), B), trainer_kwargs(case)
    )


def fit_job(
    make_model: Callable[[], pl.LightningModule],
    make_strategy: Callable[[], Any],
    make_data: Callable[[], pl.LightningDataModule],
    kwargs: dict[str, Any],
) -> Callable[[Path], None]:
    """A job for :func:`run_jobs`: one ``Trainer.fit`` whose rank record (weights, steps, the last logged
    ``callback_metrics``) goes to the path given."""

    def job(path: Path) -> None:
        trainer = pl.Trainer(strategy=make_strategy(), callbacks=[_Weights(path)], **kwargs)
        trainer.fit(make_model(), datamodule=make_data())

    return job


def _worker(
    rank: int, jobs: list[Callable[[Path], None]], port: int, out: str, timeout: Optional[float] = None
) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD)
    )
    kwargs = {"timeout": datetime.timedelta(seconds=timeout)} if timeout is not None else {}
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, **kwargs)
    try:
        for i, job in enumerate(jobs):
            try:
                job(Path(out) / f"{i}_rank{rank}.pt")
            except BaseException:
                # written whole, then renamed: a rank terminated while it writes leaves no empty record
                part = Path(out) / f"{i}_rank{rank}.err.part"
                part.write_text(f"job {i}: rank {rank}\n{traceback.format_exc()}")
                os.replace(part, part.with_suffix(""))
                raise
    finally:
        dist.destroy_process_group()


def run_jobs(
    jobs: list[Callable[[Path], None]], agree: bool = True, timeout: Optional[float] = None
) -> list[dict[str, Any]]:
    """Run every job on 2 CPU ranks in one launch; returns rank 0's record per job (``"ranks"``: both), after
    checking that the ranks' weights agree exactly (``agree``). ``timeout``: seconds a collective of the shared
    group waits before it raises (a hang becomes an error; default: torch's)."""
    with tempfile.TemporaryDirectory() as out:
        try:
            port = find_free_network_port()
            context = mp.start_processes(
                _worker, nprocs=WORLD, start_method="fork", args=(jobs, port, out, timeout), join=False
            )
            # once a rank has failed, the others get the group's timeout to end on their own (a rank waiting in a
            # collective ends there) before they are terminated, so that every rank's traceback is recorded
            grace = 5.0 if timeout is None else timeout + 5.0
            while not context.join(grace_period=grace):
                pass
        except Exception as err:
            text = "\n".join(e.read_text() for e in sorted(Path(out).glob("*.err")))
            raise AssertionError(f"a job failed in the shared launch:\n{text}") from err
        records = []
        for i in range(len(jobs)):
            r0, r1 = (torch.load(Path(out) / f"{i}_rank{r}.pt") for r in range(WORLD))
            if agree:
                torch.testing.assert_close(r0["weights"], r1["weights"], rtol=0, atol=0)
            records.append({**r0, "ranks": [r0, r1]})
    return records


def run_cases(cases: list[Case], strategies: Optional[list[Callable[[], Any]]] = None) -> list[dict[str, Any]]:
    """Fit every case in one launch (:func:`run_jobs`). ``strategies``: a strategy factory per case (default:
    the case's family)."""
    makers = strategies if strategies is not None else [FAMILIES[c.family] for c in cases]
    return run_jobs([fit_case(c, m) for c, m in zip(cases, makers)])


def reference(case: Case, local_norm_shards: int = 1) -> dict[str, Any]:
    """One process, plain torch, the whole batch (``WORLD * B * k`` samples) per step: weights, steps and, per
    step, the pre-clip gradient norm and largest gradient element (to show clipping bites).
    ``local_norm_shards > 1``: a negative control that clips each of that many parameter shards by its own
    norm (what a per-shard clip computes)."""
    model = initial_model(case)
    params = list(model.parameters())
    data = dataset(case.precision)
    opt = torch.optim.SGD(params, lr=model.lr, momentum=0.9)
    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(case.precision)
    scaler = torch.amp.GradScaler("cpu") if case.precision == "16-mixed" else None
    clip = CLIP[case.clip]
    norms, maxima = [], []
    steps = 0
    for _ in range(EPOCHS):
        for x, y in DataLoader(data, batch_size=WORLD * B * case.k, shuffle=False):
            opt.zero_grad(set_to_none=True)
            ctx = torch.autocast("cpu", dtype=half) if half is not None else torch.autocast("cpu", enabled=False)
            with ctx:
                loss = F.mse_loss(model(x), y)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None:
                scaler.unscale_(opt)
            grads = [p.grad for p in params]
            norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
            maxima.append(max(float(g.abs().max()) for g in grads))
            if clip is not None and clip[0] == "norm":
                if local_norm_shards > 1:
                    for shard in (params[i::local_norm_shards] for i in range(local_norm_shards)):
                        torch.nn.utils.clip_grad_norm_(shard, clip[1])
                else:
                    torch.nn.utils.clip_grad_norm_(params, clip[1])
            elif clip is not None:
                torch.nn.utils.clip_grad_value_(params, clip[1])
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            steps += 1
    weights = torch.cat([p.detach().flatten() for p in params])
    initial = torch.cat([p.detach().flatten() for p in initial_model(case).parameters()])
    return {"weights": weights, "initial": initial, "steps": steps, "norms": norms, "maxima": maxima}


def tolerance(precision: str) -> dict[str, float]:
    """``assert_close`` tolerances per precision (docs/guides/numerics.md explains them)."""
    if precision in ("64", "32"):
        return {}  # assert_close's defaults for the dtype
    if precision == "bf16-mixed":
        return {"rtol": 2e-2, "atol": 2e-2}
    return {"rtol": 3e-3, "atol": 3e-3}


def copy_case(case: Case, **changes: Any) -> Case:
    return copy.replace(case, **changes) if hasattr(copy, "replace") else Case(**{**case.__dict__, **changes})
