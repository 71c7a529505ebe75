"""Joining the process group without a silent wait: every rank registers on rank 0's store, and when ranks stay
missing, each waiting process names them, says what it expected and how to start them, and ends with an error.

torch's own start-up (``init_process_group`` on ``env://``, which Lightning calls) waits for the missing ranks for
the whole collective timeout (30 minutes by default) and says nothing: a ``num_nodes=2`` job started on one
machine, a second node never started, or a wrong ``devices`` / ``num_nodes`` look like a hang. Here each rank

1. connects to the store at the cluster environment's ``MASTER_ADDR:MASTER_PORT`` (rank 0 hosts it, as torch's
   ``env://`` does): a port another process holds is named at once, a rank 0 that cannot be reached is named
   after the join timeout;
2. registers its rank, then waits for the others. When no further rank has joined for
   ``LIGHTNING_MGPU_JOIN_TIMEOUT`` seconds (default :data:`DEFAULT_JOIN_TIMEOUT_S`), it raises
   :class:`RanksMissing` naming the missing ranks and nodes, the world it expected (``num_nodes`` x processes
   per node) and the torchrun / SLURM / plain lines that start them. Rank 0 posts what it saw, so every rank
   reports the same missing ranks and ends at the same time;
3. initialises the default process group on that store with the strategy's own ``timeout`` for collectives.

The timeout counts from the last rank that joined, so a slow start (many processes importing torch on a busy
machine) is not a failure as long as ranks keep arriving. :func:`announce_nodes` says, before any process
waits, that a ``num_nodes > 1`` run has no cluster environment to join.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning_fabric.utilities.distributed import log as fabric_log
from lightning_fabric.utilities.rank_zero import rank_zero_info

from lightning_mgpu import _compat
from lightning_mgpu.comm import group_is_up

__all__ = [
    "DEFAULT_JOIN_TIMEOUT_S",
    "JOIN_TIMEOUT_ENV",
    "RanksMissing",
    "announce_nodes",
    "join_process_group",
    "join_strategy_group",
    "join_timeout_s",
]

#: the environment variable that sets the join timeout, in seconds
JOIN_TIMEOUT_ENV = "LIGHTNING_MGPU_JOIN_TIMEOUT"
#: the default join timeout: seconds without a further rank joining before every waiting rank gives up
DEFAULT_JOIN_TIMEOUT_S = 30.0
_POLL_S = 0.2
_JOINS = [0]  # process groups this process has joined: each join gets its own keys on a store that outlives it


class RanksMissing(RuntimeError):
    """Not every rank joined the process group within the join timeout, or rank 0's store was unreachable or its
    port taken. The message names the ranks, what was expected and how to start them."""


def join_timeout_s() -> float:
    """``LIGHTNING_MGPU_JOIN_TIMEOUT`` in seconds (a positive number), else :data:`DEFAULT_JOIN_TIMEOUT_S`."""
    raw = os.environ.get(JOIN_TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_JOIN_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(
            f"{JOIN_TIMEOUT_ENV}={raw!r}: the join timeout is a number of seconds > 0, e.g. "
            f"{JOIN_TIMEOUT_ENV}=120 (default {DEFAULT_JOIN_TIMEOUT_S:g})."
        )
    return value


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    start = prev = None
    for r in sorted(ranks):
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = r
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(out)


def _command() -> str:
    """The command this process runs, as the user would type it (``python -m module`` kept as such)."""
    argv = list(sys.argv)
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and getattr(spec, "name", None):
        name = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return " ".join(["python", "-m", name, *map(shlex.quote, argv[1:])])
    return " ".join(["python", *map(shlex.quote, argv)])


def _torchrun_script() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    argv = list(sys.argv)
    if spec is not None and getattr(spec, "name", None):
        name = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return " ".join(["-m", name, *map(shlex.quote, argv[1:])])
    return " ".join(map(shlex.quote, argv))


def launch_lines(address: str, port: int, num_nodes: int, per_node: int, nodes: list[int]) -> str:
    """How to start ``nodes`` of a ``num_nodes`` x ``per_node`` job whose rank 0 listens at ``address:port``."""
    loopback = address in ("127.0.0.1", "localhost", "::1")
    addr = "<this machine's address>" if loopback and num_nodes > 1 else address
    lines = []
    for node in nodes[:4]:
        lines.append(f"  node {node}: MASTER_ADDR={addr} MASTER_PORT={port} NODE_RANK={node} {_command()}")
    if len(nodes) > 4:
        lines.append(f"  (and so on for nodes {_ranges(nodes[4:])})")
    lines.append(
        f"  or with torchrun, on every node: torchrun --nnodes {num_nodes} --nproc-per-node {per_node} "
        f"--node-rank <node> --master-addr {addr} --master-port {port} {_torchrun_script()}"
    )
    lines.append(f"  or under SLURM: srun --nodes {num_nodes} --ntasks-per-node {per_node} {_command()}")
    text = "\n".join(lines)
    if loopback and num_nodes > 1:
        text += (
            f"\n  (MASTER_ADDR is {address}, this machine only: set MASTER_ADDR to an address the other machines "
            f"reach, on every node)"
        )
    return text


def _world_text(world_size: int, num_nodes: int, per_node: int) -> str:
    return f"{world_size} ranks = num_nodes={num_nodes} x {per_node} process(es) per node"


def _missing_text(missing: list[int], per_node: int) -> tuple[str, list[int]]:
    by_node: dict[int, list[int]] = {}
    for r in missing:
        by_node.setdefault(r // per_node, []).append(r)
    whole = [n for n, ranks in by_node.items() if len(ranks) == per_node]
    parts = []
    for node, ranks in sorted(by_node.items()):
        parts.append(f"node {node} (rank{'s' if len(ranks) > 1 else ''} {_ranges(ranks)})")
    return ", ".join(parts), sorted(whole) or sorted(by_node)


def _timeout_advice(timeout_s: float) -> str:
    return f"To wait longer for slow starts, set {JOIN_TIMEOUT_ENV} (seconds; now {timeout_s:g})."


def _missing_error(
    rank: int,
    world_size: int,
    num_nodes: int,
    per_node: int,
    address: str,
    port: int,
    missing: list[int],
    timeout_s: float,
    seen_by: str,
) -> RanksMissing:
    described, nodes = _missing_text(missing, per_node)
    joined = sorted(set(range(world_size)) - set(missing))
    return RanksMissing(
        f"lightning-mgpu: rank {rank} of {world_size} stops waiting: ranks missing after {timeout_s:g} s without "
        f"another rank joining ({seen_by}): {described}. Expected {_world_text(world_size, num_nodes, per_node)}, "
        f"at rank 0's store {address}:{port}; joined: ranks {_ranges(joined) or 'none'}.\n"
        f"Start the missing processes with the same num_nodes and devices:\n"
        f"{launch_lines(address, port, num_nodes, per_node, nodes)}\n"
        f"If this job is meant to have fewer nodes or processes, set Trainer(num_nodes=..., devices=...) to match. "
        f"{_timeout_advice(timeout_s)}"
    )


def _connect(
    rank: int, world_size: int, num_nodes: int, per_node: int, address: str, port: int, timeout_s: float
) -> Any:
    wait = timedelta(seconds=timeout_s)
    if rank == 0:
        try:
            return dist.TCPStore(
                address, port, world_size, is_master=True, timeout=wait, wait_for_workers=False, multi_tenant=True
            )
        except Exception as error:  # torch's DistNetworkError; re-raised with the fix
            text = str(error)
            if "EADDRINUSE" in text or "address already in use" in text.lower():
                raise RanksMissing(
                    f"lightning-mgpu: rank 0 cannot listen on port {port}: another process holds it (another job, "
                    f"or an earlier run still ending). Choose a free port on every node, e.g. MASTER_PORT="
                    f"{port + 1} (a plain `python train.py` on one machine without MASTER_PORT picks a free one). "
                    f"[{text.splitlines()[0] if text else type(error).__name__}]"
                ) from error
            raise
    try:
        return dist.TCPStore(address, port, world_size, is_master=False, timeout=wait)
    except Exception as error:  # a timeout or refused connection, re-raised with what to do
        raise RanksMissing(
            f"lightning-mgpu: rank {rank} of {world_size} stops waiting: rank 0 (node 0) did not answer at "
            f"{address}:{port} within {timeout_s:g} s. Expected {_world_text(world_size, num_nodes, per_node)}; "
            f"rank 0 hosts the store. Start node 0, or give every node the same MASTER_ADDR (node 0's address) and "
            f"MASTER_PORT:\n{launch_lines(address, port, num_nodes, per_node, [0])}\n{_timeout_advice(timeout_s)} "
            f"[{str(error).splitlines()[0] if str(error) else type(error).__name__}]"
        ) from error


def _wait_for_all(store: Any, rank: int, world_size: int, timeout_s: float) -> Optional[tuple[list[int], str]]:
    """Register ``rank`` and wait until every rank has, or no rank joined for ``timeout_s``. ``None`` when all
    joined, else (the missing ranks, who saw them missing)."""
    store.set(f"rank/{rank}", socket.gethostname())
    count = store.add("count", 1)
    last_change = time.monotonic()
    while count < world_size:
        if rank != 0 and store.check(["verdict"]):
            return json.loads(store.get("verdict").decode()), "as rank 0 saw it"
        if time.monotonic() - last_change > timeout_s:
            missing = [r for r in range(world_size) if not store.check([f"rank/{r}"])]
            if rank == 0:
                store.set("verdict", json.dumps(missing))
            return missing, f"as rank {rank} saw it"
        time.sleep(_POLL_S)
        now = store.add("count", 0)
        if now != count:
            count, last_change = now, time.monotonic()
    return None


def join_process_group(
    *,
    address: str,
    port: int,
    rank: int,
    world_size: int,
    num_nodes: int,
    backend: str,
    timeout: Optional[timedelta],
    device_id: Optional[torch.device] = None,
) -> None:
    """Initialise the default process group once every one of ``world_size`` ranks has joined rank 0's store at
    ``address:port``; raise :class:`RanksMissing` (naming them and how to start them) when some do not join within
    :func:`join_timeout_s` of the last one that did. ``timeout`` is the collectives' timeout afterwards."""
    timeout_s = join_timeout_s()
    # Lightning's own lines (lightning_fabric's _init_dist_connection), which this join replaces
    fabric_log.info(f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world_size}")
    per_node = max(1, world_size // max(1, num_nodes))
    store = _connect(rank, world_size, num_nodes, per_node, address, port, timeout_s)
    _JOINS[0] += 1
    joined = dist.PrefixStore(f"/lightning_mgpu/join_{_JOINS[0]}", store)
    try:
        outcome = _wait_for_all(joined, rank, world_size, timeout_s)
    except RanksMissing:
        raise
    except Exception as error:  # rank 0's store went away while this rank waited
        raise RanksMissing(
            f"lightning-mgpu: rank {rank} of {world_size} stops waiting: rank 0's store at {address}:{port} closed "
            f"before every rank joined (rank 0 ended, e.g. after its own join timeout: see its message). Expected "
            f"{_world_text(world_size, num_nodes, per_node)}. [{str(error).splitlines()[0] if str(error) else ''}]"
        ) from error
    if outcome is not None:
        missing, seen_by = outcome
        raise _missing_error(rank, world_size, num_nodes, per_node, address, port, missing, timeout_s, seen_by)
    if timeout is not None:
        store.set_timeout(timeout)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)  # as Lightning's own set-up does
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"/lightning_mgpu/group_{_JOINS[0]}", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device_id,
    )
    rank_zero_info(
        f"{'-' * 100}\ndistributed_backend={backend}\n"
        f"All distributed processes registered. Starting with {world_size} processes\n{'-' * 100}\n"
    )


def join_strategy_group(
    strategy: Any, set_world_ranks: Callable[[], None], backend: Callable[[], str], timeout: Any, num_nodes: int
) -> None:
    """In every rank, at a strategy's set-up, unless the default group is up already: when torchrun restarted this job
    (``_compat.torchelastic_shares_its_store``), Lightning's init would use env:// on the agent's store, which keeps
    the previous attempt's addresses, so join with a per-attempt prefix; else, outside torchrun's agent store, the
    bounded join of :func:`join_process_group` (under the agent store the agents have gathered every node before the
    workers start). Lightning's ``setup_distributed`` then finds the group initialised and only sets the ranks and
    seed. ``strategy``: Lightning's (ranks, root device, cluster environment); ``set_world_ranks``: its own;
    ``backend()``: the group's backend; ``timeout``: the collectives'."""
    if group_is_up():
        return

    def device_id() -> Optional[torch.device]:
        return strategy.root_device if strategy.root_device.type != "cpu" else None  # as Lightning does

    if _compat.torchelastic_shares_its_store():
        set_world_ranks()
        dist.init_process_group(
            backend(),
            store=_compat.elastic_attempt_store(timeout),
            rank=strategy.global_rank,
            world_size=strategy.world_size,
            timeout=timeout,
            device_id=device_id(),
        )
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        set_world_ranks()
        if strategy.world_size > 1 and strategy.cluster_environment is not None:
            join_process_group(
                address=strategy.cluster_environment.main_address,
                port=strategy.cluster_environment.main_port,
                rank=strategy.global_rank,
                world_size=strategy.world_size,
                num_nodes=num_nodes,
                backend=backend(),
                timeout=timeout,
                device_id=device_id(),
            )


def announce_nodes(environment: Any, num_nodes: int, per_node: int) -> Optional[str]:
    """Before any process waits: a ``num_nodes > 1`` run on Lightning's default environment (no torchrun, SLURM or
    other cluster variables) and without ``NODE_RANK`` starts node 0 here and waits for the others, which only a
    launch on the other machines starts. Returns the message printed (``None`` when there is nothing to say)."""
    from lightning_fabric.plugins.environments import LightningEnvironment

    if num_nodes <= 1 or type(environment) is not LightningEnvironment or "NODE_RANK" in os.environ:
        return None
    if environment.creates_processes_externally:
        return None
    address, port = environment.main_address, environment.main_port
    nodes = list(range(1, num_nodes))
    text = (
        f"lightning-mgpu: num_nodes={num_nodes} but no cluster environment to join (no torchrun, SLURM or NODE_RANK "
        f"variables): this machine starts node 0 ({per_node} process(es), ranks 0-{per_node - 1}) and waits for "
        f"node{'s' if len(nodes) > 1 else ''} {_ranges(nodes)} at {address}:{port}, at most {join_timeout_s():g} s "
        f"after the last rank joins ({JOIN_TIMEOUT_ENV}). Start the other nodes:\n"
        f"{launch_lines(address, port, num_nodes, per_node, nodes)}\n"
        f"For one machine, set num_nodes=1."
    )
    print(text, file=sys.stderr, flush=True)
    return text
