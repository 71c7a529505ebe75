"""The figures in the README and the GPU tier's page are rendered from the results files, never typed by hand:
every marked block equals its rendering from ``benchmarks/results/`` and ``docs/_data/benchmarks.json``
(``python benchmarks/results_tables.py --write`` after a new result)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("results_tables", ROOT / "benchmarks" / "results_tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


tables = _load()


@pytest.mark.parametrize(
    ("page", "names"),
    [("README.md", ["gpu-summary", "cpu-summary"]), ("docs/gpu.md", ["gpu-proof-budgets"])],
)
def test_every_marked_block_is_its_rendering_from_the_results_files(page, names):
    text = (ROOT / page).read_text()
    assert tables.blocks(text) == names
    assert tables.render_page(text) == text, f"{page} is stale: python benchmarks/results_tables.py --write"


def test_the_readme_names_each_card_and_date_of_the_gpu_results():
    text = (ROOT / "README.md").read_text()
    devices = {
        json.loads(p.read_text())["environment"]["device"] for p in ROOT.glob("benchmarks/results/gpu-throughput-*")
    }
    newest = tables.newest_per_device("throughput")
    assert {data["environment"]["device"] for data in newest} == devices  # every card, its newest run
    for env in (data["environment"] for data in newest):
        assert f"| {env['device']} ({env['date'][:10]}) |" in text
    assert "not measured on a GPU yet" not in text.lower()


def test_a_changed_result_changes_the_rendering(tmp_path):
    """Negative control: the check fails on a page whose figure no longer matches its file."""
    results = tmp_path / "results"
    shutil.copytree(ROOT / "benchmarks" / "results", results)
    path = sorted(results.glob("gpu-throughput-*.json"))[0]
    data = json.loads(path.read_text())
    for row in data["rows"]:
        if row["runner"] == "mgpu_ddp":
            row["tokens_per_s"] *= 0.5
    path.write_text(json.dumps(data))
    readme = (ROOT / "README.md").read_text()
    assert tables.readme_summary(results) != tables.readme_summary()
    stale = tables.render_page(readme, {**tables.TABLES, "gpu-summary": lambda: tables.readme_summary(results)})
    assert stale != readme


def test_without_results_the_readme_says_how_to_measure(tmp_path):
    assert tables.readme_summary(tmp_path).startswith("Not measured on a GPU yet: `make gpu-proof`")


def test_the_newest_file_of_a_device_wins(tmp_path):
    for date, tokens in [("2026-01-01", 1.0), ("2026-02-01", 2.0)]:
        row = {"runner": "torch", "tokens_per_s": tokens, "mfu": 0.5}
        env = {"device": "GPU X", "date": f"{date}T00:00:00"}
        (tmp_path / f"gpu-throughput-GPU_X-{date}.json").write_text(json.dumps({"environment": env, "rows": [row]}))
    (newest,) = tables.newest_per_device("throughput", tmp_path)
    assert newest["environment"]["date"].startswith("2026-02-01")


def test_a_result_with_other_models_and_modes_summarises_the_368m_eager_rows(tmp_path):
    """Rows naming their model and mode (and failed cases) leave the README's figures those of the 368M model, eager:
    old files, without the fields, render as before."""
    env = {"device": "GPU X", "date": "2026-12-01T00:00:00"}
    old = [
        {"runner": "torch", "tokens_per_s": 100.0, "mfu": 0.3},
        {"runner": "mgpu_ddp", "tokens_per_s": 90.0, "mfu": 0.27},
    ]
    path = tmp_path / "gpu-throughput-GPU_X-2026-12-01T0000.json"
    path.write_text(json.dumps({"environment": env, "rows": old}))
    before = tables.readme_summary(tmp_path)
    assert "| 0.90x (90) |" in before
    new = [{**r, "model": "lm-368m", "compiled": False, "host_syncs_per_step": 0.0} for r in old] + [
        {"runner": "torch", "model": "gpt2-124m", "compiled": False, "tokens_per_s": 999.0, "mfu": 0.5},
        {"runner": "mgpu_ddp", "model": "lm-368m", "compiled": True, "tokens_per_s": 5.0, "mfu": 0.01},
        {"runner": "lightning_ddp", "model": "lm-368m", "compiled": False, "error": "RuntimeError: x"},
    ]
    path.write_text(json.dumps({"environment": env, "rows": new}))
    assert tables.readme_summary(tmp_path) == before


proof = tables._gpu_module("proof")


def _goals():
    spec = importlib.util.spec_from_file_location("throughput_goals", ROOT / "benchmarks" / "gpu" / "goals.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_gpu_proof_fits_its_total_on_paper_with_every_part():
    """The proof's rule: parts run in turn, those marked ``beside`` a part in a lane alongside it; on paper each part
    in turn takes its budget or, when longer, the budgets beside it added up, and the whole fits the 8 minutes."""
    plan = proof.parts(ROOT / "benchmarks" / "results", xdist=True)
    names = [p.name for p in plan]
    assert {"tier", "env", "planner", "memory", "throughput", "offload", "checkpoint"} <= set(names)
    assert len(names) == len(set(names))
    assert proof.plan_s(plan) <= proof.TOTAL_S == 480
    for main, side in proof.lanes(plan):
        assert main.beside is None and all(p.beside == main.name for p in side)
    # what times steps runs alone: only parts that measure versions or bytes, or fill a cache, run beside the tier
    assert {p.name: p.beside for p in plan if p.beside} == dict.fromkeys(
        ("env", "planner", "memory", "compile-warm"), "tier"
    )
    assert [p.name for p in plan if not p.required] == ["compile-warm"]


def test_the_plan_counts_a_lane_beside_a_part_by_its_longer_side():
    part = proof.Part
    plan = [part("a", 100, ()), part("b", 30, (), beside="a"), part("c", 90, (), beside="a"), part("d", 50, ())]
    assert proof.plan_s(plan) == 120 + 50
    assert [(m.name, [p.name for p in side]) for m, side in proof.lanes(plan)] == [("a", ["b", "c"]), ("d", [])]
    assert proof.plan_s(plan[1:]) == 30 + 90 + 50  # beside a part not run (--only): in turn like the others


def test_the_dry_run_lists_every_part_with_its_budget_and_says_the_plan_fits(capsys):
    assert proof.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for p in proof.parts(ROOT / "benchmarks" / "results", xdist=True):
        assert f"{p.name:<13} {p.budget_s:>4} s  " in out
    assert "only when a throughput goal is missed" in out
    assert f"total budget {proof.TOTAL_S} s; the plan takes {proof.TOTAL_S} s on paper" in out
    assert "): fits; parts: tier, env, planner, memory, compile-warm, throughput, offload, checkpoint" in out


def test_the_goals_are_met_missed_or_not_measured():
    goals = _goals()
    rows = [
        {"runner": "torch", "model": "gpt2-124m", "compiled": True, "tokens_per_s": 100.0, "mfu": 0.5},
        {"runner": "mgpu_ddp", "model": "gpt2-124m", "compiled": True, "tokens_per_s": 97.0, "mfu": 0.45},
        {"runner": "torch", "tokens_per_s": 100.0, "mfu": 0.3},  # a row written before the fields: lm-368m, eager
        {"runner": "mgpu_ddp", "tokens_per_s": 99.0, "mfu": 0.3},
        {"runner": "mgpu_zero3", "model": "gpt2-124m", "compiled": False, "error": "RuntimeError: x"},
    ]
    judged = goals.evaluate(rows)
    verdicts = [(g["goal"].split()[0], g["model"], g["mode"], g["verdict"]) for g in judged]
    assert verdicts == [
        ("mgpu_ddp", "gpt2-124m", "compiled", "missed"),
        ("mgpu_ddp", "lm-368m", "eager", "met"),
        ("mgpu_zero3", None, None, "not measured"),
        ("MFU", "gpt2-124m", "compiled", "met"),
    ]
    missed = judged[0]
    assert missed["value"] == pytest.approx(0.97)
    assert missed["profile_args"] == [
        "--rounds", "0", "--profile", "5", "--models", "gpt2-124m", "--modes", "compiled",
        "--profile-runners", "torch", "mgpu_ddp",
    ]  # fmt: skip
    assert "not measured on a GPU yet" in judged[2]["note"]
    lines = goals.lines(judged)
    assert any(
        line.strip().startswith("where the time goes: python benchmarks/gpu/bench_throughput.py") for line in lines
    )
    # on CPU the rows judge nothing
    assert {g["verdict"] for g in goals.evaluate(rows, not_judged="on CPU")} == {"not measured"}
    assert goals.evaluate([])[-1]["verdict"] == "not measured"
