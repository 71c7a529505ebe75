"""Lightning's launchers with one addition: a check of the Trainer and the module in the main process,
before any worker process is started (``Trainer.fit`` sets the module on the strategy just before it
launches). Subclasses, so Lightning's ``isinstance`` checks on launchers still hold."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.distributed import _set_num_threads_if_needed
from pytorch_lightning.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from pytorch_lightning.strategies.launchers.multiprocessing import _WorkerOutput
from typing_extensions import override

from lightning_mgpu.precision import MGPUPrecision

PreLaunchCheck = Callable[["pl.Trainer"], None]


class _PreLaunchCheck:
    """Put first in the bases of a Lightning launcher; takes the check as its first argument."""

    def __init__(self, check: PreLaunchCheck, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._check = check

    def launch(self, function: Callable, *args: Any, trainer: Optional[pl.Trainer] = None, **kwargs: Any) -> Any:
        if trainer is not None:
            self._check(trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class _CheckedSubprocessScriptLauncher(_PreLaunchCheck, _SubprocessScriptLauncher):
    """Lightning's popen launcher (rank 0 is this process; the other local ranks re-run the command) with a
    failure path that ends every rank and names the one that failed. Lightning's own observer polls the
    children every 5 s and SIGKILLs this process the moment one exits non-zero, before rank 0 can say why, and
    nothing ends or reaps the children when rank 0 itself raises (they wait in a collective until the timeout,
    or forever when stuck in user code; a dead one stays a zombie)."""

    def __init__(self, check: PreLaunchCheck, *args: Any, grace_s: float = 5.0, **kwargs: Any) -> None:
        super().__init__(check, *args, **kwargs)
        self._grace_s = grace_s

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional[pl.Trainer] = None, **kwargs: Any) -> Any:
        if trainer is not None:
            self._check(trainer)
        # Lightning's _SubprocessScriptLauncher.launch, with _ChildObserver in place of its process observer
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            _ChildObserver(self.procs, self._node_rank_offset(), self._grace_s).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        except BaseException as exception:
            self._end_children(exception)
            raise

    def _node_rank_offset(self) -> int:
        return self.cluster_environment.node_rank() * self.num_processes

    def _end_children(self, exception: BaseException) -> None:
        """Rank 0 failed: end and reap every child, and add what became of each to the error."""
        fates = []
        for local_rank, proc in enumerate(self.procs, start=1):
            rank = self._node_rank_offset() + local_rank
            code = proc.poll()
            if code is None:
                proc.kill()
                proc.wait()
                fates.append(f"rank {rank} (pid {proc.pid}) was still running and has been killed")
            else:
                fates.append(f"rank {rank} (pid {proc.pid}) had ended with {_exit_status(code)}")
        if fates:
            exception.args = (
                f"{exception.args[0] if exception.args else ''}\n[{'; '.join(fates)}]",
                *exception.args[1:],
            )


class _ChildObserver(threading.Thread):
    """Watches the child ranks. When one ends with an error, rank 0 (this process) gets ``grace_s`` to notice
    in its collective, name it and end by itself (its error is the one the user reads); if it has not, the
    observer names the child, kills the others and this process, as Lightning's observer does at once."""

    def __init__(self, procs: list[subprocess.Popen], rank_offset: int, grace_s: float) -> None:
        super().__init__(daemon=True, name="mgpu-child-observer")  # ends with this process
        self._procs = procs
        self._offset = rank_offset
        self._grace_s = grace_s

    @override
    def run(self) -> None:
        while True:
            time.sleep(0.5)
            codes = [p.poll() for p in self._procs]
            if all(c == 0 for c in codes):
                return
            failed = [(i, c) for i, c in enumerate(codes, start=1) if c not in (None, 0)]
            if failed:
                break
        time.sleep(self._grace_s)
        names = ", ".join(
            f"rank {self._offset + i} (pid {self._procs[i - 1].pid}) ended with {_exit_status(c)}" for i, c in failed
        )
        print(
            f"lightning-mgpu: {names}; rank {self._offset} did not end by itself within {self._grace_s:g} s: "
            f"killing every rank of this node.",
            file=sys.stderr,
            flush=True,
        )
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        os.kill(os.getpid(), signal.SIGKILL)


class _CheckedMultiProcessingLauncher(_PreLaunchCheck, _MultiProcessingLauncher):
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        try:
            super()._wrapping_function(*args, **kwargs)
        except BaseException as exception:
            # In a worker, Lightning's error handling (Trainer -> strategy.on_exception) never runs: it wraps
            # the launch in the main process. Name the failed rank and leave the group here.
            end_group = getattr(self._strategy, "_end_group_after", None)
            if end_group is not None:
                end_group(exception)
            raise
        # The worker process ends right after this: leave the process group together first.
        release_process_group()

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Optional[_WorkerOutput]:
        output = super()._collect_rank_zero_results(trainer, results)
        plugin = trainer.precision_plugin
        if (
            output is not None
            and output.weights_path is not None
            and isinstance(plugin, MGPUPrecision)
            and plugin.holds_masters
        ):
            # the main process's model gets the FP32 masters, not their half rounding (written again: only then)
            module = trainer.lightning_module
            self._strategy.checkpoint_io.save_checkpoint(
                plugin.fp32_state_dict(module, module.state_dict()), output.weights_path
            )
        return output


def release_process_group() -> None:
    """Every rank leaves the process group together. Left to interpreter exit, the group's C++ threads were
    sometimes destroyed while still running ("terminate called without an active exception", SIGABRT, seen
    intermittently here on spawn workers and on the popen rank 0)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
