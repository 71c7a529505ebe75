"""Per-step host overhead: a model so small that the optimizer step is nearly all framework, side by side in one run.

    python benchmarks/bench_overhead.py                                 # 2 CPU processes (gloo), 3 rounds
    python benchmarks/bench_overhead.py --rounds 5 --steps 400 --out benchmarks/results
    python benchmarks/bench_overhead.py --rounds 0 --profile 200        # only the profile: where the time goes
    python benchmarks/bench_overhead.py --compare /path/to/another/checkout   # mgpu_ddp before/after, one run
    python benchmarks/bench_overhead.py --world 1 --runners "Lightning ddp" mgpu_ddp   # no peer to wait for

Runners (the same model, ``Linear(8, 8) + ReLU`` and a ``Linear(8, 1)`` head, 81 parameters, fp32, SGD, batch 2 per
rank, the same data, every rank seeing its own share of each global batch through a ``DistributedSampler``), all on
``--world`` CPU processes (gloo; default 2: with one, no rank waits for another, and the figures hold the framework's
own work only, the least noisy):

* ``plain torch DDP``: a plain torch loop around ``torch.nn.parallel.DistributedDataParallel``, no Lightning
  (forward, loss, backward with the gradient all-reduce, ``step``, ``zero_grad``);
* ``Lightning ddp``: ``Trainer(strategy="ddp")``;
* ``mgpu_ddp``: the pack's ``Trainer(strategy="mgpu_ddp")``;
* ``Lightning FSDP``: Lightning's ``FSDPStrategy()`` (torch's FSDP1), the reference for the next one;
* ``mgpu_zero3``: the pack's ``MGPUShardedStrategy(stage=3)`` (FSDP2);
* ``Lightning ddp + log/bar`` and ``mgpu_ddp + log/bar``: the same as their plain rows, with ``self.log("loss",
  loss, on_step=True, prog_bar=True)`` in ``training_step``, the progress bar on and the default logger: what
  logging a metric every step costs.

The Lightning runners use the settings of a user who times training alone: no logger (``logger=False``), no
progress bar, no checkpointing, no model summary, no sanity check; each strategy with its defaults (its own launch:
the script re-run per rank). The ``+ log/bar`` rows switch the logger (Lightning's default, writing under a
temporary folder), the progress bar and the per-step ``self.log`` on.

Step time, measured the same way for every runner: rank 0's wall time between the ends of two consecutive optimizer
steps (a callback at ``on_train_batch_end``; the loop's own clock for plain torch), after ``--warmup`` steps; a
run's figure is the median over its ``--steps`` timed steps, in microseconds. Beside it, rank 0's CPU time per
step (``time.process_time``, every thread of the process): the host work itself, without the time spent waiting
for the other rank, which moves with the machine's load. Each run is its own subprocess, and the rounds visit every
runner in turn, so the machine's drifting load falls on all of them alike. Printed per runner: the median over the
rounds, the best round and the median CPU time; then the ratios mgpu_ddp / Lightning ddp, mgpu_ddp / plain torch
and mgpu_zero3 / Lightning FSDP (below 1: the pack's runner is faster): of the medians, of the best rounds, paired
(the median of each round's own ratio: the two runs of a round are minutes apart at most) and of the CPU times.
A runner that cannot run here (e.g. Lightning's FSDP on a platform without it) is skipped with the reason printed;
a run of another runner that fails (a rank that aborts at exit now and then, Lightning's own ``ddp`` too) is printed
and run once more, and a second failure ends the benchmark. The JSON of ``--out`` is named after ``--world``.

``--profile N``: then runs rank 0 of ``mgpu_ddp`` and of ``Lightning ddp`` (``--profile-logging``: of their ``+
log/bar`` rows) under cProfile for N optimizer steps (after warm-up) and prints, per optimizer step: the self time of
each package (torch / lightning / lightning_mgpu / other) for both and the difference; the pack's own functions by
cumulative time; and the functions whose self time per step mgpu_ddp spends beyond Lightning's ddp, whatever their
package: where the pack spends host time per step, line by line. cProfile slows every Python call, so read its figures
as shares, not as the step time.

``--package PATH`` runs the mgpu runners against the checkout of the pack at PATH (first on the workers'
``PYTHONPATH``; default: the checkout this script lives in); ``--compare PATH`` adds ``mgpu_ddp @ PATH``, from that
checkout, to the same alternating rounds, and its ratio: before and after in one table.

The machines are shared: timings are never asserted in tests. Not measured on a GPU (on CUDA the host overhead
hides behind the kernels when the step is long enough; this script runs its ranks on CPU).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
CHECKOUT = HERE.parent.parent
WIDTH = 8
TORCH, DDP, MGPU_DDP, FSDP, ZERO3 = "plain torch DDP", "Lightning ddp", "mgpu_ddp", "Lightning FSDP", "mgpu_zero3"
DDP_LOG, MGPU_LOG = "Lightning ddp + log/bar", "mgpu_ddp + log/bar"
RUNNERS = [TORCH, DDP, MGPU_DDP, FSDP, ZERO3, DDP_LOG, MGPU_LOG]
GROUPS = ("torch", "lightning", "lightning_mgpu", "other")


def _module(log: bool) -> Any:
    import pytorch_lightning as pl
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU())
            self.head = nn.Linear(WIDTH, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self(x), y)
            if log:
                self.log("loss", loss, on_step=True, prog_bar=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    return Tiny()


def _loader(args: argparse.Namespace, rank: int) -> Any:
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    g = torch.Generator().manual_seed(1)
    n = args.batch * args.world * (args.warmup + args.steps + 2)
    data = TensorDataset(torch.randn(n, WIDTH, generator=g), torch.randn(n, 1, generator=g))
    sampler = DistributedSampler(data, num_replicas=args.world, rank=rank, shuffle=False)
    return DataLoader(data, batch_size=args.batch, sampler=sampler)


def _stamp(stamps: list[tuple[float, float]]) -> None:
    """The end of an optimizer step: the wall clock and this process's CPU time (all its threads)."""
    stamps.append((time.perf_counter(), time.process_time()))


def _write(args: argparse.Namespace, stamps: list[tuple[float, float]]) -> None:
    times = [b[0] - a[0] for a, b in zip(stamps, stamps[1:])][args.warmup :]
    cpu = [b[1] - a[1] for a, b in zip(stamps, stamps[1:])][args.warmup :]
    pack = sys.modules.get("lightning_mgpu")
    Path(args.result).write_text(json.dumps({"times": times, "cpu": cpu, "package": getattr(pack, "__file__", None)}))


def _torch_rank(rank: int, port: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    model = DistributedDataParallel(_module(log=False))
    opt = model.module.configure_optimizers()
    stamps: list[tuple[float, float]] = []
    for x, y in _loader(args, rank):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        _stamp(stamps)
        if len(stamps) == args.warmup + args.steps + 1:
            break
    if rank == 0:
        _write(args, stamps)
    dist.barrier()
    # no teardown: tearing the gloo group down after a fork could hang one rank at exit (seen once here); the
    # result is written, so each rank leaves at once
    sys.stdout.flush()
    os._exit(0)


def _run_torch(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp
    from lightning_fabric.plugins.environments.lightning import find_free_network_port

    mp.start_processes(_torch_rank, nprocs=args.world, start_method="fork", args=(find_free_network_port(), args))


def _strategy(worker: str) -> Any:
    if worker in (DDP, DDP_LOG):
        return "ddp"
    if worker == FSDP:
        from pytorch_lightning.strategies import FSDPStrategy

        return FSDPStrategy()
    import lightning_mgpu  # noqa: F401  (registers "mgpu_ddp")

    if worker == ZERO3:
        from lightning_mgpu import MGPUShardedStrategy

        return MGPUShardedStrategy(stage=3)
    return "mgpu_ddp"


def _run_lightning(args: argparse.Namespace) -> None:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback

    total = args.warmup + args.steps + 1

    class StepClock(Callback):
        """Stamps the end of each optimizer step; with ``--profile-out``, rank 0 profiles the timed steps."""

        def __init__(self) -> None:
            self.stamps: list[tuple[float, float]] = []
            self.step = 0
            self.profiler: Any = None

        def on_train_batch_end(self, trainer: pl.Trainer, *rest: Any) -> None:
            if trainer.global_step <= self.step:
                return
            self.step = trainer.global_step
            _stamp(self.stamps)
            if args.profile_out and trainer.global_rank == 0:
                if len(self.stamps) == args.warmup + 1:
                    self.profiler = cProfile.Profile()
                    self.profiler.enable()
                elif len(self.stamps) == total and self.profiler is not None:
                    self.profiler.disable()
                    self.profiler.dump_stats(args.profile_out)

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.global_rank == 0:
                _write(args, self.stamps)

    log = args.worker in (DDP_LOG, MGPU_LOG)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.world, strategy=_strategy(args.worker), max_steps=total,
        logger=log, enable_progress_bar=log, default_root_dir=args.root, enable_checkpointing=False,
        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[StepClock()],
    )  # fmt: skip

    class Data(pl.LightningDataModule):
        def train_dataloader(self) -> Any:
            return _loader(args, trainer.global_rank)

    trainer.fit(_module(log), datamodule=Data())


def _spawn(
    runner: str, args: argparse.Namespace, tmp: str, name: str, profile_out: str = "", package: Any = None
) -> dict[str, Any]:
    """One run in its own interpreter (which the Lightning strategies re-run once per rank); the pack imported from
    ``package`` (default ``--package``), first on ``PYTHONPATH``."""
    package = Path(package or args.package)
    result = Path(tmp, f"{name}.json")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(package)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.world)))  # the same threads for all
    command = [sys.executable, str(HERE), "--worker", runner, "--result", str(result), "--root", tmp]
    command += ["--package", str(package), "--profile-out", profile_out]
    for flag in ("batch", "steps", "warmup", "world"):
        command += [f"--{flag}", str(getattr(args, flag))]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=tmp)
    if done.returncode != 0 or not result.exists():
        lines = (done.stdout + done.stderr).strip().splitlines()
        errors = [line for line in lines if "Error" in line or "error" in line] or lines[-1:]
        raise RuntimeError(f"exit code {done.returncode}: {errors[-1].strip() if errors else 'no output'}")
    record = json.loads(result.read_text())
    if runner in (MGPU_DDP, ZERO3, MGPU_LOG) and not Path(str(record["package"])).resolve().is_relative_to(package):
        raise RuntimeError(f"{runner} imported lightning_mgpu from {record['package']}, not from {package}")
    return record


def _group(filename: str, function: str) -> str:
    path = filename.replace(os.sep, "/")
    if filename == "~":  # a built-in: its name says whose it is ("<built-in method torch._C._nn.linear>")
        return "torch" if "torch" in function else "other"
    if "/lightning_mgpu/" in path:
        return "lightning_mgpu"
    if any(f"/{name}/" in path for name in ("pytorch_lightning", "lightning_fabric", "lightning", "torchmetrics")):
        return "lightning"
    if "/torch/" in path:
        return "torch"
    return "other"


def _label(key: tuple[str, int, str]) -> str:
    filename, line, function = key
    if filename == "~":
        return function
    path = filename.replace(os.sep, "/")
    for root in ("lightning_mgpu", "pytorch_lightning", "lightning_fabric", "torch"):
        if f"/{root}/" in path:
            path = root + "/" + path.rsplit(f"/{root}/", 1)[1]
            break
    else:
        path = Path(path).name
    return f"{path}:{line}({function})"


def _keyed(stats: pstats.Stats) -> dict[Any, Any]:
    """The profile's rows keyed so that two runs compare: a function named with its address (``<function
    _ParameterMeta.__instancecheck__ at 0x7f...>``) loses the address, and rows that then coincide add up."""
    out: dict[Any, Any] = {}
    for (filename, line, name), (cc, nc, tt, ct, callers) in stats.stats.items():  # type: ignore[attr-defined]
        key = (filename, line, re.sub(r" at 0x[0-9a-fA-F]+", "", name))
        if key in out:
            cc0, nc0, tt0, ct0, _ = out[key]
            cc, nc, tt, ct = cc + cc0, nc + nc0, tt + tt0, ct + ct0
        out[key] = (cc, nc, tt, ct, callers)
    return out


def _profile_table(
    ddp: pstats.Stats, mgpu: pstats.Stats, steps: int, top: int, names: tuple[str, str] = (DDP, MGPU_DDP)
) -> None:
    """Per optimizer step, in µs: package self times, the pack's functions, and what mgpu_ddp adds beyond ddp
    (``names``: the two runners profiled)."""
    lightnings, ours = names
    a, b = _keyed(ddp), _keyed(mgpu)
    per = 1e6 / steps

    def by_group(stats: dict[Any, Any]) -> dict[str, float]:
        out = dict.fromkeys(GROUPS, 0.0)
        for key, (_, _, tt, _, _) in stats.items():
            out[_group(key[0], key[2])] += tt * per
        return out

    ga, gb = by_group(a), by_group(b)
    print(f"\nself time per optimizer step under cProfile (µs), rank 0, {steps} steps after warm-up")
    print(f"{'package':<16} {lightnings:>14} {ours:>10} {'added':>8}")
    for g in GROUPS:
        print(f"{g:<16} {ga[g]:>14.0f} {gb[g]:>10.0f} {gb[g] - ga[g]:>+8.0f}")
    ta, tb = sum(ga.values()), sum(gb.values())
    print(f"{'total':<16} {ta:>14.0f} {tb:>10.0f} {tb - ta:>+8.0f}")

    own = [(key, v) for key, v in b.items() if _group(key[0], key[2]) == "lightning_mgpu"]
    print(f"\nlightning_mgpu's functions in {ours}, by cumulative time per step (top {top})")
    print(f"{'calls/step':>10} {'self µs':>8} {'cum µs':>8}  function")
    for key, (_, nc, tt, ct, _) in sorted(own, key=lambda kv: -kv[1][3])[:top]:
        print(f"{nc / steps:>10.1f} {tt * per:>8.1f} {ct * per:>8.1f}  {_label(key)}")

    print(f"\nfunctions with more self time per step in {ours} than in {lightnings} (top {top}, any package)")
    print(f"{'added µs':>8} {'calls/step':>10} {'(ddp)':>6}  {'package':<15} function")
    diffs = []
    for key, (_, nc, tt, _, _) in b.items():
        _, nc0, tt0, _, _ = a.get(key, (0, 0, 0.0, 0.0, None))
        diffs.append(((tt - tt0) * per, nc / steps, nc0 / steps, key))
    for added, calls, calls0, key in sorted(diffs, key=lambda d: -d[0])[:top]:
        print(f"{added:>+8.1f} {calls:>10.1f} {calls0:>6.1f}  {_group(key[0], key[2]):<15} {_label(key)}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2, help="per rank")
    parser.add_argument(
        "--world", type=int, default=2, help="processes (1: the framework's own work, without waiting for a peer)"
    )
    parser.add_argument("--steps", type=int, default=200, help="timed optimizer steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each visiting every runner in turn")
    parser.add_argument("--runners", nargs="+", default=RUNNERS, choices=RUNNERS, metavar="RUNNER")
    parser.add_argument("--profile", type=int, default=0, help="then profile N steps of mgpu_ddp and ddp")
    parser.add_argument("--profile-logging", action="store_true", help="profile the '+ log/bar' pair instead")
    parser.add_argument("--top", type=int, default=15, help="rows of each profile table")
    parser.add_argument("--package", type=Path, default=CHECKOUT, help="checkout of the pack for the mgpu runners")
    parser.add_argument("--compare", type=Path, default=None, help="another checkout: its mgpu_ddp beside ours")
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSON result")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run before it counts as hung")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--root", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--profile-out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.package = args.package.resolve()
    if args.worker is not None:  # one run, started by _spawn (the Lightning strategies' launch re-runs it per rank)
        sys.path.insert(0, str(args.package))
        _run_torch(args) if args.worker == TORCH else _run_lightning(args)
        return 0
    for path in [args.package] + ([args.compare] if args.compare else []):
        if not (path / "lightning_mgpu" / "__init__.py").is_file():
            parser.error(f"{path} holds no lightning_mgpu/__init__.py: pass the root of a checkout of the pack")
    # (label, runner, checkout of the pack): --compare adds mgpu_ddp from another checkout, after ours
    runners = [(runner, runner, args.package) for runner in args.runners]
    other = ""
    if args.compare is not None:
        args.compare = args.compare.resolve()
        other = f"{MGPU_DDP} @ {args.compare}"
        at = next((i + 1 for i, (label, _, _) in enumerate(runners) if label == MGPU_DDP), len(runners))
        runners.insert(at, (other, MGPU_DDP, args.compare))

    print(
        f"per-step host overhead, {args.world} CPU processes (gloo), {os.cpu_count()} cores; "
        f"Linear({WIDTH}, {WIDTH}) + ReLU + Linear({WIDTH}, 1) (81 parameters), SGD, fp32, batch {args.batch} per "
        f"rank; median of {args.steps} steps after {args.warmup}, rank 0, {args.rounds} rounds; mgpu package: "
        f"{args.package}" + (f", compared with {args.compare}" if args.compare else "")
    )
    medians: dict[str, list[float]] = {}  # per runner, each round's median wall time per step
    cpu: dict[str, list[float]] = {}  # the same for rank 0's CPU time per step
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            line = []
            for i, (label, runner, package) in enumerate(runners):
                if label in skipped:
                    continue
                try:
                    record = _spawn(runner, args, tmp, f"r{r}-{i}", package=package)
                except (RuntimeError, subprocess.TimeoutExpired) as err:
                    if runner == FSDP:  # only the reference may be missing here; the others must run
                        skipped[label] = str(err)
                        print(f"skipped {label}: {err}", flush=True)
                        continue
                    # a process that aborts at exit now and then (gloo's threads, Lightning's own ddp included):
                    # printed, and the run made once more; a second failure ends the benchmark
                    print(f"round {r + 1}: {label} failed ({err}); running it again", flush=True)
                    try:
                        record = _spawn(runner, args, tmp, f"r{r}-{i}-again", package=package)
                    except (RuntimeError, subprocess.TimeoutExpired) as again:
                        raise RuntimeError(f"{label} failed twice: {err}; {again}") from again
                median = statistics.median(record["times"])
                medians.setdefault(label, []).append(median)
                cpu.setdefault(label, []).append(statistics.median(record["cpu"]))
                line.append(f"{label} {median * 1e6:.0f}")
            print(f"round {r + 1}/{args.rounds} (µs): " + ", ".join(line), flush=True)

        rows: list[dict[str, Any]] = []
        ratios: list[dict[str, Any]] = []
        if medians:
            width = max(26, *(len(label) for label, _, _ in runners))
            head = f"{'runner':<{width}} {'median µs':>10} {'best µs':>8} {'CPU µs':>8}"
            print("\n" + head)
            print("-" * len(head))
            for label, _, _ in runners:
                if label in medians:
                    times = medians[label]
                    row = {"runner": label, "median_us": 1e6 * statistics.median(times), "best_us": 1e6 * min(times)}
                    row["rounds_us"] = [1e6 * t for t in times]
                    row["cpu_us"] = 1e6 * statistics.median(cpu[label])
                    row["cpu_rounds_us"] = [1e6 * t for t in cpu[label]]
                    rows.append(row)
                    print(f"{label:<{width}} {row['median_us']:>10.0f} {row['best_us']:>8.0f} {row['cpu_us']:>8.0f}")
            pairs = [(MGPU_DDP, DDP), (MGPU_DDP, TORCH), (ZERO3, FSDP), (MGPU_LOG, DDP_LOG)]
            for mine, theirs in pairs + ([(MGPU_DDP, other)] if other else []):
                if mine in medians and theirs in medians:
                    a, b = medians[mine], medians[theirs]
                    ratio = {"ratio": f"{mine} / {theirs}", "median": statistics.median(a) / statistics.median(b)}
                    ratio["best"] = min(a) / min(b)
                    # each round's ratio (the two ran minutes apart at most), then their median: the least noisy
                    ratio["paired"] = statistics.median(x / y for x, y in zip(a, b))
                    ratio["cpu"] = statistics.median(cpu[mine]) / statistics.median(cpu[theirs])
                    ratios.append(ratio)
                elif mine in medians or theirs in medians:
                    missing = theirs if mine in medians else mine
                    ratios.append({"ratio": f"{mine} / {theirs}", "skipped": skipped.get(missing, "not run")})
            if ratios:
                width = max(46, *(len(ratio["ratio"]) for ratio in ratios))
                print(f"\n{'ratio':<{width}} {'median':>7} {'best':>6} {'paired':>7} {'CPU':>6}")
                for ratio in ratios:
                    if "skipped" in ratio:
                        print(f"{ratio['ratio']:<{width}} {'-':>7} {'-':>6} {'-':>7} {'-':>6}   ({ratio['skipped']})")
                    else:
                        print(
                            f"{ratio['ratio']:<{width}} {ratio['median']:>6.2f}x {ratio['best']:>5.2f}x "
                            f"{ratio['paired']:>6.2f}x {ratio['cpu']:>5.2f}x"
                        )

        if args.profile:
            pair = (DDP_LOG, MGPU_LOG) if args.profile_logging else (DDP, MGPU_DDP)
            print(f"\nprofiling {args.profile} steps of {pair[0]} and {pair[1]} under cProfile (rank 0)", flush=True)
            saved = args.steps
            args.steps = args.profile
            stats = {}
            for runner in pair:
                out = str(Path(tmp, f"profile-{RUNNERS.index(runner)}.prof"))
                _spawn(runner, args, tmp, f"profile-{RUNNERS.index(runner)}", profile_out=out)
                stats[runner] = pstats.Stats(out)
            args.steps = saved
            _profile_table(stats[pair[0]], stats[pair[1]], args.profile, args.top, pair)

    if args.out and rows:
        args.out.mkdir(parents=True, exist_ok=True)
        name = args.out / f"overhead-cpu-world{args.world}-{time.strftime('%Y-%m-%d')}.json"
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("out", "result")}
        device = f"CPU, {args.world} processes (gloo)"
        name.write_text(
            json.dumps(
                {"device": device, "config": config, "rows": rows, "ratios": ratios, "skipped": skipped}, indent=1
            )
        )
        print(f"saved {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
