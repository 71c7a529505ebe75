"""Bad input gets a clear error naming the value and the fix, at construction (before any process starts)."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch

from lightning_mgpu import MGPUDDPStrategy

CASES = [
    # (kwargs, exception type, fragments the message must contain: the bad value and the fix)
    ({"comm_hook": "fp8"}, ValueError, ["'fp8'", "'powersgd'", "'fp16'"]),
    ({"comm_hook": "PowerSGD"}, ValueError, ["'PowerSGD'", "'powersgd'"]),
    (
        {"comm_hook": "powersgd", "comm_state": {"matrix_approximation_rank": -1}},
        ValueError,
        ["matrix_approximation_rank", "-1", "positive int"],
    ),
    ({"comm_hook": "powersgd", "comm_state": {"matrix_approximation_rank": 0}}, ValueError, ["0", "positive int"]),
    ({"comm_hook": "powersgd", "comm_state": {"start_powerSGD_iter": 1}}, ValueError, ["start_powerSGD_iter", "=2"]),
    ({"comm_hook": "powersgd", "comm_state": {"rank": 2}}, ValueError, ["['rank']", "matrix_approximation_rank"]),
    (
        {"comm_hook": "fp16", "comm_state": {"matrix_approximation_rank": 2}},
        ValueError,
        ["matrix_approximation_rank", "fp16"],
    ),
    ({"comm_state": {"matrix_approximation_rank": 2}}, ValueError, ["without a comm_hook", "comm_hook='powersgd'"]),
    ({"comm_hook": "powersgd", "comm_state": [1]}, TypeError, ["dict", "[1]"]),
    ({"start_method": "threads"}, ValueError, ["'threads'", "'fork'", "mgpu_ddp_notebook"]),
    ({"static_graph": "yes"}, TypeError, ["static_graph", "'yes'"]),
    ({"ddp_comm_hook": print}, TypeError, ["ddp_comm_hook", "comm_hook='fp16'"]),
]


@pytest.mark.parametrize(("kwargs", "exc", "fragments"), CASES, ids=[str(c[0]) for c in CASES])
def test_bad_argument_is_refused_with_value_and_fix(kwargs, exc, fragments):
    with pytest.raises(exc) as info:
        MGPUDDPStrategy(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} missing from: {info.value}"


def test_bf16_hook_on_gloo_is_refused_before_launch_naming_the_alternative():
    strategy = MGPUDDPStrategy(comm_hook="bf16", start_method="fork")
    with pytest.raises(ValueError) as info:
        pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert "'bf16'" in str(info.value) and "'gloo'" in str(info.value) and "comm_hook='fp16'" in str(info.value)
    assert not torch.distributed.is_initialized()


def test_bf16_hook_is_accepted_where_the_backend_can_run_it():
    strategy = MGPUDDPStrategy(comm_hook="bf16", start_method="fork", process_group_backend="nccl")
    pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)  # refused only for gloo
