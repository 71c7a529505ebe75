"""Tensor parallelism: each layer of the attention and MLP blocks split across the ranks of the
``"tensor_parallel"`` mesh dimension, without a hand-written plan.

A plan maps module names to ``torch.distributed.tensor.parallel`` styles, Megatron's pairing: the projections
that fan out (attention's query/key/value, the MLP's up/gate) are split by output column (``ColwiseParallel``:
each rank computes its heads or hidden units), the projection that fans back in (attention's output, the MLP's
down) by input row (``RowwiseParallel``: each rank multiplies its slice, one all-reduce sums them). Between the
two nothing is communicated; the weights and their gradients are ``DTensor`` shards that FSDP2 then shards
again over the data dimension.

``tensor_parallel_plan="auto"`` derives the plan:

* a Hugging Face model that ships one (``config.base_model_tp_plan``: Llama, Mistral, Qwen, ...) gets its own;
* otherwise each block is recognised by the names of its linear layers: Llama-style (``wq/wk/wv/wo``,
  ``q_proj/k_proj/v_proj/o_proj``; ``w1/w3/w2``, ``gate_proj/up_proj/down_proj``), BERT-style (``query/key/value``
  with the sibling ``output.dense``; ``intermediate.dense`` with ``output.dense``), ``fc1/fc2``,
  ``fc_in/fc_out``, in a module whose only layers with parameters they are (a norm or
  another layer beside them could sit between the split layers, so such a block stays whole); the attention
  module's head counts (``n_heads``, ``num_heads``, ``n_kv_heads``, ``num_key_value_heads``, ...) become the
  local counts (divided by the tensor size), as torchtitan does by hand. The forward must read the head count
  from those attributes or infer it from the width (``view(..., -1, head_dim)``), as these models do. Torch's
  ``nn.TransformerEncoderLayer``/``DecoderLayer`` gets its MLP split. GPT-2 (transformers' ``Conv1D`` layers) gets
  its MLP (``c_fc``/``c_proj``) and its attention split: ``c_attn`` packs query | key | value in one weight, so
  each rank holds the columns of its heads in each of the three (:func:`packed_conv1d_style`; the weight keeps its
  unsplit layout, so a gathered or saved tensor is the original one), ``c_proj`` by row, and the attention's
  ``num_heads``, ``split_size`` and ``embed_dim`` become the local values.

* the ``nn.Linear`` layers no name rule matches are paired by the model's structure (:func:`_structural_plan`): one
  forward on a small random input under a ``TorchFunctionMode`` follows each layer's output to the layer it feeds,
  through elementwise work, reshapes and attention's products, and a pair with nothing between them that has
  parameters, reduces, adds a residual or leaves the module is split once running its module as each rank would adds
  up to the whole output. One fan-out layer ``k`` times as wide as the fan-in layer's input packs ``k`` projections
  (litgpt's, nanoGPT's and timm's ``qkv``): :func:`packed_linear_style`. The head counts made local are the
  attention module's attributes and those of the ``config`` its forward reads (litgpt), on a copy of it. An attention
  laid out as nanoGPT's, whose forward reads its width from its input, is checked and split with nanoGPT's
  computation on local widths as its forward (:func:`_nanogpt_attention_forward`, installed when the plan is applied).
  An attention whose heads none of these split (grouped-query litgpt's ``qkv`` packs projections of unequal widths)
  has both its layers split by input column instead, its heads whole (:func:`input_split_style`).

Anything not matched (embeddings, norms, the output head, the packed query/key/value projection of
``nn.MultiheadAttention``) stays replicated and is listed in one line at start-up, with the share of the linear
layers' parameters the plan splits (:func:`split_share`). An auto plan that splits nothing or under
:data:`MIN_SPLIT_SHARE` of them is refused (:func:`refuse_unsplit`): each layer left whole named with why, a plan to
paste (:func:`suggested_plan`), and ``tensor_parallel_plan={}`` to train with every layer whole.

``tensor_parallel_plan="auto+sequence"`` adds sequence parallelism to that plan for a Llama-style model (torchtitan's
plan): one module whose only children with parameters are an ``nn.Embedding``, a list of blocks, a norm and an
``nn.Linear`` head as wide as the vocabulary, each block holding only norms and an attention and an MLP module the
auto plan splits whole. Between the blocks the residual stream is cut along the sequence (dim 1): the embedding is
split by vocabulary row and hands out its sequence shard, each norm runs on its shard (``SequenceParallel``), the
attention and the MLP gather the sequence at their input (``PrepareModuleInput``) and their row-wise projection
reduce-scatters it back (``output_layouts=Shard(1)``); the head is split by vocabulary column and its logits stay a
``DTensor`` sharded on the vocabulary, so the loss is computed over the sharded vocabulary (the strategy runs each
step and backward under torch's ``loss_parallel``). A Hugging Face Llama is recognised too: its base model computes
the positions and the causal mask from the embedding's output, so that stays whole and the first decoder layer cuts
the sequence. A Hugging Face GPT-2 likewise: its token and position embeddings hand out the whole sequence (the
positions and the causal mask are computed from it) and the first block cuts it (:func:`sequence_cut_style`); the
``c_proj`` of its attention and MLP (``Conv1D``) reduce-scatter back onto the sequence. A head tied to the embedding
(GPT-2's default) stays tied: both are split by vocabulary row (``Shard(0)``), and the head is given the embedding's
split parameter again after ``parallelize_module`` (which gives each its own copy). A model of another shape (BERT,
for instance) is refused with what did not match.

Example::

    plan = derive_plan(model, tensor_size=2)
    plan.styles    # {"layers.0.attention.wq": ColwiseParallel(), ..., "layers.0.feed_forward.w2": RowwiseParallel()}
    plan.summary() # "... split 14 layers (layers.*.attention.wq colwise, ...); replicated: tok_embeddings, norm, ..."
"""

from __future__ import annotations

import copy
import math
import re
import types
import weakref
from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Optional, cast

import torch
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.nn import functional as F

from lightning_mgpu import comm
from lightning_mgpu.ledger import CollectiveCounter, CommStats
from lightning_mgpu.settings import TENSOR_PARALLEL_STYLES

#: linear layers that fan out of the block's input (split by output column), and that fan back in (split by row)
_ATTENTION_IN = ("q_proj", "k_proj", "v_proj", "wq", "wk", "wv", "query", "key", "value")
_ATTENTION_OUT = ("o_proj", "wo", "out_proj")
_MLP_IN = ("gate_proj", "up_proj", "w1", "w3", "fc1", "fc_in")
_MLP_OUT = ("down_proj", "w2", "fc2", "fc_out")
#: attributes holding an attention module's head counts: each becomes the local count
_HEAD_COUNTS = (
    "n_heads",
    "num_heads",
    "n_kv_heads",
    "num_key_value_heads",
    "num_attention_heads",
    "n_head",
    "n_local_heads",
    "n_local_kv_heads",
)
#: attributes holding the width of each projection packed in GPT-2's ``c_attn``: each becomes the local width
_PACKED_WIDTHS = ("split_size", "embed_dim")
#: how :func:`input_split_style` splits a layer, in plans' kinds, the start-up line and a plan to paste (Hugging
#: Face's name for it)
INPUT_SPLIT = "rowwise_rep"


#: modules this process laid out with ``"auto+sequence"`` (their logits are sharded on the vocabulary): a later
#: ``fit`` of the same module finds it tensor-parallel already and must still compute the loss over the shards
_VOCAB_PARALLEL: weakref.WeakSet[nn.Module] = weakref.WeakSet()


@dataclass
class TensorParallelPlan:
    """A plan resolved against one model: module names (no patterns) to styles, the head counts to make local,
    and what stays replicated."""

    styles: dict[str, Any]
    """Module name -> a ``ParallelStyle`` (what ``parallelize_module`` takes)."""
    source: str
    """Where the plan comes from (for the start-up line)."""
    heads: list[tuple[str, str, int]] = field(default_factory=list)
    """``(module name, attribute, global count)`` of each head count made local; an attribute ``config.<name>`` is
    one of the module's ``config`` (litgpt's), which the module then holds a copy of."""
    replicated: list[str] = field(default_factory=list)
    """Modules holding parameters that no style splits."""
    skipped: list[str] = field(default_factory=list)
    """Blocks recognised but left replicated, each with the reason."""
    vocab_parallel: bool = False
    """Whether the head's logits are a ``DTensor`` sharded on the vocabulary (``"auto+sequence"``)."""
    sequence_entry: str = ""
    """``"auto+sequence"``: the embedding where the sequence is cut (its input length is checked there)."""
    tied: list[tuple[str, str]] = field(default_factory=list)
    """``(head, embedding)`` whose weight is one parameter (tied): both are split by vocabulary row (``Shard(0)``), and
    the head is given the embedding's split parameter again after the plan is applied."""
    share: Optional[float] = None
    """The share of the linear layers' parameters this plan splits (:func:`split_share`), for the start-up line;
    None where it was not measured."""
    input_split: list[str] = field(default_factory=list)
    """Attention blocks whose heads could not be split, each with the reason: their fan-out and fan-in layers are
    split by input column instead (:func:`input_split_style`), their heads computed whole on every rank."""
    forwards: dict[str, Any] = field(default_factory=dict)
    """Module name -> the function installed as its forward (``types.MethodType``) when the plan is applied: the
    local forward of an attention whose own reads its width from its input (nanoGPT's,
    :func:`_nanogpt_attention_forward`), checked like any split (:func:`_check_split`)."""

    def kinds(self) -> dict[str, str]:
        """Module name -> how it is split: ``"colwise"``, ``"rowwise"``, ``"sequence_parallel"`` (or a style's
        class name)."""
        return {name: _style_name(style) for name, style in self.styles.items()}

    def split_parameters(self, module: nn.Module) -> list[str]:
        """The names of ``module``'s parameters this plan shards across the tensor group; every other parameter
        stays whole on each rank of it. A style splits the parameters of the module it is given, except the bias of
        a row-wise layer (added after the sum: whole), the bias of a packed ``Conv1D`` (:func:`packed_conv1d_style`)
        and the norms ``SequenceParallel`` runs on a sequence shard (their weights stay whole)."""
        whole = {"SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput"}
        split = []
        for name, style in self.styles.items():
            if type(style).__name__ in whole:
                continue
            rowwise = _style_name(style) in ("rowwise", "colwise packed", INPUT_SPLIT)
            for pname, _ in module.get_submodule(name).named_parameters(recurse=False):
                if not (rowwise and pname == "bias"):
                    split.append(f"{name}.{pname}")
        return split

    def measure(self, module: nn.Module) -> tuple[int, int]:
        """:func:`split_share` of ``module``, kept as :attr:`share` for the start-up line."""
        split, total = split_share(module, self)
        self.share = split / total if total else None
        return split, total

    def summary(self, tensor_size: int, module: Optional[nn.Module] = None) -> str:
        """The one start-up line: what is split (with ``module``, which share of its parameters), how, and what
        stays replicated."""
        split = _grouped(f"{name} {_style_name(style)}" for name, style in self.styles.items())
        text = f"tensor parallelism over {tensor_size} ranks ({self.source}): split {len(self.styles)} layers"
        share = self.share
        if share is None and module is not None:
            done, total = split_share(module, self)
            share = done / total if total else None
        text += f", {share:.0%} of the linear layers' parameters" if share is not None else ""
        text += f" ({', '.join(split)})" if split else ""
        if self.replicated:
            text += f"; replicated: {', '.join(_grouped(self.replicated))}"
        if self.input_split:
            text += f"; heads whole (split by input column): {'; '.join(_grouped(self.input_split))}"
        if self.skipped:
            text += f"; not split: {'; '.join(self.skipped)}"
        return text


def _style_name(style: Any) -> str:
    names = {"ColwiseParallel": "colwise", "RowwiseParallel": "rowwise", "SequenceParallel": "sequence_parallel"}
    names["PrepareModuleInput"] = "input gathered"
    if type(style).__name__ == "PackedParallel":
        return "colwise packed"
    if type(style).__name__ == "InputSplitParallel":
        return INPUT_SPLIT
    if type(style).__name__ == "Conv1DParallel":
        return "colwise" if "Colwise" in repr(style) else "rowwise"
    return names.get(type(style).__name__, type(style).__name__)


def _grouped(names: Iterable[str]) -> list[str]:
    """Names with their layer indices as ``*``, each pattern once, in first-seen order."""
    return list(dict.fromkeys(re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", n) for n in names))


def is_tensor_parallel(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is a ``DTensor`` on a mesh with a ``"tensor_parallel"`` dimension of
    more than one rank, or any parameter a ``DTensor`` before FSDP shards it: tensor parallelism is applied
    (by the user's ``configure_model``, or by an earlier ``fit`` in this process)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    sharded = any(isinstance(m, FSDPModule) for m in module.modules())
    for param in module.parameters():
        if not isinstance(param, DTensor):
            continue
        if not sharded:
            return True
        names = param.device_mesh.mesh_dim_names or ()
        if any(n == "tensor_parallel" and param.device_mesh.size(i) > 1 for i, n in enumerate(names)):
            return True
    return False


def style_of(style: Any) -> Any:
    """A ``ParallelStyle`` from a plan's entry: the instance itself, or its name (Hugging Face's names)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if not isinstance(style, str):
        return style
    made: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        INPUT_SPLIT: input_split_style,
        "sequence_parallel": SequenceParallel,
    }
    if style not in made:
        raise ValueError(f"{style!r} is not a style this plan can apply; use one of {sorted(made)}.")
    return made[style]()


def matches(pattern: str, name: str) -> bool:
    """Whether module ``name`` matches ``pattern`` (``*`` stands for any one name between dots).

    >>> matches("layers.*.attention.wq", "layers.3.attention.wq"), matches("layers.*.wq", "layers.3.attention.wq")
    (True, False)
    """
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(p in ("*", n) for p, n in zip(parts, names))


def plan_from_patterns(
    module: nn.Module, patterns: Mapping[str, Any], source: str, prefix: str = ""
) -> TensorParallelPlan:
    """A user's (or a model's own) plan of patterns resolved to the module names of ``module``; a pattern that
    matches nothing is an error naming the modules there are. ``prefix``: where the patterns' root is (a Hugging
    Face plan is relative to its base model)."""
    styles: dict[str, Any] = {}
    unmatched = []
    names = [n for n, _ in module.named_modules() if n]
    for pattern, style in patterns.items():
        full = f"{prefix}.{pattern}" if prefix else pattern
        found = [n for n in names if matches(full, n)]
        if not found:
            unmatched.append(full)
        for name in found:
            styles[name] = style_of(style)
    if unmatched and source == "your plan":
        raise ValueError(
            f"tensor_parallel_plan: {unmatched} match no module of {type(module).__name__} (`*` stands for one "
            f"name between dots). Its modules with parameters include {_grouped(_holders(module))[:12]}."
        )
    return TensorParallelPlan(styles, source, replicated=_replicated(module, styles))


def _holders(module: nn.Module) -> list[str]:
    return [n for n, m in module.named_modules() if n and any(True for _ in m.parameters(recurse=False))]


def _replicated(module: nn.Module, styles: Mapping[str, Any]) -> list[str]:
    return [n for n in _holders(module) if n not in styles]


def _hf_plan(module: nn.Module) -> Optional[tuple[str, Mapping[str, str]]]:
    """``(prefix, base_model_tp_plan)`` of the first Hugging Face model inside ``module`` that ships a plan whose
    patterns name its modules, relative to its base model."""
    for name, sub in module.named_modules():
        config = getattr(sub, "config", None)
        plan = getattr(config, "base_model_tp_plan", None)
        if not plan or not hasattr(sub, "base_model_prefix"):
            continue
        base = getattr(sub, sub.base_model_prefix, sub)  # e.g. LlamaForCausalLM.model
        base_name = next((n for n, m in module.named_modules() if m is base), name)
        if all(isinstance(v, str) for v in plan.values()):
            return base_name, plan
    return None


def _linear(module: nn.Module, name: str) -> Optional[nn.Linear]:
    child = module.get_submodule(name) if _has(module, name) else None
    return child if isinstance(child, nn.Linear) else None


def _widths(layer: nn.Module) -> tuple[int, int]:
    """``(in, out)`` features of an ``nn.Linear`` or a transformers ``Conv1D``."""
    if _is_conv1d(layer):
        return int(layer.weight.shape[0]), int(layer.nf)  # type: ignore[index,arg-type]
    return int(layer.in_features), int(layer.out_features)  # type: ignore[arg-type]


def _has(module: nn.Module, dotted: str) -> bool:
    try:
        module.get_submodule(dotted)
    except AttributeError:
        return False
    return True


def _only(block: nn.Module, names: list[str]) -> bool:
    """Whether the direct children of ``block`` that hold parameters are exactly ``names``: nothing else (a norm,
    another projection) could sit between the split layers and see only a slice of their output."""
    held = {n for n, c in block.named_children() if any(True for _ in c.parameters())}
    return held == set(names) and not any(True for _ in block.parameters(recurse=False))


def _is_conv1d(module: Any) -> bool:
    """transformers' ``Conv1D`` (GPT-2's linear layers: ``y = x @ weight + bias``, weight stored ``(in, out)``)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def conv1d_style(kind: str, sequence: bool = False) -> Any:
    """A ``ParallelStyle`` splitting a transformers ``Conv1D`` by output column (``"colwise"``: weight ``Shard(1)``,
    bias ``Shard(0)``, the output left local) or by input row (``"rowwise"``: weight ``Shard(0)``, the input taken
    as this rank's slice, the output summed over the group, or with ``sequence`` reduce-scattered along the sequence,
    dim 1), as torch's styles split an ``nn.Linear``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    colwise = kind == "colwise"

    def partition(name: str, module: nn.Module, mesh: Any) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = (
                (Shard(1) if pname == "weight" else Shard(0))
                if colwise
                else (Shard(0) if pname == "weight" else Replicate())
            )
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [placement])))

    def prepare_input(module: nn.Module, inputs: Any, mesh: Any) -> Any:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Replicate() if colwise else Shard(-1)], run_check=False)
        return (x, *inputs[1:])

    def prepare_output(module: nn.Module, output: Any, mesh: Any) -> Any:
        if colwise:
            return output.to_local()
        return output.redistribute(mesh, [Shard(1) if sequence else Replicate()]).to_local()

    class Conv1DParallel(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            return distribute_module(module, device_mesh, partition, prepare_input, prepare_output)

        def __repr__(self) -> str:
            return f"Conv1D{'Colwise' if colwise else 'Rowwise'}Parallel({'output_layouts=Shard(1)' * sequence})"

    return Conv1DParallel()


def packed_conv1d_style(chunks: int) -> Any:
    """A ``ParallelStyle`` splitting a transformers ``Conv1D`` that packs ``chunks`` projections side by side in its
    output (GPT-2's ``c_attn``: query | key | value) by output column within each chunk: rank ``r`` holds the
    ``r``-th piece of every chunk (weight ``[in, chunks * width]`` as ``_StridedShard(1, split_factor=chunks)``; the
    bias, ``chunks * width`` numbers, whole on every rank, which adds its pieces), so its output is its heads' query,
    key and value, packed as the whole layer packs them; the weight keeps its unsplit layout (a gathered or saved
    tensor is the original one, in the original order). The gradients of the input and of the bias are summed over
    the group, as ``ColwiseParallel`` sums the input's."""
    return _packed_style(chunks, dim=1)


def packed_linear_style(chunks: int) -> Any:
    """:func:`packed_conv1d_style` for an ``nn.Linear`` packing ``chunks`` projections of equal width in its output
    (weight ``[chunks * width, in]``, split as ``_StridedShard(0, split_factor=chunks)``): nanoGPT's and timm's
    ``qkv`` / ``c_attn`` (query | key | value), litgpt's ``qkv`` with as many key/value heads as query heads, a
    fused gate | up projection."""
    return _packed_style(chunks, dim=0)


def _packed_style(chunks: int, dim: int) -> Any:
    from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    from lightning_mgpu._compat import strided_shard

    def partition(name: str, module: nn.Module, mesh: Any) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            # the bias stays whole (FSDP2 shards dim 0 again, which a strided split of a 1-D tensor cannot share)
            placement = strided_shard(dim, chunks) if pname == "weight" else Replicate()
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [placement])))

    class PackedParallel(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            distribute_module(module, device_mesh, partition)
            module.forward = types.MethodType(_packed_conv1d_forward, module)
            return module

        def __repr__(self) -> str:
            return f"Packed{'Conv1D' if dim else 'Linear'}ColwiseParallel(chunks={chunks})"

    return PackedParallel()


def input_split_style() -> Any:
    """A ``ParallelStyle`` splitting an ``nn.Linear`` by input column whatever its output feeds: the input arrives
    whole on every rank (each multiplies its slice of it, no communication), the output is summed over the group and
    whole again (``RowwiseParallel(input_layouts=Replicate())``), so the layer computes exactly what it computes whole
    for any model. The weight is an ordinary ``Shard(1)`` (every save, load and export path handles it); the price is
    one all-reduce of the output per call, and what the output feeds runs whole on every rank. The auto plan splits
    this way both layers of an attention whose heads it cannot split (:func:`_structural_plan`)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel

    class InputSplitParallel(RowwiseParallel):
        pass

    return InputSplitParallel(input_layouts=Replicate(), output_layouts=Replicate())


def _packed_conv1d_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The forward of a packed ``Conv1D`` (or ``nn.Linear``) split by :func:`packed_conv1d_style`, on the local
    pieces: rank ``r``'s columns (an ``nn.Linear``'s rows) are no contiguous block of the whole weight, so the
    multiplication runs on this rank's pieces (its output is local, as ``ColwiseParallel``'s is) and the input's
    gradient is summed over the group (a partial sum on each rank, as ``ColwiseParallel`` sums it)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    weight = self.weight
    assert isinstance(weight, DTensor)
    mesh = weight.device_mesh
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    x = x.to_local(grad_placements=[Partial()])
    local = weight.to_local()
    if isinstance(self, nn.Linear):  # weight [out, in]: this rank's rows
        local = local.t()
    out = x.reshape(-1, x.size(-1)) @ local
    bias = self.bias
    if isinstance(bias, DTensor):  # whole on every rank: this rank's piece of each chunk, its gradient summed
        chunks = int(weight.placements[0].split_factor)  # type: ignore[attr-defined]
        pieces = bias.to_local(grad_placements=[Partial()]).view(chunks, mesh.size(), -1)[:, mesh.get_local_rank()]
        out = out + pieces.reshape(-1)
    return out.view(*x.shape[:-1], local.shape[-1])


def fsdp_dim(param: nn.Parameter) -> Any:
    """FSDP2's placement for ``param`` over the data dimension (``fully_shard``'s ``shard_placement_fn``): dim 1 for
    a weight the tensor dimension splits strided along dim 0 (a packed ``nn.Linear``, :func:`packed_linear_style`),
    whose pieces FSDP's dim-0 split would interleave in the wrong order; None (dim 0, FSDP's default) otherwise."""
    from torch.distributed.tensor import DTensor, Shard

    from lightning_mgpu._compat import is_strided_shard

    if isinstance(param, DTensor) and param.dim() == 2:
        if any(is_strided_shard(p) and p.dim == 0 for p in param.placements):  # type: ignore[attr-defined]
            return Shard(1)
    return None


def _is_gpt2_attention(block: nn.Module) -> bool:
    """GPT-2's self-attention: ``c_attn`` (a ``Conv1D`` packing query | key | value, each ``split_size`` wide, the
    forward splitting its output with ``split(self.split_size, dim=2)``) and ``c_proj``, nothing else with
    parameters (a cross-attention's ``q_attn`` is left whole)."""
    attn, proj = getattr(block, "c_attn", None), getattr(block, "c_proj", None)
    if not (_is_conv1d(attn) and _is_conv1d(proj) and _only(block, ["c_attn", "c_proj"])):
        return False
    assert isinstance(attn, nn.Module) and isinstance(proj, nn.Module)
    width = _widths(proj)[0]
    split = getattr(block, "split_size", None)
    return _widths(attn)[1] == 3 * width and split == width and isinstance(getattr(block, "num_heads", None), int)


def _pairs(block: nn.Module) -> list[tuple[str, list[str], str]]:
    """``(kind, fan-out names, fan-in name)`` within ``block`` (names relative to it)."""
    found = []
    fan_in = [n for n in _ATTENTION_IN if _linear(block, n) is not None]
    out = next((n for n in _ATTENTION_OUT if _linear(block, n) is not None), None)
    if len(fan_in) == 3 and out is not None and _only(block, [*fan_in, out]):
        found.append(("attention", fan_in, out))
    bert_self = block.get_submodule("self") if _has(block, "self") else None
    qkv = ["query", "key", "value"]
    if bert_self is not None and _linear(block, "output.dense") is not None and _only(bert_self, qkv):
        found.append(("attention", [f"self.{n}" for n in qkv], "output.dense"))  # BERT's attention
    mlp_in = [n for n in _MLP_IN if _linear(block, n) is not None]
    mlp_out = next((n for n in _MLP_OUT if _linear(block, n) is not None), None)
    if mlp_in and mlp_out is not None and _only(block, [*mlp_in, mlp_out]):
        found.append(("mlp", mlp_in, mlp_out))
    fc, proj = getattr(block, "c_fc", None), getattr(block, "c_proj", None)
    if _is_conv1d(fc) and _is_conv1d(proj) and _only(block, ["c_fc", "c_proj"]):  # GPT-2's MLP
        found.append(("mlp", ["c_fc"], "c_proj"))
    if _is_gpt2_attention(block):
        found.append(("packed_attention", ["c_attn"], "c_proj"))
    if isinstance(block, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):  # torch's: a known forward
        found.append(("mlp", ["linear1"], "linear2"))
    up, down = _linear(block, "intermediate.dense"), _linear(block, "output.dense")
    if up is not None and down is not None and up.out_features == down.in_features:  # BERT's MLP
        if _only(block.get_submodule("intermediate"), ["dense"]):
            found.append(("mlp", ["intermediate.dense"], "output.dense"))
    return found


def adapter_layers(module: nn.Module) -> list[str]:
    """The layers of ``module`` wrapped by an adapter: a ``peft`` tuner layer (LoRA, ...) holds the layer it adapts
    as its ``base_layer`` child, beside the adapter's own weights (``lora_A``, ``lora_B``)."""
    return [name for name, m in module.named_modules() if isinstance(getattr(m, "base_layer", None), nn.Module)]


def refuse_adapters(module: nn.Module, tensor_size: int) -> None:
    """Tensor parallelism of a model with adapters is refused: no plan splits an adapted layer (its base layer and
    the adapter's matrices would have to be split together), so every rank would compute the whole model."""
    wrapped = adapter_layers(module)
    if wrapped:
        raise ValueError(
            f"tensor_parallel_size={tensor_size} with adapters (peft LoRA or another tuner) on {len(wrapped)} "
            f"layers of {type(module).__name__} (e.g. {wrapped[0]!r}): the tensor-parallel plans do not split a "
            f"layer wrapped by an adapter (its base_layer and the adapter's lora_A / lora_B would have to be split "
            f"together), so every rank would compute the whole model. Fine-tune the adapters with "
            f"strategy='mgpu_zero3' (each rank holds a shard of the frozen base) or 'mgpu_ddp', without "
            f"tensor_parallel_size."
        )


#: the auto plan is refused where it splits less than this share of the linear layers' parameters (:func:`split_share`)
MIN_SPLIT_SHARE = 0.5
#: the names of the layers the auto plan pairs (:func:`_pairs`), for the reason a layer is left whole
_PAIRED_NAMES = (*_ATTENTION_IN, *_ATTENTION_OUT, *_MLP_IN, *_MLP_OUT, "c_attn", "c_fc", "c_proj", "dense")


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def output_heads(module: nn.Module) -> list[str]:
    """The output heads of ``module``: each ``nn.Linear`` whose weight is an ``nn.Embedding``'s (tied), and the last
    linear layer of the model where it maps an embedding's width to its vocabulary (``in_features ==
    embedding_dim``, ``out_features == num_embeddings``)."""
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    weights = {id(e.weight) for e in embeddings}
    shapes = {(e.embedding_dim, e.num_embeddings) for e in embeddings}
    linears = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear)]
    heads = [n for n, m in linears if id(m.weight) in weights]
    if linears and (linears[-1][1].in_features, linears[-1][1].out_features) in shapes:
        heads.append(linears[-1][0])
    return list(dict.fromkeys(heads))


def measured_layers(module: nn.Module) -> list[str]:
    """The layers whose parameters :func:`split_share` measures: every ``nn.Linear`` and transformers ``Conv1D`` of
    ``module`` but its output heads (:func:`output_heads`; embeddings and norms are no linear layers)."""
    heads = set(output_heads(module))
    return [n for n, m in module.named_modules() if n and _is_linear(m) and n not in heads]


def split_share(module: nn.Module, plan: TensorParallelPlan) -> tuple[int, int]:
    """``(split, total)``: the parameters (elements) of the linear layers of ``module`` (:func:`measured_layers`), and
    of them those ``plan`` splits (:meth:`TensorParallelPlan.split_parameters`); a parameter two layers share, once.

    >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    >>> split_share(mlp, derive_plan(mlp, tensor_size=2))  # all but the row-wise layer's bias (added after the sum)
    (72, 76)
    """
    names = set(plan.split_parameters(module))
    seen: set[int] = set()
    split = total = 0
    for name in measured_layers(module):
        for pname, param in module.get_submodule(name).named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            total += param.numel()
            split += param.numel() if f"{name}.{pname}" in names else 0
    return split, total


def _why_whole(module: nn.Module, name: str, plan: TensorParallelPlan) -> str:
    """Why the auto plan leaves linear layer ``name`` whole, in words."""
    owner, _, leaf = name.rpartition(".")
    for skipped in plan.skipped:  # "block (reason)"
        block, _, reason = skipped.partition(" (")
        if name.startswith(f"{block}.") or block == type(module).__name__:
            return f"its block {_layer_pattern(block)} stays whole: {reason.rstrip(')')}"
    parent = module.get_submodule(owner) if owner else module
    if isinstance(parent, nn.MultiheadAttention):
        return (
            "the output projection of an nn.MultiheadAttention, whose packed query/key/value projection "
            "(in_proj_weight) the plan does not split"
        )
    if leaf not in _PAIRED_NAMES:
        return (
            "neither a name rule (wq/wo, q_proj/o_proj, w1/w2, fc1/fc2, ...) nor the model's structure pairs it: no "
            "other linear layer's output reaches it, or its output reaches another, through elementwise work, "
            "reshapes or attention alone (a norm, a reduction, a residual or the model's output sits between)"
        )
    others = sorted(n for n in _children_with_params(parent) if n != leaf)
    if others:
        return (
            f"{owner or type(module).__name__} holds other layers beside it ({', '.join(others)}): a norm or another "
            f"layer could sit between the split layers, so the block stays whole"
        )
    return "not in an attention or MLP pair the plan recognises"


def _layer_pattern(name: str) -> str:
    """``name`` with each layer index but the last name as ``*`` (``layers.3.net.0`` -> ``layers.*.net.0``)."""
    parts = name.split(".")
    return ".".join(["*" if p.isdigit() else p for p in parts[:-1]] + parts[-1:])


def suggested_plan(module: nn.Module, plan: TensorParallelPlan, size: int) -> dict[str, str]:
    """A plan of patterns to paste and edit, a best guess: the ``nn.Linear`` layers ``plan`` splits as it splits them
    (:func:`input_split_style` as :data:`INPUT_SPLIT`),
    and within each module, two consecutive children with parameters that are both ``nn.Linear`` left whole, the
    first's output as wide as the second's input and divisible by ``size``, as a pair (the first ``"colwise"``, the
    second ``"rowwise"``); layer indices as ``*`` where every layer so named is split alike."""
    guess = {
        n: kind
        for n, kind in plan.kinds().items()
        if kind in ("colwise", "rowwise", INPUT_SPLIT) and isinstance(module.get_submodule(n), nn.Linear)
    }
    skipped = [entry.partition(" (")[0] for entry in plan.skipped]  # indivisible: a plan cannot help there
    whole = {
        n for n in measured_layers(module) if n not in plan.styles and not any(n.startswith(f"{b}.") for b in skipped)
    }
    for owner, parent in module.named_modules():
        children = list(_children_with_params(parent).items())
        i = 0
        while i + 1 < len(children):
            (a_name, a), (b_name, b) = children[i], children[i + 1]
            a_full, b_full = (f"{owner}.{n}" if owner else n for n in (a_name, b_name))
            linear = isinstance(a, nn.Linear) and isinstance(b, nn.Linear) and {a_full, b_full} <= whole
            if linear and _widths(a)[1] == _widths(b)[0] and _widths(a)[1] % size == 0:
                guess[a_full], guess[b_full] = "colwise", "rowwise"
                i += 2
            else:
                i += 1
    patterns: dict[str, set[str]] = {}
    for n, kind in guess.items():
        patterns.setdefault(_layer_pattern(n), set()).add(kind)
    names = [n for n, _ in module.named_modules() if n]
    grouped: dict[str, str] = {}
    for n, kind in guess.items():
        pattern = _layer_pattern(n)
        alike = len(patterns[pattern]) == 1 and all(guess.get(m) == kind for m in names if matches(pattern, m))
        grouped[pattern if alike else n] = kind
    return grouped


def splits_too_little(plan: TensorParallelPlan, split: int, total: int) -> bool:
    """Whether ``plan``, splitting ``split`` of the ``total`` numbers :func:`split_share` counts, splits nothing or
    less than :data:`MIN_SPLIT_SHARE` of them (an auto plan so is refused)."""
    return not plan.styles or bool(total and split < MIN_SPLIT_SHARE * total)


def refuse_unsplit(module: nn.Module, plan: TensorParallelPlan, size: int, setting: str = "auto") -> None:
    """Measure the share ``plan`` (the auto plan) splits (:attr:`TensorParallelPlan.share`), and refuse a plan that
    splits nothing or less than :data:`MIN_SPLIT_SHARE` of the linear layers' parameters: every rank of the tensor
    group would compute (nearly) the whole model. The error names each layer left whole and why, a plan to paste,
    and the explicit empty plan ``{}`` that trains anyway."""
    split, total = plan.measure(module)
    if not splits_too_little(plan, split, total):
        return
    whole = [n for n in measured_layers(module) if n not in plan.styles]
    found: dict[str, tuple[str, int]] = {}
    for n in whole:
        layer = module.get_submodule(n)
        width_in, width_out = _widths(layer)
        key = f"{_layer_pattern(n)} ({type(layer).__name__} {width_in} -> {width_out})"
        reason, count = found.get(key, (_why_whole(module, n, plan), 0))
        found[key] = (reason, count + 1)
    listed = [f"  - {key}{f' x{count}' if count > 1 else ''}: {reason}" for key, (reason, count) in found.items()]
    if len(listed) > 12:
        listed = [*listed[:12], f"  - ... and {len(listed) - 12} more"]
    share = f"{split / total:.0%}" if total else "none"
    guess = suggested_plan(module, plan, size)
    paste = (
        f"To split them, pass a plan of your own; a guess to paste and edit (consecutive linear layers paired, the "
        f"first split by output column, the second by input row: check that nothing between the two mixes the hidden "
        f"units, and divide by {size} any head count the forward reads):\n    tensor_parallel_plan={guess!r}\n"
        if guess
        else "No two consecutive linear layers of one module to pair were found: to split some, write a "
        "tensor_parallel_plan of your own (module-name patterns to 'colwise' / 'rowwise'; the tensor-parallel guide "
        "shows how).\n"
    )
    raise ValueError(
        f"tensor_parallel_size={size} with tensor_parallel_plan={setting!r}: the auto plan splits {len(plan.styles)} "
        f"layers of {type(module).__name__}, {share} of its linear layers' parameters ({split:,} of {total:,}, the "
        f"output head aside), under the {MIN_SPLIT_SHARE:.0%} it needs, so every rank of the tensor group would "
        f"compute (nearly) the whole model. Linear layers left whole:\n" + "\n".join(listed or ["  (none)"]) + "\n"
        f"{paste}"
        f"To train with every layer whole on each rank, pass the explicit empty plan tensor_parallel_plan={{}}, or use "
        f"tensor_parallel_size=1 (every rank then shards the data instead)."
    )


def derive_plan(
    module: nn.Module, tensor_size: int, sequence: bool = False, structure: bool = True
) -> TensorParallelPlan:
    """The auto plan for ``module`` at ``tensor_size`` ranks; ``sequence``: with sequence parallelism and the head
    split by vocabulary (``"auto+sequence"``; see the module's documentation); ``structure``: the layers no name rule
    matches are paired by one forward (:func:`_structural_plan`; False: by their names only)."""
    if sequence:
        return _with_sequence(module, _derive_blocks(module, tensor_size, structure), tensor_size)
    hf = _hf_plan(module)
    if hf is not None:
        prefix, patterns = hf
        supported = {k: v for k, v in patterns.items() if v in TENSOR_PARALLEL_STYLES}
        plan = plan_from_patterns(module, supported, "the model's own base_model_tp_plan", prefix)
        plan.skipped += [
            f"{prefix}.{k} ({v!r}: a style this plan does not apply)" for k, v in patterns.items() if k not in supported
        ]
        return _checked(module, plan, tensor_size, attention_roots=_hf_attention_roots(module, plan))
    return _derive_blocks(module, tensor_size, structure)


def _derive_blocks(module: nn.Module, tensor_size: int, structure: bool = True) -> TensorParallelPlan:
    """The attention and MLP blocks recognised by the names of their layers."""
    styles: dict[str, Any] = {}
    heads: list[tuple[str, str, int]] = []
    skipped: list[str] = []
    recognised: set[str] = set()  # by their names, split or not: the structure is not asked about them again
    forwards: dict[str, Any] = {}
    input_split: list[str] = []
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    for name, block in module.named_modules():
        for kind, fan_out, fan_in in _pairs(block):
            full = [f"{name}.{n}" if name else n for n in [*fan_out, fan_in]]
            if any(f in styles for f in full):
                continue
            recognised.update(full)
            reason = _indivisible(block, fan_out, fan_in, tensor_size, chunks=3 if kind == "packed_attention" else 1)
            counts = _head_counts(block, fan_out[0]) if kind != "mlp" else []
            if kind == "packed_attention":  # the forward splits c_attn's output by these widths
                counts += [("", a, v) for a in _PACKED_WIDTHS if isinstance(v := getattr(block, a, None), int)]
            bad = [f"{a}={v}" for _, a, v in counts if v % tensor_size]
            if reason or bad:
                why = reason or ", ".join(bad)
                skipped.append(f"{name or type(module).__name__} ({why} not divisible by {tensor_size})")
                continue
            conv = _is_conv1d(module.get_submodule(full[-1]))
            for f in full[:-1]:
                if kind == "packed_attention":
                    styles[f] = packed_conv1d_style(3)
                    continue
                styles[f] = conv1d_style("colwise") if conv else ColwiseParallel()
            styles[full[-1]] = conv1d_style("rowwise") if conv else RowwiseParallel()
            heads += [(f"{name}.{owner}".strip(".") if owner else name, a, v) for owner, a, v in counts]
    if structure:  # the linear layers no name rule matched
        found, local, forwards, not_split, input_split = _structural_plan(module, tensor_size, taken=recognised)
        styles.update(found)
        heads += local
        skipped += not_split
    plan = TensorParallelPlan(styles, "auto plan", heads=heads, replicated=_replicated(module, styles))
    plan.skipped, plan.forwards, plan.input_split = skipped, forwards, input_split
    return plan


def _is_norm(module: nn.Module) -> bool:
    """A norm: no children, and only 1-D parameters (a weight, perhaps a bias) - ``nn.LayerNorm``, ``nn.RMSNorm``
    or one of the model's own, which ``SequenceParallel`` runs on each rank's sequence shard."""
    params = list(module.parameters())
    return not any(True for _ in module.children()) and bool(params) and all(p.dim() == 1 for p in params)


def _children_with_params(module: nn.Module) -> dict[str, nn.Module]:
    return {n: c for n, c in module.named_children() if any(True for _ in c.parameters())}


def _llama_root(module: nn.Module) -> Optional[tuple[str, str, str, str, str]]:
    """``(root, embedding, blocks, norm, head)`` names of the first module shaped as a Llama-style model: its only
    children with parameters an ``nn.Embedding``, a list of blocks, a norm and an ``nn.Linear`` as wide as the
    vocabulary, with no parameters of its own."""
    for name, root in module.named_modules():
        children = _children_with_params(root)
        if len(children) != 4 or any(True for _ in root.parameters(recurse=False)):
            continue
        embeddings = [n for n, c in children.items() if isinstance(c, nn.Embedding)]
        blocks = [n for n, c in children.items() if isinstance(c, (nn.ModuleList, nn.ModuleDict, nn.Sequential))]
        norms = [n for n, c in children.items() if _is_norm(c)]
        heads = [n for n, c in children.items() if isinstance(c, nn.Linear)]
        if len(embeddings) == len(blocks) == len(norms) == len(heads) == 1:
            head = children[heads[0]]
            if isinstance(head, nn.Linear) and head.out_features == children[embeddings[0]].num_embeddings:
                return name, embeddings[0], blocks[0], norms[0], heads[0]
    return None


#: the Hugging Face causal LMs the sequence plan lays out: model type -> (the base model's children with parameters,
#: and which of them are the embedding, the blocks and the final norm). Llama's base model also holds the rotary
#: table (used before the sequence is cut); GPT-2's the position embedding (the positions and the causal mask are
#: computed from the whole sequence before the blocks); no cross-attention.
_HF_CAUSAL_LMS = {
    "llama": ({"embed_tokens", "layers", "norm"}, "embed_tokens", "layers", "norm"),
    "gpt2": ({"wte", "wpe", "h", "ln_f"}, "wte", "h", "ln_f"),
}


def _hf_causal_lm_root(module: nn.Module, model_type: str) -> Optional[tuple[str, str, str, str, str]]:
    """The same names for a Hugging Face causal LM of ``model_type`` (a key of ``_HF_CAUSAL_LMS``): its base model
    holds the embedding, the blocks and the norm, the causal LM the head."""
    children_names, embedding, blocks, norm = _HF_CAUSAL_LMS[model_type]
    for name, outer in module.named_modules():
        config = getattr(outer, "config", None)
        prefix = getattr(outer, "base_model_prefix", None)
        if getattr(config, "model_type", None) != model_type or not isinstance(prefix, str):
            continue
        children = _children_with_params(outer)
        head = getattr(outer, "lm_head", None)
        base = children.get(prefix)
        if base is None or not isinstance(head, nn.Linear) or set(children) != {prefix, "lm_head"}:
            continue
        inner = _children_with_params(base)
        if set(inner) == children_names and isinstance(inner[embedding], nn.Embedding):
            return name, f"{prefix}.{embedding}", f"{prefix}.{blocks}", f"{prefix}.{norm}", "lm_head"
    return None


def sequence_cut_style() -> Any:
    """A ``ParallelStyle`` cutting a block's input hidden states (its first positional argument, or the keyword
    ``hidden_states``), whole on every rank, to this rank's shard of the sequence (dim 1) as a plain tensor; the
    other arguments (a causal mask over the whole sequence, a cache) pass as they are. Its backward gathers the
    gradient of the whole sequence."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ParallelStyle

    class SequenceCut(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            def cut(x: Any) -> Any:
                if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
                    return x
                whole = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                return whole.redistribute(device_mesh, [Shard(1)]).to_local()

            def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                if args:
                    return (cut(args[0]), *args[1:]), kwargs
                if "hidden_states" in kwargs:
                    return args, {**kwargs, "hidden_states": cut(kwargs["hidden_states"])}
                return args, kwargs

            module.register_forward_pre_hook(hook, with_kwargs=True)
            return module

        def __repr__(self) -> str:
            return "SequenceCut(Replicate() -> Shard(1))"

    return SequenceCut()


def _with_sequence(module: nn.Module, plan: TensorParallelPlan, size: int) -> TensorParallelPlan:
    """The auto plan with sequence parallelism between the blocks and the head split by vocabulary (torchtitan's
    Llama plan), or a ``ValueError`` naming what does not match."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    fix = "tensor_parallel_plan='auto' (no sequence parallelism), or a plan of your own / configure_model"
    gpt2 = _hf_causal_lm_root(module, "gpt2")
    hugging_face = _hf_causal_lm_root(module, "llama") or gpt2
    found = hugging_face or _llama_root(module)
    if found is None:
        raise ValueError(
            f"tensor_parallel_plan='auto+sequence' needs a Llama-style model (one module whose only children with "
            f"parameters are an nn.Embedding, a list of blocks, a norm and an nn.Linear head as wide as the "
            f"vocabulary), a Hugging Face Llama or a Hugging Face GPT-2 (GPT2LMHeadModel); {type(module).__name__} "
            f"is none of these (a BERT, for instance, is not laid out: its position and token type tables and its "
            f"masked-LM head sit beside the blocks). Use {fix}."
        )
    root = module.get_submodule(found[0]) if found[0] else module
    embedding, blocks, norm, head = (f"{found[0]}.{n}" if found[0] else n for n in found[1:])
    tables = [n for n, c in root.named_children() if not any(True for _ in c.parameters()) and any(c.buffers())]
    if hugging_face is None and (any(True for _ in root.buffers(recurse=False)) or tables):
        raise ValueError(
            f"tensor_parallel_plan='auto+sequence': {found[0] or type(module).__name__} holds buffers "
            f"({tables or 'its own'}; a position table, for instance) that its forward could apply to the sequence "
            f"between the blocks, where each rank holds only its shard of the sequence. Use {fix}."
        )
    # a tied head: both are split by vocabulary row (Shard(0)), so the head takes the embedding's split weight again
    tied = [(head, embedding)] if module.get_submodule(head).weight is module.get_submodule(embedding).weight else []
    styles = dict(plan.styles)
    vocab = int(cast(nn.Linear, module.get_submodule(head)).out_features)
    if vocab % size:
        raise ValueError(
            f"tensor_parallel_plan='auto+sequence': the vocabulary {vocab} ({head}) is not divisible by "
            f"tensor_parallel_size={size}. Pad the vocabulary to a multiple of {size}, or use {fix}."
        )
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    # Hugging Face's decoder layer passes the hidden states to its attention as a keyword
    sharded: dict[str, Any] = {"hidden_states": Shard(1)}
    whole: dict[str, Any] = {"hidden_states": Replicate()}
    gather_keyword = PrepareModuleInput(input_kwarg_layouts=sharded, desired_input_kwarg_layouts=whole)
    for index, block in module.get_submodule(blocks).named_children():
        prefix = f"{blocks}.{index}"
        children = _children_with_params(block)
        split = {n for n in children if any(s.startswith(f"{prefix}.{n}.") for s in plan.styles)}
        norms = {n for n, c in children.items() if _is_norm(c)}
        inner = [s for s in plan.styles if s.startswith(f"{prefix}.")]
        rows = [s for s in inner if _style_name(plan.styles[s]) == "rowwise"]
        if len(split) != 2 or set(children) != split | norms or len(rows) != 2:
            raise ValueError(
                f"tensor_parallel_plan='auto+sequence': block {prefix} must hold only norms and an attention and an "
                f"MLP module the auto plan splits whole; it holds {sorted(children)}, of which the plan splits "
                f"{sorted(split)}{' (' + '; '.join(plan.skipped) + ')' if plan.skipped else ''}. Use {fix}."
            )
        for name in split:  # the sequence gathered at the attention's and the MLP's input
            styles[f"{prefix}.{name}"] = gather_keyword if hugging_face and name == "self_attn" else gather
        for name in norms:
            styles[f"{prefix}.{name}"] = SequenceParallel()
        for name in rows:  # reduce-scattered along the sequence
            conv = _is_conv1d(module.get_submodule(name))
            styles[name] = conv1d_style("rowwise", sequence=True) if conv else RowwiseParallel(output_layouts=Shard(1))
    if hugging_face is None:
        styles[embedding] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    else:  # the positions and the causal mask are computed from the whole embedding; the first layer cuts it
        styles[embedding] = RowwiseParallel(input_layouts=Replicate())
        first = f"{blocks}.{next(iter(dict(module.get_submodule(blocks).named_children())))}"
        cut = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True)
        # GPT-2's model passes its blocks the cache, the causal mask and the encoder's states as positional arguments
        styles[first] = sequence_cut_style() if gpt2 else cut
    styles[norm] = SequenceParallel()
    styles[head] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    source = "auto plan with sequence parallelism"
    done = TensorParallelPlan(styles, source, heads=plan.heads, replicated=_replicated(module, styles))
    done.forwards = plan.forwards
    done.vocab_parallel, done.sequence_entry, done.tied = True, embedding, tied
    return done


def guard_sequence_length(embedding: nn.Module, size: int) -> Any:
    """Refuse, before the embedding's output is cut along the sequence, a sequence length that ``size`` ranks cannot
    share evenly (uneven shards would make the ranks' collectives disagree). Returns the hook's handle."""

    def check(module: nn.Module, args: tuple[Any, ...]) -> None:
        length = args[0].shape[1] if args and getattr(args[0], "dim", lambda: 0)() >= 2 else None
        if length is not None and length % size:
            raise ValueError(
                f"tensor_parallel_plan='auto+sequence' cuts the sequence into {size} equal shards, but this batch's "
                f"sequence length is {length}. Pad or crop the sequences to a multiple of {size}, or use "
                f"tensor_parallel_plan='auto'."
            )

    return embedding.register_forward_pre_hook(check)


def _indivisible(block: nn.Module, fan_out: list[str], fan_in: str, size: int, chunks: int = 1) -> str:
    for n in fan_out:
        width = _widths(block.get_submodule(n))[1]
        if width % (size * chunks):
            return f"{n} width {width}"
    width = _widths(block.get_submodule(fan_in))[0]
    return f"{fan_in} width {width}" if width % size else ""


def _head_counts(block: nn.Module, first_fan_out: str) -> list[tuple[str, str, int]]:
    """``(owner relative to block, attribute, count)`` of the head counts of the module holding the projections."""
    owner = first_fan_out.rpartition(".")[0]
    holder = block.get_submodule(owner) if owner else block
    return [
        (owner, a, v)
        for a in _HEAD_COUNTS
        if isinstance(v := getattr(holder, a, None), int) and not isinstance(v, bool) and v > 0
    ]


def _hf_attention_roots(module: nn.Module, plan: TensorParallelPlan) -> list[str]:
    return sorted({n.rpartition(".")[0] for n, s in plan.styles.items() if _style_name(s) == "colwise"})


def _checked(module: nn.Module, plan: TensorParallelPlan, size: int, attention_roots: list[str]) -> TensorParallelPlan:
    """A model's own plan, with each split layer's sizes checked (an indivisible one refused with its name) and the
    head counts of the modules it splits made local where the module keeps them as attributes."""
    for name, style in plan.styles.items():
        layer = module.get_submodule(name)
        kind = _style_name(style)
        width = getattr(layer, "out_features" if kind == "colwise" else "in_features", None)
        if isinstance(width, int) and width % size:
            raise ValueError(
                f"tensor parallelism over {size} ranks splits {name} ({kind}), whose width {width} is not divisible "
                f"by {size}. Use a tensor_parallel_size that divides {width}, or a tensor_parallel_plan without it."
            )
    for root in attention_roots:
        holder = module.get_submodule(root) if root else module
        for a in _HEAD_COUNTS:
            v = getattr(holder, a, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                plan.heads.append((root, a, v))
    return plan


def local_head_counts(module: nn.Module, plan: TensorParallelPlan, size: int) -> None:
    """Set the head counts of ``plan.heads`` to their local values (divided by ``size``); a count kept on a module's
    ``config`` (``config.<name>``) is set on a copy of that config the module then holds, so the other modules
    reading the shared config (the model, the blocks, the MLPs) keep the global values. The forwards of
    ``plan.forwards``, which compute with those local counts, are installed on their modules."""
    for name, forward in plan.forwards.items():
        runs = module.get_submodule(name) if name else module
        runs.forward = types.MethodType(forward, runs)
    copied: set[int] = set()
    for owner, attribute, count in plan.heads:
        holder: Any = module.get_submodule(owner) if owner else module
        if attribute.startswith("config."):
            if id(holder) not in copied:
                holder.config = copy.copy(holder.config)
                copied.add(id(holder))
            holder, attribute = holder.config, attribute.removeprefix("config.")
        setattr(holder, attribute, count // size)


class TensorParallelism:
    """The strategy's tensor-parallel part: applies the plan over the ``"tensor_parallel"`` mesh at set-up, before
    activation checkpointing and sharding (torchtitan's order), unless the user's ``configure_model`` did.

    Example::

        tp = TensorParallelism(size=2, plan="auto")
        plan = tp.apply(lightning_module, parallel_mesh.tensor)   # None where configure_model applied its own
    """

    def __init__(self, size: int, plan: Any = "auto") -> None:
        self.size = size
        self.plan_setting = plan
        self.applied: Optional[TensorParallelPlan] = None
        self._laid_out_before = False
        self.counter: Optional[CollectiveCounter] = None

    @property
    def vocab_parallel(self) -> bool:
        """Whether the plan applied (by this part, or by an earlier ``fit`` of the same module in this process)
        leaves the logits sharded on the vocabulary (``"auto+sequence"``)."""
        return self._laid_out_before or (self.applied is not None and self.applied.vocab_parallel)

    @contextmanager
    def step_context(self) -> Generator[None, None, None]:
        """Around each step and each backward: torch's ``loss_parallel`` where the logits are sharded on the
        vocabulary (``F.cross_entropy`` on them then computes the loss over the shards), else nothing."""
        if not self.vocab_parallel:
            yield
            return
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            yield

    def local_output(self, output: Any) -> Any:
        """A step's output with each replicated ``DTensor`` (the loss over the sharded vocabulary) as the plain
        tensor Lightning expects; the autograd graph is kept (``to_local`` is differentiable)."""
        if not self.vocab_parallel:
            return output
        from lightning_utilities.core.apply_func import apply_to_collection
        from torch.distributed.tensor import DTensor

        def local(t: DTensor) -> Any:
            return t.to_local() if all(p.is_replicate() for p in t.placements) else t

        return apply_to_collection(output, DTensor, local)

    def count_into(self, stats: CommStats, mesh: Any) -> None:
        """From now on, :meth:`counting` blocks count the collectives over ``mesh``'s group (the tensor dimension)
        into ``stats`` (``tensor_comm_stats=True``)."""
        self.counter = CollectiveCounter(stats, mesh.get_group())

    def counting(self) -> AbstractContextManager[None]:
        """A block whose tensor-parallel collectives the ledger counts; nothing where no count was asked for."""
        return self.counter.counting() if self.counter is not None else nullcontext()

    def plan_for(self, module: nn.Module) -> TensorParallelPlan:
        """The plan this part applies to ``module`` (no communication)."""
        if self.plan_setting in ("auto", "auto+sequence"):
            plan = derive_plan(module, self.size, sequence=self.plan_setting == "auto+sequence")
            refuse_unsplit(module, plan, self.size, self.plan_setting)  # too little split: refused on every rank
            return plan
        plan = _checked(module, plan_from_patterns(module, self.plan_setting, "your plan"), self.size, [])
        plan.measure(module)
        return plan

    def check_before_launch(self, module: nn.Module) -> None:
        """Refuse before any process starts, where the model is built already (no ``configure_model`` of its own
        that could build or split it later): layers wrapped by adapters (:func:`refuse_adapters`), a model the auto
        plan splits too little of (:func:`refuse_unsplit`), and with ``"auto+sequence"`` a model it cannot lay out."""
        own = getattr(getattr(type(module), "configure_model", None), "__module__", "") or ""
        lightnings = own.startswith(("pytorch_lightning.", "lightning.pytorch."))
        if self.size > 1 and (lightnings or not own) and not is_tensor_parallel(module):
            refuse_adapters(module, self.size)
            if self.plan_setting in ("auto", "auto+sequence"):
                self.plan_for(module)

    def apply(self, module: nn.Module, mesh: Any) -> Optional[TensorParallelPlan]:
        """Split ``module``'s layers over ``mesh`` (1-D, ``"tensor_parallel"``); None where there is nothing to do
        (one rank, or the model is tensor-parallel already)."""
        if self.size <= 1:
            return None
        from torch.distributed.fsdp import FSDPModule

        plan: Optional[TensorParallelPlan] = None
        if not is_tensor_parallel(module):  # on every rank alike, so each refuses before the group's first collective
            refuse_adapters(module, self.size)
            if any(isinstance(m, FSDPModule) for m in module.modules()):
                raise ValueError(
                    f"tensor_parallel_size={self.size}, but {type(module).__name__}'s configure_model applied FSDP "
                    f"(fully_shard) without tensor parallelism, and a sharded model cannot be split any more. Apply "
                    f"parallelize_module(..., self.device_mesh['tensor_parallel'], plan) before fully_shard in "
                    f"configure_model, or leave the sharding to the strategy (remove fully_shard), or use "
                    f"tensor_parallel_size=1."
                )
            plan = self.plan_for(module)  # derived once: an auto plan that splits too little is refused here
        comm.share_random_state(mesh.get_group())  # one dropout mask on the group's replicated activations
        if plan is None:
            self._laid_out_before = module in _VOCAB_PARALLEL
            rank_zero_info(f"tensor parallelism over {self.size} ranks: applied by {type(module).__name__} itself")
            return None
        from torch.distributed.tensor.parallel import parallelize_module

        line = plan.summary(self.size, module)
        local_head_counts(module, plan, self.size)
        if plan.styles:
            parallelize_module(module, mesh, plan.styles)
        for head, embedding in plan.tied:  # each got its own split copy: one parameter again, as before
            module.get_submodule(head).weight = module.get_submodule(embedding).weight
        if plan.sequence_entry:
            guard_sequence_length(module.get_submodule(plan.sequence_entry), self.size)
            _VOCAB_PARALLEL.add(module)
        rank_zero_info(line)
        self.applied = plan
        return plan


# --- the plan found from the model's structure: one forward, the dataflow between its linear layers -------------

#: functions whose result mixes the numbers along the split dimension (a rank's share cannot compute it alone)
_MIXING = frozenset(
    ("mean", "sum", "var", "std", "norm", "amax", "amin", "logsumexp", "var_mean", "std_mean", "layer_norm",
     "rms_norm", "group_norm", "batch_norm", "instance_norm", "normalize", "cumsum", "prod")
)  # fmt: skip
#: functions combining the heads' query and key (or the scores and the values): the path goes through attention
_ATTENDING = frozenset(("scaled_dot_product_attention", "matmul", "__matmul__", "bmm", "einsum"))
_ELEMENTWISE = frozenset(("add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "mul", "__mul__", "__rmul__"))
#: attributes holding an attention module's width across all its heads (timm's ``attn_dim``): made local too
_HEAD_WIDTHS = ("attn_dim",)
#: head counts kept on a config object the attention's forward reads (litgpt: ``self.config.n_head``)
_CONFIG_HEAD_COUNTS = ("n_head", "n_query_groups", "num_heads", "n_heads", "n_kv_heads", "num_key_value_heads")


@dataclass
class _Flow:
    """What one forward showed of the linear layers: which fan-out layers reach each layer's input (through work
    that keeps each number's position: elementwise functions, reshapes, attention's products), whether the path
    went through attention, and the layers whose output also goes elsewhere (a norm, a reduction, the output)."""

    reach: dict[str, set[str]] = field(default_factory=dict)
    attention: dict[str, bool] = field(default_factory=dict)
    consumers: dict[str, set[str]] = field(default_factory=dict)
    escaped: set[str] = field(default_factory=set)
    order: list[str] = field(default_factory=list)
    inputs: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=dict)
    """The first call's arguments of each module holding linear layers (copies), to check a split on."""


_TAG = "_mgpu_tensor_parallel_sources"


def _tags(tree: Any, found: list[torch.Tensor]) -> None:
    if isinstance(tree, torch.Tensor):
        found.append(tree)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            _tags(item, found)
    elif isinstance(tree, dict):
        for item in tree.values():
            _tags(item, found)


def _sources(tensors: Iterable[torch.Tensor]) -> tuple[set[str], bool]:
    sources: set[str] = set()
    attended = False
    for t in tensors:
        tag = getattr(t, _TAG, None)
        if tag is not None:
            sources |= tag[0]
            attended = attended or tag[1]
    return sources, attended


def _mark(tree: Any, sources: set[str], attended: bool) -> None:
    out: list[torch.Tensor] = []
    _tags(tree, out)
    for t in out:
        old = getattr(t, _TAG, None)
        if old is not None:  # an in-place function returns its input
            sources, attended = sources | old[0], attended or old[1]
        try:
            setattr(t, _TAG, (frozenset(sources), attended))
        except (AttributeError, RuntimeError):
            pass


def _flow_mode(flow: _Flow, widths: dict[str, int]) -> Any:
    from torch.overrides import TorchFunctionMode

    class FlowMode(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            result = func(*args, **kwargs)
            inputs: list[torch.Tensor] = []
            _tags((args, kwargs), inputs)
            sources, attended = _sources(inputs)
            if not sources:
                return result
            name = getattr(func, "__name__", "")
            tagged = [t for t in inputs if getattr(t, _TAG, None) is not None]
            if name in _MIXING:
                flow.escaped |= sources
                return result
            if name in _ATTENDING and (name == "scaled_dot_product_attention" or len(tagged) >= 2):
                attended = True
            if name in ("cat", "concat", "concatenate", "stack") and isinstance(result, torch.Tensor):
                dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
                if isinstance(dim, int) and result.shape[dim] >= min(widths[s] for s in sources):
                    flow.escaped |= sources  # projections side by side: a rank's pieces are not where they were
                    return result
            if name in _ELEMENTWISE and not attended:
                whole = [t for t in inputs if getattr(t, _TAG, None) is None and t.numel() > 1 and t.dim() > 0]
                if any(t.shape[-1] in {widths[s] for s in sources} for t in whole):
                    flow.escaped |= sources  # a whole tensor (a residual) added to a rank's share
                    return result
            _mark(result, sources, attended)
            return result

    return FlowMode()


def _guess_input(module: nn.Module, length: int) -> Optional[torch.Tensor]:
    """A random input (a generator of its own) of the kind the module's first layer takes: token ids where it holds
    an embedding, images where a patch embedding states its ``img_size``, else features as wide as its first linear
    layer's input."""
    params = [p for p in module.parameters() if p.is_floating_point()]
    if not params or params[0].device.type == "meta":
        return None
    dtype, device = params[0].dtype, params[0].device
    g = torch.Generator().manual_seed(0)
    tables = [m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)]
    if tables:
        return torch.randint(min(tables), (2, length), generator=g).to(device)
    for m in module.modules():
        size = getattr(m, "img_size", None)
        conv = next((c for c in m.modules() if isinstance(c, nn.Conv2d)), None)
        if conv is not None and isinstance(size, (tuple, list)) and len(size) == 2:
            shape = (2, conv.in_channels, int(size[0]), int(size[1]))
            return torch.randn(shape, generator=g, dtype=dtype).to(device)
    first = next((m for m in module.modules() if isinstance(m, nn.Linear)), None)
    if first is None:
        return None
    return torch.randn(2, length, first.in_features, generator=g, dtype=dtype).to(device)


def _trace_flow(module: nn.Module) -> _Flow:
    """One forward of each outermost module that runs on a guessed input (no gradient, in evaluation mode, the
    random state left as it was), recording the dataflow between its linear layers."""
    flow = _Flow()
    names = {m: n for n, m in module.named_modules()}
    linears: dict[nn.Module, str] = {m: n for m, n in names.items() if isinstance(m, nn.Linear)}
    if len(linears) < 2:
        return flow
    widths = {n: int(cast(nn.Linear, m).out_features) for m, n in linears.items()}
    current = [flow]
    handles = []

    def before_linear(m: nn.Module, args: tuple[Any, ...]) -> None:
        name, now = linears[m], current[0]
        sources, attended = _sources(a for a in args if isinstance(a, torch.Tensor))
        now.order.append(name)
        now.reach.setdefault(name, set()).update(sources)
        now.attention[name] = now.attention.get(name, False) or attended
        for s in sources:
            now.consumers.setdefault(s, set()).add(name)

    def after_linear(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if isinstance(out, torch.Tensor):
            setattr(out, _TAG, (frozenset((linears[m],)), False))

    def before_other(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        inputs: list[torch.Tensor] = []
        _tags((args, kwargs), inputs)
        current[0].escaped.update(_sources(inputs)[0])  # a norm (or any layer with weights) between two linears

    def record(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        def copied(x: Any) -> Any:
            return x.detach().clone() if isinstance(x, torch.Tensor) else x

        current[0].inputs.setdefault(
            names[m], (tuple(copied(a) for a in args), {k: copied(v) for k, v in kwargs.items()})
        )

    for m in names:
        if isinstance(m, nn.Linear):
            handles += [m.register_forward_pre_hook(before_linear), m.register_forward_hook(after_linear)]
        elif any(True for _ in m.parameters(recurse=False)):
            handles.append(m.register_forward_pre_hook(before_other, with_kwargs=True))
        if not isinstance(m, nn.Linear) and any(isinstance(c, nn.Linear) for c in m.modules()):
            handles.append(m.register_forward_pre_hook(record, with_kwargs=True))
    modes = {m: m.training for m in names}
    try:
        module.eval()
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            _run_outermost(module, flow, current, widths)
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
    return flow


def _run_outermost(module: nn.Module, flow: _Flow, current: list[_Flow], widths: dict[str, int]) -> None:
    """Run ``module`` on a guessed input and keep what its forward showed; where it cannot run so (it takes other
    inputs), its children, each on its own."""
    if not any(isinstance(m, nn.Linear) for m in module.modules()):
        return
    for length in (4, 2):
        x = _guess_input(module, length)
        if x is None:
            break
        current[0] = trial = _Flow()
        try:
            with _flow_mode(trial, widths):
                out = module(x)
        except Exception:  # a forward that needs other inputs: its children are tried one by one
            continue
        finally:
            current[0] = flow
        ends: list[torch.Tensor] = []
        _tags(out, ends)
        trial.escaped |= _sources(ends)[0]
        flow.escaped |= trial.escaped
        flow.order += trial.order
        flow.attention.update(trial.attention)
        for key, value in trial.reach.items():
            flow.reach.setdefault(key, set()).update(value)
        for key, value in trial.consumers.items():
            flow.consumers.setdefault(key, set()).update(value)
        for key, called in trial.inputs.items():
            flow.inputs.setdefault(key, called)
        return
    for child in module.children():
        _run_outermost(child, flow, current, widths)


def _structural_pairs(module: nn.Module, taken: set[str]) -> tuple[_Flow, list[tuple[str, list[str], str, int]]]:
    """``(kind, fan-out names, fan-in name, chunks)`` found by one forward: a fan-in linear layer whose input comes
    only from fan-out linear layers (through elementwise work, reshapes and attention's products), each of which
    feeds nothing else (no norm, no reduction, not the output, no other layer). ``kind`` is ``"attention"`` where the
    path goes through attention; ``chunks`` > 1 where one fan-out layer packs that many projections, each as wide as
    the fan-in layer's input (query | key | value)."""
    flow = _trace_flow(module)
    found: list[tuple[str, list[str], str, int]] = []
    used = set(taken)
    for fan_in in dict.fromkeys(flow.order):
        sources = sorted(flow.reach.get(fan_in, set()))
        if not sources or fan_in in used or any(s in used or s == fan_in for s in sources):
            continue
        if any(flow.consumers.get(s) != {fan_in} or s in flow.escaped for s in sources):
            continue
        layer = cast(nn.Linear, module.get_submodule(fan_in))
        chunks = 1
        if len(sources) == 1:
            out = int(cast(nn.Linear, module.get_submodule(sources[0])).out_features)
            chunks = out // layer.in_features if out % layer.in_features == 0 else 0
        kind = "attention" if flow.attention.get(fan_in) else "mlp"
        found.append((kind, sources, fan_in, chunks))
        used |= {fan_in, *sources}
    return flow, found


def _local_rows(width: int, chunks: int, size: int, rank: int) -> torch.Tensor:
    """The output rows of a fan-out layer ``width`` wide that rank ``rank`` holds: its piece of each of the
    ``chunks`` projections packed side by side (one: its contiguous block)."""
    chunk = width // chunks
    piece = chunk // size
    return torch.cat([torch.arange(i * chunk + rank * piece, i * chunk + (rank + 1) * piece) for i in range(chunks)])


def _runner(flow: _Flow, names: list[str]) -> Optional[str]:
    """The innermost module whose call was recorded and which holds all of ``names``."""
    found = [p for p in flow.inputs if all(p == "" or n.startswith(f"{p}.") for n in names)]
    return max(found, key=lambda p: p.count(".") + bool(p), default=None)


@contextmanager
def _as_rank(
    module: nn.Module,
    fan_out: list[str],
    fan_in: str,
    chunks: int,
    size: int,
    rank: int,
    local: list[tuple[str, str, int]],
    forwards: Optional[Mapping[str, Any]] = None,
) -> Generator[None, None, None]:
    """``module`` as rank ``rank`` of ``size`` computes it once the pair is split: the fan-out layers hold their
    rows, the fan-in layer its columns (the bias on rank 0 only: the sum adds it once), ``local``'s
    ``(holder, attribute, global count)`` the local count (``config.<name>``: on a copy of the holder's config), and
    each module of ``forwards`` runs that function as its forward."""
    saved: list[tuple[nn.Module, str, Any]] = []
    installed: list[nn.Module] = []

    def swap(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    try:
        for name in fan_out:
            layer = cast(nn.Linear, module.get_submodule(name))
            rows = _local_rows(layer.out_features, chunks, size, rank)
            swap(layer, "weight", nn.Parameter(layer.weight[rows], requires_grad=False))
            if layer.bias is not None:
                swap(layer, "bias", nn.Parameter(layer.bias[rows], requires_grad=False))
            swap(layer, "out_features", len(rows))
        layer = cast(nn.Linear, module.get_submodule(fan_in))
        cols = _local_rows(layer.in_features, 1, size, rank)
        swap(layer, "weight", nn.Parameter(layer.weight[:, cols], requires_grad=False))
        if layer.bias is not None and rank:
            swap(layer, "bias", nn.Parameter(torch.zeros_like(layer.bias), requires_grad=False))
        swap(layer, "in_features", len(cols))
        copies: dict[int, Any] = {}
        for holder_name, attribute, count in local:
            holder: Any = module.get_submodule(holder_name) if holder_name else module
            if attribute.startswith("config."):
                if id(holder) not in copies:
                    swap(holder, "config", copy.copy(holder.config))
                    copies[id(holder)] = holder.config
                holder, attribute = holder.config, attribute.removeprefix("config.")
            swap(holder, attribute, count // size)
        for owner_name, forward in (forwards or {}).items():
            owner = module.get_submodule(owner_name) if owner_name else module
            if "forward" not in vars(owner):  # a forward of the instance's own (another split's) is left alone
                installed.append(owner)
                owner.forward = types.MethodType(forward, owner)
        yield
    finally:
        for owner in installed:
            del owner.forward
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def _check_split(
    module: nn.Module,
    flow: _Flow,
    fan_out: list[str],
    fan_in: str,
    chunks: int,
    size: int,
    local: list[Any],
    forwards: Optional[Mapping[str, Any]] = None,
) -> str:
    """Run the recorded call of the innermost module holding the pair once whole (its own forward) and once as each
    rank computes it split (with ``forwards`` installed: :func:`_as_rank`): "" where the ranks' outputs of the fan-in
    layer sum to the whole one, else what went wrong."""
    runner = _runner(flow, [*fan_out, fan_in])
    if runner is None:
        return "no recorded call holds it"
    holder = module.get_submodule(runner) if runner else module
    args, kwargs = flow.inputs[runner]
    outputs: list[torch.Tensor] = []

    def capture(m: nn.Module, a: Any, out: Any) -> None:
        outputs.append(out)

    handle = module.get_submodule(fan_in).register_forward_hook(capture)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            holder(*args, **kwargs)
            whole, parts = outputs[0], []
            for rank in range(size):
                outputs.clear()
                with _as_rank(module, fan_out, fan_in, chunks, size, rank, local, forwards):
                    holder(*args, **kwargs)
                parts.append(outputs[0])
            summed = torch.stack(parts).sum(0)
            scale = 1 + float(whole.abs().max())
            equal = summed.shape == whole.shape and torch.allclose(summed, whole, rtol=1e-4, atol=1e-5 * scale)
    except Exception as error:  # the forward cannot run split this way (or compare): said in the reason
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".strip()
    finally:
        handle.remove()
    if not equal:
        why = f" ({fan_out[0]} does not pack {chunks} projections of equal width side by side)" if chunks > 1 else ""
        why = " (its own forward computes something else)" if forwards else why
        return f"the ranks' shares do not add up to the whole output{why}"
    return ""


def _structural_plan(
    module: nn.Module, size: int, taken: set[str]
) -> tuple[dict[str, Any], list[Any], dict[str, Any], list[str], list[str]]:
    """``(styles, local counts, local forwards, skipped, input split)`` for the pairs :func:`_structural_pairs` finds
    among the linear layers not in ``taken``, each checked by running its recorded call as each rank would
    (:func:`_check_split`): with its head counts (and widths) local, and where that does not add up and the module is
    laid out as nanoGPT's attention, with :func:`_nanogpt_attention_forward` as its forward. An attention whose heads
    none of these split (packed projections of unequal widths, as grouped-query litgpt's ``qkv``; head counts the
    size does not divide; a forward that computes something else on a rank's heads) has both layers split by input
    column (:func:`input_split_style`: exact whatever the forward does), listed with the reason."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles: dict[str, Any] = {}
    counts: list[tuple[str, str, int]] = []
    forwards: dict[str, Any] = {}
    skipped: list[str] = []
    input_split: list[str] = []
    if sum(isinstance(m, nn.Linear) for m in module.modules()) - len(taken) < 2:
        return styles, counts, forwards, skipped, input_split

    def heads_whole(kind: str, fan_out: list[str], fan_in: str, where: str, why: str) -> None:
        """The pair's heads cannot be split (``why``): an attention's layers by input column, anything else whole."""
        widths = [int(cast(nn.Linear, module.get_submodule(n)).in_features) for n in [*fan_out, fan_in]]
        if kind != "attention" or any(w % size for w in widths):
            skipped.append(f"{where} ({why})")
            return
        for name in [*fan_out, fan_in]:
            styles[name] = input_split_style()
        input_split.append(f"{where} ({why})")

    training = {m: m.training for m in module.modules()}
    module.eval()
    try:
        flow, found = _structural_pairs(module, taken)
        for kind, fan_out, fan_in, chunks in found:
            holder_name = fan_in.rpartition(".")[0]
            where = holder_name or type(module).__name__
            if chunks == 0:
                out = int(cast(nn.Linear, module.get_submodule(fan_out[0])).out_features)
                width = int(cast(nn.Linear, module.get_submodule(fan_in)).in_features)
                heads_whole(
                    kind, fan_out, fan_in, where, f"{fan_out[0]} packs projections of unequal widths: {out} for {width}"
                )
                continue
            reason = _indivisible(module, fan_out, fan_in, size, chunks=chunks)
            options: list[tuple[list[tuple[str, str, int]], dict[str, Any]]] = [([], {})]
            if kind == "attention":
                holder: Any = module.get_submodule(holder_name) if holder_name else module
                config = getattr(holder, "config", None)
                if isinstance(config, nn.Module):
                    config = None
                heads = [(holder_name, a, v) for a in _HEAD_COUNTS if (v := _count(getattr(holder, a, None)))]
                heads += [  # litgpt's config, read by the forward
                    (holder_name, f"config.{a}", v)
                    for a in _CONFIG_HEAD_COUNTS
                    if (v := _count(getattr(config, a, None)))
                ]
                w = [
                    (holder_name, a, v)
                    for a in (*_HEAD_WIDTHS, *_PACKED_WIDTHS)
                    if (v := _count(getattr(holder, a, None)))
                ]
                options = [(heads, {}), (heads + w, {})] if w else [(heads, {})]
                if _is_nanogpt_attention(holder, holder_name, fan_out, fan_in, chunks):
                    nano = [(holder_name, "n_head", holder.n_head), (holder_name, "n_embd", holder.n_embd)]
                    options.append((nano, {holder_name: _nanogpt_attention_forward}))
                bad = [f"{a.removeprefix('config.')}={v}" for _, a, v in heads if v % size]
                reason = reason or ", ".join(bad)
            if reason:
                heads_whole(kind, fan_out, fan_in, where, f"{reason} not divisible by {size}")
                continue
            errors = [_check_split(module, flow, fan_out, fan_in, chunks, size, *option) for option in options]
            if all(errors):
                tried = [e for (_, f), e in zip(options, errors) if f]
                also = f"; nor does nanoGPT's attention with its local heads: {tried[0]}" if tried else ""
                heads_whole(
                    kind, fan_out, fan_in, where, f"its forward does not compute the split pair: {errors[0]}{also}"
                )
                continue
            local, forward = options[errors.index("")]
            counts += local
            forwards.update(forward)
            for name in fan_out:
                styles[name] = packed_linear_style(chunks) if chunks > 1 else ColwiseParallel()
            styles[fan_in] = RowwiseParallel()
    finally:
        for m, mode in training.items():
            m.training = mode
    return styles, counts, forwards, skipped, input_split


def _is_nanogpt_attention(holder: nn.Module, holder_name: str, fan_out: list[str], fan_in: str, chunks: int) -> bool:
    """``holder`` is laid out as nanoGPT's ``CausalSelfAttention``: the pair is its ``c_attn`` (an ``nn.Linear``
    packing query | key | value, each ``n_embd`` wide) and ``c_proj`` (``n_embd`` in), and it keeps ``n_head``,
    ``n_embd``, ``dropout``, ``attn_dropout`` and ``resid_dropout``. Whether its forward computes what
    :func:`_nanogpt_attention_forward` does is not assumed: :func:`_check_split` runs both."""
    prefix = f"{holder_name}." if holder_name else ""
    attn, proj = getattr(holder, "c_attn", None), getattr(holder, "c_proj", None)
    width, heads = _count(getattr(holder, "n_embd", None)), _count(getattr(holder, "n_head", None))
    if not (isinstance(attn, nn.Linear) and isinstance(proj, nn.Linear) and width and heads and chunks == 3):
        return False
    dropouts = all(isinstance(getattr(holder, n, None), nn.Dropout) for n in ("attn_dropout", "resid_dropout"))
    return (
        fan_out == [f"{prefix}c_attn"]
        and fan_in == f"{prefix}c_proj"
        and attn.out_features == 3 * width == 3 * proj.in_features
        and width % heads == 0
        and dropouts
        and isinstance(getattr(holder, "dropout", None), (int, float))
    )


def _nanogpt_attention_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """nanoGPT's ``CausalSelfAttention.forward`` on a rank's share: ``n_head`` and ``n_embd`` are the local counts,
    and the width of the heads' output is ``n_embd``, not the input's (nanoGPT's ``view(B, T, C)``). The flash path
    (``scaled_dot_product_attention(is_causal=True)``), or where the module says ``flash`` is False (or keeps no
    ``flash`` but a ``bias`` buffer, the causal mask), the masked one with ``attn_dropout``; ``resid_dropout`` after
    ``c_proj``."""
    B, T, _ = x.size()
    q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
    size = self.n_embd // self.n_head
    q, k, v = (t.view(B, T, self.n_head, size).transpose(1, 2) for t in (q, k, v))
    flash = getattr(self, "flash", None)
    if flash is None:
        flash = "bias" not in dict(self.named_buffers(recurse=False))
    if flash:
        dropout = self.dropout if self.training else 0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=dropout, is_causal=True)
    else:
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = att @ v
    y = y.transpose(1, 2).contiguous().view(B, T, self.n_embd)
    return self.resid_dropout(self.c_proj(y))


def _count(value: Any) -> int:
    """``value`` where it is a positive count, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
