"""The one recommendation (``lightning_mgpu.planning.choice``): ``lightning-mgpu plan`` prints it first, with the
``Trainer(...)`` line that builds it, the alternatives and why each lost, and the notes on surprising figures; the
same layout has the same label in the text and the JSON; ``mgpu_auto`` takes the same answer."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from lightning_mgpu import EveryNth, MGPUDDPStrategy, MGPUPrecision, MGPUShardedStrategy
from lightning_mgpu.planning import LayoutPlan, plan_layouts
from lightning_mgpu.planning.choice import choose, decide_layout, device_memory_source, report
from lightning_mgpu.planning.cli import main
from lightning_mgpu.planning.lm import TransformerLM

# Pythia-1B's shape (width 2048, 16 layers, 8 heads, vocabulary 50304; 8 sequences of 2048 tokens per rank) on 8
# devices of 24 GiB: its data-parallel candidates fit only with activation checkpointing, and layouts of two pipeline
# stages fit without it and are faster on paper: the case where the plan used to answer twice. Nothing is allocated.
TOKENS = torch.zeros(8, 2048, dtype=torch.long, device="meta")


def _lm() -> TransformerLM:
    return TransformerLM(vocab=50304, d_model=2048, heads=8, layers=16)


def _layouts(memory: str) -> LayoutPlan:
    return plan_layouts(_lm, devices=8, device_memory=memory, batch=(TOKENS, TOKENS), precisions=("32-true",))


@pytest.fixture(scope="module")
def tight() -> LayoutPlan:
    """8 x 24 GiB: data parallelism fits with activation checkpointing only."""
    return _layouts("24GiB")


@pytest.fixture(scope="module")
def split() -> LayoutPlan:
    """Below every data-parallel peak: only layouts that split the model fit."""
    return _layouts("14GiB")


def _built(line: str) -> Any:
    """Evaluate a printed ``Trainer(...)`` line: the strategy object it builds and the Trainer's other arguments."""
    namespace = {
        "Trainer": lambda **kwargs: kwargs,
        "MGPUDDPStrategy": MGPUDDPStrategy,
        "MGPUShardedStrategy": MGPUShardedStrategy,
        "MGPUPrecision": MGPUPrecision,
        "EveryNth": EveryNth,
    }
    return eval(line, namespace)  # the line the user pastes


def _check_builds(line: str, layout: Any, devices: int) -> dict[str, Any]:
    arguments = _built(line)
    strategy = arguments["strategy"]
    assert arguments["devices"] == devices and arguments["precision"] == layout.precision
    if layout.strategy_arguments:
        assert isinstance(strategy, MGPUShardedStrategy)
        for key, value in layout.strategy_arguments.items():
            assert getattr(strategy.settings, key) == value, key
    else:
        assert isinstance(strategy, MGPUDDPStrategy) or strategy == "mgpu_ddp"
    checkpointing = strategy.launch_settings.activation_checkpointing if not isinstance(strategy, str) else None
    assert bool(checkpointing) == layout.activation_checkpointing
    return arguments


def test_the_report_names_one_recommendation_first_with_the_line_that_builds_it(tight):
    text = report(tight)
    best = choose(tight)
    assert tight.memory is not None and tight.memory.recommended is not None  # data parallelism fits, with AC
    assert not best.model_parallel and best.activation_checkpointing
    first, _, line = text.splitlines()[:3]
    assert first.startswith(f"Recommended: {best.name}, precision 32-true, activation checkpointing on")
    assert text.count("Recommended") == 1 and "recommended" not in text.split("Alternatives")[1].split("| ")[0]
    assert text.count("**<- recommended**") == 2  # the memory plan's row and the layout table's first row
    assert re.search(rf"\| 1 \| {re.escape(best.name)} \| 32-true \| yes \|.*<- recommended", text)
    _check_builds(line.strip(), best, devices=8)
    # the faster split layouts are alternatives that say why they lost
    faster = [x for x in tight.layouts if x.fits and x.buildable and x.samples_per_second > best.samples_per_second]
    assert faster and f"- {faster[0].name} (32-true): " in text
    assert "faster (estimated), but splits the model while a data-parallel layout fits" in text
    assert "does not fit: " in text  # the candidates before it in the order


def test_mgpu_auto_takes_the_same_answer(tight, split):
    for layouts in (tight, split):
        best = choose(layouts)
        decision = decide_layout(layouts)
        assert (decision.layout, decision.strategy) == (best.name, best.strategy)
        assert decision.strategy_line == layouts.strategy_line(best) and decision.strategy_line in decision.reason
        assert decision.table == report(layouts) and best.name in decision.reason
        assert layouts.recommended is best


def test_a_split_layout_is_recommended_only_when_no_data_parallel_candidate_fits_and_its_line_builds_it(split):
    assert split.memory is not None and split.memory.recommended is None
    best = choose(split)
    assert best.model_parallel and best.buildable and best.fits
    fitting = [x for x in split.layouts if x.fits and x.buildable]
    assert best is fitting[0]  # the fastest that fits
    line = split.strategy_line(best)
    arguments = _check_builds(line, best, devices=8)
    assert arguments["accumulate_grad_batches"] == 8 // best.data_parallel  # the global batch of 8 data ranks
    text = report(split)
    assert f"accumulate_grad_batches={8 // best.data_parallel} (times any of your own) keeps the global" in text


def test_the_same_layout_has_the_same_label_in_the_text_and_the_json(tight):
    assert tight.memory is not None
    rows = json.loads(tight.memory.to_json())
    layouts = json.loads(tight.to_json())
    text = report(tight)
    for row in rows:  # each data-parallel row is a layout of the layout plan, under the same label
        assert row["layout"] == f"{row['strategy']} 8"
        twin = next(
            x
            for x in layouts
            if (x["strategy"], x["precision"], x["activation_checkpointing"], x["tensor"], x["pipeline"])
            == (row["strategy"], row["precision"], row["activation_checkpointing"], 1, 1)
        )
        assert twin["name"] == row["layout"] and f"| {row['layout']} |" in text
    chosen = [x for x in layouts if x["recommended"]]
    assert len(chosen) == 1 and chosen[0]["name"] == choose(tight).name
    assert chosen[0]["strategy_line"] == tight.strategy_line(choose(tight))
    for old in ("| ddp ", "| zero2 ", "| zero3 ", "| strategy |"):  # the labels of the tables before
        assert old not in text


def test_the_figures_that_may_surprise_are_explained(tight, split):
    text = report(tight)
    assert "mgpu_sharded 8's parameters per rank" in text and "above mgpu_ddp 8's" in text
    assert "holds its own 1/8 shard of the parameters and every FSDP unit gathered whole" in text
    best = choose(split)
    if best.pipeline > 1 and best.strategy == "mgpu_ddp":
        assert "inside a pipeline stage=2 keeps whole replicas of each stage" in report(split)
    source = device_memory_source(None, torch.device("cpu"), 2)
    assert "psutil.virtual_memory().available) shared by the 2 processes on it" in source
    assert device_memory_source("8GiB", torch.device("cpu"), 2) == ""
    decision = decide_layout(tight, memory_source=source)
    assert source in decision.reason and f"per rank: {source}." in decision.table


def test_the_command_prints_the_recommendation_first(tmp_path, capsys):
    config = tmp_path / "lm.yaml"
    config.write_text(
        "model:\n  class_path: lightning_mgpu.planning.lm.TransformerLM\n"
        "  init_args: {vocab: 1024, d_model: 128, heads: 8, layers: 8}\n"
        "data:\n  class_path: lightning_mgpu.planning.lm.RandomTokens\n"
        "  init_args: {batch_size: 8, seq_len: 256, vocab: 1024}\n"
    )
    assert main(["--config", str(config), "--devices", "8", "--device-memory", "1GiB", "--precisions", "32-true"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("Recommended: mgpu_ddp 8, precision 32-true, activation checkpointing off")
    assert lines[2].strip() == "Trainer(strategy='mgpu_ddp', devices=8, precision='32-true')"
    assert out.count("Recommended") == 1
