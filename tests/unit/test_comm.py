"""comm.py: the one home of the pack's collectives, and the device each backend gets."""

from __future__ import annotations

import ast
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_mgpu import comm
from lightning_mgpu.ledger import CommStats
from lightning_mgpu.parts.clipping import GlobalNormClipping
from lightning_mgpu.parts.nonfinite import NonFiniteCheck
from lightning_mgpu.parts.token_loss import TokenNormalization
from tests.parts_harness import in_one_rank_group

# ----------------------------------------------------------------------------------------------------
# lightning_mgpu/comm.py is the one home of the pack's collectives: no other module calls a ``torch.distributed``
# collective, each buffer goes to the device the group's backend needs (CUDA under NCCL, the CPU under gloo, the
# tensor's own device in a mixed group that takes it), and the parts that all-reduce small tensors (token loss,
# non-finite check, clipping) build them there. No GPU is needed: the backend's name is mocked.

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_mgpu"
HOME = PACKAGE / "comm.py"

#: torch.distributed's collectives (and group creation, which every rank must call together)
COLLECTIVES = frozenset(
    {
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_reduce",
        "all_reduce_coalesced",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "batch_isend_irecv",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "irecv",
        "isend",
        "monitored_barrier",
        "new_group",
        "new_subgroups",
        "recv",
        "recv_object_list",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "send_object_list",
    }
)


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for a chain of attributes on a name, ``""`` otherwise."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def direct_collectives(source: str, filename: str = "<module>") -> list[str]:
    """Every call of a ``torch.distributed`` collective in ``source``: ``"file:line: name"``. Follows the names
    ``torch.distributed`` (and its submodules) is imported under, and collectives imported by name."""
    tree = ast.parse(source)
    modules: dict[str, str] = {"torch": "torch"}  # local name -> module it stands for
    functions: dict[str, str] = {}  # local name -> collective imported by name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    modules[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                local = alias.asname or alias.name
                if node.module.startswith("torch.distributed") and alias.name in COLLECTIVES:
                    functions[local] = alias.name
                else:
                    modules[local] = f"{node.module}.{alias.name}"
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = ""
        if isinstance(func, ast.Attribute) and func.attr in COLLECTIVES:
            owner = _dotted(func.value)
            head, _, rest = owner.partition(".")
            resolved = modules.get(head, head) + (f".{rest}" if rest else "")
            if resolved == "torch.distributed" or resolved.startswith("torch.distributed."):
                name = func.attr
        elif isinstance(func, ast.Name) and func.id in functions:
            name = functions[func.id]
        if name:
            found.append(f"{filename}:{node.lineno}: {name}")
    return found


def test_no_module_but_comm_calls_a_collective():
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != HOME
        for hit in direct_collectives(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    ]
    assert found == [], "call these through lightning_mgpu.comm:\n" + "\n".join(found)


def test_the_scanner_flags_each_way_of_calling_a_collective_directly():
    source = """
import torch
import torch.distributed as dist
from torch import nn
from torch import distributed as tdist
from torch.distributed import broadcast as bcast
import torch.distributed.distributed_c10d as c10d

def f(t, self, comm):
    dist.all_reduce(t)
    torch.distributed.barrier()
    tdist.new_group(backend="gloo")
    bcast(t, 0)
    c10d.all_gather_object([None], t)
    self.broadcast(t)            # a strategy's method: not a collective of torch.distributed
    comm.all_reduce(t)           # the home
    dist.get_world_size()        # not a collective
"""
    lines = [hit.split(": ")[1] for hit in direct_collectives(source)]
    assert lines == ["all_reduce", "barrier", "new_group", "broadcast", "all_gather_object"]


# ----------------------------------------------------------------------------------------------------------
# The device each backend gets


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Pretend a process group of the given backend is up; CUDA device 3 is current (no GPU needed)."""

    def use(name: str, cuda_available: bool = True) -> None:
        monkeypatch.setattr(comm, "group_is_up", lambda: True)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: name)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)

    return use


CPU, CUDA3 = torch.device("cpu"), torch.device("cuda", 3)


def _on(device: str) -> Any:
    """Something with a ``.device`` (all collective_device reads), on a device this machine may not have."""
    return SimpleNamespace(device=torch.device(device))


def test_nccl_gets_the_current_cuda_device(backend):
    backend("nccl")
    assert comm.collective_device() == CUDA3
    assert comm.collective_device(tensor=torch.zeros(1)) == CUDA3  # a CPU tensor is moved
    assert comm.collective_device(tensor=_on("cuda:1")) == torch.device("cuda", 1)  # a CUDA one stays


def test_gloo_gets_the_cpu(backend):
    backend("gloo")
    assert comm.collective_device() == CPU
    assert comm.collective_device(tensor=_on("cuda:1")) == CPU
    assert comm.collective_device(tensor=torch.zeros(1)) == CPU


def test_a_mixed_group_keeps_the_tensor_where_a_part_takes_it_and_prefers_cuda_otherwise(backend):
    backend("cpu:gloo,cuda:nccl")
    assert comm.backend_devices() == {"cpu": "gloo", "cuda": "nccl"}
    assert comm.collective_device(tensor=torch.zeros(1)) == CPU
    assert comm.collective_device(tensor=_on("cuda:1")) == torch.device("cuda", 1)
    assert comm.collective_device() == CUDA3
    backend("cpu:gloo,cuda:nccl", cuda_available=False)
    assert comm.collective_device() == CPU


def test_without_a_process_group_the_tensor_stays_where_it_is(monkeypatch):
    monkeypatch.setattr(comm, "group_is_up", lambda: False)
    assert comm.collective_device() == CPU
    assert comm.collective_device(tensor=_on("cuda:1")) == torch.device("cuda", 1)


def test_barrier_names_the_gpu_under_nccl_only(backend, monkeypatch):
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(dist, "barrier", lambda **kwargs: calls.append(kwargs))
    backend("nccl")
    comm.barrier()
    comm.barrier(device=torch.device("cuda", 1))
    backend("gloo")
    comm.barrier()
    assert calls == [{"group": None, "device_ids": [3]}, {"group": None, "device_ids": [1]}, {"group": None}]


def test_a_host_broadcast_reaches_every_reader_in_order_and_leaves_nothing_in_the_store():
    """Through a store and no tensor: rank 2, the source, sends two steps' objects before its 3 readers (threads,
    waiting before anything is sent) read; each reader gets both, in order (a host that is a step behind reads its
    own step's), and the store keeps nothing after."""
    import threading

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    ranks = [0, 1, 2, 3]
    got: dict[int, list[Any]] = {r: [] for r in ranks if r != 2}

    def read(rank: int) -> None:
        for _ in range(2):
            got[rank].append(comm.store_broadcast(store, None, 2, rank, ranks, "pipeline"))

    readers = [threading.Thread(target=read, args=(r,)) for r in got]
    for reader in readers:
        reader.start()
    steps = [(1, [("train_loss", {"prog_bar": True})]), (2, [("train_loss", {"prog_bar": True})])]
    for step in steps:
        assert comm.store_broadcast(store, step, 2, 2, ranks, "pipeline") is step
    for reader in readers:
        reader.join(30)
    assert got == {0: steps, 1: steps, 3: steps}
    assert [store.queue_len(f"pipeline/{r}") for r in ranks] == [0, 0, 0, 0]
    # a reader waits for its object (the store's timeout) rather than read something else
    store.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(Exception, match=r"(?i)timeout|wait"):
        comm.store_broadcast(store, None, 2, 0, ranks, "pipeline")


def test_a_buffer_off_the_collective_device_is_staged_and_copied_back():
    """A non-contiguous tensor goes through a contiguous copy; the result lands in the caller's tensor, in the
    synchronous and the asynchronous call, and the ledger counts each call's bytes."""

    def run() -> None:
        ledger = CommStats()
        t = torch.arange(6.0).reshape(2, 3).t()
        assert not t.is_contiguous()
        comm.all_reduce(t, ledger=ledger)
        torch.testing.assert_close(t, torch.arange(6.0).reshape(2, 3).t())
        work = comm.all_reduce(t, op=dist.ReduceOp.MAX, ledger=ledger, async_op=True)
        work.wait()
        torch.testing.assert_close(t, torch.arange(6.0).reshape(2, 3).t())
        assert (ledger.allreduce_calls, ledger.allreduce_bytes) == (2, 48)
        assert comm.all_gather(torch.ones(2)).shape == (1, 2)
        assert comm.all_gather_object({"a": 1}) == [{"a": 1}]
        assert comm.broadcast_object("x") == "x"
        assert comm.gather_object(5) == [5]
        torch.testing.assert_close(comm.lightning_reduce(torch.tensor([2.0, 4.0])), torch.tensor([2.0, 4.0]))

    in_one_rank_group(run)


# ----------------------------------------------------------------------------------------------------------
# The three parts that all-reduced CPU tensors whatever the backend (NCCL raises on a CPU tensor)


class _Reached(Exception):
    pass


@pytest.fixture
def nccl_collectives(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """A 2-rank NCCL group without a GPU: ``collective_device`` answers ``meta`` (standing in for CUDA, which
    this machine has not), and ``dist.all_reduce`` records the device of the tensor it is given, then stops."""
    seen: list[torch.device] = []

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        seen.append(tensor.device)
        raise _Reached

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    # raising=False: the same test runs (and fails) against a tree without the home
    monkeypatch.setattr(comm, "collective_device", lambda group=None, tensor=None: torch.device("meta"), raising=False)
    return seen


def test_token_normalization_all_reduces_on_the_collective_device(nccl_collectives):
    """loss_normalization="tokens" on GPUs: the token and loss totals reach NCCL on its device (before the
    home, a CPU float64 tensor: this test failed with ``[device(type='cpu')]``)."""
    tokens = TokenNormalization()
    tokens.add(5, 2.0)
    with pytest.raises(_Reached):
        tokens.rescale([], world_size=2, accumulate=1)
    assert nccl_collectives == [torch.device("meta")]


def test_nonfinite_check_all_reduces_on_the_collective_device(nccl_collectives):
    """nonfinite="error" on GPUs: the per-rank flags reach NCCL on its device (before the home, a CPU int64
    tensor: this test failed with ``[device(type='cpu')]``)."""
    with pytest.raises(_Reached):
        NonFiniteCheck().check([], rank=0, world_size=2, step=0)
    assert nccl_collectives == [torch.device("meta")]


def test_clipping_without_a_gradient_share_all_reduces_on_the_collective_device(nccl_collectives):
    """A rank holding no gradient shard still joins the norm's all-reduce, with its zero on NCCL's device
    (before the home, allocated on the CPU: this test failed with ``[device(type='cpu')]``)."""
    with pytest.raises(_Reached):
        GlobalNormClipping(lambda optimizer: []).total_norm([])
    assert nccl_collectives == [torch.device("meta")]


def test_clipping_with_a_share_on_another_device_is_staged_to_the_collective_device(nccl_collectives):
    with pytest.raises(_Reached):
        GlobalNormClipping(lambda optimizer: []).total_norm([torch.ones(3)])
    assert nccl_collectives == [torch.device("meta")]


def test_full_tensor_gathers_a_host_shard_on_its_meshs_device():
    """FSDP2's offloaded shards (``offload="cpu"``) are stored on the host while their mesh is CUDA's, and NCCL takes
    no host tensor: the shard goes to the mesh's device before the gather; one already there, or on a CPU mesh, is
    gathered where it is."""

    class Shard:
        def __init__(self, device: str, mesh: str = "cuda") -> None:
            self.device, self.device_mesh = torch.device(device), SimpleNamespace(device_type=mesh)

        def to(self, device: str) -> Shard:
            return Shard(device, self.device_mesh.device_type)

        def full_tensor(self) -> str:
            return f"gathered on {self.device.type}"

    assert comm.full_tensor(Shard("cpu")) == "gathered on cuda"
    assert comm.full_tensor(Shard("cuda")) == "gathered on cuda"
    assert comm.full_tensor(Shard("cpu", mesh="cpu")) == "gathered on cpu"
    plain = torch.ones(2)
    assert comm.full_tensor(plain) is plain


def test_a_4bit_shard_is_gathered_in_blocking_collectives_as_fsdp2_gathers_it(monkeypatch):
    """A ZeRO-3 (``Shard(0)``) or HSDP (``Replicate(), Shard(0)``) shard of torchao's ``NF4Tensor`` is gathered by
    ``comm.full_tensor`` through the subclass's FSDP2 all-gather extension: one blocking ``comm.all_gather`` per
    packed piece (bytes, scalers, their factors), the whole rebuilt bit for bit. ``DTensor.full_tensor`` would gather
    those pieces as functional collectives whose pending results the rebuild holds; on gloo that aborted the process
    with a corrupted heap about once in twenty 4-rank fits. A tensor without the extension is gathered the usual
    way, with no call to ``comm.all_gather``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from lightning_mgpu.quantization import dequantized, is_nf4, quantize_frozen

    gathered: list[torch.dtype] = []
    real = comm.all_gather
    monkeypatch.setattr(comm, "all_gather", lambda t, group=None: gathered.append(t.dtype) or real(t, group))

    def check() -> None:
        layer = nn.Linear(128, 128, bias=False).requires_grad_(False)
        quantize_frozen(layer)
        packed = layer.weight
        layouts = {
            "zero3": (init_device_mesh("cpu", (1,)), [Shard(0)]),
            "hsdp": (init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")), [Replicate(), Shard(0)]),
        }
        for mesh, placements in layouts.values():
            gathered.clear()
            whole = comm.full_tensor(DTensor.from_local(packed, mesh, placements, run_check=False))
            assert is_nf4(whole) and whole.shape == packed.shape
            assert gathered == [torch.int8, packed.quantization_factor.dtype, torch.uint8]
            torch.testing.assert_close(dequantized(whole), dequantized(packed), rtol=0, atol=0)
        gathered.clear()
        plain = torch.randn(4, 3)
        torch.testing.assert_close(comm.full_tensor(DTensor.from_local(plain, *layouts["zero3"])), plain)
        assert gathered == []

    in_one_rank_group(check)


def test_the_start_weights_are_broadcast_in_buckets_so_a_host_model_is_never_staged_whole(monkeypatch):
    """A model left on the host (``offload="cpu"``) is staged to NCCL's device for the start weights' broadcast: one
    bucket of at most ``START_WEIGHTS_BUCKET_BYTES`` at a time, each tensor whole in one bucket."""
    sizes: list[int] = []
    monkeypatch.setattr(comm, "group_is_up", lambda: True)
    monkeypatch.setattr(comm, "broadcast", lambda t, src=0: sizes.append(t.numel() * t.element_size()))
    monkeypatch.setattr(comm, "START_WEIGHTS_BUCKET_BYTES", 100)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # float32: 64, 16, 64 and 16 bytes
    assert comm.broadcast_start_weights(model) == 4
    assert sizes == [80, 80]


# ----------------------------------------------------------------------------------------------------
# The group is destroyed at exit whatever its backend: Lightning registers that for NCCL only, and a gloo group
# left to the interpreter's finalization can abort a process whose training ended (SIGABRT after the last line).

_EXIT_SCRIPT = """
import atexit, os, sys
import pytorch_lightning as pl
import torch.distributed as dist
from torch.utils.data import DataLoader
import lightning_mgpu
from tests.models import Regressor, make_data

# one interpreter imports once; each case is a child forked from it that runs one fit and exits as a script does
for case in sys.argv[1:]:
    strategy, mode = case.split(":")
    sys.stdout.flush()
    pid = os.fork()
    if pid:
        _, status = os.waitpid(pid, 0)
        print("EXIT", case, os.waitstatus_to_exitcode(status), flush=True)
        continue
    if mode == "control":  # the negative control: nothing registers the destruction
        lightning_mgpu.comm.leave_group_at_exit = lambda: None
    # registered after the imports' handlers, so it runs after every handler registered during fit
    atexit.register(lambda: print("AT_EXIT", case, "up" if dist.is_initialized() else "down", flush=True))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regressor().double(), DataLoader(make_data(n=8), batch_size=8))
    print("AFTER_FIT", case, "up" if dist.is_initialized() else "down", flush=True)
    sys.exit(0)  # the child ends here, through the interpreter's exit handlers
"""
#: test id -> (the script's case, the group's state in the last exit handler)
EXIT_CASES = {
    "mgpu_ddp": ("mgpu_ddp:pack", "down"),
    "mgpu_zero3": ("mgpu_zero3:pack", "down"),
    "control": ("mgpu_ddp:control", "up"),
}


@pytest.fixture(scope="module")
def exit_lines() -> list[str]:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, *(case for case, _ in EXIT_CASES.values())],
        cwd=PACKAGE.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if line.startswith(("AFTER_FIT", "AT_EXIT", "EXIT"))]


@pytest.mark.parametrize("name", list(EXIT_CASES))
def test_the_strategies_destroy_a_gloo_group_at_exit_and_not_before(exit_lines: list[str], name: str):
    case, at_exit = EXIT_CASES[name]
    lines = [line for line in exit_lines if line.split()[1] == case]
    # the group stays up after fit (a later trainer.test reuses it) and is down when the interpreter finishes
    assert lines == [f"AFTER_FIT {case} up", f"AT_EXIT {case} {at_exit}", f"EXIT {case} 0"], exit_lines


# ----------------------------------------------------------------------------------------------------
# Leaving the groups after a peer failed: never waiting out the collectives still queued on them.

GROUP_TIMEOUT_S = 30  # what a queued collective waits for a peer that never comes
LEFT_WITHIN_S = 10  # the rank must be past the line that drops its last reference well before that


def _rank_with_a_collective_queued(rank: int, port: int, leave: str, out: str) -> None:
    """Rank 1 queues an all-reduce that rank 0 never joins, holds the group as DDP's reducer does, leaves the groups
    (``leave``: the pack's ``abandon_groups``, or the plain destroy of the negative control), then drops its
    reference; it writes how long that took. Rank 0 sleeps until it is killed."""
    import time
    from datetime import timedelta

    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timeout)
    if rank == 0:
        time.sleep(3 * GROUP_TIMEOUT_S)
        return
    held = dist.group.WORLD
    queued = dist.all_reduce(torch.ones(4), async_op=True)  # kept, as a reducer keeps its work
    Path(out + ".queued").touch()
    start = time.monotonic()
    comm.abandon_groups() if leave == "abandon" else comm.destroy_group(quiet=True)
    del held, queued  # as Lightning's teardown drops the DDP wrapper
    Path(out).write_text(f"{time.monotonic() - start:.2f}")


def _seconds_to_leave(tmp_path: Path, leave: str) -> tuple[bool, float | None]:
    """Whether rank 1 queued its collective, and the seconds it took to leave (None: not done in time)."""
    import multiprocessing as mp

    from lightning_fabric.plugins.environments.lightning import find_free_network_port

    out = tmp_path / f"{leave}.txt"
    port = find_free_network_port()
    ranks = [
        mp.get_context("fork").Process(target=_rank_with_a_collective_queued, args=(r, port, leave, str(out)))
        for r in (0, 1)
    ]
    for p in ranks:
        p.start()
    ranks[1].join(LEFT_WITHIN_S)
    for p in ranks:
        p.kill()
        p.join()
    return Path(f"{out}.queued").exists(), float(out.read_text()) if out.exists() else None


def test_a_rank_leaves_its_groups_after_a_peer_failed_without_waiting_for_queued_collectives(tmp_path):
    """Freeing a gloo group waits for every collective still queued on it: after a peer failed, each waits out the
    group's timeout in whichever line drops the last reference (Lightning's teardown, unwrapping DDP), and under the
    popen launcher rank 0 killed such a rank before it could report. ``comm.abandon_groups`` (the failure path's way
    out) keeps the groups alive until the process ends, so that line passes at once."""
    queued, seconds = _seconds_to_leave(tmp_path, "abandon")
    assert queued and seconds is not None and seconds < LEFT_WITHIN_S


@pytest.mark.slow
def test_a_rank_that_destroys_its_groups_after_a_peer_failed_waits_for_queued_collectives_negative_control(tmp_path):
    """The plain destroy: the rank is still in the line that drops the group when its time is up (the wait is the
    test, hence the slow tier)."""
    assert _seconds_to_leave(tmp_path, "destroy") == (True, None)
