"""The multi-GPU training article's two recipes for reproducing a batch-64 result on a batch-16 device, measured.

    python benchmarks/bench_lr_recipes.py              # digits MLP, float64, SGD and Adam, 10 epochs

The paper's setting: batch 64, learning rate lr. The two ways the article ("深度学习多卡训练", on multi-GPU
training, its gradient-accumulation section) gives to get there with batch 16:

* recipe 1: batch 16, lr/4, no accumulation (4 small steps per 64 samples);
* recipe 2: batch 16, lr, accumulation 4 (one step on the mean gradient of 64 samples);

against the reference (batch 64, lr, 1 process) and ``mgpu_ddp`` on 2 processes x batch 8 x accumulation 4
(effective 64, lr). The article argues both recipes equal the reference. Reported per optimizer: test
accuracy, and the distance of the final weights to the reference's, relative to how far the reference
moved from the initial weights. The model has no BatchNorm (BN statistics depend on the micro-batch).
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, Subset

from lightning_mgpu import MGPUDDPStrategy
from lightning_mgpu.examples import DigitsDataModule


class DigitsMLP(pl.LightningModule):
    def __init__(self, optimizer: str, lr: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
        self.optimizer, self.lr = optimizer, lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class OrderedData(DigitsDataModule):
    """The same sample order for every runner: the split's fixed order, dealt across ranks by
    DistributedSampler without shuffle (as the parity tests do), and 1152 = 18 x 64 samples, so every
    runner ends each epoch on a whole batch of 64 (a shorter last window would be weighted differently)."""

    def train_dataloader(self) -> DataLoader:
        dataset = Subset(self._splits[0], range(1152))  # type: ignore[index]
        sampler = DistributedSampler(dataset, shuffle=False) if torch.distributed.is_initialized() else None
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, shuffle=False)


class SaveWeights(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()}, self.out)


def train(optimizer: str, lr: float, batch: int, k: int, devices: int, epochs: int, out: Path) -> dict[str, Any]:
    model = DigitsMLP(optimizer, lr)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=MGPUDDPStrategy(start_method="fork") if devices > 1 else "auto",
        precision="64-true",
        max_epochs=epochs,
        accumulate_grad_batches=k,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SaveWeights(out)],
    )
    trainer.fit(model, OrderedData(batch_size=batch))
    torch.set_num_threads(1)
    state = torch.load(out)
    eval_model = DigitsMLP(optimizer, lr).double()
    eval_model.load_state_dict(state)
    data = DigitsDataModule()
    data.setup()
    with torch.no_grad():
        correct = sum(int((eval_model(x.double()).argmax(1) == y).sum()) for x, y in data.test_dataloader())
    accuracy = correct / data.hparams["test_size"]
    return {"state": state, "accuracy": accuracy}


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.flatten() for v in state.values()])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    init = flat(copy.deepcopy(DigitsMLP("sgd", 0.0).double().state_dict()))
    runs = {
        "reference: batch 64, lr": (64, 1, 1, 1.0),
        "recipe 1: batch 16, lr/4, k=1": (16, 1, 1, 0.25),
        "recipe 2: batch 16, lr, k=4": (16, 4, 1, 1.0),
        "mgpu_ddp: 2 x batch 8, lr, k=4": (8, 4, 2, 1.0),
    }
    print(f"digits MLP (64-64-10, no BN), float64, {args.epochs} epochs, same sample order for every runner")
    with tempfile.TemporaryDirectory() as tmp:
        for optimizer, lr in (("sgd", 0.4), ("adam", 4e-3)):
            print(f"\n{optimizer} (lr = {lr}):")
            print(f"  {'runner':34s} {'test acc':>8s} {'|w - w_ref| / |w_ref - w0|':>28s}")
            ref = None
            for name, (batch, k, devices, lr_mult) in runs.items():
                result = train(optimizer, lr * lr_mult, batch, k, devices, args.epochs, Path(tmp) / "w.pt")
                w = flat(result["state"])
                if ref is None:
                    ref = w
                distance = ((w - ref).norm() / (ref - init).norm()).item()
                print(f"  {name:34s} {result['accuracy']:8.4f} {distance:28.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
