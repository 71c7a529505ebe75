"""The layout plan on paper against published layouts: torchtitan's Llama 3.1 runs (8B to 405B, 8 to 512 GPUs).

    python benchmarks/bench_layouts.py            # one markdown table, a few minutes on 2 CPU cores
    python benchmarks/bench_layouts.py --only 70B # one run

For each published run: the model (``LlamaLM``, a Llama 3 of the same width, depth, heads, key-value heads, FFN
width and vocabulary: separate query/key/value/output projections with grouped keys and values, a gated MLP,
RMSNorm, an untied head; the names of Llama's layers, so the auto tensor-parallel plan splits its attention and
MLP as torchtitan's plan does; no rotary embedding, which holds no parameters), the GPUs, machines of 8, the
device memory, the local batch (per data-parallel rank) at 8192 tokens, ``bf16-master`` (bf16 weights, activations
and gradients with FP32 masters, which under FSDP are the shards: what FSDP2's bf16 mixed-precision policy, the
published runs' setting, keeps; ``bf16-mixed`` autocasts FP32 weights and keeps an FP32 residual stream, twice
the activations of those runs); links NVLink within a machine
and 400 Gb/s per GPU across (the published platform's). It prints the layout the run used, the layout the plan
ranks first among those the strategy builds (``best``), and where the published layout ranks (among all
layouts), with each one's predicted peak per rank. Nothing is allocated: the models are traced under FakeTensorMode.
The step times are estimates (:mod:`lightning_mgpu.planning.layouts`), not measured.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Optional

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from typing_extensions import override

from lightning_mgpu.planning import format_bytes, plan_layouts
from lightning_mgpu.planning.layouts import Layout, LayoutPlan

VOCAB = 128256
SEQ = 8192


@dataclass(frozen=True)
class Shape:
    d: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Grouped-query causal attention, Llama's names (``wq/wk/wv/wo``, ``n_heads``, ``n_kv_heads``)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # the local head counts under a tensor split: -1 and the weights' widths
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """Llama's gated MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(shape.d)
        self.attention = Attention(shape.d, shape.heads, shape.kv_heads)
        self.ffn_norm = RMSNorm(shape.d)
        self.feed_forward = FeedForward(shape.d, shape.ffn)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaLM(pl.LightningModule):
    """A Llama 3 of ``shape``: token embedding, the blocks, RMSNorm, untied head; AdamW."""

    def __init__(self, shape: Shape, vocab: int = 128256) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, shape.d)
        self.layers = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = RMSNorm(shape.d)
        self.output = nn.Linear(shape.d, vocab, bias=False)

    @override
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        return F.cross_entropy(self(tokens).flatten(0, 1).float(), targets.flatten())

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


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
            lambda shape=shape: LlamaLM(shape, VOCAB),
            devices=run.gpus,
            num_nodes=run.gpus // 8,
            device_memory=run.memory,
            batch=(tokens, tokens),
            precisions=("bf16-master",),
        )
        seconds = time.perf_counter() - start
        best = plan.best
        rank, published = _published(plan, run)
        first = f"{best.name}{', AC' if best.activation_checkpointing else ''}" if best else "nothing buildable fits"
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
