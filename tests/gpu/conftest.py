"""The GPU tier: every test under ``tests/gpu`` is marked ``gpu``.

* On one NVIDIA GPU (``make test-gpu``) every test runs.
* With ``MGPU_TIER_DEVICE=cpu`` (``make test-gpu-cpu``, part of ``make test``) the cases run on CPU (gloo), so a
  fault of the tier itself shows without a GPU: every test function runs once, with its first parameters and the
  ones its module lists in ``CPU_ALSO`` (the whole matrix would cost CI minutes that prove nothing more about the
  tier's own code); ``MGPU_TIER_CPU_ALL=1`` runs every parameter. Each case is forked from one interpreter that has
  imported the worker, and runs as ``python -m tests.gpu.worker`` would (on CUDA each is a fresh interpreter). The tests
  only CUDA hardware can answer (the allocator's bytes, NVML, pinned memory, CUDA before a fork) are marked
  ``needs_cuda`` and skipped there with the reason; the CUDA-only assertions of the others are guarded by
  ``ON_CUDA``.
* Anywhere else (no CUDA device, no CPU mode) the tier is skipped with "no CUDA device".

Where ``MGPU_TIER_FAILURES`` names a file, each failing test's report (its traceback and what it printed) is
appended to it as the test fails, so a tier stopped at its time limit, before pytest's summary, still says why its
failures failed (``benchmarks/gpu/proof.py`` sets it)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from tests.gpu.worker import DEVICE


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = str(config.rootpath / "tests" / "gpu")
    skip = pytest.mark.skip(reason="no CUDA device (MGPU_TIER_DEVICE=cpu runs the tier's CPU checks)")
    cpu_subset = DEVICE == "cpu" and os.environ.get("MGPU_TIER_CPU_ALL") != "1"
    first: set[tuple[str, str]] = set()
    kept, dropped = [], []
    for item in items:
        if not str(item.path).startswith(here):
            kept.append(item)
            continue
        item.add_marker(pytest.mark.gpu)
        if DEVICE == "cuda" and not torch.cuda.is_available():
            item.add_marker(skip)
        if cpu_subset and isinstance(item, pytest.Function) and hasattr(item, "callspec"):
            key = (str(item.path), item.originalname)
            also = getattr(item.module, "CPU_ALSO", ())
            if key in first and item.name not in also:
                dropped.append(item)
                continue
            first.add(key)
        kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(scope="session", autouse=True)
def _cpu_runner() -> Iterator[None]:
    """In the CPU mode, the interpreter that forks each case (``tests/gpu/test_gpu_tier.py``'s ``cpu_runner``), for
    the whole session: started before any test, so no test's check for leftover processes counts it."""
    if DEVICE != "cpu":
        yield
        return
    from tests.gpu import test_gpu_tier as tier

    tier.cpu_runner = tier.start_cpu_runner()
    yield
    tier.cpu_runner.close()
    tier.cpu_runner = None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("MGPU_TIER_FAILURES")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):  # xdist's controller writes it once
        return
    with open(path, "a") as f:
        f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
        if report.capstdout:
            f.write(f"--- stdout\n{report.capstdout[-20000:]}\n")
