"""Run the notebooks top to bottom, as CI does, or regenerate their stored outputs.

    python notebooks/execute.py notebooks/*.ipynb            # run each in a scratch directory; fail on error
    python notebooks/execute.py --write notebooks/*.ipynb    # run and store the outputs (make notebooks)

The notebooks are stored *with* their outputs (plots and printed numbers people would rather look at than
read about), regenerated only by ``--write``. The stamp ``metadata.lightning_mgpu.sources_sha256`` is the hash
of the cells' sources when the outputs were made; tests/meta/test_notebooks.py fails when a cell was edited
without regenerating, so a stored output is never stale relative to the code above it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient

CELL_TIMEOUT_S = 180  # per cell; a hung fork launch fails the run instead of hanging CI


def sources_sha256(nb: Any) -> str:
    cells = [[c["cell_type"], c["source"]] for c in nb["cells"]]
    return hashlib.sha256(json.dumps(cells).encode()).hexdigest()


def execute(path: Path, workdir: Path) -> Any:
    """The notebook at ``path`` executed in ``workdir`` (its logs and checkpoints land there)."""
    nb = nbformat.read(str(path), as_version=4)
    NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    ).execute()
    return nb


def write(path: Path, nb: Any) -> None:
    import lightning
    import pytorch_lightning
    import torch

    nb.metadata["lightning_mgpu"] = {
        "sources_sha256": sources_sha256(nb),
        "executed_with": {
            "torch": torch.__version__,
            "pytorch_lightning": pytorch_lightning.__version__,
            "lightning": lightning.__version__,
        },
    }
    nbformat.write(nb, str(path))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--write", action="store_true", help="store the new outputs in the notebook files")
    args = parser.parse_args(argv)
    for path in args.notebooks:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as workdir:
            nb = execute(path, Path(workdir))
        if args.write:
            write(path, nb)
        print(f"{path}: ok in {time.perf_counter() - start:.1f} s{' (outputs written)' if args.write else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
