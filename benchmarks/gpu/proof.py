"""One GPU-proof run (``make gpu-proof``): the GPU tier and the benchmarks that matter most, each with a time budget
of its own, within 8 minutes of wall time on one H100.

    python benchmarks/gpu/proof.py --out benchmarks/results          # what `make gpu-proof` runs
    python benchmarks/gpu/proof.py --dry-run                         # the plan: parts, budgets, commands

Each part runs as a command of its own under a timeout (its budget, or what is left of the whole run's, whichever
is less), so a slow or hanging part cannot eat the parts after it; a part with less than ``MIN_START`` seconds
left is not started. Each part's output goes to ``<out>/proof_<part>.log``; ``<out>/gpu_proof.json`` records, per
part, its command, budget, wall time and status (``passed``, ``failed``, ``timeout``, ``not started``), with the
environment (device, driver, versions) and the throughput goals. The benchmarks write their own JSON under ``<out>``
as they always do. Exit status: 0 when every required part started passed, else 1.

The plan's rule (:func:`plan_s`, checked by ``tests/meta/test_results_tables.py``): the parts run one after another,
except those marked ``beside`` a part, which run in a lane of their own while that part runs (in their order, one
at a time); the part after waits for both. The tier runs beside parts that measure versions and bytes, not time
(``env``, ``planner``, ``memory``) and ``compile-warm``, which fills inductor's on-disk caches with the compiled
throughput cases' graphs (its timings are thrown away); the parts that time steps (``throughput``, ``offload``,
``checkpoint``) run alone. The plan on paper is the sum, over the parts run one after another, of each part's budget
or, when longer, the budgets beside it added up: at most ``TOTAL_S``, so the dry run shows the 8 minutes.

The parts:

1. ``tier``: ``tests/gpu`` (every CUDA path through ``Trainer.fit`` on NCCL; a fresh interpreter per case, twelve at a
   time with pytest-xdist), results also as JUnit XML (``gpu_tier.xml``); each failure's report is written to
   ``tier_failures.log`` as it fails, so a tier stopped at its budget still says why. Beside it, one after another:

   * ``env``: device, driver and versions;
   * ``planner``: the planner's prediction against the CUDA allocator;
   * ``memory``: memory per rank at 2, 4 and 8 ranks (torch's fake process group);
   * ``compile-warm``: one compile of each compiled throughput case, with 4 compile threads (the tier keeps the
     rest of the CPU), so that ``throughput`` compiles from warm caches; not required (a timeout only makes the
     compiles in ``throughput`` slower).

2. ``throughput``: tokens/s, MFU and host syncs per step of a GPT-2-124M-shaped model (eager and compiled) and of the
   368M model (eager, with activation checkpointing on the plain loop and ``mgpu_ddp``), for the plain torch loop,
   Lightning's ``ddp`` and ``FSDPStrategy`` and ``mgpu_ddp`` and ``mgpu_zero3`` (``bench_throughput.py --cases
   proof``, one round of 10 timed steps; each case's row saved as it is measured). It replaces the earlier
   ``compile`` part (``bench_compile.py``, the small digits transformer): the compiled language model measures what
   that part stood in for.
3. ``offload``: ZeRO-3's step time and device peak with and without ``offload="cpu"``, ours against a plain torch
   loop and Lightning's ``FSDPStrategy(cpu_offload=True)``.
4. ``checkpoint``: how long a save blocks training, synchronous against asynchronous.

Then the goals (``goals.py``: ``mgpu_ddp`` >= 0.98x plain torch, ``mgpu_zero3`` >= Lightning's ``FSDPStrategy``,
the compiled GPT-2-124M shape under ``mgpu_ddp`` >= 40% MFU) are printed from the throughput part's result as met,
missed or not measured, and recorded. When one is missed and at least ``MIN_START`` seconds of the whole budget are
left, a last part, ``profile``, profiles the first missed goal's runners in that time (``bench_throughput.py --rounds
0 --profile 5``: where each runner's step goes beyond the plain loop's); it has no budget of its own, only what is
left, so the run stays within the total.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
#: the whole run's wall-time budget: 8 minutes, leaving a lease of 15 minutes room for the machine's start and a
#: rerun
TOTAL_S = 480
#: a part with less time than this left is not started (its set-up alone would not fit)
MIN_START = 20


@dataclass(frozen=True)
class Part:
    """One command of the proof. ``beside``: the part it runs alongside (in a lane of its own), instead of after the
    part before; ``env``: variables added to its environment; ``required``: whether its status counts in the exit
    status."""

    name: str
    budget_s: int
    args: tuple[str, ...]
    beside: Optional[str] = None
    env: tuple[tuple[str, str], ...] = ()
    required: bool = True

    @property
    def command(self) -> str:
        return " ".join([*(f"{k}={v}" for k, v in self.env), *self.args])


def parts(out: Path, xdist: bool) -> list[Part]:
    py = sys.executable
    workers = ("-n", "12") if xdist else ()
    throughput = (py, "benchmarks/gpu/bench_throughput.py", "--cases", "proof", "--rounds", "1")
    return [
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
        Part("env", 30, (py, "benchmarks/gpu/env.py"), beside="tier"),
        Part("planner", 65, (py, "benchmarks/gpu/bench_planner_vs_allocator.py", "--out", str(out)), beside="tier"),
        Part("memory", 25, (py, "benchmarks/gpu/bench_memory_per_rank.py", "--out", str(out)), beside="tier"),
        Part(
            "compile-warm",
            120,
            (*throughput, "--modes", "compiled", "--warmup", "2", "--steps", "1"),
            beside="tier",
            env=(("TORCHINDUCTOR_COMPILE_THREADS", "4"),),
            required=False,
        ),
        Part("throughput", 165, (*throughput, "--warmup", "3", "--steps", "10", "--out", str(out))),
        Part("offload", 40, (py, "benchmarks/gpu/bench_offload.py", "--out", str(out))),
        Part("checkpoint", 35, (py, "benchmarks/gpu/bench_checkpoint_blocking.py", "--out", str(out))),
    ]


def lanes(plan: list[Part]) -> list[tuple[Part, list[Part]]]:
    """The parts run one after another, each with the parts that run beside it (in their order); a part marked
    ``beside`` one that is not in ``plan`` (``--only``) runs in its turn like the others."""
    main = [p for p in plan if p.beside is None or p.beside not in {q.name for q in plan}]
    return [(m, [p for p in plan if p.beside == m.name and p is not m]) for m in main]


def plan_s(plan: list[Part]) -> int:
    """The plan's wall time on paper: for each part run in turn, its budget or, when longer, the budgets of the parts
    beside it added up."""
    return sum(max(m.budget_s, sum(p.budget_s for p in side)) for m, side in lanes(plan))


def print_plan(plan: list[Part], total: int) -> None:
    for m, side in lanes(plan):
        print(f"{m.name:<13} {m.budget_s:>4} s  {m.command}")
        for p in side:
            print(f"  beside {m.name}: {p.name:<13} {p.budget_s:>4} s  {p.command}")
        if side:
            print(f"  ({m.name} and the parts beside it: {max(m.budget_s, sum(p.budget_s for p in side))} s)")
    print(
        f"{'profile':<13}    - s  only when a throughput goal is missed, in the time left of the total: "
        f"{sys.executable} benchmarks/gpu/bench_throughput.py --rounds 0 --profile 5 --models <the goal's> --modes "
        f"<the goal's> --profile-runners torch <the goal's runners> --out <out>"
    )
    on_paper = plan_s(plan)
    verdict = "fits" if on_paper <= total else "does NOT fit"
    print(
        f"total budget {total} s; the plan takes {on_paper} s on paper (each part in turn: its budget, or the budgets "
        f"beside it added up when longer): {verdict}; parts: {', '.join(p.name for p in plan)}"
    )


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


def _goals_module() -> Any:
    spec = importlib.util.spec_from_file_location("_proof_goals", Path(__file__).resolve().parent / "goals.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def goal_report(out: Path, since: float) -> tuple[Optional[str], list[dict[str, Any]]]:
    """The throughput goals judged from the newest throughput result written under ``out`` since ``since`` (the
    epoch time the run started): its file name (None if there is none) and the goals (all "not measured" then)."""
    goals = _goals_module()
    written = [p for p in out.glob("gpu-throughput-*.json") if p.stat().st_mtime >= since]
    if not written:
        return None, goals.evaluate([])
    newest = max(written, key=lambda p: p.stat().st_mtime)
    return newest.name, goals.evaluate(json.loads(newest.read_text())["rows"])


class _Run:
    """The parts' records, written to ``gpu_proof.json`` after every part (a kill keeps them); the lanes beside a part
    run in threads, so each update holds the lock."""

    def __init__(self, out: Path, total: int, xdist: bool, env: dict[str, str]) -> None:
        self.out, self.total, self.env = out, total, env
        self.start = time.monotonic()
        self.lock = threading.Lock()
        self.record: dict[str, Any] = {"total_budget_s": total, "xdist": xdist, "parts": []}
        self.ok = True

    def left(self) -> float:
        return self.total - (time.monotonic() - self.start)

    def write(self) -> None:
        (self.out / "gpu_proof.json").write_text(json.dumps(self.record, indent=1))

    def run(self, p: Part, budget: Optional[float] = None) -> None:
        left = self.left()
        entry: dict[str, Any] = {
            "name": p.name,
            "budget_s": p.budget_s,
            "command": p.command,
            "started_s": round(self.total - left, 1),
        }
        if p.beside is not None:
            entry["beside"] = p.beside
        if not p.required:
            entry["required"] = False
        if left < MIN_START:
            entry.update(status="not started", wall_s=0.0, reason=f"{left:.0f} s of the whole budget left")
        else:
            log = self.out / f"proof_{p.name}.log"
            limit = min(p.budget_s if budget is None else budget, left)
            entry["limit_s"] = round(limit, 1)
            status, wall = run_part(p, limit, log, {**self.env, **dict(p.env)})
            entry.update(status=status, wall_s=wall)
            with self.lock:
                if p.name == "env":
                    self.record["env"] = _json_in(log)
                self.ok = self.ok and (status == "passed" or not p.required)
        with self.lock:
            self.record["parts"].append(entry)
            where = f" (beside {p.beside})" if p.beside else ""
            of = f"{p.budget_s} s" if p.budget_s else f"{entry.get('limit_s', 0):.0f} s left"
            print(f"{p.name:<13} {entry['status']:<16} {entry['wall_s']:>6.1f} s / {of}{where}", flush=True)
            self.write()

    def lane(self, side: list[Part]) -> None:
        for p in side:
            self.run(p)


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
        print_plan(plan, args.total)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["MGPU_TIER_FAILURES"] = str(args.out / "tier_failures.log")  # each failure as it fails (tests/gpu/conftest.py)
    since = time.time()
    run = _Run(args.out, args.total, xdist, env)
    for main_part, side in lanes(plan):
        beside = threading.Thread(target=run.lane, args=(side,), daemon=True) if side else None
        if beside is not None:
            beside.start()
        run.run(main_part)
        if beside is not None:
            beside.join()  # the next part times steps: nothing runs beside it
    if any(p.name == "throughput" for p in plan):
        source, judged = goal_report(args.out, since)
        run.record["goals"] = {"file": source, "goals": judged}
        print("goals" + (f" ({source}):" if source else " (no throughput result written):"))
        print("\n".join(_goals_module().lines(judged)))
        missed = next((g for g in judged if g.get("profile_args")), None)
        if missed is not None:  # where the time goes, in the time left of the total
            profile = Part(
                "profile",
                0,
                (sys.executable, "benchmarks/gpu/bench_throughput.py", *missed["profile_args"], "--out", str(args.out)),
                required=False,
            )
            run.run(profile, budget=run.left() - 5)  # room for its kill and the last write
        run.write()
    run.record["wall_s"] = round(time.monotonic() - run.start, 1)
    run.write()
    print(f"gpu-proof: {run.record['wall_s']} s; {args.out / 'gpu_proof.json'}")
    return 0 if run.ok else 1


if __name__ == "__main__":
    sys.exit(main())
