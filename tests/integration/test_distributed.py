"""The distributed helpers (distributed.py): local results without a process group, then on 2 fork-started gloo
processes the gathering of uneven sizes and dicts, and the number of collectives per call."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning_fabric.plugins.environments.lightning import find_free_network_port
from torchmetrics.utilities.distributed import gather_all_tensors

from lightning_mgpu import distributed as mdist
from tests.helpers import WORLD


def test_helpers_without_a_process_group_compute_locally():
    assert not dist.is_initialized()
    assert mdist.mean(torch.tensor([1.0, 2.0, 6.0])).item() == pytest.approx(3.0)
    assert mdist.sum({"a": 2, "b": torch.ones(4)}) == {"a": pytest.approx(2.0), "b": pytest.approx(4.0)}
    assert torch.equal(mdist.gather(torch.arange(3)), torch.arange(3))


# ---------------------------------------------------------------------------------- gathering, 2 ranks
def _gather_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    # uneven: rank 0 holds 3 samples, rank 1 holds 5 (an uneven last batch)
    n = 3 if rank == 0 else 5
    losses = torch.arange(n, dtype=torch.float32) + 10 * rank
    result = {
        "mean_dict": mdist.mean({"loss": losses, "count": float(n)}),
        "mean_all": mdist.mean(losses, dst=None),
        "weighted": mdist.mean(losses.mean(), weight=n, dst=None),
        "unweighted": mdist.mean(losses.mean(), dst=None),
        "sum": mdist.sum({"loss": losses, "n": n}, dst=1),
        "gather": mdist.gather({"loss": losses, "rows": torch.full((n, 2), rank)}),
        "gather_all": mdist.gather(torch.tensor(float(rank)), dst=None),
        "empty": mdist.mean(torch.ones(0) if rank == 0 else torch.ones(2), dst=None),
    }
    try:
        mdist.gather(torch.zeros(2, 3 if rank == 0 else 4))
    except ValueError as err:
        result["shape_error"] = str(err)
    torch.save(result, Path(out) / f"gather{rank}.pt")
    dist.destroy_process_group()


def test_gathering_helpers_with_uneven_sizes_and_dicts(tmp_path):
    args = (find_free_network_port(), str(tmp_path))
    mp.start_processes(_gather_worker, nprocs=WORLD, start_method="fork", args=args)
    r0, r1 = (torch.load(tmp_path / f"gather{r}.pt") for r in range(WORLD))
    everything = torch.cat([torch.arange(3.0), torch.arange(5.0) + 10])
    # exact global mean over all 8 samples (not the mean of the two per-rank means)
    assert r0["mean_dict"]["loss"].item() == pytest.approx(everything.mean().item())
    assert r0["mean_dict"]["loss"].dtype == torch.float32
    assert r0["mean_dict"]["count"].item() == pytest.approx(4.0)
    assert r1["mean_dict"] is None  # dst=0
    for r in (r0, r1):
        assert r["mean_all"].item() == pytest.approx(everything.mean().item())
        assert r["weighted"].item() == pytest.approx(everything.mean().item())
        assert r["unweighted"].item() == pytest.approx((1.0 + 12.0) / 2)  # what sync_dist=True would give
        assert r["empty"].item() == pytest.approx(1.0)  # rank 0's empty tensor counts for nothing
        assert torch.equal(r["gather_all"], torch.tensor([0.0, 1.0]))
        assert "trailing shape" in r["shape_error"]
    assert r0["sum"] is None and r1["sum"]["loss"].item() == pytest.approx(everything.sum().item())
    assert r1["sum"]["n"].item() == 8
    assert torch.equal(r0["gather"]["loss"], everything) and r1["gather"] is None
    assert r0["gather"]["rows"].tolist() == [[0, 0]] * 3 + [[1, 1]] * 5


_COLLECTIVES = ("all_gather", "all_reduce", "reduce", "broadcast", "barrier", "all_gather_object", "gather")


def _count_worker(rank: int, port: int, out: str) -> None:
    """Per helper call, the collectives it issues (a spy on torch.distributed's functions, which the helpers
    look up at call time)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    calls: list[str] = []
    for name in _COLLECTIVES:
        original = getattr(dist, name)

        def spy(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(dist, name, spy)
    n = 3 if rank == 0 else 5  # uneven
    three = {"loss": torch.arange(n, dtype=torch.float32), "rows": torch.ones(n, 4), "mask": torch.ones(n) > 0}
    counts: dict[str, list[str]] = {}
    for label, call in (
        ("mean", lambda: mdist.mean(three)),
        ("mean_everywhere", lambda: mdist.mean(three, dst=None)),
        ("sum", lambda: mdist.sum(three, dst=1)),
        ("gather_one", lambda: mdist.gather(three["rows"], dst=None)),
        ("gather_three", lambda: mdist.gather(three, dst=None)),
        ("torchmetrics_three", lambda: [gather_all_tensors(v) for v in three.values()]),
    ):
        calls.clear()
        call()
        counts[label] = list(calls)
    torch.save(counts, Path(out) / f"count{rank}.pt")
    dist.destroy_process_group()


def test_collectives_per_call_one_for_mean_and_sum_one_plus_keys_for_gather(tmp_path):
    """The module docstring's count, and why gather is not torchmetrics' gather_all_tensors (in 1.9 a barrier
    and two all_gathers per key: 9 collectives for these 3 keys)."""
    mp.start_processes(_count_worker, nprocs=WORLD, start_method="fork", args=(find_free_network_port(), str(tmp_path)))
    for rank in range(WORLD):
        counts = torch.load(tmp_path / f"count{rank}.pt")
        assert counts["mean"] == ["reduce"] and counts["sum"] == ["reduce"]
        assert counts["mean_everywhere"] == ["all_reduce"]
        assert counts["gather_one"] == ["all_gather"] * 2  # the sizes, then the padded rows
        assert counts["gather_three"] == ["all_gather"] * 4  # the sizes of all keys, then one per key
        # the reason to keep our own: torchmetrics (1.9: barrier, shape, tensor per key) takes more
        assert len(counts["torchmetrics_three"]) > len(counts["gather_three"]), counts["torchmetrics_three"]
