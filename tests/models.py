"""The tests' models and data, importable without lightning_mgpu (a test proves that a consolidated
checkpoint resumes in plain Lightning, in a process where this package cannot be imported)."""

from __future__ import annotations

from typing import Any, Optional

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Regressor(pl.LightningModule):
    """A two-layer MLP with MSE loss and SGD+momentum: small, deterministic, no BatchNorm (BN statistics
    depend on the per-device batch, so they cannot match a single process with the global batch)."""

    def __init__(self, d_in: int = 6, hidden: int = 16, d_out: int = 3, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class NormedRegressor(Regressor):
    """The two-layer MLP with its hidden units normalised between the layers (``nn.LayerNorm`` without weights): no
    tensor-parallel pair (the norm mixes the hidden units each rank of a tensor group would hold a share of)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        norm = nn.LayerNorm(16, elementwise_affine=False)
        self.net = nn.Sequential(nn.Linear(6, 16), norm, nn.Tanh(), nn.Linear(16, 3))


class ManualRegressor(Regressor):
    """Manual optimization without :class:`~lightning_mgpu.ManualAccumulation` (what the strategies refuse
    to accumulate, and what the sharded strategies refuse outright)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))


def make_data(n: int = 96, d_in: int = 6, d_out: int = 3, dtype: torch.dtype = torch.float64) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, d_in, generator=g, dtype=dtype)
    y = torch.randn(n, d_out, generator=g, dtype=dtype)
    return TensorDataset(x, y)


class RankData(pl.LightningDataModule):
    """Per-rank DataLoader with our own DistributedSampler(shuffle=False), built once the process group
    exists: rank r gets samples r, r+N, r+2N, ... so global micro-batch j is the contiguous slice
    [j*N*b, (j+1)*N*b) -- what a single process with batch N*b*k sees, k micro-batches at a time.
    (Lightning's automatic sampler always shuffles, so tests pass use_distributed_sampler=False.)"""

    def __init__(self, dataset: TensorDataset, batch_size: int) -> None:
        super().__init__()
        self.dataset = dataset
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(self.dataset, shuffle=False) if torch.distributed.is_initialized() else None
        return DataLoader(self.dataset, batch_size=self.batch_size, sampler=sampler, shuffle=False)


class OptRegressor(Regressor):
    """:class:`Regressor` with a choice of optimizer (``"sgd"``: SGD+momentum, ``"adam"``: Adam with weight
    decay, both with a StepLR halving the lr every 2 steps, so restoring the schedule matters) and width."""

    def __init__(
        self, optimizer: str = "adam", d_in: int = 6, hidden: int = 16, d_out: int = 3, lr: Optional[float] = None
    ) -> None:
        default_lr = 0.1 if optimizer == "sgd" else 0.01
        super().__init__(d_in=d_in, hidden=hidden, d_out=d_out, lr=lr if lr is not None else default_lr)
        self.optimizer_name = optimizer

    def configure_optimizers(self) -> Any:
        return configure(self.optimizer_name, self.parameters(), self.lr)


def configure(name: str, params: Any, lr: float) -> Any:
    opt: torch.optim.Optimizer
    if name == "sgd":
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    elif name == "adam":
        opt = torch.optim.Adam(params, lr=lr, weight_decay=1e-3)
    elif name == "adamw":  # torch's AdamW: defaults hold a key its __init__ does not take
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    else:
        raise ValueError(name)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def reference_run(
    model: nn.Module, dataset: TensorDataset, global_batch: int, steps: int, optimizer: str
) -> tuple[torch.Tensor, dict[str, Any]]:
    """One process, plain torch: ``steps`` steps of ``optimizer`` (+ its StepLR) on batches of
    ``global_batch`` in order (repeating the data by epochs). Returns flat weights and optimizer.state_dict()."""
    import copy

    model = copy.deepcopy(model)
    cfg = configure(optimizer, model.parameters(), model.lr)
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
    done = 0
    while done < steps:
        for x, y in DataLoader(dataset, batch_size=global_batch, shuffle=False):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
            done += 1
            if done == steps:
                break
    return torch.cat([p.detach().flatten() for p in model.parameters()]), copy.deepcopy(opt.state_dict())


class Block(nn.Module):
    """Linear -> BatchNorm -> ReLU -> Dropout with a residual: the block the checkpointing tests wrap. A
    ``calls`` counter (a buffer the forward updates in place) shows a recompute does not update it twice."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x + self.drop(torch.relu(self.bn(self.linear(x))))


class BlockRegressor(Regressor):
    """:class:`Regressor` whose body is ``blocks`` residual :class:`Block` s with BatchNorm and dropout."""

    def __init__(self, blocks: int = 3, width: int = 16, dropout: float = 0.2, lr: float = 0.05) -> None:
        super().__init__(lr=lr)
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(6, width), *(Block(width, dropout) for _ in range(blocks)), nn.Linear(width, 3)
        )


class Predictor(Regressor):
    """:class:`Regressor` whose ``predict_step`` returns the outputs of a batch of ``(x, y)``: a tensor
    (``output="tensor"``), or a dict with a nested tuple and a ``None`` (``output="dict"``), each with the batch
    dimension first."""

    def __init__(self, output: str = "tensor") -> None:
        super().__init__()
        self.output = output

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        x, y = batch
        out = self(x)
        if self.output == "tensor":
            return out
        return {"out": out, "pair": (x.sum(dim=1), y), "none": None}
