"""Running many user scripts, each as ``python script.py`` runs it, without paying each one's imports of torch.

A fresh interpreter spends most of a short example's time importing torch, dynamo and torchmetrics (which every
Lightning namespace imports): about 9 of the 11 s of ``import pytorch_lightning`` on 2 busy cores. :class:`Scripts`
starts one interpreter that imports those three and nothing of Lightning or of the pack (so either namespace, and
the pack, are imported by the script as in a fresh interpreter), then forks it once per script: the child takes the
script's folder as its working directory and ``sys.path[0]``, the script as ``sys.argv[0]``, its output in files, a
session of its own (so a timeout ends the script and every rank it launched), and runs it as ``__main__``
(``runpy.run_path``: ``__main__.__spec__`` is ``None`` and ``__file__`` the script, as for ``python script.py``, so
Lightning's popen launch re-runs the script for its other ranks, in fresh interpreters, and a spawn launch
re-imports it). The child ends as that interpreter would: an exception the script raises is printed and exits 1,
``sys.exit`` is honoured, then threads are joined and ``atexit`` functions run. Nothing in the parent runs a torch
operator, so the fork inherits no thread pool.

:meth:`Scripts.run_module` runs a module as ``python -m module args`` does (``runpy.run_module``: ``__main__`` with the
module's spec, ``sys.argv[0]`` its file, the working directory first on ``sys.path``; a popen launch re-runs
``python -m module``). A runner may preload more than the default (the GPU tier's CPU mode preloads its worker,
Lightning and the pack with it), where what is tested is not an interpreter's start.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

PRELOADED = ("torch", "torch._dynamo", "torchmetrics")

_SERVER = r"""
import json, os, runpy, sys
for name in sys.argv[1:]:
    __import__(name)
requests, replies = sys.stdin, sys.stdout
replies.write("ready\n"); replies.flush()
for line in requests:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.setsid()
        for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                               (2, job["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            os.dup2(os.open(path, mode, 0o644), fd)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.chdir(job["cwd"])
        if job.get("env") is not None:  # the script's whole environment, as subprocess's env= gives it
            os.environ.clear()
            os.environ.update(job["env"])
        if "module" in job:  # as python -m MODULE ARGS: the working directory first on sys.path
            sys.argv = [job["module"], *job["argv"]]
            sys.path[0] = job["cwd"]
            runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [job["script"], *job["argv"]]
            sys.path[0] = os.path.dirname(job["script"])
            runpy.run_path(job["script"], run_name="__main__")
        raise SystemExit  # ends as the script's interpreter would: non-daemon threads joined, atexit run, exit 0
    replies.write(json.dumps({"pid": pid}) + "\n"); replies.flush()
    _, status = os.waitpid(pid, 0)
    replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n"); replies.flush()
"""


def session_members(sid: int) -> list[int]:
    """The pids of the processes still alive in session ``sid`` (what a script left behind), the session's leader
    left out."""
    members = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()) if os.path.isdir("/proc") else []:
        with contextlib.suppress(OSError):
            if os.getsid(pid) == sid and pid != sid:
                members.append(pid)
    return members


class ScriptRun(subprocess.CompletedProcess):  # type: ignore[type-arg]
    """A finished script: its exit code and output, and ``leftovers``, the pids of its session still alive when it
    ended (the runner then kills them)."""

    def __init__(self, args: list[str], returncode: int, stdout: str, stderr: str, leftovers: list[int]) -> None:
        super().__init__(args, returncode, stdout, stderr)
        self.leftovers = leftovers


class Scripts:
    """One pre-imported interpreter that runs scripts one after the other; :meth:`close` ends it."""

    def __init__(
        self, preload: tuple[str, ...] = PRELOADED, cwd: Path | None = None, env: dict[str, str] | None = None
    ) -> None:
        self._server = subprocess.Popen(
            [sys.executable, "-c", _SERVER, *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env=env,
        )
        self._pending = b""  # what the server wrote past the last line read: its two replies can come in one read
        assert self._reply(timeout=300) == "ready"

    def _reply(self, timeout: float) -> str:
        """The server's next line. Read from the pipe's descriptor, not through a buffered file, so that ``select``
        never waits for a line that a buffer already holds."""
        assert self._server.stdout is not None
        fd = self._server.stdout.fileno()
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the script runner ended (exit code {self._server.wait()})")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode().strip()

    def run(
        self, script: Path, timeout: float, args: tuple[str, ...] = (), env: dict[str, str] | None = None
    ) -> ScriptRun:
        """``script`` as ``python script.py *args`` in its folder (with ``env`` its whole environment, else the
        runner's); a script still running after ``timeout`` seconds is killed with everything it started, and the call
        raises ``subprocess.TimeoutExpired``. What the script left running in its session when it ended is in
        ``leftovers``, then killed. Environment read when torch, dynamo or torchmetrics are imported is the runner's:
        a test of such a variable starts a fresh interpreter."""
        out, err = script.with_suffix(".stdout"), script.with_suffix(".stderr")
        job = {"script": str(script), "argv": list(args), "cwd": str(script.parent), "env": env}
        return self._run(job, [str(script), *args], out, err, timeout)

    def run_module(self, module: str, args: list[str], cwd: Path, output: Path, timeout: float) -> ScriptRun:
        """``python -m module *args`` in ``cwd`` (its output in ``output``.stdout/.stderr), with the same timeout as
        :meth:`run`. A module the runner preloaded runs again as ``__main__`` over the imports it already holds."""
        job = {"module": module, "argv": args, "cwd": str(cwd)}
        out, err = output.with_suffix(".stdout"), output.with_suffix(".stderr")
        return self._run(job, ["-m", module, *args], out, err, timeout)

    def _run(self, job: dict[str, object], cmd: list[str], out: Path, err: Path, timeout: float) -> ScriptRun:
        job = {**job, "out": str(out), "err": str(err)}
        assert self._server.stdin is not None
        self._server.stdin.write(json.dumps(job) + "\n")
        self._server.stdin.flush()
        pid = json.loads(self._reply(timeout=30))["pid"]
        try:
            returncode = json.loads(self._reply(timeout=timeout))["returncode"]
        except TimeoutError:
            os.killpg(pid, signal.SIGKILL)  # the script's session: its launched ranks too
            self._reply(timeout=30)  # the server reaps it
            raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(), err.read_text()) from None
        leftovers = session_members(pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        return ScriptRun(cmd, returncode, out.read_text(), err.read_text(), leftovers)

    def close(self) -> None:
        assert self._server.stdin is not None
        self._server.stdin.close()
        self._server.wait(timeout=30)
