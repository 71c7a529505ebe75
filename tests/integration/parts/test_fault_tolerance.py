"""Fault-tolerant replica groups (``MGPUDDPStrategy(fault_tolerance=...)``, ``parts/fault_tolerance.py``; ZeRO-3 and
DiLoCo inside the groups too): a replica
group is SIGKILLed in the middle of a step, the other keeps committing steps without any process of its
restarting, the group is started again, heals from the survivor and joins; at the end both hold the same weights,
and those weights are the one-process replay of the committed steps (float64, torch's default tolerance).

Each group is its own launch of ``fault_tolerance_worker.py`` (a script as users write one), the lighthouse is
torchft's ``torchft_lighthouse`` command as the fault-tolerance guide starts it; group 0 imports Lightning as
``pytorch_lightning``, group 1 as ``lightning`` (``import lightning as L``), so one run proves both namespaces, and
that they train together.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_mgpu.parts.resume import ResumableDistributedSampler

pytest.importorskip("torchft", reason="the torchft extra is not installed in this environment")

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("fault_tolerance_worker.py")
DIE_AFTER = 4  # group 1 kills itself in the forward of its 5th batch
REJOIN_AT = 14  # group 0 holds after step 14 until group 1, started again, has joined the job
MAX_STEPS = 24
GROUP_SIZE = 2  # processes per replica group (DDP inside it)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(condition, timeout: float, what: str, procs) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        for p in procs:
            if p.poll() not in (None, 0, -signal.SIGKILL):
                raise AssertionError(f"a group failed (exit {p.returncode}): {p.args}")
        time.sleep(0.1)


def _replay(logs: dict[int, list[dict]], steps: int, drop_group: int | None = None) -> dict[str, torch.Tensor]:
    """One process, float64: the worker's model and optimizer; at each committed step, the gradient is the mean over
    the groups that committed it of each group's gradient, itself the mean over the group's ranks and their
    micro-batches of each batch-mean gradient (the rows each logged): accumulation and DDP (or ZeRO-3) inside a group,
    torchft's average across groups. A committed step's micro-batches are the window (of one process) whose last
    line moved the step; a dropped window's lines are left out. The learning rate decays with the committed steps."""
    torch.set_default_dtype(torch.float64)
    try:
        x, y = _data()
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.1 * step))
        for step in range(steps):
            groups: dict[int, list[list[list[int]]]] = {}
            for group, lines in sorted(logs.items()):
                ends = {(x["pid"], x["window"]) for x in lines if x["before"] == step and x["after"] == step + 1}
                ranks = [[x["rows"] for x in lines if (x["pid"], x["window"]) == end] for end in sorted(ends)]
                if ranks and group != drop_group:
                    groups[group] = ranks
            assert groups, f"no group committed step {step + 1}"
            opt.zero_grad()
            for ranks in groups.values():
                for micro in ranks:
                    for rows in micro:
                        loss = nn.functional.mse_loss(net(x[rows]), y[rows]) / (len(micro) * len(ranks) * len(groups))
                        loss.backward()
            opt.step()
            schedule.step()
        return {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()}
    finally:
        torch.set_default_dtype(torch.float32)


def _position(rows: list[int], replica: int) -> tuple[int, int]:
    """(epoch, batch) of ``rows`` in the share of Lightning's sampler (shuffled, seed 0) of ``replica`` out of
    ``2 x GROUP_SIZE``."""
    for epoch in range(8):  # 24 steps of 2 micro-batches: 6 epochs of 8 batches
        sampler = ResumableDistributedSampler(range(256), num_replicas=2 * GROUP_SIZE, rank=replica, seed=0)
        sampler.set_epoch(epoch)
        share = list(sampler)
        for batch in range(len(share) // 8):
            if share[batch * 8 : batch * 8 + 8] == rows:
                return epoch, batch
    raise AssertionError(f"rows {rows} are no batch of replica {replica}")


def _heal_continues_the_live_group(logs: dict[int, list[dict]], restarted: list[dict], live: int = 0) -> None:
    """What travelled with the heal besides the weights. The data position: at every step the restarted group
    trained the batch of its own share of the data at the epoch and batch where the live group was in its share
    (not the start of an epoch). The random state: in its first step the restarted group (started with another
    seed) drew what the live group's rank of the same number drew in that step."""
    group = 1 - live
    for rank in range(GROUP_SIZE):
        mine = [line for line in restarted if "rows" in line and line["rank"] == rank]
        for step in sorted({line["before"] for line in mine}):
            healed = [line for line in mine if line["before"] == step]
            theirs = [line for line in logs[live] if line.get("before") == step and line["rank"] == rank]
            theirs = theirs[-len(healed) :]  # a step dropped on the live group before it was taken again
            assert [_position(x["rows"], group * GROUP_SIZE + rank) for x in healed] == [
                _position(x["rows"], live * GROUP_SIZE + rank) for x in theirs
            ], (step, rank)
            if step == mine[0]["before"]:
                assert [x["draw"] for x in healed] == [x["draw"] for x in theirs], (rank, healed, theirs)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=g)
    return x, x @ torch.randn(4, 1, generator=g) + 0.1 * torch.randn(256, 1, generator=g)


class _Job:
    """The processes of one fault-tolerant job, each in a session of its own, its output in ``<n>.log``; every one
    still running at the end is SIGKILLed with its children."""

    def __init__(self, out: Path) -> None:
        self.out, self.procs, self.lighthouse_port = out, [], _free_port()

    def __enter__(self) -> _Job:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def start(self, *args: str, **env: str) -> subprocess.Popen:
        log = open(self.out / f"{len(self.procs)}.log", "w")
        proc = subprocess.Popen(
            list(args), cwd=self.out, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def output(self, proc: subprocess.Popen) -> str:
        return (self.out / f"{self.procs.index(proc)}.log").read_text()

    def outage(
        self, survivor: subprocess.Popen, doomed: subprocess.Popen, log: Path, lines: int, again: Any
    ) -> tuple[dict[int, list[dict]], dict[int, dict]]:
        """The outage: ``doomed`` ends (not cleanly), ``survivor`` logs ``lines`` lines into ``log`` without it,
        ``again()`` starts the group again; both groups end cleanly. Returns both groups' lines and end counts."""
        _wait(lambda: doomed.poll() is not None, 120, "the doomed group to end", self.procs)
        assert doomed.returncode != 0
        _wait(lambda: len(_lines(log)) >= lines, 90, "the survivor to go on alone", [survivor])
        restarted = again()
        for proc in (survivor, restarted):
            proc.wait(timeout=150)
            assert proc.returncode == 0, self.output(proc)[-4000:]
        logs = {g: _lines(self.out / f"group{g}.jsonl") for g in (0, 1)}
        return logs, {g: json.loads((self.out / f"end{g}.json").read_text()) for g in (0, 1)}

    def lighthouse(self, join_timeout_ms: int = 500) -> subprocess.Popen:
        """The guide's command; a dead group is dropped from the quorum after 1 s without its heartbeat, a live one
        that has not asked for the quorum after ``join_timeout_ms``."""
        command = shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable)) or "torchft_lighthouse"
        return self.start(command, "--min_replicas", "1", "--bind", f"[::]:{self.lighthouse_port}",
                          "--join_timeout_ms", str(join_timeout_ms), "--heartbeat_timeout_ms", "1000")  # fmt: skip

    def group(self, number: int, namespace: str, *extra: str) -> subprocess.Popen:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        address = f"http://127.0.0.1:{self.lighthouse_port}"
        args = (namespace, str(self.out), str(number), address, "--devices", str(GROUP_SIZE), *extra)
        return self.start(sys.executable, str(WORKER), *args, **env)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("inside", "accumulate", "dies_in"), [("ddp", 1, "training"), ("zero3", 2, "validation")])
def test_a_group_killed_mid_step_leaves_the_other_training_then_heals_and_both_equal_the_replay(
    tmp_path, inside, accumulate, dies_in
):
    """``inside``: each group's own layout, DDP (mgpu_ddp), or ZeRO-3 whose shards the groups replicate (HSDP with
    torchft as the replicate dimension: each rank heals its shard from the same rank of the live group), there with
    2 micro-batches per optimizer step (the quorum before the first, the commit after the last), validation every 4
    batches, and group 1 killed in the middle of a validation instead of a training step."""
    log0 = tmp_path / "group0.jsonl"
    with _Job(tmp_path) as job:
        job.lighthouse()
        # both start together; group 0 waits after step REJOIN_AT for group 1's second start
        # into one folder: written by the lowest group
        both = ("--strategy", inside, "--accumulate", str(accumulate), "--checkpoint-every", "4", "--validate")
        both = both[: -1 if dies_in == "training" else None]
        first = job.group(0, "pytorch_lightning", *both, "--wait", "started:0", "--wait", f"rejoined:{REJOIN_AT}")
        doomed = job.group(1, "lightning", *both, "--signal", "started", "--die-after", str(DIE_AFTER),
                           "--die-in", dies_in)  # fmt: skip
        # started again, with other initial weights than group 0's: only the heal can make them equal
        again = lambda: job.group(1, "lightning", *both, "--signal", "rejoined", "--seed", "7")  # noqa: E731
        logs, ends = job.outage(first, doomed, log0, REJOIN_AT, again)
    # the survivor: the same processes all along, kept committing while group 1 was gone (a quorum of itself)
    assert len({line["pid"] for line in logs[0]}) == GROUP_SIZE
    alone = {line["after"] for line in logs[0] if line["after"] > line["before"] and line["participants"] == 1}
    assert len(alone) >= REJOIN_AT - DIE_AFTER - 2, logs[0]  # the steps it committed while group 1 was gone
    # the restarted group healed: it started at the survivor's step, not at 0, and trained with it to the end
    first_pids = {line["pid"] for line in logs[1][: GROUP_SIZE * DIE_AFTER]}
    restarted = [line for line in logs[1] if line["pid"] not in first_pids]
    assert restarted[0]["before"] >= REJOIN_AT and ends[1]["heals"] >= 1 and ends[1]["heal_bytes"] > 0
    assert all(line["participants"] == 2 for line in restarted if line["after"] > line["before"])
    _heal_continues_the_live_group(logs, restarted)
    assert ends[0]["global_step"] == ends[1]["global_step"] == MAX_STEPS
    # every step counted by Lightning was committed; a dropped one is not counted (global_step did not move)
    for lines in logs.values():
        assert all(line["after"] - line["before"] in (0, 1) for line in lines)
    # one writer, the lowest live group, of one file per 4 committed steps (group 1 saved as often, wrote nothing)
    written = sorted(path.name for path in (tmp_path / "checkpoints").iterdir())
    assert written == sorted(f"group0-step={step}.ckpt" for step in range(4, MAX_STEPS + 1, 4)), written
    weights = {g: torch.load(tmp_path / f"weights{g}.pt") for g in (0, 1)}
    for name in weights[0]:
        torch.testing.assert_close(weights[1][name], weights[0][name])
    replay = _replay(logs, MAX_STEPS)
    for name in weights[0]:
        torch.testing.assert_close(weights[0][name], replay[name])
    # negative control: the replay without group 1's batches is not what the groups trained
    wrong = _replay(logs, MAX_STEPS, drop_group=1)
    with pytest.raises(AssertionError):
        for name in weights[0]:
            torch.testing.assert_close(weights[0][name], wrong[name])


def _replay_diloco(logs: dict[int, list[dict]], drop_group: int | None = None) -> dict[str, torch.Tensor]:
    """One process, float64, DiLoCo over every rank of every group: each rank (a pid) runs its own SGD with momentum
    on the rows it logged, from the synced weights of the sync its batches started after; at each committed sync
    (torchft's step ``s``) the outer Nesterov SGD steps the synced weights along the mean over the contributing
    groups of each group's mean of ``synced - local``. A rank's batches count in the committed sync they end in
    where its group contributed to it (after a dropped sync they go on into the next; a killed rank's last ones
    count nowhere). A group that joins at sync ``s`` takes each rank's momentum from the same rank of the live group
    (the heal)."""
    torch.set_default_dtype(torch.float64)
    try:
        x, y = _data()
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        anchor = [p.detach().clone() for p in net.parameters()]
        outer = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)
        synced = {0: [a.clone() for a in anchor]}  # torchft's step -> the synced weights after it
        ends: dict[int, list[tuple[int, int, int, list[dict]]]] = {}  # step -> (group, rank, pid, batches)
        joins: dict[int, list[tuple[int, int, int]]] = {}  # step -> (group, rank, pid) joining there
        for group, lines in logs.items():
            for pid in dict.fromkeys(line["pid"] for line in lines):
                mine = [line for line in lines if line["pid"] == pid]
                joins.setdefault(mine[0]["step"], []).append((group, mine[0]["rank"], pid))
                batches: list[dict] = []
                committed = mine[0]["committed"]
                for line in mine:
                    if line["committed"] != committed:  # a committed sync before this line
                        assert line["committed"] == committed + 1, line
                        if line["contributed"] and group != drop_group:
                            ends.setdefault(line["step"], []).append((group, line["rank"], pid, batches))
                        batches, committed = [], line["committed"]
                    if "rows" in line:  # not a final line or a killed rank's last word
                        batches.append(line)
        momentum: dict[int, list[torch.Tensor]] = {}
        for step in range(1, max(line["step"] for lines in logs.values() for line in lines) + 1):
            by_group: dict[int, list[list[torch.Tensor]]] = {}
            for group, _rank, pid, batches in ends.get(step, []):
                start = synced[batches[0]["step"]]
                params = [w.clone().requires_grad_(True) for w in start]
                for line in batches:
                    w1, b1, w2, b2 = params
                    rows = line["rows"]
                    loss = nn.functional.mse_loss(torch.tanh(x[rows] @ w1.T + b1) @ w2.T + b2, y[rows])
                    grads = torch.autograd.grad(loss, params)
                    old = momentum.get(pid)
                    momentum[pid] = (
                        [g.clone() for g in grads] if old is None else [0.9 * m + g for m, g in zip(old, grads)]
                    )
                    with torch.no_grad():
                        for p, m in zip(params, momentum[pid]):
                            p -= 0.05 / (1.0 + 0.1 * line["before"]) * m
                by_group.setdefault(group, []).append([w - p.detach() for w, p in zip(start, params)])
            if by_group:
                means = [[sum(d) / len(ranks) for d in zip(*ranks)] for ranks in by_group.values()]
                for a, d in zip(anchor, zip(*means)):
                    a.grad = sum(d) / len(means)
                outer.step()
            synced[step] = [a.detach().clone() for a in anchor]
            for group, rank, pid in joins.get(step, []):  # healed from the same rank of a live group
                live = [p for g, r, p, _ in ends.get(step, []) if r == rank and g != group and p in momentum]
                if live:
                    momentum[pid] = [m.clone() for m in momentum[live[0]]]
        last = synced[max(synced)]
        return {f"net.{k}": w for k, w in zip(("0.weight", "0.bias", "2.weight", "2.bias"), last)}
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_diloco_groups_sync_through_torchft_the_writing_group_killed_heals_at_a_sync_and_all_equal_the_replay(
    tmp_path,
):
    """``MGPUDiLoCoStrategy(sync_every=4, fault_tolerance=...)``: every rank takes its own inner steps; at the start of
    the step after each period the groups meet, the weight differences of the groups that trained the period are
    averaged, the outer step taken only if all commit. Group 0, the one that writes checkpoints and logs, is
    SIGKILLed half-way through writing the checkpoint of step 4, its first period's end (its other rank ends at the
    next sync); group 1 goes on syncing alone and takes over the writing from that sync; group 0, started again with
    other weights, heals at group 1's sync after step 16, writes again from there and trains with it to the end,
    where the last period is synced. The checkpoint being written when the kill came is not there under its name:
    only its hidden temporary file is."""
    log1 = tmp_path / "group1.jsonl"
    with _Job(tmp_path) as job:
        job.lighthouse(join_timeout_ms=10_000)  # groups that arrive at a sync apart still meet (the guide says why)
        both = ("--strategy", "diloco", "--quorum-timeout", "10", "--checkpoint-every", "4", "--log")
        # each waits for the other at the start of training (both heartbeating, so the first quorum has both)
        first = job.group(1, "lightning", *both, "--signal", "started1", "--wait", "started0:0",
                          "--wait", f"rejoined:{REJOIN_AT}")  # fmt: skip
        doomed = job.group(0, "pytorch_lightning", *both, "--signal", "started0", "--wait", "started1:0",
                           "--die-after", str(DIE_AFTER), "--die-in", "checkpoint")  # fmt: skip
        again = lambda: job.group(0, "pytorch_lightning", *both, "--signal", "rejoined", "--seed", "7")  # noqa: E731
        logs, ends = job.outage(first, doomed, log1, GROUP_SIZE * REJOIN_AT, again)
    assert len({line["pid"] for line in logs[1]}) == GROUP_SIZE  # the survivor never restarted
    assert all(line["participants"] == 2 for line in logs[1] if line.get("before", MAX_STEPS) < DIE_AFTER)
    alone = {
        line["step"] for line in logs[1] if line["committed"] and line["contributed"] and line["participants"] == 1
    }
    assert alone, logs[1]  # syncs group 1 committed without group 0
    first_pids = {line["pid"] for line in logs[0] if line.get("before", MAX_STEPS) < DIE_AFTER}
    restarted = [line for line in logs[0] if line["pid"] not in first_pids]
    assert restarted[0]["before"] >= REJOIN_AT and ends[0]["heals"] >= 1 and ends[0]["heal_bytes"] > 0
    assert restarted[-1]["final"] and restarted[-1]["contributed"] and restarted[-1]["participants"] == 2
    _heal_continues_the_live_group(logs, restarted, live=1)
    assert ends[0]["global_step"] == ends[1]["global_step"] == MAX_STEPS
    # one writer at a time, the lowest group of its last quorum: group 1 from its first quorum without group 0
    # (the sync after step 4), group 0 again from the sync it rejoined at (after step 16)
    written = sorted(path.name for path in (tmp_path / "checkpoints").iterdir() if not path.name.startswith("."))
    expected = ["group1-step=8", "group1-step=12", "group1-step=16", "group0-step=20", "group0-step=24"]
    assert written == sorted(f"{name}.ckpt" for name in expected), written
    for name in written:
        torch.load(tmp_path / "checkpoints" / name, weights_only=False)  # each whole
    assert len(list((tmp_path / "checkpoints").glob(".group0-step=4.ckpt.tmp-*"))) == 1  # the killed write, unnamed
    # and one group's loggers at a time: group 1's from that sync until group 0 is back
    logged = {p: {int(row["step"]) for row in csv.DictReader(p.open())} for p in tmp_path.glob("logs/*/*/metrics.csv")}
    assert sum(map(len, logged.values())) == len(set().union(*logged.values())), logged  # no step logged twice
    by_group = {g: set().union(*(s for p, s in logged.items() if p.parts[-3] == f"group{g}")) for g in (0, 1)}
    assert by_group[1] == set(range(DIE_AFTER, 16)) and set(range(16, MAX_STEPS)) <= by_group[0], by_group
    weights = {g: torch.load(tmp_path / f"weights{g}.pt") for g in (0, 1)}
    replay = _replay_diloco(logs)
    for name in weights[0]:
        torch.testing.assert_close(weights[1][name], weights[0][name])
        torch.testing.assert_close(weights[0][name], replay[name])
    wrong = _replay_diloco(logs, drop_group=0)  # negative control: without group 0's periods
    with pytest.raises(AssertionError):
        for name in weights[0]:
            torch.testing.assert_close(weights[0][name], wrong[name])


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_hung_group_leaves_by_its_step_timeout_then_the_lighthouse_going_away_ends_the_survivor_naming_it(tmp_path):
    """Group 1 hangs in user code (alive, heartbeating) in its 5th step: after step_timeout it takes itself out of
    the job, naming the step, and group 0 goes on alone. Then the lighthouse is killed: group 0 ends within its
    quorum_timeout with an error naming the lighthouse and the way back, and every checkpoint it wrote loads."""
    log = tmp_path / "group0.jsonl"
    with _Job(tmp_path) as job:
        lighthouse = job.lighthouse()
        survivor = job.group(0, "pytorch_lightning", "--wait", "started:0", "--max-steps", "10000",
                             "--quorum-timeout", "3", "--checkpoint-every", "2")  # fmt: skip
        hung = job.group(1, "lightning", "--signal", "started", "--hang-after", "4", "--step-timeout", "3")
        _wait(lambda: hung.poll() is not None, 90, "the hung group to leave", [survivor])
        left = len(_lines(log))
        alone = lambda: [x for x in _lines(log)[left:] if x["after"] > x["before"] and x["participants"] == 1]  # noqa: E731
        _wait(lambda: len(alone()) >= 3 * GROUP_SIZE, 60, "group 0 to go on alone", [survivor])
        lighthouse.kill()
        gone = time.monotonic()
        survivor.wait(timeout=60)
        ended = time.monotonic() - gone
        hung_output, output = job.output(hung), job.output(survivor)
    assert hung.returncode == 1
    assert re.search(r"replica group 1, rank \d: step \d+ has run for step_timeout=3 s without reaching its commit "
                     r"vote; the group is stuck", hung_output), hung_output[-3000:]  # fmt: skip
    assert survivor.returncode != 0 and ended < 3 + 30, ended  # the quorum timeout, the roll call, the exit
    address = f"http://127.0.0.1:{job.lighthouse_port}"
    assert f"replica group 0 got no quorum from the lighthouse at {address} within quorum_timeout=3 s" in output
    assert "Start it again (`torchft_lighthouse --min_replicas 1 --bind [::]:29510`), then this group" in output
    committed = max(line["after"] for line in _lines(log))
    saved = list(tmp_path.glob("checkpoints/*"))
    assert saved and all(path.suffix == ".ckpt" for path in saved)  # no file left half written
    steps = sorted(torch.load(path, weights_only=False)["global_step"] for path in saved)  # each loads: whole
    assert steps == list(range(2, committed + 1, 2)), (steps, committed)
