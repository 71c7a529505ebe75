"""The corpus (``tests/corpus.py``) through ``Trainer.fit`` under every preset family, ``mgpu_auto`` and the
planner: a short 2-process fit each (fork launches, float64), with parity against one process where the
mathematics allows it (DDP, ZeRO 1/2/3 and what mgpu_auto chooses: the same steps on the same global batches).
Local SGD and DiLoCo average weights every H steps instead of gradients every step: there the ranks must end
with finite weights that moved, without a reference.

The whole matrix is ``slow``; the default suite runs each model once, under a different preset per model.
A refusal by design is asserted as such (the error names the reason); every other case must train.

The unfriendly modules (``UNFRIENDLY``: datasets, loaders, a tokenizer, locks, open files, generators, lambdas,
loggers, tensors inside their own objects, a Hugging Face model with its data, lazy layers, layers made in
``configure_model``) each train under ``mgpu_auto`` (a plan, not the fallback, to the one-process weights) and are
planned by ``plan``; the two agree on the strategy and the predicted peak.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback

from lightning_mgpu import MGPUAutoStrategy, plan
from tests.corpus import MODELS, UNFRIENDLY, build
from tests.helpers import RankData, fit

#: preset family -> the launch variant the corpus uses (fork: fast on CPU)
PRESETS = {
    "mgpu_ddp": "mgpu_ddp_fork",
    "mgpu_zero1": "mgpu_zero1_notebook",
    "mgpu_sharded": "mgpu_sharded_notebook",
    "mgpu_zero3": "mgpu_zero3_notebook",
    "mgpu_local_sgd": "mgpu_local_sgd_notebook",
    "mgpu_diloco": "mgpu_diloco_notebook",
    "mgpu_auto": "mgpu_auto_notebook",
}
PARITY = {"mgpu_ddp", "mgpu_zero1", "mgpu_sharded", "mgpu_zero3", "mgpu_auto"}
BATCH, WORLD = 4, 2

_SHARDED_MANUAL = "uses manual optimization, which MGPUShardedStrategy does not support yet"
_PERIODIC_MANUAL = "needs automatic optimization"
#: (model, preset family) -> a phrase of the error the preset raises by design, before any worker starts
REFUSED: dict[tuple[str, str], str] = {
    ("two_optimizers", "mgpu_zero1"): _SHARDED_MANUAL,
    ("two_optimizers", "mgpu_sharded"): _SHARDED_MANUAL,
    ("two_optimizers", "mgpu_zero3"): _SHARDED_MANUAL,
    ("two_optimizers", "mgpu_local_sgd"): _PERIODIC_MANUAL,
    ("two_optimizers", "mgpu_diloco"): _PERIODIC_MANUAL,
}
#: model -> a phrase of the planner's refusal by design
PLAN_REFUSED = {"two_optimizers": "uses manual optimization"}

MODEL_NAMES = list(MODELS)
FAMILIES = list(PRESETS)
# the default suite: each model once, under a different family per model
DEFAULT = {(m, FAMILIES[i % len(FAMILIES)]) for i, m in enumerate(MODEL_NAMES)}


def _cases() -> list[Any]:
    cases = []
    for model in MODEL_NAMES:
        for family in FAMILIES:
            marks = [] if (model, family) in DEFAULT else [pytest.mark.slow]
            cases.append(pytest.param(model, family, marks=marks, id=f"{model}-{family}"))
    return cases


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


_REFERENCES: dict[str, torch.Tensor] = {}


def one_process(name: str) -> torch.Tensor:
    """The weights after the same training in one process on the global batch (WORLD x BATCH)."""
    if name not in _REFERENCES:
        model = build(name)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=1,
            use_distributed_sampler=False,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, datamodule=RankData({**MODELS, **UNFRIENDLY}[name][1](), WORLD * BATCH))
        _REFERENCES[name] = flat(model)
    return _REFERENCES[name]


@pytest.mark.parametrize(("name", "family"), _cases())
def test_corpus_model_trains_under_preset(name, family, tmp_path):
    if name == "hf_gpt2":
        pytest.importorskip("transformers")
    model = build(name)
    before = flat(copy.deepcopy(model))
    dataset = MODELS[name][1]()
    if (name, family) in REFUSED:
        with pytest.raises(Exception, match=REFUSED[(name, family)]):
            fit(model, PRESETS[family], tmp_path, dataset=dataset, batch_size=BATCH, max_epochs=1)
        return
    ranks = fit(model, PRESETS[family], tmp_path, dataset=dataset, batch_size=BATCH, max_epochs=1)
    steps = len(dataset) // (WORLD * BATCH)
    assert ranks[0]["global_step"] == ranks[1]["global_step"] >= steps
    for rank in ranks:
        assert torch.isfinite(rank["weights"]).all()
        assert not torch.equal(rank["weights"], before)
    if family in PARITY:
        reference = one_process(name)
        for rank in ranks:
            torch.testing.assert_close(rank["weights"], reference, rtol=1e-9, atol=1e-10)
        # the main process's module got rank 0's weights
        torch.testing.assert_close(flat(model), reference, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_the_planner_plans_every_corpus_model(name):
    if name == "hf_gpt2":
        pytest.importorskip("transformers")
    model = build(name)
    batch = next(iter(torch.utils.data.DataLoader(MODELS[name][1](), batch_size=BATCH)))
    if name in PLAN_REFUSED:
        with pytest.raises(Exception, match=PLAN_REFUSED[name]):
            plan(model, devices=WORLD, device_memory="1GiB", batch=batch)
        return
    result = plan(model, devices=WORLD, device_memory="1GiB", batch=batch)
    assert result.recommended is not None and result.recommended.strategy == "mgpu_ddp"
    assert flat(model).numel() == sum(p.numel() for p in model.parameters())  # the model was not touched


class Decision(Callback):
    """Per rank: the strategy mgpu_auto became and its decision."""

    def __init__(self, out_dir: Any) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = {"class": type(trainer.strategy).__name__, "decision": trainer.strategy.auto_decision}
        torch.save(record, self.out_dir / f"decision{trainer.global_rank}.pt")


@pytest.mark.parametrize("name", list(UNFRIENDLY))
def test_an_unfriendly_module_trains_under_mgpu_auto_and_plan_agrees(name, tmp_path):
    dataset = UNFRIENDLY[name][1]()
    strategy = MGPUAutoStrategy(start_method="fork", device_memory="1GiB")
    model = build(name)
    ranks = fit(
        model, strategy, tmp_path, dataset=dataset, batch_size=BATCH, max_epochs=1, callbacks=[Decision(tmp_path)]
    )
    records = [torch.load(tmp_path / f"decision{r}.pt", weights_only=False) for r in range(WORLD)]
    decision = records[0]["decision"]
    assert records[1]["decision"] == decision and records[0]["class"] == "MGPUDDPStrategy"
    assert decision.strategy == "mgpu_ddp" and decision.predicted_peak_bytes_per_rank > 0, decision.reason
    assert "without a memory plan" not in decision.reason
    assert type(model).__qualname__ in decision.table  # the report names the user's class
    reference = one_process(name)
    for rank in ranks:
        torch.testing.assert_close(rank["weights"], reference, rtol=1e-9, atol=1e-10)
    # the planner, on a new instance and a micro-batch of the same shape, predicts what mgpu_auto planned
    batch = next(iter(torch.utils.data.DataLoader(dataset, batch_size=BATCH)))
    result = plan(build(name), devices=WORLD, device_memory="1GiB", batch=batch, precisions=("32-true",))
    best = result.recommended
    assert best is not None
    assert (best.strategy, best.activation_checkpointing, best.predicted_peak_bytes_per_rank) == (
        decision.strategy,
        decision.activation_checkpointing,
        decision.predicted_peak_bytes_per_rank,
    )
    assert [r for r in result.table().splitlines() if r.startswith("| mgpu_ddp | no")] == [
        r for r in decision.table.splitlines() if r.startswith("| mgpu_ddp | no")
    ]
