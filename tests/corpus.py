"""A corpus of models written as users write them, for ``tests/integration/test_corpus.py``: one from a well-kept
library (a transformers GPT-2 from a tiny random config: no download) and plain-PyTorch shapes that break assumptions a
strategy might make: layers as plain attributes, a cast in ``__init__``, tied weights, frozen parameters,
buffers, several optimizers (manual optimization), a ``training_step`` that returns a dict.

Every model trains on a :class:`CorpusData` dataset of ``(inputs, targets)`` in float64 (token ids for the
language models) and is deterministic from its constructor, so two processes can be compared with one.
"""

from __future__ import annotations

from typing import Any, Callable

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

D_IN, D_OUT, VOCAB, SEQ = 6, 3, 32, 8


def regression_data(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(n, D_IN, generator=g, dtype=torch.float64), torch.randn(n, D_OUT, generator=g, dtype=torch.float64)
    )


def token_data(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return TensorDataset(ids, ids.clone())


class PlainAttributes(pl.LightningModule):
    """Layers as plain attributes of the LightningModule (no container), the activation as a function."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(D_IN, 16)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class CastInInit(pl.LightningModule):
    """Casts itself in ``__init__`` (``.to(dtype)`` and ``.double()``), as users do to pick the precision."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(D_IN, 16), nn.GELU(), nn.Linear(16, D_OUT))
        self.to(torch.float64)
        self.extra = nn.Linear(D_OUT, D_OUT).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.extra(self.net(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class TiedWeights(pl.LightningModule):
    """A tiny language model whose output projection is its embedding (one Parameter, two modules)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.out = nn.Linear(16, VOCAB, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.embed(ids))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        return F.cross_entropy(self(ids).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class FrozenParameters(pl.LightningModule):
    """A frozen first layer (``requires_grad_(False)``): a feature extractor under a trained head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(D_IN, 16), nn.Tanh())
        self.backbone.requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, D_OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


class WithBuffers(pl.LightningModule):
    """Persistent and non-persistent buffers: a fixed input normalisation and a step counter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("mean", torch.linspace(-0.5, 0.5, D_IN, dtype=torch.float64))
        self.register_buffer("scale", torch.full((D_IN,), 2.0, dtype=torch.float64), persistent=False)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.net = nn.Sequential(nn.Linear(D_IN, 16), nn.Tanh(), nn.Linear(16, D_OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.mean) * self.scale)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.seen += x.shape[0]
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class TwoOptimizers(pl.LightningModule):
    """Several optimizers: manual optimization, each optimizer stepping its own half (an encoder and a head with
    their own learning rates), as Lightning 2 requires for more than one optimizer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.encoder = nn.Sequential(nn.Linear(D_IN, 16), nn.Tanh())
        self.head = nn.Linear(16, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        enc_opt, head_opt = self.optimizers()
        enc_opt.zero_grad()
        head_opt.zero_grad()
        self.manual_backward(F.mse_loss(self(x), y))
        enc_opt.step()
        head_opt.step()

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.SGD(self.encoder.parameters(), lr=0.1, momentum=0.9),
            torch.optim.SGD(self.head.parameters(), lr=0.05),
        )


class DictStep(pl.LightningModule):
    """``training_step`` returns a dict with ``"loss"`` and more, and logs a value."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(D_IN, 16), nn.ReLU(), nn.Linear(16, D_OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        out = self(x)
        loss = F.mse_loss(out, y)
        self.log("train_loss", loss)
        return {"loss": loss, "abs_error": (out - y).abs().mean().detach()}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class HFGPT2(pl.LightningModule):
    """A transformers GPT-2 language model from a tiny random config (no download): tied input and output
    embeddings, a causal-mask buffer, dropout off so that the runs can be compared."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        config = GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=16,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        self.model = GPT2LMHeadModel(config)

    def forward(self, ids: torch.Tensor) -> Any:
        return self.model(input_ids=ids, labels=ids)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, _ = batch
        return self(ids).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.0)


#: name -> (model factory, dataset factory)
MODELS: dict[str, tuple[Callable[[], pl.LightningModule], Callable[[], TensorDataset]]] = {
    "plain_attributes": (PlainAttributes, regression_data),
    "cast_in_init": (CastInInit, regression_data),
    "tied_weights": (TiedWeights, token_data),
    "frozen_parameters": (FrozenParameters, regression_data),
    "buffers": (WithBuffers, regression_data),
    "two_optimizers": (TwoOptimizers, regression_data),
    "dict_step": (DictStep, regression_data),
    "hf_gpt2": (HFGPT2, token_data),
}


def build(name: str) -> pl.LightningModule:
    """The corpus model ``name`` in float64 (the models that cast in ``__init__`` already are)."""
    model = MODELS[name][0]()
    return model.double()
