"""Adapter-only checkpoints: bytes on disk and save time of a full checkpoint against ``checkpoint_params="trainable"``.

    python benchmarks/bench_adapter_checkpoint.py                       # GPT-2 small shape, LoRA r=8, 2 CPU ranks
    python benchmarks/bench_adapter_checkpoint.py --width 256 --layers 4 --rank 4   # a quick run

A ``peft`` LoRA GPT-2 built from a random config of ``--width``/``--layers`` (no download; 768/12 is GPT-2
small's shape, 124M parameters) with adapters of rank ``--rank`` on the attention and MLP projections, AdamW on the
adapters, trains one step on 2 fork-launched CPU ranks under each layout (``mgpu_ddp``: one consolidated file;
``mgpu_zero3``: one file gathered on rank 0 (an adapter-only save gathers the adapters only), and with
``checkpoint="sharded"``: a directory written by every rank) and setting (``"all"``, then
``"trainable"``), then calls ``trainer.save_checkpoint`` ``--repeats`` times. Printed: the bytes on disk, rank 0's
median save time and the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from lightning_mgpu import MGPUDDPStrategy, MGPUShardedStrategy

VOCAB, SEQ = 1024, 32


class LoRAGPT2(pl.LightningModule):
    def __init__(self, width: int, layers: int, rank: int) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=width, n_layer=layers, n_head=max(1, width // 64))
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
        self.model = get_peft_model(GPT2LMHeadModel(config), lora)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


class SaveTimer(pl.Callback):
    """After the last step: every rank saves ``repeats`` times (a collective for the sharded layout); rank 0
    records the bytes and the median time."""

    def __init__(self, out: Path, repeats: int) -> None:
        self.out, self.repeats = out, repeats

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        times, size = [], 0
        for i in range(self.repeats):
            path = self.out / f"save-{i}.ckpt"
            trainer.strategy.barrier()
            start = time.perf_counter()
            trainer.save_checkpoint(path)
            trainer.strategy.barrier()
            times.append(time.perf_counter() - start)
            size = _size(path)
        if trainer.is_global_zero:
            (self.out / "results.json").write_text(json.dumps({"bytes": size, "seconds": statistics.median(times)}))


def _run(strategy: Any, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[SaveTimer(out, args.repeats)],
        )
        trainer.fit(LoRAGPT2(args.width, args.layers, args.rank), DataLoader(ids, batch_size=2))
        return json.loads((out / "results.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = LoRAGPT2(args.width, args.layers, args.rank)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(
        f"LoRA GPT-2 width {args.width}, {args.layers} layers, r={args.rank}: {total:,} parameters, "
        f"{trainable:,} trainable ({100 * trainable / total:.2f}%); 2 CPU ranks, median of {args.repeats} saves"
    )
    print(
        f"{'layout':<34} {'all: bytes':>14} {'trainable: bytes':>17} {'bytes ratio':>12} {'all: s':>8} "
        f"{'trainable: s':>13} {'time ratio':>11}"
    )
    layouts = {
        "mgpu_ddp (one file)": lambda params: MGPUDDPStrategy(start_method="fork", checkpoint_params=params),
        "mgpu_zero3 (one file)": lambda params: MGPUShardedStrategy(
            stage=3, start_method="fork", checkpoint_params=params
        ),
        "mgpu_zero3 checkpoint='sharded'": lambda params: MGPUShardedStrategy(
            stage=3, checkpoint="sharded", start_method="fork", checkpoint_params=params
        ),
    }
    for name, make in layouts.items():
        a = _run(make("all"), args)
        t = _run(make("trainable"), args)
        print(
            f"{name:<34} {a['bytes']:>14,} {t['bytes']:>17,} {a['bytes'] / t['bytes']:>11.1f}x "
            f"{a['seconds']:>8.3f} {t['seconds']:>13.3f} {a['seconds'] / t['seconds']:>10.1f}x"
        )


if __name__ == "__main__":
    main()
