"""The pipeline's pieces without processes: where the stages begin, balanced splits, micro-batches, the logged
values combined over micro-batches, and the refusal of a model whose forward does not hand a block's output to the
next block, or, with the token loss, a ``training_step`` without ``num_tokens`` (found by the probe of one forward).
"""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_mgpu import _compat
from lightning_mgpu.parts.compilation import Compilation, compiled_modules
from lightning_mgpu.parts.pipeline import (
    PipelineBackend,
    PipelineError,
    balanced_bounds,
    check_loader_batches,
    combine_logs,
    plan_stages,
    split_batch,
)
from lightning_mgpu.parts.pipeline.stages import _StageOutput


class Stack(pl.LightningModule):
    def __init__(self, between: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
        self.head = nn.Linear(4, 1)
        self.between = between

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = self.embed(batch)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if self.between and i == 1:
                x = x * 2  # changes the activation between two blocks: no stage boundary may fall here
        loss = self.head(x).pow(2).mean()
        self.log("loss", loss)
        return loss


def test_auto_split_takes_the_largest_block_container_and_balances_parameters():
    plan = plan_stages(Stack(), "auto", 2)
    assert plan.container == "blocks"
    assert plan.names == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    assert plan.bounds == ((0, 2), (2, 4)) and plan.begins() == ["blocks.2"]
    assert balanced_bounds([1, 1, 1, 1, 4], 2) == ((0, 4), (4, 5))
    assert balanced_bounds([2, 2, 2, 2, 2, 2], 3) == ((0, 2), (2, 4), (4, 6))


def test_named_split_gives_the_stages_and_a_wrong_name_is_refused_with_the_names_to_use():
    plan = plan_stages(Stack(), ["blocks.1", "blocks.3"], 3)
    assert plan.bounds == ((0, 1), (1, 3), (3, 4))
    with pytest.raises(PipelineError, match=r"no module named 'blocks\.7'.*named_modules\(\)"):
        plan_stages(Stack(), ["blocks.7"], 2)
    with pytest.raises(PipelineError, match=r"children of one nn\.Sequential or nn\.ModuleList"):
        plan_stages(Stack(), ["head"], 2)
    with pytest.raises(PipelineError, match="increasing order"):
        plan_stages(Stack(), ["blocks.3", "blocks.1"], 3)
    with pytest.raises(PipelineError, match="at least 5 children"):
        plan_stages(Stack(), "auto", 5)


def test_a_batch_is_cut_into_micro_batches_and_one_that_does_not_divide_is_refused_with_the_fix():
    batch = {"x": torch.arange(12).view(6, 2), "y": (torch.arange(6), "tag")}
    parts = split_batch(batch, 3)
    assert [p["x"].shape[0] for p in parts] == [2, 2, 2]
    assert torch.equal(torch.cat([p["y"][0] for p in parts]), torch.arange(6))
    assert all(p["y"][1] == "tag" for p in parts)
    with pytest.raises(PipelineError, match=r"batch of 6 samples.*pipeline_microbatches=4.*multiple of 4"):
        split_batch(batch, 4)


def test_a_training_loader_whose_last_batch_does_not_split_is_refused_before_its_first_batch():
    from torch.utils.data import DataLoader

    # 13 samples in batches of 4: a last batch of 1, refused naming drop_last before the epoch runs
    with pytest.raises(PipelineError, match=r"13 samples per data replica in batches of 4 leave a last batch of 1\. "):
        check_loader_batches(DataLoader(range(13), batch_size=4), m=2, batches_run=4)
    with pytest.raises(PipelineError, match=r"Pass drop_last=True"):
        check_loader_batches(DataLoader(range(13), batch_size=4), m=2, batches_run=4)
    with pytest.raises(PipelineError, match=r"give a batch of 6\. Use a batch size that is a multiple of 4"):
        check_loader_batches(DataLoader(range(12), batch_size=6), m=4, batches_run=2)
    check_loader_batches(DataLoader(range(13), batch_size=4, drop_last=True), m=2, batches_run=3)
    check_loader_batches(DataLoader(range(14), batch_size=4), m=2, batches_run=4)  # a last batch of 2 splits
    check_loader_batches(DataLoader(range(13), batch_size=4), m=2, batches_run=1)  # fast_dev_run: never reached
    check_loader_batches([torch.zeros(3)], m=2, batches_run=1)  # not a DataLoader: checked batch by batch
    check_loader_batches(DataLoader(range(4), batch_size=5), m=2, batches_run=1)  # its one batch holds 4
    with pytest.raises(PipelineError, match=r"give a batch of 3\."):
        check_loader_batches(DataLoader(range(3), batch_size=5), m=2, batches_run=1)


def test_logged_values_combine_over_micro_batches_with_their_reduce_fx():
    records = [
        [("loss", torch.tensor(1.0), {}), ("seen", 2, {"reduce_fx": "sum"})],
        [("loss", torch.tensor(3.0), {}), ("seen", 4, {"reduce_fx": "sum"})],
    ]
    combined = {name: (float(value), kwargs) for name, value, kwargs in combine_logs(records)}
    assert combined == {"loss": (2.0, {}), "seen": (6.0, {"reduce_fx": "sum"})}
    # whole numbers, a Python int and an integer tensor, reduced by their mean as Lightning reduces them: in floats
    counts = combine_logs(
        [[("seen", 2, {}), ("kept", torch.tensor(3), {})], [("seen", 5, {}), ("kept", torch.tensor(4), {})]]
    )
    assert [(name, value.item(), value.dtype) for name, value, _ in counts] == [
        ("seen", 3.5, torch.float32),
        ("kept", 3.5, torch.float32),
    ]
    with pytest.raises(PipelineError, match="reduce_fx"):
        combine_logs([[("loss", torch.tensor(1.0), {"reduce_fx": "median"})]])


def _probed(module: pl.LightningModule, split: Any, token_loss: bool = False) -> PipelineBackend:
    backend = PipelineBackend(2, "1f1b", 2, split, token_loss=token_loss)
    held = backend.held
    held.module = module
    held.plan = plan_stages(module, split, 2)
    modules = dict(module.named_modules())
    held.blocks = [modules[n] for n in held.plan.names]
    micro = split_batch(torch.randn(4, 3), 2)
    state = torch.random.get_rng_state()
    backend.runner.hooks.probe(module, micro[0], 0)
    assert torch.equal(state, torch.random.get_rng_state())  # dropout in a real step draws as without the probe
    return backend


def test_the_probe_drops_the_logs_and_keeps_the_random_state_and_the_training_mode():
    module = Stack()
    backend = _probed(module, ["blocks.2"])
    assert backend.runner.hooks.logged == {} and module.training


def test_a_forward_that_changes_the_activation_at_a_boundary_is_refused_naming_the_place():
    _probed(Stack(between=True), ["blocks.3"])  # the change is inside stage 0: fine
    with pytest.raises(PipelineError, match=r"before 'blocks\.2'.*Choose other split points"):
        _probed(Stack(between=True), ["blocks.2"])


class TokenStack(Stack):
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        return {"loss": super().training_step(batch, batch_idx) * 4, "num_tokens": torch.tensor(4)}


def test_token_loss_needs_the_count_from_training_step_refused_by_the_probe_on_every_rank():
    """``loss_normalization="tokens"``: the probe (one forward on every rank, before any stage runs) refuses a
    ``training_step`` that returns no ``num_tokens``, with the token mode's fix."""
    _probed(TokenStack(), ["blocks.2"], token_loss=True)
    with pytest.raises(ValueError, match=r"needs training_step to return \{'loss': <sum of per-token losses>"):
        _probed(Stack(), ["blocks.2"], token_loss=True)
    _probed(Stack(), ["blocks.2"])  # the plain loss: a tensor is fine


def _stage0_of_two(module: pl.LightningModule) -> PipelineBackend:
    backend = PipelineBackend(2, "1f1b", 2, "auto")
    held = backend.held
    held.module = module
    held.plan = plan_stages(module, "auto", 2)
    modules = dict(module.named_modules())
    held.blocks = [modules[n] for n in held.plan.names]
    held.local = [0]  # this rank runs stage 0: blocks.0 and blocks.1
    return backend


def test_the_other_stages_blocks_are_freed_with_their_optimizer_state_and_a_whole_checkpoint_still_loads():
    module, saved = Stack(), Stack().state_dict()
    saved = {k: v + 1 for k, v in saved.items()}  # not the module's values
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    h = module.embed(torch.randn(4, 3))
    for block in module.blocks:
        h = block(h)
    module.head(h).pow(2).mean().backward()
    optimizer.step()  # momentum for every parameter
    backend = _stage0_of_two(module)
    backend.wrap_optimizer(optimizer, None)
    shapes = {n: p.shape for n, p in module.named_parameters()}
    backend.free_blocks()
    freed = {n for n, p in module.named_parameters() if p.numel() == 0}
    assert freed == {f"blocks.{i}.{w}" for i in (2, 3) for w in ("weight", "bias")}
    assert all(module.get_parameter(n).grad is None and module.get_parameter(n) not in optimizer.state for n in freed)
    assert len(optimizer.state) == len(shapes) - len(freed)  # the kept parameters keep their momentum
    assert backend.freed_bytes() == sum(shapes[n].numel() * 4 for n in freed)
    # a whole (one process's) checkpoint: this rank keeps its own blocks and what lies outside them
    backend.load_full_model_state(module, saved, strict=True)
    for name, p in module.named_parameters():
        want = torch.empty(0) if name in freed else saved[name]
        torch.testing.assert_close(p.detach(), want, msg=name)
    with pytest.raises(RuntimeError, match=r"missing keys \['blocks\.3\.bias'\]"):
        backend.load_full_model_state(module, {k: v for k, v in saved.items() if k != "blocks.3.bias"}, strict=True)
    backend.load_full_optimizer_state(module, optimizer, optimizer.state_dict())
    assert all(module.get_parameter(n) not in optimizer.state for n in freed)


def test_weight_averaging_callbacks_are_refused_before_launch_with_the_fix():
    from pytorch_lightning.callbacks import StochasticWeightAveraging

    with pytest.raises(PipelineError, match=r"StochasticWeightAveraging under pipeline.*Remove"):
        _stage0_of_two(Stack()).check_model(Stack(), None, False, [StochasticWeightAveraging(swa_lrs=0.1)])
    from lightning_mgpu import EMA

    with pytest.raises(PipelineError, match=r"EMA under pipeline.*Remove.*mgpu_zero3"):
        _stage0_of_two(Stack()).check_model(Stack(), None, False, [EMA()])


def test_compiled_blocks_stay_compiled_when_a_stage_skips_them_and_the_stage_runs_them_compiled():
    """``compile=...`` under the pipeline: each block's forward compiled, the stage hooks eager. Stage 1 of 2 skips
    blocks 0 and 1 (a passthrough in place of their forward) and feeds block 2 the received activation: it gives
    the eager loss of blocks 2 and 3 on that activation, and afterwards every block is still compiled."""
    module = Stack()
    backend = PipelineBackend(2, "1f1b", 2, "auto")
    held, hooks = backend.held, backend.runner.hooks
    held.module, held.plan = module, plan_stages(module, "auto", 2)
    modules = dict(module.named_modules())
    held.blocks = [modules[n] for n in held.plan.names]
    names = [f"blocks.{i}" for i in range(4)]
    torch.compiler.reset()
    base = _compat.compiled_graph_count()
    assert Compilation({"backend": "aot_eager"}).compile_pipeline_blocks(module, backend.blocks()) == names
    received, batch = torch.randn(5, 4), torch.randn(5, 3)
    with hooks.logs_captured(module), hooks.stage_hooks(1, received, taken := []):
        loss = module.training_step(batch, 0)
    assert taken == [1] and compiled_modules(module) == names
    assert _compat.compiled_graph_count() > base  # blocks 2 and 3 ran compiled
    with torch.no_grad():
        torch.testing.assert_close(loss, module.head(module.blocks[3](module.blocks[2](received))).pow(2).mean())
    with hooks.logs_captured(module), hooks.stage_hooks(0, None, []), pytest.raises(_StageOutput):
        module.training_step(batch, 0)  # stage 0 stops after block 1
    assert compiled_modules(module) == names
