"""The tensor-parallel tests' models: a tiny Llama-style transformer (grouped-query attention, SwiGLU MLP, RMSNorm)
in float64, its one-process reference, and a shrunk copy of Lightning's own tensor-parallel example (its model and
its hand-written ``parallelize``, from ``examples/pytorch/tensor_parallel`` of Lightning's repository), which a
module written for Lightning's ``ModelParallelStrategy`` applies in ``configure_model``."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ = 16, 6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, bias: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads, bias)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TinyLlama(nn.Module):
    def __init__(self, dim: int = 8, layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2, bias: bool = False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, n_kv_heads, 2 * dim, bias) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def token_data(n: int = 24) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randint(VOCAB, (n, SEQ + 1), generator=g))


def indexed_data(n: int = 10) -> TensorDataset:
    """Evaluation samples with their index (``TPModule.validation_step`` records which it sees)."""
    return TensorDataset(token_data(n).tensors[0], torch.arange(n))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB).double(), tokens[:, 1:].reshape(-1))


class TPModule(pl.LightningModule):
    """The tiny Llama as a LightningModule, in float64 (SGD with momentum; no plan of its own). ``tokens``: the
    training step returns the summed token loss and the token count (``loss_normalization="tokens"``). The
    validation step records the indices of the samples it sees (``seen``)."""

    def __init__(self, bias: bool = False, lr: float = 0.5, tokens: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyLlama(bias=bias).double()
        self.lr = lr
        self.tokens = tokens
        self.seen: list[int] = []

    @staticmethod
    def compute(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """The training loss of ``model`` on ``tokens`` (the one-process reference calls it too)."""
        return lm_loss(model, tokens)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self.compute(self.model, batch[0])
        if self.tokens:
            count = batch[0][:, 1:].numel()
            return {"loss": loss * count, "num_tokens": count}
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        tokens, index = batch
        self.seen += index.tolist()
        self.log("val_loss", self.compute(self.model, tokens), sync_dist=True, batch_size=len(index))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class ListTPModule(TPModule):
    """The tiny Llama's layers held by the LightningModule itself, its blocks in a bare ``nn.ModuleList`` that
    ``forward`` iterates (as tutorials write a module): no container of the model's own around them. ``model`` is the
    module itself (what :func:`reference` copies and :meth:`TPModule.compute` calls)."""

    def __init__(self) -> None:
        super().__init__()
        tiny = self._modules.pop("model")
        assert isinstance(tiny, TinyLlama)
        self.tok_embeddings, self.layers = tiny.tok_embeddings, tiny.layers
        self.norm, self.output = tiny.norm, tiny.output

    @property
    def model(self) -> nn.Module:  # type: ignore[override]
        return self

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def global_batches(dataset: TensorDataset, data_ranks: int, batch_size: int, epoch: int) -> list[torch.Tensor]:
    """The global micro-batches of an epoch as Lightning's automatic sampler deals them (it shuffles a training
    loader, seed 0 + epoch): data rank ``r`` takes every ``data_ranks``-th index from ``r``, in batches of
    ``batch_size``; global micro-batch ``j`` is every data rank's ``j``-th batch."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(epoch)).tolist()
    shares = [order[r::data_ranks] for r in range(data_ranks)]
    count = len(shares[0]) // batch_size + (len(shares[0]) % batch_size > 0)
    return [
        torch.cat([dataset.tensors[0][s[j * batch_size : (j + 1) * batch_size]] for s in shares]) for j in range(count)
    ]


def reference(
    module: TPModule,
    dataset: TensorDataset,
    data_ranks: Sequence[int],
    batch_size: int = 2,
    accumulate: int = 1,
    clip: Optional[float] = None,
    limit: Optional[int] = None,
    after_step: Optional[Callable[[nn.Module], None]] = None,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the global batch, one epoch per entry of ``data_ranks`` (the data ranks of that epoch): the
    state_dict after training as the LightningModule describes it, with Lightning's loss / k over the k
    micro-batches of each step and clipping by the global norm (``limit``: micro-batches per epoch); and each step's
    gradient norm before clipping. ``after_step``: called with the model after each optimizer step."""
    model = copy.deepcopy(module.model)
    opt = torch.optim.SGD(model.parameters(), lr=module.lr, momentum=0.9)
    norms = []
    for epoch, ranks in enumerate(data_ranks):
        batches = global_batches(dataset, ranks, batch_size, epoch)[:limit]
        for i in range(0, len(batches) - len(batches) % accumulate, accumulate):
            opt.zero_grad(set_to_none=True)
            for tokens in batches[i : i + accumulate]:
                (module.compute(model, tokens) / accumulate).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf"))))
            opt.step()
            if after_step is not None:
                after_step(model)
    return {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}, norms


class HFModule(TPModule):
    """A Hugging Face model from a tiny random config (no download), in float64: ``"llama"`` (its own
    ``base_model_tp_plan``), ``"bert"`` (masked LM, the auto plan's BERT rule) or ``"gpt2"`` (its MLP's ``Conv1D``
    layers); the model computes its loss."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        import transformers as t

        sizes = {"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2}
        torch.manual_seed(0)
        if kind == "gpt2":
            config = t.GPT2Config(
                vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=SEQ + 1, resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="eager",
            )  # fmt: skip
            self.model = t.GPT2LMHeadModel(config).double()
        elif kind == "llama":
            config = t.LlamaConfig(**sizes, num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
            self.model = t.LlamaForCausalLM(config).double()
        else:
            config = t.BertConfig(
                **sizes, num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                max_position_embeddings=SEQ + 1, attn_implementation="eager",
            )  # fmt: skip
            self.model = t.BertForMaskedLM(config).double()

    @staticmethod
    def compute(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return model(input_ids=tokens, labels=tokens).loss


# --- Lightning's tensor-parallel example, shrunk (model.py and parallelism.py, rotary embedding left out) ----------


@dataclass
class ModelArgs:
    dim: int = 16
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: Optional[int] = None
    vocab_size: int = 32
    multiple_of: int = 8
    norm_eps: float = 1e-5


class ExampleAttention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        xk = self.wk(x).view(bs, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        xv = self.wv(x).view(bs, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        xk, xv = xk.repeat_interleave(self.n_rep, dim=1), xv.repeat_interleave(self.n_rep, dim=1)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        return self.wo(output.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class ExampleFeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int) -> None:
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ExampleRMSNorm(RMSNorm):
    pass


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = ExampleAttention(args)
        self.feed_forward = ExampleFeedForward(args.dim, 4 * args.dim, args.multiple_of)
        self.attention_norm = ExampleRMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = ExampleRMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = ExampleRMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h)).float()


def parallelize(model: Transformer, device_mesh: Any) -> Transformer:
    """Lightning's example ``parallelize`` (torchtitan's), as written there: tensor parallelism with sequence
    parallelism and the loss over the sharded vocabulary, then FSDP2 over the data dimension (float32 here)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    dp_mesh, tp_mesh = device_mesh["data_parallel"], device_mesh["tensor_parallel"]
    if tp_mesh.size() > 1:
        plan = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
            "norm": SequenceParallel(),
            "layers.0": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
            ),
        }
        model = parallelize_module(model, tp_mesh, plan)
        for block in model.layers.values():
            plan = {
                "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "attention_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
                "ffn_norm": SequenceParallel(),
            }
            block.attention.n_heads //= tp_mesh.size()
            block.attention.n_kv_heads //= tp_mesh.size()
            parallelize_module(block, tp_mesh, plan)
    if dp_mesh.size() > 1:
        for layer_id, block in model.layers.items():
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=int(layer_id) < len(model.layers) - 1)
        fully_shard(model, mesh=dp_mesh)
    return model


def example_tokens(n: int = 16, seq: int = 8, vocab: int = 32) -> torch.Tensor:
    return torch.randint(vocab, (n, seq + 1), generator=torch.Generator().manual_seed(42))


class Llama3(pl.LightningModule):
    """Lightning's example LightningModule (``train.py``), shrunk: written for ``ModelParallelStrategy``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model_args = ModelArgs()
        self.model = Transformer(self.model_args)
        self.losses: list[float] = []

    def configure_model(self) -> None:
        parallelize(self.model, device_mesh=self.device_mesh)

    def training_step(self, batch: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        inputs, labels = batch[:, :-1], batch[:, 1:]
        output = self.model(inputs)
        with loss_parallel():
            loss = F.cross_entropy(output.reshape(-1, output.size(-1)), labels.reshape(-1))
        self.losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
        return loss

    def backward(self, *args: Any, **kwargs: Any) -> None:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            super().backward(*args, **kwargs)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3, foreach=True)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(example_tokens(), batch_size=2)
