"""The figures of the README and the GPU tier's page, rendered from the results files (never typed by hand): the GPU
benchmarks' JSON under ``benchmarks/results/``, the CPU benchmarks' outputs in ``docs/_data/benchmarks.json``.

    python benchmarks/results_tables.py            # print every table
    python benchmarks/results_tables.py --write    # rewrite the marked blocks of README.md and docs/gpu.md
    python benchmarks/results_tables.py --check    # exit 1 when a marked block differs from its rendering

A marked block is the text between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` in a page;
:data:`TABLES` maps each ``NAME`` to the function that renders it. ``tests/meta/test_results_tables.py`` checks that
every block equals its rendering, so a new results file (``make gpu-proof`` writes them) is followed by ``--write``.

Each benchmark's file is named ``gpu-<benchmark>-<device>-<date>.json`` (the date with the UTC time of the run,
``2026-11-30T1115``, in files written since the time was added); a table takes the newest file of each device, by
the time its environment records, and says the device and the date of every figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: the CPU benchmarks' printed figures, kept for the docs' plots (each entry names the command that printed it)
CPU_RESULTS = ROOT / "docs" / "_data" / "benchmarks.json"
#: the pages holding marked blocks
PAGES = (ROOT / "README.md", ROOT / "docs" / "gpu.md")

_BLOCK = re.compile(r"(<!-- results:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /results:(?P=name) -->)", re.S)


def newest_per_device(benchmark: str, results: Path = RESULTS) -> list[dict[str, Any]]:
    """The newest results file of ``benchmark`` for each device, loaded, in the order of their device names."""
    newest: dict[str, dict[str, Any]] = {}
    for path in sorted(results.glob(f"gpu-{benchmark}-*.json")):
        data = json.loads(path.read_text())
        device = data["environment"]["device"]
        if device not in newest or data["environment"]["date"] > newest[device]["environment"]["date"]:
            newest[device] = data
    return [newest[d] for d in sorted(newest)]


def _card(env: dict[str, Any]) -> str:
    return f"{env['device']} ({env['date'][:10]})"


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "not measured"


def summary_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of a throughput result that the README summarises: the 368M model (``goals.DEFAULT_MODEL``, the model
    of the rows written before the field), eager, measured (a file may also hold other models, compiled runs and
    failed cases, each row saying which: ``model``, ``compiled``, ``error``)."""
    goals = _gpu_module("goals")
    return [
        r for r in rows if goals.model_of(r) == goals.DEFAULT_MODEL and not r.get("compiled") and "tokens_per_s" in r
    ]


def readme_summary(results: Path = RESULTS) -> str:
    """One row per GPU: the pack against a plain torch loop and against Lightning's own strategies, the async
    checkpoint's blocking time and ZeRO-3's model states per rank."""
    lines = [
        "| GPU (date) | `mgpu_ddp` vs plain torch, tokens/s | Lightning `ddp` vs plain torch | `mgpu_zero3` vs "
        "Lightning `FSDPStrategy` | plain torch MFU | async / sync checkpoint blocking (`mgpu_ddp`; `mgpu_zero3` "
        "sharded) | ZeRO-3 model states per rank vs DDP, 8 ranks | the allocator's peak / the planner's |",
        "|---|---|---|---|---|---|---|---|",
    ]
    throughput = {d["environment"]["device"]: d for d in newest_per_device("throughput", results)}
    blocking = {d["environment"]["device"]: d for d in newest_per_device("checkpoint-blocking", results)}
    memory = {d["environment"]["device"]: d for d in newest_per_device("memory-per-rank", results)}
    planner = {d["environment"]["device"]: d for d in newest_per_device("planner-vs-allocator", results)}
    for device in sorted(set(throughput) | set(blocking) | set(memory) | set(planner)):
        cells = []
        t = throughput.get(device)
        if t is not None:
            rows = summary_rows(t["rows"])
            tok = {r["runner"]: r["tokens_per_s"] for r in rows}
            mfu = {r["runner"]: r["mfu"] for r in rows}
            cells += [
                f"{_ratio(tok.get('mgpu_ddp'), tok.get('torch'))} ({tok.get('mgpu_ddp', 0):,.0f})",
                _ratio(tok.get("lightning_ddp"), tok.get("torch")),
                _ratio(tok.get("mgpu_zero3"), tok.get("lightning_fsdp")),
                f"{mfu['torch']:.1%}" if "torch" in mfu else "not measured",
            ]
        else:
            cells += ["not measured"] * 4
        b = blocking.get(device)
        if b is not None:
            asyncs = {r["strategy"]: r["vs_sync"] for r in b["rows"] if r["mode"] == "async"}
            cells.append("; ".join(_ratio(asyncs.get(s), 1.0) for s in ("mgpu_ddp", "mgpu_zero3_sharded")))
        else:
            cells.append("not measured")
        m = memory.get(device)
        states = {(r["world"], r["strategy"]): r["states_bytes"] for r in m["rows"]} if m else {}
        cells.append(_ratio(states.get((8, "zero3")), states.get((8, "ddp"))))
        p = planner.get(device)
        ratios = sorted(r["ratio"] for r in p["rows"]) if p else []
        cells.append(f"{ratios[0]:.2f}x to {ratios[-1]:.2f}x ({len(ratios)} layouts)" if ratios else "not measured")
        date = min(d["environment"]["date"][:10] for d in (t, b, m, p) if d is not None)
        lines.append(f"| {device} ({date}) | " + " | ".join(cells) + " |")
    if len(lines) == 2:
        return "Not measured on a GPU yet: `make gpu-proof` on a machine with an NVIDIA GPU writes the results.\n"
    return "\n".join(lines) + "\n"


def readme_cpu(path: Path = CPU_RESULTS) -> str:
    """The CPU figures of the README (2 gloo processes), from the outputs kept in ``docs/_data/benchmarks.json``."""
    data = json.loads(path.read_text())
    ddp, sharded, ckpt = data["bench_ddp"], data["bench_sharded"]["n2_ratio_to_ddp"], data["bench_checkpointing"]
    step, ledger = ddp["step_ms"], ddp["ledger_ratio_to_ring_lower_bound"]
    every2, every = ckpt["bytes_and_time_vs_none"]["mgpu_every2"], ckpt["bytes_and_time_vs_none"]["mgpu"]
    manual = data["bench_manual_accum"]["ms_per_window"]
    adapters = data["bench_adapter_checkpoint"]["bytes"]["mgpu_ddp (one file)"]
    return (
        f"- `mgpu_ddp` step time {step['mgpu_ddp'] / step['lightning ddp']:.2f}x Lightning's `ddp` and "
        f"{step['mgpu_ddp'] / step['plain torch DDP']:.2f}x plain torch DDP; traffic "
        f"{ledger['mgpu_ddp k=4']:.2f}x the ring all-reduce's lower bound with accumulation; the fp16 hook "
        f"{ledger['comm_hook=fp16']:.2f}x, PowerSGD rank 1 {ledger['comm_hook=powersgd (rank 1)']:.2f}x "
        f"(`{ddp['command'].split('bin/', 1)[-1]}`).\n"
        f"- ZeRO on 2 ranks: optimizer state {sharded['mgpu_zero1']['optimizer state']:.2f}x DDP's per rank; "
        f"stage 2 also {sharded['mgpu_sharded (stage 2)']['gradients']:.2f}x the gradients, stage 3 "
        f"{sharded['mgpu_zero3']['parameters']:.2f}x the parameters (`benchmarks/bench_sharded.py`).\n"
        f"- Activation checkpointing of every block: {every[0]:.3f}x the activation bytes at {every[1]:.2f}x the step "
        f"time; every other block: {every2[0]:.2f}x at {every2[1]:.2f}x (`benchmarks/bench_checkpointing.py`).\n"
        f"- Manual optimisation (a GAN) with accumulation: "
        f"{manual['ddp+find_unused naive'] / manual['mgpu_ddp']:.2f}x faster than the naive hand-written version "
        f"(`benchmarks/bench_manual_accum.py`).\n"
        f"- Adapter-only checkpoints of a LoRA GPT-2 of GPT-2 small's shape: "
        f"{adapters['all'] / adapters['trainable']:.0f}x fewer bytes than the whole model "
        f"(`benchmarks/bench_adapter_checkpoint.py`).\n"
    )


def _gpu_module(name: str) -> Any:
    """``benchmarks/gpu/<name>.py`` (no torch imported by ``proof`` and ``goals``), loaded once."""
    key = f"_gpu_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "benchmarks" / "gpu" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # a dataclass looks its module up
        spec.loader.exec_module(module)
    return sys.modules[key]


def _proof_parts() -> tuple[list[Any], int]:
    module = _gpu_module("proof")
    return list(module.parts(RESULTS, xdist=True)), module.TOTAL_S


def proof_budgets(results: Path = RESULTS) -> str:
    """The parts of ``make gpu-proof`` with their budgets today (``benchmarks/gpu/proof.py``; a part run beside
    another says so) beside what the last recorded run (``gpu_proof.json``, with its own budgets then) gave; a part
    of that run no longer in the plan is listed after."""
    module = _gpu_module("proof")
    parts, total = list(module.parts(results, xdist=True)), module.TOTAL_S
    last_path = results / "gpu_proof.json"
    last = json.loads(last_path.read_text()) if last_path.exists() else None
    ran = {p["name"]: p for p in last["parts"]} if last else {}
    when = f"{_card(last['env'])}" if last else "no run recorded"
    lines = [
        f"| part | budget today | last run, {when}: wall time / its budget then, status |",
        "|---|---|---|",
    ]

    def run(name: str) -> str:
        r = ran.get(name)
        return f"{r['wall_s']:.0f} s / {r['budget_s']} s, {r['status']}" if r else "not run"

    for part in parts:
        beside = f" (beside `{part.beside}`)" if part.beside else ""
        lines.append(f"| `{part.name}`{beside} | {part.budget_s} s | {run(part.name)} |")
    today = {p.name for p in parts}
    for name in ran:
        if name not in today and name != "profile":
            lines.append(f"| `{name}` | not in the plan today | {run(name)} |")
    last_total = f"{last['wall_s']:.0f} s / {last['total_budget_s']} s" if last else "not run"
    lines.append(f"| together | {total} s (the plan on paper: {module.plan_s(parts)} s) | {last_total} |")
    return "\n".join(lines) + "\n"


#: block name -> its rendering
TABLES: dict[str, Callable[[], str]] = {
    "gpu-summary": readme_summary,
    "gpu-proof-budgets": proof_budgets,
    "cpu-summary": readme_cpu,
}


def render_page(text: str, tables: Optional[dict[str, Callable[[], str]]] = None) -> str:
    """``text`` with every marked block replaced by its rendering (a block of an unknown name raises KeyError)."""
    tables = tables or TABLES
    return _BLOCK.sub(lambda m: m.group(1) + tables[m.group("name")]() + m.group(4), text)


def blocks(text: str) -> list[str]:
    """The names of the marked blocks in ``text``."""
    return [m.group("name") for m in _BLOCK.finditer(text)]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the marked blocks of README.md and docs/gpu.md")
    ap.add_argument("--check", action="store_true", help="exit 1 when a marked block differs from its rendering")
    args = ap.parse_args(argv)
    if not (args.write or args.check):
        for name, render in TABLES.items():
            print(f"{name}:\n{render()}")
        return 0
    stale = []
    for page in PAGES:
        text = page.read_text()
        new = render_page(text)
        if new != text:
            stale.append(page.relative_to(ROOT))
            if args.write:
                page.write_text(new)
    if stale:
        print(("rewrote: " if args.write else "stale (run with --write): ") + ", ".join(map(str, stale)))
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
