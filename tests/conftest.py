from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from tests.scripts import Scripts


# One intra-op thread in the test process and in everything it starts. torch runs CPU operators on an OpenMP pool
# (libgomp) whose threads exist only in the process that ran a parallel operator with more than one thread: a child
# forked from it that runs one with more than one thread waits for them for ever (seen here: a one-rank fork resume
# hung in Tanh.forward, a one-process reference forked by a test in flash attention, after earlier tests had run
# with two threads in this process). Lightning's launchers set the count of the process that launches
# (``cpu_count() // devices``: a one-device run sets 2 here) unless ``OMP_NUM_THREADS`` is set, and children
# inherit it; so it is set here, and ``_one_intra_op_thread`` below puts both back after every test. Ranks of two
# processes on 2 cores get one thread each either way. The pack's own fork launch gives its ranks one thread
# whatever the parent did (``launchers._one_intra_op_thread``; tests/integration/strategies/test_launchers.py).
def _one_thread() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


_one_thread()

_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")
# seed_everything (LightningCLI runs it in this process for the fork/spawn configs) leaves these behind, and
# reset_seed() in later tests' workers would re-seed from them
_SEED_ENV = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@pytest.fixture(autouse=True)
def _fresh_distributed_env():
    """Lightning's launchers write MASTER_PORT etc. into this process's environment; a later test would
    reuse a port still in TIME_WAIT. Start every test without them."""
    saved = {k: os.environ.pop(k) for k in _DIST_ENV if k in os.environ}
    saved_seed = {k: os.environ[k] for k in _SEED_ENV if k in os.environ}
    yield
    for k in (*_DIST_ENV, *_SEED_ENV):
        os.environ.pop(k, None)
    os.environ.update(saved)
    os.environ.update(saved_seed)


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Every test starts with one intra-op thread and ``OMP_NUM_THREADS=1`` (see the top of this file), whatever a
    test before it changed."""
    yield
    _one_thread()


# --- nothing of the pack outlives a test ------------------------------------------------------------------
# After every test (as Lightning's own suite does): no thread of the pack (every one is named "mgpu..." or
# "lightning_mgpu...") still running, no child process of this one still running or unreaped, no process group
# left initialised in this process. A multi-process test is where these would come from (the main process of a
# fork/spawn launch keeps no group; its workers and the popen launcher's observer end with the Trainer call).
# Cheap: a thread list, one scan of the process table, one flag.
_PACK_THREADS = ("mgpu", "lightning_mgpu")
_REAP_GRACE_S = 5.0  # a child that has just exited when the test returns gets this long to be reaped


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _multiprocessing_helpers(pid: int) -> bool:
    """multiprocessing's resource tracker and forkserver: started once per interpreter, by design long-lived."""
    import psutil

    try:
        cmdline = " ".join(psutil.Process(pid).cmdline())
    except psutil.ZombieProcess:
        return False  # ended, not reaped: a leftover
    except psutil.Error:
        return True  # gone already
    return "resource_tracker" in cmdline or "forkserver" in cmdline


def leftovers(threads_before: set[threading.Thread], children_before: set[int]) -> list[str]:
    """What a test left behind: the pack's threads still alive, child processes still there after a short grace
    (running, or ended and not reaped), an initialised process group (which is destroyed here, so the next test
    starts clean)."""
    import psutil

    found = [
        f"thread {t.name!r} still running"
        for t in set(threading.enumerate()) - threads_before
        if t.is_alive() and t.name.startswith(_PACK_THREADS)
    ]
    new = [pid for pid in _children() - children_before if not _multiprocessing_helpers(pid)]
    if new:
        procs = []
        for pid in new:
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(pid))
        deadline = time.monotonic() + _REAP_GRACE_S
        while procs and time.monotonic() < deadline:
            procs = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if procs:
                time.sleep(0.1)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                found.append(f"child process {p.pid} ({' '.join(p.cmdline())[:120]}) still running")
        for pid in new:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    found.append(f"child process {pid} ended and was never reaped (a zombie)")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        found.append("a process group is still initialised in the test process")
        torch.distributed.destroy_process_group()
    return found


@pytest.fixture(scope="session")
def scripts() -> Iterator[Scripts]:
    """One interpreter that has imported torch, for the whole session (``tests/scripts.py``): every test that runs a
    user's script or module as ``python`` runs it (the docs' examples, the main job) forks it from there. Started
    before the first such test's check for leftover processes, so no test counts it."""
    runner = Scripts()
    yield runner
    runner.close()


@pytest.fixture(autouse=True)
def _nothing_left_behind():
    threads_before = set(threading.enumerate())
    children_before = _children()
    yield
    found = leftovers(threads_before, children_before)
    if found:
        pytest.fail("the test left behind: " + "; ".join(found), pytrace=False)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--compat-namespace",
        choices=("pytorch_lightning", "lightning"),
        default=None,
        help="run each test of the compatibility subset in this namespace only: the original where that is "
        "pytorch_lightning, its copy from tests.lightning_ns (tests/integration/test_namespaces.py) where that is "
        "lightning; a test without a copy runs either way (the compatibility tiers: each meets one namespace)",
    )


def _copy_name(item: pytest.Item) -> str:
    """The name the `lightning` copy of ``item`` has in tests/integration/test_namespaces.py."""
    where = ".".join(item.path.relative_to(os.path.dirname(__file__)).with_suffix("").parts)
    where = where.replace(".test_", "_").replace(".", "_")
    return f"test_lightning__{where}__{item.originalname.removeprefix('test_')}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    namespace = config.getoption("--compat-namespace")
    if namespace is None:
        return
    names = {id(i): getattr(i, "originalname", "") for i in items}
    copies = {n for n in names.values() if n.startswith("test_lightning__")}
    if namespace == "pytorch_lightning":
        drop = [i for i in items if names[id(i)] in copies]
    else:
        drop = [i for i in items if isinstance(i, pytest.Function) and _copy_name(i) in copies]
        copied = sum(n in copies for n in names.values())
        if len(drop) != copied:  # the copies' naming (test_namespaces.py) and _copy_name disagree
            raise pytest.UsageError(f"--compat-namespace: {copied} lightning copies, but {len(drop)} originals found")
    if drop:
        config.hook.pytest_deselected(items=drop)
        kept = set(map(id, items)) - set(map(id, drop))
        items[:] = [i for i in items if id(i) in kept]
