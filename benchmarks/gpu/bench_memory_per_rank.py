"""Model-state memory per rank at world sizes 2, 4 and 8 on ONE GPU, beside the ZeRO paper's formulas.

    python benchmarks/gpu/bench_memory_per_rank.py [--out benchmarks/results] [--d-model 1024 --layers 12]

Each world size is built in this one process with torch's fake process group (``torch.testing._internal.
distributed.fake_pg``, as torchtitan's memory estimation does): this process is rank 0 of N, collectives allocate
their outputs and move no data, so what the CUDA allocator holds is exactly what rank 0 of a real N-GPU job holds.
For DDP (what ``mgpu_ddp`` builds: ``gradient_as_bucket_view``), stage 1 (DDP + ``ZeroRedundancyOptimizer``, as
``mgpu_zero1``), stage 2 (FSDP2 ``fully_shard(reshard_after_forward=False)`` per block, as ``mgpu_sharded``) and
stage 3 (``fully_shard``, as ``mgpu_zero3``) it trains two steps of a transformer language model with AdamW in FP32
and reports, per rank:

* ``states``: bytes allocated after the second ``optimizer.step()`` (parameters + gradients + Adam state; the
  step's activations are freed by then), beside the formula for FP32 Adam (4 bytes each of parameter, gradient,
  and two moments: DDP 16P, stage 1 8P + 8P/N, stage 2 4P + 12P/N, stage 3 16P/N);
* ``peak``: the allocator's peak during the second step (activations and gathered parameters included);
* the ZeRO paper's mixed-precision Adam figures (16P; 4P + 12P/N; 2P + 14P/N; 16P/N) for reference: the same
  16 bytes per parameter, split 2 + 2 + 12 instead of 4 + 4 + 8.

``tp2_zero3`` is the tensor-parallel layout (``mgpu_tensor_parallel``): a 2-D mesh of data N/2 x tensor 2, the pack's
auto tensor-parallel plan applied over the tensor dimension (``TensorParallelism``: here it splits each layer's MLP;
the packed attention, the norms, the embedding and the head stay replicated), then ``fully_shard`` over the data
dimension. Its formula: 16 bytes per split parameter over all N ranks, 16 per replicated parameter over the N/2
data ranks of its tensor group.

FSDP2's stage 2 (``reshard_after_forward=False``) keeps the full parameters from the forward to the end of the
backward only: after the step a rank holds its shard of them, so its ``states`` are stage 3's (16P/N) and the
difference from stage 3 is in ``peak`` (no re-gather in the backward). The ZeRO paper's stage 2 keeps the full
parameters all the time (its formula's 4P / 2P term); the table shows both.

Without CUDA the script still runs (a check of the script): the states are then counted from the tensors each
rank holds, not measured, and the peak is not reported.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from env import environment, result_name

from lightning_mgpu.parts.sharding import local_bytes
from lightning_mgpu.parts.tensor_parallel import TensorParallelism
from lightning_mgpu.planning.lm import TransformerLM
from lightning_mgpu.planning.measure import fake_process_group

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
FP32 = {
    "ddp": lambda p, n: 16 * p,
    "zero1": lambda p, n: 8 * p + 8 * p / n,
    "zero2": lambda p, n: 4 * p + 12 * p / n,
    "zero3": lambda p, n: 16 * p / n,
}
PAPER_MIXED = {
    "ddp": lambda p, n: 16 * p,
    "zero1": lambda p, n: 4 * p + 12 * p / n,
    "zero2": lambda p, n: 2 * p + 14 * p / n,
    "zero3": lambda p, n: 16 * p / n,
}


def _fake_allreduce(state: Any, bucket: Any) -> torch.futures.Future:
    """DDP's all-reduce on the fake backend, whose futures carry no value (DDP's built-in hook then fails): issue
    the collective in place on the bucket, as the built-in hook does, and hand DDP the bucket back."""
    buffer = bucket.buffer()
    dist.all_reduce(buffer)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buffer)
    return fut


# DDP checks the hook's annotations as objects (this module's are strings: `from __future__ import annotations`)
_fake_allreduce.__annotations__ = {
    "state": object,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def tensor_split(model: nn.Module) -> int:
    """The parameters the auto tensor-parallel plan splits over 2 ranks (counted before it is applied; a row-wise
    layer's bias stays whole)."""
    split = set(TensorParallelism(size=2).plan_for(model).split_parameters(model))
    return sum(p.numel() for name, p in model.named_parameters() if name in split)


def build(kind: str, model: nn.Module, device: str) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], int]]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    params = list(model.parameters())
    if kind == "tp2_zero3":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(
            device, (dist.get_world_size() // 2, 2), mesh_dim_names=("data_parallel", "tensor_parallel")
        )
        TensorParallelism(size=2).apply(model, mesh["tensor_parallel"])
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(model, mesh=mesh["data_parallel"])
        wrapped, opt = model, torch.optim.AdamW(model.parameters(), lr=1e-4)
        local = opt
    elif kind in ("ddp", "zero1"):
        wrapped: nn.Module = DDP(model, gradient_as_bucket_view=True, device_ids=None)
        wrapped.register_comm_hook(None, _fake_allreduce)
        opt: torch.optim.Optimizer = (
            torch.optim.AdamW(params, lr=1e-4)
            if kind == "ddp"
            else ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-4)
        )
        local = getattr(opt, "optim", opt)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device, (dist.get_world_size(),))
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh, reshard_after_forward=kind == "zero3")
        fully_shard(model, mesh=mesh, reshard_after_forward=kind == "zero3")
        wrapped, opt = model, torch.optim.AdamW(model.parameters(), lr=1e-4)
        local = opt

    def counted() -> int:  # what this rank holds, from its tensors (the CPU fallback)
        states = sum(local_bytes(v) for s in local.state.values() for v in s.values())
        grads = sum(local_bytes(p.grad) for p in model.parameters())
        return states + grads + sum(local_bytes(p) for p in model.parameters())

    return wrapped, opt, counted


def measure(kind: str, n: int, args: argparse.Namespace, device: str) -> dict[str, float]:
    cuda = device == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
    base = torch.cuda.memory_allocated() if cuda else 0
    with fake_process_group(n):
        torch.manual_seed(0)
        with torch.device(device):  # initialised on the device: fast
            model = TransformerLM(vocab=args.vocab, d_model=args.d_model, heads=args.heads, layers=args.layers)
        p = sum(x.numel() for x in model.parameters())
        split = tensor_split(model) if kind == "tp2_zero3" else 0
        wrapped, opt, counted = build(kind, model, device)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
        for step in range(2):
            if cuda and step == 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            logits = wrapped(tokens)
            nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
            del logits
            opt.step()
            if step == 1:
                if cuda:
                    torch.cuda.synchronize()
                    states = torch.cuda.memory_allocated() - base
                    peak = torch.cuda.max_memory_allocated() - base
                else:
                    states, peak = counted(), float("nan")
            opt.zero_grad(set_to_none=kind not in ("ddp", "zero1"))  # bucket views stay allocated in DDP
        del wrapped, opt, model
    if kind == "tp2_zero3":  # split parameters over all n ranks, replicated ones over the n/2 data ranks
        formula = 16 * split / n + 16 * (p - split) / (n // 2)
        return {
            "params": p,
            "split_params": split,
            "states_bytes": states,
            "peak_bytes": peak,
            "fp32_formula_bytes": formula,
            "paper_mixed_formula_bytes": formula,
        }
    return {
        "params": p,
        "states_bytes": states,
        "peak_bytes": peak,
        "fp32_formula_bytes": FP32[kind](p, n),
        "paper_mixed_formula_bytes": PAPER_MIXED[kind](p, n),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON result")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = environment()
    rows = []
    for n in args.worlds:
        for kind in STRATEGIES + (("tp2_zero3",) if n >= 2 and n % 2 == 0 else ()):
            rows.append({"world": n, "strategy": kind, **measure(kind, n, args, device)})
    gib = 2**30
    p = rows[0]["params"]
    print(f"model-state memory per rank, {p / 1e6:.0f}M parameters, FP32 AdamW, on {env['device']}")
    print(
        f"{'N':>2} {'strategy':<10}{'states GiB':>11}{'fp32 formula':>13}{'ratio':>7}"
        f"{'peak GiB':>10}{'paper mixed':>12}"
    )
    for r in rows:
        ratio = r["states_bytes"] / r["fp32_formula_bytes"]
        print(
            f"{r['world']:>2} {r['strategy']:<10}{r['states_bytes'] / gib:>11.3f}{r['fp32_formula_bytes'] / gib:>13.3f}"
            f"{ratio:>7.3f}{r['peak_bytes'] / gib:>10.3f}{r['paper_mixed_formula_bytes'] / gib:>12.3f}"
        )
    if device != "cuda":
        print("(no CUDA device: states counted from the tensors each rank holds; peak not measured)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = result_name("memory-per-rank", env)
        (args.out / name).write_text(
            json.dumps({"environment": env, "config": vars(args) | {"out": None}, "rows": rows}, indent=1)
        )
        print(f"saved {args.out / name}")


if __name__ == "__main__":
    main()
