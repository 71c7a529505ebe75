"""parts/failures.py, the strategy side: roll-call grace and what a rank does after an exception."""

from __future__ import annotations

from datetime import timedelta

from lightning_mgpu.parts.failures import FailureHandling


def test_the_roll_call_waits_a_quarter_of_the_timeout_within_2_to_10_seconds():
    assert FailureHandling(timedelta(seconds=20)).roll_call_s() == 5.0
    assert FailureHandling(timedelta(seconds=1)).roll_call_s() == 2.0
    assert FailureHandling(timedelta(minutes=30)).roll_call_s() == 10.0
    assert FailureHandling(None).roll_call_s() == 5.0


def test_without_a_process_group_an_exception_is_marked_handled_and_no_rank_is_missing():
    error = RuntimeError("boom")
    failures = FailureHandling(timedelta(seconds=8))
    assert failures.end_group_after(error, rank=0, world_size=2) == []
    assert error._mgpu_missing_ranks == []  # type: ignore[attr-defined]
    assert str(error) == "boom"
