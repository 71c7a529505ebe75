"""Mid-epoch resume: a run stopped mid-epoch and resumed from its checkpoint equals the uninterrupted run.

What Lightning 2.6.6 guarantees when ``fit(ckpt_path=...)`` resumes from a mid-epoch checkpoint (read in
``loops/fit_loop.py`` and ``loops/training_epoch_loop.py``, measured in the negative control below): weights,
optimizer and scheduler state, the epoch, ``global_step`` and the batch counters come back, so the epoch's
remaining number of batches, the accumulation windows and the number of optimizer steps are right, and its
automatic ``DistributedSampler`` gets ``set_epoch`` with the same epoch (the same permutation). The data do not:
a torch DataLoader has no position, so the resumed epoch starts again at its first batch and ends when the
batch counter reaches the epoch's length: the first j micro-batches are used twice, the last j never. With
``num_workers > 0`` the resumed epoch even gets epoch 0's permutation, also from an end-of-epoch checkpoint.

What lightning_mgpu adds (``lightning_mgpu/sampler.py``): mgpu_ddp and mgpu_sharded put a
``ResumableDistributedSampler`` (torch's order) in place of Lightning's automatic sampler and save its position,
counted in the epoch's global order, in mid-epoch checkpoints. "Equal" means: same final weights (float64,
``assert_close`` defaults), same number of optimizer steps, and every optimizer step uses the same set of
samples as in the uninterrupted run, so in the interrupted epoch no sample is used twice or left out; at a
different world size N' the per-device batch b' keeps the global micro-batch N'*b' == N*b (here 2 x 4 -> 1 x 8
with accumulate_grad_batches=2, global batch 16).

Scenario: 48 samples, 2 ranks x batch 4 x accumulation 2: 3 optimizer steps per epoch, 2 epochs. The
uninterrupted run writes ModelCheckpoint(every_n_train_steps=4) at global_step 4 (2 of epoch 1's 6 micro-batches
in, at an accumulation boundary) and one checkpoint inside an accumulation window (after epoch 1's 3rd
micro-batch; ModelCheckpoint itself only saves right after optimizer steps).
Its steps before the checkpoint are what an interrupted run would have done: the resumed run starts from
the checkpoint alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset

from lightning_mgpu import MGPUDDPStrategy, MGPULocalSGDStrategy, MGPUShardedStrategy
from lightning_mgpu.parts.resume import (
    LOADER_STATES_KEY,
    POSITION_KEY,
    ResumableDistributedSampler,
    apply_position,
)
from tests.helpers import WORLD, Regressor, fit

SAMPLES, B, K, EPOCHS = 48, 4, 2, 2
MICRO = WORLD * B  # samples per global micro-batch
GLOBAL = MICRO * K  # samples per optimizer step
STEPS_PER_EPOCH = SAMPLES // GLOBAL
SAVE_STEP = 4  # ModelCheckpoint(every_n_train_steps=4): one checkpoint, 1 step into epoch 1
MID_WINDOW = (1, 2)  # (epoch, batch_idx): after this micro-batch, inside step 4's accumulation window


def make_indexed_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 6, generator=g, dtype=torch.float64)
    y = torch.randn(SAMPLES, 3, generator=g, dtype=torch.float64)
    return TensorDataset(x, y, torch.arange(SAMPLES))


class IndexedRegressor(Regressor):
    """:class:`Regressor` on ``(x, y, index)`` batches."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        return F.mse_loss(self(x), y)


class ShuffledData(pl.LightningDataModule):
    """A plain shuffled DataLoader (Lightning puts its automatic DistributedSampler in), or one with the
    sampler that ``make_sampler(dataset)`` builds in the worker."""

    def __init__(
        self,
        batch_size: int,
        make_sampler: Optional[Callable[[TensorDataset], Sampler]] = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.make_sampler = make_sampler
        self.num_workers = num_workers

    def train_dataloader(self) -> DataLoader:
        dataset = make_indexed_data()
        kwargs: dict[str, Any] = {"batch_size": self.batch_size, "num_workers": self.num_workers}
        if self.make_sampler is None:
            return DataLoader(dataset, shuffle=True, **kwargs)
        return DataLoader(dataset, sampler=self.make_sampler(dataset), **kwargs)


class StepIndices(Callback):
    """Writes ``out_dir/indices{rank}.pt``: per micro-batch ``(global_step it contributes to, dataset indices)``,
    and what the training loader's sampler is."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)
        self.batches: list[tuple[int, list[int]]] = []
        self.sampler: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = trainer.train_dataloader
        sampler = loader.sampler
        self.sampler = {
            "type": type(sampler).__name__,
            "users": getattr(sampler, "set_by_user", False),
            "stateful": hasattr(loader, "load_state_dict"),
        }

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.batches.append((trainer.global_step, batch[2].tolist()))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"batches": self.batches, "sampler": self.sampler}, self.out_dir / f"indices{trainer.global_rank}.pt"
        )


class SaveAt(Callback):
    """``trainer.save_checkpoint(path)`` after micro-batch ``batch_idx`` of ``epoch`` (every rank calls it: a
    sharded save is a collective)."""

    def __init__(self, path: Path, epoch: int, batch_idx: int) -> None:
        self.path, self.epoch, self.batch_idx = Path(path), epoch, batch_idx

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if (trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx) == (self.epoch, self.batch_idx):
            trainer.save_checkpoint(self.path)


def run(
    out: Path,
    strategy: Any,
    *,
    devices: int = WORLD,
    batch_size: int = B,
    ckpt_path: Optional[Path] = None,
    callbacks: Optional[list[Callback]] = None,
    make_sampler: Optional[Callable[[TensorDataset], Sampler]] = None,
    num_workers: int = 0,
    **trainer_kwargs: Any,
) -> dict[str, Any]:
    """Fit on ``devices`` fork-launched ranks with Lightning's automatic sampler. Returns the final weights and
    ``global_step`` (rank 0), per optimizer step the sorted dataset indices all ranks used, and rank 0's sampler."""
    os.environ.pop("PL_GLOBAL_SEED", None)  # the automatic sampler's seed: 0, as in the reference below
    ranks = fit(
        IndexedRegressor().double(),
        strategy,
        out,
        datamodule=ShuffledData(batch_size, make_sampler, num_workers),
        devices=devices,
        accumulate=K,
        max_epochs=EPOCHS,
        callbacks=[StepIndices(out), *(callbacks or [])],
        enable_checkpointing=bool(callbacks),
        use_distributed_sampler=trainer_kwargs.pop("use_distributed_sampler", True),
        ckpt_path=str(ckpt_path) if ckpt_path is not None else None,
        **trainer_kwargs,
    )
    records = [torch.load(out / f"indices{r}.pt") for r in range(devices)]
    steps: dict[int, list[int]] = {}
    for record in records:
        for step, indices in record["batches"]:
            steps.setdefault(step, []).extend(indices)
    for r in ranks:
        torch.testing.assert_close(r["weights"], ranks[0]["weights"], rtol=0, atol=0)  # the replicas agree
    return {
        "weights": ranks[0]["weights"],
        "global_step": ranks[0]["global_step"],
        "steps": {step: sorted(indices) for step, indices in steps.items()},
        "sampler": records[0]["sampler"],
    }


def epoch_order(epoch: int, seed: int = 0) -> list[int]:
    """torch's DistributedSampler permutation for ``seed + epoch`` (what Lightning's automatic sampler draws)."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(SAMPLES, generator=g).tolist()


def reference(lost: frozenset[tuple[int, int]] = frozenset()) -> tuple[torch.Tensor, dict[int, list[int]]]:
    """One process, plain torch, on the same shuffled order: step t of epoch e takes the next GLOBAL entries of
    ``epoch_order(e)`` as K micro-batches of MICRO samples, each contributing ``loss / K`` (Lightning's
    accumulation). ``lost``: (step, micro-batch) pairs whose gradient never reaches the step. Returns the
    weights and, per step, the sorted indices used."""
    model = IndexedRegressor().double()
    opt = torch.optim.SGD(model.parameters(), lr=model.lr, momentum=0.9)
    data = make_indexed_data()
    steps: dict[int, list[int]] = {}
    for epoch in range(EPOCHS):
        order = epoch_order(epoch)
        for t in range(STEPS_PER_EPOCH):
            step = epoch * STEPS_PER_EPOCH + t
            opt.zero_grad(set_to_none=True)
            for m in range(K):
                idx = order[t * GLOBAL + m * MICRO : t * GLOBAL + (m + 1) * MICRO]
                if (step, m) not in lost:
                    x, y, _ = data[idx]
                    (F.mse_loss(model(x), y) / K).backward()
            opt.step()
            steps[step] = sorted(order[t * GLOBAL : (t + 1) * GLOBAL])
    return torch.cat([p.detach().flatten() for p in model.parameters()]), steps


def assert_each_sample_once_per_epoch(steps: dict[int, list[int]]) -> None:
    for epoch in range(EPOCHS):
        used = [i for t in range(STEPS_PER_EPOCH) for i in steps[epoch * STEPS_PER_EPOCH + t]]
        assert sorted(used) == list(range(SAMPLES)), f"epoch {epoch}: a sample was used twice or left out"


def combined(before: dict[int, list[int]], after: dict[int, list[int]], resumed_at: int) -> dict[int, list[int]]:
    """The steps of an interrupted run: ``before``'s up to the checkpoint, then the resumed run's. A step split
    by a mid-window checkpoint has micro-batches in both."""
    steps = {s: list(v) for s, v in before.items() if s <= resumed_at}
    for s, v in after.items():
        steps[s] = sorted(steps.get(s, []) + v)
    return steps


# ---------------------------------------------------------------------------------------------------------
# single-process checks of the sampler (no processes)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "world", "shuffle", "drop_last"), [(48, 2, True, False), (10, 4, True, False),
                                                                  (10, 4, False, True), (3, 4, True, False),
                                                                  (1, 4, True, False)])  # fmt: skip
def test_sampler_yields_exactly_torchs_distributed_sampler(n, world, shuffle, drop_last):
    dataset = range(n)
    for epoch in (0, 3):
        for rank in range(world):
            kwargs = dict(num_replicas=world, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last)
            ours, torchs = ResumableDistributedSampler(dataset, **kwargs), DistributedSampler(dataset, **kwargs)
            ours.set_epoch(epoch)
            torchs.set_epoch(epoch)
            assert list(ours) == list(torchs)
            assert len(ours) == len(torchs)


@pytest.mark.parametrize(("world", "new_world"), [(2, 2), (2, 1), (2, 4), (1, 3)])
def test_skip_continues_the_global_order_on_any_world_size(world, new_world):
    """After j micro-batches of b on N ranks the ranks used the first j*N*b entries of the epoch's order; the
    rest, split over N' ranks, are the remaining entries, each once (at N' == N: each rank's own tail)."""
    b, j, epoch = 4, 3, 1
    full = ResumableDistributedSampler(range(SAMPLES), num_replicas=world, rank=0, seed=0)
    full.set_epoch(epoch)
    order = full.global_order()
    assert order == epoch_order(epoch)
    consumed = j * b * world
    rest = []
    for rank in range(new_world):
        s = ResumableDistributedSampler(range(SAMPLES), num_replicas=new_world, rank=rank, seed=0)
        s.skip(epoch, consumed)
        s.set_epoch(epoch)  # what Lightning calls at the resumed epoch's start: keeps the position
        mine = list(s)
        rest += mine
        if new_world == world:
            torchs = DistributedSampler(range(SAMPLES), num_replicas=world, rank=rank, seed=0)
            torchs.set_epoch(epoch)
            assert mine == list(torchs)[j * b :]
        assert list(s) == order[rank::new_world]  # the skip is used once; the next pass is the whole epoch
    assert sorted(rest) == sorted(order[consumed:])


def test_position_refuses_another_micro_batch_size_or_data_order():
    position = {"format": "lightning_mgpu.sampler_position", "epoch": 1, "consumed": 16, "complete": False,
                "micro_batch": 8, "batch_size": 4, "world_size": 2, "dataset_size": SAMPLES, "shuffle": True,
                "seed": 0}  # fmt: skip
    one_rank = ResumableDistributedSampler(range(SAMPLES), num_replicas=1, rank=0, seed=0)
    with pytest.raises(ValueError, match=r"2 ranks x batch_size 4 = 8 samples per micro-batch.*batch_size=8"):
        apply_position(one_rank, position, batch_size=4, accumulate_grad_batches=4)
    with pytest.raises(ValueError, match="seed 0 -> 3"):
        apply_position(ResumableDistributedSampler(range(SAMPLES), 1, 0, seed=3), position, 8, 2)
    with pytest.raises(ValueError, match="dataset_size 48 -> 40"):
        apply_position(ResumableDistributedSampler(range(40), 1, 0, seed=0), position, 8, 2)
    with pytest.warns(UserWarning, match="inside an accumulation window"):
        apply_position(one_rank, {**position, "consumed": 24}, batch_size=8, accumulate_grad_batches=2)


# ---------------------------------------------------------------------------------------------------------
# negative control: plain Lightning
# ---------------------------------------------------------------------------------------------------------


def test_plain_lightning_replays_the_interrupted_epochs_first_batches_and_skips_its_last(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=SAVE_STEP, save_top_k=-1)
    straight = run(tmp_path / "straight", DDPStrategy(start_method="fork"), callbacks=[ckpt])
    resumed = run(tmp_path / "resumed", DDPStrategy(start_method="fork"), ckpt_path=tmp_path / "ckpt/step=4.ckpt")

    assert straight["sampler"]["type"] == "DistributedSampler" and not straight["sampler"]["stateful"]
    assert resumed["global_step"] == straight["global_step"] == EPOCHS * STEPS_PER_EPOCH  # the counters are right
    # ... the data are not: the resumed steps 4 and 5 got epoch 1's first 4 micro-batches (steps 3 and 4 of the
    # uninterrupted run), so step 3's samples were used twice and step 5's never in epoch 1
    assert resumed["steps"] == {4: straight["steps"][3], 5: straight["steps"][4]}
    with pytest.raises(AssertionError):
        assert_each_sample_once_per_epoch(combined(straight["steps"], resumed["steps"], SAVE_STEP - 1))
    assert not torch.allclose(resumed["weights"], straight["weights"])


# ---------------------------------------------------------------------------------------------------------
# mgpu_ddp and mgpu_sharded: the resumed run equals the uninterrupted one
# ---------------------------------------------------------------------------------------------------------

STRATEGIES: dict[str, Callable[[], Any]] = {
    "mgpu_ddp": lambda: MGPUDDPStrategy(start_method="fork"),
    "zero1": lambda: MGPUShardedStrategy(stage=1, start_method="fork"),
    "zero2": lambda: MGPUShardedStrategy(stage=2, start_method="fork"),
    "zero3-sharded_ckpt": lambda: MGPUShardedStrategy(stage=3, checkpoint="sharded", start_method="fork"),
    # the same, with checkpoints written in the background (async_checkpoint=True): they resume alike
    "mgpu_ddp-async": lambda: MGPUDDPStrategy(start_method="fork", async_checkpoint=True),
    "zero1-async": lambda: MGPUShardedStrategy(stage=1, start_method="fork", async_checkpoint=True),
    "zero3-sharded_ckpt-async": lambda: MGPUShardedStrategy(
        stage=3, checkpoint="sharded", start_method="fork", async_checkpoint=True
    ),
}


@pytest.fixture(scope="module")
def uninterrupted_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Any]]:
    """Per strategy, once per module: the uninterrupted run, writing the checkpoint at step 4 and the mid-window
    one (tests of one strategy share it, whatever order pytest runs them in)."""
    runs: dict[str, dict[str, Any]] = {}

    def get(name: str) -> dict[str, Any]:
        if name not in runs:
            tmp = tmp_path_factory.mktemp(name)
            callbacks = [
                ModelCheckpoint(dirpath=tmp / "ckpt", filename="{step}", every_n_train_steps=SAVE_STEP, save_top_k=-1),
                SaveAt(tmp / "mid_window.ckpt", *MID_WINDOW),
            ]
            result = run(tmp / "straight", STRATEGIES[name](), callbacks=callbacks)
            runs[name] = {
                **result,
                "name": name,
                "ckpt": tmp / "ckpt/step=4.ckpt",
                "mid_window": tmp / "mid_window.ckpt",
            }
        return runs[name]

    return get


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_uninterrupted_run_uses_lightnings_order_and_equals_one_process(uninterrupted_runs, name):
    """Our sampler gives the uninterrupted run Lightning's automatic order (torch's permutation for seed 0 +
    epoch), and N ranks x b x K equals one process with the global batch on that order."""
    uninterrupted = uninterrupted_runs(name)
    expected, steps = reference()
    assert uninterrupted["sampler"] == {"type": "ResumableDistributedSampler", "users": False, "stateful": True}
    assert uninterrupted["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert uninterrupted["steps"] == steps
    torch.testing.assert_close(uninterrupted["weights"], expected)
    initial = torch.cat([p.detach().flatten() for p in IndexedRegressor().double().parameters()])
    assert (expected - initial).abs().max() > 1e-2, "weights did not move: the comparison would prove nothing"


@pytest.mark.parametrize(
    ("name", "devices"),
    [("mgpu_ddp", 2), ("mgpu_ddp", 1), ("zero1", 2), ("zero2", 2), ("zero3-sharded_ckpt", 1),
     ("mgpu_ddp-async", 2), ("mgpu_ddp-async", 1), ("zero1-async", 2), ("zero3-sharded_ckpt-async", 1)],
    ids=["mgpu_ddp-2to2", "mgpu_ddp-2to1", "zero1-2to2", "zero2-2to2", "zero3-sharded_ckpt-2to1",
         "mgpu_ddp-async-2to2", "mgpu_ddp-async-2to1", "zero1-async-2to2", "zero3-sharded_ckpt-async-2to1"],
)  # fmt: skip
def test_resume_at_an_accumulation_boundary_equals_the_uninterrupted_run(tmp_path, uninterrupted_runs, name, devices):
    """Resumed from step 4 (2 of epoch 1's 6 micro-batches in) on ``devices`` ranks with the same global
    micro-batch (2 x 4, or 1 x 8): same weights, steps and samples per step as the uninterrupted run."""
    uninterrupted = uninterrupted_runs(name)
    position = _position(uninterrupted["ckpt"])
    assert position["epoch"] == 1 and position["consumed"] == 2 * MICRO
    resumed = run(
        tmp_path, STRATEGIES[uninterrupted["name"]](), devices=devices, batch_size=MICRO // devices,
        ckpt_path=uninterrupted["ckpt"],
    )  # fmt: skip

    assert resumed["global_step"] == uninterrupted["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert resumed["steps"] == {s: uninterrupted["steps"][s] for s in (4, 5)}
    assert_each_sample_once_per_epoch(combined(uninterrupted["steps"], resumed["steps"], SAVE_STEP - 1))
    torch.testing.assert_close(resumed["weights"], uninterrupted["weights"])


def test_resume_inside_an_accumulation_window_uses_each_sample_once_but_loses_the_windows_gradients(
    tmp_path, uninterrupted_runs
):
    """A checkpoint written inside step 4's window (after its first micro-batch; trainer.save_checkpoint in
    on_train_batch_end: ModelCheckpoint only saves right after optimizer steps) holds no gradients: the
    resumed run goes on with the window's second micro-batch and steps with its gradient only (Lightning's
    counters keep the window aligned). Every sample is still used once, and the weights are exactly one
    process's with that micro-batch's gradient missing, not the uninterrupted run's."""
    uninterrupted = uninterrupted_runs("mgpu_ddp")
    resumed = run(tmp_path, STRATEGIES["mgpu_ddp"](), ckpt_path=uninterrupted["mid_window"])

    assert resumed["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert resumed["steps"] == {4: _micro_batch(4, 1), 5: uninterrupted["steps"][5]}
    before = {s: v for s, v in uninterrupted["steps"].items() if s < 4}
    before[4] = _micro_batch(4, 0)  # trained on before the save
    assert_each_sample_once_per_epoch(combined(before, resumed["steps"], 4))
    expected, _ = reference(lost=frozenset({(4, 0)}))
    torch.testing.assert_close(resumed["weights"], expected)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(resumed["weights"], uninterrupted["weights"])


def _micro_batch(step: int, m: int) -> list[int]:
    """The sorted indices of micro-batch ``m`` of ``step`` (an epoch-1 step) in the uninterrupted order."""
    start = (step - STEPS_PER_EPOCH) * GLOBAL + m * MICRO
    return sorted(epoch_order(1)[start : start + MICRO])


def _position(path: Path) -> dict[str, Any]:
    meta = path / "meta.pt" if path.is_dir() else path  # a sharded checkpoint keeps the position in meta.pt
    checkpoint = torch.load(meta, weights_only=False)
    assert "combined_loader" not in checkpoint["loops"]["fit_loop"]["state_dict"]  # moved out of the loop state
    return checkpoint[POSITION_KEY]


def test_a_mid_epoch_checkpoint_written_here_resumes_in_plain_lightning(tmp_path, uninterrupted_runs):
    """The position is a top-level key plain Lightning ignores: its DDPStrategy resumes the checkpoint (replaying
    as in the negative control) instead of refusing a loader state it has no loader for."""
    uninterrupted = uninterrupted_runs("mgpu_ddp")
    resumed = run(tmp_path, DDPStrategy(start_method="fork"), ckpt_path=uninterrupted["ckpt"])
    assert resumed["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert resumed["steps"] == {4: uninterrupted["steps"][3], 5: uninterrupted["steps"][4]}


def test_resume_with_another_samples_per_micro_batch_is_refused(tmp_path, uninterrupted_runs):
    """2 x 4 resumed on 1 x 4: Lightning's restored batch_idx (2) would count micro-batches of 8 samples as
    micro-batches of 4 (wrong epoch end and windows), so the resume is refused with the batch size that works."""
    uninterrupted = uninterrupted_runs("mgpu_ddp")
    with pytest.raises(Exception, match=r"8 samples per micro-batch; this run has 1 x 4.*resume with batch_size=8"):
        run(tmp_path, STRATEGIES["mgpu_ddp"](), devices=1, batch_size=B, ckpt_path=uninterrupted["ckpt"])


def test_resume_with_dataloader_workers_draws_the_resumed_epochs_order(tmp_path):
    """With num_workers > 0 Lightning's resume gets even an end-of-epoch checkpoint wrong: it creates the
    epoch's iterator (the workers draw their indices at once) before its set_epoch, and not again for the
    resumed epoch, so epoch 1 gets epoch 0's permutation (plain DDPStrategy, below). Our sampler is given the
    resumed epoch before the iterator exists."""
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    straight = run(tmp_path / "straight", STRATEGIES["mgpu_ddp"](), callbacks=[ckpt], num_workers=1)
    path = tmp_path / "ckpt/epoch=0.ckpt"
    resumed = run(tmp_path / "resumed", STRATEGIES["mgpu_ddp"](), ckpt_path=path, num_workers=1)
    plain = run(tmp_path / "plain", DDPStrategy(start_method="fork"), ckpt_path=path, num_workers=1)

    epoch_1 = {s: straight["steps"][s] for s in range(STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH)}
    assert resumed["steps"] == epoch_1
    torch.testing.assert_close(resumed["weights"], straight["weights"])
    assert list(plain["steps"].values()) == [straight["steps"][s] for s in range(STEPS_PER_EPOCH)]  # epoch 0's order


# ---------------------------------------------------------------------------------------------------------
# samplers the user set are kept
# ---------------------------------------------------------------------------------------------------------


def _users_distributed(dataset: TensorDataset) -> Sampler:
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    sampler.set_by_user = True  # type: ignore[attr-defined]
    return sampler


class _EveryOther(Sampler[int]):
    """A custom sampler: Lightning wraps it in its DistributedSamplerWrapper."""

    def __init__(self, dataset: TensorDataset) -> None:
        self.n = len(dataset)

    def __iter__(self) -> Iterator[int]:
        return iter([*range(0, self.n, 2), *range(1, self.n, 2)])

    def __len__(self) -> int:
        return self.n


def _users_resumable(dataset: TensorDataset) -> Sampler:
    sampler = ResumableDistributedSampler(dataset, shuffle=True, seed=0)
    sampler.set_by_user = True  # type: ignore[attr-defined]
    return sampler


@pytest.mark.parametrize(
    ("make_sampler", "use_distributed_sampler", "expected"),
    [
        (_users_distributed, True, ("DistributedSampler", True, False)),
        (_users_distributed, False, ("DistributedSampler", True, False)),
        (_EveryOther, True, ("DistributedSamplerWrapper", False, False)),
        (_users_resumable, False, ("ResumableDistributedSampler", True, True)),
    ],
    ids=["own-DistributedSampler", "use_distributed_sampler=False", "custom-sampler-wrapped", "own-resumable"],
)
def test_a_sampler_the_user_set_is_kept(tmp_path, make_sampler, use_distributed_sampler, expected):
    """Only Lightning's automatic DistributedSampler is replaced; a ResumableDistributedSampler of the user's
    is kept and gets its position saved."""
    got = run(
        tmp_path, STRATEGIES["mgpu_ddp"](), make_sampler=make_sampler, use_distributed_sampler=use_distributed_sampler,
        max_steps=1,
    )["sampler"]  # fmt: skip
    assert (got["type"], got["users"], got["stateful"]) == expected


# ---------------------------------------------------------------------------------------------------------
# loaders with a state of their own: torchdata's StatefulDataLoader, litdata's StreamingDataLoader
# ---------------------------------------------------------------------------------------------------------
# The same scenario (48 samples, 2 ranks x 4 x accumulation 2, 2 epochs), with ModelCheckpoint every 2 steps:
# step=2 is 4 of epoch 0's 6 micro-batches in (the resumed run must also get epoch 1 right), step=4 is 2 of
# epoch 1's in. "Exact" here: per rank, the resumed run's micro-batches are the uninterrupted run's from the
# checkpoint on, in the same order (at another world size: each global micro-batch holds the same samples),
# every epoch uses each of the 48 samples once, and the final weights are the uninterrupted run's.
#
#   stateful      StatefulDataLoader(dataset, batch_size, shuffle=True): Lightning puts its automatic sampler in
#   stateful-own  StatefulDataLoader(dataset, batch_size, sampler=DistributedSampler(...)) and
#                 use_distributed_sampler=False: the loader's own state (the batches this rank drew)
#   streaming     litdata StreamingDataLoader(StreamingDataset(local folder written by litdata.optimize,
#                 shuffle=True, drop_last=True)): its own state, counted across all ranks

os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")  # litdata asks PyPI for a newer release otherwise

LOADERS = ("stateful", "stateful-own", "streaming")
RESUME_STEPS = (2, 4)


def _streaming_sample(i: int) -> dict[str, Any]:
    x, y, index = make_indexed_data()[i]
    return {"x": x, "y": y, "index": int(index)}


@pytest.fixture(scope="module")
def streaming_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 48 samples written by ``litdata.optimize`` into a local folder (no network), 6 chunks of 8."""
    from litdata import optimize

    out = tmp_path_factory.mktemp("streaming") / "data"
    optimize(fn=_streaming_sample, inputs=list(range(SAMPLES)), output_dir=str(out), chunk_size=8, num_workers=1)
    return out


class LoaderData(pl.LightningDataModule):
    """One of :data:`LOADERS` over the indexed data."""

    def __init__(self, kind: str, batch_size: int, num_workers: int = 0, data_dir: Optional[Path] = None) -> None:
        super().__init__()
        self.kind, self.batch_size, self.num_workers, self.data_dir = kind, batch_size, num_workers, data_dir

    def train_dataloader(self) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        kwargs: dict[str, Any] = {"batch_size": self.batch_size, "num_workers": self.num_workers}
        if self.kind == "streaming":
            from litdata import StreamingDataLoader, StreamingDataset

            dataset = StreamingDataset(str(self.data_dir), shuffle=True, seed=0, drop_last=True)
            return StreamingDataLoader(dataset, **kwargs)
        data = make_indexed_data()
        if self.kind == "torch":  # a torch DataLoader (the resume tests above), here for its workers
            return DataLoader(data, shuffle=True, **kwargs)
        if self.kind == "stateful":
            return StatefulDataLoader(data, shuffle=True, **kwargs)
        return StatefulDataLoader(data, sampler=DistributedSampler(data, shuffle=True, seed=0), **kwargs)


class LoaderRegressor(IndexedRegressor):
    """:class:`IndexedRegressor` on tuples or litdata's dict batches."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch[:2]
        return F.mse_loss(self(x), y)


class MicroBatches(Callback):
    """Writes ``out_dir/micro{rank}.pt``: per micro-batch ``(global_step, epoch, dataset indices in order)``."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)
        self.batches: list[tuple[int, int, list[int]]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        ids = batch["index"] if isinstance(batch, dict) else batch[2]
        self.batches.append((trainer.global_step, trainer.current_epoch, ids.tolist()))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(self.batches, self.out_dir / f"micro{trainer.global_rank}.pt")


def run_loader(
    out: Path,
    strategy: Any,
    kind: str,
    *,
    devices: int = WORLD,
    batch_size: int = B,
    data_dir: Optional[Path] = None,
    ckpt_path: Optional[Path] = None,
    callbacks: Optional[list[Callback]] = None,
    num_workers: int = 0,
) -> dict[str, Any]:
    """Fit with one of :data:`LOADERS` on ``devices`` fork-launched ranks. Returns rank 0's weights and
    ``global_step``, per rank the micro-batches ``(step, epoch, indices)``, and per global micro-batch (the j-th
    micro-batch of every rank) ``(step, epoch, sorted indices)``."""
    os.environ.pop("PL_GLOBAL_SEED", None)
    ranks = fit(
        LoaderRegressor().double(),
        strategy,
        out,
        datamodule=LoaderData(kind, batch_size, num_workers, data_dir),
        devices=devices,
        accumulate=K,
        max_epochs=EPOCHS,
        callbacks=[MicroBatches(out), *(callbacks or [])],
        enable_checkpointing=bool(callbacks),
        use_distributed_sampler=kind != "stateful-own",
        ckpt_path=str(ckpt_path) if ckpt_path is not None else None,
    )
    per_rank = [torch.load(out / f"micro{r}.pt") for r in range(devices)]
    assert len({len(b) for b in per_rank}) == 1, "the ranks drew different numbers of micro-batches"
    merged = [(parts[0][0], parts[0][1], sorted(i for _, _, ids in parts for i in ids)) for parts in zip(*per_rank)]
    return {"weights": ranks[0]["weights"], "global_step": ranks[0]["global_step"], "ranks": per_rank,
            "global": merged}  # fmt: skip


def distinct_per_epoch(micro: list[tuple[int, int, list[int]]]) -> list[int]:
    """How many distinct samples each epoch's global micro-batches hold (48 when each is used once)."""
    return [len({i for _, e, ids in micro for i in ids if e == epoch}) for epoch in range(EPOCHS)]


def interrupted(straight: dict[str, Any], resumed: dict[str, Any], at_step: int) -> list[tuple[int, int, list[int]]]:
    """The global micro-batches an interrupted run used: the uninterrupted run's before the checkpoint at
    optimizer step ``at_step`` (an accumulation boundary), then the resumed run's."""
    return [m for m in straight["global"] if m[0] < at_step] + resumed["global"]


def loader_runs(tmp_path_factory: pytest.TempPathFactory, streaming: Callable[[], Path]) -> Callable[..., Any]:
    runs: dict[tuple[str, str], dict[str, Any]] = {}

    def get(name: str, kind: str) -> dict[str, Any]:
        if (name, kind) not in runs:
            tmp = tmp_path_factory.mktemp(f"{name}-{kind}")
            ckpt = ModelCheckpoint(dirpath=tmp / "ckpt", filename="{step}", every_n_train_steps=2, save_top_k=-1)
            data_dir = streaming() if kind == "streaming" else None
            result = run_loader(tmp / "straight", STRATEGIES[name](), kind, data_dir=data_dir, callbacks=[ckpt])
            runs[(name, kind)] = {**result, "ckpt": tmp / "ckpt", "data_dir": data_dir}
        return runs[(name, kind)]

    return get


@pytest.fixture(scope="module")
def uninterrupted_loader_runs(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Any:
    """Per (strategy, loader), once per module: the uninterrupted run, writing checkpoints at steps 2, 4, 6."""
    return loader_runs(tmp_path_factory, lambda: request.getfixturevalue("streaming_dir"))


def check_exact(straight: dict[str, Any], resumed: dict[str, Any], at_step: int, same_world: bool) -> None:
    expected = [m for m in straight["global"] if m[0] >= at_step]
    assert resumed["global"] == expected  # every global micro-batch holds the same samples
    if same_world:  # and each rank draws them in the same order
        for mine, theirs in zip(resumed["ranks"], straight["ranks"]):
            assert mine == [m for m in theirs if m[0] >= at_step]
    assert distinct_per_epoch(interrupted(straight, resumed, at_step)) == [SAMPLES] * EPOCHS
    assert resumed["global_step"] == straight["global_step"] == EPOCHS * STEPS_PER_EPOCH
    torch.testing.assert_close(resumed["weights"], straight["weights"])


def resume_loader(
    tmp_path: Path, straight: dict[str, Any], name: str, kind: str, devices: int, at_step: int
) -> dict[str, Any]:
    ckpt = straight["ckpt"] / f"step={at_step}.ckpt"
    return run_loader(
        tmp_path / f"resumed-{devices}-{at_step}", STRATEGIES[name](), kind, devices=devices,
        batch_size=MICRO // devices, data_dir=straight["data_dir"], ckpt_path=ckpt,
    )  # fmt: skip


# what plain Lightning's DDPStrategy gives (measured by the negative control below): distinct samples of the
# interrupted epoch, resumed on 2 ranks x 4 and on 1 x 8 (of 48), and the optimizer steps reached (of 6)
PLAIN_LIGHTNING = {
    "stateful": {"at_step": 4, "distinct": (39, 38), "steps": (6, 6)},
    "stateful-own": {"at_step": 4, "distinct": (36, 38), "steps": (6, 6)},
    # litdata: the interrupted epoch 0 is right, but its `restore` flag outlives it: epoch 1 replays epoch 0's
    # rest (16 samples) and training ends 2 steps early (its StopIteration comes first)
    "streaming": {"at_step": 2, "distinct": (16, 16), "steps": (4, 4)},
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", LOADERS)
def test_stateful_loaders_in_plain_lightning_do_not_resume_exactly(tmp_path, streaming_dir, kind):
    """Negative control: plain Lightning's DDPStrategy. With a StatefulDataLoader it saves the loader's state
    (rank 0's) and restores it before the resumed epoch's iterator, but the sampler still has epoch 0 then
    (set_epoch comes after the iterator), and the state counts this rank's batches: the interrupted epoch
    does not use each sample once, at the same world size or at another. With litdata the epoch after the
    interrupted one replays its rest."""
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=2, save_top_k=-1)
    plain = lambda: DDPStrategy(start_method="fork")  # noqa: E731
    straight = run_loader(tmp_path / "straight", plain(), kind, data_dir=streaming_dir, callbacks=[ckpt])
    assert distinct_per_epoch(straight["global"]) == [SAMPLES] * EPOCHS
    at_step = PLAIN_LIGHTNING[kind]["at_step"]
    distinct, steps = [], []
    for devices in (2, 1):
        resumed = run_loader(
            tmp_path / f"resumed{devices}", plain(), kind, devices=devices, batch_size=MICRO // devices,
            data_dir=streaming_dir, ckpt_path=tmp_path / f"ckpt/step={at_step}.ckpt",
        )  # fmt: skip
        distinct.append(distinct_per_epoch(interrupted(straight, resumed, at_step))[1])
        steps.append(resumed["global_step"])
    assert (tuple(distinct), tuple(steps)) == (PLAIN_LIGHTNING[kind]["distinct"], PLAIN_LIGHTNING[kind]["steps"])


# the default suite: mgpu_ddp and a sharded preset (zero3 with the sharded checkpoint layout), each kind of loader
# once; `-m slow`: every strategy of STRATEGIES (synchronous and asynchronous checkpoints) with every kind
DEFAULT_LOADER_CASES = ("mgpu_ddp-stateful", "zero3-sharded_ckpt-streaming", "zero3-sharded_ckpt-stateful-own")
LOADER_CASES = [
    pytest.param(
        name, kind, marks=() if f"{name}-{kind}" in DEFAULT_LOADER_CASES else pytest.mark.slow, id=f"{name}-{kind}"
    )
    for name in STRATEGIES
    for kind in LOADERS
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("name", "kind"), LOADER_CASES)
def test_loader_resumes_mid_epoch_exactly_at_the_same_world_size(tmp_path, uninterrupted_loader_runs, name, kind):
    """2 ranks -> 2 ranks, from step 2 (inside epoch 0) and step 4 (inside epoch 1): each rank draws the
    uninterrupted run's micro-batches in the same order, every epoch uses each sample once, same weights."""
    straight = uninterrupted_loader_runs(name, kind)
    assert distinct_per_epoch(straight["global"]) == [SAMPLES] * EPOCHS
    for at_step in RESUME_STEPS:
        resumed = resume_loader(tmp_path, straight, name, kind, WORLD, at_step)
        check_exact(straight, resumed, at_step, same_world=True)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("name", "kind"), [p for p in LOADER_CASES if p.values[1] != "stateful-own"])
def test_loader_resumes_mid_epoch_exactly_at_another_world_size(tmp_path, uninterrupted_loader_runs, name, kind):
    """2 x 4 -> 1 x 8 (the same global micro-batch). The StatefulDataLoader, through lightning_mgpu's resumable
    sampler (a position in the epoch's global order, an order that does not depend on the world size), equals
    the uninterrupted run to the end. litdata finishes the interrupted epoch exactly (its state counts the
    epoch's samples across ranks and it re-splits the rest); its later epochs are litdata's order for the new
    world size, i.e. exactly what an uninterrupted run on 1 rank draws in them, each sample once."""
    straight = uninterrupted_loader_runs(name, kind)
    one_rank = None
    for at_step in RESUME_STEPS:
        resumed = resume_loader(tmp_path, straight, name, kind, 1, at_step)
        if kind != "streaming":
            check_exact(straight, resumed, at_step, same_world=False)
            continue
        epoch = at_step // STEPS_PER_EPOCH
        rest = [m for m in resumed["global"] if m[1] == epoch]
        assert rest == [m for m in straight["global"] if m[0] >= at_step and m[1] == epoch]
        assert distinct_per_epoch(interrupted(straight, resumed, at_step)) == [SAMPLES] * EPOCHS
        assert resumed["global_step"] == EPOCHS * STEPS_PER_EPOCH
        later = [m for m in resumed["global"] if m[1] > epoch]
        if later:
            if one_rank is None:
                one_rank = run_loader(tmp_path / "one-rank", STRATEGIES[name](), kind, devices=1, batch_size=MICRO,
                                      data_dir=straight["data_dir"])  # fmt: skip
            assert later == [m for m in one_rank["global"] if m[1] > epoch]
            assert later != [m for m in straight["global"] if m[1] > epoch]  # not 2 ranks' order
        else:
            torch.testing.assert_close(resumed["weights"], straight["weights"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("name", "kind"), [p for p in LOADER_CASES if p.values[1] == "stateful-own"])
def test_a_per_rank_loader_position_at_another_world_size_is_refused_before_training(
    tmp_path, uninterrupted_loader_runs, name, kind
):
    """A StatefulDataLoader with a sampler of the user's keeps its position per rank (the batches this rank
    drew): resumed on 1 rank, the checkpoint is refused when it is loaded, before any batch, with the fixes."""
    straight = uninterrupted_loader_runs(name, kind)
    refused = r"(?s)mid-epoch \(epoch 1\) at world size 2.*StatefulDataLoader.*Resume at world size 2"
    with pytest.raises(Exception, match=refused):
        resume_loader(tmp_path, straight, name, kind, 1, 4)
    assert not (tmp_path / "resumed-1-4" / "micro0.pt").exists()  # no batch was trained on


def test_uninterrupted_stateful_dataloader_uses_torchs_order_and_equals_one_process(uninterrupted_loader_runs):
    """With Lightning's automatic sampler a StatefulDataLoader(shuffle=True) gets the pack's resumable sampler:
    the order of a torch DataLoader(shuffle=True) (torch's permutation for seed 0 + epoch), and the weights of
    one process on it."""
    straight = uninterrupted_loader_runs("mgpu_ddp", "stateful")
    expected, steps = reference()
    got: dict[int, list[int]] = {}
    for step, _, ids in straight["global"]:
        got[step] = sorted(got.get(step, []) + ids)
    assert got == steps
    torch.testing.assert_close(straight["weights"], expected)


def test_loader_states_are_kept_per_rank_with_the_world_size(uninterrupted_loader_runs):
    """The checkpoint holds every rank's state of a loader with its own state (Lightning keeps rank 0's in its
    loop state, which stays for plain Lightning), the world size and whether it is mid-epoch; the pack's
    sampler position is a top-level key instead."""
    own = torch.load(uninterrupted_loader_runs("mgpu_ddp", "stateful-own")["ckpt"] / "step=4.ckpt", weights_only=False)
    record = own[LOADER_STATES_KEY]
    assert (record["world_size"], record["epoch"], record["mid_epoch"]) == (2, 1, True)
    assert record["loaders"] == [("torchdata's StatefulDataLoader", False)]
    assert own["loops"]["fit_loop"]["state_dict"]["combined_loader"] == record["ranks"][0]
    ours = torch.load(uninterrupted_loader_runs("mgpu_ddp", "stateful")["ckpt"] / "step=4.ckpt", weights_only=False)
    assert LOADER_STATES_KEY not in ours and ours[POSITION_KEY]["consumed"] == 2 * MICRO


# local SGD (weights averaged every 2 steps) resumes its data the same way (the part lives in the strategies'
# shared base); its weights at another world size restart from the last synced ones (local-SGD guide), so the
# data are compared there, not the weights
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", LOADERS)
def test_local_sgd_resumes_its_loader_mid_epoch_exactly(tmp_path, streaming_dir, kind):
    make = lambda: MGPULocalSGDStrategy(sync_every=2, start_method="fork")  # noqa: E731
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=2, save_top_k=-1)
    data_dir = streaming_dir if kind == "streaming" else None
    straight = run_loader(tmp_path / "straight", make(), kind, data_dir=data_dir, callbacks=[ckpt])
    for at_step in RESUME_STEPS:
        resumed = run_loader(tmp_path / f"resumed-{at_step}", make(), kind, data_dir=data_dir,
                             ckpt_path=tmp_path / f"ckpt/step={at_step}.ckpt")  # fmt: skip
        check_exact(straight, resumed, at_step, same_world=True)
    if kind == "stateful":
        resumed = run_loader(tmp_path / "resumed-1", make(), kind, devices=1, batch_size=MICRO,
                             ckpt_path=tmp_path / "ckpt/step=4.ckpt")  # fmt: skip
        assert resumed["global"] == [m for m in straight["global"] if m[0] >= 4]
        assert distinct_per_epoch(interrupted(straight, resumed, 4)) == [SAMPLES] * EPOCHS


# dataloader workers: the resumable sampler runs in the main process (torchdata's batch sampler calls iter() on it
# when torch's loader iterator is created, and again at its _reset: the position must survive the first), the
# StatefulDataLoader's own state holds the workers' snapshots, litdata hands its workers their share; each resumes
# exactly (with an eager iter() the stateful case restarted the epoch)
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "kind", ["torch", "stateful", *(pytest.param(kind, marks=pytest.mark.slow) for kind in LOADERS[1:])]
)
def test_loader_with_workers_resumes_mid_epoch_exactly(tmp_path, streaming_dir, kind):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=2, save_top_k=-1)
    data_dir = streaming_dir if kind == "streaming" else None
    make = STRATEGIES["mgpu_ddp"]
    straight = run_loader(tmp_path / "straight", make(), kind, data_dir=data_dir, callbacks=[ckpt], num_workers=1)
    for at_step in RESUME_STEPS:
        resumed = run_loader(tmp_path / f"resumed-{at_step}", make(), kind, data_dir=data_dir, num_workers=1,
                             ckpt_path=tmp_path / f"ckpt/step={at_step}.ckpt")  # fmt: skip
        check_exact(straight, resumed, at_step, same_world=True)
