"""Every notebook in notebooks/ runs top to bottom (a Jupyter kernel, as a user runs it), and its stored
outputs were made from the cells as they are now (notebooks/execute.py --write stamps the cells' hash)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
_spec = importlib.util.spec_from_file_location("notebooks_execute", ROOT / "notebooks" / "execute.py")
assert _spec is not None and _spec.loader is not None
runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)


def errors(nb: nbformat.NotebookNode) -> list[str]:
    return [
        f"cell {i}: {o.get('ename')}: {o.get('evalue')}"
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        for o in cell.get("outputs", [])
        if o.output_type == "error"
    ]


def test_the_quickstart_and_one_notebook_per_capability_ship():
    names = {p.stem for p in NOTEBOOKS}
    shipped = {"quickstart", "sharded_memory", "activation_checkpointing", "gan_accumulation", "precision"}
    shipped.add("fine_tuning")
    shipped.add("model_parallel")
    assert shipped <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_outputs_come_from_the_current_cells(path):
    nb = nbformat.read(str(path), as_version=4)
    stamp = nb.metadata.get("lightning_mgpu", {}).get("sources_sha256")
    assert stamp == runner.sources_sha256(nb), f"{path.name} was edited after its outputs: run `make notebooks`"
    counts = [c.execution_count for c in nb.cells if c.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1)), f"{path.name} was not run top to bottom: {counts}"
    assert not errors(nb)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, tmp_path):
    nb = runner.execute(path, tmp_path)  # raises CellExecutionError with the failing cell's traceback
    assert not errors(nb)
    assert all(c.execution_count for c in nb.cells if c.cell_type == "code")
