"""The GPU tier: every test under ``tests/gpu`` is marked ``gpu`` and skipped with "no CUDA device" where torch sees
no CUDA device (every CPU machine, CI included). ``make test-gpu`` runs only these, on one NVIDIA GPU."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = str(config.rootpath / "tests" / "gpu")
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
