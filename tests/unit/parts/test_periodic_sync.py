"""parts/periodic_sync.py: when local SGD / DiLoCo sync, what a sync computes and sends, and its checkpoint state.

The checks that need two ranks run in one forked pair of gloo processes (one launch for all of them)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import traceback
import warnings
from collections.abc import Iterator
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_mgpu.ledger import CommStats
from lightning_mgpu.parts.periodic_sync import BUCKET_BYTES, PeriodicSync, _buckets
from lightning_mgpu.settings import DiLoCoSettings, LocalSGDSettings
from tests.parts_harness import in_one_rank_group


def _params(rank: int) -> list[torch.Tensor]:
    """Two float64 parameters, identical on every rank."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)]


def _move(params: list[torch.Tensor], rank: int, step: int) -> None:
    """A rank-dependent local update (what an inner optimizer step does)."""
    for i, p in enumerate(params):
        p.add_(0.1 * (rank + 1) * (i + 1) * (step + 1))


def _two_rank_checks(rank: int, world: int) -> None:
    # local SGD, H=2: no traffic on the first step, the mean of the ranks' weights on the second
    params = [p.requires_grad_() for p in _params(rank)]
    sync = PeriodicSync(LocalSGDSettings(sync_every=2))
    sync.setup(params, group=None, world_size=world)
    start = [p.detach().clone() for p in params]
    stats = CommStats()
    locals_ = []
    for step in range(2):
        with torch.no_grad():
            _move(params, rank, step)
        locals_.append([p.detach().clone() for p in params])
        synced = sync.after_optimizer_step(stats)
        assert synced == (step == 1)
    # rank r moved by 0.1 (r+1)(i+1)(1+2): the mean over r = 0, 1 is 0.1 * 1.5 * (i+1) * 3
    for i, (p, s) in enumerate(zip(params, start)):
        torch.testing.assert_close(p.detach(), s + 0.1 * 1.5 * (i + 1) * 3)
    gathered = [torch.zeros(17, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, torch.cat([p.detach().flatten() for p in params]))
    assert torch.equal(gathered[0], gathered[1])  # every rank holds identical weights after a sync
    assert (stats.allreduce_calls, stats.allreduce_bytes, stats.sync_rounds) == (1, 17 * 8, 1)

    # fp16 / bf16 communication (gloo runs both): a quarter of float64's bytes; the difference is rounded, not the
    # weights
    for comm_dtype, atol in (("fp16", 1e-3), ("bf16", 1e-2)):
        params = [p.requires_grad_() for p in _params(rank)]
        sync = PeriodicSync(LocalSGDSettings(sync_every=1, comm_dtype=comm_dtype))  # type: ignore[arg-type]
        sync.setup(params, group=None, world_size=world)
        stats = CommStats()
        with torch.no_grad():
            _move(params, rank, 0)
        sync.after_optimizer_step(stats)
        assert stats.allreduce_bytes == 17 * 2 and params[0].dtype == torch.float64
        for i, (p, s) in enumerate(zip(params, _params(rank))):
            torch.testing.assert_close(p.detach(), s + 0.1 * 1.5 * (i + 1), atol=atol, rtol=0)

    # DiLoCo: the outer Nesterov SGD steps the anchor along the averaged difference, twice (momentum carried)
    params = [p.requires_grad_() for p in _params(rank)]
    settings = DiLoCoSettings(sync_every=1, outer_lr=0.7, outer_momentum=0.9, nesterov=True)
    sync = PeriodicSync(settings)
    sync.setup(params, group=None, world_size=world)
    ref = [p.detach().clone().requires_grad_() for p in _params(rank)]
    outer = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    stats = CommStats()
    for step in range(2):
        with torch.no_grad():
            _move(params, rank, step)
        sync.after_optimizer_step(stats)
        for i, r in enumerate(ref):  # the mean pseudo-gradient: -(mean move)
            r.grad = torch.full_like(r, -0.1 * 1.5 * (i + 1) * (step + 1))
        outer.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r.detach())
    assert stats.sync_rounds == 2

    # a checkpoint mid-period restores every rank's own weights at the same world size
    params = [p.requires_grad_() for p in _params(rank)]
    sync = PeriodicSync(DiLoCoSettings(sync_every=3))
    sync.setup(params, group=None, world_size=world)
    stats = CommStats()
    for step in range(4):
        with torch.no_grad():
            _move(params, rank, step)
        sync.after_optimizer_step(stats)
    state, mine = sync.state_dict(), sync.local_weights()
    assert (state["steps"], state["since_sync"], state["world_size"]) == (4, 1, world)
    fresh = [p.requires_grad_() for p in _params(rank)]
    restored = PeriodicSync(DiLoCoSettings(sync_every=3))
    restored.setup(fresh, group=None, world_size=world)
    assert restored.load_state_dict(state, mine) == "exact"
    for p, w in zip(fresh, mine):
        assert torch.equal(p.detach(), w)
    for a, b in zip(restored.anchor, sync.anchor):
        assert torch.equal(a, b)
    assert restored.since_sync == 1
    # and both continue identically: two more steps complete the period
    for s in (sync, restored):
        for step in (4, 5):
            with torch.no_grad():
                _move(s.params, rank, step)
            s.after_optimizer_step(CommStats())
    for a, b in zip(sync.params, restored.params):
        assert torch.equal(a.detach(), b.detach())


def _worker(rank: int, world: int, store: str, error: str) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        try:
            _two_rank_checks(rank, world)
        finally:
            dist.destroy_process_group()
    except BaseException:
        with open(f"{error}{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise


def _run_two_ranks(fn: Callable[[int, int, str, str], None]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        error = os.path.join(tmp, "error")
        try:
            mp.start_processes(fn, nprocs=2, args=(2, os.path.join(tmp, "store"), error), start_method="fork")
        except Exception as e:  # the rank's own traceback is more useful than torch's summary
            texts = [open(f"{error}{r}").read() for r in range(2) if os.path.exists(f"{error}{r}")]
            raise AssertionError("\n".join(texts) or str(e)) from None


def test_two_ranks_sync_average_count_and_restore_as_specified():
    """Local SGD averages on the H-th step only, fp16 sends half the bytes, DiLoCo's outer Nesterov step matches
    torch's SGD by hand, and a mid-period state restores exactly (see ``_two_rank_checks``)."""
    _run_two_ranks(_worker)


def test_a_negative_control_the_two_rank_checks_can_fail():
    """A sync that keeps each rank's own weights fails the checks."""
    original = PeriodicSync.sync

    def no_average(self, stats):
        self.since_sync = 0

    PeriodicSync.sync = no_average  # the fork children inherit the broken sync
    try:
        with pytest.raises(AssertionError):
            _run_two_ranks(_worker)
    finally:
        PeriodicSync.sync = original


def test_warmup_steps_do_not_sync_and_the_anchor_starts_after_them():
    def check() -> None:
        params = [torch.zeros(2, dtype=torch.float64, requires_grad=True)]
        sync = PeriodicSync(LocalSGDSettings(sync_every=2, warmup_steps=3))
        sync.setup(params, group=None, world_size=1)
        stats = CommStats()
        flags = []
        for _ in range(7):
            assert sync.in_warmup == (sync.steps < 3)
            with torch.no_grad():
                params[0].add_(1.0)
            flags.append(sync.after_optimizer_step(stats))
        assert flags == [False, False, False, False, True, False, True]
        assert stats.sync_rounds == 2 and stats.allreduce_calls == 0  # one rank: nothing to send
        torch.testing.assert_close(sync.anchor[0], torch.full((2,), 7.0, dtype=torch.float64))

    in_one_rank_group(check)


@contextlib.contextmanager
def _as_rank(rank: int) -> Iterator[None]:
    """Lightning's record of this process's global rank (what its rank-zero-only warnings read)."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    was = getattr(rank_zero_only, "rank", 0)
    rank_zero_only.rank = rank  # type: ignore[attr-defined]
    try:
        yield
    finally:
        rank_zero_only.rank = was  # type: ignore[attr-defined]


def test_another_world_size_resumes_from_the_last_synced_weights_and_says_so():
    def check() -> None:
        params = [torch.zeros(2, dtype=torch.float64, requires_grad=True)]
        sync = PeriodicSync(LocalSGDSettings(sync_every=2))
        sync.setup(params, group=None, world_size=1)
        for _ in range(3):
            with torch.no_grad():
                params[0].add_(1.0)
            sync.after_optimizer_step(CommStats())
        state = dict(sync.state_dict(), world_size=4)  # as written by 4 ranks
        fresh = [torch.full((2,), -1.0, dtype=torch.float64, requires_grad=True)]
        restored = PeriodicSync(LocalSGDSettings(sync_every=2))
        restored.setup(fresh, group=None, world_size=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert restored.load_state_dict(state, sync.local_weights()) == "synced"
        assert any("last synced weights" in str(w.message) and "4 ranks" in str(w.message) for w in caught)
        torch.testing.assert_close(fresh[0].detach(), torch.full((2,), 2.0, dtype=torch.float64))
        assert restored.since_sync == 0 and restored.steps == 3
        # every rank resumes so, and rank 0 alone says it (once per job, not once per rank)
        again = PeriodicSync(LocalSGDSettings(sync_every=2))
        again.setup([torch.zeros(2, dtype=torch.float64, requires_grad=True)], group=None, world_size=1)
        with warnings.catch_warnings(record=True) as caught, _as_rank(1):
            warnings.simplefilter("always")
            assert again.load_state_dict(state, sync.local_weights()) == "synced"
        assert caught == []

    in_one_rank_group(check)


def test_a_checkpoint_of_the_other_algorithm_is_refused():
    def check() -> None:
        local = PeriodicSync(LocalSGDSettings())
        local.setup([torch.zeros(1, requires_grad=True)], group=None, world_size=1)
        diloco = PeriodicSync(DiLoCoSettings())
        diloco.setup([torch.zeros(1, requires_grad=True)], group=None, world_size=1)
        with pytest.raises(ValueError, match="local_sgd"):
            diloco.load_state_dict(local.state_dict(), None)

    in_one_rank_group(check)


def test_buckets_are_per_dtype_in_order_and_at_most_the_bucket_size():
    n = BUCKET_BYTES // 4 // 2 + 1  # two of these float32 tensors do not fit one bucket
    a, b, c = torch.zeros(n), torch.zeros(n), torch.zeros(3, dtype=torch.float64)
    assert [[id(t) for t in bucket] for bucket in _buckets([a, c, b], None)] == [[id(a)], [id(b)], [id(c)]]
    # in fp16 the two float32 tensors are half the bytes: one bucket
    assert [len(bucket) for bucket in _buckets([a, b], torch.float16)] == [2]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sync_every": 0}, "sync_every=0"),
        ({"warmup_steps": -1}, "warmup_steps=-1"),
        ({"comm_dtype": "int8"}, "comm_dtype='int8'"),
        ({"outer_lr": 0.0}, "outer_lr=0.0"),
        ({"outer_momentum": 1.0}, r"outer_momentum=1.0"),
        ({"outer_momentum": 0.0}, "nesterov=False"),
    ],
)
def test_settings_refuse_bad_values_naming_them_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DiLoCoSettings(**kwargs)
    DiLoCoSettings(outer_momentum=0.0, nesterov=False)  # the fix the last message names
