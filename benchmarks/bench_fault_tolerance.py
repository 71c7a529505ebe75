"""What fault tolerance costs and what it saves, measured side by side in one run (CPU, gloo, 2 processes in all):

    python benchmarks/bench_fault_tolerance.py            # about 2 minutes on 2 cores
    python benchmarks/bench_fault_tolerance.py --json     # the table's figures as JSON too

Every run trains the sample transformer (:class:`lightning_mgpu.examples.DigitsTransformer`) on the digits for the
same number of optimizer steps, one process per rank:

1. Lightning's ``ddp``: one job of 2 ranks;
2. ``mgpu_ddp``: one job of 2 ranks;
3. ``mgpu_ddp`` with ``fault_tolerance``: 2 replica groups of 1 rank each and a lighthouse (torchft's), the same 2
   ranks, the gradients averaged across the groups through torchft instead of inside DDP;
4. the same, with group 1 SIGKILLed in the middle of a step and started again at once: it heals from group 0;
5. ``mgpu_diloco`` (``sync_every=8``): one job of 2 ranks, then 2 replica groups of 1 rank with ``fault_tolerance``
   (the weight differences averaged across the groups through torchft every 8 steps).

Printed: the median wall time per optimizer step of each run against ``mgpu_ddp``'s (run 1-3); for run 4, the steps
group 0 committed while group 1 was gone, the seconds from the kill to the restarted group's first committed step
(its start-up included: importing torch and Lightning is most of it), and the bytes the heal received against the
weights and the optimizer state; from the ledger, the bytes of the cross-group all-reduce per step (for run 5 too:
about 1/8 of run 3's). The machine's
load is the same for all runs (2 processes each); the figures of one run are comparable with each other only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STEPS = 60
WARMUP = 10
KILL_AT = 20


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def group_main(args: argparse.Namespace) -> None:
    """One launch: a job of ``--devices`` ranks, with fault tolerance where ``--lighthouse`` is given."""
    import pytorch_lightning as pl
    import torch

    import lightning_mgpu  # noqa: F401  (registers the presets)
    from lightning_mgpu import MGPUDDPStrategy, MGPUDiLoCoStrategy
    from lightning_mgpu.examples import DigitsDataModule, DigitsTransformer

    out = Path(args.out)

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *rest: Any) -> None:
            self.start, self.before = time.perf_counter(), trainer.global_step

        def on_before_backward(self, trainer: pl.Trainer, *rest: Any) -> None:
            if args.die_at is not None and trainer.global_step == args.die_at:  # in the middle of the step
                (out / "killed").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, trainer: pl.Trainer, *rest: Any) -> None:
            replicas = getattr(trainer.strategy, "replicas", None)
            line = {
                "seconds": time.perf_counter() - self.start,
                "before": self.before,
                "after": trainer.global_step,
                "time": time.time(),
                "participants": replicas.participants if replicas is not None else 0,
            }
            if trainer.is_global_zero:
                with open(out / f"{args.name}.jsonl", "a") as f:
                    f.write(json.dumps(line) + "\n")
            if args.stop_after_join is None:
                return
            joined = out / "joined"
            if args.name.endswith("again") and line["after"] > line["before"] and not joined.exists():
                joined.write_text(str(line["after"]))  # the restarted group's first committed step
            if joined.exists() and trainer.global_step >= int(joined.read_text() or 0) + args.stop_after_join:
                trainer.should_stop = True  # both groups, at the same committed step

        def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
            if not trainer.is_global_zero:
                return
            stats = trainer.strategy.comm_stats if hasattr(trainer.strategy, "comm_stats") else None
            weights = list(module.state_dict().values())
            moments = [
                v for o in trainer.optimizers for s in o.state.values() for v in s.values() if torch.is_tensor(v)
            ]
            end = {
                "state_bytes": sum(t.numel() * t.element_size() for t in weights + moments),
                "heal_bytes": stats.heal_bytes if stats is not None else 0,
                "replica_group_bytes": stats.replica_group_bytes if stats is not None else 0,
                "steps": trainer.global_step,
            }
            (out / f"{args.name}.end.json").write_text(json.dumps(end))

    ft = None
    if args.lighthouse:
        ft = {"lighthouse": args.lighthouse, "replica_group": args.group, "replica_groups": 2, "timeout": 10}
    if args.strategy == "ddp":
        strategy: Any = "ddp"
    elif args.strategy == "diloco":
        strategy = MGPUDiLoCoStrategy(sync_every=8, fault_tolerance=ft, start_method="fork")
    else:
        strategy = MGPUDDPStrategy(fault_tolerance=ft, start_method="fork")
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=STEPS if args.stop_after_join is None else 100_000,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Record()],
    )
    trainer.fit(DigitsTransformer(), DigitsDataModule(batch_size=32))


def _launch(out: Path, name: str, *extra: str) -> subprocess.Popen:
    # one thread per process in every run, as Lightning gives each of 2 ranks on 2 cores: two groups of one process
    # on one machine would otherwise each take every core (in a real job each group has machines of its own)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()), "OMP_NUM_THREADS": "1"}
    log = open(out / f"{name}.log", "w")
    cmd = [sys.executable, __file__, "--role", "group", "--out", str(out), "--name", name, *extra]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _lines(out: Path, name: str) -> list[dict[str, Any]]:
    path = out / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _median_ms(lines: list[dict[str, Any]]) -> float:
    return 1000 * statistics.median(line["seconds"] for line in lines[WARMUP:])


def _wait(procs: list[subprocess.Popen], timeout: float = 600) -> None:
    for proc in procs:
        if proc.wait(timeout=timeout) != 0:
            raise SystemExit(f"a run failed: {' '.join(map(str, proc.args))}")


def main(args: argparse.Namespace) -> None:
    from torchft.coordination import LighthouseServer

    out = Path(tempfile.mkdtemp(prefix="bench_ft_"))
    _wait([_launch(out, "lightning_ddp", "--strategy", "ddp", "--devices", "2")])
    _wait([_launch(out, "mgpu_ddp", "--devices", "2")])
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=1000)
    address = lighthouse.address()
    ft = ("--lighthouse", address, "--devices", "1")
    _wait([_launch(out, f"ft{g}", *ft, "--group", str(g)) for g in (0, 1)])
    # the kill: group 0 trains on until 5 steps after group 1 is back; group 1 is started again as soon as it died
    ft = (*ft, "--stop-after-join", "5")
    survivor = _launch(out, "kill0", *ft, "--group", "0")
    doomed = _launch(out, "kill1", *ft, "--group", "1", "--die-at", str(KILL_AT))
    doomed.wait(timeout=600)
    restarted = _launch(out, "kill1again", *ft, "--group", "1")
    _wait([survivor, restarted])
    diloco = ("--strategy", "diloco")
    _wait([_launch(out, "diloco", *diloco, "--devices", "2")])
    _wait([_launch(out, f"diloco_ft{g}", *diloco, "--lighthouse", address, "--group", str(g)) for g in (0, 1)])
    lighthouse.shutdown()

    base = _median_ms(_lines(out, "mgpu_ddp"))
    rows = [
        ("Lightning ddp, 2 ranks", _median_ms(_lines(out, "lightning_ddp"))),
        ("mgpu_ddp, 2 ranks", base),
        ("mgpu_ddp fault_tolerance, 2 groups x 1 rank", _median_ms(_lines(out, "ft0"))),
        ("mgpu_diloco sync_every=8, 2 ranks", _median_ms(_lines(out, "diloco"))),
        ("mgpu_diloco fault_tolerance, 2 groups x 1 rank", _median_ms(_lines(out, "diloco_ft0"))),
    ]
    print(f"{'run':<46} {'step ms':>8} {'vs mgpu_ddp':>12}")
    for name, ms in rows:
        print(f"{name:<46} {ms:8.1f} {ms / base:11.2f}x")
    killed = float((out / "killed").read_text())
    alone = [line for line in _lines(out, "kill0") if line["after"] > line["before"] and line["participants"] == 1]
    first = next(line for line in _lines(out, "kill1again") if line["after"] > line["before"])
    end0 = json.loads((out / "ft0.end.json").read_text())
    diloco0 = json.loads((out / "diloco_ft0.end.json").read_text())
    healed = json.loads((out / "kill1again.end.json").read_text())
    figures = {
        "steps": {name: ms for name, ms in rows},
        "ft_vs_mgpu_ddp": rows[2][1] / base,
        "steps_committed_alone": len(alone),
        "kill_to_first_committed_step_s": first["time"] - killed,
        "heal_bytes": healed["heal_bytes"],
        "state_bytes": healed["state_bytes"],
        "replica_group_bytes_per_step": end0["replica_group_bytes"] / end0["steps"],
        "diloco_ft_vs_diloco": rows[4][1] / rows[3][1],
        "diloco_replica_group_bytes_per_step": diloco0["replica_group_bytes"] / diloco0["steps"],
    }
    print(f"\nkill group 1 at step {KILL_AT}, start it again at once:")
    print(f"  steps group 0 committed alone             {len(alone)}")
    print(f"  kill -> restarted group's first step      {figures['kill_to_first_committed_step_s']:.1f} s")
    print(
        f"  heal received                             {healed['heal_bytes']:,} B "
        f"({healed['heal_bytes'] / healed['state_bytes']:.2f}x weights + optimizer state, {healed['state_bytes']:,} B)"
    )
    print(f"  cross-group all-reduce per step           {figures['replica_group_bytes_per_step']:,.0f} B")
    print(
        f"mgpu_diloco with fault_tolerance: {figures['diloco_ft_vs_diloco']:.2f}x mgpu_diloco's step; cross-group "
        f"all-reduce per step {figures['diloco_replica_group_bytes_per_step']:,.0f} B "
        f"({figures['diloco_replica_group_bytes_per_step'] / figures['replica_group_bytes_per_step']:.3f}x mgpu_ddp's)"
    )
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default="main", choices=("main", "group"))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--name")
    parser.add_argument("--strategy", default="mgpu_ddp")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--lighthouse")
    parser.add_argument("--group", type=int, default=0)
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--stop-after-join", type=int, default=None)
    parsed = parser.parse_args()
    group_main(parsed) if parsed.role == "group" else main(parsed)
