"""Tensor parallelism on 4 gloo processes (tensor 2 x data 2): the weights of one process with the global batch
(float64, ``assert_close`` defaults), with accumulation, clipping that bites, activation checkpointing, the token
loss, exact evaluation and checkpoints that resume across layouts; and Lightning's own tensor-parallel example
trains to the same losses under ``MGPUShardedStrategy`` as under Lightning's ``ModelParallelStrategy``."""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import pytorch_lightning as pl
import torch
import torch.multiprocessing as mp
from lightning_fabric.plugins.environments.lightning import find_free_network_port
from pytorch_lightning.callbacks import Callback
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_mgpu import EMA, MGPUShardedStrategy, _compat, export_checkpoint, plan_layouts
from lightning_mgpu.comm import local_shard
from lightning_mgpu.parts.pipeline import PipelineBackend
from lightning_mgpu.parts.steps import PipelineSteps
from lightning_mgpu.parts.tensor_parallel import TensorParallelism, is_tensor_parallel
from lightning_mgpu.plugins.checkpoint_io import EMA_STATE_KEY
from tests.helpers import Recorder, load_ranks
from tests.tensor_parallel_models import (
    SEQ,
    VOCAB,
    Block,
    FamiliesModule,
    HFModule,
    ListTPModule,
    Llama3,
    TinyLlama,
    TPModule,
    global_batches,
    indexed_data,
    lm_loss,
    reference,
    token_data,
)

WORLD = 4


class Data(pl.LightningDataModule):
    """Plain loaders: Lightning puts in its sampler, with the strategy's ``distributed_sampler_kwargs``."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_data(), batch_size=2)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(indexed_data(), batch_size=2)


class Report(Callback):
    """At the end of fit, on every rank: the sampler's split, the evaluation samples seen, the logged metrics;
    then a consolidated checkpoint (a collective) where ``save`` is given."""

    def __init__(self, out: Path, save: Optional[Path] = None) -> None:
        self.out, self.save = Path(out), save
        self.layouts: dict[str, set[tuple[str, int]]] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        # what each norm takes in and what the head hands out on this rank: (placement, local length of the dim)
        for name, module in pl_module.model.named_modules():
            if name.endswith(("norm", ".ln_1", ".ln_2", ".ln_f")) and not name.endswith("embeddings.LayerNorm"):
                module.register_forward_pre_hook(lambda m, args, name=name: self._seen(name, args[0], 1))
            if name in ("output", "lm_head"):
                module.register_forward_hook(lambda m, args, out, name=name: self._seen(name, out, -1))

    def _seen(self, name: str, x: Any, dim: int) -> None:
        placement = str(x.placements[0]) if hasattr(x, "placements") else "local"
        local = x.to_local() if hasattr(x, "to_local") else x
        self.layouts.setdefault(name, set()).add((placement, local.shape[dim]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        record = {
            "sampler": trainer.strategy.distributed_sampler_kwargs,
            "seen": list(pl_module.seen),
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "split": is_tensor_parallel(pl_module),  # the layers were split, not merely computed twice
            "layouts": self.layouts,
            "ledger": dataclasses.replace(trainer.strategy.comm_stats),
            "units": [n for n, m in pl_module.named_modules() if isinstance(m, FSDPModule)],
            "local": {n: tuple(local_shard(p).shape) for n, p in pl_module.named_parameters()},  # this rank's piece
            "tied": _tied(pl_module),
        }
        torch.save(record, self.out / f"report{trainer.global_rank}.pt")
        if self.save is not None:
            trainer.save_checkpoint(self.save)


def _tied(module: torch.nn.Module) -> list[str]:
    """The names under which a parameter already listed appears again (a tied weight: one ``Parameter`` object)."""
    once = {id(p) for p in module.parameters()}
    every = dict(module.named_parameters(remove_duplicate=False))
    return sorted(n for n in every if n not in dict(module.named_parameters())) if len(once) < len(every) else []


def _fit(
    out: Path,
    devices: int,
    strategy: Any,
    epochs: int,
    module: Optional[TPModule] = None,
    save: Optional[Path] = None,
    callbacks: Sequence[Callback] = (),
    **kwargs: Any,
) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=epochs, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[*callbacks, Recorder(out), Report(out, save)], **kwargs,
    )  # fmt: skip
    trainer.fit(module or TPModule(), datamodule=Data(), ckpt_path=ckpt_path)
    records = load_ranks(out, devices)
    for r, record in enumerate(records):
        record.update(torch.load(out / f"report{r}.pt", weights_only=False))
    return records


def _assert_weights(records: list[dict[str, Any]], expected: dict[str, torch.Tensor]) -> None:
    for record in records:
        assert set(record["state"]) == set(expected)
        for name, value in expected.items():
            torch.testing.assert_close(record["state"][name], value, msg=name)


def _differs(records: list[dict[str, Any]], expected: dict[str, torch.Tensor]) -> bool:
    try:
        _assert_weights(records, expected)
    except AssertionError:
        return True
    return False


def _ema_of(decay: float, into: dict[str, torch.Tensor]) -> Callable[[torch.nn.Module], None]:
    """A one-process EMA of the trainable weights after each step (the first copies them), into ``into``."""

    def update(model: torch.nn.Module) -> None:
        for name, p in model.named_parameters():
            key = f"model.{name}"
            into[key] = p.detach().clone() if key not in into else decay * into[key] + (1 - decay) * p.detach()

    return update


def test_tensor2_data2_equals_one_process_evaluates_each_sample_once_and_resumes_across_layouts(tmp_path: Path):
    # tensor 2 x data 2, k = 1, activation checkpointing of every block, the auto plan, the tensor dimension counted;
    # the EMA callback averages each rank's piece of the split layers and evaluates with the average
    tp = MGPUShardedStrategy(
        stage=3, tensor_parallel_size=2, activation_checkpointing=Block, tensor_comm_stats=True, start_method="fork"
    )
    first = _fit(tmp_path / "tp", WORLD, tp, epochs=1, save=tmp_path / "tp.ckpt", callbacks=[EMA(decay=0.5)])
    ema: dict[str, torch.Tensor] = {}
    expected, _ = reference(TPModule(), token_data(), data_ranks=[2], after_step=_ema_of(0.5, ema))
    _assert_weights(first, expected)
    assert all(r["split"] for r in first)
    # the auto plan alone: the norms see the whole sequence, the head hands out whole logits
    assert all(set(r["layouts"]["norm"]) == {("local", SEQ)} for r in first)
    assert all(set(r["layouts"]["output"]) == {("local", VOCAB)} for r in first)
    # negative control: had the tensor-parallel ranks taken different batches (4 data ranks), the weights differ
    assert _differs(first, reference(TPModule(), token_data(), data_ranks=[4])[0])
    # the data is split over the 2 data ranks; both ranks of a tensor-parallel group see the same batches
    assert [r["sampler"] for r in first] == [{"num_replicas": 2, "rank": d} for d in (0, 0, 1, 1)]
    assert first[0]["global_step"] == 6
    # exact evaluation: every sample once across the data ranks, the same samples within a tensor-parallel group
    assert first[0]["seen"] == first[1]["seen"] and first[2]["seen"] == first[3]["seen"]
    assert sorted(first[0]["seen"] + first[2]["seen"]) == list(range(10))
    model = TPModule().model  # validated with the EMA weights (the trained ones back afterwards: the weights above)
    model.load_state_dict({k.removeprefix("model."): v for k, v in ema.items()})
    with torch.no_grad():
        one_process = float(lm_loss(model, indexed_data().tensors[0]))
    assert all(r["metrics"]["val_loss"] == pytest.approx(one_process, rel=1e-12) for r in first)
    # the consolidated checkpoint holds the whole tensors, of the weights and of their EMA (one process's EMA)
    saved = torch.load(tmp_path / "tp.ckpt", weights_only=False)
    for name, value in expected.items():
        torch.testing.assert_close(saved["state_dict"][name], value)
    torch.testing.assert_close(saved[EMA_STATE_KEY], ema)
    assert _differs([{"state": saved[EMA_STATE_KEY]}], expected)  # negative control: the average is not the weights

    _assert_tensor_ledger(first)

    # resumed at data 4 (no tensor dimension), then on one process, then back at tensor 2 x data 2
    data4 = _fit(
        tmp_path / "d4", WORLD, MGPUShardedStrategy(stage=3, tensor_comm_stats=True, start_method="fork"), epochs=2,
        ckpt_path=str(tmp_path / "tp.ckpt"), save=tmp_path / "d4.ckpt",
    )  # fmt: skip
    _assert_weights(data4, reference(TPModule(), token_data(), data_ranks=[2, 4])[0])
    # negative control: the same count over a tensor dimension of one rank finds nothing (the data dimension's
    # collectives, FSDP's all-gathers and reduce-scatters, are not in it)
    assert all(r["ledger"].tensor_calls == r["ledger"].tensor_bytes == 0 for r in data4)
    assert data4[0]["ledger"].round_bytes > 0
    # one process in a child of its own: its process group must not outlive the fit in this process
    mp.start_processes(_one_process, args=(tmp_path,), nprocs=1, start_method="fork")
    one = load_ranks(tmp_path / "one", 1)
    _assert_weights(one, reference(TPModule(), token_data(), data_ranks=[2, 4, 1])[0])
    back = MGPUShardedStrategy(stage=3, tensor_parallel_size=2, start_method="fork")
    again = _fit(tmp_path / "back", WORLD, back, epochs=4, ckpt_path=str(tmp_path / "one.ckpt"))
    _assert_weights(again, reference(TPModule(), token_data(), data_ranks=[2, 4, 1, 2])[0])


class AttentionFrozen(TPModule):
    """The tiny Llama with its embedding and attention layers frozen (a frozen base, the rest trained)."""

    def __init__(self) -> None:
        super().__init__()
        for name, p in self.model.named_parameters():
            p.requires_grad_("attention." not in name and "tok_embeddings" not in name)


def test_a_tensor_parallel_adapter_only_checkpoint_leaves_the_base_out_and_resumes_as_the_uninterrupted_run(
    tmp_path: Path,
):
    # tensor 2 (data 1), checkpoint_params="trainable": the checkpoint holds the trained layers whole, not the
    # frozen (split) attention; the resumed fit ends with one process's weights after both epochs
    def strategy() -> MGPUShardedStrategy:
        return MGPUShardedStrategy(tensor_parallel_size=2, checkpoint_params="trainable", start_method="fork")

    first = _fit(tmp_path / "a", 2, strategy(), epochs=1, module=AttentionFrozen(), save=tmp_path / "a.ckpt")
    _assert_weights(first, reference(AttentionFrozen(), token_data(), data_ranks=[1])[0])
    assert all(r["split"] for r in first)
    saved = torch.load(tmp_path / "a.ckpt", weights_only=False)
    frozen = {f"model.{n}" for n, p in AttentionFrozen().model.named_parameters() if not p.requires_grad}
    assert frozen and "model.layers.0.attention.wq.weight" in frozen
    assert set(saved["state_dict"]) == set(first[0]["state"]) - frozen
    resumed = _fit(
        tmp_path / "b", 2, strategy(), epochs=2, module=AttentionFrozen(), ckpt_path=str(tmp_path / "a.ckpt")
    )
    expected, _ = reference(AttentionFrozen(), token_data(), data_ranks=[1, 1])
    _assert_weights(resumed, expected)
    assert _differs(resumed, reference(AttentionFrozen(), token_data(), data_ranks=[1])[0])  # epoch 2 did train


def _assert_tensor_ledger(records: list[dict[str, Any]]) -> None:
    """The ledger's tensor-parallel count against what the split layers must send, from the shapes: each block's
    output is the loader's batch 2 x 6 positions x width 8 in float64 = 768 bytes; of each of the 2 blocks the 2
    row-wise layers (attention's wo, the MLP's w2) all-reduce their output in forward, the recomputed forward runs
    wo's again but stops before w2's (torch's recomputation stops once every tensor the backward keeps is back, and
    nothing keeps w2's output: the residual sum reads it), the 5 column-wise ones (wq, wk, wv, w1, w3) all-reduce
    their input's gradient in backward; a ring all-reduce over 2 ranks sends 2 (2-1)/2 = 1x its payload. Then the
    layout planner's figure for this layout."""
    block_output = 2 * 6 * 8 * 8
    calls = 2 * (2 + 1 + 5)
    for record in records:
        ledger = record["ledger"]
        assert ledger.optimizer_steps == 6
        assert ledger.tensor_calls == 6 * calls
        assert ledger.tensor_bytes_per_step == calls * block_output == 12288
        assert ledger.tensor_sent_bytes_per_step == 12288
    tokens = token_data().tensors[0][:2]
    layouts = plan_layouts(
        TPModule, devices=WORLD, device_memory="1GiB", batch=[tokens], activation_checkpointing=Block,
        strategies=("mgpu_zero3",), precisions=("32-true",),
    ).layouts  # fmt: skip
    wanted = (2, 2, 1, True)  # tensor 2 x data 2, no pipeline, checkpointed blocks
    layout = next(x for x in layouts if (x.tensor, x.data_shard, x.pipeline, x.activation_checkpointing) == wanted)
    assert layout.tensor_bytes == records[0]["ledger"].tensor_sent_bytes_per_step  # the planner's model is exact here
    # negative control: the count a fused projection would give (one all-reduce per attention and MLP in each
    # forward, recomputed one and backward: 6 per block) is not the one measured
    assert 2 * 6 * block_output != records[0]["ledger"].tensor_sent_bytes_per_step


def _one_process(_: int, tmp_path: Path) -> None:
    strategy = MGPUShardedStrategy(stage=3)
    _fit(tmp_path / "one", 1, strategy, epochs=3, ckpt_path=str(tmp_path / "d4.ckpt"), save=tmp_path / "one.ckpt")


def test_accumulation_clipping_token_loss_and_a_plan_of_your_own_on_the_hybrid_mesh(tmp_path: Path):
    # tensor 2 x (2 replicas x 1 shard), k = 3, clipping that bites, the token loss, the non-finite check, the
    # MLPs split by the user's plan (the attention stays replicated), biases in every linear layer; a sharded
    # checkpoint (DCP) resumed at data 4
    plan = {"model.layers.*.feed_forward.w1": "colwise", "model.layers.*.feed_forward.w3": "colwise"}
    plan["model.layers.*.feed_forward.w2"] = "rowwise"
    strategy = MGPUShardedStrategy(
        stage=3, mesh="hybrid", shard_size=1, tensor_parallel_size=2, tensor_parallel_plan=plan,
        loss_normalization="tokens", nonfinite="error", checkpoint="sharded", start_method="fork",
    )  # fmt: skip
    clip = 0.1
    train = {"accumulate_grad_batches": 3, "gradient_clip_val": clip}
    module = TPModule(bias=True, tokens=True)
    records = _fit(tmp_path / "tp", WORLD, strategy, epochs=1, module=module, save=tmp_path / "sharded.ckpt", **train)
    expected, norms = reference(TPModule(bias=True), token_data(), data_ranks=[2], accumulate=3, clip=clip)
    assert records[0]["global_step"] == 2 and min(norms) > 2 * clip  # every step is clipped
    _assert_weights(records, expected)
    assert all(r["split"] for r in records)
    # negative control: without the clipping the weights differ
    assert _differs(records, reference(TPModule(bias=True), token_data(), data_ranks=[2], accumulate=3)[0])
    # the sharded directory resumes at data 4
    data4 = MGPUShardedStrategy(stage=3, checkpoint="sharded", loss_normalization="tokens", start_method="fork")
    resumed = _fit(tmp_path / "d4", WORLD, data4, epochs=2, module=TPModule(bias=True, tokens=True),
                   ckpt_path=str(tmp_path / "sharded.ckpt"), **train)  # fmt: skip
    both, _ = reference(TPModule(bias=True), token_data(), data_ranks=[2, 4], accumulate=3, clip=clip)
    _assert_weights(resumed, both)


def test_sequence_parallel_norms_and_the_loss_over_the_sharded_vocabulary_equal_one_process(tmp_path: Path):
    # tensor 2 x data 2, "auto+sequence": the norms on sequence shards, the head split by vocabulary and the user's
    # unchanged F.cross_entropy computing the loss over the vocabulary shards; k = 3 with clipping that bites
    strategy = MGPUShardedStrategy(
        stage=3, tensor_parallel_size=2, tensor_parallel_plan="auto+sequence", start_method="fork"
    )  # fmt: skip
    clip = 0.1
    train = {"accumulate_grad_batches": 3, "gradient_clip_val": clip}
    records = _fit(tmp_path, WORLD, strategy, epochs=1, **train)
    expected, norms = reference(TPModule(), token_data(), data_ranks=[2], accumulate=3, clip=clip)
    assert records[0]["global_step"] == 2 and min(norms) > 2 * clip  # every step is clipped
    _assert_weights(records, expected)
    assert all(r["split"] for r in records)
    # every norm took its rank's half of the sequence, and the head handed out its half of the vocabulary
    for r in records:
        assert set(r["layouts"]) == {"layers.0.attention_norm", "layers.0.ffn_norm", "layers.1.attention_norm",
                                     "layers.1.ffn_norm", "norm", "output"}  # fmt: skip
        assert all(v == {("S(1)", SEQ // 2)} for k, v in r["layouts"].items() if k != "output")  # Shard(1)
        assert r["layouts"]["output"] == {("S(2)", VOCAB // 2)}
    # exact evaluation through the same sharded loss
    model = TPModule().model
    model.load_state_dict({k.removeprefix("model."): v for k, v in expected.items()})
    with torch.no_grad():
        one_process = float(lm_loss(model, indexed_data().tensors[0]))
    assert all(r["metrics"]["val_loss"] == pytest.approx(one_process, rel=1e-12) for r in records)
    # negative control: without the clipping the weights differ
    assert _differs(records, reference(TPModule(), token_data(), data_ranks=[2], accumulate=3)[0])

    # k = 1 with activation checkpointing of every block, the loss logged from the step (synced over the ranks)
    strategy = MGPUShardedStrategy(
        stage=3, tensor_parallel_size=2, tensor_parallel_plan="auto+sequence", activation_checkpointing=Block,
        start_method="fork",
    )  # fmt: skip
    records = _fit(tmp_path / "k1", WORLD, strategy, epochs=1, module=LoggedLoss(), limit_val_batches=0)
    _assert_weights(records, reference(TPModule(), token_data(), data_ranks=[2])[0])
    before_last, _ = reference(TPModule(), token_data(), data_ranks=[2], limit=5)
    model.load_state_dict({k.removeprefix("model."): v for k, v in before_last.items()})
    with torch.no_grad():
        last = float(lm_loss(model, global_batches(token_data(), 2, 2, epoch=0)[5]))
    assert all(r["metrics"]["train_loss"] == pytest.approx(last, rel=1e-12) for r in records)


def _lay_out_twice(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
        model = TinyLlama().double()
        first, second = TensorParallelism(2, "auto+sequence"), TensorParallelism(2, "auto+sequence")
        first.apply(model, mesh)
        again = second.apply(model, mesh)  # a second fit of the same module in this process
        tokens = token_data().tensors[0][:2]
        with second.step_context():
            loss = second.local_output(lm_loss(model, tokens))
            loss.backward()
        result = (first.vocab_parallel, again, second.vocab_parallel, type(loss).__name__)
        torch.save(result, Path(out) / f"twice{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_a_module_laid_out_by_an_earlier_fit_keeps_its_loss_over_the_sharded_vocabulary(tmp_path: Path):
    mp.start_processes(_lay_out_twice, nprocs=2, start_method="fork", args=(find_free_network_port(), str(tmp_path)))
    for r in range(2):
        assert torch.load(tmp_path / f"twice{r}.pt") == (True, None, True, "Tensor")


class LoggedLoss(TPModule):
    @override
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, sync_dist=True)
        return loss


class LlamaOnEvenSequences(HFModule):
    """Hugging Face's Llama on the first ``SEQ`` tokens of each sample (a length the tensor size divides)."""

    def __init__(self) -> None:
        super().__init__("llama")

    @staticmethod
    def compute(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return model(input_ids=tokens[:, :SEQ], labels=tokens[:, :SEQ]).loss


def test_sequence_parallel_hugging_face_llama_equals_one_process(tmp_path: Path):
    pytest.importorskip("transformers")
    strategy = MGPUShardedStrategy(
        stage=3, tensor_parallel_size=2, tensor_parallel_plan="auto+sequence", start_method="fork"
    )  # fmt: skip
    records = _fit(tmp_path, WORLD, strategy, epochs=1, module=LlamaOnEvenSequences(), limit_train_batches=4,
                   limit_val_batches=0)  # fmt: skip
    expected, _ = reference(LlamaOnEvenSequences(), token_data(), data_ranks=[2], limit=4)
    _assert_weights(records, expected)
    # negative control: one micro-batch fewer, and the weights differ
    assert _differs(records, reference(LlamaOnEvenSequences(), token_data(), data_ranks=[2], limit=3)[0])
    for r in records:
        norms = {k: v for k, v in r["layouts"].items() if k != "lm_head"}
        assert len(norms) == 5 and all(v == {("S(1)", SEQ // 2)} for v in norms.values())  # 2 x 2 layers + final
        assert r["layouts"]["lm_head"] == {("S(2)", VOCAB // 2)}


class GPT2OnEvenSequences(HFModule):
    """Hugging Face's GPT-2 (its head tied to the token embedding) on the first ``SEQ`` tokens of each sample, without
    the key/value cache (a training forward needs none, and a checkpointed block's recompute would append to it)."""

    def __init__(self) -> None:
        super().__init__("gpt2")

    @staticmethod
    def compute(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return model(input_ids=tokens[:, :SEQ], labels=tokens[:, :SEQ], use_cache=False).loss


def test_sequence_parallel_hugging_face_gpt2_with_its_tied_head_equals_one_process(tmp_path: Path):
    # tensor 2 x data 2, "auto+sequence" on GPT2LMHeadModel: the token and position embeddings whole, the first block
    # cuts the sequence, the norms on sequence shards, the head (one parameter with the token embedding) split by
    # vocabulary; k = 3 with clipping that bites
    pytest.importorskip("transformers")
    one = GPT2OnEvenSequences().model
    assert one.lm_head.weight is one.transformer.wte.weight  # tied by default
    strategy = MGPUShardedStrategy(
        stage=3, tensor_parallel_size=2, tensor_parallel_plan="auto+sequence", start_method="fork"
    )  # fmt: skip
    clip = 0.05
    train = {"accumulate_grad_batches": 3, "gradient_clip_val": clip}
    records = _fit(tmp_path, WORLD, strategy, epochs=1, module=GPT2OnEvenSequences(), limit_val_batches=0, **train)
    expected, norms = reference(GPT2OnEvenSequences(), token_data(), data_ranks=[2], accumulate=3, clip=clip)
    assert records[0]["global_step"] == 2 and min(norms) > 2 * clip  # every step is clipped
    _assert_weights(records, expected)  # the head and the token embedding trained as one weight, as on one process
    torch.testing.assert_close(expected["model.lm_head.weight"], expected["model.transformer.wte.weight"])
    # negative control: without the clipping the weights differ
    assert _differs(records, reference(GPT2OnEvenSequences(), token_data(), data_ranks=[2], accumulate=3)[0])
    for r in records:
        assert r["split"] and r["tied"] == ["model.lm_head.weight"]  # still one parameter after the plan and FSDP
        norms_seen = {k: v for k, v in r["layouts"].items() if k != "lm_head"}
        assert set(norms_seen) == {f"transformer.h.{i}.ln_{j}" for i in range(2) for j in (1, 2)} | {"transformer.ln_f"}
        assert all(v == {("S(1)", SEQ // 2)} for v in norms_seen.values())  # each norm took half the sequence
        assert r["layouts"]["lm_head"] == {("S(2)", VOCAB // 2)}  # the head handed out half the vocabulary

    # k = 1 with activation checkpointing of every block (the first one cutting the sequence), exact evaluation
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    strategy = MGPUShardedStrategy(
        stage=3, tensor_parallel_size=2, tensor_parallel_plan="auto+sequence", activation_checkpointing=GPT2Block,
        start_method="fork",
    )  # fmt: skip
    records = _fit(tmp_path / "k1", WORLD, strategy, epochs=1, module=GPT2OnEvenSequences(), limit_train_batches=3)
    expected, _ = reference(GPT2OnEvenSequences(), token_data(), data_ranks=[2], limit=3)
    _assert_weights(records, expected)
    model = GPT2OnEvenSequences().model
    model.load_state_dict({k.removeprefix("model."): v for k, v in expected.items()})
    with torch.no_grad():
        one_process = float(GPT2OnEvenSequences.compute(model, indexed_data().tensors[0]))
    assert all(r["metrics"]["val_loss"] == pytest.approx(one_process, rel=1e-12) for r in records)
    assert all(r["tied"] == ["model.lm_head.weight"] for r in records)


@pytest.mark.parametrize(("kind", "stage"), [("llama", 3), ("bert", 2), ("gpt2", 3)])
def test_hugging_face_models_split_by_the_auto_plan_equal_one_process(tmp_path: Path, kind: str, stage: int):
    pytest.importorskip("transformers")
    strategy = MGPUShardedStrategy(stage=stage, tensor_parallel_size=2, start_method="fork")  # type: ignore[arg-type]
    records = _fit(tmp_path, 2, strategy, epochs=1, module=HFModule(kind), limit_train_batches=4)
    expected, _ = reference(HFModule(kind), token_data(), data_ranks=[1], limit=4)
    _assert_weights(records, expected)
    assert _differs(records, reference(HFModule(kind), token_data(), data_ranks=[2], limit=4)[0])
    assert all(r["split"] for r in records)
    if kind == "gpt2":  # the packed query | key | value projection is split by heads, its output projection by rows
        attn = "model.transformer.h.0.attn"
        assert records[0]["local"][f"{attn}.c_attn.weight"] == (16, 24)  # of (16, 48): 2 of 4 heads' q, k, v
        assert records[0]["local"][f"{attn}.c_attn.bias"] == (48,)  # whole: each rank adds its heads' pieces
        assert records[0]["local"][f"{attn}.c_proj.weight"] == (8, 16)


#: family -> (a split weight, its shape on each of the 4 ranks: split over the tensor dimension, then over the data one;
#: a packed query | key | value weight by rows over the tensor dimension, by columns over the data one)
FAMILY_SHARDS = {
    "litgpt": ("transformer.h.0.attn.qkv.weight", (24, 8)),  # of (48, 16): 2 of 4 heads' q, k, v; half the columns
    # of (32, 16): 4 query heads | 2 key/value groups, split by input column (the heads whole), then by rows
    "litgpt_gqa": ("transformer.h.0.attn.qkv.weight", (16, 8)),
    "nanogpt": (
        "transformer.h.0.attn.c_attn.weight",
        (24, 8),
    ),  # of (48, 16): 2 heads of 4 (its local forward)
    "vit": ("blocks.0.attn.qkv.weight", (24, 8)),  # of (48, 16)
    "mlp": ("0.weight", (8, SEQ * VOCAB)),  # of (32, 96)
    "llama": ("layers.0.attention.wq.weight", (2, 8)),  # of (8, 8): 2 of 4 heads
}


@pytest.mark.timeout(300)
def test_the_families_found_by_their_structure_equal_one_process_each(tmp_path: Path):
    # litgpt (multi-head and grouped-query), nanoGPT, timm's ViT, a plain MLP and torchtitan's Llama side by side in one
    # module, at tensor 2 x data 2: the auto plan finds their pairs by one forward (no name rule matches litgpt's,
    # nanoGPT's attention or the MLP's; the Llama's are found by name), and each family's weights are one process's
    # with the global batch
    strategy = MGPUShardedStrategy(stage=3, tensor_parallel_size=2, start_method="fork")  # type: ignore[arg-type]
    records = _fit(tmp_path, WORLD, strategy, epochs=1, module=FamiliesModule(), limit_train_batches=3)
    expected, _ = reference(FamiliesModule(), token_data(), data_ranks=[2], limit=3)
    wrong, _ = reference(FamiliesModule(), token_data(), data_ranks=[4], limit=3)  # other batches on each rank
    assert all(r["split"] for r in records)
    for family, (weight, shape) in FAMILY_SHARDS.items():
        mine = {k: v for k, v in expected.items() if k.startswith(f"model.{family}.")}
        for record in records:
            for name, value in mine.items():
                torch.testing.assert_close(record["state"][name], value, msg=f"{family}: {name}")
        assert _differs([{"state": {k: records[0]["state"][k] for k in mine}}], {k: wrong[k] for k in mine}), family
        assert all(r["local"][f"model.{family}.{weight}"] == shape for r in records), family


def test_a_tensor_parallel_gpt2_saves_its_packed_attention_whole_and_resumes_from_either_layout(tmp_path: Path):
    # the split c_attn keeps the unsplit layout in checkpoints: consolidated (gathered on rank 0), sharded (DCP,
    # read back by the export, which knows nothing of the split), and both resume into the split model at another
    # data size: tensor 2 x data 2 -> tensor 2 x data 1 -> tensor 2 x data 2
    pytest.importorskip("transformers")

    def strategy(layout: str) -> MGPUShardedStrategy:
        return MGPUShardedStrategy(stage=3, tensor_parallel_size=2, checkpoint=layout, start_method="fork")  # type: ignore[arg-type]

    def expected(data_ranks: list[int]) -> dict[str, torch.Tensor]:
        return reference(HFModule("gpt2"), token_data(), data_ranks=data_ranks, limit=2)[0]

    first = _fit(tmp_path / "a", WORLD, strategy("consolidated"), epochs=1, module=HFModule("gpt2"),
                 limit_train_batches=2, save=tmp_path / "a.ckpt")  # fmt: skip
    _assert_weights(first, expected([2]))
    assert first[0]["local"]["model.transformer.h.0.attn.c_attn.weight"] == (8, 24)  # data 2 rows x tensor 2 heads
    saved = torch.load(tmp_path / "a.ckpt", weights_only=False)["state_dict"]
    assert set(saved) == set(expected([2]))
    for name, value in expected([2]).items():
        torch.testing.assert_close(saved[name], value, msg=name)
    resumed = _fit(tmp_path / "b", 2, strategy("sharded"), epochs=2, module=HFModule("gpt2"), limit_train_batches=2,
                   save=tmp_path / "b.ckpt", ckpt_path=str(tmp_path / "a.ckpt"))  # fmt: skip
    _assert_weights(resumed, expected([2, 1]))
    exported = torch.load(export_checkpoint(tmp_path / "b.ckpt", tmp_path / "b.pt", format="torch", prefix=""))
    assert set(exported) == set(expected([2, 1]))
    for name, value in expected([2, 1]).items():
        torch.testing.assert_close(exported[name], value, msg=name)
    again = _fit(tmp_path / "c", WORLD, strategy("sharded"), epochs=3, module=HFModule("gpt2"), limit_train_batches=2,
                 ckpt_path=str(tmp_path / "b.ckpt"))  # fmt: skip
    _assert_weights(again, expected([2, 1, 2]))


@pytest.mark.parametrize(("stage", "tensor"), [(3, 1), (2, 2)])
def test_blocks_in_a_bare_module_list_of_the_lightning_module_are_each_a_unit_and_equal_one_process(
    tmp_path: Path, stage: int, tensor: int
):
    # the default FSDP units of a module whose blocks are a ModuleList attribute of the LightningModule itself: each
    # block, never the list (it has no forward for FSDP's hooks); data 2, then tensor 2 x data 1, on 2 processes
    strategy = MGPUShardedStrategy(stage=stage, tensor_parallel_size=tensor, start_method="fork")  # type: ignore[arg-type]
    records = _fit(tmp_path, 2, strategy, epochs=1, module=ListTPModule(), limit_train_batches=3)
    data = 2 // tensor

    def expected(data_ranks: int) -> dict[str, torch.Tensor]:
        state, _ = reference(ListTPModule(), token_data(), data_ranks=[data_ranks], limit=3)
        return {k.removeprefix("model."): v for k, v in state.items()}

    assert records[0]["global_step"] == 3
    _assert_weights(records, expected(data))
    assert _differs(records, expected(2 // data))  # negative control: the other split of the batch differs
    for record in records:
        assert record["units"] == ["", "tok_embeddings", "layers.0", "layers.1", "norm", "output"]
        assert record["split"] == (tensor > 1)


# --- one dropout mask per tensor-parallel group ------------------------------------------------------------------


class DropoutTP(ListTPModule):
    """Dropout on the embedding's output (replicated over a tensor-parallel group), in processes that start from
    different random states (``configure_model`` seeds each from its rank, as processes given no common seed are)."""

    def configure_model(self) -> None:
        torch.manual_seed(100 + self.global_rank)
        self.draws = torch.rand(3)  # what this process would draw from here on
        self.losses: list[float] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.dropout(self.tok_embeddings(tokens), 0.5, self.training)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss))
        return loss


class Losses(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        torch.save({"draws": pl_module.draws, "losses": pl_module.losses}, self.out / f"losses{trainer.global_rank}.pt")


def test_the_ranks_of_a_tensor_parallel_group_draw_one_dropout_mask(tmp_path: Path) -> None:
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=MGPUShardedStrategy(stage=3, tensor_parallel_size=2,
        start_method="fork"), max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Losses(tmp_path)],
    )  # fmt: skip
    trainer.fit(DropoutTP(), DataLoader(token_data(), batch_size=2))
    ranks = [torch.load(tmp_path / f"losses{r}.pt", weights_only=False) for r in range(WORLD)]
    # the processes' random states differed (without the shared state a group's ranks drew different masks) ...
    assert not torch.equal(ranks[0]["draws"], ranks[1]["draws"])
    assert len(ranks[0]["losses"]) == 3
    # ... the two ranks of each tensor-parallel group compute one loss (one mask on the replicated activation), and
    # the data replicas, on other batches with their own masks, others
    assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[2]["losses"] == ranks[3]["losses"]
    assert ranks[0]["losses"] != ranks[2]["losses"]


# --- Lightning's example, under ours and under Lightning's ModelParallelStrategy -----------------------------------


def _rank(rank: int, port: int, job: Callable[[], None], out: str) -> None:
    # what a cluster (or torchrun) sets for each process: Lightning starts no process of its own
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", LOCAL_RANK=str(rank))
    os.environ["WORLD_SIZE"] = str(WORLD)
    torch.set_num_threads(1)
    try:
        job()
    except BaseException:
        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _example_losses(make_strategy: Callable[[], Any]) -> list[list[float]]:
    """Lightning's example module (shrunk) trained for 4 steps on 4 processes; every rank's losses."""
    with tempfile.TemporaryDirectory() as out:

        def job() -> None:
            torch.manual_seed(0)
            trainer = pl.Trainer(
                accelerator="cpu", devices=WORLD, strategy=make_strategy(), max_steps=4, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            )  # fmt: skip
            module = Llama3()
            trainer.fit(module)
            torch.save(module.losses, Path(out) / f"losses{trainer.global_rank}.pt")

        try:
            mp.start_processes(_rank, nprocs=WORLD, start_method="fork", args=(find_free_network_port(), job, out))
        except Exception as err:
            errors = "\n".join(p.read_text() for p in sorted(Path(out).glob("*.err")))
            raise AssertionError(f"a rank failed:\n{errors}") from err
        return [torch.load(Path(out) / f"losses{r}.pt") for r in range(WORLD)]


def test_lightnings_example_module_trains_as_under_model_parallel_strategy():
    from pytorch_lightning.strategies import ModelParallelStrategy

    ours = _example_losses(lambda: MGPUShardedStrategy(stage=3, tensor_parallel_size=2))
    lightnings = _example_losses(lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2))
    assert len(ours[0]) == 4
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(lightnings))  # float32 tolerance
    # the ranks of a tensor-parallel group see the same batch, the data ranks different ones
    assert ours[0] == ours[1] and ours[2] == ours[3] and ours[0] != ours[2]


def _normed_mlp() -> torch.nn.Sequential:
    """An MLP with a norm between its layers (no weights of its own): no pair the auto plan may split."""
    norm = torch.nn.LayerNorm(8, elementwise_affine=False)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), norm, torch.nn.ReLU(), torch.nn.Linear(8, 2))


class _MLPSteps:
    """The steps, data and optimizer of a module holding ``net`` (either namespace's ``LightningModule`` after it)."""

    net: torch.nn.Module

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net.parameters(), lr=0.1)


class BuiltMLP(_MLPSteps, pl.LightningModule):
    """An MLP built in ``configure_model`` (on each rank, after launch): the auto plan splits none of it."""

    def configure_model(self) -> None:
        self.net = _normed_mlp()


@pytest.mark.timeout(120)
def test_a_model_built_in_configure_model_that_the_auto_plan_cannot_split_is_refused_on_every_rank() -> None:
    """Each rank derives the same plan and refuses it before the tensor group's first collective: the fit raises
    the refusal (naming the layers and a plan to paste) instead of training the whole model on every rank, and no
    rank waits for another."""
    strategy = MGPUShardedStrategy(stage=3, tensor_parallel_size=2, start_method="fork")
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(Exception, match=r"the auto plan splits 0 layers of BuiltMLP(.|\n)*'net.0': 'colwise'"):
        trainer.fit(BuiltMLP())


class GlobalRankData(Data):
    """Training batches sharded over the global ranks (as plain data parallelism shards them, or as data drawn at
    random in each process differs): the two ranks that split each layer get different batches."""

    def train_dataloader(self) -> DataLoader:
        data = token_data()
        return DataLoader(data, batch_size=2, sampler=DistributedSampler(data, shuffle=False))


@pytest.mark.timeout(120)
def test_a_first_training_batch_that_differs_within_the_tensor_group_is_refused() -> None:
    """Without the check the ranks would train on a mix of two batches and report two different losses."""
    strategy = MGPUShardedStrategy(stage=3, tensor_parallel_size=2, start_method="fork")
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    with pytest.raises(Exception, match="tensor-parallel group got different training_step batches") as raised:
        trainer.fit(TPModule(), datamodule=GlobalRankData())
    assert "distributed_sampler_kwargs" in str(raised.value) and "seed_everything" in str(raised.value)


def test_the_lightning_namespace_trains_a_tensor_parallel_model():
    import lightning as L

    from lightning_mgpu.lightning import MGPUShardedStrategy as Strategy
    from lightning_mgpu.lightning.examples import DigitsDataModule, DigitsTransformer

    class MLP(_MLPSteps, L.LightningModule):  # built in __init__, the auto plan cannot split it: refused before launch
        def __init__(self) -> None:
            super().__init__()
            self.net = _normed_mlp()

    refusing = L.Trainer(
        accelerator="cpu", devices=2, strategy=Strategy(stage=3, tensor_parallel_size=2, start_method="fork"),
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"the auto plan splits 0 layers of MLP(.|\n)*tensor_parallel_plan=\{\}"):
        refusing.fit(MLP())
    assert not torch.distributed.is_initialized()  # refused in this process, before any rank started

    class Check(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            assert is_tensor_parallel(pl_module) and trainer.global_step == 2

    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=Strategy(stage=3, tensor_parallel_size=2, start_method="fork"),
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Check()], limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(DigitsTransformer(d_model=32, heads=4, layers=2), DigitsDataModule())

    # "auto+sequence": the logits the step sees are sharded on the vocabulary, its F.cross_entropy runs unchanged
    class LanguageModel(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.logits = TinyLlama().double(), ""

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            logits = self.model(batch[0][:, :-1])
            self.logits = str(getattr(logits, "placements", "whole"))
            return lm_loss_of(logits, batch[0])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(token_data(), batch_size=2)

    class Sharded(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
            assert pl_module.logits == "(Shard(dim=2),)" and trainer.global_step == 2

    strategy = Strategy(stage=3, tensor_parallel_size=2, tensor_parallel_plan="auto+sequence", start_method="fork")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Sharded()],
    )  # fmt: skip
    trainer.fit(LanguageModel())
    # the families the structure pairs (litgpt's GPT among them): the lightning copy of their parity test,
    # tests/integration/test_namespaces.py


def lm_loss_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


# --- tensor parallelism within the pipeline's stages (pipeline 2 x tensor 2) -------------------------------------

PP_CLIP = 0.1


class FourBlocks(TPModule):
    """The tiny Llama with 4 blocks (2 interleaved stages on each of 2 pipeline ranks), biases in every linear layer."""

    def __init__(self) -> None:
        super().__init__(bias=True)
        torch.manual_seed(0)
        self.model = TinyLlama(layers=4, bias=True).double()


class StageRecord(Callback):
    """On every rank: the local size of each parameter at the first optimizer step (another stage's block freed: 0
    elements; a split layer: its shard), and at the end of fit the whole state (a collective of the pipeline and
    the tensor groups), the metrics and the sampler's split; then a consolidated checkpoint where ``save`` is given."""

    def __init__(self, out: Path, save: Optional[Path] = None) -> None:
        self.out, self.save = Path(out), save
        self.local: dict[str, int] = {}

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        self.graphs = _compat.compiled_graph_count()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if not self.local:
            self.local = {n: local_shard(p).numel() for n, p in pl_module.named_parameters()}

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        strategy = trainer.strategy
        if strategy._sharded_settings.checkpoint == "sharded":  # the whole model, not this rank's part for DCP
            state = strategy._sharded.sharding.full_model_state(pl_module)
        else:
            state = strategy.lightning_module_state_dict()
        if self.save is not None:
            trainer.save_checkpoint(self.save)
        self.out.mkdir(parents=True, exist_ok=True)
        record = {
            "state": {k: v.detach().clone() for k, v in state.items()},
            "local": self.local,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "sampler": getattr(trainer.strategy, "distributed_sampler_kwargs", None),
            "split": is_tensor_parallel(pl_module),
            "step": trainer.global_step,
            "ledger": dataclasses.replace(trainer.strategy.comm_stats),
            "graphs": _compat.compiled_graph_count() - self.graphs,  # compiled by torch.compile during fit
        }
        torch.save(record, self.out / f"stage{trainer.global_rank}.pt")


def _fit_stages(
    out: Path,
    strategy: Any,
    devices: int,
    module: TPModule,
    epochs: int = 1,
    save: Optional[Path] = None,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=epochs, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=PP_CLIP, callbacks=[StageRecord(out, save)], **kwargs,
    )  # fmt: skip
    trainer.fit(module, datamodule=Data(), ckpt_path=ckpt_path)
    return [torch.load(out / f"stage{r}.pt", weights_only=False) for r in range(devices)]


def _pipeline_tensor(schedule: str, plan: Any = "auto", compile: bool = False) -> MGPUShardedStrategy:
    return MGPUShardedStrategy(
        pipeline_parallel_size=2, tensor_parallel_size=2, tensor_parallel_plan=plan, pipeline_schedule=schedule,
        pipeline_microbatches=2, compile=compile, start_method="fork",
    )  # fmt: skip


def _resume_on_one_process(_: int, tmp_path: Path, name: str = "pp_tp.ckpt", checkpoint: str = "consolidated") -> None:
    strategy = MGPUShardedStrategy(stage=3, checkpoint=checkpoint)
    _fit_stages(tmp_path / "one", strategy, 1, TPModule(bias=True), epochs=2, save=tmp_path / "one.ckpt",
                accumulate_grad_batches=3, ckpt_path=str(tmp_path / name))  # fmt: skip


def _assert_validated_saved_and_resumed(
    records: list[dict[str, Any]], expected: dict[str, Any], tmp_path: Path, ckpt: str, strategy: Any, data: int
) -> None:
    """After a pipeline x tensor fit of ``data`` data ranks (k = 3): the validation at the end of the epoch ran
    through the stages (the one-process loss of the trained weights); the consolidated checkpoint ``ckpt`` holds
    one process's whole tensors and resumes on one process as the uninterrupted run (its optimizer state gathered
    over the stages, the data shards and the tensor shards); and back, one process's checkpoint resumed by
    ``strategy`` (whole tensors and optimizer state cut into its pieces) continues as that run too."""
    model = TPModule(bias=True).model
    model.load_state_dict({k.removeprefix("model."): v for k, v in expected.items()})
    with torch.no_grad():
        one_process = float(lm_loss(model, indexed_data().tensors[0]))
    assert all(r["metrics"]["val_loss"] == pytest.approx(one_process, rel=1e-12) for r in records)
    saved = torch.load(tmp_path / ckpt, weights_only=False)
    for name, value in expected.items():
        torch.testing.assert_close(saved["state_dict"][name], value, msg=name)
    mp.start_processes(_resume_on_one_process, args=(tmp_path, ckpt), nprocs=1, start_method="fork")
    resumed = torch.load(tmp_path / "one" / "stage0.pt", weights_only=False)
    uninterrupted, _ = reference(TPModule(bias=True), token_data(), data_ranks=[data, 1], accumulate=3, clip=PP_CLIP)
    for name, value in uninterrupted.items():
        torch.testing.assert_close(resumed["state"][name], value, msg=name)
    back = _fit_stages(tmp_path / "back", strategy, len(records), TPModule(bias=True), epochs=3,
                       accumulate_grad_batches=3, ckpt_path=str(tmp_path / "one.ckpt"))  # fmt: skip
    three, _ = reference(TPModule(bias=True), token_data(), data_ranks=[data, 1, data], accumulate=3, clip=PP_CLIP)
    _assert_weights(back, three)


def test_pipeline2_tensor2_equals_one_process_and_its_checkpoint_resumes_on_one_process(tmp_path: Path):
    # pipeline 2 x tensor 2 (data 1), 1F1B, k = 3, clipping that bites (the norm over both stages and both tensor
    # shards, the replicated norms and row-wise biases counted once), the auto plan, biases in every linear layer
    records = _fit_stages(tmp_path / "pp", _pipeline_tensor("1f1b"), WORLD, TPModule(bias=True),
                          save=tmp_path / "pp_tp.ckpt", accumulate_grad_batches=3)  # fmt: skip
    expected, norms = reference(TPModule(bias=True), token_data(), data_ranks=[1], accumulate=3, clip=PP_CLIP)
    assert records[0]["step"] == 4 and min(norms) > 2 * PP_CLIP  # every step is clipped
    for record in records:
        assert set(record["state"]) == set(expected)
        for name, value in expected.items():
            torch.testing.assert_close(record["state"][name], value, msg=name)
    # negative control: without the clipping the weights differ
    assert _differs(records, reference(TPModule(bias=True), token_data(), data_ranks=[1], accumulate=3)[0])
    # every rank sees the same batches; each holds its own stage's blocks only, their split layers as halves
    assert [r["sampler"] for r in records] == [{"num_replicas": 1, "rank": 0}] * WORLD
    assert all(r["split"] for r in records)
    for rank, record in enumerate(records):
        own, other = (0, 1) if rank < 2 else (1, 0)  # ranks 0, 1: stage 0 (tensor 0, 1); ranks 2, 3: stage 1
        local = record["local"]
        assert local[f"model.layers.{other}.attention.wq.weight"] == 0
        assert local[f"model.layers.{other}.attention_norm.weight"] == 0
        assert local[f"model.layers.{own}.attention.wq.weight"] == 8 * 8 // 2  # colwise: half the rows
        assert local[f"model.layers.{own}.feed_forward.w2.weight"] == 8 * 16 // 2  # rowwise: half the columns
        assert local[f"model.layers.{own}.attention_norm.weight"] == 8  # whole on each tensor rank
        assert local["model.tok_embeddings.weight"] == VOCAB * 8
    _assert_validated_saved_and_resumed(records, expected, tmp_path, "pp_tp.ckpt", _pipeline_tensor("1f1b"), 1)


# (schedule, k, plan, devices, compile): GPipe with a plan of yours (the MLPs split, the attention whole);
# interleaved 1F1B with 4 blocks (2 stages per rank); pipeline 2 x data 2 x tensor 2 on 8 ranks; each stage's split
# blocks compiled (inductor)
MLP_PLAN = {
    "model.layers.*.feed_forward.w1": "colwise",
    "model.layers.*.feed_forward.w3": "colwise",
    "model.layers.*.feed_forward.w2": "rowwise",
}
PIPELINE_TENSOR_MATRIX = [
    ("gpipe", 1, MLP_PLAN, WORLD, False),
    ("interleaved_1f1b", 1, "auto", WORLD, False),
    ("1f1b", 3, "auto", 2 * WORLD, False),
    ("1f1b", 1, "auto", WORLD, True),
]


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "accumulate", "plan", "devices", "compile"), PIPELINE_TENSOR_MATRIX)
def test_pipeline_tensor_matrix_equals_one_process(
    tmp_path: Path, schedule: str, accumulate: int, plan: Any, devices: int, compile: bool
) -> None:
    module = FourBlocks() if schedule == "interleaved_1f1b" else TPModule(bias=True)
    strategy = _pipeline_tensor(schedule, plan, compile)
    records = _fit_stages(tmp_path, strategy, devices, module, accumulate_grad_batches=accumulate)
    data = devices // WORLD
    fresh = FourBlocks() if schedule == "interleaved_1f1b" else TPModule(bias=True)
    expected, norms = reference(fresh, token_data(), data_ranks=[data], accumulate=accumulate, clip=PP_CLIP)
    assert min(norms) > PP_CLIP
    assert all(r["split"] for r in records)
    assert [r["sampler"]["rank"] for r in records] == [(rank // 2) % data for rank in range(devices)]
    for record in records:
        for name, value in expected.items():
            torch.testing.assert_close(record["state"][name], value, msg=name)


class DistributedBoundary(pl.LightningModule):
    """Two blocks of two linear layers; the plan leaves the first block's output a ``DTensor``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)) for _ in range(2)
        ).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch[0]
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 8, dtype=torch.float64)), batch_size=2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_plan_leaving_a_dtensor_at_a_stage_boundary_is_refused_naming_the_layer() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"blocks.*.0": ColwiseParallel(), "blocks.*.1": RowwiseParallel(use_local_output=False)}
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=_pipeline_tensor("gpipe", plan), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(Exception, match=r"The output of 'blocks.0' at a pipeline stage boundary is a DTensor"):
        trainer.fit(DistributedBoundary())


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])  # 3: each stage's split blocks sharded over a data dimension of one
def test_the_lightning_namespace_trains_pipeline_stages_split_by_the_tensor_plan(tmp_path: Path, stage: int) -> None:
    import lightning as L

    from lightning_mgpu.lightning import MGPUShardedStrategy as Strategy

    class Llama(L.LightningModule):  # TPModule(bias=True) written against `lightning`
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyLlama(bias=True).double()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return lm_loss(self.model, batch[0])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(token_data(), batch_size=2)

    class Save(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
            state = trainer.strategy.lightning_module_state_dict()  # a collective: on every rank
            if trainer.global_rank == 0:
                sharded = bool(
                    trainer.strategy._sharded.steps.pipeline.held.sharded_stages
                )  # its stages FSDP2 units (stage=3)
                record = {"state": state, "split": is_tensor_parallel(pl_module), "sharded": sharded}
                torch.save(record, tmp_path / "state.pt")

    strategy = Strategy(
        stage=stage, pipeline_parallel_size=2, tensor_parallel_size=2, pipeline_microbatches=2, start_method="fork"
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Save()],
    )  # fmt: skip
    trainer.fit(Llama())
    record = torch.load(tmp_path / "state.pt", weights_only=False)
    expected, _ = reference(TPModule(bias=True), token_data(), data_ranks=[1], limit=2)
    assert record["split"] and record["sharded"] == (stage == 3)
    for name, value in expected.items():
        torch.testing.assert_close(record["state"][name], value, msg=name)


# --- ZeRO-3 and tensor parallelism within the pipeline's stages (pipeline 2 x data 2 x tensor 2) -----------------


def _zero3_pipeline_tensor(checkpoint: str = "consolidated") -> MGPUShardedStrategy:
    return MGPUShardedStrategy(
        stage=3, pipeline_parallel_size=2, tensor_parallel_size=2, pipeline_microbatches=2, checkpoint=checkpoint,
        start_method="fork",
    )  # fmt: skip


class StridedShardCountedAsCopies(PipelineBackend):
    """Negative control: the clipping norm takes FSDP2's strided shard over the data dimension (the placement it
    gives a weight the plan splits) for copies, as ``Placement.is_shard()`` does: a split weight's shards weigh
    ``1 / D``, not 1."""

    def norm_clipping(self, group: Any, ledger: Any) -> Any:
        clipping = super().norm_clipping(group, ledger)
        ranks = self.dims.data_parallel * self.dims.tensor  # the stage's data x tensor ranks

        def total_norm(grads: Any) -> torch.Tensor:
            squared = torch.zeros((), dtype=torch.float64)
            for g in grads:
                shards = 1
                if isinstance(g, DTensor):
                    shards = math.prod(g.device_mesh.size(d) for d, p in enumerate(g.placements) if p.is_shard())
                squared += local_shard(g).double().pow(2).sum() / max(ranks // shards, 1)
            torch.distributed.all_reduce(squared)
            return squared.sqrt()

        clipping.total_norm = total_norm
        return clipping


class StridedShardMiscounted(MGPUShardedStrategy):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        assert isinstance(self._sharded.steps, PipelineSteps)
        p = self._sharded.steps.pipeline
        self._sharded.steps.pipeline = self._sharded.sharding = StridedShardCountedAsCopies(
            p.size, "1f1b", 2, "auto", shard_stage=3
        )


@pytest.mark.slow
def test_zero3_pipeline2_data2_tensor2_equals_one_process_and_its_checkpoint_resumes_both_ways(tmp_path: Path):
    # 8 processes (the smallest layout where ZeRO-3 shards a tensor-split stage: 2 data ranks), 1F1B, k = 3, the auto
    # plan, clipping that bites: the norm counts each gradient element once (a block's weight sharded over data and
    # split by the plan: distinct on each rank; a norm or row-wise bias sharded over data only: on both tensor
    # ranks; the weights outside the blocks: on the stage's 4 ranks, on the first stage only)
    world = 2 * WORLD
    records = _fit_stages(tmp_path / "pp", _zero3_pipeline_tensor(), world, TPModule(bias=True),
                          save=tmp_path / "pp.ckpt", accumulate_grad_batches=3)  # fmt: skip
    expected, norms = reference(TPModule(bias=True), token_data(), data_ranks=[2], accumulate=3, clip=PP_CLIP)
    assert records[0]["step"] == len(norms) == 2 and min(norms) > 2 * PP_CLIP  # every step is clipped
    _assert_weights(records, expected)
    # negative control: without the clipping the weights differ
    assert _differs(records, reference(TPModule(bias=True), token_data(), data_ranks=[2], accumulate=3)[0])
    assert all(r["split"] for r in records)
    assert [r["sampler"] for r in records] == [{"num_replicas": 2, "rank": (rank // 2) % 2} for rank in range(world)]
    for rank, record in enumerate(records):
        own, other = (0, 1) if rank < WORLD else (1, 0)  # ranks 0-3: stage 0 (data x tensor); ranks 4-7: stage 1
        local = record["local"]
        assert local[f"model.layers.{other}.attention.wq.weight"] == 0  # another stage's block: freed
        assert local[f"model.layers.{other}.attention_norm.weight"] == 0
        assert local[f"model.layers.{own}.attention.wq.weight"] == 8 * 8 // 4  # split by the plan, then over data
        assert local[f"model.layers.{own}.feed_forward.w2.weight"] == 8 * 16 // 4  # row-wise, then over data
        assert local[f"model.layers.{own}.attention_norm.weight"] == 8 // 2  # whole in the plan, sharded over data
        assert local["model.tok_embeddings.weight"] == VOCAB * 8  # outside the blocks: whole
        # one reduce-scatter per optimizer step of this rank's tensor shards of its stage's whole gradients (float64)
        handed = sum(2 * n for name, n in local.items() if name.startswith(f"model.layers.{own}."))
        assert (record["ledger"].sync_rounds, record["ledger"].round_bytes) == (2, 2 * 8 * handed)
    _assert_validated_saved_and_resumed(records, expected, tmp_path, "pp.ckpt", _zero3_pipeline_tensor(), 2)
    # negative control: a norm that counts the split weights' shards over data as copies fails the comparison
    miscounted = StridedShardMiscounted(
        stage=3, pipeline_parallel_size=2, tensor_parallel_size=2, pipeline_microbatches=2, start_method="fork"
    )
    wrong = _fit_stages(tmp_path / "wrong", miscounted, world, TPModule(bias=True), accumulate_grad_batches=3)
    assert all(r["split"] for r in wrong) and wrong[0]["local"] == records[0]["local"]  # laid out as the right one
    assert _differs(wrong, expected)


@pytest.mark.slow
def test_zero3_pipeline2_data2_tensor2_writes_a_sharded_checkpoint_that_resumes_there_and_in_one_process(
    tmp_path: Path,
) -> None:
    # checkpoint="sharded" (torch's distributed checkpoint, a directory): each rank writes its data x tensor shards
    # of its stage's blocks (2-D DTensors) and the weights outside the blocks; the directory resumes at pipeline 2 x
    # data 2 x tensor 2 and in one process (MGPUShardedStrategy(stage=3, checkpoint="sharded"), re-sliced on load),
    # each continuing as the uninterrupted one-process run (k = 3, clipping that bites)
    world = 2 * WORLD
    saved = tmp_path / "pp.ckpt"
    records = _fit_stages(tmp_path / "pp", _zero3_pipeline_tensor("sharded"), world, TPModule(bias=True),
                          save=saved, accumulate_grad_batches=3)  # fmt: skip
    expected, _ = reference(TPModule(bias=True), token_data(), data_ranks=[2], accumulate=3, clip=PP_CLIP)
    _assert_weights(records, expected)
    assert saved.is_dir() and len(list(saved.glob("*.distcp"))) == world
    again = _fit_stages(tmp_path / "again", _zero3_pipeline_tensor("sharded"), world, TPModule(bias=True), epochs=2,
                        accumulate_grad_batches=3, ckpt_path=str(saved))  # fmt: skip
    _assert_weights(again, reference(TPModule(bias=True), token_data(), [2, 2], accumulate=3, clip=PP_CLIP)[0])
    mp.start_processes(_resume_on_one_process, args=(tmp_path, "pp.ckpt", "sharded"), nprocs=1, start_method="fork")
    one = torch.load(tmp_path / "one" / "stage0.pt", weights_only=False)
    _assert_weights([one], reference(TPModule(bias=True), token_data(), [2, 1], accumulate=3, clip=PP_CLIP)[0])


@pytest.mark.parametrize(
    ("schedule", "devices", "accumulate", "compile"),
    [
        # pipeline 2 x tensor 2 on one data rank (4 processes): ZeRO-3's units over a data dimension of 1, each
        # block's weights 2-D DTensors of the (data, tensor) mesh, shards of one
        ("gpipe", WORLD, 3, False),
        # pipeline 2 x data 2 x tensor 2, 4 blocks, 2 stages per rank (torch's schedule gathers and reshards each)
        pytest.param("interleaved_1f1b", 2 * WORLD, 1, False, marks=pytest.mark.slow),
        # each stage's split and sharded blocks compiled (inductor)
        pytest.param("1f1b", WORLD, 1, True, marks=pytest.mark.slow),
    ],
)
def test_zero3_pipeline_tensor_schedules_equal_one_process(
    tmp_path: Path, schedule: str, devices: int, accumulate: int, compile: bool
) -> None:
    strategy = MGPUShardedStrategy(
        stage=3, pipeline_parallel_size=2, tensor_parallel_size=2, pipeline_microbatches=2,
        pipeline_schedule=schedule, compile=compile, start_method="fork",
    )  # fmt: skip
    make = FourBlocks if schedule == "interleaved_1f1b" else lambda: TPModule(bias=True)
    records = _fit_stages(tmp_path, strategy, devices, make(), accumulate_grad_batches=accumulate)
    data = [devices // WORLD]
    expected, norms = reference(make(), token_data(), data_ranks=data, accumulate=accumulate, clip=PP_CLIP)
    assert records[0]["step"] == len(norms) and min(norms) > 2 * PP_CLIP  # every step is clipped
    assert all(r["split"] for r in records)
    assert all((r["graphs"] > 0) == compile for r in records)  # torch.compile compiled graphs on every rank
    _assert_weights(records, expected)
    assert _differs(records, reference(make(), token_data(), data_ranks=data, accumulate=accumulate)[0])


@pytest.mark.slow
def test_hsdp_pipeline2_tensor2_equals_one_process(tmp_path: Path):
    # 8 processes: pipeline 2 x HSDP (2 replicas x 1 shard) x tensor 2, 1F1B, k = 3, clipping that bites every step:
    # the norm weighs each gradient by 1 / (the stage's ranks holding its values), both replicas of a shard included
    world = 2 * WORLD
    strategy = MGPUShardedStrategy(
        stage=3, mesh="hybrid", shard_size=1, pipeline_parallel_size=2, tensor_parallel_size=2,
        pipeline_microbatches=2, start_method="fork",
    )  # fmt: skip
    records = _fit_stages(tmp_path / "pp", strategy, world, TPModule(bias=True), accumulate_grad_batches=3)
    expected, norms = reference(TPModule(bias=True), token_data(), data_ranks=[2], accumulate=3, clip=PP_CLIP)
    assert records[0]["step"] == len(norms) == 2 and min(norms) > 2 * PP_CLIP  # every step is clipped
    _assert_weights(records, expected)
    assert _differs(records, reference(TPModule(bias=True), token_data(), data_ranks=[2], accumulate=3)[0])
    for rank, record in enumerate(records):  # shard groups of 1: each rank holds its tensor split whole
        own = 0 if rank < WORLD else 1
        assert record["local"][f"model.layers.{own}.attention.wq.weight"] == 8 * 8 // 2
        assert record["local"][f"model.layers.{1 - own}.attention.wq.weight"] == 0  # the other stage's: freed
