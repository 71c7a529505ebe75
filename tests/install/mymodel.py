"""A user's own module, as the install check (`make test-install`) writes it beside cfg.yaml: layers as plain
attributes, its data in its own train_dataloader(). The check rewrites the first import for the `lightning`
distribution (`import lightning.pytorch as pl`)."""

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class MyModel(pl.LightningModule):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, hidden)
        self.fc2 = torch.nn.Linear(hidden, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
        return DataLoader(data, batch_size=8)
