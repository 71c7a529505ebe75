"""The throughput goals of the GPU proof, judged from the rows of a ``bench_throughput.py`` result: met, missed or
not measured, and for a missed goal the profile that says where the time goes.

    python benchmarks/gpu/goals.py benchmarks/results/gpu-throughput-<device>-<date>.json

The goals (one GPU, bf16-mixed; :data:`GOALS`):

* ``mgpu_ddp`` at least 0.98x the plain torch loop's tokens/s, judged for each model and mode (eager, compiled)
  that measured both;
* ``mgpu_zero3`` at least Lightning's ``FSDPStrategy``'s tokens/s (1.0x), for each model and mode that measured
  both;
* the compiled GPT-2-124M-shaped model under ``mgpu_ddp`` at least 40% MFU.

No torch here: ``proof.py`` reads the goals from the file its throughput part wrote. A row without a ``model`` or a
``compiled`` field (results written before the field existed) is the 368M model, eager.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

#: the model of rows that name none (every result before the GPT-2-124M shape was added)
DEFAULT_MODEL = "lm-368m"
#: how to measure a goal that a result does not hold
MEASURE = "python benchmarks/gpu/bench_throughput.py --cases proof --rounds 1 --warmup 3 --steps 10 (or make gpu-proof)"


@dataclass(frozen=True)
class Goal:
    """``runner`` at least ``at_least`` times ``against``'s tokens/s, or, with ``against`` None, at least
    ``at_least`` MFU; ``model`` and ``compiled`` restrict the rows judged (None: each model, each mode)."""

    name: str
    runner: str
    against: Optional[str]
    at_least: float
    model: Optional[str] = None
    compiled: Optional[bool] = None


GOALS: tuple[Goal, ...] = (
    Goal("mgpu_ddp / plain torch, tokens/s", "mgpu_ddp", "torch", 0.98),
    Goal("mgpu_zero3 / Lightning FSDPStrategy, tokens/s", "mgpu_zero3", "lightning_fsdp", 1.0),
    Goal("MFU of the compiled gpt2-124m under mgpu_ddp", "mgpu_ddp", None, 0.40, model="gpt2-124m", compiled=True),
)


def model_of(row: dict[str, Any]) -> str:
    return row.get("model", DEFAULT_MODEL)


def mode(compiled: bool) -> str:
    return "compiled" if compiled else "eager"


def measured(rows: list[dict[str, Any]]) -> dict[tuple[str, bool], dict[str, dict[str, Any]]]:
    """The rows that measured something (a failed case has an ``error`` instead), by (model, compiled) and runner,
    in the order the groups first appear."""
    out: dict[tuple[str, bool], dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r.get("tokens_per_s") is not None:
            out.setdefault((model_of(r), bool(r.get("compiled", False))), {})[r["runner"]] = r
    return out


def profile_command(model: str, compiled: bool, runners: tuple[str, ...]) -> str:
    """The profile of ``runners`` (each step's device time, kernels, host waits, the operators that differ most from
    the plain loop's) for ``model`` in one mode."""
    return (
        f"python benchmarks/gpu/bench_throughput.py --rounds 0 --profile 5 --models {model} --modes {mode(compiled)} "
        f"--profile-runners {' '.join(runners)}"
    )


def evaluate(rows: list[dict[str, Any]], not_judged: Optional[str] = None) -> list[dict[str, Any]]:
    """One entry per goal and (model, mode) judged: ``goal``, ``model``, ``mode``, ``value``, ``at_least``,
    ``verdict`` ("met", "missed", "not measured"), ``note`` and, when missed, ``profile`` (a command) and
    ``profile_args`` (its arguments to ``bench_throughput.py``). ``not_judged``: why these rows judge no goal (a run
    on CPU checks the script): every verdict is then "not measured", the values still shown."""
    groups = measured(rows)
    out: list[dict[str, Any]] = []
    for goal in GOALS:
        found = []
        for (model, compiled), by in groups.items():
            if goal.model is not None and model != goal.model:
                continue
            if goal.compiled is not None and compiled != goal.compiled:
                continue
            row = by.get(goal.runner)
            if row is None:
                continue
            if goal.against is None:
                value = row.get("mfu")
                note = "" if value is not None else "the device's dense bf16 peak is not known to the script"
            else:
                ref = by.get(goal.against)
                if ref is None:
                    continue
                value, note = row["tokens_per_s"] / ref["tokens_per_s"], ""
            found.append((model, compiled, value, note))
        if not found:
            out.append(
                {
                    "goal": goal.name,
                    "model": goal.model,
                    "mode": mode(bool(goal.compiled)) if goal.compiled is not None else None,
                    "value": None,
                    "at_least": goal.at_least,
                    "verdict": "not measured",
                    "note": f"not measured on a GPU yet: {MEASURE}",
                }
            )
            continue
        for model, compiled, value, note in found:
            verdict = "not measured" if value is None else ("met" if value >= goal.at_least else "missed")
            if not_judged and value is not None:
                verdict, note = "not measured", not_judged
            entry = {
                "goal": goal.name,
                "model": model,
                "mode": mode(compiled),
                "value": value,
                "at_least": goal.at_least,
                "verdict": verdict,
                "note": note,
            }
            if verdict == "missed":
                # the plain loop first: the profile prints where each runner's step goes beyond it
                others = (goal.against,) if goal.against not in (None, "torch") else ()
                runners = ("torch", *others, goal.runner)
                entry["profile"] = profile_command(model, compiled, runners)
                entry["profile_args"] = [
                    "--rounds",
                    "0",
                    "--profile",
                    "5",
                    "--models",
                    model,
                    "--modes",
                    mode(compiled),
                    "--profile-runners",
                    *runners,
                ]
            out.append(entry)
    return out


def lines(results: list[dict[str, Any]]) -> list[str]:
    """The goals as printed: one line each, a missed goal followed by the command of its profile."""
    out = []
    for e in results:
        if e["value"] is None:
            shown = "-"
        elif e["goal"].startswith("MFU"):
            shown = f"{e['value']:.1%} (goal >= {e['at_least']:.0%})"
        else:
            shown = f"{e['value']:.3f}x (goal >= {e['at_least']:.2f}x)"
        where = f"{e['model']} {e['mode']}" if e["model"] else "each model and mode"
        note = f"; {e['note']}" if e["note"] else ""
        out.append(f"  {e['verdict']:<13}{e['goal']}, {where}: {shown}{note}")
        if e.get("profile"):
            out.append(f"               where the time goes: {e['profile']}")
    return out


if __name__ == "__main__":
    data = json.loads(Path(sys.argv[1]).read_text())
    print("goals:")
    print("\n".join(lines(evaluate(data["rows"]))))
