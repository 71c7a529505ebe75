"""The memory planner's predicted peak against the CUDA allocator's, for the strategies, precisions and checkpointing.

    python benchmarks/gpu/bench_planner_vs_allocator.py [--out benchmarks/results]
    python benchmarks/gpu/bench_planner_vs_allocator.py --tiny     # a check of the script (CPU: predictions only)

For a ``TransformerLM`` of ~117M parameters (batch 8 x 512 tokens, AdamW; ``--seqs`` for other lengths) the
planner (:func:`lightning_mgpu.plan`, world size 1) predicts the peak per rank of every candidate; then each row trains
through ``Trainer(strategy=...).fit`` on one GPU (NCCL, world size 1) in this process and reads
``torch.cuda.max_memory_allocated`` over the second step (the first creates the optimizer state), less what the
allocator held before the model was built (cuBLAS's workspaces, warmed up first: the plan does not count them).

Compared: ``PlanRow.one_device_bytes``: for ``mgpu_ddp`` / ``mgpu_zero1`` the model states and activations plus
the first gradient buckets, which DDP may still hold while it rebuilds its buckets at the start of the second step
(a single rank's gradients are DDP's buckets: no bucket in flight beside them); for the FSDP stages the whole
predicted peak (the all-gather and reduce-scatter buffers are real allocations at world size 1 too). The CPU
benchmark (``benchmarks/bench_planner.py``) checks ``measurable_bytes``, without DDP's reducer. The GPU tier
holds the ratio within 15% (``tests/gpu/test_gpu_features.py``). The result is saved as JSON under ``--out``.

Then a 4-bit base with offload (``--no-qlora`` leaves it out): a TinyLlama-1.1B-shaped model (width 2048, 22 blocks, 32
heads, 4 key-value heads, FFN 5632, vocabulary 32000) in bfloat16 with a LoRA adapter (rank 64) on every linear layer
of its blocks and every frozen linear weight packed in torchao's NF4 (``benchmarks/bench_qlora_70b.py``'s
``QLoRALlama``, the model of the 70B plan at another shape), one sequence of 2048 tokens, ``bf16-mixed``, under
``MGPUShardedStrategy(stage=3, offload="cpu")`` with and without activation checkpointing: the plan's device peak
beside the allocator's, and the plan's host memory beside the host copy of the shards. Built on the GPU (quantizing
1.1B weights on the host takes minutes), then moved to the host before the fit, as a model too large for the device
is. ``--tiny``: the same with 2 blocks of width 256 (CPU: the plan and a fit, no peak).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the QLoRA model of the 70B plan
from env import environment, result_name

from lightning_mgpu import MGPUDDPStrategy, MGPUShardedStrategy, plan
from lightning_mgpu.planning import format_bytes
from lightning_mgpu.planning.lm import RandomTokens, TransformerLM
from lightning_mgpu.quantization import stored_bytes

CUDA = torch.cuda.is_available()
STAGES = {"mgpu_ddp": 0, "mgpu_zero1": 1, "mgpu_sharded": 2, "mgpu_zero3": 3}
#: (strategy, precision, activation checkpointing)
ROWS = [
    ("mgpu_ddp", "32-true", False),
    ("mgpu_ddp", "32-true", True),
    ("mgpu_ddp", "bf16-mixed", False),
    ("mgpu_ddp", "bf16-mixed", True),
    ("mgpu_zero1", "32-true", False),
    ("mgpu_sharded", "bf16-mixed", False),
    ("mgpu_zero3", "32-true", False),
    ("mgpu_zero3", "bf16-mixed", True),
]


class StepPeak(pl.Callback):
    """``torch.cuda.max_memory_allocated`` over the second training step."""

    def __init__(self) -> None:
        self.peak = -1

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if CUDA and idx == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if CUDA and int(args[-1]) == 1:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()


def _warm_up_cublas() -> None:
    """Allocate cuBLAS's workspaces (forward thread and backward thread, FP32 and BF16) before any baseline."""
    if not CUDA:
        return
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(64, 64, device="cuda", dtype=dtype, requires_grad=True)
        (a @ a).float().sum().backward()
    torch.cuda.synchronize()


def measure(model_args: dict[str, Any], data: RandomTokens, strategy: str, precision: str, ac: bool) -> int:
    """Bytes the allocator's peak over the second step exceeds what it held before the model was built."""
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated() if CUDA else 0
    policy = {nn.TransformerEncoderLayer} if ac else None
    stage = STAGES[strategy]
    built: Any = (
        MGPUDDPStrategy(activation_checkpointing=policy)
        if stage == 0
        else MGPUShardedStrategy(stage=stage, activation_checkpointing=policy)
    )
    torch.manual_seed(0)
    return peak_of(built, precision, TransformerLM(**model_args), data, baseline)


def peak_of(strategy: Any, precision: str, model: pl.LightningModule, data: Any, baseline: int) -> int:
    """Fit ``model`` for 3 steps on one device: the allocator's peak over the second step less ``baseline`` (-1
    without CUDA)."""
    peak = StepPeak()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="gpu" if CUDA else "cpu",
        devices=1,
        precision=precision,
        max_steps=3,
        callbacks=[peak],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, data)
    del trainer
    return peak.peak - baseline if peak.peak >= 0 else -1


def qlora_rows(tiny: bool) -> list[dict[str, Any]]:
    """The 4-bit base with offload (the module docstring): one row per activation-checkpointing setting."""
    from bench_layouts import Block, Shape
    from bench_qlora_70b import QLoRALlama

    shape = Shape(256, 2, 4, 2, 704) if tiny else Shape(2048, 22, 32, 4, 5632)
    vocab, seq = (512, 64) if tiny else (32000, 2048)
    tokens = torch.zeros(1, seq, dtype=torch.long)
    planned = plan(
        lambda: QLoRALlama(shape, vocab),
        devices=1,
        device_memory="1TiB",
        batch=(tokens, tokens),
        precisions=("bf16-mixed",),
        strategies=("mgpu_zero3",),
        offload=True,
        host_memory="1TiB",
    )
    data = RandomTokens(batch_size=1, seq_len=seq, vocab=vocab, samples=4)
    data.setup("fit")
    rows = []
    for ac in (False, True):
        predicted = planned.row("mgpu_zero3", "bf16-mixed", ac)
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
        baseline = torch.cuda.memory_allocated() if CUDA else 0
        torch.manual_seed(0)
        with torch.device("cuda" if CUDA else "cpu"):
            model = QLoRALlama(shape, vocab)
        model.cpu()  # on the host, as a model too large for the device: the strategy moves what it keeps there
        packed = sum(stored_bytes(p) for p in model.parameters() if not p.requires_grad)
        strategy = MGPUShardedStrategy(stage=3, offload="cpu", activation_checkpointing={Block} if ac else None)
        measured = peak_of(strategy, "bf16-mixed", model, data, baseline)
        del model
        rows.append(
            {
                "model": "QLoRALlama",
                "shape": [shape.d, shape.layers, shape.heads, shape.kv_heads, shape.ffn],
                "parameters": planned.states.parameter_count,
                "four_bit": planned.states.four_bit_count,
                "trainable": planned.states.trainable_count,
                "seq": seq,
                "activation_checkpointing": ac,
                "predicted_peak_bytes": predicted.predicted_peak_bytes_per_rank,
                "predicted_one_device_bytes": predicted.one_device_bytes,
                "predicted_host_bytes": predicted.host_bytes,
                "frozen_bytes_built": packed,
                "measured_bytes": measured,
                "ratio": measured / predicted.one_device_bytes if measured > 0 else None,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqs", type=int, nargs="*", default=[512])
    ap.add_argument("--tiny", action="store_true", help="a small model, to check the script (CPU works)")
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON result")
    ap.add_argument("--no-qlora", dest="qlora", action="store_false", help="without the 4-bit base with offload")
    args = ap.parse_args()
    if args.tiny:
        args.vocab, args.d_model, args.heads, args.layers, args.batch, args.seqs = 512, 64, 4, 2, 4, [32]
    env = environment()
    _warm_up_cublas()
    model_args = {"vocab": args.vocab, "d_model": args.d_model, "heads": args.heads, "layers": args.layers}
    params = sum(p.numel() for p in TransformerLM(**model_args).parameters())
    print(f"TransformerLM, {params / 1e6:.0f}M parameters, batch {args.batch}, on {env['device']}")
    print("| seq | strategy | precision | AC | predicted | measured | measured / predicted |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for seq in args.seqs:
        data = RandomTokens(batch_size=args.batch, seq_len=seq, vocab=args.vocab, samples=4 * args.batch)
        data.setup("fit")
        sample = next(iter(data.train_dataloader()))
        plans = {
            precision: plan(
                lambda: TransformerLM(**model_args),
                devices=1,
                device_memory="1TiB",
                batch=sample,
                precisions=(precision,),
            )
            for precision in sorted({p for _, p, _ in ROWS})
        }
        for strategy, precision, ac in ROWS:
            predicted = plans[precision].row(strategy, precision, ac)
            measured = measure(model_args, data, strategy, precision, ac)
            ratio = measured / predicted.one_device_bytes if measured > 0 else None
            rows.append(
                {
                    "model": "TransformerLM",
                    "parameters": params,
                    "batch": args.batch,
                    "seq": seq,
                    "strategy": strategy,
                    "precision": precision,
                    "activation_checkpointing": ac,
                    "predicted_peak_bytes": predicted.predicted_peak_bytes_per_rank,
                    "predicted_measurable_bytes": predicted.measurable_bytes,
                    "predicted_one_device_bytes": predicted.one_device_bytes,
                    "predicted_rebuilt_buckets_bytes": predicted.rebuilt_buckets_bytes,
                    "measured_bytes": measured,
                    "ratio": ratio,
                }
            )
            shown = format_bytes(measured) if measured > 0 else "not measured (no CUDA)"
            print(
                f"| {seq} | {strategy} | {precision} | {'yes' if ac else 'no'} | "
                f"{format_bytes(predicted.one_device_bytes)} | {shown} | {f'{ratio:.3f}' if ratio else '-'} |"
            )
    result: dict[str, Any] = {"environment": env, "config": {k: v for k, v in vars(args).items() if k != "out"}}
    result["rows"] = rows
    save(args.out, result)  # before the 4-bit rows: a failure there keeps these
    if args.qlora:
        print("\n4-bit base (NF4) + LoRA, ZeRO-3 with offload='cpu', bf16-mixed, 1 GPU")
        print("| AC | predicted device peak | measured | measured / predicted | predicted host | frozen weights |")
        print("|---|---|---|---|---|---|")
        try:
            result["qlora_offload"] = qlora_rows(args.tiny)
        except Exception as err:  # recorded, so that the proof says why
            result["qlora_offload_error"] = f"{type(err).__name__}: {err}"
            print(f"failed: {result['qlora_offload_error']}")
        for row in result.get("qlora_offload", []):
            shown = format_bytes(row["measured_bytes"]) if row["measured_bytes"] > 0 else "not measured (no CUDA)"
            ratio = f"{row['ratio']:.3f}" if row["ratio"] else "-"
            print(
                f"| {'yes' if row['activation_checkpointing'] else 'no'} | "
                f"{format_bytes(row['predicted_one_device_bytes'])} | {shown} | {ratio} | "
                f"{format_bytes(row['predicted_host_bytes'])} | {format_bytes(row['frozen_bytes_built'])} |"
            )
        save(args.out, result)


def save(out: Any, result: dict[str, Any]) -> None:
    if out:
        out.mkdir(parents=True, exist_ok=True)
        name = result_name("planner-vs-allocator", result["environment"])
        (out / name).write_text(json.dumps(result, indent=1))
        print(f"saved {out / name}")


if __name__ == "__main__":
    main()
