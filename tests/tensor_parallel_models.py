"""The tensor-parallel tests' models: a tiny Llama-style transformer (grouped-query attention, SwiGLU MLP, RMSNorm)
in float64, its one-process reference, and a shrunk copy of Lightning's own tensor-parallel example (its model and
its hand-written ``parallelize``, from ``examples/pytorch/tensor_parallel`` of Lightning's repository), which a
module written for Lightning's ``ModelParallelStrategy`` applies in ``configure_model``."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, cast

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


# --- the families the auto plan recognises by their structure, written as their projects write them ---------------
# litgpt 0.5.13 (``litgpt/model.py``: ``GPT``, ``Block``, ``CausalSelfAttention``, ``LLaMAMLP``, ``GptNeoxMLP``,
# ``build_rope_cache``, ``apply_rope``; without the key/value cache), used where the ``litgpt`` package is not installed


@dataclass
class LitConfig:
    """The fields of litgpt's ``Config`` its GPT reads here (``n_query_groups``: key/value heads)."""

    n_embd: int = 16
    n_head: int = 4
    n_query_groups: int = 4
    n_layer: int = 2
    block_size: int = 8
    padded_vocab_size: int = VOCAB
    intermediate_size: int = 32
    mlp_class_name: str = "LLaMAMLP"
    parallel_residual: bool = False
    bias: bool = True
    norm_eps: float = 1e-5
    rope_base: int = 10000
    head_size: Optional[int] = None
    rope_n_elem: int = 0

    def __post_init__(self) -> None:
        if self.head_size is None:
            self.head_size = self.n_embd // self.n_head
        self.rope_n_elem = self.head_size  # rotary_percentage=1.0


def build_rope_cache(seq_len: int, n_elem: int, base: int = 10000) -> tuple[torch.Tensor, torch.Tensor]:
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2).float() / n_elem))
    seq_idx = torch.arange(seq_len).float()
    idx_theta = torch.outer(seq_idx, theta).repeat(1, 2)
    return torch.cos(idx_theta), torch.sin(idx_theta)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    head_size_half = x.size(-1) // 2
    x1 = x[..., :head_size_half]
    x2 = x[..., head_size_half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    dims_diff = x.dim() - cos.dim()
    if dims_diff > 0:
        new_shape = cos.shape[0:1] + (1,) * dims_diff + cos.shape[1:]
        cos = cos.view(*new_shape)
        sin = sin.view(*new_shape)
    roped = (x * cos) + (rotated * sin)
    return roped.to(dtype=x.dtype)


class LitCausalSelfAttention(nn.Module):
    def __init__(self, config: LitConfig, block_idx: int) -> None:
        super().__init__()
        head_size = cast(int, config.head_size)
        self.qkv = nn.Linear(config.n_embd, (config.n_head + 2 * config.n_query_groups) * head_size, bias=config.bias)
        self.proj = nn.Linear(head_size * config.n_head, config.n_embd, bias=config.bias)
        self.config = config

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any = None) -> torch.Tensor:
        head_size = cast(int, self.config.head_size)
        n_head = self.config.n_head
        n_query_groups = self.config.n_query_groups
        rope_n_elem = self.config.rope_n_elem
        B, T, _ = x.size()
        qkv = self.qkv(x)
        query_size = n_head * head_size
        key_size = value_size = n_query_groups * head_size
        q, k, v = qkv.split((query_size, key_size, value_size), dim=-1)
        q = q.view(B, T, n_head, head_size)
        k = k.view(B, T, n_query_groups, head_size)
        v = v.view(B, T, n_query_groups, head_size)
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
        q_roped = apply_rope(q[..., :rope_n_elem], cos, sin)
        k_roped = apply_rope(k[..., :rope_n_elem], cos, sin)
        q = torch.cat((q_roped, q[..., rope_n_elem:]), dim=-1)
        k = torch.cat((k_roped, k[..., rope_n_elem:]), dim=-1)
        if n_query_groups != n_head:
            q_per_kv = n_head // n_query_groups
            k = k.repeat_interleave(q_per_kv, dim=1)
            v = v.repeat_interleave(q_per_kv, dim=1)
        scale = 1.0 / math.sqrt(head_size)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale, is_causal=mask is None)
        y = y.transpose(1, 2)
        y = y.reshape(B, T, head_size * n_head)
        return self.proj(y)


class LitLLaMAMLP(nn.Module):
    def __init__(self, config: LitConfig) -> None:
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fc_1 = self.fc_1(x)
        x_fc_2 = self.fc_2(x)
        x = F.silu(x_fc_1) * x_fc_2
        return self.proj(x)


class LitGptNeoxMLP(nn.Module):
    def __init__(self, config: LitConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        x = F.gelu(x, approximate="none")
        return self.proj(x)


class LitBlock(nn.Module):
    def __init__(self, config: LitConfig, block_idx: int) -> None:
        super().__init__()
        self.norm_1 = nn.LayerNorm(config.n_embd, eps=config.norm_eps)
        self.attn = LitCausalSelfAttention(config, block_idx)
        self.post_attention_norm = nn.Identity()
        self.norm_2 = nn.LayerNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = LitLLaMAMLP(config) if config.mlp_class_name == "LLaMAMLP" else LitGptNeoxMLP(config)
        self.post_mlp_norm = nn.Identity()
        self.config = config

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any = None) -> torch.Tensor:
        x_normed = self.norm_1(x)
        attention_output = self.attn(x_normed, cos, sin, mask)
        attention_output = self.post_attention_norm(attention_output)
        if self.config.parallel_residual:
            x_normed = self.norm_2(x)
            x = attention_output + x
        else:
            x = attention_output + x
            x_normed = self.norm_2(x)
        return self.post_mlp_norm(self.mlp(x_normed)) + x


class LitGPT(nn.Module):
    def __init__(self, config: LitConfig) -> None:
        super().__init__()
        self.config = config
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
                h=nn.ModuleList(LitBlock(config, block_idx) for block_idx in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.norm_eps),
            )
        )
        cos, sin = build_rope_cache(config.block_size, config.rope_n_elem, config.rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        cos = self.cos[:T].unsqueeze(0)
        sin = self.sin[:T].unsqueeze(0)
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, cos, sin, None)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)


def litgpt_model(n_query_groups: int = 4, mlp_class_name: str = "LLaMAMLP") -> nn.Module:
    """litgpt's ``GPT`` from a tiny config: the ``litgpt`` package where it is installed, else the copy above."""
    sizes: dict[str, Any] = dict(n_embd=16, n_head=4, n_query_groups=n_query_groups, n_layer=2, block_size=8)
    sizes.update(padded_vocab_size=VOCAB, intermediate_size=32, mlp_class_name=mlp_class_name, bias=True)
    try:
        from litgpt.config import Config
        from litgpt.model import GPT
    except ImportError:
        return LitGPT(LitConfig(**sizes))
    config = Config(
        **sizes, vocab_size=VOCAB, rotary_percentage=1.0, parallel_residual=False, norm_class_name="LayerNorm",
        norm_eps=1e-5, lm_head_bias=False,
    )  # fmt: skip
    return GPT(config)


# nanoGPT (``model.py``: ``LayerNorm``, ``CausalSelfAttention``, ``MLP``, ``Block``, ``GPT``; without generation)


@dataclass
class NanoConfig:
    block_size: int = 8
    vocab_size: int = VOCAB
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 16
    dropout: float = 0.0
    bias: bool = True


class NanoLayerNorm(nn.Module):
    """LayerNorm but with an optional bias."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoCausalSelfAttention(nn.Module):
    def __init__(self, config: NanoConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.flash = hasattr(torch.nn.functional, "scaled_dot_product_attention")
        if not self.flash:
            self.register_buffer(
                "bias", torch.tril(torch.ones(config.block_size, config.block_size)).view(
                    1, 1, config.block_size, config.block_size
                ),
            )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
            )
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        y = self.resid_dropout(self.c_proj(y))
        return y


class NanoMLP(nn.Module):
    def __init__(self, config: NanoConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


class NanoBlock(nn.Module):
    def __init__(self, config: NanoConfig) -> None:
        super().__init__()
        self.ln_1 = NanoLayerNorm(config.n_embd, bias=config.bias)
        self.attn = NanoCausalSelfAttention(config)
        self.ln_2 = NanoLayerNorm(config.n_embd, bias=config.bias)
        self.mlp = NanoMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class NanoGPT(nn.Module):
    def __init__(self, config: NanoConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([NanoBlock(config) for _ in range(config.n_layer)]),
                ln_f=NanoLayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> Any:
        device = idx.device
        b, t = idx.size()  # noqa: RUF059 - as nanoGPT writes it
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


# timm's ViT (``timm/layers``: ``PatchEmbed``, ``Attention``, ``Mlp``; ``timm/models/vision_transformer.py``: ``Block``,
# ``VisionTransformer`` with class-token pooling; no drop-path, no layer scale)


class TimmPatchEmbed(nn.Module):
    def __init__(self, img_size: int = 8, patch_size: int = 4, in_chans: int = 1, embed_dim: int = 16) -> None:
        super().__init__()
        self.img_size = (img_size, img_size)
        self.patch_size = (patch_size, patch_size)
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.norm = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        x = x.flatten(2).transpose(1, 2)  # NCHW -> NLC
        return self.norm(x)


class TimmAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attn_dim = num_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.fused_attn = True
        self.qkv = nn.Linear(dim, self.attn_dim * 3, bias=qkv_bias)
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.norm = nn.Identity()
        self.proj = nn.Linear(self.attn_dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape  # noqa: RUF059 - as timm writes it
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        x = x.transpose(1, 2).reshape(B, N, self.attn_dim)
        x = self.norm(x)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class TimmMlp(nn.Module):
    def __init__(self, in_features: int, hidden_features: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(0.0)
        self.norm = nn.Identity()
        self.fc2 = nn.Linear(hidden_features, in_features)
        self.drop2 = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        x = self.act(x)
        x = self.drop1(x)
        x = self.norm(x)
        x = self.fc2(x)
        x = self.drop2(x)
        return x


class TimmBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = TimmAttention(dim, num_heads=num_heads)
        self.ls1 = nn.Identity()
        self.drop_path1 = nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = TimmMlp(dim, int(dim * mlp_ratio))
        self.ls2 = nn.Identity()
        self.drop_path2 = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


class TimmViT(nn.Module):
    def __init__(self, img_size: int = 8, patch_size: int = 4, num_classes: int = VOCAB, embed_dim: int = 16,
                 depth: int = 2, num_heads: int = 4) -> None:  # fmt: skip
        super().__init__()
        self.patch_embed = TimmPatchEmbed(img_size, patch_size, 1, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, self.patch_embed.num_patches + 1, embed_dim) * 0.02)
        self.pos_drop = nn.Dropout(0.0)
        self.blocks = nn.Sequential(*[TimmBlock(embed_dim, num_heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = self.pos_drop(x + self.pos_embed)
        x = self.blocks(x)
        x = self.norm(x)
        return self.head(x[:, 0])


def images_of(tokens: torch.Tensor) -> torch.Tensor:
    """8 x 8 one-channel images from the token rows (their first four tokens one-hot), for the ViT."""
    return F.one_hot(tokens[:, :4], VOCAB).to(torch.float64).view(-1, 1, 8, 8)


def plain_mlp() -> nn.Sequential:
    """A plain MLP as tutorials write one: the one-hot input tokens in, the next token's logits out."""
    return nn.Sequential(nn.Linear(SEQ * VOCAB, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, VOCAB))


#: family -> (its model, the loss of that model on a batch of token rows)
FAMILIES: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module, torch.Tensor], torch.Tensor]]] = {
    "litgpt": (lambda: litgpt_model(4), lambda m, t: lm_loss(m, t)),
    "litgpt_gqa": (lambda: litgpt_model(2), lambda m, t: lm_loss(m, t)),
    "nanogpt": (lambda: NanoGPT(NanoConfig()), lambda m, t: m(t[:, :-1], t[:, 1:].contiguous())[1]),
    "vit": (lambda: TimmViT(), lambda m, t: F.cross_entropy(m(images_of(t)), t[:, -1])),
    "mlp": (plain_mlp, lambda m, t: F.cross_entropy(m(F.one_hot(t[:, :-1], VOCAB).flatten(1).double()), t[:, -1])),
    # torchtitan's Llama as written (wq/wk/wv/wo, w1/w3/w2, n_heads/n_kv_heads): split by the name rules
    "llama": (lambda: TinyLlama(), lambda m, t: lm_loss(m, t)),
}


class FamiliesModule(TPModule):
    """Several families side by side (``model.<family>``), trained on one loss, their sum: each family's weights
    depend on its own loss only."""

    def __init__(self, families: Sequence[str] = tuple(FAMILIES)) -> None:
        super().__init__(lr=0.1)
        torch.manual_seed(0)
        self.model = nn.ModuleDict({f: FAMILIES[f][0]().double() for f in families})

    @staticmethod
    def compute(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return sum(
            (FAMILIES[f][1](m, tokens) for f, m in cast(nn.ModuleDict, model).items()),
            torch.zeros((), dtype=torch.float64),
        )
