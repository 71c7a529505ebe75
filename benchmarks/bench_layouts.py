"""The layout plan on paper against published layouts: torchtitan's Llama 3.1 runs (8B to 405B, 8 to 512 GPUs).

    python benchmarks/bench_layouts.py            # one markdown table, a few minutes on 2 CPU cores
    python benchmarks/bench_layouts.py --only 70B # one run

For each published run: the model (a ``TransformerLM`` of the same width, depth, heads, vocabulary and parameter
count: its FFN width is the Llama layer's parameters less ``4 d**2``, over ``2 d``), the GPUs, machines of 8, the
device memory, the local batch (per data-parallel rank) at 8192 tokens, ``bf16-master`` (bf16 weights, activations
and gradients with FP32 masters, which under FSDP are the shards: what FSDP2's bf16 mixed-precision policy, the
published runs' setting, keeps; ``bf16-mixed`` autocasts FP32 weights and keeps an FP32 residual stream, twice
the activations of those runs); links NVLink within a machine
and 400 Gb/s per GPU across (the published platform's). It prints the layout the run used, the layout the plan
ranks first, and where the published layout ranks, with each one's predicted peak per rank. Nothing is allocated:
the models are traced under FakeTensorMode. The step times are estimates (:mod:`lightning_mgpu.planning.layouts`),
not measured.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Optional

import torch

from lightning_mgpu.planning import format_bytes, plan_layouts
from lightning_mgpu.planning.layouts import Layout, LayoutPlan
from lightning_mgpu.planning.lm import TransformerLM

VOCAB = 128256
SEQ = 8192


@dataclass(frozen=True)
class Shape:
    d: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int

    @property
    def stand_in_ffn(self) -> int:
        """The FFN width of a TransformerLM layer with a Llama layer's parameters (GQA attention, gated MLP)."""
        head = self.d // self.heads
        llama = 2 * self.d * self.d + 2 * self.d * self.kv_heads * head + 3 * self.d * self.ffn
        return (llama - 4 * self.d * self.d) // (2 * self.d)


SHAPES = {  # Llama 3 8B / 70B / 405B: width, layers, heads, key-value heads, FFN width
    "8B": Shape(4096, 32, 32, 8, 14336),
    "70B": Shape(8192, 80, 64, 8, 28672),
    "405B": Shape(16384, 126, 128, 8, 53248),
}


@dataclass(frozen=True)
class Run:
    label: str
    model: str
    gpus: int
    memory: str
    local_batch: int
    data_shard: int
    tensor: int
    pipeline: int
    published: str


RUNS = [
    Run("8B, 8 GPUs", "8B", 8, "96GB", 2, 8, 1, 1, "FSDP 8, selective AC, 82.4 GiB"),
    Run("8B, 128 GPUs", "8B", 128, "96GB", 2, 128, 1, 1, "FSDP 128, selective AC, 67.0 GiB"),
    Run("70B, 256 GPUs", "70B", 256, "96GB", 16, 32, 8, 1, "FSDP 32 x TP 8, full AC, 71.9 GiB"),
    Run("405B, 512 GPUs", "405B", 512, "96GB", 32, 8, 8, 8, "FSDP 8 x TP 8 x PP 8 (1F1B), full AC, 82.5 GiB"),
    Run("405B, 128 GPUs", "405B", 128, "94GB", 2, 16, 8, 1, "FSDP 16 x TP 8, full AC (FSDP alone: OOM)"),
]


def _published(plan: LayoutPlan, run: Run) -> tuple[Optional[int], Optional[Layout]]:
    """The rank (1-based, among all layouts) of the published layout: FSDP over ``data_shard`` ranks (ZeRO-2 or
    ZeRO-3), the tensor and pipeline sizes, full activation checkpointing, 1F1B; the faster of the two stages."""
    for i, x in enumerate(plan.layouts, 1):
        if (
            (x.data_replicate, x.data_shard, x.tensor, x.pipeline) == (1, run.data_shard, run.tensor, run.pipeline)
            and x.strategy in ("mgpu_sharded", "mgpu_zero3")
            and x.activation_checkpointing
            and x.schedule in ("1f1b", "-")
        ):
            return i, x
    return None, None


def _data_parallel(plan: LayoutPlan) -> str:
    """The fastest layout without a tensor or pipeline split that fits, or that none does."""
    best = plan.best_where(data_parallel_only=True)
    if best is None:
        return "fits nowhere"
    return f"{best.name}{', AC' if best.activation_checkpointing else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="the runs whose label starts with this, e.g. 70B")
    args = parser.parse_args()
    print(
        "| run | published layout | plan's first (fits) | its peak/rank | published layout's rank | its peak/rank | "
        "fits | data parallel alone | plan time |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for run in RUNS:
        if args.only and not run.label.startswith(args.only):
            continue
        shape = SHAPES[run.model]
        tokens = torch.zeros(run.local_batch, SEQ, dtype=torch.long, device="meta")
        start = time.perf_counter()
        plan = plan_layouts(
            lambda shape=shape: TransformerLM(VOCAB, shape.d, shape.heads, shape.layers, ffn=shape.stand_in_ffn),
            devices=run.gpus,
            num_nodes=run.gpus // 8,
            device_memory=run.memory,
            batch=(tokens, tokens),
            precisions=("bf16-master",),
        )
        seconds = time.perf_counter() - start
        best = plan.best
        rank, published = _published(plan, run)
        first = f"{best.name}{', AC' if best.activation_checkpointing else ''}" if best else "nothing fits"
        cells = [
            run.label,
            run.published,
            first,
            format_bytes(best.predicted_peak_bytes_per_rank) if best else "-",
            f"{rank} of {len(plan.layouts)}" if rank else "not enumerated",
            format_bytes(published.predicted_peak_bytes_per_rank) if published else "-",
            ("yes" if published.fits else "no") if published else "-",
            _data_parallel(plan),
            f"{seconds:.0f} s",
        ]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
