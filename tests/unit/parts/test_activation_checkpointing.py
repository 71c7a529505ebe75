"""parts/activation_checkpointing.py: checked before launch, applied before wrapping, removed at teardown."""

from __future__ import annotations

import pytest

from lightning_mgpu import checkpointed_modules
from lightning_mgpu.parts.activation_checkpointing import ActivationCheckpointing
from tests.models import BlockRegressor


def test_a_policy_matching_no_module_is_refused_by_the_check():
    with pytest.raises(ValueError, match="'ConvBlock'"):
        ActivationCheckpointing("ConvBlock").check(BlockRegressor())


def test_apply_then_remove_gives_the_module_back_unchanged():
    module = BlockRegressor(blocks=2)
    part = ActivationCheckpointing("Block")
    part.apply(module)
    assert checkpointed_modules(module) == ["net.1", "net.2"]
    part.remove(module)
    assert checkpointed_modules(module) == []


def test_no_policy_does_nothing():
    module = BlockRegressor(blocks=1)
    part = ActivationCheckpointing(None)
    part.check(module)
    part.apply(module)
    assert checkpointed_modules(module) == []
