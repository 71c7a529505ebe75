"""Where the test suite's time goes: the slowest tests and files, and what each spends its time on.

    make test-profile                              # the default suite, then the report
    make test-profile PROFILE_ARGS="-m slow"       # the slow tier
    python -m pytest -p tests.suite_profile --profile-out .profile tests/integration/strategies
    python tests/suite_profile.py .profile         # the report of a finished run

As a pytest plugin (``-p tests.suite_profile --profile-out DIR``) it times every test (set-up, call and teardown) and,
in the test's process and the workers it forks (fork launches, the suite's default: they inherit its patches), each
``Trainer.fit`` in phases, written as JSON lines to ``DIR/phases.jsonl``:

* ``start-up``: from the test's ``Trainer(...)`` to the worker's process-group rendezvous (the Trainer's set-up, the
  fork, the launcher's);
* ``rendezvous``: ``torch.distributed.init_process_group``;
* ``steps``: the training batches (``on_train_batch_start`` to ``on_train_batch_end``), compile time included;
* ``compile``: of those, the time torch.compile spent compiling (dynamo's own counters);
* ``fit, other``: the rest of the fit (the strategy's set-up, validation, checkpoints, teardown).

Figures are rank 0's (the slowest rank of a step is the one the others wait for, so rank 0 sees the step's time),
summed over the fits of a test. The rest of a test's time (``test, other``) is the test's own process: reference
computations, loading results, assertions, and the launch's teardown. The report prints the 30 slowest tests and the
slowest files with their share of the run. ``make test`` prints each tier's time as it finishes ("[make test] ...").
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

_FILE = "MGPU_PROFILE_FILE"  # where the phases go (set by the plugin: the workers inherit it)
_TEST = "MGPU_PROFILE_TEST"  # the test's node id
_LAUNCH = "MGPU_PROFILE_LAUNCH"  # time.time() of the test's latest Trainer(...)
PHASES = ("start-up", "rendezvous", "steps", "compile", "fit, other")


def _record(phase: str, seconds: float, rank: int = 0) -> None:
    path = os.environ.get(_FILE)
    if not path or rank != 0:
        return
    line = json.dumps({"test": os.environ.get(_TEST, "?"), "phase": phase, "s": round(seconds, 4)}) + "\n"
    with open(path, "a") as f:  # one short line per write: appends from several processes do not interleave
        f.write(line)


def _compile_seconds() -> float:
    dynamo = sys.modules.get("torch._dynamo.utils")
    metrics = getattr(dynamo, "compilation_time_metrics", None) or {}
    return sum(sum(times) for name, times in metrics.items() if name.endswith("compile_inner"))


def _profiling_callback(namespace: str) -> Any:
    """The profiling callback of one Lightning namespace: a class this module's ``__getattr__`` also builds by name, so
    a spawn launch (which pickles the Trainer's callbacks into a new interpreter) finds it there."""
    base = __import__(namespace, fromlist=["Callback"]).Callback

    class Profile(base):  # type: ignore[misc, valid-type]
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            self.fit_start, self.steps, self.compile0 = time.time(), 0.0, _compile_seconds()

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            self.batch_start = time.time()

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            self.steps += time.time() - self.batch_start

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            rank = trainer.global_rank
            _record("steps", self.steps, rank)
            _record("compile", _compile_seconds() - self.compile0, rank)
            _record("fit, other", time.time() - self.fit_start - self.steps, rank)

    Profile.__qualname__ = Profile.__name__ = _CALLBACK + namespace.replace(".", "_")
    return Profile


_CALLBACK = "_Profile_"
_BUILT: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    if name.startswith(_CALLBACK):
        namespace = {"pytorch_lightning": "pytorch_lightning", "lightning_pytorch": "lightning.pytorch"}.get(
            name.removeprefix(_CALLBACK)
        )
        if namespace is not None:
            if name not in _BUILT:
                _BUILT[name] = _profiling_callback(namespace)
            return _BUILT[name]
    raise AttributeError(name)


def _install() -> None:
    """Patch both namespaces' Trainer set-up (a profiling callback, the launch time) and ``init_process_group`` (the
    rendezvous) in this process. Fork launches (the suite's default) inherit the patches; spawn and popen workers
    are new interpreters without them (a spawn launch unpickles the callback, so its steps and the rest of its fit are
    counted; its start-up and rendezvous count in the test's "test, other")."""
    import torch.distributed as dist

    init = dist.init_process_group

    def timed_init(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        result = init(*args, **kwargs)
        rank = dist.get_rank()
        launched = os.environ.get(_LAUNCH)
        if launched:
            _record("start-up", start - float(launched), rank)
        _record("rendezvous", time.time() - start, rank)
        return result

    dist.init_process_group = timed_init
    for name in ("pytorch_lightning", "lightning.pytorch"):
        try:
            connectors = __import__(f"{name}.trainer.connectors.callback_connector", fromlist=["_CallbackConnector"])
        except ImportError:
            continue
        # the Trainer's own signature stays as it is (LightningCLI and the migration guard read it): the callback joins
        # the list Lightning builds in Trainer.__init__, which is also when the launch's clock starts
        connector, callback = connectors._CallbackConnector, __getattr__(_CALLBACK + name.replace(".", "_"))
        original = connector.on_trainer_init

        def on_trainer_init(
            self: Any, *args: Any, _original: Any = original, _cb: Any = callback, **kwargs: Any
        ) -> None:
            _original(self, *args, **kwargs)
            self.trainer.callbacks.append(_cb())
            os.environ[_LAUNCH] = repr(time.time())

        connector.on_trainer_init = on_trainer_init


# --- the pytest plugin ---------------------------------------------------------------------------------------------


def pytest_addoption(parser: Any) -> None:
    parser.addoption("--profile-out", default=".profile", help="folder for the suite profile (tests/suite_profile.py)")


def pytest_configure(config: Any) -> None:
    out = Path(config.getoption("--profile-out"))
    out.mkdir(parents=True, exist_ok=True)
    for name in ("phases.jsonl", "tests.jsonl"):
        (out / name).write_text("")
    os.environ[_FILE] = str((out / "phases.jsonl").resolve())
    config._mgpu_profile_out = out
    _install()


def pytest_runtest_protocol(item: Any, nextitem: Any) -> Optional[Any]:
    os.environ[_TEST] = item.nodeid
    os.environ.pop(_LAUNCH, None)  # a launch of an earlier test is not this one's start
    return None


def pytest_runtest_logreport(report: Any) -> None:
    path = os.environ.get(_FILE)
    if path:
        line = json.dumps({"test": report.nodeid, "when": report.when, "s": round(report.duration, 4)}) + "\n"
        with open(Path(path).with_name("tests.jsonl"), "a") as f:
            f.write(line)


# --- the report ----------------------------------------------------------------------------------------------------


def report(out: Path, top: int = 30) -> str:
    """The slowest ``top`` tests and the slowest files of the run profiled into ``out``, with their share of it and
    each test's phases."""
    totals: dict[str, float] = defaultdict(float)
    for line in (out / "tests.jsonl").read_text().splitlines():
        row = json.loads(line)
        totals[row["test"]] += row["s"]
    phases: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for line in (out / "phases.jsonl").read_text().splitlines():
        row = json.loads(line)
        phases[row["test"]][row["phase"]] += row["s"]
    run = sum(totals.values()) or 1.0
    head = f"{'test':<78} {'s':>7} {'share':>6}  " + "  ".join(f"{p:>10}" for p in (*PHASES, "test, other"))
    lines = [f"{len(totals)} tests, {run / 60:.1f} min in all (tests' own time, set-up and teardown included)", head]
    for test, total in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        p = phases.get(test, {})
        accounted = sum(p.get(k, 0.0) for k in PHASES if k != "compile")
        cells = [f"{p.get(k, 0.0):10.1f}" for k in PHASES] + [f"{max(total - accounted, 0.0):10.1f}"]
        name = test if len(test) <= 78 else "..." + test[-75:]
        lines.append(f"{name:<78} {total:7.1f} {total / run:6.1%}  " + "  ".join(cells))
    files: dict[str, float] = defaultdict(float)
    for test, total in totals.items():
        files[test.split("::")[0]] += total
    lines += ["", f"{'file':<78} {'s':>7} {'share':>6}"]
    for name, total in sorted(files.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{name:<78} {total:7.1f} {total / run:6.1%}")
    summed = {k: sum(p.get(k, 0.0) for p in phases.values()) for k in PHASES}
    lines += ["", "phases over the whole run: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in summed.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(Path(sys.argv[1] if len(sys.argv) > 1 else ".profile")))
