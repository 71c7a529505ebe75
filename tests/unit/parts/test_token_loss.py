"""parts/token_loss.py: counts tokens per step and rescales the synced gradients by W * k / T."""

from __future__ import annotations

import pytest
import torch

from lightning_mgpu.ledger import CommStats
from lightning_mgpu.parts.token_loss import TokenNormalization
from tests.parts_harness import in_one_rank_group


def test_rescale_turns_the_micro_batch_average_into_the_token_mean():
    def run() -> None:
        w = torch.tensor([1.0, -2.0], dtype=torch.float64, requires_grad=True)
        batches = [(torch.tensor([[1.0, 2.0], [0.5, 0.0]], dtype=torch.float64), 2), (torch.ones(1, 2).double(), 1)]
        ledger = CommStats()
        tokens = TokenNormalization(ledger)
        for x, n in batches:  # what Lightning does with k=2: backward of (sum of token losses) / k
            loss = (x @ w).pow(2).sum()
            tokens.record({"loss": loss, "num_tokens": n})
            (loss / 2).backward()
        mean = tokens.rescale([w], world_size=1, accumulate=2)
        expected = torch.tensor([1.0, -2.0], dtype=torch.float64, requires_grad=True)
        x = torch.cat([b for b, _ in batches])
        (x @ expected).pow(2).mean().backward()
        torch.testing.assert_close(w.grad, expected.grad)
        torch.testing.assert_close(mean, float((x @ expected).pow(2).mean()))
        assert (ledger.allreduce_calls, ledger.allreduce_bytes) == (1, 16)

    in_one_rank_group(run)


def test_a_step_without_tokens_is_refused():
    def run() -> None:
        with pytest.raises(ValueError, match="counted 0 tokens"):
            TokenNormalization().rescale([], world_size=1, accumulate=1)

    in_one_rank_group(run)
