"""The package's layout rules (docs/development.md): one home per concept, data flowing one way (parts and plugins
never import a strategy, settings import no part, plugin, planner or strategy, no two subpackages import each other
both ways), no import cycle, lazy imports inside functions included, and the import paths that
moved still working with a warning that names the new one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_mgpu"
LOWER = [
    *sorted((PACKAGE / "parts").rglob("*.py")),  # a part that is a package (parts/pipeline/) included
    *sorted((PACKAGE / "plugins").rglob("*.py")),
    PACKAGE / "settings.py",
    PACKAGE / "comm.py",
    PACKAGE / "comm_hooks.py",
    PACKAGE / "ledger.py",
]


def _module_name(path: Path, root: Path = PACKAGE) -> str:
    name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _imported(path: Path) -> set[str]:
    """Every ``lightning_mgpu`` module ``path`` imports, at module level or inside a function (``ast.walk``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n.startswith("lightning_mgpu")}


def _graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules it imports. ``from pkg import sub`` depends on ``sub`` when ``sub`` is a module (the
    package is only being walked through), on ``pkg`` otherwise."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    top = root.name
    for name, path in modules.items():
        deps = _imported(path)
        deps = {d for d in deps if d in modules and not any(s.startswith(d + ".") and s in modules for s in deps)}
        # importing a.b.c runs the __init__ of a.b first (when a.b is not imported yet); the top package is
        # always imported first by whoever imports the pack, so it is left out
        parents = {".".join(d.split(".")[:i]) for d in deps for i in range(2, d.count(".") + 1)}
        deps |= {p for p in parents if p in modules and p != top and not name.startswith(p + ".")}
        graph[name] = deps - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("path", LOWER, ids=[_module_name(p) for p in LOWER])
def test_parts_and_plugins_do_not_import_a_strategy(path):
    assert not [n for n in _imported(path) if n.startswith("lightning_mgpu.strategies")]


def test_settings_import_no_part_plugin_planner_or_strategy():
    """Settings sit below the parts: each option's type and checks, nothing that uses them."""
    above = ("lightning_mgpu.parts", "lightning_mgpu.plugins", "lightning_mgpu.planning", "lightning_mgpu.strategies")
    assert [n for n in _imported(PACKAGE / "settings.py") if n.startswith(above)] == []


def _folder_edges(root: Path) -> set[tuple[str, str]]:
    """(folder, folder) for every import from a module of one subpackage into another, lazy imports included."""

    def folder(module: str) -> str:
        return module.split(".")[1] if module.count(".") >= 2 else ""

    edges = set()
    for name, deps in _graph(root).items():
        for dep in deps:
            a, b = folder(name), folder(dep)
            if a and b and a != b:
                edges.add((a, b))
    return edges


def _both_ways(edges: set[tuple[str, str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, b in edges if (b, a) in edges and a < b)


def test_subpackages_import_each_other_in_one_direction_only():
    """Plugins use parts (the precision plugin's global-norm clipping), never the reverse: no two subpackages
    (parts, plugins, planning, strategies, callbacks, ...) import each other both ways."""
    edges = _folder_edges(PACKAGE)
    assert _both_ways(edges) == []
    assert ("parts", "plugins") not in edges


def test_the_direction_check_finds_two_folders_importing_each_other(tmp_path):
    pkg = tmp_path / "lightning_mgpu"
    for sub in ("parts", "plugins"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "parts" / "a.py").write_text("def f():\n    from lightning_mgpu.plugins.b import g\n")
    (pkg / "plugins" / "b.py").write_text("from lightning_mgpu.parts.a import f\n")
    assert _both_ways(_folder_edges(pkg)) == [("parts", "plugins")]


def test_the_package_has_no_import_cycle_lazy_imports_included():
    assert _cycles(_graph(PACKAGE)) == []


def test_the_cycle_check_finds_a_cycle_through_a_subpackage_init(tmp_path):
    # negative control: sub/x.py imports other/y.py, whose package __init__ imports sub/x's package back
    root = tmp_path / "lightning_mgpu"
    for package in ("sub", "other"):
        (root / package).mkdir(parents=True)
    (root / "sub" / "__init__.py").write_text("from lightning_mgpu.sub.x import f\n")
    (root / "sub" / "x.py").write_text("from lightning_mgpu.other.y import g\n")
    (root / "other" / "__init__.py").write_text("from lightning_mgpu.other.z import h\n")
    (root / "other" / "y.py").write_text("g = 1\n")
    (root / "other" / "z.py").write_text("from lightning_mgpu.sub import f\n")
    assert _cycles(_graph(root)) != []


def test_the_cycle_check_finds_a_cycle_hidden_in_a_function_body(tmp_path):
    # negative control: a.py imports b at module level, b.py imports a inside a function
    root = tmp_path / "lightning_mgpu"
    root.mkdir()
    (root / "a.py").write_text("from lightning_mgpu.b import g\n")
    (root / "b.py").write_text("def g():\n    from lightning_mgpu.a import x\n")
    assert _cycles(_graph(root)) == [["lightning_mgpu.a", "lightning_mgpu.b"]]


def test_no_module_only_forwards_to_another():
    """A module whose body is nothing but imports (and a docstring / ``__all__``) is a second home: merge it."""
    forwarding = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py":
            continue  # a package's __init__ gathers its public names
        body = [n for n in ast.parse(path.read_text()).body if not isinstance(n, (ast.Import, ast.ImportFrom))]
        body = [n for n in body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        body = [
            n
            for n in body
            if not (isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets))
        ]
        if not body:
            forwarding.append(path.name)
    assert forwarding == []


CLASS_LINES = 400  # a class longer than this holds more than one concept: split it into parts it owns
STRATEGY_MODULE_LINES = 500  # a strategy is a table of short hooks; its work lives in the runtime and the parts


def _oversized(root: Path) -> list[str]:
    """Each class under ``root`` longer than :data:`CLASS_LINES`, and each module of ``root/strategies`` longer than
    :data:`STRATEGY_MODULE_LINES`, as ``"path: what, lines"``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        module_lines = len(source.splitlines())
        where = path.relative_to(root.parent).as_posix()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > CLASS_LINES:
                    found.append(f"{where}: class {node.name}, {lines}")
        if path.parent == root / "strategies" and module_lines > STRATEGY_MODULE_LINES:
            found.append(f"{where}: module, {module_lines}")
    return found


def test_no_class_over_400_lines_and_no_strategy_module_over_500():
    assert _oversized(PACKAGE) == []


def test_the_size_check_finds_a_long_class_and_a_long_strategy_module(tmp_path):
    root = tmp_path / "lightning_mgpu"
    (root / "strategies").mkdir(parents=True)
    (root / "big.py").write_text("class Big:\n" + "    x = 1\n" * CLASS_LINES)
    (root / "small.py").write_text("class Small:\n" + "    x = 1\n" * (CLASS_LINES - 1))
    (root / "strategies" / "long.py").write_text("x = 1\n" * (STRATEGY_MODULE_LINES + 1))
    (root / "long_part.py").write_text("x = 1\n" * (STRATEGY_MODULE_LINES + 1))  # only strategies/ is held to it
    assert _oversized(root) == [
        "lightning_mgpu/big.py: class Big, 401",
        "lightning_mgpu/strategies/long.py: module, 501",
    ]
