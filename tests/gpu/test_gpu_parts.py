"""Parts whose GPU path needs no Trainer: checked in this process (the GPU tier; skipped with "no CUDA device")."""

from __future__ import annotations

import time

import torch

from lightning_mgpu.plugins.async_checkpoint import AsyncCheckpointWriter
from tests.gpu.test_gpu_tier import needs_cuda


@needs_cuda
def test_async_checkpoint_stages_gpu_tensors_to_pinned_cpu_memory_and_copies_them() -> None:
    live = torch.ones(3, device="cuda")
    staged = AsyncCheckpointWriter().stage({"w": live})
    assert staged["w"].device.type == "cpu" and staged["w"].is_pinned()
    live.add_(1)  # training goes on: the staged copy keeps the value at the save
    torch.cuda.synchronize()
    assert torch.equal(staged["w"], torch.ones(3))


@needs_cuda
def test_async_checkpoint_staging_waits_for_no_kernel_and_orders_the_copy_between_two_steps() -> None:
    """``stage`` queues its copy after the work training queued and returns at once; the next step's kernel, queued
    after the save, runs only after the copy."""
    live = torch.ones(1 << 24, device="cuda")  # 64 MB
    writer = AsyncCheckpointWriter()
    writer.stage({"w": live})  # the first save allocates the pinned buffer
    writer.wait_staged()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU work queued (training's kernels)...
    live.fill_(3.0)  # ...ending with the step whose state the checkpoint holds
    start = time.perf_counter()
    staged = writer.stage({"w": live})
    returned = time.perf_counter() - start
    live.add_(1)  # the next optimizer step, queued after the save
    assert returned < 0.25, f"stage waited {returned:.3f} s for the queued kernels or its copy"
    assert writer.copies_pending
    writer.wait_staged()
    assert staged["w"].is_pinned() and torch.equal(staged["w"], torch.full((1 << 24,), 3.0))
    torch.cuda.synchronize()
    assert torch.equal(live, torch.full_like(live, 4.0))
