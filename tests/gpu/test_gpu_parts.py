"""Parts whose GPU path needs no Trainer: checked in this process (the GPU tier; skipped with "no CUDA device")."""

from __future__ import annotations

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
