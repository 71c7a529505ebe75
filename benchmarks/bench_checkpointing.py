"""Activation checkpointing: saved-activation bytes and step time of an 8-block transformer, side by side.

    python benchmarks/bench_checkpointing.py            # CPU here; CUDA when available
    python benchmarks/bench_checkpointing.py --steps 10 --d-model 512

Variants, measured in one run with their steps interleaved (so machine noise hits all alike):
  none            no checkpointing
  torch           torch's checkpoint_wrapper (non-reentrant) on every block: what Lightning's FSDPStrategy
                  uses; BatchNorm statistics updated twice per step
  mgpu            lightning_mgpu.apply_activation_checkpointing on every block (BatchNorm-safe)
  mgpu_reentrant  the same, reentrant mode
  mgpu_matmuls    lightning_mgpu, every block, keeping its matmuls and attention (selective, save="matmuls")
  mgpu_budget50   lightning_mgpu, every block, keeping half its operator outputs' bytes (save=0.5)
  mgpu_every2     lightning_mgpu, EveryNth(2): every other block
  mgpu_first6     lightning_mgpu, a callable policy: the first 6 of the 8 blocks

"bytes" are the distinct storages the forward made that are alive when backward starts: what autograd saved and
what selective checkpointing kept (a whole checkpointed block keeps its input only). Targets: mgpu <=
0.40x the bytes of none, at <= 1.35x the step time.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import weakref

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_ac
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_mgpu import EveryNth, apply_activation_checkpointing


class Transformer(nn.Module):
    def __init__(self, blocks: int, d_model: int, heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, 0.1, batch_first=True, norm_first=True)
            for _ in range(blocks)
        )
        self.head = nn.Linear(d_model, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).mean()


def variant(name: str, base: nn.Module) -> nn.Module:
    model = copy.deepcopy(base)
    if name == "torch":
        torch_ac.apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=lambda m: torch_ac.checkpoint_wrapper(
                m, checkpoint_impl=torch_ac.CheckpointImpl.NO_REENTRANT
            ),
            check_fn=lambda m: isinstance(m, nn.TransformerEncoderLayer),
        )
    elif name == "mgpu":
        apply_activation_checkpointing(model, nn.TransformerEncoderLayer)
    elif name == "mgpu_reentrant":
        apply_activation_checkpointing(model, nn.TransformerEncoderLayer, use_reentrant=True)
    elif name == "mgpu_matmuls":
        apply_activation_checkpointing(model, nn.TransformerEncoderLayer, save="matmuls")
    elif name == "mgpu_budget50":
        apply_activation_checkpointing(model, nn.TransformerEncoderLayer, save=0.5)
    elif name == "mgpu_every2":
        apply_activation_checkpointing(model, EveryNth(2, container="blocks"))
    elif name == "mgpu_first6":
        first = {id(b) for b in list(model.blocks)[: len(model.blocks) * 3 // 4]}
        apply_activation_checkpointing(model, lambda m: id(m) in first)
    return model


class _Made(TorchDispatchMode):
    """Weak references to the storage of every tensor the forward makes."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.made.append(weakref.ref(t.untyped_storage()))
        return out


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the storages the forward made that are still alive when backward starts: what autograd saved and
    what selective checkpointing kept (a second forward: a memory budget measures in its first)."""
    for _ in range(2):
        made = _Made()
        with made:
            out = model(x).sum()
        held = sum({s.data_ptr(): s.nbytes() for r in made.made if (s := r()) is not None}.values())
        out.backward()
        model.zero_grad(set_to_none=True)
    return held


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    if x.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model(x).backward()
    opt.step()
    if x.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bn_double_update() -> dict[str, int]:
    """num_batches_tracked after one training step of a Conv-BN block, per variant (1 is right)."""
    out = {}
    for name in ("none", "torch", "mgpu"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), nn.Conv2d(4, 1, 3))
        if name == "torch":
            model[0] = torch_ac.checkpoint_wrapper(model[0])
        elif name == "mgpu":
            apply_activation_checkpointing(model, EveryNth(2))
        model(torch.randn(2, 1, 8, 8)).sum().backward()
        out[name] = int(model.state_dict()["0.1.num_batches_tracked"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant (after 2 warm-up steps)")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    base = Transformer(args.blocks, args.d_model, args.heads).to(device)
    x = torch.randn(args.batch, args.seq, args.d_model, device=device)
    names = ["none", "torch", "mgpu", "mgpu_reentrant", "mgpu_matmuls", "mgpu_budget50", "mgpu_every2", "mgpu_first6"]
    models = {n: variant(n, base) for n in names}
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, m in models.items()}
    bytes_ = {n: saved_bytes(models[n], x) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.steps + 2):
        for n in names:  # interleaved: noise from other jobs on the machine hits every variant alike
            t = step(models[n], opts[n], x)
            if i >= 2:
                times[n].append(t)

    params = sum(p.numel() for p in base.parameters())
    print(
        f"{args.blocks}-block transformer, d_model {args.d_model}, {params / 1e6:.2f}M params, batch {args.batch} x "
        f"seq {args.seq}, {device.type}, {torch.get_num_threads()} threads, median of {args.steps} steps"
    )
    print(f"{'variant':<16}{'saved MiB':>10}{'bytes/none':>12}{'ms/step':>10}{'time/none':>11}")
    t0, b0 = statistics.median(times["none"]), bytes_["none"]
    for n in names:
        t = statistics.median(times[n])
        print(f"{n:<16}{bytes_[n] / 2**20:>10.1f}{bytes_[n] / b0:>12.3f}{t * 1e3:>10.1f}{t / t0:>11.3f}")
    print(f"BatchNorm num_batches_tracked after one step (1 is right): {bn_double_update()}")


if __name__ == "__main__":
    main()
