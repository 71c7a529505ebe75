"""``lightning-mgpu export`` on checkpoints written by 2 processes: a transformers GPT-2 (tiny random config,
float64) trained with the EMA callback under ZeRO-3, saved as a sharded directory and as one file; the exported
folder loads with ``from_pretrained`` to the trained weights (or the average, ``--ema``) bit for bit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

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


def _train(tmp: Path, layout: str) -> tuple[str, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    out = tmp / layout
    out.mkdir()
    ema = EMA(decay=0.8)
    path = str(out / "saved.ckpt")
    records = fit(
        HFGPT2().double(), MGPUShardedStrategy(stage=3, checkpoint=layout, start_method="fork"), out,
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

    for layout in ("sharded", "consolidated"):
        path, trained, average = _train(tmp_path, layout)
        assert Path(path).is_dir() == (layout == "sharded")
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
    # one torch.save file, through the console command as a user runs it (the last layout: one file)
    single = tmp_path / "weights.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_mgpu", "export", path, "--format", "torch", str(single)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch.testing.assert_close(torch.load(single, weights_only=True), expected, rtol=0, atol=0)
    assert HF_MODELS_KEY in torch.load(path, weights_only=True, mmap=True)
