"""The documentation site's promises: every code example runs, every public name is documented and listed.

Code examples: every ```python block of every page is a whole script a reader can paste, and runs as one, as
``__main__`` in a scratch directory, forked from one interpreter that has imported torch and nothing of Lightning or
of the pack (``tests/scripts.py``: what each example would otherwise spend importing torch; the popen presets launch
their other ranks by re-running that script in fresh interpreters, as they do a user's; the examples use small
settings, ``max_steps=2``, ``devices=2`` on CPU). A block that cannot run here
is preceded by a MyST comment line ``% docs-test: skip: <reason>``; the reason is required and the skips are few
(counted below).
"""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import lightning_mgpu
from tests.scripts import Scripts

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts and p.name != "README.md")
BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", re.M | re.S)
SKIP = re.compile(r"^% docs-test: skip(?::\s*(?P<reason>.*))?$")
MAX_SKIPPED_BLOCKS = 3


def blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """(line number, code, skip reason or None) of each ```python block of ``page``."""
    text = page.read_text()
    found = []
    for match in BLOCK.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = [ln for ln in text[: match.start()].splitlines() if ln.strip()]
        skip = SKIP.match(before[-1].strip()) if before else None
        reason = None
        if skip:
            reason = (skip.group("reason") or "").strip()
            assert reason, f"{page.name}:{line}: a skipped block must say why (% docs-test: skip: <reason>)"
        found.append((line, match.group(1), reason))
    return found


RUNNABLE = [p for p in PAGES if any(reason is None for _, _, reason in blocks(p))]
EXAMPLES = [(page, line, code) for page in PAGES for line, code, reason in blocks(page) if reason is None]


def test_every_guide_page_has_code_that_runs() -> None:
    guides = sorted((DOCS / "guides").glob("*.md"))
    assert len(guides) >= 11
    without = [g.name for g in guides if g not in RUNNABLE]
    assert without == [], f"guide pages without a runnable ```python block: {without}"


def test_skipped_blocks_are_few_and_say_why() -> None:
    skipped = [(p.name, line, reason) for p in PAGES for line, _, reason in blocks(p) if reason is not None]
    assert all(reason for _, _, reason in skipped)
    assert len(skipped) <= MAX_SKIPPED_BLOCKS, skipped


def test_blocks_are_valid_python() -> None:
    for page in PAGES:
        for line, code, _ in blocks(page):
            ast.parse(code, filename=f"{page.name}:{line}")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("page", "line", "code"), EXAMPLES, ids=[f"{p.relative_to(DOCS)}:{line}" for p, line, _ in EXAMPLES]
)
def test_example_runs(page: Path, line: int, code: str, tmp_path: Path, scripts: Scripts) -> None:
    script = tmp_path / f"{page.stem.replace('-', '_')}_{line}.py"
    script.write_text(code)
    proc = scripts.run(script, timeout=280)
    assert proc.returncode == 0, f"{page.name}:{line} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _ends(pid: int) -> bool:
    """Whether process ``pid`` ends within 5 s: gone, or ended and waiting for init (which adopted it) to reap it."""
    for _ in range(50):
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_a_script_runs_as_python_runs_it(tmp_path: Path, scripts: Scripts) -> None:
    """The examples' runner: a script as ``__main__`` with its own folder, arguments, exit code and output, ending as an
    interpreter ends (threads joined, then ``atexit``); torch imported already, Lightning and the pack not; a script
    over its timeout is killed with what it started; what a script leaves running is named and killed."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import os, sys, __main__\n"
        "print(__name__, __main__.__spec__, os.getcwd() == os.path.dirname(__file__), sys.argv == [__file__, 'a'])\n"
        "print(sorted(m for m in ('torch', 'pytorch_lightning', 'lightning', 'lightning_mgpu') if m in sys.modules))\n"
        "print('to stderr', file=sys.stderr)\n"
        "import atexit, threading, time\n"
        "atexit.register(print, 'at exit')\n"
        "threading.Thread(target=lambda: (time.sleep(1), print('thread joined'))).start()\n"
        "sys.exit(3)\n"
    )
    ran = scripts.run(script, timeout=60, args=("a",))
    assert ran.returncode == 3
    assert ran.stdout.splitlines() == ["__main__ None True True", "['torch']", "thread joined", "at exit"]
    assert ran.stderr == "to stderr\n"
    script.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "open('child.pid', 'w').write(str(child.pid))\n"
        "time.sleep(120)\n"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        scripts.run(script, timeout=5)
    assert _ends(int((tmp_path / "child.pid").read_text())), "the script's child outlived its timeout"
    script.write_text("raise ValueError('the traceback is the output')\n")
    ran = scripts.run(script, timeout=60)  # the runner goes on after a killed script
    assert ran.returncode == 1 and "ValueError: the traceback is the output" in ran.stderr
    assert ran.leftovers == []
    # what a script leaves running when it ends is named, then killed (the popen tests assert there is none)
    script.write_text(
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "print(child.pid)\n"
    )
    ran = scripts.run(script, timeout=60)
    left = int(ran.stdout)
    assert ran.returncode == 0 and ran.leftovers == [left]
    assert _ends(left), "the script's leftover outlived the run"
    # a module as python -m runs it (the GPU tier's CPU mode runs its worker so): __main__ with the module's spec,
    # argv[0] its file, the working directory first on sys.path
    (tmp_path / "probe_module.py").write_text(
        "import os, sys, __main__\n"
        "print(__name__, __main__.__spec__.name, sys.argv[1:], sys.argv[0] == __file__, sys.path[0] == os.getcwd())\n"
    )
    ran = scripts.run_module("probe_module", ["a", "b"], cwd=tmp_path, output=tmp_path / "module", timeout=60)
    assert ran.returncode == 0 and ran.stdout == "__main__ probe_module ['a', 'b'] True True\n", ran


# ------------------------------------------------------------------------------------------------- API reference


def _api_names() -> list[str]:
    text = (DOCS / "api.md").read_text().split("## Modules the guides use")[0]
    return re.findall(r"^   (\w+)$", text, re.M)


def test_api_page_lists_every_public_name_once() -> None:
    listed = _api_names()
    public = [n for n in lightning_mgpu.__all__ if n != "__version__"]
    assert sorted(listed) == sorted(public)
    assert len(set(listed)) == len(listed)


def _documented_data(module_name: str) -> set[str]:
    """Module attributes with a ``#:`` doc comment or a docstring after the assignment (what autodoc shows)."""
    from sphinx.pycode import ModuleAnalyzer

    return {name for (_, name) in ModuleAnalyzer.for_module(module_name).find_attr_docs()}


def undocumented_public_names() -> set[str]:
    missing = set()
    for name in lightning_mgpu.__all__:
        if name == "__version__":
            continue
        obj = getattr(lightning_mgpu, name)
        if inspect.isclass(obj):
            doc = obj.__dict__.get("__doc__")
        elif inspect.isfunction(obj) or inspect.ismodule(obj):
            doc = obj.__doc__
        else:  # data: a constant documented where it is assigned
            home = next(
                m
                for m in ("lightning_mgpu.comm_hooks", "lightning_mgpu.presets", "lightning_mgpu")
                if getattr(sys.modules.get(m), name, None) is obj
            )
            doc = "documented" if name in _documented_data(home) else None
        if not (doc and doc.strip()):
            missing.add(f"lightning_mgpu.{name}")
    return missing


def _known_undocumented() -> set[str]:
    tree = ast.parse((DOCS / "conf.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
            if isinstance(target, ast.Name) and target.id == "KNOWN_UNDOCUMENTED":
                return set(ast.literal_eval(node.value))
    raise AssertionError("docs/conf.py has no KNOWN_UNDOCUMENTED")


def test_every_public_name_has_a_docstring() -> None:
    # KNOWN_UNDOCUMENTED (docs/conf.py) lists exactly the names still waiting for a docstring; it must shrink
    # to empty, and a name documented since must leave it (the docs build warns, i.e. fails, on the others).
    assert undocumented_public_names() == _known_undocumented()


def test_the_lightning_copy_has_the_same_public_names() -> None:
    lightning_ns = pytest.importorskip("lightning_mgpu.lightning")
    assert sorted(lightning_ns.__all__) == sorted(lightning_mgpu.__all__)
