"""A corpus of models written as users write them, for ``tests/integration/test_corpus.py``: one from a well-kept
library (a transformers GPT-2 from a tiny random config: no download) and plain-PyTorch shapes that break assumptions a
strategy might make: layers as plain attributes, a cast in ``__init__``, tied weights, frozen parameters,
buffers, several optimizers (manual optimization), a ``training_step`` that returns a dict.

``UNFRIENDLY``: modules that hold what a planner cannot copy or fake (their datasets and loaders, a tokenizer,
tensors inside their own objects, locks, open files, generators, lambdas, loggers, a Hugging Face model with its
data) or that make their layers late (``nn.LazyLinear``, layers made in ``configure_model``).

Every model trains on a :class:`CorpusData` dataset of ``(inputs, targets)`` in float64 (token ids for the
language models) and is deterministic from its constructor, so two processes can be compared with one.
"""

from __future__ import annotations

import itertools
import logging
import tempfile
import threading
from io import StringIO
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

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


class LoRAGPT2(HFGPT2):
    """The transformers GPT-2 of :class:`HFGPT2` with ``peft`` LoRA adapters on its attention and MLP
    projections: the base frozen, only the adapters (and nothing else) trainable; ``seed`` makes another base
    (for the tests that must refuse a resume onto it). Not in :data:`MODELS` (its own tests train it under every
    preset family)."""

    def __init__(self, seed: int = 0, rank: int = 4, optimizer: str = "adamw") -> None:
        super().__init__()
        self.optimizer_name = optimizer
        from peft import LoraConfig, get_peft_model

        if seed:
            torch.manual_seed(seed)
            for p in self.model.parameters():
                p.data.normal_(0.0, 0.02)
        torch.manual_seed(100)
        config = LoraConfig(
            r=rank, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True
        )
        self.model = get_peft_model(self.model, config)
        # peft starts lora_B at zero (the adapted model is the base at step 0); a random start makes every
        # adapter matrix's gradient non-zero from the first step, so that parity covers all of them
        for name, p in self.model.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0.0, 0.05)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self(batch[0]).loss
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        trainable = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "sgd":  # plain SGD: weight averaging every step is then gradient averaging
            return torch.optim.SGD(trainable, lr=0.1)
        return torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.0)


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


class HoldsDatasets(PlainAttributes):
    """Its datasets as attributes (``self.train_ds``), as many tutorials write it."""

    def __init__(self) -> None:
        super().__init__()
        self.train_ds = regression_data()
        self.val_ds = regression_data(8)


class HoldsLoaders(PlainAttributes):
    """A data loader (with its dataset, sampler and a torch.Generator) kept as an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.loader = DataLoader(regression_data(), batch_size=4, shuffle=True, generator=torch.Generator())


class HoldsTokenizer(TiedWeights):
    """A Hugging Face fast tokenizer built in memory (a word-level vocabulary: no download); the loss ignores
    its padding id."""

    def __init__(self) -> None:
        super().__init__()
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {str(i): i for i in range(VOCAB - 1)} | {"[PAD]": VOCAB - 1}
        raw = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
        raw.pre_tokenizer = pre_tokenizers.Whitespace()
        self.tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        logits = self(ids).flatten(0, 1)
        return F.cross_entropy(logits, targets.flatten(), ignore_index=self.tokenizer.pad_token_id)


class Normalizer:
    """A plain object holding tensors (not a module: its tensors are neither parameters nor buffers)."""

    def __init__(self) -> None:
        self.stats = {"mean": torch.linspace(-0.5, 0.5, D_IN, dtype=torch.float64), "std": torch.full((D_IN,), 2.0)}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.stats["mean"]) / self.stats["std"].to(x.dtype)


class TensorsInObjects(PlainAttributes):
    """Tensors inside its own objects, used in ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.normalize = Normalizer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.normalize(x))


class HoldsLocks(PlainAttributes):
    """A lock and a re-entrant lock (neither can be copied or pickled), taken in ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.rlock = threading.RLock()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with self.lock, self.rlock:
            return super().training_step(batch, batch_idx)


class HoldsOpenFile(PlainAttributes):
    """An open file (written at each epoch's end)."""

    def __init__(self) -> None:
        super().__init__()
        self.journal = tempfile.TemporaryFile("w+")

    def on_train_epoch_end(self) -> None:
        self.journal.write(f"epoch {self.current_epoch}\n")


class HoldsGenerators(PlainAttributes):
    """A Python generator (advanced in ``training_step``) and a torch.Generator."""

    def __init__(self) -> None:
        super().__init__()
        self.counter = (i for i in itertools.count())
        self.rng = torch.Generator().manual_seed(0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        next(self.counter)
        return super().training_step(batch, batch_idx)


class HoldsLambdas(PlainAttributes):
    """Its activation and loss as lambdas."""

    def __init__(self) -> None:
        super().__init__()
        self.activation = lambda x: torch.tanh(x)
        self.loss_fn = lambda out, y: F.mse_loss(out, y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.activation(self.fc2(self.activation(self.fc1(x)))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(self(x), y)


class HoldsLogger(PlainAttributes):
    """A ``logging.Logger`` with a handler on an in-memory stream, called in ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.console = logging.getLogger(f"corpus.{id(self)}")
        self.console.addHandler(logging.StreamHandler(StringIO()))
        self.console.setLevel(logging.INFO)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.console.info("step %d", batch_idx)
        return super().training_step(batch, batch_idx)


class HFGPT2WithData(HFGPT2):
    """The transformers GPT-2 holding its token dataset and a loader of it."""

    def __init__(self) -> None:
        super().__init__()
        self.train_ds = token_data()
        self.loader = DataLoader(self.train_ds, batch_size=4)


class LazyLayers(pl.LightningModule):
    """``nn.LazyLinear`` layers, materialized in ``configure_model`` by a forward of one row (DDP needs them
    materialized before it wraps the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.LazyLinear(16, dtype=torch.float64), nn.Tanh(), nn.LazyLinear(D_OUT, dtype=torch.float64)
        )

    def configure_model(self) -> None:
        if any(isinstance(m, nn.modules.lazy.LazyModuleMixin) for m in self.net):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                self.net(torch.zeros(1, D_IN, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class LayersInConfigureModel(pl.LightningModule):
    """No layer until ``configure_model`` (called by Lightning before the strategy sets up), made once."""

    def __init__(self) -> None:
        super().__init__()
        self.net: Optional[nn.Module] = None

    def configure_model(self) -> None:
        if self.net is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                self.net = nn.Sequential(
                    nn.Linear(D_IN, 16, dtype=torch.float64), nn.Tanh(), nn.Linear(16, D_OUT, dtype=torch.float64)
                )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.net is not None
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


#: name -> (model factory, dataset factory): modules that hold what cannot be copied, or make their layers late
UNFRIENDLY: dict[str, tuple[Callable[[], pl.LightningModule], Callable[[], TensorDataset]]] = {
    "datasets": (HoldsDatasets, regression_data),
    "loaders": (HoldsLoaders, regression_data),
    "tokenizer": (HoldsTokenizer, token_data),
    "tensors_in_objects": (TensorsInObjects, regression_data),
    "locks": (HoldsLocks, regression_data),
    "open_file": (HoldsOpenFile, regression_data),
    "generators": (HoldsGenerators, regression_data),
    "lambdas": (HoldsLambdas, regression_data),
    "logger": (HoldsLogger, regression_data),
    "hf_gpt2_with_data": (HFGPT2WithData, token_data),
    "lazy_layers": (LazyLayers, regression_data),
    "layers_in_configure_model": (LayersInConfigureModel, regression_data),
}


def build(name: str) -> pl.LightningModule:
    """The corpus model ``name`` (of :data:`MODELS` or :data:`UNFRIENDLY`) in float64 (the models that cast in
    ``__init__`` or make their layers in float64 already are)."""
    model = {**MODELS, **UNFRIENDLY}[name][0]()
    return model.double()
