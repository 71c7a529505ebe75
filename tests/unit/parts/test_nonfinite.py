"""parts/nonfinite.py: the agreed check names the parameter and passes finite gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mgpu.ledger import CommStats
from lightning_mgpu.parts.nonfinite import NonFiniteCheck
from tests.parts_harness import in_one_rank_group


def test_finite_gradients_pass_and_a_nan_is_named():
    def run() -> None:
        model = nn.Linear(2, 2)
        model(torch.ones(1, 2)).sum().backward()
        ledger = CommStats()
        check = NonFiniteCheck(ledger)
        check.check(list(model.named_parameters()), rank=0, world_size=1, step=3)
        model.bias.grad[1] = float("inf")
        with pytest.raises(FloatingPointError, match="optimizer step 3 \\(rank 0: parameter 'bias'"):
            check.check(list(model.named_parameters()), rank=0, world_size=1, step=3)
        assert ledger.allreduce_calls == 0  # one rank: nothing to agree on

    in_one_rank_group(run)
