"""Data flows one way: parts never import a strategy (DESIGN.md), and accumulation does not either (it once
imported strategies/ddp.py, which imported it back)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_mgpu"
MODULES = [*sorted((PACKAGE / "parts").glob("*.py")), PACKAGE / "accumulation.py", PACKAGE / "settings.py"]


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("path", MODULES, ids=[p.name for p in MODULES])
def test_module_does_not_import_a_strategy(path):
    assert not [n for n in _imported(path) if n.startswith("lightning_mgpu.strategies")]
