"""The peer check: Lightning's own tests for the strategies the presets replace, run as released and swapped.

Lightning's test files (``tests/tests_pytorch`` at the tag of the installed release) that name a DDP or FSDP
strategy are copied twice into a temporary directory. The second copy is swapped: every ``strategy="ddp..."``
string with a preset counterpart becomes the ``mgpu_ddp...`` preset, every ``DDPStrategy(`` becomes
``MGPUDDPStrategy(`` (from ``lightning_mgpu.lightning``, the namespace Lightning's tests use), every
``strategy="fsdp"`` becomes ``mgpu_zero3`` (Lightning's FSDP shards parameters, gradients and optimizer state:
ZeRO stage 3), and ``import lightning_mgpu`` is added to the tests' ``conftest.py`` so the presets are registered.
Both copies run with pytest (``--junitxml``, a per-test timeout); the check prints the counts of each run and
every test whose outcome differs.

    make test-lightning LIGHTNING_SRC=/path/to/pytorch-lightning
    python tests/lightning_peer/peer_check.py --lightning-src /path/to/pytorch-lightning [FILES...]

``--lightning-src`` is a clone of Lightning's repository (a bare one too): the files come from the tag matching
the installed ``lightning`` release, else the nearest earlier tag (said in the output). A plain directory with a
``tests/tests_pytorch`` folder is used as it is. FILES (paths under ``tests/tests_pytorch``) narrow the run; by
default it covers the folders whose tests train through a strategy (callbacks, checkpointing, loggers, loops,
strategies/launchers, trainer, tuner, utilities); ``--all-folders`` takes every folder. Lightning's tests need
``cloudpickle`` besides the pack's test extra. The check needs the repository, so ``make test`` does not run it.
Exit status: 0 when no outcome differs, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from io import BytesIO
from pathlib import Path

FOLDERS = (
    "callbacks",
    "checkpointing",
    "loggers",
    "loops",
    "strategies/launchers",
    "trainer",
    "tuner",
    "utilities",
)
# Lightning's preset names and the pack's counterparts. Names absent here (ddp_find_unused_parameters_true,
# fsdp_cpu_offload, ...) have none and are left as they are.
SWAP = {
    "ddp": "mgpu_ddp",
    "ddp_spawn": "mgpu_ddp_spawn",
    "ddp_fork": "mgpu_ddp_fork",
    "ddp_notebook": "mgpu_ddp_notebook",
    "fsdp": "mgpu_zero3",
}
NAMES = re.compile(r"""["'](ddp|fsdp)(_\w+)?["']|\bDDPStrategy\b|\bFSDPStrategy\b""")
_STRATEGY_STRING = re.compile(r"""\bstrategy(\s*=\s*)(["'])(ddp|fsdp)(\w*)\2""")
_DDP_CLASS = re.compile(r"(?<![\w.])DDPStrategy\(")
_IMPORT = "from lightning_mgpu.lightning import MGPUDDPStrategy  # peer check: the swap\n"
_PLUGIN = "\n\nimport lightning_mgpu  # noqa: E402,F401  peer check: registers the mgpu presets in both namespaces\n"


def swap_source(text: str) -> tuple[str, int]:
    """The swapped text of one test file and the number of replacements."""
    count = 0

    def strategy(m: re.Match) -> str:
        nonlocal count
        name = m.group(3) + m.group(4)
        if name not in SWAP:
            return m.group(0)
        count += 1
        return f"strategy{m.group(1)}{m.group(2)}{SWAP[name]}{m.group(2)}"

    text = _STRATEGY_STRING.sub(strategy, text)
    text, n = _DDP_CLASS.subn("MGPUDDPStrategy(", text)
    count += n
    if n:
        # after the module docstring and __future__ imports: before the first other top-level import
        lines = text.splitlines(keepends=True)
        at = next(
            (i for i, line in enumerate(lines) if re.match(r"(import|from) (?!__future__)", line)),
            0,
        )
        lines.insert(at, _IMPORT)
        text = "".join(lines)
    return text, count


def _git(src: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(src), *args], capture_output=True, check=False)


def _version_key(tag: str) -> tuple[int, ...]:
    return tuple(int(p) for p in tag.split("."))


def choose_tag(tags: list[str], version: str) -> str:
    """The tag of ``version``, else the nearest earlier release tag."""
    releases = sorted((t for t in tags if re.fullmatch(r"\d+\.\d+\.\d+", t)), key=_version_key)
    if version in releases:
        return version
    base = re.match(r"\d+\.\d+\.\d+", version)
    target = _version_key(base.group(0)) if base else (0,)
    earlier = [t for t in releases if _version_key(t) <= target]
    if not earlier:
        raise SystemExit(f"no release tag at or before {version} in the Lightning checkout")
    return earlier[-1]


def extract_tests(src: Path, dest: Path, version: str) -> str:
    """Put Lightning's ``tests/tests_pytorch`` and its ``pyproject.toml`` (pytest settings) under ``dest``;
    returns where they came from."""
    if _git(src, "rev-parse", "--git-dir").returncode == 0:
        tags = _git(src, "tag").stdout.decode().split()
        tag = choose_tag(tags, version)
        archive = _git(src, "archive", "--format=tar", tag, "tests/tests_pytorch", "pyproject.toml")
        if archive.returncode:
            raise SystemExit(archive.stderr.decode())
        with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
            tar.extractall(dest, filter="data")
        note = "" if tag == version else f" (no tag {version}: the nearest earlier release)"
        return f"tag {tag}{note}"
    if not (src / "tests" / "tests_pytorch").is_dir():
        raise SystemExit(f"{src}: neither a git checkout of Lightning nor a folder with tests/tests_pytorch")
    shutil.copytree(src / "tests" / "tests_pytorch", dest / "tests" / "tests_pytorch")
    if (src / "pyproject.toml").exists():
        shutil.copy(src / "pyproject.toml", dest / "pyproject.toml")
    return f"the folder {src} as it is"


def select(tests: Path, folders: tuple[str, ...] | None) -> list[str]:
    """The test files (relative to ``tests``) that name a DDP or FSDP strategy."""
    chosen = []
    for path in sorted(tests.rglob("test_*.py")):
        rel = path.relative_to(tests).as_posix()
        if folders is not None and not any(rel.startswith(f + "/") for f in folders):
            continue
        if NAMES.search(path.read_text(encoding="utf-8")):
            chosen.append(rel)
    return chosen


def make_swapped(released: Path, swapped: Path, files: list[str]) -> int:
    shutil.copytree(released, swapped)
    tests = swapped / "tests" / "tests_pytorch"
    total = 0
    for rel in files:
        path = tests / rel
        text, n = swap_source(path.read_text(encoding="utf-8"))
        path.write_text(text, encoding="utf-8")
        total += n
    with open(tests / "conftest.py", "a", encoding="utf-8") as f:
        f.write(_PLUGIN)
    return total


def run(root: Path, files: list[str], report: Path, timeout: int, python: str, log: Path) -> float:
    """pytest on ``files`` from ``root/tests`` (Lightning's layout: ``tests_pytorch`` importable from there)."""
    cmd = [
        python,
        "-m",
        "pytest",
        *[f"tests_pytorch/{f}" for f in files],
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        f"--timeout={timeout}",
        f"--junitxml={report}",
        "-q",
        "-o",
        "addopts=--color=no --disable-pytest-warnings",  # no --strict-markers: a marker of a plugin not installed
        "--continue-on-collection-errors",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS",)}
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        subprocess.run(cmd, cwd=root / "tests", env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    return time.monotonic() - start


def outcomes(report: Path) -> dict[str, str]:
    """Test id -> passed / failed / error / skipped, from a junit report (an error in teardown after a pass
    counts as an error, as pytest reports it)."""
    result: dict[str, str] = {}
    if not report.exists():
        return result
    for case in ET.parse(report).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        outcome = (
            "error"
            if "error" in tags
            else "failed"
            if "failure" in tags
            else "skipped"
            if "skipped" in tags
            else "passed"
        )
        # a test can appear twice (call failed, then teardown error): keep the worse
        if result.get(test_id) in ("error", "failed") and outcome not in ("error", "failed"):
            continue
        result[test_id] = outcome
    return result


def _counts(results: dict[str, str]) -> str:
    c = Counter(results.values())
    return ", ".join(f"{c[k]} {k}" for k in ("passed", "failed", "error", "skipped"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="test files under tests/tests_pytorch (default: every selected)")
    parser.add_argument("--lightning-src", required=True, type=Path, help="a clone of Lightning's repository")
    parser.add_argument("--all-folders", action="store_true", help="select from every folder of tests_pytorch")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test (pytest-timeout)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs both copies")
    parser.add_argument("--work", type=Path, help="keep the copies, logs and reports here (default: a temp dir)")
    parser.add_argument("--only", choices=("released", "swapped"), help="run one copy (the other is not compared)")
    args = parser.parse_args(argv)

    version = subprocess.run(
        [args.python, "-c", "import lightning; print(lightning.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    work = args.work or Path(tempfile.mkdtemp(prefix="lightning-peer-"))
    work.mkdir(parents=True, exist_ok=True)
    released, swapped = work / "released", work / "swapped"
    for d in (released, swapped):
        shutil.rmtree(d, ignore_errors=True)
    released.mkdir()
    origin = extract_tests(args.lightning_src.resolve(), released, version)
    tests = released / "tests" / "tests_pytorch"
    files = args.files or select(tests, None if args.all_folders else FOLDERS)
    missing = [f for f in files if not (tests / f).exists()]
    if missing:
        raise SystemExit(f"not in Lightning's tests: {', '.join(missing)}")
    replacements = make_swapped(released, swapped, files)
    print(f"lightning {version}; Lightning's tests from {origin}; {len(files)} files, {replacements} replacements")
    print(f"work directory: {work}", flush=True)

    # file by file, each as released then swapped: an interrupted check still compares the files it finished
    variants = [(n, r) for n, r in (("released", released), ("swapped", swapped)) if args.only in (None, n)]
    results: dict[str, dict[str, str]] = {name: {} for name, _ in variants}
    seconds = dict.fromkeys(results, 0.0)
    try:
        for i, rel in enumerate(files):
            found = {}
            for name, root in variants:
                stem = f"{name}-{i:03d}"
                log = work / f"{stem}.log"
                seconds[name] += run(root, [rel], work / f"{stem}.xml", args.timeout, args.python, log)
                found[name] = outcomes(work / f"{stem}.xml")
            for name in found:  # a file counts once both copies have run
                results[name].update(found[name])
            line = "; ".join(f"{name} {_counts(r)}" for name, r in found.items())
            print(f"[{i + 1}/{len(files)}] {rel}: {line}", flush=True)
    except KeyboardInterrupt:
        print(f"interrupted: the files finished so far are compared ({len(files)} selected)")
    print()
    for name in results:
        print(f"{name:9s} {_counts(results[name])}  ({seconds[name]:.0f} s; logs {work}/{name}-*.log)")
    if len(results) < 2:
        return 0
    before, after = results["released"], results["swapped"]
    differing = sorted(t for t in set(before) | set(after) if before.get(t, "absent") != after.get(t, "absent"))
    print(f"\n{len(differing)} tests change outcome (released -> swapped):")
    for t in differing:
        print(f"  {t}: {before.get(t, 'absent')} -> {after.get(t, 'absent')}")
    (work / "differences.json").write_text(
        json.dumps({t: [before.get(t, "absent"), after.get(t, "absent")] for t in differing}, indent=1)
    )
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
