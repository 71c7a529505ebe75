"""What the GPU tier runs on: device, driver, versions. Printed before `make test-gpu` and stored with every result.

python benchmarks/gpu/env.py          # prints one JSON object

Each GPU benchmark saves its result as ``gpu-<benchmark>-<device>-<date>T<hhmm>.json`` (:func:`result_name`: the UTC
time of the run's environment, so that two runs on one day keep both files).
"""

from __future__ import annotations

import datetime
import json
import platform
from typing import Any


def environment() -> dict[str, Any]:
    import lightning
    import pytorch_lightning
    import torch

    import lightning_mgpu

    cuda = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if cuda else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "device_memory_gib": round(props.total_memory / 2**30, 1) if props else None,
        "multiprocessors": props.multi_processor_count if props else None,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "torch": torch.__version__,
        "pytorch_lightning": pytorch_lightning.__version__,
        "lightning": lightning.__version__,
        "lightning_mgpu": lightning_mgpu.__version__,
        "python": platform.python_version(),
    }


def result_name(benchmark: str, env: dict[str, Any]) -> str:
    """``gpu-<benchmark>-<device>-<date>T<hhmm>.json`` for a run in ``env`` (:func:`environment`)."""
    stamp = env["date"][:16].replace(":", "")
    return f"gpu-{benchmark}-{env['device'].replace(' ', '_')}-{stamp}.json"


if __name__ == "__main__":
    print(json.dumps(environment(), indent=1))
