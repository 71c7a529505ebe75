"""Every public class and function of the pack shows a runnable example in its docstring, and every example runs.

The examples are doctests (``>>>``): this module runs them all in one fresh interpreter (several start a
Trainer or a one-process group, which must not leak into the test process), with ``ELLIPSIS`` and
``NORMALIZE_WHITESPACE``. A new public name without an example fails :func:`test_every_public_callable_has_an_example`.
"""

from __future__ import annotations

import doctest
import inspect
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
    import doctest, inspect, sys
    import torch
    import lightning_mgpu
    names = sys.argv[1:]
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    runner = doctest.DocTestRunner(optionflags=flags)
    parser = doctest.DocTestParser()
    for name in names:
        if torch.distributed.is_initialized():  # a one-process fit of an earlier example leaves its group
            torch.distributed.destroy_process_group()
        obj = getattr(lightning_mgpu, name)
        test = parser.get_doctest(inspect.getdoc(obj), {}, f"lightning_mgpu.{name}", inspect.getsourcefile(obj), 0)
        runner.run(test)
    result = runner.summarize(verbose=False)
    print(f"doctest: {result.attempted} examples, {result.failed} failed")
    sys.exit(1 if result.failed or not result.attempted else 0)
    """
)


def test_every_example_runs() -> None:
    names = _public_callables()
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, *names], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    attempted = int(done.stdout.rsplit("doctest: ", 1)[1].split()[0])
    assert attempted >= 3 * len(names), done.stdout[-2000:]


_MODULE_RUNNER = textwrap.dedent(
    """
    import doctest, importlib, pkgutil, sys
    import torch
    import lightning_mgpu
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    runner = doctest.DocTestRunner(optionflags=flags)
    finder = doctest.DocTestFinder(exclude_empty=True)
    for info in pkgutil.walk_packages(lightning_mgpu.__path__, "lightning_mgpu."):
        if info.name == "lightning_mgpu.__main__":
            continue
        module = importlib.import_module(info.name)
        for test in finder.find(module):
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            runner.run(test)
    result = runner.summarize(verbose=False)
    print(f"doctest: {result.attempted} examples, {result.failed} failed")
    sys.exit(1 if result.failed or not result.attempted else 0)
    """
)


def test_every_example_in_every_module_runs() -> None:
    """The examples of private helpers and methods too (a method's example is not reached from ``__all__``)."""
    done = subprocess.run(
        [sys.executable, "-c", _MODULE_RUNNER], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert int(done.stdout.rsplit("doctest: ", 1)[1].split()[0]) > 0, done.stdout[-2000:]


def test_a_wrong_example_fails(tmp_path) -> None:
    """Negative control: the runner reports a docstring whose output is wrong."""
    code = _RUNNER.replace("obj = getattr(lightning_mgpu, name)", "obj = bad")
    code = code.replace(
        "import lightning_mgpu", 'import lightning_mgpu\ndef bad():\n    """\n    >>> 1 + 1\n    3\n    """'
    )
    done = subprocess.run([sys.executable, "-c", code, "x"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1 and "1 failed" in done.stdout, done.stdout + done.stderr
