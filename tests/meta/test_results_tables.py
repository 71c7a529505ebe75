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
