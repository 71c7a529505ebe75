"""The 70B-on-two-24-GiB-GPUs plan on paper: a Llama-2-70B-shaped model with LoRA adapters over a 4-bit base.

    python benchmarks/bench_qlora_70b.py             # one markdown table, a few minutes on 2 CPU cores
    python benchmarks/bench_qlora_70b.py --layers 2  # the same shape, 2 blocks: a quick look

The published result this checks (Answer.AI's FSDP + QLoRA): a Llama 2 70B fine-tuned with LoRA on two 24 GB
gaming GPUs, its frozen base in 4 bits and sharded by FSDP, with activation checkpointing and the sharded states
offloaded to host memory. The model here is ``bench_layouts.LlamaLM`` at Llama 2 70B's shape (width 8192, 80
blocks, 64 heads, 8 key-value heads, FFN 28672, vocabulary 32000) built in bfloat16, every linear layer of the
blocks with a LoRA adapter (rank 64, the adapters trainable), then :func:`~lightning_mgpu.quantize_frozen` packing
every frozen linear weight (the head too) in torchao's NF4; one sequence of 2048 tokens per GPU, ``bf16-mixed``.
It plans ``mgpu_zero3`` on 2 GPUs of 24 GiB with and without ``offload``, and prints, for each row (with and
without activation checkpointing), the device's peak per rank by component, the host memory per rank and what
moves between host and device per micro-batch. Nothing is allocated: the model is traced under FakeTensorMode.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from bench_layouts import LlamaLM, Shape
from torch import nn

from lightning_mgpu import quantize_frozen
from lightning_mgpu.planning import format_bytes, plan

LLAMA2_70B = Shape(8192, 80, 64, 8, 28672)
VOCAB = 32000
SEQ = 2048


class LoRALinear(nn.Module):
    """A frozen linear layer with a trainable low-rank update, ``W x + B A x * alpha / r`` (the LoRA paper's)."""

    def __init__(self, base: nn.Linear, rank: int = 64, alpha: int = 16) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.zeros(rank, base.in_features, dtype=base.weight.dtype))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=base.weight.dtype))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


class QLoRALlama(LlamaLM):
    """``LlamaLM`` in bfloat16, frozen, LoRA on every linear layer of its blocks, its frozen linears in 4 bits."""

    def __init__(self, shape: Shape, vocab: int) -> None:
        super().__init__(shape, vocab)
        self.to(torch.bfloat16).requires_grad_(False)
        for block in self.layers:
            for parent in list(block.modules()):
                for name, child in list(parent.named_children()):
                    if isinstance(child, nn.Linear):
                        setattr(parent, name, LoRALinear(child))
        quantize_frozen(self)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=LLAMA2_70B.layers)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--device-memory", default="24GiB")
    parser.add_argument("--host-memory", default="256GiB", help="one machine's host memory (default 256GiB)")
    args = parser.parse_args()
    shape = Shape(LLAMA2_70B.d, args.layers, LLAMA2_70B.heads, LLAMA2_70B.kv_heads, LLAMA2_70B.ffn)
    tokens = torch.zeros(1, SEQ, dtype=torch.long)
    print(
        f"Llama 2 70B shape ({args.layers} blocks), LoRA rank 64 on every block linear, 4-bit base; "
        f"{args.devices} GPUs x {args.device_memory}, host {args.host_memory}, 1 x {SEQ} tokens per GPU, bf16-mixed\n"
    )
    print(
        "| offload | AC | base and states on the device | activations | gathered units | peak/rank | fits | "
        "host/rank | host<->device per micro-batch |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    seconds: list[float] = []
    for offload in (False, True):
        start = time.perf_counter()
        result = plan(
            lambda: QLoRALlama(shape, VOCAB),
            devices=args.devices,
            device_memory=args.device_memory,
            batch=(tokens, tokens),
            precisions=("bf16-mixed",),
            strategies=("mgpu_zero3",),
            require_fit=False,
            offload=offload,
            host_memory=args.host_memory,
        )
        for row in result.rows:
            states = row.parameters_bytes + row.gradients_bytes + row.optimizer_state_bytes
            moved = f"{format_bytes(row.transfer_bytes)} ({row.transfer_seconds * 1e3:.0f} ms at PCIe 4.0 x16)"
            print(
                f"| {'yes' if offload else 'no'} | {'yes' if row.activation_checkpointing else 'no'} | "
                f"{format_bytes(states)} | {format_bytes(row.activations_bytes)} | "
                f"{format_bytes(row.communication_bytes)} | {format_bytes(row.predicted_peak_bytes_per_rank)} | "
                f"{'yes' if row.fits else 'no'} | {format_bytes(row.host_bytes) if offload else '-'} | "
                f"{moved if offload else '-'} |"
            )
        seconds.append(time.perf_counter() - start)
    s = result.states
    print(
        f"\n{s.parameter_count:,} parameters, {s.four_bit_count:,} of them in 4 bits "
        f"({format_bytes(s.parameters.get('nf4', 0))} packed), {s.trainable_count:,} trainable; planned in "
        f"{' and '.join(f'{t:.0f} s' for t in seconds)}."
    )


if __name__ == "__main__":
    main()
