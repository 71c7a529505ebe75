"""Comm hooks are really applied on CPU/gloo, and the ledger counts what they hand to the collective."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_mgpu import MGPUDDPStrategy
from tests.helpers import Regressor, fit, make_data, plain_ddp_weights

B = 4
EPOCHS = 2


def _fit32(tmp_path, name, **strategy_kwargs):
    model = Regressor(hidden=32)
    strategy = MGPUDDPStrategy(start_method="fork", **strategy_kwargs)
    return fit(
        model,
        strategy,
        tmp_path / name,
        dataset=make_data(dtype=torch.float32),
        batch_size=B,
        max_epochs=EPOCHS,
        profile=True,
    )


def test_fp16_hook_changes_weights_slightly_and_matches_torch_ddp_with_the_hook(tmp_path):
    plain = _fit32(tmp_path, "none")[0]
    fp16 = _fit32(tmp_path, "fp16", comm_hook="fp16")[0]
    diff = (fp16["weights"] - plain["weights"]).abs().max().item()
    assert 0 < diff < 1e-2, f"fp16 compression must change the weights a little, changed by {diff}"

    by_hand = plain_ddp_weights(Regressor(hidden=32), make_data(dtype=torch.float32), B, EPOCHS, tmp_path, "fp16")
    torch.testing.assert_close(fp16["weights"], by_hand)
    # and our no-hook path is torch DDP's default averaging
    torch.testing.assert_close(
        plain["weights"], plain_ddp_weights(Regressor(hidden=32), make_data(dtype=torch.float32), B, EPOCHS, tmp_path)
    )


def test_fp16_hook_halves_the_bytes_handed_to_the_collective(tmp_path):
    plain_rank0 = _fit32(tmp_path, "none")[0]
    fp16_rank0 = _fit32(tmp_path, "fp16", comm_hook="fp16")[0]
    # the fp16 hook is Python: the spy on torch.distributed.all_reduce sees its calls and bytes
    assert fp16_rank0["batch_ledger"] == fp16_rank0["batch_spy"], "ledger disagrees with the all_reduce spy"
    assert [c for c, _ in fp16_rank0["batch_spy"]] == fp16_rank0["batch_allreduces"], "spy disagrees with profiler"
    # no hook: DDP's built-in C++ all-reduce, which only torch.profiler sees
    assert all(c == 0 for c, _ in plain_rank0["batch_spy"])
    assert plain_rank0["batch_ledger_calls"] == plain_rank0["batch_allreduces"]
    plain, fp16 = plain_rank0["ledger"], fp16_rank0["ledger"]
    assert fp16.allreduce_calls == plain.allreduce_calls
    assert fp16.allreduce_bytes * 2 == plain.allreduce_bytes
    assert plain.ratio_to_lower_bound == pytest.approx(1.0)
    assert fp16.ratio_to_lower_bound == pytest.approx(0.5)


@pytest.mark.parametrize(("hook", "calls_per_bucket"), [("powersgd", 3), ("batched_powersgd", 2)])
def test_powersgd_compresses_and_the_ledger_matches_the_profiler(tmp_path, hook, calls_per_bucket):
    plain = _fit32(tmp_path, "none")[0]
    state = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
    ranks = _fit32(tmp_path, hook, comm_hook=hook, comm_state=state)
    for r in ranks:
        # the ledger agrees, batch by batch, with an independent spy on torch.distributed.all_reduce
        assert r["batch_ledger"] == r["batch_spy"]
        calls = [c for c, _ in r["batch_spy"]]
        # syncs 0 and 1: plain all-reduce (state.iter < start_powerSGD_iter=2); then every sync is compressed
        assert calls[:2] == [1, 1]
        assert set(calls[2:]) == {calls_per_bucket}
    ledger = ranks[0]["ledger"]
    assert ledger.allreduce_bytes < 0.5 * plain["ledger"].allreduce_bytes
    assert not torch.allclose(ranks[0]["weights"], plain["weights"]), "compression had no effect"


def test_powersgd_matches_torch_ddp_with_the_hook_registered_by_hand(tmp_path):
    state = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 3}
    ours = _fit32(tmp_path, "psgd", comm_hook="powersgd", comm_state=state)[0]["weights"]
    by_hand = plain_ddp_weights(
        Regressor(hidden=32), make_data(dtype=torch.float32), B, EPOCHS, tmp_path, "powersgd", state
    )
    torch.testing.assert_close(ours, by_hand)


class WideMLP(Regressor):
    """5.3M parameters: DDP lays them out in two buckets (its default caps), the case that broke."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(512, 2048),
            torch.nn.ReLU(),
            torch.nn.Linear(2048, 2048),
            torch.nn.ReLU(),
            torch.nn.Linear(2048, 10),
        )


@pytest.mark.parametrize("hook", ["powersgd", "batched_powersgd"])
def test_powersgd_with_several_buckets_keeps_collectives_in_the_same_order_on_every_rank(tmp_path, hook):
    """PowerSGD all-reduces P and Q from future callbacks on gloo threads; with two buckets the ranks
    issued them in different orders and gloo aborted ("Received data size doesn't match expected size")."""
    g = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(128, 512, generator=g), torch.randn(128, 10, generator=g))
    strategy = MGPUDDPStrategy(start_method="fork", comm_hook=hook, comm_state={"start_powerSGD_iter": 2})
    ranks = fit(WideMLP(), strategy, tmp_path, dataset=dataset, batch_size=8, max_epochs=1)
    for r in ranks:
        assert r["batch_ledger"] == r["batch_spy"]
        compressed = r["batch_spy"][3:]
        assert {c for c, _ in compressed} == {2 * (3 if hook == "powersgd" else 2)}, "expected two buckets"
    torch.testing.assert_close(ranks[0]["weights"], ranks[1]["weights"])
