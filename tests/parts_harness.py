"""For the parts' tests: run a function in a forked child that has a one-rank gloo process group (torch's
wrappers need one), so that no group or gloo thread is left in the pytest process."""

from __future__ import annotations

import os
import tempfile
import traceback
from typing import Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def _child(fn: Callable[[], None], store_path: str, error_path: str) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=0, world_size=1)
        try:
            fn()
        finally:
            dist.destroy_process_group()
    except BaseException:
        with open(error_path, "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def in_one_rank_group(fn: Callable[[], None]) -> None:
    """Run ``fn`` in a forked child inside a world-size-1 gloo group; re-raise its failure here."""
    with tempfile.TemporaryDirectory() as tmp:
        store, error = os.path.join(tmp, "store"), os.path.join(tmp, "error.txt")
        proc = mp.get_context("fork").Process(target=_child, args=(fn, store, error))
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            text = open(error).read() if os.path.exists(error) else f"exit code {proc.exitcode}"
            raise AssertionError(f"the child failed:\n{text}")
