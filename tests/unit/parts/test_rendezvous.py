"""The bounded join (parts/rendezvous.py) in one process: a rank alone names the ones missing, a port in use and an
unreachable rank 0 are named, the timeout is read from the environment, and the launch lines are the user's own."""

from __future__ import annotations

import socket
import sys
import time

import pytest
import torch.distributed as dist
from lightning_fabric.plugins.environments import LightningEnvironment
from lightning_fabric.plugins.environments.lightning import find_free_network_port

from lightning_mgpu.parts import rendezvous
from lightning_mgpu.parts.rendezvous import JOIN_TIMEOUT_ENV, RanksMissing, join_process_group, join_timeout_s


def _join(rank: int, port: int, world_size: int = 2, num_nodes: int = 1) -> None:
    join_process_group(
        address="127.0.0.1", port=port, rank=rank, world_size=world_size, num_nodes=num_nodes, backend="gloo",
        timeout=None,
    )  # fmt: skip


@pytest.mark.timeout(60)
def test_rank_zero_alone_names_the_missing_ranks_and_how_to_start_them(monkeypatch):
    monkeypatch.setenv(JOIN_TIMEOUT_ENV, "1")
    start = time.monotonic()
    with pytest.raises(RanksMissing) as error:
        _join(0, find_free_network_port(), world_size=4, num_nodes=2)
    text = str(error.value)
    assert time.monotonic() - start < 30  # bounded by the join timeout, not by the collectives' 30 minutes
    assert "rank 0 of 4 stops waiting" in text
    assert "node 0 (rank 1), node 1 (ranks 2-3)" in text
    assert "Expected 4 ranks = num_nodes=2 x 2 process(es) per node" in text
    assert "joined: ranks 0." in text
    assert "NODE_RANK=1" in text and "torchrun --nnodes 2 --nproc-per-node 2" in text and "srun --nodes 2" in text
    assert f"{JOIN_TIMEOUT_ENV} (seconds; now 1)" in text
    assert not dist.is_initialized()


@pytest.mark.timeout(60)
def test_a_port_in_use_is_named_at_once(monkeypatch):
    monkeypatch.setenv(JOIN_TIMEOUT_ENV, "20")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(RanksMissing, match=f"rank 0 cannot listen on port {port}: another process holds it"):
            _join(0, port)
        assert time.monotonic() - start < 10  # at once, not after the join timeout


@pytest.mark.timeout(60)
def test_a_rank_that_cannot_reach_rank_zero_says_so(monkeypatch):
    monkeypatch.setenv(JOIN_TIMEOUT_ENV, "1")
    port = find_free_network_port()
    expected = rf"rank 1 of 2 stops waiting: rank 0 \(node 0\) did not answer at 127.0.0.1:{port}"
    with pytest.raises(RanksMissing, match=expected):
        _join(1, port)


def test_join_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(JOIN_TIMEOUT_ENV, raising=False)
    assert join_timeout_s() == rendezvous.DEFAULT_JOIN_TIMEOUT_S == 30.0
    monkeypatch.setenv(JOIN_TIMEOUT_ENV, "2.5")
    assert join_timeout_s() == 2.5
    for bad in ("0", "-1", "soon", "inf"):
        monkeypatch.setenv(JOIN_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=f"{JOIN_TIMEOUT_ENV}='{bad}': the join timeout is a number of seconds"):
            join_timeout_s()


def test_num_nodes_without_a_cluster_environment_is_announced(monkeypatch, capsys):
    monkeypatch.delenv("NODE_RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29555")
    monkeypatch.setattr(sys, "argv", ["train.py", "--epochs", "2"])
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", None)  # `python train.py`, not `python -m`
    text = rendezvous.announce_nodes(LightningEnvironment(), num_nodes=2, per_node=3)
    assert text is not None and text in capsys.readouterr().err
    assert text.startswith("lightning-mgpu: num_nodes=2 but no cluster environment to join")
    assert "node 0 (3 process(es), ranks 0-2) and waits for node 1 at 127.0.0.1:29555" in text
    assert "NODE_RANK=1 python train.py --epochs 2" in text
    monkeypatch.setenv("NODE_RANK", "0")  # a cluster (or the user) names the node: nothing to say
    assert rendezvous.announce_nodes(LightningEnvironment(), num_nodes=2, per_node=3) is None
    monkeypatch.delenv("NODE_RANK")
    assert rendezvous.announce_nodes(LightningEnvironment(), num_nodes=1, per_node=3) is None
