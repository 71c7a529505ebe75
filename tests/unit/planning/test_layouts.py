"""The layout plan (``lightning_mgpu.plan_layouts``, the layouts ``lightning-mgpu plan`` lists, ``mgpu_auto``'s
split of the model): communication per link and step times against hand-computed values, memory per rank against
the memory plan and against a model actually split into stages and tensor shards, and the choice."""

from __future__ import annotations

import json
import math
from dataclasses import fields, replace
from typing import Any, Optional

import pytest
import torch

from lightning_mgpu.parts.tensor_parallel import TensorParallelism, derive_plan
from lightning_mgpu.planning import NoPlanFits, PlanError, PlanRequest, plan_layouts
from lightning_mgpu.planning.candidates import candidate_row, estimate
from lightning_mgpu.planning.choice import choose, decide_layout, notes
from lightning_mgpu.planning.layouts import Layout, LayoutPlan, Links, estimate_layouts, group_link, short_reason
from lightning_mgpu.planning.lm import RandomTokens, TransformerLM
from lightning_mgpu.planning.measure import fake_process_group
from lightning_mgpu.planning.trace import (
    PLANNED_TENSOR_SIZE,
    ModelStates,
    StepTrace,
    count_model_states,
    tensor_split,
    trace_step,
    unit_fractions,
)
from tests.models import NormedRegressor, Regressor
from tests.parts_harness import in_forked_child
from tests.tensor_parallel_models import VOCAB, litgpt_model

# A model of 2,000 FP32 parameters (8,000 bytes), Adam (16,000 bytes of state), 4 blocks of 8 heads whose output is
# 100 bytes for the loader's batch of 4, split by tensor parallelism as a Llama block is (2 row-wise, 5 column-wise
# layers each), 1,000 bytes of activations, 3 TFLOP per step; a tensor split splits every parameter and activation
# (the share the auto plan splits is measured below, on a TransformerLM split for real).
_GIVEN = {"parameters": {"float32": 8000}, "parameter_count": 2000, "trainable_count": 2000, "trainable_bytes": 8000,
          "optimized_bytes": 8000, "buffers": 0, "optimizer_state": 16000, "optimizer_transient": 0,
          "optimizer_names": ("Adam",), "four_bit_count": 0}  # fmt: skip
STATES = ModelStates(**{f.name: _GIVEN[f.name] for f in fields(ModelStates)})
TRACE = StepTrace(
    "32-true", False, 8000, 8000, 1000, (), ((1000, 8000),), flops=3 * 10**12, blocks=4, block_output_bytes=100,
    rowwise_layers=8, colwise_layers=20, tensor_split_bytes=8000, tensor_split_activations=1000,
    tensor_divisor=8,
)  # fmt: skip
UNITS = (0.25, 0.0)
LINKS = Links(intra=100.0, inter=10.0)  # GB/s


def _plan(trace: StepTrace = TRACE, memory: Any = "1GiB", microbatches: Optional[int] = 4, **kwargs: Any) -> LayoutPlan:
    strategies = kwargs.pop("strategies", None)
    request = PlanRequest(devices=8, device_memory=memory, num_nodes=2, precisions=("32-true",),
                          **({"strategies": strategies} if strategies else {}),
                          offload=kwargs.pop("offload", False))  # fmt: skip
    result = estimate_layouts(
        "hand", request, STATES, [trace], UNITS, batch_size=4, links=kwargs.pop("links", LINKS), device_tflops=1.0,
        microbatches=microbatches, **kwargs,
    )  # fmt: skip
    result.memory = estimate("hand", request, STATES, [trace], UNITS, require_fit=False)
    return result


def _find(result: LayoutPlan, strategy: str, r: int, s: int, t: int, p: int, schedule: str = "-") -> Layout:
    return next(
        x
        for x in result.layouts
        if (x.strategy, x.data_replicate, x.data_shard, x.tensor, x.pipeline, x.schedule)
        == (strategy, r, s, t, p, schedule)
    )


# --- communication and step time: hand-computed ----------------------------------------------------------------


def test_ddp_over_two_machines_all_reduces_the_gradients_across_them():
    x = _find(_plan(), "mgpu_ddp", 1, 8, 1, 1)
    assert x.data_bytes == 14000  # 2 (8-1)/8 * 8000
    assert (x.data_link, x.intra_bytes, x.inter_bytes) == ("inter", 0, 14000)
    assert x.compute_seconds == pytest.approx(3.0)  # 3e12 FLOP at 1 TFLOP/s
    assert x.step_seconds == pytest.approx(3.0)  # the all-reduce (1.4 us at 10 GB/s) hides behind the compute
    assert x.samples_per_second == pytest.approx(4 * 8 / 3.0)


def test_zero3_gathers_twice_and_hsdp_keeps_its_shards_within_a_machine():
    flat = _find(_plan(), "mgpu_zero3", 1, 8, 1, 1)
    assert flat.data_bytes == 21000  # 2 * 7/8 * 8000 (forward and backward all-gathers) + 7/8 * 8000 (reduce-scatter)
    assert flat.inter_bytes == 21000
    hsdp = _find(_plan(), "mgpu_hsdp", 2, 4, 1, 1)
    assert (hsdp.intra_bytes, hsdp.inter_bytes) == (18000, 2000)  # 2*3/4*8000 + 3/4*8000 | 2*1/2*(8000/4)
    assert hsdp.data_link == "inter"


def test_a_tensor_and_pipeline_layout_sends_what_the_formulas_say_on_each_link():
    x = _find(_plan(), "mgpu_ddp", 1, 2, 2, 2, "1f1b")
    assert x.data_bytes == 2000  # all-reduce of the rank's quarter of the gradients over 2 data ranks: 2*1/2*2000
    assert x.tensor_bytes == 1400  # (8 forward + 20 backward all-reduces) / 2 stages * 2*1/2*100
    assert x.pipeline_bytes == 200  # the activation forward and its gradient back: 2 * 100
    # ranks: tensor innermost (stride 1), data stride 2, pipeline stride 4: machines of 4
    assert (x.tensor_link, x.data_link, x.pipeline_link) == ("intra", "intra", "inter")
    assert (x.intra_bytes, x.inter_bytes) == (3400, 200)
    assert x.bubble == pytest.approx(1 / 5)  # (P-1)/(m+P-1), P=2, m=4
    compute = 3.0 / 4
    assert x.compute_seconds == pytest.approx(compute)
    assert x.step_seconds == pytest.approx((compute + 1400 / 100e9 + 200 / 10e9) / (1 - 1 / 5))
    assert x.samples_per_second == pytest.approx(4 * 2 / x.step_seconds)


def test_activation_checkpointing_recomputes_the_tensor_all_reduces_of_the_forward():
    plain = _find(_plan(), "mgpu_ddp", 1, 2, 4, 1)
    ac = _find(_plan(replace(TRACE, activation_checkpointing=True, rowwise_recomputed=4)), "mgpu_ddp", 1, 2, 4, 1)
    assert plain.tensor_bytes == 4200  # (8 + 20) all-reduces * 2*3/4*100
    assert ac.tensor_bytes == 4800  # 4 of the 8 row-wise outputs recomputed (a block's last is not): (12 + 20) * 150
    nothing_split = _find(_plan(replace(TRACE, tensor_divisor=0)), "mgpu_ddp", 1, 8, 1, 1)
    assert nothing_split.tensor == 1
    assert all(x.tensor == 1 for x in _plan(replace(TRACE, tensor_divisor=0)).layouts)  # nothing to split
    # a tensor size that does not divide every split width (or head count) is not proposed: 2 divides 6, 4 does not
    assert {x.tensor for x in _plan(replace(TRACE, tensor_divisor=6)).layouts} == {1, 2}


def test_no_tensor_split_is_proposed_for_a_model_the_auto_plan_splits_too_little_of_and_the_plan_says_why():
    """An MLP no name rule knows, built under fake tensors (a class): the planner cannot check the structure's pairs
    (a forward of fake tensors proves no split), counts no split of it, proposes no tensor-parallel layout and says
    why in one line, with how to have them checked; a model it splits whole keeps its tensor layouts."""
    trace = trace_step(NormedRegressor, (torch.randn(4, 6), torch.randn(4, 3)), "32-true")
    assert trace.tensor_refused.startswith("the auto plan's name rules split 0% of NormedRegressor's linear layers'")
    assert "could not be checked without real weights (the model was built under fake tensors)" in trace.tensor_refused
    assert "plan(model, ...)" in trace.tensor_refused and "tensor_parallel_plan" in trace.tensor_refused
    assert trace_step(_lm, _batch(), "32-true").tensor_refused == ""
    refused = _plan(replace(TRACE, tensor_refused=trace.tensor_refused))
    assert {x.tensor for x in refused.layouts} == {1} and {x.tensor for x in _plan().layouts} > {1}
    line = f"- No tensor-parallel layout: {trace.tensor_refused}."
    assert line in notes(refused, choose(refused)) and "\n" not in line
    assert not any("tensor-parallel layout" in n for n in notes(_plan(), choose(_plan())))


def _layouts(model: Any, batch: Any, devices: int = 4) -> LayoutPlan:
    return plan_layouts(model, devices=devices, device_memory="1GiB", batch=batch, precisions=("32-true",))


@pytest.mark.parametrize("name", ["litgpt", "mlp"])
def test_the_planner_splits_by_tensor_a_model_the_launch_splits_by_its_structure(name):
    """litgpt's GPT and a plain MLP, whose layers no name rule knows: given with real weights (an instance), the
    planner derives the auto plan as the launch does (its structure paired and checked on real tensors, before the
    fake trace) and proposes tensor layouts at every size that divides what it splits; the same model built under
    fake tensors (negative control) gets none, with the reason."""
    if name == "litgpt":
        model, batch, divisor = litgpt_model(), (torch.randint(VOCAB, (4, 8)),), 4  # 4 heads of 4 columns
    else:
        model, batch, divisor = Regressor(hidden=16), (torch.randn(4, 6), torch.randn(4, 3)), 16
    split = tensor_split(model, real=True)
    launch = derive_plan(model, tensor_size=PLANNED_TENSOR_SIZE)  # what TensorParallelism.plan_for derives
    assert dict(split.kinds) == {n: k.replace("colwise packed", "colwise") for n, k in launch.kinds().items()}
    assert len(split.kinds) >= 2 and split.refused == "" and split.divisor == divisor
    assert split.parameters == tuple(launch.split_parameters(model))
    result = _layouts(model, batch)
    assert {x.tensor for x in result.layouts} == {1, 2, 4} and result.tensor_note == ""
    named = dict(model.named_parameters())
    trace = next(t for t in _traces(model, batch))
    assert trace.tensor_split_bytes == sum(named[n].numel() * 4 for n in split.parameters) > 0
    assert trace.tensor_divisor == divisor and trace.tensor_refused == ""
    fake = _layouts(type(model) if name == "mlp" else litgpt_model, batch)  # built under fake tensors
    assert {x.tensor for x in fake.layouts} == {1}
    assert "could not be checked without real weights" in fake.tensor_note


def _traces(model: Any, batch: Any) -> list[StepTrace]:
    from lightning_mgpu.planning import _traced

    request = PlanRequest(devices=4, device_memory="1GiB", precisions=("32-true",))
    return _traced(model, request, batch, None)[2]


def test_a_model_its_structure_cannot_split_is_refused_with_the_launchs_reason():
    """The hidden units normalised between the two layers: with real weights the structure is asked too and pairs
    nothing, so the planner refuses a tensor layout for the launch's reason (which refuses it too)."""
    model = NormedRegressor()
    result = _layouts(model, (torch.randn(4, 6), torch.randn(4, 3)))
    assert {x.tensor for x in result.layouts} == {1}
    assert result.tensor_note == (
        "No tensor-parallel layout: the auto plan at tensor size 2 splits 0% of NormedRegressor's linear layers' "
        "parameters, under the 50% it needs (neither its name rules nor its structure pair more)."
    )
    with pytest.raises(ValueError, match="under the 50% it needs"):
        TensorParallelism(size=2).check_before_launch(model)


def test_a_model_on_the_meta_device_keeps_the_name_rules_and_says_how_to_have_its_structure_checked():
    """litgpt's GPT built on the meta device (too big to build): no forward proves a split, so the planner keeps
    the name rules (which split none of it) and says the structure's pairs could not be checked, and how."""
    with torch.device("meta"):
        model = litgpt_model()
    split = tensor_split(model, real=True)
    assert split.kinds == () and split.divisor == 0
    assert split.refused.startswith("the auto plan's name rules split 0% of GPT's linear layers' parameters")
    assert "could not be checked without real weights (the model was built on the meta device)" in split.refused
    assert "tensor_parallel_plan of your own" in split.refused
    result = _layouts(model, (torch.randint(VOCAB, (4, 8), device="meta"),))
    assert {x.tensor for x in result.layouts} == {1} and split.refused in result.tensor_note


def test_the_bubble_and_in_flight_activations_of_1f1b_and_gpipe():
    result = _plan()
    one = _find(result, "mgpu_ddp", 1, 2, 2, 2, "1f1b")
    gpipe = _find(result, "mgpu_ddp", 1, 2, 2, 2, "gpipe")
    assert one.bubble == gpipe.bubble == pytest.approx(1 / 5)
    # A * k / (m P T): 1F1B keeps min(P, m) = 2 micro-batches in flight on the first stage, GPipe all m = 4
    assert (one.activations_bytes, gpipe.activations_bytes) == (125, 250)
    # the rest of the peak is the memory plan's mgpu_ddp row on a quarter of the model (2,000 bytes of weights)
    assert (one.parameters_bytes, one.gradients_bytes, one.optimizer_state_bytes) == (2000, 2000, 4000)
    assert one.predicted_peak_bytes_per_rank == 2000 + 2000 + 4000 + 125 + 2000  # + one bucket of the gradients
    four = _find(result, "mgpu_ddp", 1, 2, 1, 4, "gpipe")
    assert four.bubble == pytest.approx(3 / 7)


def test_fsdp_under_a_pipeline_keeps_its_units_gathered_and_its_gradients_whole_until_the_last_micro_batch():
    x = _find(_plan(), "mgpu_zero3", 1, 4, 1, 2, "1f1b")
    # the rank's half of the model: 4,000 bytes of weights and of gradients, over 4 shards; ZeRO-2's memory (the
    # shard 1,000 + the gathered 4,000; optimizer 16,000 / 2 / 4; activations 1,000 * 2 / (4 * 2); the largest
    # unit's reduce-scatter, half the piece: 2,000 + 500) and the whole 4,000 bytes of gradients
    assert (x.parameters_bytes, x.gradients_bytes, x.optimizer_state_bytes) == (5000, 4000, 2000)
    assert (x.activations_bytes, x.communication_bytes) == (250, 2500)
    assert x.predicted_peak_bytes_per_rank == 5000 + 4000 + 2000 + 250 + 2500
    assert x.data_bytes == 3000 + 3000  # one all-gather of the weights and one reduce-scatter per step


def test_sizes_are_kept_to_what_the_model_and_the_machines_allow():
    layouts = _plan().layouts
    assert max(x.tensor for x in layouts) == 4  # machines of 4: tensor stays within one
    assert max(x.pipeline for x in layouts) == 4  # 4 blocks
    assert max(x.tensor for x in _plan(tensor_across_machines=True).layouts) == 8
    short = _plan(microbatches=2).layouts
    assert not [x for x in short if x.pipeline == 4 and x.schedule == "1f1b"]  # 1F1B needs m >= P
    assert [x for x in short if x.pipeline == 4 and x.schedule == "gpipe"]
    assert group_link(4, 2, 8) == "intra" and group_link(4, 4, 8) == "inter"


def test_layouts_that_fit_come_first_fastest_first():
    result = _plan(memory=700_000)
    fits = [x.fits for x in result.layouts]
    assert fits == sorted(fits, reverse=True)
    speeds = [x.samples_per_second for x in result.layouts if x.fits]
    assert all(a >= b * (1 - 1e-5) for a, b in zip(speeds, speeds[1:]))  # ties (to 6 digits): the cheaper first
    assert result.best is next(x for x in result.layouts if x.fits and x.buildable)


def test_link_names_and_speeds_are_checked():
    assert Links.of("pcie", 25) == Links(32.0, 25.0)
    with pytest.raises(PlanError, match=r"intra_node_link='nvlnk' is not a known link.*'nvlink'"):
        Links.of("nvlnk")
    with pytest.raises(PlanError, match=r"schedules=\('zb',\)"):
        _plan(schedules=("zb",))


# --- memory: the memory plan's rows, and a model actually split ------------------------------------------------


def _lm() -> TransformerLM:
    return TransformerLM(vocab=512, d_model=64, heads=4, layers=4)


def _batch() -> Any:
    data = RandomTokens(batch_size=4, seq_len=32, vocab=512)
    data.setup("fit")
    return next(iter(data.train_dataloader()))


_LM: dict[str, LayoutPlan] = {}


def _lm_plan() -> LayoutPlan:
    if "plan" not in _LM:
        _LM["plan"] = plan_layouts(_lm, devices=2, device_memory="8GiB", batch=_batch(), precisions=("32-true",))
    return _LM["plan"]


def test_without_a_split_each_layout_is_the_memory_plans_row():
    result = _lm_plan()
    assert result.memory is not None
    for strategy in ("mgpu_ddp", "mgpu_zero1", "mgpu_sharded", "mgpu_zero3"):
        for ac in (False, True):
            row = result.memory.row(strategy, "32-true", ac)
            x = next(
                x
                for x in result.layouts
                if (x.strategy, x.activation_checkpointing, x.tensor, x.pipeline) == (strategy, ac, 1, 1)
            )
            assert x.predicted_peak_bytes_per_rank == row.predicted_peak_bytes_per_rank
            assert x.activations_bytes == row.activations_bytes


def _bytes(params: Any) -> int:
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in params)


def test_a_pipeline_stage_holds_the_parameters_the_plan_gives_a_rank():
    # a rank of a pipeline holds its stage's blocks and every weight outside the blocks (the embedding, the final
    # norm, the head: parts/pipeline/ frees only the other stages' blocks)
    x = next(x for x in _lm_plan().layouts if (x.tensor, x.pipeline, x.activation_checkpointing) == (1, 2, False))
    model = _lm()
    outside = [*model.embed.parameters(), *model.norm.parameters(), *model.head.parameters()]
    measured = max(_bytes([*stage.parameters(), *outside]) for stage in (model.blocks[:2], model.blocks[2:]))
    assert x.parameters_bytes == measured, (x.parameters_bytes, measured)
    # negative control: the stages split as if the embedding went with the first and the head with the last
    split = [[*model.embed.parameters(), *model.blocks[:2].parameters()], [*model.blocks[2:].parameters(),
             *model.norm.parameters(), *model.head.parameters()]]  # fmt: skip
    assert abs(max(_bytes(stage) for stage in split) - measured) > 0.15 * measured


class _WideVocabulary(TransformerLM):
    """Most of its weights in the embedding and the head; SGD with momentum (one buffer per parameter, no step
    counter), so that the optimizer state has a hand-computed size."""

    def __init__(self) -> None:
        super().__init__(vocab=4096, d_model=16, heads=2, layers=4)

    def configure_optimizers(self) -> Any:
        import torch

        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_zero3_in_a_pipeline_keeps_the_weights_outside_the_blocks_whole_on_every_rank():
    # ZeRO-3 over 2 data ranks x 2 stages: each stage's blocks sharded over its data ranks (kept gathered from the
    # first micro-batch to the last), the embedding, final norm and head whole on every rank with their whole
    # gradients and momentum (parts/pipeline/: only the stages' blocks are FSDP units)
    data = RandomTokens(batch_size=4, seq_len=8, vocab=4096)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    result = plan_layouts(_WideVocabulary, devices=4, device_memory="8GiB", batch=batch, precisions=("32-true",),
                          strategies=("mgpu_zero3",), pipeline_schedules=("1f1b",))  # fmt: skip
    x = next(x for x in result.layouts if (x.strategy, x.data_shard, x.pipeline, x.activation_checkpointing)
             == ("mgpu_zero3", 2, 2, False))  # fmt: skip
    model = _WideVocabulary()
    outside = _bytes([*model.embed.parameters(), *model.norm.parameters(), *model.head.parameters()])
    stage = _bytes(model.blocks[:2].parameters())  # the two stages' blocks are the same size
    assert outside > 4 * stage
    assert x.buildable and x.strategy_arguments["stage"] == 3
    assert x.parameters_bytes == stage // 2 + stage + outside  # the shard, the gathered stage, the outside weights
    assert x.optimizer_state_bytes == stage // 2 + outside  # momentum of the shard and of the outside weights
    assert x.model_states_bytes == 3 * (stage // 2) + 3 * outside  # between steps: shards, and the outside whole
    # negative control: the outside weights counted as the blocks are (split by the stages, sharded by the data)
    trace = trace_step(_WideVocabulary, batch, "32-true")
    assert trace.outside_parameters == outside
    request = PlanRequest(devices=4, device_memory="8GiB", precisions=("32-true",), strategies=("mgpu_zero3",))
    states, units = count_model_states(_WideVocabulary), unit_fractions(_WideVocabulary)
    old = estimate_layouts("lm", request, states, [replace(trace, outside_parameters=0)], units, batch_size=4,
                           schedules=("1f1b",))  # fmt: skip
    y = next(y for y in old.layouts if (y.data_shard, y.pipeline, y.tensor) == (2, 2, 1))
    assert x.parameters_bytes - y.parameters_bytes > 0.2 * x.parameters_bytes
    assert y.optimizer_state_bytes < 0.5 * x.optimizer_state_bytes


def test_a_tensor_split_counts_what_the_auto_plan_splits_as_a_rank_holds_it_under_zero3():
    # tensor 2 x data 2: the auto plan splits each block's MLP (linear1, linear2; linear2's bias stays whole); the
    # packed attention, the norms, the embedding and the head stay replicated over the tensor group; ZeRO-3 then
    # shards everything over the data group
    # in a forked child: torch's DTensor caches would leak into later forked tests
    split, states, counters = in_forked_child(_held_under_tensor_2_data_2, timeout=240)
    result = plan_layouts(_lm, devices=4, device_memory="8GiB", batch=_batch(), precisions=("32-true",),
                          strategies=("mgpu_zero3",), pipeline_schedules=("1f1b",))  # fmt: skip
    x = next(
        x
        for x in result.layouts
        if (x.tensor, x.data_shard, x.pipeline, x.activation_checkpointing) == (2, 2, 1, False)
    )
    trace = trace_step(_lm, _batch(), "32-true")  # the trace the layout above was estimated from
    assert trace.tensor_split_bytes == split  # the parameters the plan shards over the tensor group, to the byte
    # parameters, gradients and Adam's moments to the byte; Adam's step counters (a 4-byte scalar per parameter,
    # whole on every rank) are shared out as the rest of the optimizer state is: the one approximation here
    assert abs(x.model_states_bytes - states) <= counters < 0.01 * states, (x.model_states_bytes, states, counters)
    # negative control: every parameter split by the tensor size (the count before the plan was read) is far off
    everything = replace(trace, tensor_split_bytes=trace.parameters, tensor_split_activations=trace.activations)
    request = PlanRequest(devices=4, device_memory="8GiB", precisions=("32-true",), strategies=("mgpu_zero3",))
    states_, units = count_model_states(_lm), unit_fractions(_lm)
    old = estimate_layouts("lm", request, states_, [everything], units, batch_size=4, schedules=("1f1b",))
    y = next(y for y in old.layouts if (y.tensor, y.data_shard, y.pipeline) == (2, 2, 1))
    assert abs(y.model_states_bytes - states) > 0.2 * states, (y.model_states_bytes, states)
    assert x.activations_bytes > y.activations_bytes  # the residual stream and the norms' activations stay whole


def _held_under_tensor_2_data_2() -> tuple[int, int, int]:
    # one process, torch's fake backend: rank 0 of tensor 2 x data 2, split and sharded as mgpu_zero3 with
    # tensor_parallel_size=2 lays it out, then one AdamW step
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    from lightning_mgpu.parts.sharding import local_bytes
    from lightning_mgpu.parts.tensor_parallel import TensorParallelism

    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
        model = _lm()
        TensorParallelism(size=2).apply(model, mesh["tensor_parallel"])
        split = sum(
            p.numel() * p.element_size()
            for p in model.parameters()
            if isinstance(p, DTensor) and any(isinstance(q, Shard) for q in p.placements)
        )
        for block in model.blocks:
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(model, mesh=mesh["data_parallel"])
        optimizer = model.configure_optimizers()
        tokens, targets = _batch()
        model.training_step((tokens, targets), 0).backward()
        optimizer.step()
        params = list(model.parameters())
        held = sum(local_bytes(p) + local_bytes(p.grad) for p in params)
        moments = sum(local_bytes(v) for s in optimizer.state.values() for k, v in s.items() if k != "step")
        counters = sum(local_bytes(s["step"]) for s in optimizer.state.values())
    assert all(isinstance(p, DTensor) for p in params) and torch.is_tensor(params[0].grad)
    return split, held + moments + counters, counters


# --- the table, the command and mgpu_auto's choice --------------------------------------------------------------


def test_the_command_lists_the_layouts_after_the_memory_plan(capsys):
    pytest.importorskip("jsonargparse")  # the command's parser (installed with the package; absent on a bare tier)
    from lightning_mgpu.cli import main as cli_main

    assert cli_main(["plan", "--config", "configs/ddp.yaml", "--devices", "4", "--device-memory", "1GiB",
                     "--precisions", "32-true", "--top", "3"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "| mgpu_ddp 4 |" in out and "Layouts (data replicate x data shard x tensor x pipeline)" in out
    assert "| 1 | " in out and "| 4 | " not in out  # --top 3
    assert cli_main(["plan", "--config", "configs/ddp.yaml", "--devices", "4", "--device-memory", "1GiB",
                     "--precisions", "32-true", "--layouts", "--json"]) == 0  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    assert {(r["tensor"], r["pipeline"]) for r in rows} >= {(1, 1), (1, 2), (1, 4)}  # no attention: no tensor split
    assert {"intra_bytes", "inter_bytes", "bubble", "step_seconds", "activations_bytes", "name"} <= set(rows[0])


def test_the_command_proposes_a_pipeline_when_no_data_parallel_candidate_fits(capsys):
    pytest.importorskip("jsonargparse")
    from lightning_mgpu.cli import main as cli_main

    assert cli_main(["plan", "--config", "configs/ddp.yaml", "--devices", "4", "--device-memory", "3MiB",
                     "--precisions", "32-true"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    first = out.splitlines()[0]  # the one recommendation, first: a pipeline, and why
    assert first.startswith("Recommended: ") and " x pp " in first and "No data-parallel candidate fits" in first
    with pytest.raises(SystemExit) as exit_:  # nothing fits at all: the memory plan's error, as before
        cli_main(["plan", "--config", "configs/ddp.yaml", "--devices", "4", "--device-memory", "64KiB",
                  "--precisions", "32-true"])  # fmt: skip
    assert exit_.value.code == 2 and "no candidate fits" in capsys.readouterr().err


def _sizes(layout: Layout) -> Optional[dict[str, Any]]:
    """Builds every layout (a strategy that takes every option)."""
    return {
        "stage": layout.stage or 1,
        "tensor_parallel_size": layout.tensor,
        "pipeline_parallel_size": layout.pipeline,
    }


def test_mgpu_auto_splits_the_model_only_when_no_data_parallel_candidate_fits_and_the_strategy_builds_it():
    roomy = decide_layout(_plan(), _sizes)
    assert (roomy.strategy, roomy.tensor_parallel_size, roomy.pipeline_parallel_size) == ("mgpu_ddp", 1, 1)
    assert roomy.strategy_arguments == {}
    tight = replace(TRACE, activations=10**6, timeline=((10**6, 8000),))
    both = decide_layout(_plan(tight, memory=700_000), _sizes)
    assert both.tensor_parallel_size > 1 or both.pipeline_parallel_size > 1
    assert both.stage is not None and "No data-parallel candidate fits" in both.reason
    assert both.strategy_arguments["tensor_parallel_size"] == both.tensor_parallel_size

    def pipelines_only(layout: Layout) -> Optional[dict[str, Any]]:
        return _sizes(layout) if layout.tensor == 1 else None

    pipeline = decide_layout(_plan(tight, memory=700_000), pipelines_only)
    # 2 stages fit (1F1B: 2 of the 4 micro-batches in flight, a quarter of the activations) with less bubble than 4
    assert (pipeline.tensor_parallel_size, pipeline.pipeline_parallel_size) == (1, 2)
    with pytest.raises(NoPlanFits, match=r"would fit, but MGPUShardedStrategy here cannot build it"):
        decide_layout(_plan(tight, memory=700_000), lambda layout: None)


def test_mgpu_auto_builds_a_layout_with_the_keywords_the_sharded_settings_accept():
    import lightning_mgpu.strategies.auto as auto

    result = _plan()
    tensor2 = _find(result, "mgpu_zero3", 1, 4, 2, 1)
    assert auto.layout_arguments(tensor2) == {"stage": 3, "tensor_parallel_size": 2}
    # DDP-style replicas with a tensor split: stage 1 refuses tensor parallelism, stage 2 would shard the data
    ddp_tensor = _find(result, "mgpu_ddp", 1, 4, 2, 1)
    assert auto.layout_arguments(ddp_tensor) is None
    assert "tensor_parallel_size=2 needs FSDP2" in ddp_tensor.not_buildable
    pipeline_tensor = _find(result, "mgpu_ddp", 1, 2, 2, 2, "1f1b")
    assert auto.layout_arguments(pipeline_tensor) == {
        "stage": 2, "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "pipeline_microbatches": 4,
        "pipeline_schedule": "1f1b",
    }  # fmt: skip
    # ZeRO-3 over the data dimension with tensor parallelism inside the pipeline: built too
    zero3_tensor = _find(result, "mgpu_zero3", 1, 2, 2, 2, "1f1b")
    assert auto.layout_arguments(zero3_tensor) == {
        "stage": 3, "tensor_parallel_size": 2, "pipeline_parallel_size": 2,
        "pipeline_microbatches": zero3_tensor.microbatches, "pipeline_schedule": "1f1b",
    }  # fmt: skip
    # pipeline stages with DDP-style replicas or ZeRO-3 over the data dimension, not ZeRO-1 or ZeRO-2
    pipelined = {"pipeline_parallel_size": 2, "pipeline_microbatches": 4, "pipeline_schedule": "1f1b"}
    zero3 = _find(result, "mgpu_zero3", 1, 4, 1, 2, "1f1b")
    assert auto.layout_arguments(zero3) == {"stage": 3, **pipelined, "pipeline_microbatches": zero3.microbatches}
    replicas = _find(result, "mgpu_ddp", 1, 4, 1, 2, "1f1b")
    assert auto.layout_arguments(replicas) == {"stage": 2, **pipelined, "pipeline_microbatches": replicas.microbatches}
    zero2 = _find(result, "mgpu_sharded", 1, 4, 1, 2, "1f1b")
    assert auto.layout_arguments(zero2) is None
    assert "stage=2 builds whole replicas over the data dimension here, not ZeRO-2 shards" in zero2.not_buildable
    assert auto.layout_arguments(_find(result, "mgpu_zero1", 1, 4, 1, 2, "1f1b")) is None
    # a data-parallel layout: mgpu_ddp itself (no sharded keywords), the others at their stage
    assert auto.layout_arguments(_find(result, "mgpu_ddp", 1, 8, 1, 1)) == {}
    hsdp = {"stage": 3, "mesh": "hybrid", "shard_size": 4}  # the planner's shard group, passed on
    assert auto.layout_arguments(_find(result, "mgpu_hsdp", 2, 4, 1, 1)) == hsdp
    # HSDP inside a pipeline builds (stage=3 on a hybrid mesh); no master precision inside a pipeline does
    from dataclasses import replace

    from lightning_mgpu.planning.layouts import sharded_arguments

    staged = replace(zero3, strategy="mgpu_hsdp", data_replicate=2, data_shard=2)
    assert sharded_arguments(staged) == {
        "stage": 3, "mesh": "hybrid", "shard_size": 2, **pipelined, "pipeline_microbatches": zero3.microbatches
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"MGPUPrecision\('bf16-master'\) with pipeline_parallel_size=2 is not"):
        sharded_arguments(replace(zero3, precision="bf16-master"))
    assert sharded_arguments(replace(_find(result, "mgpu_ddp", 1, 8, 1, 1), precision="bf16-master")) == {}


def test_buildability_is_what_the_sharded_settings_say(monkeypatch):
    """No list of refused combinations in the planner: a rule the settings drop (or add) changes which layouts
    build. Here the settings are made to accept ZeRO-3 with tensor parallelism inside a pipeline, then to refuse
    every pipeline."""
    import lightning_mgpu.planning.layouts as layouts
    from lightning_mgpu.settings import ShardedSettings

    class Accepting(ShardedSettings):
        def _check_pipeline(self) -> None:
            if self.tensor_parallel_size > 1 and self.stage == 3:
                return
            super()._check_pipeline()

    monkeypatch.setattr(layouts, "ShardedSettings", Accepting)
    x = _find(_plan(), "mgpu_zero3", 1, 2, 2, 2, "1f1b")
    assert x.buildable and x.strategy_arguments["stage"] == 3

    class Refusing(ShardedSettings):
        def _check_pipeline(self) -> None:
            if self.pipeline_parallel_size > 1:
                raise ValueError("pipeline_parallel_size is refused here: for this test")

    monkeypatch.setattr(layouts, "ShardedSettings", Refusing)
    assert not any(x.buildable for x in _plan().layouts if x.pipeline > 1)
    assert all(x.buildable for x in _plan().layouts if x.pipeline == 1 and x.strategy != "mgpu_ddp" and x.tensor == 1)


def _zero2_pipelines_fastest(**kwargs: Any) -> LayoutPlan:
    """A plan whose fastest layout that fits is ZeRO-2 (or ZeRO-1) inside a pipeline, which the strategy does not
    build: the activations fit only split into stages, the link within a machine is slow enough for a tensor
    split's all-reduces to show (the data dimension's collectives still hide behind the compute), 4 stages idle
    longer than 2, and the memory lies between the peak of ZeRO-2 over 4 data ranks x 2 stages and that of whole
    replicas (DDP, as fast, ranked first where it fits)."""
    tight, slow = replace(TRACE, activations=10**6, timeline=((10**6, 8000),)), Links(intra=1e-3, inter=10.0)
    roomy = _plan(tight, links=slow)
    ddp, zero2 = (
        _find(roomy, s, 1, 4, 1, 2, "1f1b").predicted_peak_bytes_per_rank for s in ("mgpu_ddp", "mgpu_sharded")
    )
    assert zero2 < ddp
    return _plan(tight, memory=math.ceil((zero2 + ddp) / 2 / 0.9), links=slow, **kwargs)


def test_a_layout_the_settings_refuse_is_never_best_and_the_table_says_why(monkeypatch):
    result = _zero2_pipelines_fastest()
    fastest = next(x for x in result.layouts if x.fits)
    assert not fastest.buildable and fastest.pipeline > 1 and fastest.strategy in ("mgpu_zero1", "mgpu_sharded")
    best = result.best
    assert best is not None and best.buildable and best.fits
    assert all(not x.buildable for x in result.layouts[: result.layouts.index(best)] if x.fits)
    table = result.table(top=3)
    assert f"| 1 | {best.name} |" in table and "| 4 |" not in table  # the first row is the best
    assert f"- {fastest.name} ({fastest.strategy}" in table and "not buildable: " in table
    assert short_reason(fastest.not_buildable) in table
    assert f"| {fastest.name} |" not in table
    assert "of 42 layouts fit and 10 of those are buildable" in table  # ZeRO-3 x tensor x pipeline among them
    # negative control: every layout taken as buildable, the refused one would have been chosen
    import lightning_mgpu.planning.layouts as layouts

    monkeypatch.setattr(layouts, "sharded_arguments", lambda layout: {})
    unfiltered = _zero2_pipelines_fastest()
    assert unfiltered.best is not None
    assert (unfiltered.best.name, unfiltered.best.strategy) == (fastest.name, fastest.strategy)
    assert "Not buildable" not in unfiltered.table() and f"| 1 | {fastest.name} |" in unfiltered.table()


def test_mgpu_auto_never_takes_a_refused_layout():
    import lightning_mgpu.strategies.auto as auto

    result = _zero2_pipelines_fastest()
    fastest = next(x for x in result.layouts if x.fits)
    assert result.best is not None
    decision = decide_layout(result, auto.layout_arguments)
    assert decision.strategy_arguments == result.best.strategy_arguments
    assert decision.stage not in (fastest.stage, None)
    # negative control: a builder that builds every layout takes the refused one
    assert decide_layout(result, _sizes).strategy_arguments["stage"] == fastest.stage
    # nothing buildable fits (no tensor split, so no layout of one data rank): the error gives the settings' reason
    only_zero2 = _zero2_pipelines_fastest(strategies=("mgpu_sharded",), max_tensor=1)
    with pytest.raises(NoPlanFits, match=r"would fit, but MGPUShardedStrategy here cannot build it \(stage=2 builds"):
        decide_layout(only_zero2, auto.layout_arguments)


def test_flops_of_a_traced_step_count_the_matrix_products_and_the_recomputation():
    result = _lm_plan()
    traced = {x.activation_checkpointing: x for x in result.layouts if (x.tensor, x.pipeline) == (1, 1)}
    n = sum(p.numel() for name, p in _lm().named_parameters() if not name.startswith("embed"))
    tokens = 4 * 32
    flops = traced[False].compute_seconds * result.device_tflops * 1e12
    assert 6 * n * tokens <= flops <= 1.2 * 6 * n * tokens  # 6 N per token, plus attention's products
    assert traced[True].compute_seconds > traced[False].compute_seconds  # the recomputed forward
    assert math.isclose(result.batch_size, 4)


def test_the_benchmarks_llama_stand_in_is_split_as_llama_and_has_the_published_parameter_count(monkeypatch):
    """``benchmarks/bench_layouts.py`` plans the published Llama runs with ``LlamaLM``: its auto tensor-parallel plan
    splits every block's query, key, value, output, gate, up and down projections (only the embedding, the norms
    and the head whole), and each size holds the published parameters (8B, 70B, 405B) within 2%."""
    import importlib.util
    import sys
    from pathlib import Path

    import torch

    from lightning_mgpu.parts.tensor_parallel import derive_plan

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_layouts.py"
    spec = importlib.util.spec_from_file_location("bench_layouts", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    for name, shape in bench.SHAPES.items():
        with torch.device("meta"):
            model = bench.LlamaLM(shape, bench.VOCAB)
        count = sum(p.numel() for p in model.parameters())
        assert abs(count / (float(name.removesuffix("B")) * 1e9) - 1) < 0.02, (name, count)
        split = set(derive_plan(model, 8).split_parameters(model))
        layers = [f"attention.w{n}" for n in "qkvo"] + [f"feed_forward.w{n}" for n in "132"]
        expected = {f"layers.{i}.{n}.weight" for i in range(shape.layers) for n in layers}
        assert split == expected, (name, sorted(split ^ expected)[:4])
        whole = {n for n, _ in model.named_parameters()} - split
        assert all(n.startswith(("tok_embeddings.", "output.", "norm.")) or "_norm." in n for n in whole), name


def test_offload_keeps_shards_gradients_and_optimizer_state_on_the_host_and_counts_the_transfers():
    """``offload=True`` plans the sharded rows as FSDP2's ``CPUOffloadPolicy`` runs them (the module docstring's
    8,000 bytes of parameters and of gradients, 16,000 of Adam's state, over 8 ranks): the device keeps what is
    gathered to compute, the host a rank's shards, gradient shards and optimizer state, and each micro-batch moves
    the shards to the device twice (forward and backward) and the gradient shards back. Against the same row
    without offload (the control), and the host memory checked per machine."""
    n = 8
    off = PlanRequest(devices=n, device_memory="1GiB", precisions=("32-true",))
    on = PlanRequest(devices=n, device_memory="1GiB", precisions=("32-true",), offload=True)
    without = candidate_row("mgpu_zero3", STATES, TRACE, UNITS, off, off.usable_bytes)
    row = candidate_row("mgpu_zero3", STATES, TRACE, UNITS, on, on.usable_bytes)
    assert (without.optimizer_state_bytes, without.host_bytes, without.transfer_bytes) == (16000 // n, 0, 0)
    assert row.parameters_bytes == without.parameters_bytes - 8000 // n  # the shard is on the host
    assert row.gradients_bytes == row.optimizer_state_bytes == 0
    assert (row.activations_bytes, row.communication_bytes) == (without.activations_bytes, without.communication_bytes)
    assert row.host_bytes == (8000 + 8000 + 16000) // n and row.transfer_bytes == 3 * 8000 // n
    assert row.transfer_seconds == pytest.approx(3000 / 32e9)  # PCIe 4.0 x16
    assert candidate_row("mgpu_ddp", STATES, TRACE, UNITS, on, on.usable_bytes).host_bytes == 0  # DDP does not offload
    # mgpu_sharded keeps every unit gathered from forward to backward: one gather's transfer per micro-batch
    assert candidate_row("mgpu_sharded", STATES, TRACE, UNITS, on, on.usable_bytes).transfer_bytes == 2 * 8000 // n
    # the host memory of one machine is shared by its 8 ranks, less the headroom
    for host, fits in ((int(n * 4000 / 0.9) + n, True), (n * 4000, False)):
        checked = PlanRequest(devices=n, device_memory="1GiB", precisions=("32-true",), offload=True, host_memory=host)
        assert candidate_row("mgpu_zero3", STATES, TRACE, UNITS, checked, checked.usable_bytes).fits is fits
    # the layouts: the transfers lengthen the step; a layout that splits the model is not buildable offloaded
    plain, offloaded = _plan(), _plan(offload=True)
    flat, flat_off = _find(plain, "mgpu_zero3", 1, 8, 1, 1), _find(offloaded, "mgpu_zero3", 1, 8, 1, 1)
    assert flat_off.host_bytes == 4000 and flat.host_bytes == 0
    assert flat_off.step_seconds == pytest.approx(flat.step_seconds + 3000 / 32e9)
    assert flat_off.strategy_arguments == {"stage": 3, "offload": "cpu"}
    split = _find(offloaded, "mgpu_zero3", 1, 4, 2, 1)
    assert "offload='cpu' with tensor_parallel_size=2 is not built yet" in split.not_buildable
    assert _find(plain, "mgpu_zero3", 1, 4, 2, 1).buildable  # the control: not offloaded, it is built
    # offloaded rows that fit the device but not the host: the error says host memory, and by how much
    tight = PlanRequest(devices=n, device_memory="1GiB", precisions=("32-true",), strategies=("mgpu_zero3",),
                        offload=True, host_memory=n * 1000)  # fmt: skip
    with pytest.raises(NoPlanFits, match=r"fits the device but holds 3.91 KiB per rank in host memory, 3.03 KiB over"):
        estimate("hand", tight, STATES, [TRACE], UNITS)
    with pytest.raises(PlanError, match="offload='yes' must be True or False"):
        PlanRequest(devices=n, device_memory="1GiB", offload="yes")  # type: ignore[arg-type]
