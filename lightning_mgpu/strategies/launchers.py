"""Lightning's launchers with one addition: a check of the Trainer and the module in the main process,
before any worker process is started (``Trainer.fit`` sets the module on the strategy just before it
launches). Subclasses, so Lightning's ``isinstance`` checks on launchers still hold."""

from __future__ import annotations

import atexit
import inspect
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_mgpu import comm
from lightning_mgpu._compat import (
    MultiProcessingLauncher,
    SubprocessScriptLauncher,
    call_children_scripts,
    cpu_fork_despite_cuda_probe,
    forget_inherited_compile_threads,
    forget_inherited_dtensor_caches,
    is_interactive,
    set_num_threads_if_needed,
    worker_output,
)
from lightning_mgpu.comm import group_is_up
from lightning_mgpu.parts.rendezvous import announce_nodes

PreLaunchCheck = Callable[["pl.Trainer"], None]


#: strategy -> (what the user wrote, the notebook form of the same strategy), as ``Trainer(strategy=...)``
#: arguments. Handed in by ``lightning_mgpu.presets``, which holds the preset table: it imports the strategies, so
#: they cannot import it.
_NOTEBOOK_ADVICE: list[Callable[[Any], tuple[str, str]]] = []


def set_notebook_advice(advice: Callable[[Any], tuple[str, str]]) -> None:
    """Where a notebook refusal finds the notebook preset to suggest (:func:`check_interactive`)."""
    _NOTEBOOK_ADVICE[:] = [advice]


def check_interactive(strategy: Any, start_method: str) -> None:
    """In a notebook, a launch that re-runs the script (popen) or spawns fresh interpreters cannot work. Lightning
    refuses it too, right after this, but suggests its own ``strategy='ddp_notebook'``, which would silently drop the
    pack; the refusal here names the notebook preset of the same strategy."""
    if not is_interactive() or start_method == "fork":
        return
    name = type(strategy).__name__
    advice = _NOTEBOOK_ADVICE[0] if _NOTEBOOK_ADVICE else None
    flag, choice = advice(strategy) if advice else (f"{name}(...)", f"{name}(..., start_method='fork')")
    raise MisconfigurationException(
        f"`Trainer(strategy={flag})` is not compatible with an interactive environment. Run your code as a "
        f"script, or choose a notebook-compatible strategy: `Trainer(strategy={choice})` (fork launch; CUDA "
        f"must not be initialised before it). In case you are spawning processes yourself, make sure to "
        f"include the Trainer creation inside the worker function."
    )


class _PreLaunchCheck:
    """Put first in the bases of a Lightning launcher; takes the check as its first argument.

    It also keeps the ``weights_only`` of the Trainer call it launches (:attr:`weights_only`): Lightning 2.6.6
    passes it to ``Strategy.load_checkpoint`` only for strategies that restore before their set-up, and drops it
    (``None``) for those that restore after it (``restore_checkpoint_after_setup``, the sharded strategies)."""

    def __init__(self, check: PreLaunchCheck, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._check = check
        self.weights_only: Optional[bool] = None

    def launch(self, function: Callable, *args: Any, trainer: Optional[pl.Trainer] = None, **kwargs: Any) -> Any:
        if trainer is not None:
            self._check(trainer)
        strategy: Any = getattr(self, "_strategy", None)  # Lightning's multiprocessing launcher keeps it there
        if strategy is not None and strategy.cluster_environment is not None:
            announce_nodes(strategy.cluster_environment, strategy.num_nodes, strategy.num_processes)
        self.weights_only = requested_weights_only(function, args, kwargs)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]  # the launcher after it


def requested_weights_only(function: Callable, args: tuple, kwargs: dict[str, Any]) -> Optional[bool]:
    """The ``weights_only`` given to the Trainer call whose implementation ``function(*args, **kwargs)`` is being
    launched (``Trainer._fit_impl``, ``_validate_impl``, ... take it by that name), ``None`` if not given.

    Example:

        >>> def _fit_impl(model, ckpt_path=None, weights_only=None): ...
        >>> requested_weights_only(_fit_impl, ("model", "last.ckpt", False), {})
        False
    """
    try:
        value = inspect.signature(function).bind_partial(*args, **kwargs).arguments.get("weights_only")
    except (TypeError, ValueError):  # not a Trainer call's implementation
        return None
    return value if isinstance(value, bool) else None


def launched_weights_only(launcher: Any) -> Optional[bool]:
    """The ``weights_only`` of the Trainer call ``launcher`` launched last (``None``: not given, or no launch)."""
    value = getattr(launcher, "weights_only", None)
    return value if isinstance(value, bool) else None


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class _CheckedSubprocessScriptLauncher(_PreLaunchCheck, SubprocessScriptLauncher):
    """Lightning's popen launcher (rank 0 is this process; the other local ranks re-run the command) with a
    failure path that names the failed rank and leaves no process behind.

    Lightning's own observer polls the children every 5 s and SIGKILLs this process the moment one exits
    non-zero, before rank 0 can say why; and nothing ends a child that is stuck, or reaps one that died. Here,
    when ``fit`` raises in rank 0: the observer stands down, rank 0 takes its roll call first (``on_failure``:
    the strategy's ``_end_group_after``, which returns the ranks that did not answer), then kills only those
    children (stuck or dead ones; a child that answered is handling the failure itself and may go on, e.g. a
    script that catches the exception and fits again) and reaps every child that has ended. Children still
    running when this process exits are ended and reaped then.

    ``finish(trainer, results)``, when given, runs in every rank after the Trainer call and replaces what it
    returns (the strategy gathers ``trainer.predict``'s predictions there)."""

    def __init__(
        self,
        check: PreLaunchCheck,
        *args: Any,
        on_failure: Optional[Callable[[BaseException], list[int]]] = None,
        grace_s: float = 5.0,
        finish: Optional[Callable[[pl.Trainer, Any], Any]] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(check, *args, **kwargs)
        self._on_failure = on_failure
        self._grace_s = grace_s
        self._finish = finish
        self._observer: Optional[_ChildObserver] = None

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional[pl.Trainer] = None, **kwargs: Any) -> Any:
        if trainer is not None:
            self._check(trainer)
        self.weights_only = requested_weights_only(function, args, kwargs)  # as _PreLaunchCheck.launch keeps it
        # Lightning's _SubprocessScriptLauncher.launch, with _ChildObserver in place of its process observer
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally and not self.procs:
            announce_nodes(self.cluster_environment, self.num_nodes, self.num_processes)  # before anyone waits
            call_children_scripts(self)
            atexit.register(_end_and_reap, self.procs, self._grace_s)
        # One observer per Trainer call, while child ranks run (none with one device per node): it ends with the
        # call, so no thread of this launcher outlives it. A later call (trainer.test after fit) starts its own.
        observer = None
        if any(proc.poll() is None for proc in self.procs):
            observer = self._observer = _ChildObserver(self.procs, self._node_rank_offset(), self._grace_s)
            observer.start()
        set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            results = function(*args, **kwargs)
            if self._finish is not None and trainer is not None:
                results = self._finish(trainer, results)  # every rank: e.g. the predictions gathered
            return results
        except BaseException as exception:
            # rank 0 is handling a failure: no SIGKILL from behind
            if observer is not None:
                observer.stand_down.set()
            missing = self._on_failure(exception) if self._on_failure is not None else []
            self._end_children(exception, missing)
            raise
        finally:
            if observer is not None:
                observer.stand_down.set()
                observer.join()

    def _node_rank_offset(self) -> int:
        return self.cluster_environment.node_rank() * self.num_processes

    def _end_children(self, exception: BaseException, missing: list[int]) -> None:
        """Kill the children the roll call found missing, reap every child that has ended, and add what became
        of each to the error."""
        fates = []
        for local_rank, proc in enumerate(self.procs, start=1):
            rank = self._node_rank_offset() + local_rank
            code = proc.poll()
            if code is None and rank in missing:
                proc.kill()
                proc.wait()
                fates.append(f"rank {rank} (pid {proc.pid}) was still running and has been killed")
            elif code is not None:
                fates.append(f"rank {rank} (pid {proc.pid}) had ended with {_exit_status(code)}")
        if fates:
            exception.args = (
                f"{exception.args[0] if exception.args else ''}\n[{'; '.join(fates)}]",
                *exception.args[1:],
            )


def _one_intra_op_thread() -> None:
    """In a worker forked from the main process: one intra-op thread (``torch.set_num_threads(1)``, and
    ``OMP_NUM_THREADS=1`` in the worker's environment so that Lightning's launcher keeps it).

    torch's CPU operators run in parallel on an OpenMP thread pool (GNU libgomp on Linux). Once the main process has
    run a parallel operator with more than one thread, the pool's threads exist only there: a forked child that runs
    a parallel operator with more than one thread waits for them forever. Lightning's fork launcher gives each worker
    ``cpu_count() // devices`` threads, so a notebook that ran a forward pass on the CPU, then
    ``Trainer(strategy="mgpu_ddp_notebook", accelerator="cpu", devices=2)`` on a machine with more than two cores,
    hung in the first forward of its workers (reproduced on CPU; on GPUs a worker's first parallel CPU operator, such
    as a collate of large tensors, is exposed the same way). Nothing tells whether the main process has run such an
    operator, so a forked worker always runs one thread; a spawn or popen launch starts new interpreters, which take
    Lightning's count."""
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


def _end_and_reap(procs: list[subprocess.Popen], grace_s: float) -> None:
    """At exit of the process that launched them: leave the process group (a child still waiting in a
    collective for this rank, e.g. after rank 0 raised, fails at once and ends), give the child ranks
    ``grace_s`` to finish, then kill the rest; reap all (no zombie outlives its parent's job)."""
    if any(proc.poll() is None for proc in procs):
        comm.destroy_group(quiet=True)  # freed where nothing else holds it: its connections close now
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_KILL = getattr(signal, "SIGKILL", signal.SIGTERM)  # Windows has no SIGKILL (Lightning uses SIGTERM there)


class _ChildObserver(threading.Thread):
    """Watches the child ranks during one Trainer call of this process. When one ends with an
    error, rank 0 (this process) gets ``grace_s`` to notice in its collective and raise, which makes it stand
    down (its error is the one the user reads); if rank 0 has not, it is stuck (e.g. in user code): the
    observer names the child, kills the others and this process, as Lightning's observer does at once."""

    def __init__(self, procs: list[subprocess.Popen], rank_offset: int, grace_s: float) -> None:
        super().__init__(daemon=True, name="mgpu-child-observer")  # ends with this process
        self._procs = procs
        self._rank_offset = rank_offset
        self._grace_s = grace_s
        self.stand_down = threading.Event()

    @override
    def run(self) -> None:
        failed: list[tuple[int, int]] = []
        while not failed:
            if self.stand_down.wait(0.5):
                return
            codes = [p.poll() for p in self._procs]
            if all(c == 0 for c in codes):
                return
            failed = [(i, c) for i, c in enumerate(codes, start=1) if c not in (None, 0)]
        if self.stand_down.wait(self._grace_s):
            return
        names = ", ".join(
            f"rank {self._rank_offset + i} (pid {self._procs[i - 1].pid}) ended with {_exit_status(c)}"
            for i, c in failed
        )
        print(
            f"lightning-mgpu: {names}; rank {self._rank_offset} did not end by itself within {self._grace_s:g} s: "
            f"killing every rank of this node.",
            file=sys.stderr,
            flush=True,
        )
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        os.kill(os.getpid(), _KILL)


class _CheckedMultiProcessingLauncher(_PreLaunchCheck, MultiProcessingLauncher):
    """Lightning's spawn/fork launcher with the pre-launch check, the failure path in the workers, and the
    weights handed back to the main process chosen by the strategy.

    Args:
        check: the pre-launch check (main process).
        strategy: Lightning's launcher argument.
        start_method: ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        on_failure: called in a worker with the exception that ended it (name the failed rank, leave the group).
        weights: a collective, run on every rank after fit: the module state the main process gets (the FP32
            masters of master-weight precision; under FSDP2 the full state gathered from the shards, where
            Lightning hands back rank 0's shards only).
        results: ``(collect, restore)``: ``collect(trainer)`` runs in rank 0's worker after the call and returns
            a picklable object; ``restore(trainer, it)`` runs in the main process with it, beside Lightning's
            ``callback_metrics`` (the ledger, ``mgpu_auto``'s decision, ``DeviceMonitor``'s history).
        returned: ``(prepare, finish)``: ``prepare(trainer, function, args, kwargs)`` runs in the main process
            before the workers start and returns the call's ``(args, kwargs)``; ``finish(trainer, results)`` runs
            in every worker after the call (a collective) and returns what the main process's call returns
            (``trainer.predict``'s predictions, gathered).
        device_type: the type of the Trainer's devices (a fork of CPU workers is safe where torch would refuse it).

    What the call returns and the extra results (``callback_metrics``, the strategy's results) travel in temporary
    files, as Lightning's weights do (see ``_SavedResults``).
    """

    def __init__(
        self,
        check: PreLaunchCheck,
        strategy: Any,
        start_method: Any = "spawn",
        on_failure: Optional[Callable[[BaseException], list[int]]] = None,
        weights: Optional[Callable[[], dict[str, Any]]] = None,
        results: Optional[tuple[Callable[[pl.Trainer], Any], Callable[[pl.Trainer, Any], None]]] = None,
        returned: Optional[tuple[Callable[..., tuple[tuple, dict]], Callable[[pl.Trainer, Any], Any]]] = None,
        device_type: Callable[[], str] = lambda: "cpu",
    ) -> None:
        super().__init__(check, strategy, start_method=start_method)
        self._on_failure = on_failure
        self._weights = weights
        self._hand_back = results
        self._returned = returned
        self._forks = start_method in ("fork", "forkserver")
        self._from_this_process = start_method == "fork"  # forkserver's workers come from a new interpreter
        self._device_type_of = device_type

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional[pl.Trainer] = None, **kwargs: Any) -> Any:
        if self._returned is not None:
            args, kwargs = self._returned[0](trainer, function, args, kwargs)
        if self._forks and self._device_type_of() == "cpu":
            # CPU workers never initialise CUDA, so a fork is safe even in a process that torch marks as a "bad
            # fork" (on the CUDA wheel without a GPU, asking for the device count marks every later fork child
            # so). Lightning refuses such forks on any device; on CUDA its refusal stands.
            with cpu_fork_despite_cuda_probe():
                returned = super().launch(function, *args, trainer=trainer, **kwargs)
        else:
            returned = super().launch(function, *args, trainer=trainer, **kwargs)
        return returned.load() if isinstance(returned, _SavedResults) else returned

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        if self._forks:  # the parent's compile threads do not exist here (_compat.py)
            forget_inherited_compile_threads()
        if self._from_this_process:
            _one_intra_op_thread()
            forget_inherited_dtensor_caches()  # specs over the parent's mesh (_compat.py)
        try:
            super()._wrapping_function(*args, **kwargs)
        except BaseException as exception:
            # In a worker, Lightning's error handling (Trainer -> strategy.on_exception) never runs: it wraps
            # the launch in the main process. Name the failed rank and leave the group here.
            if self._on_failure is not None:
                self._on_failure(exception)
            raise
        # The worker process ends right after this: leave the process group together first.
        release_process_group()

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        if self._returned is not None:
            results = self._returned[1](trainer, results)  # a collective: every rank takes part
        if trainer.local_rank == 0 and results is not None:
            results = _SavedResults(results)  # what the call returns (predictions, test metrics): in a file
        if self._weights is None:
            return super()._collect_rank_zero_results(trainer, results)
        # Lightning's own, with the strategy's weights: a collective, every rank takes part
        state_dict = self._weights()
        strategy = trainer.strategy
        if trainer.local_rank != 0:
            return None
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        extra = self.get_extra_results(trainer)
        return worker_output(best_model_path, weights_path, trainer.state, results, extra)

    @override
    def get_extra_results(self, trainer: pl.Trainer) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        if self._hand_back is not None:
            extra[_RESULTS] = self._hand_back[0](trainer)
        # in a file: many logged metrics, or a DeviceMonitor history of more than about 70 rows, are more than
        # the queue's pipe holds (see _SavedResults)
        return {_FILED: _SavedResults(extra)}

    @override
    def update_main_process_results(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        if isinstance(extra.get(_FILED), _SavedResults):
            extra = extra[_FILED].load()
        super().update_main_process_results(trainer, extra)
        if self._hand_back is not None and _RESULTS in extra:
            self._hand_back[1](trainer, extra[_RESULTS])


_RESULTS = "lightning_mgpu_results"  # the key of the strategy's results among the worker's extra results
_FILED = "lightning_mgpu_filed"  # the key of the file that holds the worker's extra results


class _SavedResults:
    """A worker's return value in a temporary file (``torch.save``), loaded and removed by the main process (see
    ``returned``). Not on Lightning's queue: the worker writes it to a pipe that the main process reads only once
    every worker has ended, so a value larger than the pipe's buffer (64 KiB on Linux) blocks the worker forever;
    and a tensor put there shares its memory with the worker, gone once it has exited.

    The file is private to the user: created with mode 0600 in a directory of its own made with mode 0700
    (``tempfile.mkdtemp``), so no other user can write it or put another file in its place; the main process reads
    it once (it may hold any picklable prediction, so with ``weights_only=False``) and removes both."""

    def __init__(self, value: Any) -> None:
        folder = tempfile.mkdtemp(prefix="lightning_mgpu_results_")  # mode 0700
        self.path = os.path.join(folder, "results.pt")
        with os.fdopen(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            torch.save(value, f)

    def load(self) -> Any:
        # written by this job's own worker a moment ago, in its private directory: not a file received from elsewhere
        try:
            return torch.load(self.path, weights_only=False)
        finally:
            os.remove(self.path)
            os.rmdir(os.path.dirname(self.path))


def release_process_group() -> None:
    """Every rank leaves the process group together. Left to interpreter exit, the group's C++ threads were
    sometimes destroyed while still running ("terminate called without an active exception", SIGABRT, seen
    intermittently here on spawn workers and on the popen rank 0)."""
    if group_is_up():
        comm.barrier()
        comm.destroy_group()
