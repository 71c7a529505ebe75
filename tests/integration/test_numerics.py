"""The numerics matrix: every preset family x accumulation {1, 3} x clipping {none, norm, value} x precision
{64, 32, bf16-mixed, 16-mixed with the scaler} x validation {off, Lightning's defaults} gives, on 2 ranks, the
weights of one process with the whole batch (float64: ``assert_close`` defaults; lower precisions: the
tolerances of ``tests/numerics_harness.py``, explained in docs/guides/numerics.md).

All cases of one precision group run in ONE 2-process launch (``run_cases``); the tests read its records. The float64
group runs whole; of the lower precisions' product, the pairwise cover (``tests/matrix.py``) runs in the slow tier and
``pytest -m full_matrix`` runs the rest: the launch fits the cases the session selected.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import lightning_mgpu.strategies.sharded_model as sharded_model_module
from lightning_mgpu import MGPUShardedStrategy
from tests.matrix import pairwise
from tests.numerics_harness import CLIP, FAMILIES, Case, reference, run_cases, tolerance

ACCUMULATION = (1, 3)
CLIPPING = tuple(CLIP)
LOWER = ("32", "bf16-mixed", "16-mixed")


def _cases(precisions: tuple[str, ...]) -> list[Case]:
    return [
        Case(family, k, clip, precision, val)
        for family, k, clip, precision, val in itertools.product(
            FAMILIES, ACCUMULATION, CLIPPING, precisions, (False, True)
        )
    ]


EXACT_CASES = _cases(("64",))
#: the lower precisions' matrix, with the ids of ``Case.id``
LOWER_AXES = (
    {family: family for family in FAMILIES},
    {f"k{k}": k for k in ACCUMULATION},
    {clip: clip for clip in CLIPPING},
    {precision: precision for precision in LOWER},
    {"noval": False, "val": True},
)
LOWER_TEST = "test_lower_precision_training_equals_one_process_within_tolerance"


@pytest.fixture(scope="module")
def exact_runs() -> dict[str, dict[str, Any]]:
    return {c.id: r for c, r in zip(EXACT_CASES, run_cases(EXACT_CASES))}


@pytest.fixture(scope="module")
def lower_runs(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    """The lower-precision cases this session runs (after ``-m`` deselected the others), in one launch."""
    items = [i for i in request.session.items if i.module is request.module and i.originalname == LOWER_TEST]
    cases = [Case(**i.callspec.params) for i in items]  # its parameters are the fields of Case
    return {c.id: r for c, r in zip(cases, run_cases(cases))}


def _check(case: Case, got: dict[str, Any]) -> None:
    expected = reference(case)
    assert got["global_step"] == expected["steps"]
    torch.testing.assert_close(got["weights"], expected["weights"], **tolerance(case.precision))
    assert (expected["weights"] - expected["initial"]).abs().max() > 1e-3, "weights did not move"
    clip = CLIP[case.clip]
    if clip is not None:  # clipping bites in every step: the comparison tests it
        algorithm, value = clip
        observed = expected["norms"] if algorithm == "norm" else expected["maxima"]
        assert min(observed) > value, f"{algorithm} clipping at {value} would not change step {observed}"


@pytest.mark.parametrize("case", EXACT_CASES, ids=lambda c: c.id)
def test_float64_training_equals_one_process_with_the_whole_batch(case, exact_runs):
    _check(case, exact_runs[case.id])


@pytest.mark.slow
@pytest.mark.parametrize(("family", "k", "clip", "precision", "val"), pairwise(*LOWER_AXES))
def test_lower_precision_training_equals_one_process_within_tolerance(family, k, clip, precision, val, lower_runs):
    case = Case(family, k, clip, precision, val)
    _check(case, lower_runs[case.id])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_global_norm_clipping_adds_one_scalar_all_reduce_per_step_where_gradients_are_sharded(family, exact_runs):
    """From the ledger: ZeRO-2/3 (each rank holds a share of the gradients) add exactly one all-reduce per clipped
    optimizer step; DDP, manual DDP and ZeRO-1 (whole averaged gradients everywhere) add none."""
    for k in ACCUMULATION:
        plain = exact_runs[Case(family, k, "none", "64", False).id]
        clipped = exact_runs[Case(family, k, "norm", "64", False).id]
        added = clipped["allreduce_calls"] - plain["allreduce_calls"]
        sharded = family in ("zero2", "zero2_fairscale", "zero3")
        assert added == (clipped["global_step"] if sharded else 0), (family, k, added)


def _local_norm_fairscale() -> Any:
    strategy = MGPUShardedStrategy(stage=2, backend="fairscale", start_method="popen")
    strategy._sharded.sharding.norm_clipping = lambda group, ledger: None  # Lightning's clip: this rank's norm only
    return strategy


def _fairscale_without_mode_follow() -> Any:
    sharded_model_module.follow_module_mode = lambda wrapper, module: None  # the defect: the wrapper stays in eval mode
    return MGPUShardedStrategy(stage=2, backend="fairscale", start_method="popen")


def test_negative_controls_local_norm_clipping_and_wrapper_left_in_eval_mode_fail():
    """The matrix can fail: clipping each rank's gradient shard by its own norm, and fairscale's
    ShardedDataParallel left in eval mode after validation (no gradient hooks: nothing reduced), both end
    away from one process (the second one also at the bf16 tolerance); and a reference that clips per-shard norms
    differs from the global-norm one."""
    norm = Case("zero2_fairscale", 3, "norm", "64", False)
    val = Case("zero2_fairscale", 1, "none", "64", True)
    val_bf16 = Case("zero2_fairscale", 1, "none", "bf16-mixed", True)  # the bf16 tolerance still catches it
    makers = [_local_norm_fairscale, _fairscale_without_mode_follow, _fairscale_without_mode_follow]
    runs = run_cases([norm, val, val_bf16], makers)
    for case, got in zip((norm, val, val_bf16), runs):
        expected = reference(case)
        assert got["global_step"] == expected["steps"]
        with pytest.raises(AssertionError):
            torch.testing.assert_close(got["weights"], expected["weights"], **tolerance(case.precision))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(reference(norm, local_norm_shards=2)["weights"], reference(norm)["weights"])


def test_norm_clipping_under_fairscale_stage_2_with_a_plugin_that_clips_locally_is_refused_before_launch(tmp_path):
    """fairscale stage 2 leaves each rank its own gradients; only MGPUPrecision clips them by the global norm, so
    another precision plugin (here Lightning's 64-true) with norm clipping cannot equal one process: refused."""
    import pytorch_lightning as pl
    from pytorch_lightning.utilities.exceptions import MisconfigurationException

    from tests.numerics_harness import ValData, ValRegressor, dataset

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MGPUShardedStrategy(stage=2, backend="fairscale", start_method="fork"),
        precision="64-true",
        gradient_clip_val=0.5,
        default_root_dir=tmp_path,
        logger=False,
    )
    with pytest.raises(MisconfigurationException, match=r"clip each shard by its own norm.*gradient_clip_algorithm="):
        trainer.fit(ValRegressor(), datamodule=ValData(dataset("64"), 4))
