"""``lightning-mgpu export`` on checkpoints written by 2 processes: a transformers GPT-2 (tiny random config,
float64) trained with the EMA callback under ZeRO-3, saved as a sharded directory and as one file; the exported
folder loads with ``from_pretrained`` to the trained weights (or the average, ``--ema``) bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_mgpu import EMA, MGPUShardedStrategy
from lightning_mgpu.export import HF_MODELS_KEY, export_checkpoint, main
from tests.corpus import HFGPT2, token_data
from tests.helpers import fit

PREFIX = "model."


class SaveAtEnd(pl.Callback):
    """Saves ``trainer.save_checkpoint(path)`` at the end of fit and records the whole EMA average (rank 0)."""

    def __init__(self, path: str, ema: EMA, out: Path) -> None:
        self.path, self.ema, self.out = path, ema, out

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        trainer.save_checkpoint(self.path)
        from torch.distributed.tensor import DTensor

        params = dict(pl_module.named_parameters())
        average = {}
        for name, local in self.ema._ema.items():
            p = params[name]
            if isinstance(p, DTensor):
                spread = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                local = spread.full_tensor()
            average[name] = local.clone()
        if trainer.is_global_zero:
            torch.save(average, self.out / "average.pt")


#: label -> the strategy that writes the checkpoint (a sharded directory, or one file)
WRITERS: dict[str, Any] = {
    "zero3_sharded_dir": lambda: MGPUShardedStrategy(stage=3, checkpoint="sharded", start_method="fork"),
    "hsdp_sharded_dir": lambda: MGPUShardedStrategy(
        stage=3, mesh="hybrid", shard_size=1, checkpoint="sharded", start_method="fork"
    ),
    "zero3_one_file": lambda: MGPUShardedStrategy(stage=3, checkpoint="consolidated", start_method="fork"),
    "ddp_one_file": lambda: "mgpu_ddp_fork",
}


def _train(tmp: Path, label: str) -> tuple[str, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    out = tmp / label
    out.mkdir()
    ema = EMA(decay=0.8)
    path = str(out / "saved.ckpt")
    records = fit(
        HFGPT2().double(), WRITERS[label](), out,
        dataset=token_data(16), batch_size=2, max_epochs=1, callbacks=[ema, SaveAtEnd(path, ema, out)],
    )  # fmt: skip
    return path, records[0]["state"], torch.load(out / "average.pt", weights_only=True)


def _stripped(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len(PREFIX) :]: v for k, v in state.items() if k.startswith(PREFIX)}


def _loaded(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert model.lm_head.weight is model.transformer.wte.weight  # tied again: both names held the same values
    return model.state_dict()


def test_export_sharded_and_one_file_checkpoints_to_from_pretrained_bit_for_bit(tmp_path: Path) -> None:
    from safetensors import safe_open

    for layout in WRITERS:
        path, trained, average = _train(tmp_path, layout)
        assert Path(path).is_dir() == layout.endswith("_dir")
        expected = _stripped(trained)
        # the function: the trained weights
        folder = export_checkpoint(path, tmp_path / f"hf_{layout}", format="hf")
        loaded = _loaded(folder)
        assert {k: v for k, v in loaded.items() if k in expected} == loaded  # nothing the checkpoint lacks
        torch.testing.assert_close(loaded, {k: expected[k] for k in loaded}, rtol=0, atol=0)
        assert loaded["lm_head.weight"].dtype == torch.float64
        # the command: the EMA average in place of the trained weights (frozen tensors and buffers as saved)
        assert main([path, "--format", "hf", str(tmp_path / f"ema_{layout}"), "--ema"]) == 0
        ema_loaded = _loaded(tmp_path / f"ema_{layout}")
        with_average = {**expected, **_stripped(average)}
        # tied: GPT-2's output layer is its input embedding, averaged once and exported under both names
        assert "lm_head.weight" not in _stripped(average)
        with_average["lm_head.weight"] = with_average["transformer.wte.weight"]
        torch.testing.assert_close(ema_loaded, {k: with_average[k] for k in ema_loaded}, rtol=0, atol=0)
        assert not torch.equal(ema_loaded["transformer.h.0.mlp.c_fc.weight"], loaded["transformer.h.0.mlp.c_fc.weight"])
        # the safetensors file holds the model's own names, every tensor of the checkpoint's model
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            assert sorted(f.keys()) == sorted(expected)
    # one torch.save file, through the console command's entry (`lightning-mgpu export ...`) in this process: it
    # starts no Trainer (the command in a fresh interpreter, as a user runs it: the 4-bit base's merged export);
    # imported here: the command needs jsonargparse, which the compatibility tiers' environments leave out
    from lightning_mgpu.cli import main as cli_main

    single = tmp_path / "weights.pt"
    assert cli_main(["export", path, "--format", "torch", str(single)]) == 0
    torch.testing.assert_close(torch.load(single, weights_only=True), expected, rtol=0, atol=0)
    assert HF_MODELS_KEY in torch.load(path, weights_only=True, mmap=True)


class LoraGPT2(HFGPT2):
    """The GPT-2 of the corpus with peft LoRA adapters on its attention projections (the base frozen)."""

    def __init__(self) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
        self.model = get_peft_model(self.model, config)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)


def test_export_peft_adapters_merged_or_as_an_adapter_folder(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ema = EMA(decay=0.8)
    path = str(tmp_path / "saved.ckpt")
    records = fit(
        LoraGPT2().double(), MGPUShardedStrategy(stage=3, checkpoint="sharded", start_method="fork"), tmp_path,
        dataset=token_data(16), batch_size=2, max_epochs=1, callbacks=[ema, SaveAtEnd(path, ema, tmp_path)],
    )  # fmt: skip
    trained = _stripped(records[0]["state"])  # peft's names: base_model.model.transformer...
    average = _stripped(torch.load(tmp_path / "average.pt", weights_only=True))
    assert average and all(".lora_" in name for name in average)  # only the adapters are trainable

    def merged_by_peft(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        module = LoraGPT2().double()
        module.model.load_state_dict(state)
        return module.model.merge_and_unload().state_dict()

    # merged: what peft's merge_and_unload gives, from the trained adapters and from their average
    for ema_flag, state in ((False, trained), (True, {**trained, **average})):
        folder = tmp_path / f"merged{int(ema_flag)}"
        export_checkpoint(path, folder, format="hf", ema=ema_flag)
        loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
        expected = merged_by_peft(state)
        assert sorted(loaded) == sorted(expected)
        torch.testing.assert_close(loaded, expected, rtol=0, atol=0)  # the same operations: bit for bit
    with pytest.raises(AssertionError):  # negative control: the unmerged base is told apart
        base = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in trained.items()}
        torch.testing.assert_close(loaded, {k: base[k] for k in loaded})
    # the adapter folder: the base model unmerged plus the adapter, loaded to the trained tensors exactly, by
    # transformers (which attaches the adapter it finds in the folder) and by peft onto a base model
    assert main([path, "--format", "hf", str(tmp_path / "adapter"), "--adapters", "peft"]) == 0
    attached = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter").state_dict()
    own = {k.removeprefix("base_model.model."): v for k, v in trained.items()}
    torch.testing.assert_close(attached, own, rtol=0, atol=0)
    base_model = HFGPT2().double().model  # a GPT-2 of the same configuration
    model = PeftModel.from_pretrained(base_model, tmp_path / "adapter")
    lora = {k: v for k, v in trained.items() if ".lora_" in k}
    torch.testing.assert_close({k: v for k, v in model.state_dict().items() if ".lora_" in k}, lora, rtol=0, atol=0)
