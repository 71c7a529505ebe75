"""Every public class and function of the pack shows a runnable example in its docstring, and every example runs.

The examples are doctests (``>>>``): this module runs them all in one fresh interpreter (several start a
Trainer or a one-process group, which must not leak into the test process), with ``ELLIPSIS`` and
``NORMALIZE_WHITESPACE``. A new public name without an example fails :func:`test_every_public_callable_has_an_example`.
"""

from __future__ import annotations

import doctest
import inspect
import re
import subprocess
import sys
import textwrap

import pytest

import lightning_mgpu

pytestmark = pytest.mark.slow


def _public_callables() -> list[str]:
    return sorted(
        n
        for n in lightning_mgpu.__all__
        if inspect.isclass(getattr(lightning_mgpu, n)) or inspect.isfunction(getattr(lightning_mgpu, n))
    )


def _examples(name: str) -> list[doctest.Example]:
    return doctest.DocTestParser().get_examples(inspect.getdoc(getattr(lightning_mgpu, name)) or "")


def test_every_public_callable_has_an_example() -> None:
    missing = [n for n in _public_callables() if not _examples(n)]
    assert not missing, f"public names whose docstring has no '>>>' example: {missing}"


_RUNNER = textwrap.dedent(
    """
    import doctest, importlib, inspect, pkgutil, sys
    import torch
    import lightning_mgpu
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    parser = doctest.DocTestParser()

    def run(label, tests):
        runner = doctest.DocTestRunner(optionflags=flags)
        for test in tests:
            if torch.distributed.is_initialized():  # a one-process fit of an earlier example leaves its group
                torch.distributed.destroy_process_group()
            runner.run(test)
        result = runner.summarize(verbose=False)
        print(f"doctest {label}: {result.attempted} examples, {result.failed} failed")
        return result

    def public(names):  # the public names' examples
        for name in names:
            obj = getattr(lightning_mgpu, name)
            yield parser.get_doctest(inspect.getdoc(obj), {}, f"lightning_mgpu.{name}", inspect.getsourcefile(obj), 0)

    def modules():  # every module's examples: private helpers and methods too
        finder = doctest.DocTestFinder(exclude_empty=True)
        for info in pkgutil.walk_packages(lightning_mgpu.__path__, "lightning_mgpu."):
            if info.name != "lightning_mgpu.__main__":
                yield from finder.find(importlib.import_module(info.name))

    results = [run("public", public(sys.argv[2:]))]
    if sys.argv[1] == "both":
        results.append(run("modules", modules()))
    sys.exit(1 if any(r.failed or not r.attempted for r in results) else 0)
    """
)


@pytest.fixture(scope="module")
def doctest_counts() -> dict[str, tuple[int, int]]:
    """Both runs in one interpreter (one start-up, not two): ``{"public": (attempted, failed), "modules": ...}``."""
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, "both", *_public_callables()],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    counts = {
        m.group(1): (int(m.group(2)), int(m.group(3)))
        for m in re.finditer(r"^doctest (\w+): (\d+) examples, (\d+) failed$", done.stdout, re.M)
    }
    assert sorted(counts) == ["modules", "public"], done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    return counts


def test_every_example_runs(doctest_counts: dict[str, tuple[int, int]]) -> None:
    attempted, failed = doctest_counts["public"]
    assert failed == 0 and attempted >= 3 * len(_public_callables()), doctest_counts


def test_every_example_in_every_module_runs(doctest_counts: dict[str, tuple[int, int]]) -> None:
    """The examples of private helpers and methods too (a method's example is not reached from ``__all__``)."""
    attempted, failed = doctest_counts["modules"]
    assert failed == 0 and attempted > doctest_counts["public"][0], doctest_counts


def test_a_wrong_example_fails(tmp_path) -> None:
    """Negative control: the runner reports a docstring whose output is wrong."""
    code = _RUNNER.replace("obj = getattr(lightning_mgpu, name)", "obj = bad")
    code = code.replace(
        "import lightning_mgpu", 'import lightning_mgpu\ndef bad():\n    """\n    >>> 1 + 1\n    3\n    """'
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "public", "x"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1 and "1 failed" in done.stdout, done.stdout + done.stderr
