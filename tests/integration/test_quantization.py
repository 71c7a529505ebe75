"""A 4-bit frozen base (``lightning_mgpu.quantize_frozen``: torchao's NF4) with LoRA adapters, under the data-parallel
layouts, on CPU processes: a ``peft`` LoRA on a transformers Llama from a tiny random config, float64.

Each case trains 2 epochs of 2 optimizer steps on a global batch of 8 and proves, in one run: the adapters equal one
process with the same 4-bit base and the global batch (``assert_close`` defaults; the dequantised base is the same
on every layout); the base unchanged on every rank, still 4-bit there, and each rank holding its share of the packed
bytes (all of them under DDP and where a shard group has one rank, 1/shards under ZeRO-3 and HSDP). The ZeRO-3 case
and the DDP case also write a checkpoint at the end of epoch 1 (an adapter-only sharded directory; a whole file with
the packed base) and resume it on one process, ending with the uninterrupted run's weights.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch.utils.data import TensorDataset

from lightning_mgpu import MGPUDDPStrategy, MGPUShardedStrategy, quantize_frozen
from lightning_mgpu.parts.trainable_state import KEY
from lightning_mgpu.quantization import dequantized, is_nf4
from tests.helpers import fit
from tests.scripts import Scripts

VOCAB, SEQ, SAMPLES, GLOBAL, EPOCHS = 64, 8, 16, 8, 2
#: 16 scaler blocks of 64 x 16 weights per 64 x 64 layer: every frozen weight splits into whole blocks over 4 ranks
SCALER_BLOCK = 16


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """One CPU thread in this process around each case. A fork launch inherits OpenMP's state, and a rank whose first
    parallel kernel (the Llama's rotary cosines) uses a team the parent had started hangs in it: GNU OpenMP is not
    fork-safe. The runs in this process (the one-process reference, the resumes) also leave a process group behind."""
    torch.set_num_threads(1)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    torch.set_num_threads(1)


def tokens() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    return TensorDataset(ids, ids.clone())


class QLoRALlama(pl.LightningModule):
    """The way a QLoRA tutorial builds it: a pretrained Llama (here a tiny random one), LoRA adapters from peft on
    the attention and MLP projections, then the frozen linear weights packed in 4 bits."""

    def __init__(self) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
        )
        base = LlamaForCausalLM(config).double()
        torch.manual_seed(100)
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
        self.model = get_peft_model(base, lora)  # the base frozen, the adapters trainable
        for name, p in self.model.named_parameters():
            if "lora_B" in name:  # a random start: every adapter matrix gets a gradient from the first step
                p.data.normal_(0.0, 0.05)
        self.packed = quantize_frozen(self.model, scaler_block_size=SCALER_BLOCK)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, _ = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)


def _packed_bytes(tensor: torch.Tensor) -> int:
    return sum(
        getattr(tensor, name).numel() * getattr(tensor, name).element_size()
        for name in ("quantized_data", "quantized_scalers", "quantization_factor")
    )


class Probe(Callback):
    """Per rank at the end of fit: how many weights are 4-bit there and the packed bytes this rank holds."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        local = [p.to_local() if hasattr(p, "to_local") else p for p in pl_module.parameters()]
        packed = [t for t in local if is_nf4(t)]
        record = {"nf4": len(packed), "bytes": sum(_packed_bytes(t) for t in packed)}
        torch.save(record, self.out / f"probe{trainer.global_rank}.pt")


@functools.cache
def one_process(batch: int = GLOBAL) -> dict[str, torch.Tensor]:
    """The adapters after the same training in one process (Lightning's own single-device strategy)."""
    state = fit(QLoRALlama(), "auto", Path(tempfile.mkdtemp()), dataset=tokens(), batch_size=batch, devices=1)
    return {k: v for k, v in state[0]["state"].items() if "lora_" in k}


@functools.cache
def as_built() -> tuple[dict[str, torch.Tensor], int]:
    """The dequantised base as built, and the bytes of all its packed weights."""
    model = QLoRALlama()
    state = {f"{k}": dequantized(v) for k, v in model.state_dict().items() if is_nf4(v)}
    return state, sum(_packed_bytes(p) for p in model.parameters() if is_nf4(p))


#: id -> (strategy factory, processes, ranks sharing one copy of the base, the strategy resuming on one process)
CASES: dict[str, tuple[Callable[[], Any], int, int, Optional[Callable[[], Any]]]] = {
    # a full checkpoint file (checkpoint_params="all", the default): the packed base in it, loaded back
    "ddp": (lambda: MGPUDDPStrategy(start_method="fork"), 2, 1, MGPUDDPStrategy),
    # an adapter-only sharded directory: the base's fingerprint in place of the base
    "zero3": (
        lambda: MGPUShardedStrategy(stage=3, start_method="fork", checkpoint="sharded", checkpoint_params="trainable"),
        2,
        2,
        lambda: MGPUShardedStrategy(stage=3, checkpoint="sharded", checkpoint_params="trainable"),
    ),
    # ZeRO-1: DDP under the optimizer's sharding, the base whole on each rank
    "zero1": (lambda: MGPUShardedStrategy(stage=1, start_method="fork"), 2, 1, None),
    # the shards of the base, the adapters and their optimizer state in host memory
    "zero3-offload": (lambda: MGPUShardedStrategy(stage=3, offload="cpu", start_method="fork"), 2, 2, None),
    "zero3-4": (lambda: MGPUShardedStrategy(stage=3, start_method="fork"), 4, 4, None),
    "hsdp-4": (lambda: MGPUShardedStrategy(stage=3, mesh="hybrid", shard_size=2, start_method="fork"), 4, 2, None),
    # one rank per shard group: the base stays outside FSDP2, whole and 4-bit on each rank
    "hsdp-whole": (lambda: MGPUShardedStrategy(stage=3, mesh="hybrid", shard_size=1, start_method="fork"), 2, 1, None),
}
SLOW = {"zero1", "zero3-offload", "zero3-4", "hsdp-4", "hsdp-whole"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def test_adapters_over_a_4bit_base_equal_one_process_and_each_rank_holds_its_share(case: str, tmp_path: Path) -> None:
    make_strategy, world, shards, resume = CASES[case]
    model = QLoRALlama()
    assert len(model.packed) == 15  # 7 projections in each of 2 layers, and the output head
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpts", filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    ranks = fit(
        model,
        make_strategy(),
        tmp_path / "run",
        dataset=tokens(),
        batch_size=GLOBAL // world,
        devices=world,
        max_epochs=EPOCHS,
        callbacks=[Probe(tmp_path), *([saver] if resume else [])],
        enable_checkpointing=resume is not None,
    )
    reference, (base, total_bytes) = one_process(), as_built()
    for rank in ranks:
        assert rank["global_step"] == EPOCHS * SAMPLES // GLOBAL
        torch.testing.assert_close({k: rank["state"][k] for k in reference}, reference)  # the adapters: parity
        for name, values in base.items():  # the 4-bit base: bit for bit as built
            assert torch.equal(rank["state"][name], values), name
    for r in range(world):
        probe = torch.load(tmp_path / f"probe{r}.pt", weights_only=True)
        assert probe["nf4"] == 15  # still 4-bit on every rank
        assert probe["bytes"] == total_bytes // shards  # each rank's share of the packed bytes
    if resume is None:
        return
    first = tmp_path / "ckpts" / "epoch=0.ckpt"
    if first.is_dir():  # adapter-only: the base's fingerprint, not the base
        assert set(base) <= set(torch.load(first / "meta.pt", weights_only=False)[KEY]["frozen"])
    else:  # the whole model: the base as its packed 4-bit bytes
        saved = torch.load(first, weights_only=True)["state_dict"]
        assert all(is_nf4(saved[name]) for name in base)
        _exports_merged_into_the_dequantised_base(tmp_path / "ckpts" / f"epoch={EPOCHS - 1}.ckpt", ranks[0]["state"])
    # on one process, not forked: a fork after the parent ran torch's thread pool may hang in the child's first
    # parallel kernel (OpenMP is not fork-safe)
    resumed = fit(
        QLoRALlama(),
        resume(),
        tmp_path / "resumed",
        dataset=tokens(),
        batch_size=GLOBAL,
        devices=1,
        max_epochs=EPOCHS,
        ckpt_path=str(first),
    )
    torch.testing.assert_close(resumed[0]["state"], ranks[0]["state"])  # continue == uninterrupted


def _exports_merged_into_the_dequantised_base(checkpoint: Path, trained: dict[str, torch.Tensor]) -> None:
    """``lightning-mgpu export --dtype bfloat16`` of the last whole checkpoint, run as a user runs it (a fresh
    interpreter that has not imported torchao: weights-only loading allows torchao's tensor once its module is
    imported) writes each adapted weight as the dequantised base plus ``scaling * B @ A`` (peft's merge), every
    weight in bfloat16."""
    out = checkpoint.parent / "merged.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_mgpu", "export", str(checkpoint), "--format", "torch", "--dtype", "bfloat16",
         str(out)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = torch.load(out, weights_only=True)
    root, scaling = "model.base_model.model.", 8 / 4
    expected = {}
    for name, value in trained.items():
        if "lora_" in name:
            continue
        if name.endswith("base_layer.weight"):
            a, b = (trained[name.replace("base_layer", f"lora_{m}.default")] for m in "AB")
            value = value + (b @ a) * scaling
        expected[name.removeprefix(root).replace(".base_layer", "")] = value.to(torch.bfloat16)
    assert set(exported) == set(expected)
    torch.testing.assert_close(exported, expected)
    q = "model.layers.0.self_attn.q_proj.weight"  # negative control: the base alone is told apart
    assert not torch.allclose(exported[q], trained[f"{root}{q.replace('.weight', '.base_layer.weight')}"].bfloat16())


def test_the_parity_check_sees_a_different_global_batch() -> None:
    """Negative control: one process on the per-rank batch (4, not 8) does not pass the comparison above."""
    with pytest.raises(AssertionError):
        torch.testing.assert_close(one_process(GLOBAL // 2), one_process())


#: id -> (strategy factory, processes, ranks sharing one copy of the base, micro-batches per optimizer step)
COMPOSED: dict[str, tuple[Callable[[], Any], int, int, int]] = {
    # ZeRO-2 (mgpu_sharded: FSDP2 without resharding after the forward) shards the 4-bit base by ZeRO-3's path
    "zero2": (lambda: MGPUShardedStrategy(stage=2, start_method="fork"), 2, 2, 1),
    # everything at once: the 4-bit base and the adapters offloaded, activation checkpointing, accumulation
    "zero3-offload-ac-accumulate": (
        lambda: MGPUShardedStrategy(
            stage=3, offload="cpu", activation_checkpointing="LlamaDecoderLayer", start_method="fork"
        ),
        2,
        2,
        2,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(COMPOSED))
def test_a_4bit_base_under_zero2_and_offload_with_checkpointing_and_accumulation_equals_one_process(
    case: str, tmp_path: Path
) -> None:
    """ZeRO-2, and ZeRO-3 offloaded with activation checkpointing of each decoder layer and 2 micro-batches per step:
    the adapters equal one process on the global batch (the control: ``test_the_parity_check_sees_a_different_global_
    batch``), the base is bit for bit as built and still 4-bit on every rank, each rank holds its share of the packed
    bytes."""
    make_strategy, world, shards, accumulate = COMPOSED[case]
    ranks = fit(
        QLoRALlama(),
        make_strategy(),
        tmp_path / "run",
        dataset=tokens(),
        batch_size=GLOBAL // (world * accumulate),
        accumulate=accumulate,
        devices=world,
        max_epochs=EPOCHS,
        callbacks=[Probe(tmp_path)],
    )
    reference, (base, total_bytes) = one_process(), as_built()
    for rank in ranks:
        assert rank["global_step"] == EPOCHS * SAMPLES // GLOBAL
        torch.testing.assert_close({k: rank["state"][k] for k in reference}, reference)
        for name, values in base.items():
            assert torch.equal(rank["state"][name], values), name
    for r in range(world):
        probe = torch.load(tmp_path / f"probe{r}.pt", weights_only=True)
        assert probe["nf4"] == 15
        assert probe["bytes"] == total_bytes // shards


@pytest.mark.slow
def test_an_adapter_only_checkpoint_of_a_4bit_base_exports_as_a_peft_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ZeRO-3 on 2 processes writes an adapter-only sharded directory of the 4-bit base; ``lightning-mgpu export
    --format hf --adapters peft`` writes the adapter folder alone, which peft attaches to a base of the same
    configuration with the trained adapters exactly. A merged export of it is refused (it holds no base)."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from lightning_mgpu.export import main as export_main

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpts", filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    strategy = MGPUShardedStrategy(stage=3, start_method="fork", checkpoint="sharded", checkpoint_params="trainable")
    ranks = fit(
        QLoRALlama(), strategy, tmp_path / "run", dataset=tokens(), batch_size=GLOBAL // 2, devices=2, max_epochs=1,
        callbacks=[saver], enable_checkpointing=True,
    )  # fmt: skip
    checkpoint = tmp_path / "ckpts" / "epoch=0.ckpt"
    assert checkpoint.is_dir()
    assert export_main([str(checkpoint), "--format", "hf", str(tmp_path / "adapter"), "--adapters", "peft"]) == 0
    built: Any = QLoRALlama().model  # a base of the same configuration (its adapters replaced by the folder's)
    base = LlamaForCausalLM(built.config).double()
    attached = PeftModel.from_pretrained(base, tmp_path / "adapter")
    trained = {k.removeprefix("model."): v for k, v in ranks[0]["state"].items() if ".lora_" in k}
    loaded = {k: v for k, v in attached.state_dict().items() if ".lora_" in k}
    assert trained and sorted(loaded) == sorted(trained)
    torch.testing.assert_close(loaded, trained, rtol=0, atol=0)
    with pytest.raises(SystemExit) as exited:  # negative control: a merged export needs the base, not in it
        export_main([str(checkpoint), "--format", "hf", str(tmp_path / "merged")])
    assert exited.value.code == 2 and "--adapters peft" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# a base loaded in 4 bits by bitsandbytes (the Hugging Face QLoRA tutorial's path): bitsandbytes_qlora.py, run as a
# user's script with bitsandbytes on its path (kept out of the test environment: peft imports it whenever it can)
# ---------------------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
#: where the Makefile installs bitsandbytes (``BITSANDBYTES``), outside the test environment
BITSANDBYTES_SITE = ROOT / ".bitsandbytes"


def test_a_bitsandbytes_4bit_base_trains_under_mgpu_ddp_as_one_process_and_is_refused_where_fsdp2_shards(
    tmp_path: Path, scripts: Scripts
) -> None:
    """A tiny GPT-2 loaded in 4 bits by bitsandbytes with peft's LoRA: 2 processes of ``mgpu_ddp`` (the base whole
    on each rank) train the adapters as one process on the global batch (``assert_close``'s defaults for float32,
    the most bitsandbytes' CPU path allows); the negative control, one process on the per-rank batch, does not. ZeRO-2
    and HSDP (FSDP2) are refused before any rank starts, naming the weight and the fixes: FSDP2 would split the
    packed bytes without bitsandbytes' quantization state. ``mgpu_auto`` does not plan it and takes ``mgpu_ddp``,
    saying why."""
    assert (BITSANDBYTES_SITE / "bitsandbytes").is_dir(), "run `make setup`: it installs bitsandbytes there"
    script = tmp_path / "bitsandbytes_qlora.py"  # run from here: its output is written beside it
    shutil.copy(Path(__file__).with_name(script.name), script)
    run = scripts.run(script, timeout=400, args=(str(tmp_path), str(BITSANDBYTES_SITE), str(ROOT)))
    assert run.returncode == 0, run.stderr[-3000:]
    base = json.loads((tmp_path / "base.json").read_text())
    assert len(base["quantized"]) == 8 and base["kinds"] == ["Params4bit"]  # c_attn and c_fc of 2 layers, 2 each
    start, one = (torch.load(tmp_path / f"{name}.pt", weights_only=True) for name in ("start", "one"))
    assert one and all(not torch.equal(one[k], start[k]) for k in one)  # every adapter matrix trained
    for rank in range(2):
        torch.testing.assert_close(torch.load(tmp_path / f"ddp{rank}.pt", weights_only=True), one)
    with pytest.raises(AssertionError):  # negative control: the per-rank batch alone differs
        torch.testing.assert_close(torch.load(tmp_path / "half.pt", weights_only=True), one)
    refused = json.loads((tmp_path / "refused.json").read_text())
    for layout, stage in (("zero2", 2), ("hsdp", 3)):
        assert refused[layout] is not None, f"{layout} trained a bitsandbytes base"
        assert (
            f"is quantized by bitsandbytes (Params4bit; 8 such weights), and stage={stage} shards it"
            in (refused[layout])
        )
        assert "'mgpu_ddp' or 'mgpu_zero1'" in refused[layout] and "quantize_frozen" in refused[layout]
    auto = json.loads((tmp_path / "auto.json").read_text())  # no plan for it: mgpu_ddp, saying why
    assert auto["strategy"] == "mgpu_ddp", auto
    assert (
        "mgpu_auto chose mgpu_ddp without a memory plan: BitsAndBytesQLoRA has weights quantized by bitsandbytes"
        in (auto["reason"])
    )
