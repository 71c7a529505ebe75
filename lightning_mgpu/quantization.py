"""A 4-bit frozen base: the frozen linear weights of a fine-tuned model held as torchao's ``NF4Tensor`` (the QLoRA
paper's 4-bit NormalFloat with double-quantised scalers), the adapters beside them trained in full precision.

:func:`quantize_frozen` replaces the weight of every frozen ``nn.Linear`` of a module (``requires_grad=False``: a
``peft`` base, or weights the user froze) by its NF4 form; the layer's forward is unchanged (torchao's tensor
dequantises itself inside ``F.linear``, to the input's dtype, and returns no gradient for the weight). Call it once
the base is built and frozen and before the Trainer sets the model up (in ``__init__`` after ``get_peft_model``,
or in ``configure_model``). The dequantised weights are a function of the original weights only, so every rank
and every layout computes with the same base, and adapters trained on N ranks equal one process with the same
4-bit base (``tests/integration/test_quantization.py``).

What each layout does with the packed bytes: ``mgpu_ddp`` and ZeRO-1 keep the whole 4-bit base on every rank;
FSDP2's stages (ZeRO-2 and 3) and HSDP shard it (torchao's tensor implements FSDP2's all-gather extension: each rank
keeps its rows' packed bytes and scalers, and the layer gathers them, still packed, before it computes). A shard
must hold whole quantisation blocks: a weight of ``numel`` elements splits over ``W`` ranks when ``numel`` is a
multiple of ``W * block_size * scaler_block_size`` (:func:`check_shardable` says which weight does not, and the
fix).

torchao is an optional dependency: ``pip install "lightning-mgpu[torchao]"``.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

import torch
from torch import nn

#: torchao's defaults (the QLoRA paper's): 64 weights per 4-bit block, 256 blocks per 8-bit scaler block
BLOCK_SIZE = 64
SCALER_BLOCK_SIZE = 256
_NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"


def _torchao() -> Any:
    """torchao's NF4 module (checked with torchao 0.18.0), or an ImportError naming the extra."""
    try:
        return importlib.import_module(_NF4_MODULE)
    except ImportError as err:
        raise ImportError(
            "A 4-bit (NF4) base needs torchao, which is not installed. Install the extra: "
            'pip install "lightning-mgpu[torchao]" (torchao 0.18.0 is the release tested).'
        ) from err


def loads_once_imported(error: BaseException) -> bool:
    """Whether ``error``, ``torch.load(weights_only=True)``'s refusal, names torchao's ``NF4Tensor`` (a checkpoint
    holding a 4-bit base, read where torchao is not imported yet). Imports torchao's NF4 module, which allows its own
    class for weights-only loading, so a second load succeeds; an ImportError naming the extra where torchao is
    missing."""
    if _NF4_MODULE not in str(error):
        return False
    _torchao()
    return True


def is_nf4(tensor: Any) -> bool:
    """Whether ``tensor`` (a parameter, its data, or a ``DTensor`` whose local shard is one) is torchao's
    ``NF4Tensor``; False without torchao."""
    to_local = getattr(tensor, "to_local", None)  # a DTensor's shard, read without a collective
    if callable(to_local):
        tensor = to_local()
    return type(tensor).__name__ == "NF4Tensor" and type(tensor).__module__ == _NF4_MODULE


def has_nf4(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is 4-bit (its ``DTensor`` shard under ZeRO-3 included)."""
    return any(is_nf4(p) for p in module.parameters())


def stored_bytes(tensor: torch.Tensor) -> int:
    """The bytes ``tensor`` stores: for a 4-bit weight its packed pieces (the 4-bit codes, two to a byte, the 8-bit
    scalers and their factors), for any other tensor its elements times their size. What the planner counts.

    Example:

        >>> import torch
        >>> from lightning_mgpu.quantization import stored_bytes
        >>> stored_bytes(torch.zeros(128, 128))
        65536
    """
    if is_nf4(tensor):
        names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
        return sum(stored_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def empty_packed(tensor: torch.Tensor) -> torch.Tensor:
    """A 4-bit weight of ``tensor``'s shape, dtype and packing whose pieces are new empty tensors, made in the
    caller's tensor mode: the planner's stand-in of a 4-bit weight under ``FakeTensorMode`` (it computes as the
    weight does, and its pieces are what :func:`stored_bytes` counts)."""
    names, context = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    pieces = {
        name: torch.empty(tuple(getattr(tensor, name).shape), dtype=getattr(tensor, name).dtype) for name in names
    }
    return type(tensor).__tensor_unflatten__(pieces, context, tensor.size(), tensor.stride())  # type: ignore[attr-defined]


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """The values of a 4-bit tensor in the dtype it was quantised from (this rank's rows for a shard)."""
    return tensor.get_original_weight()  # type: ignore[attr-defined]


def _largest_scaler_block(sizes: list[int], elements_per_block: int, at_most: int) -> Optional[int]:
    """The largest ``scaler_block_size`` of at most ``at_most`` for which every size is a whole number of scaler
    blocks of ``elements_per_block`` elements each (``block_size``, times the shards a weight is split over); None
    where none is."""
    return next((s for s in range(at_most, 0, -1) if all(n % (elements_per_block * s) == 0 for n in sizes)), None)


def quantize_frozen(
    module: nn.Module, *, block_size: int = BLOCK_SIZE, scaler_block_size: int = SCALER_BLOCK_SIZE
) -> list[str]:
    """Replace the weight of every frozen ``nn.Linear`` in ``module`` by its NF4 form, in place; returns the names of
    the weights replaced (``"model.layers.0.self_attn.q_proj.weight"``). Trainable layers (the adapters, or a head
    left trainable) and biases stay as they are. Raises ValueError, naming the weight and the fix, for a frozen
    linear weight whose size is not a multiple of ``block_size * scaler_block_size`` (NF4 packs whole blocks), and
    when no frozen linear weight is found (freeze the base first: ``get_peft_model`` does, or
    ``requires_grad_(False)``). A weight already in NF4 is left alone, so a second call changes nothing.

    Example:

        >>> from torch import nn
        >>> from lightning_mgpu import quantize_frozen
        >>> model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 8))
        >>> model[0].requires_grad_(False)  # the frozen base; model[1] stays trainable
        Linear(in_features=128, out_features=128, bias=True)
        >>> quantize_frozen(model)
        ['0.weight']
        >>> quantize_frozen(model)  # already packed
        []
    """
    nf4 = _torchao()
    for name, value in (("block_size", block_size), ("scaler_block_size", scaler_block_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"quantize_frozen({name}={value!r}): a positive int is needed (torchao's default: 64/256)")
    group = block_size * scaler_block_size
    frozen = [
        (f"{prefix}.weight" if prefix else "weight", layer)
        for prefix, layer in module.named_modules()
        if isinstance(layer, nn.Linear) and not layer.weight.requires_grad
    ]
    if not frozen:
        raise ValueError(
            f"quantize_frozen found no frozen nn.Linear weight in {type(module).__name__}: NF4 holds a frozen base "
            "only. Freeze the base first (peft's get_peft_model does, or module.requires_grad_(False)), then call it."
        )
    bad = [(name, layer.weight.numel()) for name, layer in frozen if layer.weight.numel() % group]
    if bad:
        listed = ", ".join(f"{name} ({numel} elements)" for name, numel in bad[:4])
        fitting = _largest_scaler_block(
            [layer.weight.numel() for _, layer in frozen], block_size, scaler_block_size - 1
        )
        fix = (
            f"Pass scaler_block_size={fitting} (the largest that every frozen weight takes)"
            if fitting is not None
            else f"No scaler_block_size fits every weight at block_size={block_size}: pass a smaller block_size"
        )
        raise ValueError(
            f"quantize_frozen(block_size={block_size}, scaler_block_size={scaler_block_size}) packs blocks of "
            f"{group} elements, and these frozen weights are not a multiple of it: {listed}"
            f"{' and more' if len(bad) > 4 else ''}. {fix}, or leave those layers trainable."
        )
    done = []
    for name, layer in frozen:
        if is_nf4(layer.weight):
            continue
        with torch.no_grad():
            packed = nf4.to_nf4(layer.weight.detach().contiguous(), block_size, scaler_block_size)
        layer.weight = nn.Parameter(packed, requires_grad=False)
        done.append(name)
    return done


def bitsandbytes_weights(module: nn.Module) -> list[str]:
    """The names of ``module``'s parameters that bitsandbytes quantized (its 4-bit ``Params4bit`` and 8-bit
    ``Int8Params``: a Hugging Face model loaded with ``BitsAndBytesConfig``); bitsandbytes need not be imported."""
    return [
        name for name, param in module.named_parameters() if type(param).__module__.partition(".")[0] == "bitsandbytes"
    ]


def refuse_bitsandbytes_shards(module: nn.Module, layout: str) -> None:
    """Before FSDP2 shards ``module`` (``layout`` names the setting that does it): a weight bitsandbytes quantized is
    refused, with the fix. FSDP2 shards each weight as a plain tensor, without the quantization state bitsandbytes
    keeps beside it, and adapters trained over such a base do not equal one process's; ``mgpu_ddp`` and ZeRO-1 keep
    the base whole on each rank and train them as one process does (``tests/integration/test_quantization.py``)."""
    quantized = bitsandbytes_weights(module)
    if quantized:
        kind = type(module.get_parameter(quantized[0])).__name__
        raise ValueError(
            f"{quantized[0]} is quantized by bitsandbytes ({kind}; {len(quantized)} such weights), and {layout} "
            f"shards it with FSDP2, which splits the packed bytes without bitsandbytes' quantization state: the "
            f"adapters would not train as on one process. Keep the 4-bit base whole on each rank with "
            f"strategy='mgpu_ddp' or 'mgpu_zero1' (MGPUShardedStrategy(stage=1)), or load the base in full "
            f"precision and pack its frozen weights with lightning_mgpu.quantize_frozen (torchao's NF4, which "
            f"ZeRO-3 shards)."
        )


def check_shardable(module: nn.Module, shards: int) -> None:
    """Before ZeRO-3/HSDP shards ``module`` over ``shards`` ranks: every NF4 weight must split into whole blocks
    (each rank's rows hold a whole number of scaler blocks). Raises ValueError naming the first weights that do not,
    their sizes and the fix; torchao would otherwise fail inside FSDP2 with an assertion."""
    if shards <= 1:
        return
    bad, sizes, block = [], [], BLOCK_SIZE
    for name, param in module.named_parameters():
        if not is_nf4(param):
            continue
        packed: Any = param  # torchao's NF4Tensor: its block sizes are attributes
        block, group = packed.block_size, packed.block_size * packed.scaler_block_size
        sizes.append(param.numel())
        if param.shape[0] % shards or param.numel() % (group * shards):
            bad.append(f"{name} ({tuple(param.shape)}, blocks of {group} elements)")
    if bad:
        fitting = _largest_scaler_block(sizes, block * shards, SCALER_BLOCK_SIZE)
        requantize = f"quantize_frozen(..., scaler_block_size={fitting}), " if fitting else ""
        raise ValueError(
            f"ZeRO-3 shards each 4-bit weight over {shards} ranks, and these do not split into whole NF4 blocks: "
            f"{', '.join(bad[:4])}{' and more' if len(bad) > 4 else ''}. Quantize with {requantize or 'a smaller '}"
            f"{'' if requantize else 'scaler_block_size, '}shard over fewer ranks (mesh='hybrid' with a smaller "
            "shard_size), or keep the base whole on each rank (stage=1, mgpu_zero1, or mgpu_ddp)."
        )
