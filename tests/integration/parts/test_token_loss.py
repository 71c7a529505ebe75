"""``loss_normalization="tokens"``: 2 ranks x k=3 micro-batches with padding masks of different token counts give
the weights of one process minimising the mean over every token of the concatenated batch (float64), for
automatic and manual optimization and every strategy family; the logged ``loss_per_token`` is that mean."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import ManualAccumulation, MGPUDDPStrategy, MGPUShardedStrategy
from lightning_mgpu.settings import CommonSettings
from tests.models import RankData, Regressor
from tests.numerics_harness import WORLD, fit_job, run_jobs

B, K, L, EPOCHS = 2, 3, 5, 2
N = 4 * WORLD * B * K  # 4 steps per epoch


def token_data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, L, 6, generator=g, dtype=torch.float64)
    y = torch.randn(N, L, 3, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, L + 1, (N,), generator=g)  # 1..L real tokens, the rest padding
    mask = (torch.arange(L)[None, :] < lengths[:, None]).to(torch.float64)
    return TensorDataset(x, y, mask)


def token_losses(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x, y, mask = batch
    per_token = ((model(x) - y) ** 2).mean(-1) * mask
    return per_token.sum(), mask.sum()


class TokenRegressor(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        loss, tokens = token_losses(self, batch)
        return {"loss": loss, "num_tokens": tokens}


class ManualTokenRegressor(ManualAccumulation, Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        loss, tokens = token_losses(self, batch)
        self.manual_backward(loss)
        self.trainer.strategy.add_tokens(tokens, loss)
        opt.step()


def reference() -> tuple[torch.Tensor, float]:
    """One process over the concatenated batch of each step: the mean over its real tokens."""
    model = Regressor().double()
    opt = torch.optim.SGD(model.parameters(), lr=model.lr, momentum=0.9)
    last = 0.0
    for _ in range(EPOCHS):
        for batch in DataLoader(token_data(), batch_size=WORLD * B * K, shuffle=False):
            opt.zero_grad()
            loss, tokens = token_losses(model, batch)
            (loss / tokens).backward()
            opt.step()
            last = float(loss.detach() / tokens)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), last


def _micro_batch_mean_reference() -> torch.Tensor:
    """Negative control: the mean per micro-batch averaged over micro-batches and ranks (Lightning's default)."""
    model = Regressor().double()
    opt = torch.optim.SGD(model.parameters(), lr=model.lr, momentum=0.9)
    for _ in range(EPOCHS):
        for batch in DataLoader(token_data(), batch_size=WORLD * B * K, shuffle=False):
            opt.zero_grad()
            chunks = [torch.split(t, B) for t in batch]
            total = sum(s / n for s, n in (token_losses(model, mb) for mb in zip(*chunks)))
            (total / (WORLD * K)).backward()
            opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


STRATEGIES: dict[str, Callable[[], Any]] = {
    "ddp": lambda: MGPUDDPStrategy(start_method="popen", loss_normalization="tokens"),
    "zero1": lambda: MGPUShardedStrategy(stage=1, start_method="popen", loss_normalization="tokens"),
    "zero2": lambda: MGPUShardedStrategy(stage=2, start_method="popen", loss_normalization="tokens"),
    "zero2_fairscale": lambda: MGPUShardedStrategy(
        stage=2, backend="fairscale", start_method="popen", loss_normalization="tokens"
    ),
    "zero3": lambda: MGPUShardedStrategy(stage=3, start_method="popen", loss_normalization="tokens"),
}
KWARGS = {
    "accelerator": "cpu",
    "devices": WORLD,
    "max_epochs": EPOCHS,
    "accumulate_grad_batches": K,
    "use_distributed_sampler": False,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "limit_val_batches": 0,
    "num_sanity_val_steps": 0,
}
JOBS = [*((name, TokenRegressor) for name in STRATEGIES), ("ddp", ManualTokenRegressor)]


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    jobs = [
        fit_job(lambda m=model: m().double(), STRATEGIES[name], lambda: RankData(token_data(), B), KWARGS)
        for name, model in JOBS
    ]
    return run_jobs(jobs)


@pytest.mark.parametrize("index", range(len(JOBS)), ids=[f"{n}-{m.__name__}" for n, m in JOBS])
def test_gradient_is_that_of_the_mean_over_every_token_of_the_step(index, runs):
    expected, last_mean = reference()
    got = runs[index]
    assert got["global_step"] == EPOCHS * N // (WORLD * B * K)
    torch.testing.assert_close(got["weights"], expected)
    torch.testing.assert_close(got["metrics"]["loss_per_token"], last_mean)
    initial = torch.cat([p.detach().flatten() for p in Regressor().double().parameters()])
    assert (expected - initial).abs().max() > 1e-2, "weights did not move"


def test_token_counts_differ_so_the_micro_batch_mean_is_a_different_answer():
    """Negative control: the micro-batches hold different token counts, so the default per-micro-batch mean
    ends elsewhere; the comparison above can fail."""
    counts = {int(m.sum()) for m in torch.split(token_data().tensors[2], B)}
    assert len(counts) > 1
    with pytest.raises(AssertionError):
        torch.testing.assert_close(_micro_batch_mean_reference(), reference()[0])


def test_unknown_normalization_and_a_missing_count_are_refused():
    with pytest.raises(ValueError, match="loss_normalization='sum' is unknown"):
        CommonSettings(loss_normalization="sum")  # type: ignore[arg-type]
    from lightning_mgpu.parts.token_loss import TokenNormalization

    with pytest.raises(ValueError, match="needs training_step to return"):
        TokenNormalization().record(torch.tensor(1.0))
