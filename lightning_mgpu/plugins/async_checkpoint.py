"""Checkpoint writes in the background, of a state copied off the live tensors first.

A save with ``async_checkpoint=True`` has two halves:

1. **Staging**, in the training thread, before the step goes on: :meth:`AsyncCheckpointWriter.stage` deep-copies
   the checkpoint. Every tensor is copied to CPU memory (pinned memory when it lives on a GPU, so the copy is a
   DMA); a ``DTensor`` keeps its mesh and placements around a copy of its local shard, which stays in CPU memory.
   Everything else is ``copy.deepcopy``-ed. The training step may then change the live weights and optimizer
   state: the write sees the state of the step the checkpoint names, bit for bit. (Lightning's
   ``AsyncCheckpointIO`` hands the live tensors to its thread: its file can mix two steps.)
2. **Writing**, in one background thread per strategy (:meth:`AsyncCheckpointWriter.submit`). At most one write
   is in flight: a new save first waits for the previous write to finish. No write is dropped or superseded:
   every checkpoint ``ModelCheckpoint`` asked for is written, complete, before the next one starts.

A GPU tensor's copy does not stop the training thread: :meth:`~AsyncCheckpointWriter.stage` queues it on a side
stream of the writer (which first waits for the work already queued on the current stream: the copy reads the
tensors as that work leaves them), records an event after the copies and makes the current stream wait for that
event, and returns. Every kernel training queues afterwards, the next optimizer step included, runs after the
copies have read the sources; the host waits for nothing (no ``torch.cuda.synchronize()``). The background thread
waits for the event before it writes, then writes on the training's device with the side stream as its current
stream (:meth:`CudaStreams.writing_on`). On the CPU the copies are made before ``stage`` returns, as plain copies.

The staging buffers are kept for the next save (one CPU copy of the checkpoint's tensors per rank; pinned
allocation is slow), as torch's ``DefaultStager(cache_staged_state_dict=True)`` does. torch's stager itself
(``torch.distributed.checkpoint.staging``, torch 2.13 read) is not used: staged in the caller's thread it
synchronises the whole device; staged in a thread of its own, its side stream is not ordered after the current
stream, and the caller must wait for the staging to end before anything changes the state, which here would mean a
wait before the next forward (it updates BatchNorm's buffers) in code outside the checkpoint's.

A failed write is kept, with its path and cause, until :meth:`AsyncCheckpointWriter.finish`; the strategy calls it
on every rank at the next save and at the end of fit, and raises :class:`CheckpointWriteError` on every rank.
Removals of old checkpoints asked for while a write is in flight (``ModelCheckpoint``'s top-k) wait for that
write to succeed (:meth:`AsyncCheckpointWriter.remove_after_write`): an old checkpoint is never removed before
its replacement is complete, and never if the replacement failed.

Example::

    writer = AsyncCheckpointWriter()
    staged = writer.stage({"state_dict": model.state_dict(), "epoch": 3})  # copies; training may go on
    writer.submit("last.ckpt", lambda: torch.save(staged, "last.ckpt"))
    ...
    failures = writer.finish()  # waits; [] if the write succeeded
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

import torch

from lightning_mgpu import comm
from lightning_mgpu._compat import dtensor_around

log = logging.getLogger(__name__)


class CheckpointWriteError(RuntimeError):
    """A checkpoint written in the background (``async_checkpoint=True``) failed on some rank; raised on every
    rank at the next save or at the end of fit, naming the path and the cause. The live training state was
    never touched, and the checkpoint previously under that name is still there, complete.

    Example (a save into a path that cannot be written: ``save_checkpoint`` returns at once, the error comes at the
    end of fit):

        >>> import os, tempfile
        >>> import pytorch_lightning as pl
        >>> from lightning_mgpu import CheckpointWriteError, MGPUDDPStrategy
        >>> from lightning_mgpu.examples import DigitsCNN, DigitsDataModule
        >>> not_a_folder = os.path.join(tempfile.mkdtemp(), "a-file")
        >>> open(not_a_folder, "w").close()
        >>> class SaveAtStep2(pl.Callback):
        ...     def on_train_batch_end(self, trainer, *args):
        ...         if trainer.global_step == 2:
        ...             trainer.save_checkpoint(os.path.join(not_a_folder, "step2.ckpt"))
        >>> trainer = pl.Trainer(strategy=MGPUDDPStrategy(async_checkpoint=True), accelerator="cpu", devices=1,
        ...                      max_steps=4, callbacks=[SaveAtStep2()], logger=False, enable_checkpointing=False,
        ...                      enable_progress_bar=False, enable_model_summary=False)
        >>> try:
        ...     trainer.fit(DigitsCNN(), DigitsDataModule())
        ... except CheckpointWriteError as err:
        ...     print(str(err).split(" (")[0])
        The background write of a checkpoint failed
    """


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return DTensor


@dataclass
class _Job:
    path: str
    thread: Optional[threading.Thread] = None
    error: Optional[BaseException] = None
    done: bool = False
    removals: list[Callable[[], None]] = field(default_factory=list)


class _Copies(NamedTuple):
    done: Any  # the event recorded after the copies
    device: torch.device
    stream: Any  # the side stream they were queued on


def _land(copies: list[_Copies]) -> None:
    """Block until the side-stream copies ``copies`` have landed."""
    for copied in copies:
        copied.done.synchronize()


SIDE_STREAM_DEVICES = ("cuda",)
"""The device types whose tensors :meth:`AsyncCheckpointWriter.stage` copies on a side stream without waiting for
the copies (any other device's tensors are copied before ``stage`` returns)."""


class CudaStreams:
    """The calls into ``torch.cuda`` that staging on a side stream makes, in one place (a test replaces them)."""

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def use(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def record_use(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)  # the caching allocator keeps a freed source until the stream's copy has run

    @contextlib.contextmanager
    def writing_on(self, device: torch.device, stream: Any) -> Iterator[None]:
        """In the writer thread: ``device`` (the training's; a new thread starts on device 0) with the writer's
        side stream ``stream`` as its current stream. ``torch.distributed.checkpoint``'s writer synchronises the
        current stream of the current device: the idle side stream, not training's, and never device 0's context
        from a rank on another GPU."""
        torch.cuda.set_device(device)
        with torch.cuda.stream(stream):
            yield


class AsyncCheckpointWriter:
    """Stages checkpoints off the live tensors and writes them in one background thread (see the module).

    Args:
        rank: this process's global rank (in error messages).
        keep_buffers: keep the staging buffers for the next save of the same shapes (default ``True``).
    """

    def __init__(self, rank: int = 0, keep_buffers: bool = True) -> None:
        self.rank = rank
        self.keep_buffers = keep_buffers
        self._jobs_guard = threading.Lock()
        self._job: Optional[_Job] = None
        self._failures: list[str] = []
        self._causes: list[BaseException] = []
        self._buffers: list[torch.Tensor] = []  # staging copies, in traversal order, reused when shapes match
        self._cuda = CudaStreams()
        self._streams: dict[torch.device, Any] = {}  # a side stream per device, kept for the next saves
        self._copies: list[_Copies] = []  # the last staging's side-stream copies, per device (none on the CPU)

    def __getstate__(self) -> dict[str, Any]:
        # a spawn launch pickles the strategy: no thread, lock, buffers, streams or events travel
        state = self.__dict__.copy()
        state.update(_jobs_guard=None, _job=None, _buffers=[], _failures=[], _causes=[], _streams={}, _copies=[])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._jobs_guard = threading.Lock()

    # --- staging ------------------------------------------------------------------------------------------
    def stage(self, obj: Any) -> Any:
        """A deep copy of ``obj`` whose tensors are in CPU memory (pinned when they came from a GPU). Tensors shared
        in ``obj`` stay shared in the copy. Call it with no write in flight (:meth:`submit` waits first; the buffers
        are reused).

        A CPU tensor is copied before ``stage`` returns. A GPU tensor's copy is only queued (see the module): the
        copy holds its values once :meth:`wait_staged` returns, which the write :meth:`submit` runs next does
        first; kernels queued on the current stream after ``stage`` run after the copy."""
        self.wait()
        dtensor = _dtensor_type()
        memo: dict[int, Any] = {}
        used = [0]
        entered: dict[torch.device, Any] = {}  # the side streams of this staging, ordered after the current streams

        def side_stream(device: torch.device) -> Any:
            stream = entered.get(device)
            if stream is None:
                stream = self._streams.get(device)
                if stream is None:
                    stream = self._streams[device] = self._cuda.new_stream(device)
                stream.wait_stream(self._cuda.current_stream(device))  # what training queued has run first
                entered[device] = stream
            return stream

        def copy_tensor(t: torch.Tensor) -> torch.Tensor:
            src = t.detach()
            i = used[0]
            used[0] += 1
            pin = src.is_cuda and torch.cuda.is_available()
            buf = self._buffers[i] if i < len(self._buffers) else None
            if (
                buf is None
                or buf.shape != src.shape
                or buf.dtype != src.dtype
                or buf.stride() != src.stride()
                or (pin and not buf.is_pinned())
            ):
                buf = torch.empty_strided(src.size(), src.stride(), dtype=src.dtype, device="cpu", pin_memory=pin)
                if i < len(self._buffers):
                    self._buffers[i] = buf
                else:
                    self._buffers.append(buf)
            if src.device.type in SIDE_STREAM_DEVICES:
                stream = side_stream(src.device)
                with self._cuda.use(stream):
                    buf.copy_(src, non_blocking=True)
                self._cuda.record_use(src, stream)
            else:
                buf.copy_(src)
            return buf

        def visit(o: Any) -> None:
            if id(o) in memo:
                return
            if dtensor is not None and isinstance(o, dtensor):
                d: Any = o
                local = copy_tensor(d.to_local())
                if local.device.type == d.device_mesh.device_type:
                    memo[id(o)] = dtensor.from_local(
                        local, d.device_mesh, d.placements, run_check=False, shape=d.size(), stride=d.stride()
                    )
                else:  # the CPU copy of a GPU shard: from_local would copy it back to the GPU
                    memo[id(o)] = dtensor_around(d, local)
            elif isinstance(o, torch.Tensor):
                memo[id(o)] = copy_tensor(o)
            elif isinstance(o, Mapping):
                for v in o.values():
                    visit(v)
            elif isinstance(o, (list, tuple, set, frozenset)):
                for v in o:
                    visit(v)

        visit(obj)
        del self._buffers[used[0] :]
        copies = []
        for device, stream in entered.items():  # the copies queued: training's next kernels wait for them, not the host
            done = self._cuda.new_event()
            done.record(stream)
            self._cuda.current_stream(device).wait_event(done)
            copies.append(_Copies(done, device, stream))
        self._copies = copies
        tensors = dict(memo)
        try:
            staged = copy.deepcopy(obj, memo)
        except Exception:  # an object deepcopy cannot copy: copy the containers, share such leaves
            staged = _copy_containers(obj, tensors)  # (deepcopy's memo now holds half-filled containers)
        if not self.keep_buffers:
            self._buffers = []
        return staged

    @property
    def copies_pending(self) -> bool:
        """Whether the last :meth:`stage` queued copies on a side stream that no write has waited for yet."""
        return bool(self._copies)

    def wait_staged(self) -> None:
        """Block until the copies the last :meth:`stage` queued have landed (at once on the CPU)."""
        copies, self._copies = self._copies, []
        _land(copies)

    # --- writing ------------------------------------------------------------------------------------------
    def submit(self, path: str, write: Callable[[], None]) -> None:
        """Run ``write()`` (which writes ``path``) in the background thread, after the previous write finished and
        once the copies of the last :meth:`stage` have landed."""
        self.wait()
        job = _Job(path=path)
        copies, self._copies = self._copies, []  # the last staging's copies: the write reads what they land

        def run() -> None:
            _lower_priority()
            try:
                _land(copies)
                with self._cuda.writing_on(copies[0].device, copies[0].stream) if copies else contextlib.nullcontext():
                    write()
            except BaseException as err:
                job.error = err
            with self._jobs_guard:
                job.done = True
                removals, job.removals = job.removals, []
                if job.error is not None:
                    self._failures.append(f"{job.path}: {describe_error(job.error, self.rank)}")
                    self._causes.append(job.error)
            if job.error is None:
                for remove in removals:  # the replacement is complete: the old checkpoints can go
                    try:
                        remove()
                    except Exception as err:
                        log.warning(f"Removing an old checkpoint after writing {job.path} failed: {err}")

        job.thread = threading.Thread(target=run, name=f"lightning_mgpu-checkpoint-writer-{self.rank}", daemon=True)
        self._job = job
        job.thread.start()

    def remove_after_write(self, remove: Callable[[], None]) -> None:
        """``remove()`` now if no write is in flight, else once the write in flight has succeeded (never if it
        failed: the old checkpoint is then the latest complete one)."""
        with self._jobs_guard:
            job = self._job
            if job is not None and not job.done:
                job.removals.append(remove)
                return
            if job is not None and job.error is not None:
                return  # the last write failed: what it was to replace stays
        remove()

    @property
    def in_flight(self) -> bool:
        """Whether a write is running now."""
        job = self._job
        return job is not None and not job.done

    def wait(self) -> None:
        """Block until the write in flight (if any) has finished."""
        job = self._job
        if job is not None and job.thread is not None:
            job.thread.join()

    def finish(self) -> list[str]:
        """Wait for the write in flight; return the failures not yet reported (``"PATH: on rank R, CAUSE"``) and
        forget them."""
        self.wait()
        with self._jobs_guard:
            failures, self._failures = self._failures, []
        return failures

    def take_causes(self) -> list[BaseException]:
        """The exceptions behind the failures :meth:`finish` last returned on this rank (to chain them)."""
        with self._jobs_guard:
            causes, self._causes = self._causes, []
        return causes


class AsyncWrites:
    """The coordination of background checkpoint writes (``async_checkpoint=True``): which saves go to the
    background, the agreement of every rank on their outcome, and the gloo group of their collectives."""

    def __init__(self, writer: AsyncCheckpointWriter, timeout: Any) -> None:
        self.writer = writer
        self.timeout = timeout
        self.unsettled = False  # every rank: an async save was submitted since the last agreement
        self._write_group: Any = None  # a gloo group for the background writes' collectives (sharded layout)

    def submit(self, path: str, rank: int, write: Callable[[], None]) -> None:
        self.unsettled = True
        self.writer.rank = rank
        self.writer.submit(path, write)

    def settle(self, world_size: int) -> None:
        """Every rank, at a save and at the end of fit: wait for the write in flight, and raise
        :class:`~lightning_mgpu.CheckpointWriteError` on every rank if any rank's write failed."""
        if not self.unsettled:
            return
        self.unsettled = False
        failures = self.writer.finish()
        causes = self.writer.take_causes()
        if comm.group_is_up() and world_size > 1:
            # on the writes' gloo group where there is one (every rank's writer thread has ended on it): the pickles
            # stay on the CPU, where over NCCL they would wait for the kernels training queued
            gathered = comm.all_gather_object(failures, group=self._write_group)
            failures = [f for rank_failures in gathered for f in rank_failures]
        if failures:
            raise CheckpointWriteError(failure_message(failures)) from (causes[0] if causes else None)

    def group(self) -> Any:
        """A gloo group of all ranks for the collectives of background writes: they must not interleave with
        the training thread's collectives on the default group (torch's advice for ``dcp.async_save``). Made on
        every rank at the first asynchronous sharded save (a collective)."""
        if self._write_group is None:
            self._write_group = comm.new_group(backend="gloo", timeout=self.timeout)
        return self._write_group

    def end(self) -> None:
        """Teardown: wait for the last write (an error not raised yet, e.g. after another exception, is logged)
        and leave the checkpoint group."""
        for failure in self.writer.finish():
            log.error(f"The background write of {failure}")
        self.writer.take_causes()
        self.unsettled = False
        group, self._write_group = self._write_group, None
        if group is not None:
            comm.destroy_group(group, quiet=True)


def _lower_priority() -> None:
    """Give the writer thread a lower CPU priority (nice +10) than training: where cores are scarce the step keeps
    its CPU time and the write takes what is left. Linux applies ``setpriority`` to one thread when given its
    thread id (setpriority(2), "a bug" in POSIX terms that Linux documents); elsewhere this does nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + 10, 19))
    except (AttributeError, OSError):  # pragma: no cover - no permission or no such call: keep the priority
        pass


def _copy_containers(obj: Any, memo: dict[int, Any]) -> Any:
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) in (dict,) else copy.copy(obj)
        for k, v in obj.items():
            out[k] = _copy_containers(v, memo)
        return out
    if isinstance(obj, list):
        return [_copy_containers(v, memo) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_copy_containers(v, memo) for v in obj)
    return obj


def describe_error(error: BaseException, rank: int) -> str:
    """``"on rank R, TYPE: MESSAGE"``; a ``torch.distributed.checkpoint`` failure names the ranks where it
    happened (its message is the remote tracebacks)."""
    per_rank = getattr(error, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
    if isinstance(per_rank, Mapping) and per_rank:
        parts = []
        for r, wrapped in sorted(per_rank.items()):
            inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
            parts.append(f"on rank {r}, {type(inner).__name__}: {inner}")
        return "; ".join(parts)
    return f"on rank {rank}, {type(error).__name__}: {error}"


def failure_message(failures: list[str]) -> str:
    """The error raised on every rank for ``failures`` (every rank's :meth:`AsyncCheckpointWriter.finish`, in rank
    order; a failure several ranks saw alike is named once)."""
    unique = list(dict.fromkeys(failures))
    lines = "\n".join(f"  - {f}" for f in unique)
    return (
        f"The background write of a checkpoint failed (async_checkpoint=True):\n{lines}\nThe training state is "
        f"untouched. A failed write replaces and removes no checkpoint: the one previously under that name, if "
        f"any, is still complete. Fix the cause (disk space, permissions, the path) and resume from the last "
        f"complete checkpoint, or save with async_checkpoint=False to see the error at the save itself."
    )
