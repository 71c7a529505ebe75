"""N ranks x batch b x accumulation k == 1 process x batch N*b*k, in float64 (assert_close defaults)."""

from __future__ import annotations

import pytest
import torch

from lightning_mgpu import MGPUDDPStrategy
from tests.helpers import WORLD, Regressor, fit, make_data, reference_weights

B = 4
EPOCHS = 2


@pytest.mark.compat
@pytest.mark.parametrize("static_graph", [False, True], ids=["dynamic", "static_graph"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_ddp_weights_equal_single_process_with_global_batch(tmp_path, k, static_graph):
    dataset = make_data()
    model = Regressor().double()
    initial = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    expected = reference_weights(model, dataset, global_batch=WORLD * B * k, epochs=EPOCHS)

    ranks = fit(
        model,
        MGPUDDPStrategy(start_method="fork", static_graph=static_graph),
        tmp_path,
        dataset=dataset,
        batch_size=B,
        accumulate=k,
        max_epochs=EPOCHS,
    )

    steps = EPOCHS * len(dataset) // (WORLD * B * k)
    for r in ranks:
        assert r["global_step"] == steps
        torch.testing.assert_close(r["weights"], expected)
    assert (expected - initial).abs().max() > 1e-2, "weights did not move: the comparison would prove nothing"


@pytest.mark.compat
@pytest.mark.parametrize(
    ("global_batch", "lr"),
    [(WORLD * B, 0.1), (WORLD * B * 2, 0.1 * (1 + 1e-5))],
    ids=["accumulation_ignored", "lr_off_by_1e-5"],
)
def test_parity_check_can_fail(tmp_path, global_batch, lr):
    """Negative controls for the parity test: the same comparison fails against a reference that ignores
    accumulation, and against one whose learning rate differs by one part in 1e5 (the tolerance is tight)."""
    dataset = make_data()
    model = Regressor().double()
    wrong = reference_weights(model, dataset, global_batch=global_batch, epochs=EPOCHS, lr=lr)
    ranks = fit(
        model,
        MGPUDDPStrategy(start_method="fork"),
        tmp_path,
        dataset=dataset,
        batch_size=B,
        accumulate=2,
        max_epochs=EPOCHS,
    )
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ranks[0]["weights"], wrong)
