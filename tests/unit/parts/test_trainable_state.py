"""Adapter-only checkpoints without a Trainer: which saves leave the frozen base out, what the checkpoint keeps,
and the fingerprint that refuses another base (``lightning_mgpu/parts/trainable_state.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_mgpu.parts.trainable_state import (
    KEY,
    check_base,
    check_keys,
    differences,
    fingerprint,
    frozen_parameters,
    saves_trainable_only,
    trainable_only,
)
from tests.corpus import FrozenParameters


class Adapted(nn.Module):
    """A frozen base (a 16x16 layer and a norm) with a small trainable adapter and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.adapter = nn.Linear(16, 2, bias=False)
        self.register_buffer("seen", torch.zeros(()))
        self.base.requires_grad_(False)
        self.norm.requires_grad_(False)


def _identity(obj: object) -> object:
    return obj


def test_which_saves_leave_the_frozen_base_out() -> None:
    adapted, mostly_trained = Adapted(), FrozenParameters()  # 306 of 338 frozen; 112 of 531 frozen
    assert [saves_trainable_only(adapted, s) for s in ("all", "trainable", "auto")] == [False, True, True]
    assert [saves_trainable_only(mostly_trained, s) for s in ("all", "trainable", "auto")] == [False, True, False]
    assert not saves_trainable_only(nn.Linear(2, 2), "trainable")  # nothing frozen: a full checkpoint


def test_an_adapter_only_checkpoint_keeps_the_trainable_parameters_and_buffers_and_the_fingerprint() -> None:
    model = Adapted()
    checkpoint = {"state_dict": model.state_dict(), "epoch": 3, "optimizer_states": [{"state": {}}]}
    trainable_only(checkpoint, model)
    assert set(checkpoint["state_dict"]) == {"adapter.weight", "seen"}
    assert set(checkpoint[KEY]["frozen"]) == {"base.weight", "base.bias", "norm.weight", "norm.bias"}
    assert checkpoint[KEY]["frozen"]["base.weight"]["shape"] == [16, 16]
    assert checkpoint["epoch"] == 3 and "optimizer_states" in checkpoint
    # the fingerprint is plain data: it loads with weights_only=True
    assert all(isinstance(v["first_row"], str) for v in checkpoint[KEY]["frozen"].values())


def test_the_fingerprint_names_what_differs_in_another_base() -> None:
    model = Adapted()
    saved = fingerprint(frozen_parameters(model))
    assert differences(saved, fingerprint(frozen_parameters(Adapted()))) == []  # the same base, built again
    other = Adapted()
    with torch.no_grad():  # one ulp in the first row: detected
        w = other.base.weight
        w[0, 3] = torch.nextafter(w[0, 3], w[0, 3] + 1)
    other.norm.bias = nn.Parameter(other.norm.bias.detach().double(), requires_grad=False)
    other.base.bias.requires_grad_(True)
    other.extra = nn.Parameter(torch.zeros(3), requires_grad=False)
    assert differences(saved, fingerprint(frozen_parameters(other))) == [
        "base.weight: different values (its first row)",
        "base.bias: frozen at save, now absent or trainable",
        "norm.bias: float32(16,) at save, float64(16,) now",
        "extra: frozen now, not frozen (so saved) at save",
    ]


def test_a_change_outside_the_first_rows_is_not_seen() -> None:
    """The documented limit of a sampled fingerprint: only each tensor's first row is hashed."""
    saved = fingerprint(frozen_parameters(Adapted()))
    other = Adapted()
    with torch.no_grad():
        other.base.weight[5] += 1.0
    assert differences(saved, fingerprint(frozen_parameters(other))) == []


def test_check_base_refuses_another_base_and_passes_a_full_checkpoint() -> None:
    model = Adapted()
    checkpoint = {"state_dict": model.state_dict()}
    assert check_base(checkpoint, model, True, _identity) is None  # a full checkpoint: nothing to check
    trainable_only(checkpoint, model)
    assert check_base(checkpoint, Adapted(), True, _identity) == set(checkpoint[KEY]["frozen"])
    other = Adapted()
    with torch.no_grad():
        other.base.weight.mul_(2)
    with pytest.raises(ValueError, match=r"1 of 4 frozen parameters differ: base\.weight.*same base weights"):
        check_base(checkpoint, other, True, _identity)
    # a rank other than 0 takes rank 0's verdict (here: the broadcast hands it the refusal)
    with pytest.raises(ValueError, match="another frozen base"):
        check_base(checkpoint, Adapted(), False, lambda _: "This checkpoint ... another frozen base")


def test_a_strict_load_checks_the_adapters_keys() -> None:
    model = Adapted()
    checkpoint = {"state_dict": model.state_dict()}
    trainable_only(checkpoint, model)
    left_out = set(checkpoint[KEY]["frozen"])
    check_keys(checkpoint["state_dict"], model, left_out)
    broken = copy.copy(checkpoint["state_dict"])
    del broken["adapter.weight"]
    broken["extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"missing keys \['adapter.weight'\], unexpected keys \['extra'\]"):
        check_keys(broken, model, left_out)


def test_a_4bit_base_is_saved_adapter_only_under_auto_and_fingerprinted_by_its_dequantised_values() -> None:
    """A 4-bit base (torchao's NF4): ``"auto"`` leaves it out even where it is a small share of the parameters; a
    sharded directory of it (``"all"``) is refused before launch with the fix; its fingerprint is that of the values
    the layers compute with, so a base quantised from another one (or left in full precision) is refused."""
    from lightning_mgpu.parts.trainable_state import check_sharded_save
    from lightning_mgpu.quantization import dequantized, quantize_frozen

    class MostlyTrained(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.base = nn.Linear(128, 128, bias=False).requires_grad_(False)  # 16,384 frozen
            self.head = nn.Linear(128, 512)  # 66,048 trainable

    model = MostlyTrained()
    full_precision = fingerprint(frozen_parameters(model))
    assert not saves_trainable_only(model, "auto")  # before: most parameters train, a full checkpoint
    check_sharded_save(model, "all")
    quantize_frozen(model, scaler_block_size=64)
    assert saves_trainable_only(model, "auto") and saves_trainable_only(model, "trainable")
    assert not saves_trainable_only(model, "all")  # a consolidated file holds the packed base
    check_sharded_save(model, "trainable")
    check_sharded_save(model, "auto")
    with pytest.raises(
        ValueError, match=r"checkpoint_params='all' would write MostlyTrained's 4-bit base \(base\.weight"
    ):
        check_sharded_save(model, "all")
    packed = fingerprint(frozen_parameters(model))
    plain = nn.Parameter(dequantized(model.base.weight).clone(), requires_grad=False)
    assert packed == fingerprint({"base.weight": plain})  # the dequantised values
    assert differences(full_precision, packed) == ["base.weight: different values (its first row)"]  # quantised
