"""Pipeline parallelism through ``Trainer.fit`` on 4 gloo processes (pipeline 2 x data 2, and pipeline 4), float64:
the weights equal one process with the same global batch for each schedule, with ``accumulate_grad_batches`` and
global-norm clipping that bites; the logged training loss and the validation loss and metric are the one-process
values, validation running through the stages (each rank holding only its stages' blocks) on an uneven set; a
consolidated checkpoint written by the pipeline resumes in one process and continues as an uninterrupted run, and
one written mid-epoch moves through ZeRO-3 over the 4 ranks to one process as one uninterrupted run. Two
models as users write them: an ``nn.Sequential`` stack and a GPT-style model whose forward iterates a
``ModuleList`` (embeddings and a causal mask before the blocks, a norm and a head tied to the embedding after).
With ``loss_normalization="tokens"`` and padded targets, the weights are those of one process minimising the mean
over every real token of each optimizer step. With ``compile=True`` (inductor, each block compiled, the stage
hooks eager) the weights and losses are one process's too, every block compiled on every rank."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import pytest
import pytorch_lightning as pl
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_mgpu import MGPUPrecision, MGPUShardedStrategy, _compat
from lightning_mgpu.parts.compilation import compiled_modules
from lightning_mgpu.parts.pipeline import PipelineBackend, plan_stages
from lightning_mgpu.parts.resume import POSITION_KEY
from lightning_mgpu.parts.steps import PipelineSteps

WORLD = 4
GLOBAL_BATCH = 8
SAMPLES = 48  # 6 batches of 8 per epoch
VALIDATION = 45  # 23 and 22 samples on 2 replicas, in batches of 5: [5, 5, 5, 5, 3] and [5, 5, 5, 5, 2]
CLIP = 0.05
VOCAB, SEQ, WIDTH = 11, 6, 8


class SequentialNet(pl.LightningModule):
    """A plain ``nn.Sequential`` stack."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(6, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 3)
        ).double()
        self.val_mae = torchmetrics.MeanAbsoluteError()
        self.val_mae.set_dtype(torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        out = self(x)
        self.log("val_loss", F.mse_loss(out, y), sync_dist=True)
        self.val_mae(out, y)  # a torchmetrics metric, updated on the last stage only
        self.log("val_mae", self.val_mae)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, called as ``block(x, mask)``."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        att = (q @ k.transpose(-2, -1) / math.sqrt(WIDTH)).masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj(att @ v)
        return x + self.mlp(self.ln2(x))


class TinyGPT(pl.LightningModule):
    """GPT-style: token and position embeddings, a causal mask, ``for block in self.blocks``, a final norm, a head
    whose weight is the token embedding's (tied)."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(blocks)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight
        self.double()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=idx.device), diagonal=1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, target = batch
        loss = F.cross_entropy(self(idx).flatten(0, 1), target.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        idx, target = batch
        self.log("val_loss", F.cross_entropy(self(idx).flatten(0, 1), target.flatten()), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class HFGPT2(pl.LightningModule):
    """A transformers GPT-2 (tiny random config, tied embeddings, dropout off), its loss from ``labels``: the blocks
    are ``model.transformer.h``, each returning a tuple."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        drop = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
        config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=2, n_head=2, **drop)
        self.model = GPT2LMHeadModel(config).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch[0], labels=batch[0]).loss, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def dataset(model: str) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    if model.startswith("gpt") or model == "hf_gpt2":
        tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return TensorDataset(
        torch.randn(SAMPLES, 6, generator=g, dtype=torch.float64),
        torch.randn(SAMPLES, 3, generator=g, dtype=torch.float64),
    )


class Data(pl.LightningDataModule):
    """Training batches from the strategy's sampler arguments (every stage of a pipeline gets its replica's
    batch); validation through Lightning's automatic sampler (exact evaluation)."""

    def __init__(self, data: TensorDataset, batch_size: int, automatic: bool = False) -> None:
        super().__init__()
        self.data, self.batch_size, self.automatic = data, batch_size, automatic

    def train_dataloader(self) -> DataLoader:
        distributed = torch.distributed.is_initialized()
        if self.automatic and distributed:  # Lightning's automatic sampler, shuffling (the pack's resumable one)
            return DataLoader(self.data, batch_size=self.batch_size)
        if self.automatic:  # one process: the same order (torch's shuffle with Lightning's seed 0, one replica)
            sampler = DistributedSampler(self.data, num_replicas=1, rank=0, shuffle=True, seed=0)
            return DataLoader(self.data, batch_size=self.batch_size, sampler=sampler)
        kwargs = self.trainer.strategy.distributed_sampler_kwargs if distributed else {"num_replicas": 1, "rank": 0}
        sampler = DistributedSampler(self.data, shuffle=False, **kwargs)
        return DataLoader(self.data, batch_size=self.batch_size, sampler=sampler)

    def val_dataloader(self) -> DataLoader:  # uneven: different batch sizes on the replicas
        return DataLoader(TensorDataset(*(t[:VALIDATION] for t in self.data.tensors)), batch_size=5)


class Record(pl.Callback):
    """On every rank at the end of fit: the whole state (a collective under the pipeline), the logged values, the
    pre-clip gradient norms; rank 0 saves them and a checkpoint."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.norms: list[float] = []
        self.memory: list[Any] = []
        self.validation: list[int] = []  # the parameter bytes this rank holds around each validation_step

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        squares = [p.grad.pow(2).sum() for p in module.parameters() if p.grad is not None]
        self.norms.append(float(torch.stack(squares).sum().sqrt()) if squares else 0.0)
        if hasattr(trainer.strategy, "memory_report"):  # this rank's parameter, gradient, optimizer-state bytes
            self.memory.append(trainer.strategy.memory_report())

    def on_validation_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if hasattr(trainer.strategy, "memory_report"):
            self.validation.append(trainer.strategy.memory_report().parameters)

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.on_validation_batch_start(trainer)

    def on_fit_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.memory:
            full = sum(p.numel() * p.element_size() for p in module.parameters())  # gathered at the end of fit
            self.out.mkdir(parents=True, exist_ok=True)
            record = {"steps": self.memory, "full": full, "validation": self.validation}
            torch.save(record, self.out / f"memory{trainer.global_rank}.pt")

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        state = trainer.strategy.lightning_module_state_dict()
        trainer.save_checkpoint(self.out / "last.ckpt")
        if trainer.global_rank == 0:
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            stats = trainer.strategy.pipeline_stats() if hasattr(trainer.strategy, "pipeline_stats") else None
            ledger = getattr(trainer.strategy, "comm_stats", None)
            record = {"state": state, "metrics": metrics, "norms": self.norms, "stats": stats, "ledger": ledger}
            torch.save(record, self.out / "record.pt")


class SaveAfterStep(pl.Callback):
    """A checkpoint right after optimizer step ``step`` (where ``ModelCheckpoint(every_n_train_steps=...)`` saves:
    a mid-epoch resume there is exact)."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step, self.saved = path, step, False

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and not self.saved:  # the batch of the step
            trainer.save_checkpoint(self.path)
            self.saved = True


def trainer_kwargs(out: Path, accumulate: int, **kwargs: Any) -> dict[str, Any]:
    return {
        "accelerator": "cpu",
        "max_epochs": 1 if accumulate == 1 else 2,  # 6 or 4 optimizer steps
        "accumulate_grad_batches": accumulate,
        "gradient_clip_val": CLIP,
        "use_distributed_sampler": True,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "callbacks": [Record(out)],
        **kwargs,
    }


def make_model(name: str) -> pl.LightningModule:
    """``"gpt8"``: 8 blocks, for 4 ranks of 2 interleaved stages each."""
    if name == "hf_gpt2":
        pytest.importorskip("transformers")
        return HFGPT2()
    return TinyGPT(blocks=8 if name == "gpt8" else 4) if name.startswith("gpt") else SequentialNet()


def reference(
    name: str, accumulate: int, out: Path, ckpt: Optional[Path] = None, epochs: int = 0, automatic: bool = False
) -> dict[str, Any]:
    """One process, the global batch: plain Lightning on one device (``automatic``: the order of Lightning's
    automatic sampler)."""
    out.mkdir(parents=True, exist_ok=True)
    kwargs = trainer_kwargs(out, accumulate, devices=1)
    if epochs:
        kwargs["max_epochs"] = epochs
    trainer = pl.Trainer(**kwargs)
    trainer.fit(make_model(name), Data(dataset(name), GLOBAL_BATCH, automatic), ckpt_path=ckpt)
    return torch.load(out / "record.pt", weights_only=False)


def pipelined(
    tmp: Path,
    name: str,
    pipeline: int,
    schedule: str,
    accumulate: int,
    strategy_cls: type = MGPUShardedStrategy,
    predict: bool = False,
    ckpt: Optional[Path] = None,
    epochs: int = 0,
    **options: Any,
) -> dict[str, Any]:
    replicas = WORLD // pipeline
    m = 2 * pipeline if schedule == "interleaved_1f1b" else 4
    strategy = strategy_cls(
        pipeline_parallel_size=pipeline,
        pipeline_schedule=schedule,
        pipeline_microbatches=m,
        start_method="fork",
        **options,
    )
    kwargs = trainer_kwargs(tmp, accumulate, devices=WORLD)
    if epochs:
        kwargs["max_epochs"] = epochs
    trainer = pl.Trainer(strategy=strategy, **kwargs)
    model = make_model(name)
    trainer.fit(model, Data(dataset(name), GLOBAL_BATCH // replicas), ckpt_path=ckpt)
    record = torch.load(tmp / "record.pt", weights_only=False)
    record["main_stats"] = trainer.strategy.pipeline_stats()  # what the main process holds after the fork launch
    if predict:  # a new launch: every rank runs the whole model on its share, gathered in dataset order
        record["predictions"] = torch.cat(trainer.predict(model, DataLoader(dataset(name), batch_size=5)))
    return record


def assert_holds_its_stages(out: Path, name: str, pipeline: int, schedule: str) -> None:
    """During training, and during validation (before and after each validation_step), every rank holds
    (parameters, gradients and optimizer state) only the blocks of its stages and the parameters outside the
    blocks; after fit it holds the whole model again."""
    model = make_model(name)
    stages = pipeline * (2 if schedule == "interleaved_1f1b" else 1)
    plan = plan_stages(model, "auto", stages)
    modules = dict(model.named_modules())

    def ids(names: Any) -> set[int]:
        return {id(p) for n in names for p in modules[n].parameters()}

    in_blocks = ids(plan.names)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    for rank in range(WORLD):
        index = rank // (WORLD // pipeline)  # the rank's coordinate on the pipeline dimension
        owned = ids(n for s, (a, b) in enumerate(plan.bounds) if s % pipeline == index for n in plan.names[a:b])
        want = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) in owned or id(p) not in in_blocks)
        assert want < full
        record = torch.load(out / f"memory{rank}.pt", weights_only=False)
        assert record["full"] == full
        for step, report in enumerate(record["steps"]):
            assert report.parameters == want, (rank, step)
            assert report.gradients == want, (rank, step)  # every parameter it holds has its gradient
            if step:  # SGD's momentum exists after the first step: one buffer per parameter held, none other
                assert report.optimizer_state == want, (rank, step)
        batches = math.ceil(math.ceil(VALIDATION / (WORLD // pipeline)) / 5)  # a replica's, each epoch
        held = record["validation"]  # before and after each validation_step
        assert held and len(held) % (2 * batches) == 0, (rank, len(held))
        assert held == [want] * len(held), f"validation holds other stages' blocks on rank {rank}"


def assert_one_process(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert want["norms"] and max(want["norms"]) > CLIP, "the clipping must bite for the comparison to mean anything"
    assert got["state"].keys() == want["state"].keys()
    for key in want["state"]:
        torch.testing.assert_close(got["state"][key], want["state"][key], msg=key)
    names = ["train_loss", "val_loss", *(["val_mae"] if "val_mae" in want["metrics"] else [])]
    for name in names:
        torch.testing.assert_close(got["metrics"][name], want["metrics"][name], msg=name)


# (model, pipeline stages, schedule, accumulate_grad_batches): the default suite runs one of each schedule, each
# layout and each k once; -m slow the whole matrix
CASES = [
    ("sequential", 2, "1f1b", 3),
    ("gpt", 4, "gpipe", 1),
    ("gpt", 2, "interleaved_1f1b", 3),
    ("hf_gpt2", 2, "gpipe", 1),
]
MATRIX = [
    ("gpt8" if (model, p, schedule) == ("gpt", 4, "interleaved_1f1b") else model, p, schedule, k)
    for model in ("sequential", "gpt")
    for p in (2, 4)
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b")
    for k in (1, 3)
    if (model, p, schedule, k) not in CASES and (model, p, schedule) != ("sequential", 4, "interleaved_1f1b")
]


@pytest.mark.parametrize(("model", "pipeline", "schedule", "accumulate"), CASES)
def test_pipeline_trains_as_one_process(
    tmp_path: Path, model: str, pipeline: int, schedule: str, accumulate: int
) -> None:
    want = reference(model, accumulate, tmp_path / "reference")
    # the GPT at pipeline 4 also recomputes its blocks' activations and checks the gradients are finite
    options = {"activation_checkpointing": Block, "nonfinite": "error"} if (model, pipeline) == ("gpt", 4) else {}
    got = pipelined(
        tmp_path / "pipeline", model, pipeline, schedule, accumulate, predict=model == "sequential", **options
    )
    assert_one_process(got, want)
    assert_holds_its_stages(tmp_path / "pipeline", model, pipeline, schedule)
    # the checkpoint the pipeline wrote is one process's: it resumes on one device and continues as an
    # uninterrupted run (its optimizer state, gathered from the stages, included)
    epochs = (2 if accumulate == 1 else 4) if model == "sequential" else 0
    if model == "sequential":  # stage 0 (rank 0) sends the (1, 8) float64 activation of each of 4 micro-batches
        stats = got["stats"]
        assert (stats.stages, stats.microbatches, stats.bytes_sent) == (2, 4, 4 * 8 * 8)
        assert stats.bubble_theory == pytest.approx(1 / 5) and 0.0 <= stats.bubble <= 1.0
        assert got["ledger"].stage_bytes_per_step == accumulate * stats.bytes_sent  # k micro-steps per step
        assert got["main_stats"] == stats  # rank 0's, handed back to the main process as its callback_metrics
    if epochs:
        trained = SequentialNet()
        trained.load_state_dict(want["state"])
        with torch.no_grad():
            torch.testing.assert_close(got["predictions"], trained(dataset(model).tensors[0]))
        resumed = reference(
            model, accumulate, tmp_path / "resumed", ckpt=tmp_path / "pipeline" / "last.ckpt", epochs=epochs
        )
        uninterrupted = reference(model, accumulate, tmp_path / "uninterrupted", epochs=epochs)
        # and the other way: one process's checkpoint resumed by the pipeline (its optimizer state loaded on every
        # stage) continues as the uninterrupted run
        into_pipeline = pipelined(
            tmp_path / "into_pipeline",
            model,
            pipeline,
            schedule,
            accumulate,
            ckpt=tmp_path / "reference" / "last.ckpt",
            epochs=epochs,
        )
        assert_holds_its_stages(tmp_path / "into_pipeline", model, pipeline, schedule)  # the loaded state too
        for key in uninterrupted["state"]:
            torch.testing.assert_close(resumed["state"][key], uninterrupted["state"][key], msg=key)
            torch.testing.assert_close(into_pipeline["state"][key], uninterrupted["state"][key], msg=key)
        if pipeline == 2:  # pipeline 2 x data 2 -> data 4 (ZeRO-3) -> one process: one uninterrupted run
            assert_layout_chain(tmp_path, model, accumulate, epochs)


def assert_layout_chain(tmp: Path, name: str, accumulate: int, epochs: int) -> None:
    """Pipeline 2 x data 2 -> ZeRO-3 over 4 data replicas -> one process, one uninterrupted run: the pipeline stops
    mid-epoch (its loader's position, counted in the epoch's global order, goes into the checkpoint), ZeRO-3
    resumes there (the optimizer state split across the 4 ranks, each taking its half of the pipeline replica's
    samples) and stops at the end of the next epoch; one process resumes that for the last epoch: the weights are
    those of the uninterrupted one-process run. Negative controls: the last leg without the optimizer state (its
    momentum dropped from the checkpoint), and the middle leg without the loader's position, do not give them."""
    want = reference(name, accumulate, tmp / "shuffled", epochs=epochs, automatic=True)
    steps_per_epoch = SAMPLES // GLOBAL_BATCH // accumulate
    stop = (epochs - 2) * steps_per_epoch + 1  # one optimizer step into the second-to-last epoch
    strategy = MGPUShardedStrategy(pipeline_parallel_size=2, pipeline_microbatches=4, start_method="fork")
    first = tmp / "chain_pipeline" / "mid_epoch.ckpt"
    kwargs = trainer_kwargs(tmp / "chain_pipeline", accumulate, devices=WORLD, strategy=strategy, max_steps=stop)
    kwargs["callbacks"].append(SaveAfterStep(first, stop))
    pl.Trainer(**{**kwargs, "max_epochs": -1}).fit(make_model(name), Data(dataset(name), GLOBAL_BATCH // 2, True))
    position = torch.load(first, weights_only=False)[POSITION_KEY]
    assert (position["consumed"], position["complete"]) == (accumulate * GLOBAL_BATCH, False)

    def zero3(out: Path, ckpt: Path) -> Path:
        strategy = MGPUShardedStrategy(stage=3, start_method="fork")
        kwargs = trainer_kwargs(out, accumulate, devices=WORLD, strategy=strategy, max_epochs=epochs - 1)
        pl.Trainer(**kwargs).fit(make_model(name), Data(dataset(name), GLOBAL_BATCH // WORLD, True), ckpt_path=ckpt)
        return out / "last.ckpt"

    middle = zero3(tmp / "zero3", first)
    saved = torch.load(middle, weights_only=False)
    assert (saved["epoch"], saved["global_step"]) == (epochs - 1, (epochs - 1) * steps_per_epoch)
    assert saved["optimizer_states"][0]["state"], "the momentum travels through the data-parallel layout"
    final = reference(name, accumulate, tmp / "final", ckpt=middle, epochs=epochs, automatic=True)
    assert_same_weights(final, want)
    for state in saved["optimizer_states"]:
        state["state"] = {}
    torch.save(saved, tmp / "no_momentum.ckpt")
    control = reference(
        name, accumulate, tmp / "no_momentum", ckpt=tmp / "no_momentum.ckpt", epochs=epochs, automatic=True
    )
    with pytest.raises(AssertionError):
        assert_same_weights(control, want)
    unplaced = torch.load(first, weights_only=False)  # Lightning's replay: the epoch's first batches again
    del unplaced[POSITION_KEY]
    torch.save(unplaced, tmp / "no_position.ckpt")
    replayed_middle = zero3(tmp / "no_position", tmp / "no_position.ckpt")
    replayed = reference(name, accumulate, tmp / "replayed", ckpt=replayed_middle, epochs=epochs, automatic=True)
    with pytest.raises(AssertionError):
        assert_same_weights(replayed, want)


def assert_same_weights(got: dict[str, Any], want: dict[str, Any]) -> None:
    for key in want["state"]:
        torch.testing.assert_close(got["state"][key], want["state"][key], msg=key)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "pipeline", "schedule", "accumulate"), MATRIX)
def test_pipeline_matrix(tmp_path: Path, model: str, pipeline: int, schedule: str, accumulate: int) -> None:
    assert_one_process(
        pipelined(tmp_path / "pipeline", model, pipeline, schedule, accumulate),
        reference(model, accumulate, tmp_path / "reference"),
    )
    assert_holds_its_stages(tmp_path / "pipeline", model, pipeline, schedule)


class UnsyncedReplicas(PipelineBackend):
    """Negative control: the data replicas' gradients are not averaged (each replica steps on its own half of the
    batch). (Summing the micro-batches' losses instead of averaging them would not do: clipping that bites every
    step hides a scale.)"""

    def sync_gradients(self) -> None:
        pass


class GatheringUnsyncedReplicas(UnsyncedReplicas):
    """And the whole model gathered on every rank for evaluation (the step run on it, not through the stages)."""

    def runs_stages_in_evaluation(self) -> bool:
        self.gather_blocks()
        return False


class BrokenPipeline(MGPUShardedStrategy):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        assert isinstance(self._sharded.steps, PipelineSteps)
        p = self._sharded.steps.pipeline
        self._sharded.steps.pipeline = self._sharded.sharding = GatheringUnsyncedReplicas(
            p.size, "1f1b", p.microbatches, "auto"
        )


def test_negative_control_the_comparison_fails_for_a_wrong_pipeline(tmp_path: Path) -> None:
    want = reference("sequential", 1, tmp_path / "reference")
    got = pipelined(tmp_path / "pipeline", "sequential", 2, "1f1b", 1, strategy_cls=BrokenPipeline)
    with pytest.raises(AssertionError):
        assert_one_process(got, want)
    # the whole model gathered for validation: the check of what each rank holds during validation fails
    with pytest.raises(AssertionError, match="validation holds other stages' blocks"):
        assert_holds_its_stages(tmp_path / "pipeline", "sequential", 2, "1f1b")


@pytest.mark.parametrize("stage", [2, 3])
def test_the_lightning_namespace_trains_a_module_list_model_as_one_process(tmp_path: Path, stage: int) -> None:
    """``import lightning as L`` with ``lightning_mgpu.lightning`` (``stage=3``: each stage one FSDP2 unit over its
    data dimension of 1): pipeline 2 on 2 processes, 1F1B, a model whose
    forward iterates a ``ModuleList``, its loader sharded by Lightning's automatic sampler (one data replica: both
    stages see every batch). Batches of 10, 10, 10, 10, 8, 10: the batch of a new shape is checked with the other
    stage's blocks freed (gathered for that one forward, freed again)."""
    import lightning as L

    import lightning_mgpu.lightning as mgpu

    data = dataset("sequential")

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.inp = nn.Linear(6, WIDTH)
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3)])
            self.out = nn.Linear(WIDTH, 3)
            self.double()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            h = self.inp(x)
            for layer in self.layers:
                h = layer(h)
            return F.mse_loss(self.out(h), y)

        def train_dataloader(self) -> DataLoader:
            if self.trainer.world_size > 1:  # Lightning's automatic sampler, shuffling: one data replica of 2 stages
                return DataLoader(data, batch_size=10)
            # one process: the same order (torch's shuffle of epoch 0 with Lightning's seed 0, one replica)
            sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
            return DataLoader(data, batch_size=10, sampler=sampler)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    class Save(L.Callback):
        def on_train_end(self, trainer: Any, module: Any) -> None:
            state = trainer.strategy.lightning_module_state_dict()
            if trainer.global_rank == 0:
                torch.save(state, tmp_path / f"{trainer.world_size}.pt")

    flags: dict[str, Any] = {"accelerator": "cpu", "max_steps": 6, "logger": False, "enable_checkpointing": False}
    flags.update(enable_progress_bar=False, enable_model_summary=False, callbacks=[Save()])
    L.Trainer(devices=1, **flags).fit(Net())
    strategy = mgpu.MGPUShardedStrategy(
        stage=stage, pipeline_parallel_size=2, pipeline_microbatches=2, start_method="fork"
    )
    L.Trainer(devices=2, strategy=strategy, **flags).fit(Net())
    want, got = torch.load(tmp_path / "1.pt"), torch.load(tmp_path / "2.pt")
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=key)


IGNORE = -100  # cross_entropy's ignore_index: the padding of the targets


class TokenGPT(TinyGPT):
    """``loss_normalization="tokens"``: the sum of the token losses over the real (not padded) targets, and their
    count."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        loss, tokens = gpt_token_losses(self, batch)
        return {"loss": loss, "num_tokens": tokens}


def gpt_token_losses(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    idx, target = batch
    loss = F.cross_entropy(model(idx).flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="sum")
    return loss, (target != IGNORE).sum()


def padded_dataset() -> TensorDataset:
    """``dataset("gpt")`` with each row's targets padded after 1 to SEQ real tokens."""
    idx, target = dataset("gpt").tensors
    lengths = torch.randint(1, SEQ + 1, (SAMPLES,), generator=torch.Generator().manual_seed(2))
    return TensorDataset(idx, target.masked_fill(torch.arange(SEQ)[None, :] >= lengths[:, None], IGNORE))


def token_reference(step_batch: int, epochs: int, micro: int = 0) -> tuple[dict[str, torch.Tensor], float]:
    """One process, plain torch, the global batch of each optimizer step in one piece: the mean over its real
    tokens (``micro``: instead, the mean of the means of its ``micro`` micro-batches, the plain loss's weighting);
    the weights and the last step's token mean."""
    model = TokenGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    last = 0.0
    for _ in range(epochs):
        for batch in DataLoader(padded_dataset(), batch_size=step_batch):
            opt.zero_grad()
            loss, tokens = gpt_token_losses(model, batch)
            if micro:
                parts = zip(*(t.chunk(micro) for t in batch))
                sum(s / n for s, n in (gpt_token_losses(model, mb) for mb in parts)).div(micro).backward()
            else:
                (loss / tokens).backward()
            opt.step()
            last = float(loss.detach() / tokens)
    return model.state_dict(), last


def test_pipeline_token_loss_is_the_mean_over_every_token_of_the_step(tmp_path: Path) -> None:
    """``loss_normalization="tokens"`` through pipeline 2 x data 2, 4 micro-batches of one row each, k=2: the
    weights are those of one process minimising the mean over every real token of the step's 16 rows, and the
    logged ``loss_per_token`` is that mean. No clipping (it would hide a scale). The rows hold 1 to 6 real tokens,
    so the mean of the micro-batches' means (the plain loss's weighting) ends elsewhere: the comparison can fail."""
    accumulate, replicas, m = 2, 2, 4
    counts = {int(row.ne(IGNORE).sum()) for row in padded_dataset().tensors[1]}
    assert len(counts) > 1, "micro-batches of different token counts"
    strategy = MGPUShardedStrategy(
        pipeline_parallel_size=2, pipeline_microbatches=m, loss_normalization="tokens", start_method="fork"
    )
    kwargs = trainer_kwargs(tmp_path, accumulate, devices=WORLD, strategy=strategy, gradient_clip_val=None)
    pl.Trainer(**kwargs).fit(TokenGPT(), Data(padded_dataset(), GLOBAL_BATCH // replicas))
    got = torch.load(tmp_path / "record.pt", weights_only=False)
    step_batch, epochs = GLOBAL_BATCH * accumulate, kwargs["max_epochs"]
    want, last_mean = token_reference(step_batch, epochs)
    assert got["state"].keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got["state"][key], want[key], msg=key)
    torch.testing.assert_close(got["metrics"]["loss_per_token"], last_mean)
    initial = TokenGPT().state_dict()
    assert max(float((want[k] - initial[k]).abs().max()) for k in want) > 1e-2, "the weights moved"
    mean_of_means, _ = token_reference(step_batch, epochs, micro=step_batch)  # one row per micro-batch
    with pytest.raises(AssertionError):
        for key in want:
            torch.testing.assert_close(got["state"][key], mean_of_means[key], msg=key)


class GlobalRankValidation(Data):
    """Validation batches sharded over the 4 global ranks (not the data replicas): the stages of one pipeline get
    different batches."""

    def val_dataloader(self) -> DataLoader:
        data = TensorDataset(*(t[:VALIDATION] for t in self.data.tensors))
        return DataLoader(data, batch_size=5, sampler=DistributedSampler(data, shuffle=False))


class GlobalRankTraining(Data):
    """Training batches sharded over the 4 global ranks (not the data replicas), as a loader built for plain data
    parallelism shards them, or as data drawn at random in each process differs: the stages of one pipeline would
    compute their loss on another batch's activations."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, sampler=DistributedSampler(self.data, shuffle=False))


@pytest.mark.parametrize(
    ("data_cls", "method"), [(GlobalRankValidation, "validation_step"), (GlobalRankTraining, "training_step")]
)
def test_batches_that_differ_between_the_stages_are_refused(data_cls: type, method: str, tmp_path: Path) -> None:
    """Every evaluation batch, and the first training batch of a fit, is compared across the pipeline's ranks."""
    strategy = MGPUShardedStrategy(pipeline_parallel_size=2, pipeline_microbatches=4, start_method="fork")
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(tmp_path, 1, devices=WORLD, limit_train_batches=1))
    with pytest.raises(Exception, match=f"different {method} batches") as raised:  # raised, not waited on
        trainer.fit(make_model("sequential"), data_cls(dataset("sequential"), GLOBAL_BATCH // 2))
    assert "distributed_sampler_kwargs" in str(raised.value) and "seed_everything" in str(raised.value)


# --- compile=True: each block compiled, the stage hooks and training_step eager ------------------------------------

BLOCKS = [f"blocks.{i}" for i in range(4)]


class CompiledBlocks(pl.Callback):
    """On every rank: the modules compiled at the start and the end of training (the blocks each rank skips as
    another stage's stay compiled) and the graphs torch.compile compiled in this process (counted from a fresh
    compiler state at set-up)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.record: dict[str, Any] = {}

    def setup(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        torch.compiler.reset()
        self.base = _compat.compiled_graph_count()

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.record["start"] = compiled_modules(module)

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.record["end"] = compiled_modules(module)
        self.record["graphs"] = _compat.compiled_graph_count() - self.base
        torch.save(self.record, self.out / f"compiled{trainer.global_rank}.pt")


def compiled_pipeline(tmp: Path, accumulate: int, compile: Any, world: int, stage: int = 2) -> dict[str, Any]:
    """The 4-block GPT under pipeline 2 (1F1B, 4 micro-batches) on ``world`` processes with ``compile`` (at
    ``stage=3`` each stage's blocks sharded over its data ranks)."""
    strategy = MGPUShardedStrategy(
        stage=stage, pipeline_parallel_size=2, pipeline_microbatches=4, compile=compile, start_method="fork"
    )
    kwargs = trainer_kwargs(tmp, accumulate, devices=world, strategy=strategy)
    kwargs["callbacks"].append(CompiledBlocks(tmp))
    pl.Trainer(**kwargs).fit(TinyGPT(), Data(dataset("gpt"), GLOBAL_BATCH // (world // 2)))
    record = torch.load(tmp / "record.pt", weights_only=False)
    record["ranks"] = [torch.load(tmp / f"compiled{r}.pt", weights_only=False) for r in range(world)]
    return record


def assert_compiled_as_one_process(got: dict[str, Any], want: dict[str, Any]) -> None:
    """The weights (gathered at the end of fit), the training loss and the validation loss (run through the stages,
    the compiled blocks' evaluation graphs) are one process's; every rank compiled every block, kept them compiled
    to the end of training and compiled graphs."""
    assert_one_process(got, want)
    for rank, record in enumerate(got["ranks"]):
        assert record["start"] == record["end"] == BLOCKS, rank
        assert record["graphs"] > 0, rank


def perturbed_backend(graph: Any, example_inputs: Any) -> Any:
    """A torch.compile backend that runs the graph eagerly and scales its floating outputs by 1.001: blocks that
    really run compiled give other weights (negative control)."""

    def run(*args: Any) -> Any:
        out = graph(*args)
        scale = lambda t: t * 1.001 if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
        return type(out)(scale(t) for t in out) if isinstance(out, (tuple, list)) else scale(out)

    return run


@pytest.mark.slow
def test_compiled_pipeline_trains_as_one_process(tmp_path: Path) -> None:
    """``compile`` under pipeline 2 on 2 processes, k = 1, with torch's ``aot_eager`` backend (dynamo's graphs and
    AOTAutograd's forward and backward, as inductor gets them, without inductor's kernel compile: about a minute less
    on 2 cores): each block compiled, the weights, the training and validation losses those of one process; a backend
    that perturbs the compiled blocks' outputs gives other weights (so the blocks ran compiled, and the comparison can
    fail). ``compile=True`` itself (inductor) under the pipeline: the three compiled-pipeline tests below. In the slow
    tier: ten seconds of a 2-core default suite for a combination of two features each proved there alone."""
    want = reference("gpt", 1, tmp_path / "reference")
    compiled = compiled_pipeline(tmp_path / "compiled", 1, {"backend": "aot_eager"}, world=2)
    assert_compiled_as_one_process(compiled, want)
    control = compiled_pipeline(tmp_path / "perturbed", 1, {"backend": perturbed_backend}, world=2)
    assert all(r["end"] == BLOCKS for r in control["ranks"])  # compiled, with the perturbing backend
    with pytest.raises(AssertionError):
        assert_one_process(control, want)


@pytest.mark.slow
def test_compiled_pipeline_with_data_replicas_and_accumulation_trains_as_one_process(tmp_path: Path) -> None:
    """``compile=True`` (inductor) under pipeline 2 x data 2 on 4 processes, k = 3."""
    want = reference("gpt", 3, tmp_path / "reference")
    assert_compiled_as_one_process(compiled_pipeline(tmp_path / "compiled", 3, True, world=4), want)


@pytest.mark.slow
def test_compiled_blocks_sharded_by_zero3_inside_the_pipeline_train_as_one_process(tmp_path: Path) -> None:
    """``compile=True`` with ``stage=3`` under pipeline 2 x data 2 on 4 processes, k = 1: each stage's blocks
    sharded over its data ranks and each block compiled; the weights and losses are one process's."""
    want = reference("gpt", 1, tmp_path / "reference")
    assert_compiled_as_one_process(compiled_pipeline(tmp_path / "compiled", 1, True, world=4, stage=3), want)


@pytest.mark.slow
def test_the_lightning_namespace_trains_a_compiled_pipeline_as_one_process(tmp_path: Path) -> None:
    """``import lightning as L`` with ``lightning_mgpu.lightning``: pipeline 2 on 2 processes, ``compile`` (with
    ``aot_eager``: the namespace is the subject here, inductor under the pipeline is proved above), a GPT whose forward
    iterates a ``ModuleList`` of the blocks above: the weights of one process, every block compiled on both ranks."""
    import lightning as L

    import lightning_mgpu.lightning as mgpu
    from lightning_mgpu.lightning.parts import compilation  # the namespace's own copy of the part

    data = dataset("gpt")

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.wte = nn.Embedding(VOCAB, WIDTH)
            self.blocks = nn.ModuleList([Block() for _ in range(4)])
            self.head = nn.Linear(WIDTH, VOCAB)
            self.double()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            idx, target = batch
            mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)
            x = self.wte(idx)
            for block in self.blocks:
                x = block(x, mask)
            return F.cross_entropy(self.head(x).flatten(0, 1), target.flatten())

        def train_dataloader(self) -> DataLoader:
            kwargs = self.trainer.strategy.distributed_sampler_kwargs if self.trainer.world_size > 1 else {}
            sampler = DistributedSampler(data, shuffle=False, **({"num_replicas": 1, "rank": 0} | (kwargs or {})))
            return DataLoader(data, batch_size=GLOBAL_BATCH, sampler=sampler)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)

    class Save(L.Callback):
        def on_train_end(self, trainer: Any, module: Any) -> None:
            compiled = compilation.compiled_modules(module)
            state = trainer.strategy.lightning_module_state_dict()
            torch.save((state, compiled), tmp_path / f"{trainer.world_size}-{trainer.global_rank}.pt")

    flags: dict[str, Any] = {"accelerator": "cpu", "max_steps": 4, "logger": False, "enable_checkpointing": False}
    flags.update(enable_progress_bar=False, enable_model_summary=False, callbacks=[Save()])
    flags.update(use_distributed_sampler=False)
    L.Trainer(devices=1, **flags).fit(Net())
    strategy = mgpu.MGPUShardedStrategy(
        pipeline_parallel_size=2, pipeline_microbatches=2, compile={"backend": "aot_eager"}, start_method="fork"
    )
    L.Trainer(devices=2, strategy=strategy, **flags).fit(Net())
    want, _ = torch.load(tmp_path / "1-0.pt")
    for rank in range(2):
        got, compiled = torch.load(tmp_path / f"2-{rank}.pt")
        assert compiled == BLOCKS, rank
        for key in want:
            torch.testing.assert_close(got[key], want[key], msg=f"{key} on rank {rank}")


# --- stage=3: ZeRO-3 over the data dimension inside the pipeline ------------------------------------------------


class ShardedRecord(pl.Callback):
    """Under ``MGPUShardedStrategy(stage=3, pipeline_parallel_size=2)``, on every rank before each optimizer step:
    the reduce-scatters and all-gathers issued so far (FSDP2's collectives, counted by spies installed in each
    process), and the
    bytes of the optimizer state this rank holds for its stages' blocks beside what one whole replica of them
    would hold; at the end of fit the whole state, the metrics and a checkpoint."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.calls = 0
        self.gathers = 0
        self.norms: list[float] = []
        self.mesh: tuple[int, ...] = ()  # the shape of the mesh the first sharded parameter lives on
        # (reduce-scatters so far, all-gathers so far, state bytes held, state bytes whole)
        self.steps: list[tuple[int, int, int, int]] = []

    def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.world_size == 1:
            return
        reduce_scatter, all_gather = torch.distributed.reduce_scatter_single, torch.distributed.all_gather_single

        def counted_reduce(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return reduce_scatter(*args, **kwargs)

        def counted_gather(*args: Any, **kwargs: Any) -> Any:
            self.gathers += 1
            return all_gather(*args, **kwargs)

        # FSDP2's collectives, in this process only (forked: the parent keeps its own)
        torch.distributed.reduce_scatter_single = counted_reduce
        torch.distributed.all_gather_single = counted_gather
        assert isinstance(trainer.strategy._sharded.steps, PipelineSteps)

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        from lightning_mgpu.parts.sharding import local_bytes

        if trainer.world_size == 1:  # the one-process reference: the pre-clip norm
            self.norms.append(float(torch.stack([p.grad.pow(2).sum() for p in module.parameters()]).sum().sqrt()))
            return
        sharded = trainer.strategy._sharded.steps.pipeline.held.sharded_params
        self.mesh = tuple(sharded[0].device_mesh.shape)
        held = whole = 0
        for p in sharded:
            for value in optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor) and value.shape == p.shape:
                    held += local_bytes(value)
                    whole += value.numel() * value.element_size()
        self.steps.append((self.calls, self.gathers, held, whole))

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        sharded = getattr(trainer.strategy, "_sharded", None)  # the whole model whatever the checkpoint layout
        state = sharded.sharding.full_model_state(module) if sharded else trainer.strategy.lightning_module_state_dict()
        trainer.save_checkpoint(self.out / "last.ckpt")
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(self.steps, self.out / f"steps{trainer.global_rank}.pt")
        if trainer.global_rank == 0:
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            ledger = getattr(trainer.strategy, "comm_stats", None) if trainer.world_size > 1 else None
            record = {"state": state, "metrics": metrics, "norms": self.norms, "ledger": ledger, "mesh": self.mesh}
            torch.save(record, self.out / "record.pt")


def sharded_run(
    out: Path,
    schedule: str,
    accumulate: int,
    stage: int = 3,
    devices: int = WORLD,
    ckpt: Optional[Path] = None,
    epochs: int = 0,
    strategy_cls: type = MGPUShardedStrategy,
    checkpoint: str = "consolidated",
    data_cls: type = Data,
    layout: Optional[dict[str, Any]] = None,
    **flags: Any,
) -> dict[str, Any]:
    """TinyGPT (a head tied to the embedding, outside the blocks) through pipeline 2 x data 2 at ``stage`` (or one
    process with ``devices=1``: plain Lightning, or ``MGPUShardedStrategy(stage=3)`` to read a sharded checkpoint),
    float64, clipping that bites."""
    out.mkdir(parents=True, exist_ok=True)
    kwargs = trainer_kwargs(out, accumulate, devices=devices)
    kwargs["callbacks"] = [ShardedRecord(out)]
    kwargs.update(flags)
    if epochs:
        kwargs["max_epochs"] = epochs
    replicas = devices // 2 if devices > 1 else 1  # pipeline 2
    if devices > 1:
        m = min(4, GLOBAL_BATCH // replicas)
        kwargs["strategy"] = strategy_cls(
            stage=stage,
            pipeline_parallel_size=2,
            pipeline_schedule=schedule,
            pipeline_microbatches=m,
            checkpoint=checkpoint,
            start_method="fork",
            **(layout or {}),
        )
    elif checkpoint == "sharded":
        kwargs["strategy"] = MGPUShardedStrategy(stage=3, checkpoint="sharded", start_method="fork")
    pl.Trainer(**kwargs).fit(make_model("gpt"), data_cls(dataset("gpt"), GLOBAL_BATCH // replicas), ckpt_path=ckpt)
    record = torch.load(out / "record.pt", weights_only=False)
    if devices > 1:
        record["steps"] = [torch.load(out / f"steps{r}.pt", weights_only=False) for r in range(devices)]
    return record


def assert_sharded_over_data(
    record: dict[str, Any], accumulate: int, units: int = 1, steps: int = 0, gathered_per_batch: bool = False
) -> None:
    """One reduce-scatter and one all-gather per local stage and optimizer step (not per micro-batch, nor per
    accumulation micro-step), the ledger's rounds alike; the optimizer state of each rank's blocks is half of a
    whole replica's (2 data ranks). ``gathered_per_batch``: torch's interleaved schedule gathers and reshards each
    stage in every batch (its own unshard and reshard actions), k all-gathers per optimizer step."""
    count = steps or SAMPLES // GLOBAL_BATCH // accumulate * (1 if accumulate == 1 else 2)
    ledger = record["ledger"]  # rank 0's: its stage's 2 blocks' float64 gradients, one reduce-scatter per step
    block_bytes = 2 * 600 * 8 // units
    assert ledger.sync_rounds == ledger.optimizer_steps == len(record["steps"][0])
    assert ledger.round_bytes == ledger.optimizer_steps * units * block_bytes
    for rank, rows in enumerate(record["steps"]):
        assert len(rows) == count, rank
        for step, (calls, gathers, held, whole) in enumerate(rows):
            assert calls == units * (step + 1), (rank, step, calls)
            # the stage gathered once per step, once more at the first (the shape check of the batch) and once for
            # each validation loop so far (one per epoch)
            extra = 1 + step // (SAMPLES // GLOBAL_BATCH // accumulate)
            per_step = accumulate if gathered_per_batch else 1
            assert gathers == units * (per_step * (step + 1) + extra), (rank, step, gathers)
            if step or steps:  # SGD's momentum exists after the first step, or from a checkpoint
                assert whole > 0 and held == whole // 2, (rank, step, held, whole)


@pytest.mark.parametrize("accumulate", [1, 3])
def test_zero3_inside_the_pipeline_trains_as_one_process(tmp_path: Path, accumulate: int) -> None:
    """``stage=3`` with pipeline 2 x data 2 (1F1B): each stage's blocks sharded with FSDP2 over its 2 data ranks,
    gradients reduce-scattered once per optimizer step; the weights and logged values are one process's; (k=1) its
    consolidated checkpoint resumes in one process as an uninterrupted run, and one process's checkpoint resumes
    in the pipeline (its optimizer state cut into the shards) as that run too."""
    want = sharded_run(tmp_path / "reference", "1f1b", accumulate, devices=1)
    got = sharded_run(tmp_path / "zero3", "1f1b", accumulate)
    assert_sharded_over_data(got, accumulate)
    assert_sharded_one_process(got, want)
    if accumulate == 1:
        resumed = sharded_run(
            tmp_path / "resumed", "1f1b", 1, devices=1, ckpt=tmp_path / "zero3" / "last.ckpt", epochs=2
        )
        uninterrupted = sharded_run(tmp_path / "uninterrupted", "1f1b", 1, devices=1, epochs=2)
        into = sharded_run(tmp_path / "into", "1f1b", 1, ckpt=tmp_path / "reference" / "last.ckpt", epochs=2)
        for key in uninterrupted["state"]:
            torch.testing.assert_close(resumed["state"][key], uninterrupted["state"][key], msg=key)
            torch.testing.assert_close(into["state"][key], uninterrupted["state"][key], msg=key)
        assert_sharded_over_data(into, 1, steps=SAMPLES // GLOBAL_BATCH)  # the loaded momentum in shards


def test_zero3_inside_the_pipeline_writes_a_sharded_checkpoint(tmp_path: Path) -> None:
    """``checkpoint="sharded"`` (DCP) with pipeline 2 x data 2 at ``stage=3``: each rank writes the shards of its
    stage's blocks and the weights outside the blocks, not the other stage's freed blocks; the directory resumes in
    the pipeline and in one process (re-sliced by DCP), each continuing as the uninterrupted one-process run. The
    optimizer state is in the shards from the first step on."""
    saved = tmp_path / "zero3" / "last.ckpt"
    sharded_run(tmp_path / "zero3", "1f1b", 1, checkpoint="sharded")
    assert saved.is_dir()
    uninterrupted = sharded_run(tmp_path / "uninterrupted", "1f1b", 1, devices=1, epochs=2)
    pipeline = sharded_run(tmp_path / "pipeline", "1f1b", 1, ckpt=saved, epochs=2, checkpoint="sharded")
    one = sharded_run(tmp_path / "one", "1f1b", 1, devices=1, ckpt=saved, epochs=2, checkpoint="sharded")
    for key in uninterrupted["state"]:
        torch.testing.assert_close(pipeline["state"][key], uninterrupted["state"][key], msg=key)
        torch.testing.assert_close(one["state"][key], uninterrupted["state"][key], msg=key)
    assert_sharded_over_data(pipeline, 1, steps=SAMPLES // GLOBAL_BATCH)  # the second epoch, its momentum loaded


def assert_sharded_one_process(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert want["norms"] and max(want["norms"]) > CLIP, "the clipping must bite for the comparison to mean anything"
    assert got["state"].keys() == want["state"].keys()
    for key in want["state"]:
        torch.testing.assert_close(got["state"][key], want["state"][key], msg=key)
    for name in ("train_loss", "val_loss"):
        torch.testing.assert_close(got["metrics"][name], want["metrics"][name], msg=name)


class ReplicatedCountedTwice(PipelineBackend):
    """Negative control: the clipping norm counts the parameters outside the blocks (replicated on all 4 ranks)
    whole on both data ranks of the first stage, not once."""

    def norm_clipping(self, group: Any, ledger: Any) -> Any:
        clipping = super().norm_clipping(group, ledger)
        clipping.copies = lambda grad: 1  # no copies: the weights outside the blocks whole on both ranks of stage 0
        return clipping


class MiscountedZero3(MGPUShardedStrategy):
    backend: type[PipelineBackend] = ReplicatedCountedTwice

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        assert isinstance(self._sharded.steps, PipelineSteps)
        p = self._sharded.steps.pipeline
        self._sharded.steps.pipeline = self._sharded.sharding = self.backend(
            p.size, "1f1b", p.microbatches, "auto", shard_stage=3
        )


def test_negative_control_zero3_inside_the_pipeline_with_a_wrong_norm(tmp_path: Path) -> None:
    want = sharded_run(tmp_path / "reference", "1f1b", 1, devices=1)
    got = sharded_run(tmp_path / "zero3", "1f1b", 1, strategy_cls=MiscountedZero3)
    assert_sharded_over_data(got, 1)  # sharded as the right one: only the norm differs
    with pytest.raises(AssertionError):
        assert_sharded_one_process(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved_1f1b"])
@pytest.mark.parametrize("accumulate", [1, 3])
def test_zero3_inside_the_pipeline_matrix(tmp_path: Path, schedule: str, accumulate: int) -> None:
    want = sharded_run(tmp_path / "reference", schedule, accumulate, devices=1)
    got = sharded_run(tmp_path / "zero3", schedule, accumulate)
    interleaved = schedule == "interleaved_1f1b"
    assert_sharded_over_data(got, accumulate, units=2 if interleaved else 1, gathered_per_batch=interleaved)
    assert_sharded_one_process(got, want)


class UnevenValidation(Data):
    """Validation batches of one sample: 23 on one data replica, 22 on the other (the whole stages gathered for
    the loop)."""

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*(t[:VALIDATION] for t in self.data.tensors)), batch_size=1)


@pytest.mark.slow
def test_zero3_inside_the_pipeline_validates_unevenly_mid_epoch(tmp_path: Path) -> None:
    """Validation every 3 batches on replicas that run different numbers of batches: the sharded stages are gathered
    whole for the loop and sharded again by the next training step; weights and losses stay one process's."""
    want = sharded_run(tmp_path / "one", "1f1b", 1, devices=1, data_cls=UnevenValidation, val_check_interval=3)
    got = sharded_run(tmp_path / "zero3", "1f1b", 1, data_cls=UnevenValidation, val_check_interval=3)
    assert_sharded_one_process(got, want)


# --- HSDP (mesh="hybrid") inside the pipeline ----------------------------------------------------------------


class ShardCopiesCountedTwice(PipelineBackend):
    """Negative control for HSDP: the clipping norm counts each shard whole on both replicas that hold it (the
    weights outside the blocks still once)."""

    def norm_clipping(self, group: Any, ledger: Any) -> Any:
        from torch.distributed.tensor import DTensor

        clipping = super().norm_clipping(group, ledger)
        ranks = self.dims.data_parallel * self.dims.tensor  # the stage's ranks

        def total_norm(grads: Any) -> torch.Tensor:
            squared = torch.zeros((), dtype=torch.float64)
            for g in grads:
                local = g.to_local() if isinstance(g, DTensor) else g
                squared += local.double().pow(2).sum() / (1 if isinstance(g, DTensor) else ranks)
            torch.distributed.all_reduce(squared)
            return squared.sqrt()

        clipping.total_norm = total_norm
        return clipping


class MiscountedHSDP(MiscountedZero3):
    backend = ShardCopiesCountedTwice


HSDP_1 = {"mesh": "hybrid", "shard_size": 1}


@pytest.mark.slow  # the default suite proves HSDP's norm (test_sharding.py) and ZeRO-3's inside the pipeline apart
def test_hsdp_inside_the_pipeline_trains_as_one_process(tmp_path: Path) -> None:
    """``stage=3, mesh="hybrid", shard_size=1`` with pipeline 2 on 4 processes: each stage one FSDP2 unit over the
    2-D mesh (2 replicas x 1 shard) of its data ranks, so both ranks of a stage hold the same shard; the clipping
    norm counts it once (half on each replica) and the weights and losses equal one process's with k = 3; a norm
    that counts the copies twice does not (negative control). Lightning's sanity check runs first, on the whole
    model, the sharded stage gathered for it (it failed on the shards' DTensors)."""
    want = sharded_run(tmp_path / "reference", "1f1b", 3, devices=1)
    got = sharded_run(tmp_path / "hsdp", "1f1b", 3, layout=HSDP_1, num_sanity_val_steps=2)
    assert got["mesh"] == (2, 1)
    assert_sharded_one_process(got, want)
    wrong = sharded_run(tmp_path / "wrong", "1f1b", 3, layout=HSDP_1, strategy_cls=MiscountedHSDP)
    assert wrong["mesh"] == (2, 1)
    with pytest.raises(AssertionError):
        assert_sharded_one_process(wrong, want)


@pytest.mark.slow
def test_hsdp_inside_the_pipeline_on_8_processes_resumes_from_its_sharded_checkpoint(tmp_path: Path) -> None:
    """Pipeline 2 x HSDP (2 replicas x 2 shards) on 8 processes, k = 1, ``checkpoint="sharded"``: each rank holds
    half of its stage's optimizer state, one reduce-scatter per step; the weights and losses are one process's, and
    the DCP directory resumes in one process as the uninterrupted run."""
    layout = {"mesh": "hybrid", "shard_size": 2}
    want = sharded_run(tmp_path / "reference", "1f1b", 1, devices=1)
    got = sharded_run(tmp_path / "hsdp", "1f1b", 1, devices=8, layout=layout, checkpoint="sharded")
    assert got["mesh"] == (2, 2)
    assert_sharded_over_data(got, 1)
    assert_sharded_one_process(got, want)
    saved = tmp_path / "hsdp" / "last.ckpt"
    assert saved.is_dir()
    uninterrupted = sharded_run(tmp_path / "uninterrupted", "1f1b", 1, devices=1, epochs=2)
    one = sharded_run(tmp_path / "one", "1f1b", 1, devices=1, ckpt=saved, epochs=2, checkpoint="sharded")
    for key in uninterrupted["state"]:
        torch.testing.assert_close(one["state"][key], uninterrupted["state"][key], msg=key)


class CountedBatches(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        (self.out / f"batch{trainer.global_rank}-{trainer.global_step}").touch()


@pytest.mark.timeout(120)
def test_a_last_batch_that_does_not_split_is_refused_before_the_first_batch_trains(tmp_path: Path) -> None:
    """44 samples per replica in batches of 8 leave a last batch of 4, which 8 micro-batches cannot split: the fit
    is refused at its first training batch, naming ``drop_last=True``, with no batch trained (it failed at the end
    of the first epoch)."""
    data = TensorDataset(*(t[:44] for t in dataset("sequential").tensors))
    kwargs = trainer_kwargs(tmp_path, 1, devices=2, callbacks=[CountedBatches(tmp_path)])
    strategy = MGPUShardedStrategy(pipeline_parallel_size=2, pipeline_microbatches=8, start_method="fork")
    with pytest.raises(Exception, match=r"leave a last batch of 4\. Pass drop_last=True"):
        pl.Trainer(strategy=strategy, **kwargs).fit(make_model("sequential"), Data(data, GLOBAL_BATCH))
    assert not list(tmp_path.glob("batch*"))


# --- precision, the non-finite check and background checkpoints with the pipeline --------------------------------

OVERFLOW_STEP = 4  # the optimizer step whose gradient overflows on one stage of one replica only


class HalfNet(SequentialNet):
    """The sequential stack in float32, for mixed precision (autocast computes the linear layers in half)."""

    def __init__(self) -> None:
        super().__init__()
        self.float()
        self.val_mae.set_dtype(torch.float32)


def half_dataset() -> TensorDataset:
    return TensorDataset(*(t.float() for t in dataset("sequential").tensors))


class Inject(pl.Callback):
    """After the backward of optimizer step ``step``, on the ranks ``ranks`` (every rank of one process), puts
    ``value`` into the gradient of ``param`` where this rank holds it (before the gradient sync of the pipeline)."""

    def __init__(self, step: int, ranks: tuple[int, ...], param: str, value: float) -> None:
        self.step, self.ranks, self.param, self.value = step, ranks, param, value

    def on_after_backward(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.global_step != self.step or (trainer.world_size > 1 and trainer.global_rank not in self.ranks):
            return
        p = dict(module.named_parameters())[self.param]
        if p.numel() and p.grad is not None:  # held here (not one of the other stages' freed blocks)
            p.grad.view(-1)[0] = self.value


class EveryRank(pl.Callback):
    """Every rank: after each optimizer step, the loss scale, the skipped steps and the values of the parameters it
    holds; the error fit raised, if any."""

    def __init__(self, out: Path) -> None:
        self.out, self.steps = out, []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        plugin = trainer.precision_plugin
        held = {n: p.detach().clone() for n, p in module.named_parameters() if p.numel()}
        self.steps.append((getattr(plugin, "loss_scale", 1.0), getattr(plugin, "skipped_steps", 0), held))

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(self.steps, self.out / f"steps{trainer.global_rank}.pt")

    def on_exception(self, trainer: pl.Trainer, module: pl.LightningModule, exception: BaseException) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(f"{type(exception).__name__}: {exception}", self.out / f"error{trainer.global_rank}.pt")


def precision_run(
    out: Path,
    precision: Any,
    devices: int = WORLD,
    inject: Optional[Inject] = None,
    ckpt: Optional[Path] = None,
    save_at: int = -1,
    max_epochs: int = 1,
    **options: Any,
) -> dict[str, Any]:
    """HalfNet, k = 1, 6 steps an epoch, the precision (a name or an MGPUPrecision), on one process or on pipeline 2
    x data 2."""
    callbacks: list[Any] = [EveryRank(out)] + ([inject] if inject is not None else [])
    if save_at >= 0:
        callbacks.append(SaveAfterStep(out / "mid.ckpt", save_at))
    kwargs = trainer_kwargs(out, 1, devices=devices)
    kwargs["callbacks"] = kwargs["callbacks"] + callbacks
    kwargs["max_epochs"] = max_epochs
    if isinstance(precision, str):
        kwargs["precision"] = precision
    else:
        kwargs["plugins"] = [precision]
    replicas = 1
    if devices > 1:
        replicas = devices // 2
        kwargs["strategy"] = MGPUShardedStrategy(
            pipeline_parallel_size=2, pipeline_microbatches=4, start_method="fork", **options
        )
    trainer = pl.Trainer(**kwargs)
    trainer.fit(HalfNet(), Data(half_dataset(), GLOBAL_BATCH // replicas), ckpt_path=ckpt)
    record = torch.load(out / "record.pt", weights_only=False)
    record["ranks"] = [torch.load(out / f"steps{r}.pt", weights_only=False) for r in range(devices)]
    return record


def assert_close_to(got: dict[str, Any], want: dict[str, Any], tolerance: float) -> None:
    """The weights within ``tolerance`` (absolute) of one process's and the training loss within it relatively, and
    the comparison meaningful: training moved every weight tensor by more than ten times the tolerance."""
    start = HalfNet().state_dict()
    moved = [float((want["state"][k] - start[k]).abs().max()) for k in start]
    assert min(moved) > 10 * tolerance, moved
    assert got["state"].keys() == want["state"].keys()
    for key in want["state"]:
        torch.testing.assert_close(got["state"][key], want["state"][key], rtol=0, atol=tolerance, msg=key)
    torch.testing.assert_close(got["metrics"]["train_loss"], want["metrics"]["train_loss"], rtol=tolerance, atol=0)


def test_bf16_mixed_pipeline_trains_as_one_process_and_sends_bf16_activations(tmp_path: Path) -> None:
    """``precision="bf16-mixed"`` (CPU autocast, float32 weights), pipeline 2 x data 2, 1F1B, clipping that bites: the
    weights are one process's (Lightning's own ``MixedPrecision``) within 2e-4 and its loss within 2e-4 relatively.
    bf16 keeps 8 significant bits (unit roundoff 2^-9 ~ 2e-3): the pipeline rounds each micro-batch's weight
    gradient (one sample) to bf16 where one process rounds the whole batch's, so each step's update differs by a few
    roundoffs of itself, and the six steps move each weight by 7e-3 to 3e-2 in all (clipped at 0.05): a few 1e-5
    (3e-5 measured); 2e-4 leaves room for the order of the sums and stays ten times below every weight's movement
    (a wrong pipeline, such as unsynced replicas, is off by about that movement). The activation each micro-batch sends
    from stage 0 is the (1, 8) bf16 output of autocast's linear layer (its Tanh keeps bf16): 4 x 8 x 2 bytes per step,
    in the ledger too."""
    want = precision_run(tmp_path / "reference", "bf16-mixed", devices=1)
    got = precision_run(tmp_path / "pipeline", "bf16-mixed")
    assert max(want["norms"]) > CLIP
    assert_close_to(got, want, 2e-4)
    stats = got["stats"]
    assert (stats.stages, stats.microbatches, stats.bytes_sent) == (2, 4, 4 * 8 * 2)
    assert got["ledger"].stage_bytes_per_step == stats.bytes_sent
    assert all(p.dtype == torch.float32 for p in got["state"].values())


def fp16(init_scale: float = 2.0**24) -> MGPUPrecision:
    """fp16 whose first step overflows in the backward of every stage (and one process's), the next scale safe."""
    return MGPUPrecision("16-mixed", init_scale=init_scale, backoff_factor=2.0**-8)


def test_fp16_pipeline_skips_an_overflow_of_one_stage_on_every_rank_and_checkpoints_in_the_background(
    tmp_path: Path,
) -> None:
    """``MGPUPrecision("16-mixed")`` (CPU autocast, the fp16 loss scaler), pipeline 2 x data 2, 1F1B,
    ``async_checkpoint=True``. The schedule's backward starts from the loss times the loss scale, as one process's:
    at step 0 the scale 2^24 overflows the half backward in the stages, and every rank skips the step as one process
    does (the scale then 2^16); at step 4 only rank 0's stage-0 gradient holds inf (stage 1 and replica 1 saw
    none): every rank of both stages skips it (its weights unchanged there), the scale 2^8 on every rank, the same
    steps and scales as one process doing the same. The weights and loss are one process's within 5e-5 (fp16 keeps
    11 significant bits: the micro-batches' rounding is 8x smaller than bf16's; measured 1e-5). The activations sent
    are fp16 (4 x 8 x 2 bytes a step). The checkpoints written in the background equal the state they name: the
    last one the weights gathered at the end of fit, with the scaler's state; the one of step 3 resumes in one
    process and continues as the uninterrupted run."""
    inject = Inject(OVERFLOW_STEP, (0,), "net.0.weight", float("inf"))
    want = precision_run(tmp_path / "reference", fp16(), devices=1, inject=inject)
    got = precision_run(tmp_path / "pipeline", fp16(), inject=inject, save_at=3, async_checkpoint=True)
    trajectory = [(2.0**16, 1)] * OVERFLOW_STEP + [(2.0**8, 2)] * 2  # (scale, skipped) after each step
    assert [step[:2] for step in want["ranks"][0]] == trajectory
    for rank, steps in enumerate(got["ranks"]):
        assert [step[:2] for step in steps] == trajectory, rank
        before, after = steps[OVERFLOW_STEP - 1][2], steps[OVERFLOW_STEP][2]
        assert before.keys() == after.keys() and len(before) < len(want["state"])  # its stage's blocks
        for name in before:
            torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=f"rank {rank} stepped {name}")
    start = HalfNet().state_dict()
    for name, value in got["ranks"][0][0][2].items():  # step 0 skipped: the initial weights
        torch.testing.assert_close(value, start[name], rtol=0, atol=0)
    assert_close_to(got, want, 5e-5)
    assert got["stats"].bytes_sent == 4 * 8 * 2
    # the background writes: the last checkpoint is the consolidated state of the end of fit, exactly
    last = torch.load(tmp_path / "pipeline" / "last.ckpt", weights_only=False)
    assert last["state_dict"].keys() == got["state"].keys()
    for key, value in got["state"].items():
        torch.testing.assert_close(last["state_dict"][key], value, rtol=0, atol=0, msg=key)
    plugin_state = next(v for k, v in last.items() if "MGPUPrecision" in k or k == "MixedPrecision")
    assert plugin_state["scaler"]["scale"] == 2.0**8 and plugin_state["skipped_steps"] == 2
    # the step-3 checkpoint, written while steps 4 and 5 trained, holds the weights of step 3 bit for bit (stage 0's
    # blocks as rank 0 held them then, stage 1's as rank 2 did)
    mid = torch.load(tmp_path / "pipeline" / "mid.ckpt", weights_only=False)
    held = {**got["ranks"][0][2][2], **got["ranks"][2][2][2]}
    assert held.keys() == mid["state_dict"].keys()
    for key, value in held.items():
        torch.testing.assert_close(mid["state_dict"][key], value, rtol=0, atol=0, msg=key)
    # the last one resumes in one process and continues as the uninterrupted run
    ckpt = tmp_path / "pipeline" / "last.ckpt"
    resumed = precision_run(tmp_path / "resumed", fp16(), devices=1, inject=inject, ckpt=ckpt, max_epochs=2)
    uninterrupted = precision_run(tmp_path / "uninterrupted", fp16(), devices=1, inject=inject, max_epochs=2)
    assert [step[:2] for step in resumed["ranks"][0]] == [(2.0**8, 2)] * 6
    assert_close_to(resumed, uninterrupted, 5e-5)


@pytest.mark.timeout(120)
def test_a_nan_in_one_stage_stops_every_rank_with_the_nonfinite_error(tmp_path: Path, monkeypatch: Any) -> None:
    """``nonfinite="error"``, pipeline 2 x data 2: at optimizer step 2 only rank 2 (stage 1, replica 0) gets a NaN in
    its head's gradient; after the gradient sync both ranks of stage 1 hold it and stage 0 none, and every rank raises
    the same ``FloatingPointError`` naming the step and the ranks of stage 1 (none waits for the others in a
    collective: the fit ends within the timeout), the main process raises it, and no process is left behind. (Each
    worker notes its error and meets the others in a barrier before raising it: the launcher ends the workers once
    one has failed, so without it a rank could be ended before its note.)"""
    import multiprocessing

    from lightning_mgpu.parts.nonfinite import NonFiniteCheck

    out = tmp_path / "pipeline"
    check = NonFiniteCheck.check

    def noted(self: NonFiniteCheck, named: Any, rank: int, *args: Any, **kwargs: Any) -> None:
        try:
            check(self, named, rank, *args, **kwargs)
        except FloatingPointError as error:
            torch.save(str(error), out / f"raised{rank}.pt")
            torch.distributed.barrier()
            raise

    monkeypatch.setattr(NonFiniteCheck, "check", noted)  # the forked workers inherit it
    inject = Inject(2, (2,), "net.4.weight", float("nan"))
    out.mkdir(parents=True)
    with pytest.raises(Exception, match=r"Non-finite .*at optimizer step 2") as raised:
        precision_run(out, "32-true", inject=inject, nonfinite="error")
    assert "rank 2: parameter 'net.4.weight'; rank 3: parameter 'net.4.weight'" in str(raised.value)
    errors = [torch.load(out / f"raised{r}.pt", weights_only=False) for r in range(WORLD)]
    assert errors[0].startswith("Non-finite (NaN/Inf) gradient at optimizer step 2") and errors == [errors[0]] * WORLD
    assert not multiprocessing.active_children()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "stage", "schedule"),
    [
        ("16-mixed", 3, "1f1b"),
        ("bf16-mixed", 3, "1f1b"),
        ("16-mixed", 2, "gpipe"),
        ("bf16-mixed", 2, "interleaved_1f1b"),
    ],
)
def test_mixed_precision_pipeline_matrix(tmp_path: Path, precision: str, stage: int, schedule: str) -> None:
    """The mixed-precision comparison above with ZeRO-3 inside the pipeline (the loss scale through FSDP2's
    reduce-scatter) and the other schedules: fp16 skips steps 0 and 4 on every rank as one process does and stays
    within 5e-5 of it; bf16 within 2e-4 (the tolerances of the default tests)."""
    inject = Inject(OVERFLOW_STEP, (0,), "net.0.weight", float("inf"))
    fp16_run = precision == "16-mixed"
    plugin: Any = fp16() if fp16_run else precision
    want = precision_run(tmp_path / "reference", plugin, devices=1, inject=inject if fp16_run else None)
    got = precision_run(
        tmp_path / "pipeline",
        fp16() if fp16_run else precision,
        inject=inject if fp16_run else None,
        stage=stage,
        pipeline_schedule=schedule,
    )
    trajectory = [step[:2] for step in want["ranks"][0]]
    assert trajectory == ([(2.0**16, 1)] * OVERFLOW_STEP + [(2.0**8, 2)] * 2 if fp16_run else [(1.0, 0)] * 6)
    assert all([step[:2] for step in steps] == trajectory for steps in got["ranks"])
    assert_close_to(got, want, 5e-5 if fp16_run else 2e-4)


class NaNLossAtStep2(HalfNet):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step == 2 else loss


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_nan_loss_on_the_last_stage_stops_every_rank_with_the_nonfinite_error(tmp_path: Path) -> None:
    """A NaN loss on the last stage at step 2 (its backward spreads NaN into both stages' gradients): the fit raises
    the non-finite error naming the step and a parameter on each of the four ranks; no process is left behind."""
    import multiprocessing

    strategy = MGPUShardedStrategy(
        pipeline_parallel_size=2, pipeline_microbatches=4, start_method="fork", nonfinite="error"
    )
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(tmp_path, 1, devices=WORLD))
    with pytest.raises(Exception, match=r"Non-finite .*at optimizer step 2") as raised:
        trainer.fit(NaNLossAtStep2(), Data(half_dataset(), GLOBAL_BATCH // 2))
    assert all(f"rank {r}: parameter 'net." in str(raised.value) for r in range(WORLD))
    assert not multiprocessing.active_children()


class RankLocalScaler(MGPUPrecision):
    """Negative control: torch's plain ``GradScaler``, whose inf check each rank makes alone."""

    def _make_scaler(self, device: str) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(device=device, **self._scaler_kwargs)  # type: ignore[arg-type]


def test_negative_control_a_rank_local_overflow_check_lets_the_stages_diverge(tmp_path: Path) -> None:
    """With each rank's scaler checking only its own gradients, the inf of rank 0's stage 0 at step 4 is skipped by
    stage 0 (whose replicas share it through the gradient sync) and stepped by stage 1: the check of the fp16 test
    above fails there."""
    inject = Inject(OVERFLOW_STEP, (0,), "net.0.weight", float("inf"))
    plugin = RankLocalScaler("16-mixed", init_scale=2.0**16, backoff_factor=2.0**-8)
    got = precision_run(tmp_path / "pipeline", plugin, inject=inject)
    skipped = [steps[OVERFLOW_STEP][1] for steps in got["ranks"]]
    assert skipped == [1, 1, 0, 0]
