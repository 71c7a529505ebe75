"""For the parts' tests: run a function in a forked child (optionally inside a one-rank gloo process group: torch's
wrappers need one), so that no group, gloo thread, compiled graph or compile thread is left in the pytest process.
A fork costs a fraction of a second where a fresh interpreter costs the seconds of importing torch and Lightning."""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _child(
    fn: Callable[[], Any], store_path: Optional[str], error_path: str, result_path: str, stacks_path: str
) -> None:
    # a child that hangs writes where each of its threads is when the parent signals it, before killing it (a
    # signal, not faulthandler's timer: the timer's thread is not in a child forked in turn, which would wait for it)
    faulthandler.register(signal.SIGUSR1, file=open(stacks_path, "w"), all_threads=True)
    # one intra-op thread, as torch's DataLoader sets in the workers it forks: an OpenMP thread pool the parent
    # started is not in the child, and a parallel region would wait for its threads
    torch.set_num_threads(1)
    try:
        if store_path is None:
            result = fn()
        else:
            dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=0, world_size=1)
            try:
                result = fn()
            finally:
                dist.destroy_process_group()
        with open(result_path, "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(error_path, "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def in_forked_child(fn: Callable[[], Any], group: bool = False, timeout: float = 240) -> Any:
    """Run ``fn`` in a forked child (inside a world-size-1 gloo group with ``group``) and return what it returned
    (pickled); re-raise its failure here. A child still running after ``timeout`` seconds (below pytest's own
    timeout, so that this one reports) is killed and named, with where each of its threads was."""
    with tempfile.TemporaryDirectory() as tmp:
        store, error, result, stacks = (
            os.path.join(tmp, name) for name in ("store", "error.txt", "result.pkl", "stacks.txt")
        )
        args = (fn, store if group else None, error, result, stacks)
        proc = mp.get_context("fork").Process(target=_child, args=args)
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(1)
            proc.kill()
            proc.join()
            where = open(stacks).read() if os.path.exists(stacks) else ""
            raise AssertionError(
                f"the child was still running after {timeout} s and was killed; its threads were at:\n{where}"
            )
        if proc.exitcode != 0:
            text = open(error).read() if os.path.exists(error) else f"exit code {proc.exitcode}"
            raise AssertionError(f"the child failed:\n{text}")
        with open(result, "rb") as f:
            return pickle.load(f)


def in_one_rank_group(fn: Callable[[], None]) -> None:
    """Run ``fn`` in a forked child inside a world-size-1 gloo group; re-raise its failure here."""
    in_forked_child(fn, group=True)
