"""One GPU-proof run (``make gpu-proof``): the GPU tier and the benchmarks that matter most, most valuable first, each
with a time budget of its own, within 8 minutes of wall time on one H100.

    python benchmarks/gpu/proof.py --out benchmarks/results          # what `make gpu-proof` runs
    python benchmarks/gpu/proof.py --dry-run                         # the plan: parts, budgets, commands

Each part runs as a command of its own under a timeout (its budget, or what is left of the whole run's, whichever
is less), so a slow or hanging part cannot eat the parts after it; a part with less than ``MIN_START`` seconds
left is not started. Each part's output goes to ``<out>/proof_<part>.log``; ``<out>/gpu_proof.json`` records, per
part, its command, budget, wall time and status (``passed``, ``failed``, ``timeout``, ``not started``), with the
environment (device, driver, versions). The benchmarks write their own JSON under ``<out>`` as they always do.
Exit status: 0 when every part started passed, else 1.

The parts, most valuable first (estimates: docs/gpu.md):

1. ``env``: device, driver and versions.
2. ``tier``: ``tests/gpu`` (every CUDA path through ``Trainer.fit`` on NCCL; a fresh interpreter per case, twelve at a
   time with pytest-xdist), results also as JUnit XML (``gpu_tier.xml``); each failure's report is written to
   ``tier_failures.log`` as it fails, so a tier stopped at its budget still says why.
3. ``throughput``: tokens/s and MFU of ``mgpu_ddp``/``mgpu_sharded``/``mgpu_zero3`` against a plain torch loop and
   Lightning's ``ddp`` and ``FSDPStrategy`` (one round of 10 timed steps).
4. ``offload``: ZeRO-3's step time and device peak with and without ``offload="cpu"``, ours against a plain torch
   loop and Lightning's ``FSDPStrategy(cpu_offload=True)``.
5. ``compile``: the step time compiled (inductor) against eager.
6. ``planner``: the planner's prediction against the CUDA allocator.
7. ``checkpoint``: how long a save blocks training, synchronous against asynchronous.
8. ``memory``: memory per rank at 2, 4 and 8 ranks (torch's fake process group).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: the whole run's wall-time budget: 8 minutes, leaving a lease of 15 minutes room for the machine's start and a
#: rerun
TOTAL_S = 480
#: a part with less time than this left is not started (its set-up alone would not fit)
MIN_START = 20


@dataclass(frozen=True)
class Part:
    name: str
    budget_s: int
    args: tuple[str, ...]


def parts(out: Path, xdist: bool) -> list[Part]:
    py = sys.executable
    workers = ("-n", "12") if xdist else ()
    return [
        Part("env", 40, (py, "benchmarks/gpu/env.py")),
        Part(
            "tier",
            240,
            (
                py,
                "-m",
                "pytest",
                "tests/gpu",
                *workers,
                "-p",
                "no:cacheprovider",
                "-o",
                "timeout=150",
                "-o",
                "addopts=-ra --strict-markers",
                "-v",
                f"--junitxml={out / 'gpu_tier.xml'}",
            ),
        ),
        Part(
            "throughput",
            75,
            (
                py,
                "benchmarks/gpu/bench_throughput.py",
                "--rounds",
                "1",
                "--warmup",
                "3",
                "--steps",
                "10",
                "--out",
                str(out),
            ),
        ),
        Part("offload", 40, (py, "benchmarks/gpu/bench_offload.py", "--out", str(out))),
        Part(
            "compile",
            75,
            (
                py,
                "benchmarks/bench_compile.py",
                "--accelerator",
                "gpu",
                "--devices",
                "1",
                "--rounds",
                "1",
                "--out",
                str(out),
            ),
        ),
        Part("planner", 45, (py, "benchmarks/gpu/bench_planner_vs_allocator.py", "--out", str(out))),
        Part("checkpoint", 35, (py, "benchmarks/gpu/bench_checkpoint_blocking.py", "--out", str(out))),
        Part("memory", 35, (py, "benchmarks/gpu/bench_memory_per_rank.py", "--out", str(out))),
    ]


def run_part(part: Part, timeout_s: float, log: Path, env: dict[str, str]) -> tuple[str, float]:
    """Run one part under ``timeout_s`` (its whole process group is killed at the limit); its status and wall time."""
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            part.args, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout_s)
            status = "passed" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            status = "timeout"
    return status, round(time.monotonic() - start, 1)


def _json_in(log: Path) -> Any:
    """The JSON object a part printed (env.py's), or what its log holds instead."""
    text = log.read_text()
    try:
        return json.loads(text[text.index("{") : text.rindex("}") + 1])
    except ValueError:
        return {"error": text[-2000:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--total", type=int, default=TOTAL_S, help="wall-time budget of the whole run, seconds")
    ap.add_argument("--only", nargs="*", default=None, help="part names (default: all, in order)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and run nothing")
    args = ap.parse_args(argv)
    xdist = importlib.util.find_spec("xdist") is not None
    plan = [p for p in parts(args.out, xdist) if args.only is None or p.name in args.only]
    if args.dry_run:
        for p in plan:
            print(f"{p.name:<11} {p.budget_s:>4} s  {' '.join(p.args)}")
        print(f"total budget {args.total} s; parts' budgets add up to {sum(p.budget_s for p in plan)} s")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["MGPU_TIER_FAILURES"] = str(args.out / "tier_failures.log")  # each failure as it fails (tests/gpu/conftest.py)
    start = time.monotonic()
    record: dict[str, Any] = {"total_budget_s": args.total, "xdist": xdist, "parts": []}
    ok = True
    for p in plan:
        left = args.total - (time.monotonic() - start)
        entry: dict[str, Any] = {"name": p.name, "budget_s": p.budget_s, "command": " ".join(p.args)}
        if left < MIN_START:
            entry.update(status="not started", wall_s=0.0, reason=f"{left:.0f} s of the whole budget left")
        else:
            log = args.out / f"proof_{p.name}.log"
            status, wall = run_part(p, min(p.budget_s, left), log, env)
            entry.update(status=status, wall_s=wall)
            if p.name == "env":
                record["env"] = _json_in(log)
            ok = ok and status == "passed"
        record["parts"].append(entry)
        print(f"{p.name:<11} {entry['status']:<16} {entry['wall_s']:>6.1f} s / {p.budget_s} s", flush=True)
        (args.out / "gpu_proof.json").write_text(json.dumps(record, indent=1))  # after every part: a kill keeps it
    record["wall_s"] = round(time.monotonic() - start, 1)
    (args.out / "gpu_proof.json").write_text(json.dumps(record, indent=1))
    print(f"gpu-proof: {record['wall_s']} s; {args.out / 'gpu_proof.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
