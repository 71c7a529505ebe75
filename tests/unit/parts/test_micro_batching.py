"""The micro-batching part alone, in one process: splitting, the whole-batch gradient, back-off and growth."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_mgpu.parts.micro_batching import MicroBatching, MicroBatchTooSmall, batch_rows, slice_batch


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 2).double()


def _batch(n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64)


def _whole_batch_grad(model: nn.Module, batch) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(batch[0]), batch[1]).backward()
    grad = torch.cat([p.grad.flatten().clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return grad


def _run(mb: MicroBatching, model: nn.Module, batch, forward=None):
    seen: list[int] = []

    def default_forward(micro):
        seen.append(micro[0].shape[0])
        return F.mse_loss(model(micro[0]), micro[1])

    params = list(model.parameters())
    out = mb.run(batch, forward=forward or default_forward, backward=lambda loss: loss.backward(), params=params)
    out.backward()  # as Lightning's closure does after training_step: the step's gradients are added in
    return out, seen


def test_rows_and_slices_follow_the_first_dimension_through_nested_batches():
    Pair = namedtuple("Pair", "x y")
    batch = {"a": Pair(torch.arange(6), torch.zeros(6, 2)), "meta": "text", "other": torch.ones(3)}
    assert batch_rows(batch) == 6
    part = slice_batch(batch, 2, 4, 6)
    assert isinstance(part["a"], Pair) and part["a"].x.tolist() == [2, 3]
    assert part["a"].y.shape == (2, 2) and part["meta"] == "text" and part["other"].shape == (3,)
    with pytest.raises(ValueError, match="found none"):
        batch_rows(["no", "tensors"])


@pytest.mark.parametrize("size", [1, 3, 4, 10, 16])
def test_micro_batches_give_the_whole_batch_gradient_and_loss(size):
    model, batch = _model(), _batch(10)
    expected = _whole_batch_grad(model, batch)
    out, seen = _run(MicroBatching(size), model, batch)
    assert sum(seen) == 10 and max(seen) == min(size, 10)
    torch.testing.assert_close(torch.cat([p.grad.flatten() for p in model.parameters()]), expected)
    torch.testing.assert_close(out.detach(), F.mse_loss(model(batch[0]), batch[1]).detach())


def test_unweighted_micro_batch_losses_would_give_another_gradient():
    """Negative control: summing the micro-batch means without their row shares is detectably wrong."""
    model, batch = _model(), _batch(10)
    expected = _whole_batch_grad(model, batch)
    for start in range(0, 10, 3):
        F.mse_loss(model(batch[0][start : start + 3]), batch[1][start : start + 3]).backward()
    with pytest.raises(AssertionError):
        torch.testing.assert_close(torch.cat([p.grad.flatten() for p in model.parameters()]), expected)


def test_an_out_of_memory_error_redoes_the_step_at_half_size_without_losing_or_repeating_rows():
    model, batch = _model(), _batch(10)
    expected = _whole_batch_grad(model, batch)
    rows: list[list[float]] = []

    def forward(micro):
        if micro[0].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (raised on purpose)")
        rows.append(micro[0][:, 0].tolist())
        return F.mse_loss(model(micro[0]), micro[1])

    mb = MicroBatching("auto")
    _run(mb, model, batch, forward)
    assert [(b.from_size, b.to_size, b.ranks) for b in mb.backoffs] == [(10, 5, (0,)), (5, 2, (0,))]
    assert mb.size == 2
    assert sorted(v for r in rows for v in r) == sorted(batch[0][:, 0].tolist())  # each row exactly once
    torch.testing.assert_close(torch.cat([p.grad.flatten() for p in model.parameters()]), expected)


@pytest.mark.parametrize(("rank", "logged"), [(0, 1), (1, 0)])
def test_a_back_off_is_logged_once_per_job_by_rank_0(caplog, rank, logged):
    def forward(micro):
        if micro[0].shape[0] > 5:
            raise torch.OutOfMemoryError("CUDA out of memory (raised on purpose)")
        return F.mse_loss(model(micro[0]), micro[1])

    model = _model()
    with caplog.at_level("WARNING", logger="lightning_mgpu.parts.micro_batching"):
        _run(MicroBatching("auto", rank=rank), model, _batch(10), forward)
    assert sum("every rank redoes the step at micro_batch_size=5" in r.getMessage() for r in caplog.records) == logged


def test_the_gradients_survive_lightnings_zero_grad_between_step_and_backward():
    """Lightning's closure runs training_step, then zero_grad, then backward on the returned loss."""
    model, batch = _model(), _batch(10)
    expected = _whole_batch_grad(model, batch)
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # a previous step's gradients
    out = MicroBatching(3).run(
        batch, forward=lambda m: F.mse_loss(model(m[0]), m[1]), backward=lambda loss: loss.backward(),
        params=list(model.parameters()),
    )  # fmt: skip
    model.zero_grad(set_to_none=True)
    out.backward()
    torch.testing.assert_close(torch.cat([p.grad.flatten() for p in model.parameters()]), expected)


def test_gradients_not_kept_are_dropped_at_the_start_of_the_step():
    model, batch = _model(), _batch(10)
    expected = _whole_batch_grad(model, batch)
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # the previous optimizer step's, which Lightning would zero
    params = list(model.parameters())
    out = MicroBatching(3).run(
        batch, forward=lambda m: F.mse_loss(model(m[0]), m[1]), backward=lambda loss: loss.backward(),
        params=params, keep_gradients=False,
    )  # fmt: skip
    assert all(p.grad is None for p in params)
    out.backward()
    torch.testing.assert_close(torch.cat([p.grad.flatten() for p in params]), expected)


def test_a_redo_keeps_the_gradients_accumulated_before_the_step():
    model, first, second = _model(), _batch(6), _batch(8)
    expected = _whole_batch_grad(model, first) + _whole_batch_grad(model, second)
    calls = {"n": 0}

    def forward(micro):
        calls["n"] += 1
        if calls["n"] == 3:  # in the middle of the second batch, after one of its micro-batches went backward
            raise torch.OutOfMemoryError("out of memory (raised on purpose)")
        return F.mse_loss(model(micro[0]), micro[1])

    mb = MicroBatching(4)
    _run(mb, model, first, forward)
    _run(mb, model, second, forward)
    assert len(mb.backoffs) == 1
    torch.testing.assert_close(torch.cat([p.grad.flatten() for p in model.parameters()]), expected)


def test_the_micro_batch_grows_back_after_clean_steps():
    model, batch = _model(), _batch(8)
    pressure = {"limit": 2}

    def forward(micro):
        if micro[0].shape[0] > pressure["limit"]:
            raise torch.OutOfMemoryError("out of memory (raised on purpose)")
        return F.mse_loss(model(micro[0]), micro[1])

    mb = MicroBatching("auto", grow_after=2)
    _run(mb, model, batch, forward)
    assert mb.size == 2
    pressure["limit"] = 8  # the pressure eases: the size climbs back to the whole batch
    for _ in range(6):
        _run(mb, model, batch, forward)
    assert mb.size == 8


def test_one_row_that_does_not_fit_is_a_clear_error():
    model, batch = _model(), _batch(4)

    def forward(micro):
        raise torch.OutOfMemoryError("out of memory (raised on purpose)")

    with pytest.raises(MicroBatchTooSmall, match="micro-batch of 1 row"):
        _run(MicroBatching(2), model, batch, forward)


def test_other_errors_are_not_retried():
    model, batch = _model(), _batch(4)

    def forward(micro):
        raise ValueError("a bug in training_step")

    mb = MicroBatching(2)
    with pytest.raises(ValueError, match="a bug"):
        _run(mb, model, batch, forward)
    assert mb.backoffs == []


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "max"])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="micro_batch_size"):
        MicroBatching(bad)
