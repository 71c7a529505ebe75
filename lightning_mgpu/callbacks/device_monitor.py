"""DeviceMonitor: what every rank is doing, gathered to rank 0 with one collective per logging interval."""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Optional, Union

import psutil
import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_mgpu.callbacks._base import MGPUCallback
from lightning_mgpu.callbacks._timeline import (
    AFTER_BACKWARD,
    BEFORE_BACKWARD,
    COLUMNS,
    END,
    GRADS_READY,
    PREV_END,
    START,
    IntervalReport,
    analyze,
)
from lightning_mgpu.distributed import all_gather_rows

__all__ = ["DeviceMonitor"]

Stamp = Union[float, "torch.cuda.Event", None]
_HEADER = ("batches", "steps", "sync_exit", "mem_peak_mb", "mem_mb", "gpu_util", "gpu_mem_mb", "gpu_temp_c")
_MB = 2.0**20
_PROC_STATUS = "/proc/self/status"  # Linux: VmHWM, the peak RSS since the last reset
_PROC_CLEAR_REFS = "/proc/self/clear_refs"


class DeviceMonitor(MGPUCallback):
    """Per-rank step time, data wait, forward/backward/optimizer time, time waiting for other ranks, peak
    memory and (on NVIDIA GPUs with ``nvidia-ml-py``) utilization, for every rank, in any Lightning logger.

    Every ``every_n_steps`` optimizer steps each rank sends its timestamps and memory figures to rank 0 in
    **one** ``all_gather`` (nothing is communicated inside a step, and on GPU the timestamps are CUDA events
    read at the interval's end, so the step never waits for the device). Rank 0 logs, in ms per optimizer step:

    * ``device/rank{r}/step_ms`` = ``data_ms`` (waiting for the DataLoader) + ``forward_ms`` +
      ``backward_ms`` (until the last gradient is computed) + ``comm_ms`` (from there to the end of the
      backward: the gradient all-reduce's tail; measured on CPU, where a parameter hook gives the time the
      last gradient was ready; on GPU it is part of ``backward_ms``) + ``optimizer_ms``; ``wait_ms``: the
      part of those spent blocked in collectives for slower ranks; ``busy_ms`` = ``step_ms - wait_ms``,
      the rank's own work;
    * ``device/rank{r}/mem_peak_mb`` (CUDA allocator peak on GPU; on CPU the process's peak RSS, over the
      interval on Linux, since the process started elsewhere) and ``mem_mb`` (RSS through psutil);
      ``gpu_util`` (%), ``gpu_mem_mb`` (device memory in use, all processes) and ``gpu_temp_c`` (°C) from NVML
      when available;
    * ``device/imbalance/straggler_ratio`` (max/min ``busy_ms``), ``straggler_rank``, ``max_wait_ms`` and
      ``memory_ratio`` (max/min ``mem_peak_mb``),

    and warns when the straggler or memory ratio passes its threshold, saying whether the straggler is
    waiting for data or computing. How waiting is told apart from work: :mod:`lightning_mgpu.callbacks._timeline`.
    ``history`` holds the logged dicts on rank 0 (for notebooks; :mod:`lightning_mgpu.plot` reads the CSV).

    Example (with ``strategy="mgpu_ddp", devices=N`` each rank gets its ``rank{r}`` columns; any logger gets
    the same dicts, ``CSVLogger`` for :mod:`lightning_mgpu.plot`):

        >>> import pytorch_lightning as pl
        >>> from lightning_mgpu import DeviceMonitor
        >>> from lightning_mgpu.examples import DigitsCNN, DigitsDataModule
        >>> monitor = DeviceMonitor(every_n_steps=2)
        >>> trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, callbacks=[monitor], logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(DigitsCNN(), DigitsDataModule())
        >>> len(monitor.history)  # one row per interval of 2 optimizer steps
        2
        >>> sorted(k for k in monitor.history[-1] if k.startswith("device/rank0/"))  # doctest: +NORMALIZE_WHITESPACE
        ['device/rank0/backward_ms', 'device/rank0/busy_ms', 'device/rank0/comm_ms', 'device/rank0/data_ms',
         'device/rank0/forward_ms', 'device/rank0/mem_mb', 'device/rank0/mem_peak_mb', 'device/rank0/optimizer_ms',
         'device/rank0/step_ms', 'device/rank0/wait_ms']
    """

    def __init__(
        self,
        every_n_steps: Optional[int] = None,
        straggler_warn: float = 1.25,
        memory_warn: float = 1.25,
        nvml: Optional[bool] = None,
        prefix: str = "device",
    ) -> None:
        """
        Args:
            every_n_steps: optimizer steps per interval (one gather, one log line); default: the Trainer's
                ``log_every_n_steps``.
            straggler_warn: warn when the slowest rank's busy time exceeds the fastest's by this ratio.
            memory_warn: warn when the largest peak memory exceeds the smallest by this ratio.
            nvml: read GPU utilization and memory through NVML (``pip install nvidia-ml-py``); ``None``: when
                available on a CUDA device, ``True``: required, ``False``: never.
            prefix: metric name prefix.
        """
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1
        ):
            raise ValueError(
                f"DeviceMonitor(every_n_steps={every_n_steps!r}): an int >= 1, or None for log_every_n_steps."
            )
        for name, value in (("straggler_warn", straggler_warn), ("memory_warn", memory_warn)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1.0:
                raise ValueError(
                    f"DeviceMonitor({name}={value!r}): a ratio >= 1.0 (1.25 warns at 25 % imbalance; "
                    f"float('inf') never warns)."
                )
        if nvml is True and not _nvml_importable():
            raise ImportError("DeviceMonitor(nvml=True) needs NVML bindings: `pip install nvidia-ml-py`, or nvml=None.")
        if not isinstance(prefix, str) or not prefix or "/" in prefix:
            raise ValueError(f"DeviceMonitor(prefix={prefix!r}): a non-empty name without '/'.")
        self.every_n_steps = every_n_steps
        self.straggler_warn = float(straggler_warn)
        self.memory_warn = float(memory_warn)
        self.nvml = nvml
        self.prefix = prefix
        self.history: list[dict[str, float]] = []
        self.intervals = 0
        self._clock: Union[_CpuClock, _CudaClock] = _CpuClock()
        self._interval_batches = 1
        self._rows: list[list[Stamp]] = []
        self._stepped = 0
        self._last_end: Stamp = None
        self._sync_exit = math.nan
        self._warned: set[str] = set()
        self._nvml_ok = False
        self._grads_ready: Stamp = None
        self._hooks: list[Any] = []

    # ----------------------------------------------------------------------------------------------- setup
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # log_every_n_steps is set on the Trainer at runtime by Lightning's logger connector
        every = self.every_n_steps or max(int(getattr(trainer, "log_every_n_steps", 50)), 1)
        self._interval_batches = every * max(trainer.accumulate_grad_batches, 1)
        device = pl_module.device
        self._clock = _CudaClock(device) if device.type == "cuda" else _CpuClock()
        self._nvml_ok = device.type == "cuda" and self.nvml is not False and _nvml_importable()
        self._rows, self._stepped, self._last_end = [], 0, None
        self.intervals = 0
        # the clocks' common instant for the first interval (ranks leave a collective together): the only
        # collective outside the intervals, once per fit
        all_gather_rows(torch.zeros(1, dtype=torch.float64))
        self._sync_exit = time.perf_counter()
        self._clock.anchor()
        self._reset_peak(device)
        if isinstance(self._clock, _CpuClock):
            # the time the last gradient is computed, before DDP waits for its all-reduce: a few Python calls
            # per backward (on GPU the CPU-side time would not say when the device finished: not measured)
            for p in pl_module.parameters():
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, param: torch.Tensor) -> None:
        self._grads_ready = time.perf_counter()

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove_hooks()

    # -------------------------------------------------------------------------------------------- probes
    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        row: list[Stamp] = [None] * COLUMNS
        row[PREV_END] = self._last_end
        row[START] = self._clock.stamp()
        self._rows.append(row)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._rows and self._rows[-1][BEFORE_BACKWARD] is None and trainer.training:
            self._rows[-1][BEFORE_BACKWARD] = self._clock.stamp()
        self._grads_ready = None

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._rows and trainer.training:
            self._rows[-1][AFTER_BACKWARD] = self._clock.stamp()
            if self._grads_ready is not None:
                self._rows[-1][GRADS_READY] = self._grads_ready

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._stepped += 1

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self._rows:
            return
        self._rows[-1][END] = self._last_end = self._clock.stamp()
        if len(self._rows) >= self._interval_batches:
            self._flush(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._rows:  # the epoch's last, shorter interval (every rank has the same number of batches)
            self._flush(trainer, pl_module)
        self._last_end = None

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.training:  # the first batch's wait includes creating the epoch's DataLoader iterator
            self._last_end = self._clock.stamp()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_end = None  # the gap across validation is not a data wait

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.training:  # validation inside an epoch: the next batch's data wait starts here
            self._last_end = self._clock.stamp()

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self._last_end = None  # nor is the time spent writing a checkpoint

    # ------------------------------------------------------------------------------------ main process
    def results_for_main_process(self) -> dict[str, Any]:
        """After a spawn/fork fit, in rank 0's worker: what this callback in the main process gets
        (:meth:`restore_results_from_worker`); the strategy hands it back as Lightning hands back
        ``callback_metrics``.

        Example:

            >>> from lightning_mgpu import DeviceMonitor
            >>> worker, main = DeviceMonitor(), DeviceMonitor()
            >>> worker.history.append({"step": 2.0, "device/rank0/step_ms": 1.5}); worker.intervals = 1
            >>> main.restore_results_from_worker(worker.results_for_main_process())
            >>> main.history, main.intervals
            ([{'step': 2.0, 'device/rank0/step_ms': 1.5}], 1)
        """
        return {"history": [dict(row) for row in self.history], "intervals": self.intervals}

    def restore_results_from_worker(self, results: dict[str, Any]) -> None:
        """In the main process: rank 0's ``history`` and ``intervals`` (see :meth:`results_for_main_process`)."""
        self.history = list(results["history"])
        self.intervals = int(results["intervals"])

    # ---------------------------------------------------------------------------------------------- flush
    def _flush(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = pl_module.device
        rows = self._rows
        times = torch.tensor(
            [[math.nan if v is None else v for v in row] for row in self._clock.resolve(rows)], dtype=torch.float64
        )
        header = torch.tensor(
            [len(rows), self._stepped, self._sync_exit, *self._memory(device), *self._gpu(device)], dtype=torch.float64
        )
        local = torch.cat([header, times.flatten()])
        # (world, len): the interval's one collective; on GPU the copy back waits for it, so ranks leave together
        gathered = all_gather_rows(local).cpu()
        self._sync_exit = time.perf_counter()
        self._clock.anchor()
        self._rows, self._stepped = [], 0
        self._reset_peak(device)
        self._last_end = self._clock.stamp()  # the next batch's data wait starts after this flush
        self.intervals += 1
        if trainer.is_global_zero:
            self._report(trainer, gathered)

    def _report(self, trainer: pl.Trainer, gathered: torch.Tensor) -> None:
        world = gathered.shape[0]
        head = len(_HEADER)
        batches = gathered[:, 0]
        if not bool((batches == batches[0]).all()):
            rank_zero_warn(f"DeviceMonitor: ranks recorded different numbers of batches {batches.tolist()}; skipped.")
            return
        n = int(batches[0])
        times = gathered[:, head:].reshape(world, n, COLUMNS)
        if trainer.num_nodes > 1:
            # different hosts, different clocks: align them on the exit of the previous collective
            times = times - (gathered[:, 2] - gathered[0, 2]).view(world, 1, 1)
        report = analyze(times, steps=int(gathered[0, 1]))
        for i, name in enumerate(_HEADER[3:], start=3):
            report.extra[name] = gathered[:, i].tolist()
        metrics = report.metrics(self.prefix)
        self.history.append({"step": float(trainer.global_step), **metrics})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        self._warn_about(report, metrics)

    def _warn_about(self, report: IntervalReport, metrics: dict[str, float]) -> None:
        r, ratio = report.straggler_rank, report.straggler_ratio
        if ratio > self.straggler_warn and f"straggler{r}" not in self._warned:
            self._warned.add(f"straggler{r}")
            fast = min(range(len(report.busy_ms)), key=report.busy_ms.__getitem__)
            extra_data = report.data_ms[r] - report.data_ms[fast]
            extra = report.busy_ms[r] - report.busy_ms[fast]
            cause = (
                "most of it is waiting for data on that rank: more DataLoader workers (num_workers), "
                "pin_memory=True, or lighter preprocessing in its data path"
                if extra_data >= 0.5 * extra
                else "most of it is compute on that rank: uneven batch contents (sequence lengths), a slower or "
                "busier device, or work only that rank does"
            )
            rank_zero_warn(
                f"DeviceMonitor: rank {r} is a straggler: busy {report.busy_ms[r]:.1f} ms per step vs "
                f"{report.busy_ms[fast]:.1f} ms on rank {fast} (ratio {ratio:.2f} > straggler_warn="
                f"{self.straggler_warn}); the other ranks wait up to {max(report.wait_ms):.1f} ms per step for it. "
                f"Data wait {report.data_ms[r]:.1f} ms vs {report.data_ms[fast]:.1f} ms: {cause}."
            )
        mem_ratio = metrics.get(f"{self.prefix}/imbalance/memory_ratio", 1.0)
        if mem_ratio > self.memory_warn and "memory" not in self._warned:
            self._warned.add("memory")
            mem = report.extra["mem_peak_mb"]
            rank_zero_warn(
                f"DeviceMonitor: peak memory differs across ranks by {mem_ratio:.2f}x (> memory_warn="
                f"{self.memory_warn}): {', '.join(f'rank {i} {m:.0f} MB' for i, m in enumerate(mem))}. The "
                f"largest decides the batch size that fits; look for work done on one rank only (logging, "
                f"metrics, an output gathered to rank 0), as DataParallel does on its first GPU."
            )

    # -------------------------------------------------------------------------------------------- helpers
    @staticmethod
    def _reset_peak(device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        else:
            _reset_rss_peak()

    @staticmethod
    def _memory(device: torch.device) -> tuple[float, float]:
        if device.type == "cuda":
            return torch.cuda.max_memory_allocated(device) / _MB, torch.cuda.memory_allocated(device) / _MB
        # two reads of two /proc files: the RSS can grow by a page between them, so the peak is read second
        # and never reported below the current RSS
        current = _rss_mb()
        return max(_rss_peak_mb(), current), current

    def _gpu(self, device: torch.device) -> tuple[float, float, float]:
        if not self._nvml_ok:
            return math.nan, math.nan, math.nan
        try:
            return (
                float(torch.cuda.utilization(device)),
                torch.cuda.device_memory_used(device) / _MB,
                float(torch.cuda.temperature(device)),
            )
        except Exception as err:  # no driver access (containers), MIG: keep training, say it once
            self._nvml_ok = False
            if self.nvml:
                raise RuntimeError(f"DeviceMonitor(nvml=True): NVML query failed: {err}") from err
            rank_zero_warn(f"DeviceMonitor: NVML unavailable ({err}); GPU utilization is not logged.")
            return math.nan, math.nan, math.nan


class _CpuClock:
    """``time.perf_counter``: CLOCK_MONOTONIC on Linux, common to all processes of one host."""

    def stamp(self) -> float:
        return time.perf_counter()

    def anchor(self) -> None:
        pass

    def resolve(self, rows: list[list[Stamp]]) -> list[list[Stamp]]:
        return rows


class _CudaClock:
    """CUDA events on the current stream, converted to the host clock through an anchor event recorded
    right after a collective (at the interval's end, where reading them may wait for the device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._anchor: Any = None
        self._anchor_cpu = 0.0

    def stamp(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def anchor(self) -> None:
        torch.cuda.synchronize(self.device)
        self._anchor = self.stamp()
        self._anchor.synchronize()
        self._anchor_cpu = time.perf_counter()

    def resolve(self, rows: list[list[Stamp]]) -> list[list[Stamp]]:
        torch.cuda.synchronize(self.device)
        base, anchor = self._anchor_cpu, self._anchor

        def seconds(v: Stamp) -> Stamp:
            return v if v is None or isinstance(v, float) else base + anchor.elapsed_time(v) / 1e3

        return [[seconds(v) for v in row] for row in rows]


def _nvml_importable() -> bool:
    try:
        import pynvml  # noqa: F401  (nvidia-ml-py; torch.cuda.utilization uses it)
    except ImportError:
        return False
    return True


def _rss_mb() -> float:
    """Current RSS of this process (psutil; on Linux it reads ``/proc/self/statm`` as we used to)."""
    try:
        # a fresh Process each call, never a cached one: ranks are forked from the launching process, and a
        # Process made before the fork would go on reading the parent's pid
        return psutil.Process().memory_info().rss / _MB
    except (psutil.Error, OSError):
        return math.nan


# Peak RSS: psutil has no resettable peak. Its only peak field is Windows' ``peak_wset`` (since the process
# started); on Linux ``memory_info()`` has no peak at all (psutil 7.2: rss, vms, shared, text, lib, data, dirty).
# The monitor logs the peak *per interval* (the memory_ratio compares ranks interval by interval), so on Linux
# it keeps reading VmHWM from /proc/self/status and resetting it by writing 5 to /proc/self/clear_refs (proc(5)),
# which no library wraps. Elsewhere the peak is the process's peak since it started (not reset per interval).


def _rss_peak_mb() -> float:
    """Peak RSS since the last reset (Linux VmHWM), else since the process started (Windows ``peak_wset``
    through psutil, other POSIX ``getrusage``)."""
    try:
        with open(_PROC_STATUS) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    try:
        peak = getattr(psutil.Process().memory_info(), "peak_wset", None)  # Windows only
    except (psutil.Error, OSError):
        peak = None
    if peak is not None:
        return peak / _MB
    try:
        import resource

        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, OSError):
        return math.nan
    # ru_maxrss is in bytes on macOS, in KiB on Linux and the BSDs (getrusage(2) of each)
    return maxrss / _MB if sys.platform == "darwin" else maxrss / 1024.0


def _reset_rss_peak() -> None:
    try:  # Linux: writing 5 to clear_refs resets VmHWM to the current RSS (proc(5)); no psutil equivalent
        with open(_PROC_CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        pass
