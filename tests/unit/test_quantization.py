"""quantization.py: a frozen base's linear weights in 4 bits (torchao's NF4), and the checks around it."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_mgpu import quantization
from lightning_mgpu.quantization import check_shardable, dequantized, has_nf4, is_nf4, quantize_frozen


class Model(nn.Module):
    """A frozen base (two linear layers, an embedding) with a trainable adapter beside it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 128)
        self.base = nn.Linear(128, 128, bias=True)
        self.head = nn.Linear(128, 256, bias=False)
        self.adapter = nn.Linear(128, 128, bias=False)
        self.double()
        for module in (self.embed, self.base, self.head):
            module.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.base(x) + self.adapter(x))


def test_only_frozen_linear_weights_are_packed_and_the_layer_computes_with_their_dequantised_values() -> None:
    model = Model()
    original = model.base.weight.detach().clone()
    names = quantize_frozen(model, scaler_block_size=64)
    assert names == ["base.weight", "head.weight"]
    assert is_nf4(model.base.weight) and is_nf4(model.head.weight) and has_nf4(model)
    # the adapter, the bias and the embedding stay as they were; the packed weights stay frozen
    assert not is_nf4(model.adapter.weight) and model.adapter.weight.requires_grad
    assert not is_nf4(model.base.bias) and not is_nf4(model.embed.weight)
    assert not model.base.weight.requires_grad
    # 4 bits: the values moved (NF4 rounds each to one of 16 levels per block) but stay near the original
    values = dequantized(model.base.weight)
    assert values.dtype == torch.float64 and not torch.equal(values, original)
    assert (values - original).abs().max() < 0.25 * original.abs().max()
    # the forward is the plain layer's, computed with exactly those values; the adapter gets its gradient
    x = torch.randn(4, 128, dtype=torch.float64)
    expected = F.linear(F.linear(x, values, model.base.bias) + model.adapter(x), dequantized(model.head.weight))
    out = model(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert model.adapter.weight.grad is not None and model.base.weight.grad is None
    # a second call packs nothing again
    assert quantize_frozen(model, scaler_block_size=64) == []


def test_bad_input_is_refused_naming_the_value_and_the_fix() -> None:
    trainable = nn.Linear(128, 128)
    with pytest.raises(ValueError, match=r"no frozen nn.Linear weight in Linear.*Freeze the base first"):
        quantize_frozen(trainable)
    narrow = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 64)).requires_grad_(False)  # a GQA key projection
    with pytest.raises(ValueError, match=r"16384 elements.*1\.weight \(8192 elements\).*Pass scaler_block_size=128"):
        quantize_frozen(narrow)
    odd = nn.Sequential(nn.Linear(128, 128), nn.Linear(100, 128)).requires_grad_(False)
    with pytest.raises(ValueError, match=r"1\.weight \(12800 elements\).*Pass scaler_block_size=8 "):
        quantize_frozen(odd)
    assert not has_nf4(odd)  # nothing was packed: the check runs before any weight is replaced
    with pytest.raises(ValueError, match=r"quantize_frozen\(block_size=0\): a positive int"):
        quantize_frozen(odd, block_size=0)


def test_without_torchao_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def missing(name: str, *args: object) -> object:
        if name.startswith("torchao"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args)

    monkeypatch.setattr(quantization.importlib, "import_module", missing)
    with pytest.raises(ImportError, match=r'pip install "lightning-mgpu\[torchao\]"'):
        quantize_frozen(Model())


def test_zero3_shards_must_hold_whole_blocks() -> None:
    one_group = Model()
    quantize_frozen(one_group)  # 128 x 128 at 64 x 256: a single scaler block, which cannot be split
    check_shardable(one_group, 1)
    with pytest.raises(ValueError, match=r"over 2 ranks.*base\.weight \(\(128, 128\), blocks of 16384.*smaller"):
        check_shardable(one_group, 2)
    four_groups = Model()
    quantize_frozen(four_groups, scaler_block_size=64)  # 4 scaler blocks in base.weight, 8 in head.weight
    check_shardable(four_groups, 2)
    check_shardable(four_groups, 4)
    with pytest.raises(ValueError, match=r"base\.weight"):
        check_shardable(four_groups, 8)
