"""Shared multi-process harness for the tests: tiny models, per-rank recorders, a single-process reference.

Workers hand results back as ``torch.save`` files (never through ``mp.Queue``: a tensor sent that way is gone once the
worker exits).
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning_fabric.plugins.environments.lightning import find_free_network_port
from pytorch_lightning.callbacks import Callback
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_mgpu import MGPUDDPStrategy, comm
from tests.models import RankData, Regressor, make_data  # noqa: F401  (re-exported for the tests)
from tests.scripts import session_members

WORLD = 2
#: "machines" x ranks per machine of :func:`run_on_two_machines`
NODES, PER_NODE = 2, 2
#: a job of :func:`run_on_two_machines`: one ``Trainer.fit`` per machine, writing its records under the path given
Job = Callable[[Path], None]


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor shard (FSDP2) is gathered from all ranks (a collective, the pack's own:
    ``comm.full_tensor`` gathers a 4-bit shard's packed pieces as FSDP2 does); a 4-bit weight (torchao's
    ``NF4Tensor``) dequantised to the dtype it was quantised from."""
    tensor = comm.full_tensor(tensor)
    return tensor.get_original_weight() if hasattr(tensor, "get_original_weight") else tensor


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([full(p.detach()).flatten().clone() for p in module.parameters()])


class AllReduceSpy:
    """Test-only instrument, independent of our ledger: wraps ``torch.distributed.all_reduce`` in this worker
    process and counts calls and payload bytes from any thread (torch's hooks look the function up on the
    module at call time; PowerSGD issues its later all-reduces from future callbacks on gloo threads, which
    torch.profiler on the training thread does not record)."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self._lock: Any = None  # created in the worker: a Trainer launched with spawn is pickled
        self._original: Any = None

    def __enter__(self) -> AllReduceSpy:
        import threading

        self._lock = threading.Lock()
        self._original = original = dist.all_reduce

        def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.calls += 1
                self.bytes += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)

        dist.all_reduce = spy
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_reduce = self._original
        self._lock = None


_BATCH_MARK = "mgpu_test_batch_"


def profiled_events(prof: torch.profiler.profile) -> list[tuple[str, int, int]]:
    """``(name, start ns, end ns)`` of every event a stopped CPU profile recorded, read from the profiler's raw
    results: ``prof.events()`` first parses them into a tree of FunctionEvents, which took about 4 s per fit of
    the tests that profile a whole fit, for nothing they read."""
    assert prof.profiler is not None and prof.profiler.kineto_results is not None, "the profile is not stopped"
    return [(e.name(), e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()]


def collectives_by_window(
    events: list[tuple[str, int, int]], windows: list[tuple[int, int]]
) -> tuple[list[dict[str, int]], dict[str, int]]:
    """The gloo collectives of :func:`profiled_events`, counted by name in the first ``(start, end)`` window in which
    each started; those that started in none are counted apart (the second result)."""
    inside: list[dict[str, int]] = [{} for _ in windows]
    outside: dict[str, int] = {}
    for name, begin, _ in events:
        if not name.startswith("gloo:"):
            continue
        hits = [i for i, (first, last) in enumerate(windows) if first <= begin <= last]
        counts = inside[hits[0]] if hits else outside
        counts[name] = counts.get(name, 0) + 1
    return inside, outside


class Recorder(Callback):
    """Writes, per rank, into ``out_dir/rank{r}.pt``: final weights, the comm ledger, per-batch
    ``gloo:all_reduce`` counts from torch.profiler and per-batch ``(calls, bytes)`` from an
    :class:`AllReduceSpy` (both independent of our ledger), and per-batch ledger ``(calls, bytes)``.
    With ``grads=True`` also the flat gradient after every micro-batch's backward."""

    def __init__(self, out_dir: Path, profile: bool = False, grads: bool = False) -> None:
        self.out_dir = Path(out_dir)
        self.profile = profile
        self.grads = grads
        self.batch_allreduces: list[int] = []
        self.batch_events: list[dict[str, int]] = []
        self.batch_ledger_calls: list[int] = []
        self.batch_ledger_bytes: list[int] = []
        self.batch_spy: list[tuple[int, int]] = []
        self._spy = AllReduceSpy()
        self._spy_before = (0, 0)
        self._bytes_before = 0
        self.batch_grads: list[torch.Tensor] = []
        self._prof: Optional[torch.profiler.profile] = None
        self._mark: Optional[Any] = None
        self._marked = 0
        self._calls_before = 0

    def _ledger(self, trainer: pl.Trainer) -> Any:
        return getattr(trainer.strategy, "comm_stats", None)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._spy.__enter__()
        if self.profile:
            # One profile over the whole fit, each batch a marked range; a collective belongs to the batch in which
            # it started. A profile per batch, stopped at the batch's end, lost now and then (torch 2.11, 5 of 9
            # runs) the event of an all-reduce whose work gloo's thread had completed but not yet closed.
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._prof.__enter__()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        ledger = self._ledger(trainer)
        self._calls_before = ledger.allreduce_calls if ledger is not None else 0
        self._bytes_before = ledger.allreduce_bytes if ledger is not None else 0
        self._spy_before = (self._spy.calls, self._spy.bytes)
        if self._prof is not None:
            self._mark = torch.autograd.profiler.record_function(f"{_BATCH_MARK}{self._marked}")
            self._mark.__enter__()
            self._marked += 1

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.grads:
            self.batch_grads.append(torch.cat([p.grad.detach().flatten().clone() for p in pl_module.parameters()]))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None
        ledger = self._ledger(trainer)
        if ledger is not None:
            self.batch_ledger_calls.append(ledger.allreduce_calls - self._calls_before)
            self.batch_ledger_bytes.append(ledger.allreduce_bytes - self._bytes_before)
        self.batch_spy.append((self._spy.calls - self._spy_before[0], self._spy.bytes - self._spy_before[1]))

    def _count_batch_events(self) -> None:
        """The gloo collectives of each marked batch, by the time each started (see ``on_train_start``)."""
        assert self._prof is not None
        self._prof.__exit__(None, None, None)
        events = profiled_events(self._prof)
        self._prof = None
        marks = {name: (start, end) for name, start, end in events if name.startswith(_BATCH_MARK)}
        self.batch_events, _ = collectives_by_window(events, [marks[f"{_BATCH_MARK}{i}"] for i in range(self._marked)])
        self.batch_allreduces = [b.get("gloo:all_reduce", 0) for b in self.batch_events]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._spy.__exit__(None, None, None)
        if self._prof is not None:
            self._count_batch_events()
        ledger = self._ledger(trainer)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # one gather per tensor under FSDP2: the weights are read from the state, not gathered again
        state = {k: full(v).detach().clone() for k, v in pl_module.state_dict().items()}
        torch.save(
            {
                "weights": torch.cat([state[name].flatten() for name, _ in pl_module.named_parameters()]),
                "state": state,
                "ledger": copy.deepcopy(ledger) if ledger is not None else None,
                "batch_allreduces": self.batch_allreduces,
                "batch_events": self.batch_events,
                "batch_ledger_calls": self.batch_ledger_calls,
                "batch_ledger": list(zip(self.batch_ledger_calls, self.batch_ledger_bytes)),
                "batch_spy": self.batch_spy,
                "batch_grads": self.batch_grads,
                "global_step": trainer.global_step,
            },
            self.out_dir / f"rank{trainer.global_rank}.pt",
        )


def load_ranks(out_dir: Path, world: int = WORLD) -> list[dict[str, Any]]:
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def fit(
    model: pl.LightningModule,
    strategy: Any,
    out_dir: Path,
    *,
    dataset: Optional[TensorDataset] = None,
    batch_size: int = 4,
    accumulate: int = 1,
    max_epochs: int = 2,
    devices: int = WORLD,
    profile: bool = False,
    grads: bool = False,
    callbacks: Optional[list[Callback]] = None,
    datamodule: Optional[pl.LightningDataModule] = None,
    **trainer_kwargs: Any,
) -> list[dict[str, Any]]:
    """Fit ``model`` on ``devices`` CPU processes with our own sampler (or on ``datamodule``'s loaders);
    returns each rank's record."""
    dataset = dataset if dataset is not None else make_data()
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": devices,
        "strategy": strategy,
        "max_epochs": max_epochs,
        "accumulate_grad_batches": accumulate,
        "use_distributed_sampler": False,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "callbacks": [Recorder(out_dir, profile=profile, grads=grads), *(callbacks or [])],
    }
    kwargs.update(trainer_kwargs)
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = pl.Trainer(**kwargs)
    datamodule = datamodule if datamodule is not None else RankData(dataset, batch_size)
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    return load_ranks(out_dir, devices)


def reference_weights(
    model: nn.Module, dataset: TensorDataset, global_batch: int, epochs: int, lr: float = 0.1
) -> torch.Tensor:
    """One process, plain torch: SGD+momentum on batches of ``global_batch`` in order, MSE loss."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loader = DataLoader(dataset, batch_size=global_batch, shuffle=False)
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            opt.step()
    return flat_params(model)


class AlwaysSyncDDP(MGPUDDPStrategy):
    """Negative control: a broken accumulation that all-reduces on every micro-batch."""

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        yield None


def _plain_ddp_worker(
    rank: int,
    model: nn.Module,
    dataset: TensorDataset,
    batch_size: int,
    epochs: int,
    hook_name: Optional[str],
    hook_state: Optional[dict[str, Any]],
    port: int,
    out: str,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    # under spawn, torch.multiprocessing hands both ranks the same shared-memory tensors: train a private copy
    model = copy.deepcopy(model)
    ddp = DDP(model)
    if hook_name == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook_name == "powersgd":
        ddp.register_comm_hook(powersgd.PowerSGDState(process_group=None, **(hook_state or {})), powersgd.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=model.lr, momentum=0.9)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=DistributedSampler(dataset, shuffle=False))
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            F.mse_loss(ddp(x), y).backward()
            opt.step()
    if rank == 0:
        torch.save(flat_params(model), out)
    # Drop DDP (its reducer holds work on the process group) before destroying the group: the other order
    # hung intermittently in the reducer's destructor, after this function's last line.
    del ddp, opt
    dist.barrier()
    dist.destroy_process_group()


def plain_ddp_weights(
    model: nn.Module,
    dataset: TensorDataset,
    batch_size: int,
    epochs: int,
    out_dir: Path,
    hook_name: Optional[str] = None,
    hook_state: Optional[dict[str, Any]] = None,
) -> torch.Tensor:
    """The same training as ``fit`` (k=1) in a hand-written torch DDP loop on 2 gloo processes, with the
    comm hook registered by hand: the reference our strategy must reproduce."""
    out = str(Path(out_dir) / "plain_ddp.pt")
    mp.start_processes(
        _plain_ddp_worker,
        nprocs=WORLD,
        start_method="fork",
        args=(copy.deepcopy(model), dataset, batch_size, epochs, hook_name, hook_state, find_free_network_port(), out),
    )
    return torch.load(out)


def run_sample_config(module: str, config: str, out_dir: Path, *overrides: str) -> str:
    """Run ``python -m lightning_mgpu.examples.<module> fit --config configs/<config> [overrides]`` as a user does,
    with logs under ``out_dir``; asserts exit 0 and returns its standard output."""
    import sys

    root = Path(__file__).resolve().parents[1]
    proc, _ = run_isolated(
        [
            sys.executable, "-m", f"lightning_mgpu.examples.{module}", "fit",
            "--config", str(root / "configs" / config),
            "--trainer.default_root_dir", str(out_dir), *overrides,
        ],
        timeout=300, cwd=out_dir,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def run_isolated(cmd: list[str], *, timeout: float, **kwargs: Any) -> tuple[Any, list[int]]:
    """``subprocess.run`` in a session of its own. Returns the completed process and the pids of its session
    still alive when it ended (what it left behind: the caller asserts on it); then, and also when it times
    out or the test fails, SIGKILLs the whole session, so no launched rank outlives the test."""
    import signal
    import subprocess

    proc = subprocess.Popen(
        cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
    )
    leftovers: list[int] = []
    try:
        out, err = proc.communicate(timeout=timeout)
        leftovers = session_members(proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), leftovers


def _node(node: int, jobs: list[Job], ports: list[int], out: str) -> None:
    torch.set_num_threads(1)
    for i, (job, port) in enumerate(zip(jobs, ports)):
        # what a cluster sets on each machine; Lightning's environment reads them, its fork launch starts the ranks
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(node))
        path = Path(out) / str(i)
        path.mkdir(exist_ok=True)
        try:
            job(path)
        except BaseException:
            (Path(out) / f"node{node}.err").write_text(f"job {i}:\n{traceback.format_exc()}")
            raise


def run_on_two_machines(jobs: list[Job]) -> list[list[dict[str, Any]]]:
    """Every job, one after the other, on 2 "machines" x 2 ranks: each machine is a forked process with
    ``NODE_RANK`` set (as a cluster sets it), whose job runs ``Trainer(num_nodes=2, devices=2)``; Lightning's
    environment reads it and the fork launch starts the machine's 2 ranks (global rank = node x 2 + local rank).
    Each job writes ``rank{r}.pt`` into the folder it is given; returns each job's 4 rank records."""
    with tempfile.TemporaryDirectory() as out:
        ports = [find_free_network_port() for _ in jobs]
        try:
            mp.start_processes(_node, nprocs=NODES, start_method="fork", args=(jobs, ports, out))
        except Exception as err:
            errors = sorted(Path(out).glob("*.err"))
            raise AssertionError("a machine failed:\n" + "\n".join(e.read_text() for e in errors)) from err
        return [
            [torch.load(Path(out) / str(i) / f"rank{r}.pt", weights_only=False) for r in range(NODES * PER_NODE)]
            for i in range(len(jobs))
        ]


# --- poisoned checkpoints: an entry whose unpickling runs code -----------------------------------------------


def leave_marker(path: str, value: Any = None) -> Any:
    """What a poisoned entry runs when unpickled: creates the file ``path`` (the test's proof that code ran), and
    returns ``value`` (so a load that ran it goes on as if nothing happened)."""
    Path(path).touch()
    return value


class Poison:
    """An object whose unpickling calls :func:`leave_marker` (as ``os.system`` would be called by a malicious one)."""

    def __init__(self, marker: Path, value: Any = None) -> None:
        self.marker = str(marker)
        self.value = value

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (leave_marker, (self.marker, self.value))

    def __deepcopy__(self, memo: dict[int, Any]) -> Poison:
        return self  # copied as it is (an async save's staging deep-copies the checkpoint), never run by a copy
