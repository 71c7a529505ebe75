from __future__ import annotations

import os

import pytest

_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")


@pytest.fixture(autouse=True)
def _fresh_distributed_env():
    """Lightning's launchers write MASTER_PORT etc. into this process's environment; a later test would
    reuse a port still in TIME_WAIT. Start every test without them."""
    saved = {k: os.environ.pop(k) for k in _DIST_ENV if k in os.environ}
    yield
    for k in _DIST_ENV:
        os.environ.pop(k, None)
    os.environ.update(saved)
