"""Fine-tuning with adapters (a ``peft`` LoRA GPT-2 from a tiny random config, float64) under every preset family
on 2 processes, and adapter-only checkpoints (``checkpoint_params``, ``lightning_mgpu/parts/trainable_state.py``).

Each case trains 2 epochs of 2 optimizer steps (global batch 8) and proves, in one run: parity with one process on
the global batch (``assert_close`` defaults); the frozen base unchanged on every rank, with no gradient and no
optimizer state there (the optimizer state each rank holds is that of its adapters only); the checkpoint written
at the end of epoch 1 holds the adapters, their optimizer state and the loop state, not the base. The cases with a
resume world size then resume from that checkpoint (at the same or another world size, sync or async writes,
consolidated file or sharded directory) and end with the uninterrupted run's weights.

Local SGD and DiLoCo average weights instead of gradients: they equal gradient averaging when the weights are
averaged after every step (``sync_every=1``) and the inner optimizer is plain SGD (the average of ``w - lr g_r``
is ``w - lr mean(g_r)``; DiLoCo with ``outer_lr=1`` and no outer momentum applies that average as is). With Adam's
per-rank moments, or averaging every H > 1 steps, the runs follow another trajectory than one process: those are
the cases here, with plain SGD.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Optional

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint

from lightning_mgpu import MGPUDDPStrategy, MGPUDiLoCoStrategy, MGPULocalSGDStrategy, MGPUShardedStrategy
from lightning_mgpu.parts.trainable_state import KEY
from tests.corpus import LoRAGPT2, token_data
from tests.helpers import RankData, fit
from tests.matrix import tiers

pytest.importorskip("peft")

B, WORLD, EPOCHS, SAMPLES = 4, 2, 2, 16


@pytest.fixture(autouse=True)
def _one_rank_cleanup() -> Any:
    """The runs on one process (resumes at world size 1, the evaluation test) run in this process and leave a
    process group and Lightning's thread count behind, which later fork launches would inherit and hang on."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    torch.set_num_threads(1)


class Probe(Callback):
    """Per rank at the end of fit: whether any frozen parameter has a gradient, which parameters the optimizer
    holds state for (by name) and that state's bytes on this rank."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.start_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_step = trainer.global_step  # a resumed run starts where its checkpoint stopped

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        names = {id(p): n for n, p in pl_module.named_parameters()}
        opt: Any = trainer.optimizers[0]
        local = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer: this rank's partition
        with_state, state_bytes = [], 0
        for p, state in local.state.items():
            with_state.append(names[id(p)])
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    v = v.to_local() if hasattr(v, "to_local") else v
                    state_bytes += v.numel() * v.element_size()
        torch.save(
            {
                "frozen_grads": [
                    n for n, p in pl_module.named_parameters() if not p.requires_grad and p.grad is not None
                ],
                "with_state": with_state,
                "state_bytes": state_bytes,
                "start_step": self.start_step,
            },
            self.out / f"probe{trainer.global_rank}.pt",
        )


@functools.cache
def one_process(optimizer: str, batch: int = WORLD * B) -> dict[str, torch.Tensor]:
    """The state after the same training in one process on batches of ``batch``."""
    model = LoRAGPT2(optimizer=optimizer).double()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=EPOCHS,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=RankData(token_data(SAMPLES), batch))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _trainable_names(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


#: id -> (strategy factory, optimizer, resume at this world size or None)
CASES: dict[str, tuple[Any, str, Optional[int]]] = {
    "ddp-file-sync": (lambda: MGPUDDPStrategy(start_method="fork", checkpoint_params="trainable"), "adamw", 1),
    "zero1-file-async": (
        lambda: MGPUShardedStrategy(stage=1, start_method="fork", checkpoint_params="trainable", async_checkpoint=True),
        "adamw",
        2,
    ),
    "zero2-dir-sync": (
        lambda: MGPUShardedStrategy(stage=2, start_method="fork", checkpoint="sharded", checkpoint_params="auto"),
        "adamw",
        1,
    ),
    "zero3-dir-async": (
        lambda: MGPUShardedStrategy(
            stage=3, start_method="fork", checkpoint="sharded", checkpoint_params="trainable", async_checkpoint=True
        ),
        "adamw",
        2,
    ),
    # the base, the adapters and their optimizer state offloaded to host memory; an adapter-only file resumes on 1 rank
    "zero3-offload-file-sync": (
        lambda: MGPUShardedStrategy(stage=3, offload="cpu", start_method="fork", checkpoint_params="trainable"),
        "adamw",
        1,
    ),
    "hsdp-file-sync": (
        lambda: MGPUShardedStrategy(
            stage=3, mesh="hybrid", shard_size=1, start_method="fork", checkpoint_params="trainable"
        ),
        "adamw",
        2,
    ),
    "local_sgd": (
        lambda: MGPULocalSGDStrategy(sync_every=1, start_method="fork", checkpoint_params="trainable"),
        "sgd",
        None,
    ),
    "diloco": (
        lambda: MGPUDiLoCoStrategy(
            sync_every=1,
            outer_lr=1.0,
            outer_momentum=0.0,
            nesterov=False,
            start_method="fork",
            checkpoint_params="trainable",
        ),
        "sgd",
        None,
    ),
}


def _checkpoint_contents(path: Path) -> tuple[set[str], dict[str, Any], int, int]:
    """(the weight keys, the non-tensor part with the fingerprint, optimizer states' parameter count, bytes)."""
    if path.is_dir():
        from torch.distributed.checkpoint import FileSystemReader

        meta = torch.load(path / "meta.pt", weights_only=False)
        keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        weights = {k.split(".", 1)[1] for k in keys if k.startswith("state_dict.")}
        prefix = "optimizer_0.state."
        states = {k[len(prefix) :].rsplit(".", 1)[0] for k in keys if k.startswith(prefix)}
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        return weights, meta, len(states), size
    ckpt = torch.load(path, weights_only=False)
    return set(ckpt["state_dict"]), ckpt, len(ckpt["optimizer_states"][0]["state"]), path.stat().st_size


# the slow tier: ZeRO-1 and ZeRO-2, whose whole parameters save as DDP's and whose sharded directory and background
# writes the ZeRO-3 cells prove
@pytest.mark.parametrize("case", tiers({c: c for c in CASES}, slow={"zero1-file-async", "zero2-dir-sync"}))
def test_lora_fine_tuning_has_parity_keeps_the_base_stateless_and_resumes_from_adapter_only_checkpoints(
    case: str, tmp_path: Path
) -> None:
    make_strategy, optimizer, resume_world = CASES[case]
    model = LoRAGPT2(optimizer=optimizer).double()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainable = _trainable_names(model)
    frozen = set(before) - trainable
    ckpts = tmp_path / "ckpts"
    saver = ModelCheckpoint(dirpath=ckpts, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    ranks = fit(
        model,
        make_strategy(),
        tmp_path / "run",
        dataset=token_data(SAMPLES),
        batch_size=B,
        max_epochs=EPOCHS,
        callbacks=[Probe(tmp_path), saver],
        enable_checkpointing=True,
    )
    reference = one_process(optimizer)
    for rank in ranks:
        assert rank["global_step"] == EPOCHS * SAMPLES // (WORLD * B)
        torch.testing.assert_close(rank["state"], reference)  # parity, the adapters included
        for name in frozen:  # the base: bit for bit as built
            assert torch.equal(rank["state"][name], before[name]), name
    for r in range(WORLD):
        probe = torch.load(tmp_path / f"probe{r}.pt", weights_only=False)
        assert probe["frozen_grads"] == []
        assert set(probe["with_state"]) <= trainable
        assert probe["with_state"] or optimizer == "sgd"  # plain SGD keeps no state
        # AdamW: exp_avg + exp_avg_sq (float64) and a step per adapter parameter, or a share of them (sharded)
        assert probe["state_bytes"] <= sum(before[n].numel() for n in trainable) * 2 * 8 + 8 * len(trainable)
    # the checkpoint of epoch 0: the adapters, their optimizer state, the loop state and the base's fingerprint
    first = ckpts / "epoch=0.ckpt"
    weights, meta, states, _ = _checkpoint_contents(first)
    assert weights == trainable
    assert set(meta[KEY]["frozen"]) == frozen
    assert meta["epoch"] == 0 and meta["global_step"] == SAMPLES // (WORLD * B)
    if optimizer == "adamw":
        assert states == len(trainable)
    if resume_world is None:
        return
    resumed = fit(
        LoRAGPT2(optimizer=optimizer).double(),
        make_strategy(),
        tmp_path / "resumed",
        dataset=token_data(SAMPLES),
        batch_size=WORLD * B // resume_world,
        devices=resume_world,
        max_epochs=EPOCHS,
        ckpt_path=str(first),
        callbacks=[Probe(tmp_path / "resumed")],
    )
    # the resumed run trained epoch 1 only, from the checkpoint's adapters and optimizer state
    assert torch.load(tmp_path / "resumed" / "probe0.pt", weights_only=False)["start_step"] == SAMPLES // (WORLD * B)
    for rank in resumed:  # continue == uninterrupted
        torch.testing.assert_close(rank["state"], ranks[0]["state"])
    if case == "zero3-dir-async":
        # another base, sharded over 2 ranks (only rank 0 holds the first rows): refused on every rank, no hang
        with pytest.raises(Exception, match="saved on another frozen base"):
            fit(
                LoRAGPT2(seed=1).double(),
                make_strategy(),
                tmp_path / "refused",
                dataset=token_data(SAMPLES),
                batch_size=B,
                max_epochs=EPOCHS,
                ckpt_path=str(first),
            )


def test_the_parity_check_sees_a_different_global_batch() -> None:
    """Negative control: the one-process run on the per-rank batch (4, not 8) does not pass the comparison the
    cases above make."""
    with pytest.raises(AssertionError):
        torch.testing.assert_close(one_process("adamw", B), one_process("adamw"))


def _one_process_trainer(tmp_path: Path, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=MGPUDDPStrategy(checkpoint_params="trainable"),
        max_epochs=1,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kwargs,
    )


def test_an_adapter_only_checkpoint_loads_for_evaluation_and_is_refused_on_another_base(tmp_path: Path) -> None:
    model = LoRAGPT2().double()
    trainer = _one_process_trainer(tmp_path, enable_checkpointing=False)
    data = RankData(token_data(SAMPLES), WORLD * B)
    trainer.fit(model, datamodule=data)
    path = tmp_path / "adapters.ckpt"
    trainer.save_checkpoint(path)
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}

    # evaluation onto the same base (a fresh model: adapters as initialised) gets the trained adapters
    fresh = LoRAGPT2().double()
    data.val_dataloader = lambda: torch.utils.data.DataLoader(token_data(8), batch_size=8)  # type: ignore[method-assign]
    _one_process_trainer(tmp_path).validate(fresh, datamodule=data, ckpt_path=str(path), verbose=False)
    torch.testing.assert_close(fresh.state_dict(), trained)

    # another base: refused, with the reason and the fix, before anything is loaded
    other = LoRAGPT2(seed=1).double()
    other_before = {k: v.detach().clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match=r"saved on another frozen base.*differ.*Build the model on the same base"):
        _one_process_trainer(tmp_path).fit(other, datamodule=data, ckpt_path=str(path))
    for k, v in other.state_dict().items():
        assert torch.equal(v, other_before[k]), k
