"""parts/clipping.py: clipping by the norm over every rank's gradient share, with one scalar all-reduce."""

from __future__ import annotations

import torch
from torch import nn

from lightning_mgpu.ledger import CommStats
from lightning_mgpu.parts.clipping import GlobalNormClipping
from tests.parts_harness import in_one_rank_group


def _model_with_grads() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).double()
    model(torch.randn(5, 4, dtype=torch.float64)).pow(2).sum().backward()
    return model


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def test_clip_equals_torch_clip_grad_norm_and_counts_one_all_reduce():
    def run() -> None:
        model, expected = _model_with_grads(), _model_with_grads()
        torch.nn.utils.clip_grad_norm_(expected.parameters(), 0.1)
        ledger = CommStats()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        total = GlobalNormClipping(_params, ledger=ledger).clip(opt, 0.1)
        assert total > 0.1, "the clip must bite for the comparison to mean anything"
        for p, q in zip(model.parameters(), expected.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        assert (ledger.allreduce_calls, ledger.allreduce_bytes) == (1, 8)

    in_one_rank_group(run)


def test_only_the_share_given_is_measured_and_scaled():
    """The norm is taken over the share ``share_of`` names (on one rank: the whole group's), and only that share
    is scaled; the multi-rank proof is tests/integration/test_numerics.py."""

    def run() -> None:
        model = _model_with_grads()
        whole = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        first = list(model[0].parameters())
        before = [p.grad.clone() for p in first]
        total = GlobalNormClipping(lambda opt: _params(opt)).total_norm([p.grad for p in model.parameters()])
        torch.testing.assert_close(total, whole)
        GlobalNormClipping(lambda opt: first).clip(torch.optim.SGD(model.parameters(), lr=0.1), 0.1)
        local = torch.linalg.vector_norm(torch.stack([g.norm() for g in before]))
        for p, g in zip(first, before):
            torch.testing.assert_close(p.grad, g * (0.1 / (local + 1e-6)))

    in_one_rank_group(run)
