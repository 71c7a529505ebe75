from __future__ import annotations

import os

import pytest
import torch

# Fork launches (the tests' default) after this process has used torch's intra-op (OpenMP) thread pool
# deadlock in the child's first parallel op when the child runs with more than one thread: Lightning gives a
# single forked rank cpu_count() threads (seen here: a 1-rank fork resume hung in Tanh.forward after an
# earlier test ran a reference model in this process). One thread in the test process keeps every child
# single-threaded: it inherits this setting, and multi-rank children get 1 thread each on 2 cores anyway.
torch.set_num_threads(1)

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
