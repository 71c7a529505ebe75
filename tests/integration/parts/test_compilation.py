"""``compile=...`` through ``Trainer.fit`` on 2 CPU ranks (gloo), float64, ``backend="aot_eager"`` (AOTAutograd's
graphs run eagerly: the tests stay fast, the graphs are the ones inductor would get): the same weights and buffers
as eager with accumulation, norm clipping, activation checkpointing and validation; no graph compiled after warm-up
across accumulation boundaries, validation, checkpoint saves and a resume (dynamo's counters); a model compiled by
the user before ``Trainer.fit``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_mgpu import MGPUDDPStrategy, MGPULocalSGDStrategy, MGPUShardedStrategy, _compat
from lightning_mgpu.parts.compilation import compiled_modules
from tests.helpers import AllReduceSpy
from tests.models import Block, BlockRegressor, RankData, make_data
from tests.numerics_harness import run_jobs

FAST = {"backend": "aot_eager"}
B = 4  # per-rank micro-batch; 48 samples: 6 micro-batches per rank and epoch


class ValBlocks(BlockRegressor):
    """Residual blocks with BatchNorm (dropout off: the compiled and eager runs draw no random numbers) and a
    validation step."""

    def __init__(self) -> None:
        super().__init__(blocks=2, width=8, dropout=0.0)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)


class ValData(RankData):
    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size)


class Record(Callback):
    """What each rank hands back, in the file :func:`run_jobs` reads: weights, the whole state (parameters and
    BatchNorm buffers, gathered from FSDP2's shards), the modules compiled, and the graphs compiled in this process
    counted from a fresh compiler state at set-up (before the strategy compiles), after the first validation of
    fit (warm-up: the training and the evaluation graphs) and at the end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.counts: dict[str, int] = {}
        self.compiled: list[str] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        torch.compiler.reset()
        self.base = _compat.compiled_graph_count()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.compiled = compiled_modules(pl_module)
        self.spy = AllReduceSpy().__enter__()  # torch.distributed.all_reduce calls, independent of the ledger

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and "warm" not in self.counts:
            self.counts["warm"] = _compat.compiled_graph_count() - self.base

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.counts["end"] = _compat.compiled_graph_count() - self.base
        self.spy.__exit__(None, None, None)
        ledger = getattr(trainer.strategy, "comm_stats", None)
        state = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in pl_module.state_dict().items()
        }
        weights = torch.cat([state[name].flatten() for name, _ in pl_module.named_parameters()])
        record = {
            "weights": weights,
            "state": state,
            "graphs": dict(self.counts),
            "compiled": self.compiled,
            "global_step": trainer.global_step,
            "all_reduce_calls": self.spy.calls,
            "ledger_rounds": ledger.sync_rounds if ledger is not None else None,
        }
        torch.save(record, self.path)


def job(
    make_strategy: Callable[[], Any],
    make_model: Callable[[], Any] = lambda: ValBlocks().double(),
    epochs: int = 2,
    ckpt: Optional[Path] = None,
    resume: bool = False,
    dtype: torch.dtype = torch.float64,
    record: Optional[Callable[[Path], Callback]] = None,
    **kwargs: Any,
) -> Callable[[Path], None]:
    """One ``Trainer.fit`` on the ranks of :func:`run_jobs`: k=3 accumulation, norm clipping, validation every
    epoch (2 batches), optionally a checkpoint every epoch (``ckpt``) or a resume from its ``last.ckpt``."""

    def run(path: Path) -> None:
        callbacks: list[Callback] = [(record or Record)(path)]
        if ckpt is not None:
            callbacks.append(ModelCheckpoint(dirpath=ckpt, save_last=True, save_top_k=0))
        flags: dict[str, Any] = {
            "accelerator": "cpu",
            "devices": 2,
            "max_epochs": epochs,
            "accumulate_grad_batches": 3,
            "gradient_clip_val": 0.05,
            "use_distributed_sampler": False,
            "logger": False,
            "enable_checkpointing": ckpt is not None,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "limit_val_batches": 2,
            "num_sanity_val_steps": 0,
            **kwargs,
        }
        trainer = pl.Trainer(strategy=make_strategy(), callbacks=callbacks, **flags)
        ckpt_path = str(ckpt / "last.ckpt") if resume and ckpt is not None else None
        trainer.fit(make_model(), datamodule=ValData(make_data(n=48, dtype=dtype), B), ckpt_path=ckpt_path)

    return run


def assert_same_state(compiled: dict[str, Any], eager: dict[str, Any]) -> None:
    """Weights and every buffer (BatchNorm statistics, the blocks' call counters), float64 default tolerance."""
    assert compiled["global_step"] == eager["global_step"] > 0
    torch.testing.assert_close(compiled["state"], eager["state"])


AC = {"activation_checkpointing": Block}


def ddp(**kwargs: Any) -> Callable[[], Any]:
    return lambda: MGPUDDPStrategy(**kwargs)


def sharded(stage: int, **kwargs: Any) -> Callable[[], Any]:
    return lambda: MGPUShardedStrategy(stage=stage, **kwargs)


@pytest.mark.timeout(600)
def test_compiled_mgpu_ddp_and_zero3_match_eager_with_accumulation_clipping_and_checkpointing():
    """mgpu_ddp (the LightningModule's forward compiled) and mgpu_zero3 (each block compiled after sharding), each
    with activation checkpointing, k=3 and norm clipping, against the same fit eager; nothing is compiled after the
    first validation. A model compiled by the user (``trainer.fit(torch.compile(model))``: Lightning compiles its
    ``training_step``) under mgpu_ddp's default ``compile=False`` gives the eager weights too. The negative
    control: a fit whose first weight is off by 1e-6 at the start fails the comparison. (One launch for all.)"""

    def perturbed() -> ValBlocks:
        model = ValBlocks().double()
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] += 1e-6
        return model

    records = run_jobs(
        [
            job(ddp(**AC)),
            job(ddp(compile=FAST, **AC)),
            job(sharded(3, **AC)),
            job(sharded(3, compile=FAST, **AC)),
            job(sharded(3, compile=FAST, **AC), make_model=perturbed),
            job(ddp(**AC), make_model=lambda: torch.compile(ValBlocks().double(), backend="aot_eager")),
        ]
    )
    ddp_eager, ddp_compiled, z3_eager, z3_compiled, z3_perturbed, user_compiled = records
    assert ddp_compiled["compiled"] == [""] and ddp_eager["compiled"] == []  # the whole forward
    assert z3_compiled["compiled"] == ["net"]  # the FSDP unit's block (the model's one child with parameters)
    for compiled in (ddp_compiled, z3_compiled):
        assert compiled["graphs"]["warm"] > 0
        assert compiled["graphs"]["end"] == compiled["graphs"]["warm"]  # nothing compiled after warm-up
    assert ddp_eager["graphs"]["end"] == 0
    assert_same_state(ddp_compiled, ddp_eager)
    assert_same_state(z3_compiled, z3_eager)
    for compiled, eager in ((ddp_compiled, ddp_eager), (z3_compiled, z3_eager)):  # accumulation: no extra syncs
        assert compiled["all_reduce_calls"] == eager["all_reduce_calls"] > 0
        assert compiled["ledger_rounds"] == eager["ledger_rounds"] == compiled["global_step"]
    with pytest.raises(AssertionError):
        assert_same_state(z3_perturbed, z3_eager)
    assert user_compiled["graphs"]["end"] > 0 and user_compiled["compiled"] == []  # the user's compilation ran
    assert_same_state(user_compiled, ddp_eager)


@pytest.mark.timeout(600)
def test_no_recompilation_after_warm_up_across_checkpoint_saves_and_resume(tmp_path):
    """mgpu_zero3 compiled: a checkpoint after every epoch; the resumed fit (a fresh compiler state) compiles the
    same graphs as the first fit's warm-up and nothing more, and ends where an uninterrupted fit ends."""
    ckpt = tmp_path / "ckpt"
    strategy = sharded(3, compile=FAST)
    first, resumed, straight = run_jobs(
        [
            job(strategy, epochs=2, ckpt=ckpt),
            job(strategy, epochs=3, ckpt=ckpt, resume=True),
            job(strategy, epochs=3),
        ]
    )
    assert first["graphs"]["warm"] > 0 and first["graphs"]["end"] == first["graphs"]["warm"]
    assert resumed["graphs"]["end"] == first["graphs"]["warm"]
    assert_same_state(resumed, straight)


def test_sharded_stages_refuse_a_model_compiled_by_the_user_naming_the_strategy():
    """Lightning refuses a compiled model for strategies other than its own DDP/FSDP before any strategy code
    runs (``compile=True`` is the way there)."""
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=MGPUShardedStrategy(stage=3, start_method="fork"), logger=False
    )
    with pytest.raises(RuntimeError, match="compiled model is incompatible with the current strategy") as err:
        trainer.fit(torch.compile(ValBlocks(), backend="eager"), datamodule=ValData(make_data(n=48), B))
    assert f"`{type(trainer.strategy).__name__}`" in str(err.value)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("k", [1, 3], ids=["k1", "k3"])
def test_every_family_compiled_matches_eager(k):
    """mgpu_zero1, mgpu_sharded (stage 2) and mgpu_local_sgd (sync every 2 steps), with and without activation
    checkpointing, at k=1 and k=3: compiled equals eager."""
    makers = [
        sharded(1),
        sharded(1, **AC),
        sharded(2),
        sharded(2, **AC),
        lambda: MGPULocalSGDStrategy(sync_every=2),
        lambda: MGPULocalSGDStrategy(sync_every=2, **AC),
    ]
    compiled_makers = [
        sharded(1, compile=FAST),
        sharded(1, compile=FAST, **AC),
        sharded(2, compile=FAST),
        sharded(2, compile=FAST, **AC),
        lambda: MGPULocalSGDStrategy(sync_every=2, compile=FAST),
        lambda: MGPULocalSGDStrategy(sync_every=2, compile=FAST, **AC),
    ]
    jobs = [job(m, accumulate_grad_batches=k) for pair in zip(makers, compiled_makers) for m in pair]
    records = run_jobs(jobs)
    for eager, compiled in zip(records[::2], records[1::2]):
        assert compiled["graphs"]["end"] == compiled["graphs"]["warm"] > 0
        for r_compiled, r_eager in zip(compiled["ranks"], eager["ranks"]):
            assert_same_state(r_compiled, r_eager)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-master"])
def test_compiled_lower_precisions_match_eager(precision):
    """bf16 autocast, fp16 with the loss scaler and bf16 weights with FP32 masters (MGPUPrecision, on CPU too):
    compiled equals eager under mgpu_ddp and mgpu_zero3 (aot_eager runs the same kernels)."""
    from lightning_mgpu import MGPUPrecision

    extra: dict[str, Any] = (
        {"precision": "bf16-mixed"} if precision == "bf16-mixed" else {"plugins": [MGPUPrecision(precision)]}
    )

    def model() -> ValBlocks:
        return ValBlocks().float()

    def data_job(maker: Callable[[], Any]) -> Callable[[Path], None]:
        return job(maker, make_model=model, dtype=torch.float32, **extra)

    records = run_jobs(
        [data_job(ddp()), data_job(ddp(compile=FAST)), data_job(sharded(3)), data_job(sharded(3, compile=FAST))]
    )
    for eager, compiled in zip(records[::2], records[1::2]):
        assert_same_state(compiled, eager)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mgpu_auto_hands_compile_to_the_strategy_it_chooses():
    """``MGPUAutoStrategy(compile=...)``: the chosen strategy compiles (the same choice eager and compiled: the plan
    does not depend on compilation), with the eager weights."""
    from lightning_mgpu import MGPUAutoStrategy

    eager, compiled = run_jobs(
        [
            job(lambda: MGPUAutoStrategy(device_memory="8GiB")),
            job(lambda: MGPUAutoStrategy(device_memory="8GiB", compile=FAST)),
        ]
    )
    assert compiled["compiled"] and not eager["compiled"]
    assert compiled["graphs"]["end"] == compiled["graphs"]["warm"] > 0
    assert_same_state(compiled, eager)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_manual_optimization_under_compiled_mgpu_ddp_matches_eager():
    """Manual optimization with ``ManualAccumulation`` (k=3) and clipping in ``on_before_optimizer_step``: the
    compiled forward gives the eager weights (each optimizer's gradients still synced once per step)."""
    from tests.numerics_harness import CLIP, ManualValRegressor

    def model() -> Any:
        return ManualValRegressor(CLIP["norm"]).double()

    eager, compiled = run_jobs(
        [
            job(ddp(), make_model=model, gradient_clip_val=None),
            job(ddp(compile=FAST), make_model=model, gradient_clip_val=None),
        ]
    )
    assert compiled["compiled"] == [""]
    assert compiled["all_reduce_calls"] == eager["all_reduce_calls"] > 0
    assert_same_state(compiled, eager)


class LoggingBlocks(ValBlocks):
    """``self.log`` (synchronised across ranks, per step and per epoch, and a summed one) inside ``training_step``,
    which is itself compiled with ``compile_step`` (``torch.compile`` of the bound method: dynamo traces the step and
    breaks its graph at each ``self.log``)."""

    def __init__(self, compile_step: bool = False) -> None:
        super().__init__()
        if compile_step:
            self.training_step = torch.compile(self.training_step, **FAST)  # type: ignore[method-assign]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.training:  # inside the forward the strategy compiles under mgpu_ddp
            self.log("out_mean", out.detach().mean(), on_step=False, on_epoch=True, sync_dist=True)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.log("loss_sum", 3 * loss.detach(), on_step=False, on_epoch=True, reduce_fx="sum")
        return loss


class RecordLogged(Record):
    """:class:`Record` plus what ``self.log`` left in ``trainer.callback_metrics`` at the end of fit."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        record = torch.load(self.path, weights_only=False)
        record["logged"] = {k: v.detach().clone() for k, v in trainer.callback_metrics.items()}
        torch.save(record, self.path)


def test_self_log_inside_a_compiled_training_step_under_the_compile_option():
    """``self.log`` inside compiled code under ``compile=...`` of mgpu_ddp (the forward it compiles, and a
    ``training_step`` compiled by ``torch.compile`` of the method) and of mgpu_zero3 (the compiled ``training_step``):
    every value (the synchronised per-step and per-epoch loss, a summed value, a mean from the forward) and the
    weights equal the eager run's. The same under mgpu_ddp for a model the user compiled
    (``trainer.fit(torch.compile(model))``: Lightning compiles its ``forward`` and ``training_step``). On torch >=
    2.12 with Lightning 2.6.6 the compiled runs failed in ``self.log`` ("'method' object has no attribute
    '__dict__'") before the strategy ran ``log`` eagerly. The negative control shows a logged value that differs is
    caught."""

    def logging_job(
        make_strategy: Callable[[], Any], compile_step: bool, by_user: bool = False
    ) -> Callable[[Path], None]:
        def make_model() -> Any:
            model = LoggingBlocks(compile_step).double()
            return torch.compile(model, **FAST) if by_user else model

        return job(make_strategy, make_model, epochs=1, record=RecordLogged)

    ddp_eager, ddp_compiled, zero3_eager, zero3_compiled, user_compiled = run_jobs(
        [
            logging_job(ddp(), False),
            logging_job(ddp(compile=FAST), True),
            logging_job(sharded(3), False),
            logging_job(sharded(3, compile=FAST), True),
            logging_job(ddp(), False, by_user=True),
        ]
    )
    logged = {"train_loss", "train_loss_step", "train_loss_epoch", "loss_sum", "out_mean", "val_loss"}
    assert user_compiled["graphs"]["end"] > 0 and user_compiled["compiled"] == []  # the user's compilation ran
    # each against its own eager run: the ranks' BatchNorm statistics, which validation reads, are rank 0's under
    # DDP (buffers broadcast) and each rank's own under FSDP2
    for compiled, eager in ((ddp_compiled, ddp_eager), (zero3_compiled, zero3_eager)):
        assert set(eager["logged"]) == logged
        assert compiled["compiled"], "the compile option compiled nothing"
        assert_same_state(compiled, eager)
        torch.testing.assert_close(compiled["logged"], eager["logged"])
    assert_same_state(user_compiled, ddp_eager)
    torch.testing.assert_close(user_compiled["logged"], ddp_eager["logged"])
    changed = {**ddp_eager["logged"], "loss_sum": ddp_eager["logged"]["loss_sum"] * 1.01}
    with pytest.raises(AssertionError):  # negative control
        torch.testing.assert_close(ddp_compiled["logged"], changed)
