"""The memory planner (``lightning_mgpu.plan``, ``lightning-mgpu plan``): exact model states, predictions within
15% of a real step measured with torch's ``MemTracker``, the recommendation order, and bad input refused
before anything runs."""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_mgpu.cli import main as cli_main
from lightning_mgpu.examples import DigitsCNN, DigitsDataModule, DigitsTransformer
from lightning_mgpu.planning import NoPlanFits, Plan, PlanError, PlanRequest, parse_memory, plan, plan_layouts
from lightning_mgpu.planning.cli import main as plan_main
from lightning_mgpu.planning.lm import RandomTokens, TransformerLM
from lightning_mgpu.planning.measure import fake_process_group, measure_step
from lightning_mgpu.planning.trace import count_model_states

TOLERANCE = 0.15


def _digits_batch() -> Any:
    data = DigitsDataModule(batch_size=32)
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def _lm() -> TransformerLM:  # wider than DigitsTransformer, with an embedding and a causal mask
    return TransformerLM(vocab=512, d_model=128, heads=4, layers=3)


def _lm_batch() -> Any:
    data = RandomTokens(batch_size=4, seq_len=64, vocab=512)
    data.setup("fit")
    return next(iter(data.train_dataloader()))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], Any], Any]] = {
    "DigitsCNN": (DigitsCNN, _digits_batch, {"Conv2d"}),
    "DigitsTransformer": (DigitsTransformer, _digits_batch, {"TransformerEncoderLayer", "ConvBlock"}),
    "TransformerLM": (_lm, _lm_batch, {"TransformerEncoderLayer"}),
}
_PLANS: dict[str, Plan] = {}


def _plan(name: str) -> Plan:
    if name not in _PLANS:  # one plan per model for the whole module: each takes a few seconds
        factory, batch, policy = MODELS[name]
        _PLANS[name] = plan(
            factory,
            devices=2,
            device_memory="8GiB",
            batch=batch(),
            precisions=("32-true", "bf16-mixed"),
            activation_checkpointing=policy,
        )
    return _PLANS[name]


def _check(name: str, strategy: str, precision: str, ac: bool) -> tuple[int, int]:
    factory, batch, policy = MODELS[name]
    predicted = _plan(name).row(strategy, precision, ac).measurable_bytes
    measured = measure_step(factory, batch(), precision, policy if ac else None, strategy).peak_bytes
    return predicted, measured


@pytest.mark.parametrize("ac", [False, True], ids=["no_ac", "ac"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("name", list(MODELS))
def test_ddp_prediction_is_within_15_percent_of_a_real_single_process_step(name: str, precision: str, ac: bool):
    predicted, measured = _check(name, "mgpu_ddp", precision, ac)
    assert abs(predicted - measured) <= TOLERANCE * measured, (predicted, measured)


@pytest.mark.parametrize("ac", [False, True], ids=["no_ac", "ac"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("strategy", ["mgpu_zero1", "mgpu_sharded", "mgpu_zero3"])
@pytest.mark.parametrize("name", list(MODELS))
def test_sharded_prediction_is_within_15_percent_of_rank_0_of_two_on_the_fake_process_group(
    name: str, strategy: str, precision: str, ac: bool
):
    with fake_process_group(world_size=2):
        predicted, measured = _check(name, strategy, precision, ac)
    assert abs(predicted - measured) <= TOLERANCE * measured, (predicted, measured)


def test_negative_control_a_prediction_without_activations_misses_the_transformer_by_more_than_15_percent():
    row = _plan("DigitsTransformer").row("mgpu_ddp", "32-true", False)
    factory, batch, _ = MODELS["DigitsTransformer"]
    measured = measure_step(factory, batch(), "32-true").peak_bytes
    without_activations = row.measurable_bytes - row.activations_bytes
    assert abs(without_activations - measured) > TOLERANCE * measured
    assert abs(row.measurable_bytes - measured) <= TOLERANCE * measured  # the real one passes


def test_checkpointing_shrinks_the_transformers_activations():
    p = _plan("TransformerLM")
    assert p.row("mgpu_ddp", "32-true", True).activations_bytes < p.row("mgpu_ddp", "32-true", False).activations_bytes


def test_adam_keeps_two_states_per_parameter_and_a_step_sgd_momentum_one():
    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(100, 50), nn.Linear(50, 10))  # 5,560 parameters in 4 tensors

    class WithOptimizer(nn.Sequential):
        def __init__(self, make: Callable[[Any], torch.optim.Optimizer]) -> None:
            super().__init__(nn.Linear(100, 50), nn.Linear(50, 10))
            self.make = make

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return self.make(self.parameters())

    n = 100 * 50 + 50 + 50 * 10 + 10
    adam = count_model_states(lambda: WithOptimizer(lambda ps: torch.optim.Adam(ps)))
    assert adam.parameters == {"float32": 4 * n} and adam.parameter_count == n
    assert adam.optimizer_state == 2 * 4 * n + 4 * 4  # exp_avg + exp_avg_sq, and a float32 step per tensor
    sgd = count_model_states(lambda: WithOptimizer(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)))
    assert sgd.optimizer_state == 4 * n and sgd.optimizer_names == ("SGD",)
    assert count_model_states(model).optimizer_names == ("Adam",)  # a plain nn.Module: Adam


def test_the_step_counts_the_foreach_temporaries_torch_uses_for_cuda_tensors():
    # torch steps Adam with foreach kernels on CUDA (foreach=None): a parameter-sized list for sqrt(exp_avg_sq) lives
    # through the step. The planner's tensors are CPU ones, for which torch would take the per-tensor loop (one
    # parameter's temporaries): a DDP step measured on a GPU peaked about one parameter copy above that.
    class WithOptimizer(nn.Sequential):
        def __init__(self, foreach: Any) -> None:
            super().__init__(*(nn.Linear(64, 64) for _ in range(8)))
            self.foreach = foreach

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), foreach=self.foreach)

    n = 8 * (64 * 64 + 64)
    default = count_model_states(lambda: WithOptimizer(None))
    assert default.optimizer_transient >= 4 * n, default  # one FP32 copy of the parameters at least
    per_tensor = count_model_states(lambda: WithOptimizer(False))  # negative control: the user's choice is kept
    assert per_tensor.optimizer_transient < 4 * n // 4, per_tensor


def test_sharding_divides_the_optimizer_state_and_master_weights_halve_the_parameters():
    p = plan(DigitsTransformer, devices=4, device_memory="8GiB", batch=_digits_batch())
    ddp, zero1 = p.row("mgpu_ddp"), p.row("mgpu_zero1")
    assert zero1.optimizer_state_bytes == ddp.optimizer_state_bytes // 4
    assert p.row("mgpu_zero3").parameters_bytes < ddp.parameters_bytes / 2  # a quarter + the gathered root
    fp32 = sum(p.states.parameters.values())
    assert p.row("mgpu_ddp", "bf16-master").parameters_bytes == fp32 // 2 + fp32 + p.states.buffers


def test_hybrid_sharding_is_planned_per_rank_as_the_shard_group_of_one_machine():
    """4 ranks on 2 machines: mgpu_hsdp shards over the 2 ranks of a machine, so each rank holds what mgpu_zero3
    holds on 2 ranks; on one machine it is no candidate (it would be mgpu_zero3)."""
    batch = _digits_batch()
    two = plan(DigitsTransformer, devices=4, num_nodes=2, device_memory="8GiB", batch=batch, precisions=("32-true",))
    one = plan(DigitsTransformer, devices=2, device_memory="8GiB", batch=batch, precisions=("32-true",))
    hsdp, zero3_on_2 = two.row("mgpu_hsdp"), one.row("mgpu_zero3")
    for field in ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "predicted_peak_bytes_per_rank"):
        assert getattr(hsdp, field) == getattr(zero3_on_2, field), field
    assert two.row("mgpu_zero3").optimizer_state_bytes == hsdp.optimizer_state_bytes // 2
    order = [r.strategy for r in two.rows if not r.activation_checkpointing]
    assert order.index("mgpu_sharded") < order.index("mgpu_hsdp") < order.index("mgpu_zero3")
    assert "mgpu_hsdp" not in {r.strategy for r in one.rows}


def test_the_recommendation_is_the_first_candidate_in_order_that_fits():
    roomy = _plan("TransformerLM")
    assert roomy.recommended == roomy.row("mgpu_ddp", "32-true", False)
    ddp = roomy.row("mgpu_ddp", "32-true", False).predicted_peak_bytes_per_rank
    tight = plan(
        _lm,
        devices=2,
        device_memory=int((ddp - 1) / 0.9),
        batch=_lm_batch(),
        activation_checkpointing={"TransformerEncoderLayer"},
        precisions=("32-true", "bf16-mixed"),
    )
    fitting = [r for r in tight.rows if r.fits]
    assert tight.recommended == fitting[0]
    assert [r.sort_key for r in tight.rows] == sorted(r.sort_key for r in tight.rows)
    assert not tight.row("mgpu_ddp", "32-true", False).fits


def test_a_billion_parameter_model_is_planned_without_allocating_it_or_starting_a_process_group():
    tokens = torch.zeros(8, 2048, dtype=torch.long, device="meta")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    p = plan(
        lambda: TransformerLM(d_model=2048, heads=16, layers=18),
        devices=8,
        device_memory="80GiB",
        batch=(tokens, tokens),
        precisions=("32-true",),
    )
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert p.states.parameter_count > 1_000_000_000
    assert grown < 1 * 2**30  # the FP32 weights alone would be 4 GiB
    assert not dist.is_initialized()
    assert p.row("mgpu_ddp").predicted_peak_bytes_per_rank > 4 * p.states.parameter_count * 4  # P + G + 2 Adam


def test_plan_is_exported_at_the_top_level():
    import lightning_mgpu

    assert lightning_mgpu.plan is plan and "plan" in lightning_mgpu.__all__


def test_the_cli_prints_json_rows_for_a_config(capsys):
    assert cli_main(["plan", "--config", "configs/ddp.yaml", "--devices", "2", "--device-memory",
                                    "1GiB", "--json", "--precisions", "32-true"]) == 0  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 8  # 4 strategies x with/without checkpointing
    keys = {"strategy", "activation_checkpointing", "precision", "predicted_peak_bytes_per_rank", "fits"}
    assert keys <= set(rows[0]) and {"activations_bytes", "communication_bytes"} <= set(rows[0])
    assert sum(r["recommended"] for r in rows) == 1


def test_the_cli_plans_hybrid_sharding_on_several_machines(capsys):
    assert cli_main(["plan", "--config", "configs/ddp.yaml", "--devices", "4", "--num-nodes", "2", "--device-memory",
                                    "1GiB", "--json", "--precisions", "32-true"]) == 0  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 10  # 5 strategies (mgpu_hsdp too) x with/without checkpointing
    hsdp = next(r for r in rows if r["strategy"] == "mgpu_hsdp" and not r["activation_checkpointing"])
    zero3 = next(r for r in rows if r["strategy"] == "mgpu_zero3" and not r["activation_checkpointing"])
    assert hsdp["optimizer_state_bytes"] == 2 * zero3["optimizer_state_bytes"]  # sharded over 2 ranks, not 4


# --- bad input: a clear error before anything runs ---------------------------------------------------------


@pytest.fixture
def nothing_runs(monkeypatch):
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the planner traced a model after bad input")

    monkeypatch.setattr("lightning_mgpu.planning.trace_step", refuse)
    monkeypatch.setattr("lightning_mgpu.planning.count_model_states", refuse)


def test_an_unknown_model_class_names_the_class_path_and_how_to_name_one(nothing_runs, tmp_path):
    with pytest.raises(PlanError, match=r"'mypkg\.models\.NoSuchModel'.*full import path"):
        plan("mypkg.models.NoSuchModel", devices=2, device_memory="80GiB", batch=torch.zeros(1))
    config = tmp_path / "fit.yaml"
    config.write_text("model:\n  class_path: lightning_mgpu.examples.DigitsCNNN\n")
    with pytest.raises(PlanError, match=r"'lightning_mgpu\.examples\.DigitsCNNN'.*has no 'DigitsCNNN'"):
        plan(str(config), devices=2, device_memory="80GiB")


def test_an_unparsable_memory_size_names_the_accepted_units(nothing_runs, capsys):
    with pytest.raises(PlanError, match=r"device_memory='80XB'.*accepted units: B, KB, MB, GB, TB, KiB, MiB, GiB"):
        plan(DigitsCNN, devices=2, device_memory="80XB", batch=torch.zeros(1))
    with pytest.raises(SystemExit) as exit_:
        plan_main(["--config", "configs/ddp.yaml", "--devices", "2", "--device-memory", "80XB"])
    assert exit_.value.code == 2 and "accepted units" in capsys.readouterr().err


def test_a_device_memory_that_fits_nothing_names_the_smallest_plan_and_the_shortfall(capsys):
    with pytest.raises(NoPlanFits, match=r"smallest plan, strategy='mgpu_\w+'.*misses by [\d.]+ \w+B") as err:
        plan(DigitsCNN, devices=2, device_memory="64KiB", batch=_digits_batch(), precisions=("32-true",))
    smallest = min(r.predicted_peak_bytes_per_rank for r in err.value.plan.rows)
    assert not any(r.fits for r in err.value.plan.rows) and smallest > 0.9 * 64 * 1024


@pytest.mark.parametrize(
    ("field", "kwargs", "fix"),
    [
        ("devices", {"devices": 0}, "positive int"),
        ("headroom", {"headroom": 1.5}, "fraction"),
        ("precisions", {"precisions": ("fp8",)}, "choose from"),
        ("strategies", {"strategies": ("deepspeed",)}, "choose from"),
        ("num_nodes", {"devices": 3, "num_nodes": 2}, "divides devices=3"),
        ("strategies", {"strategies": ("mgpu_hsdp",)}, "on num_nodes=1.*Add 'mgpu_zero3'"),
    ],
)
def test_the_request_names_the_bad_field_and_the_fix(field: str, kwargs: dict[str, Any], fix: str):
    with pytest.raises(PlanError, match=rf"{field}=.*{fix}"):
        PlanRequest(**{"devices": 2, "device_memory": "80GiB", **kwargs})


def test_memory_sizes_accept_decimal_and_binary_units():
    assert parse_memory("80GiB") == 80 * 2**30
    assert parse_memory("40 GB") == 40 * 10**9
    assert parse_memory("1.5mib") == 3 * 2**19
    assert parse_memory(1024) == 1024


class _FrozenBase(nn.Module):
    """A frozen 512-wide base with a rank-4 low-rank adapter (LoRA's shape: 0.8% of the parameters trainable)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512))
        self.base.requires_grad_(False)
        self.down, self.up = nn.Linear(512, 4, bias=False), nn.Linear(4, 512, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def test_the_plan_counts_gradients_and_optimizer_state_of_the_trainable_parameters_only():
    model = _FrozenBase()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert frozen > 100 * trainable
    p = plan(
        _FrozenBase,
        devices=2,
        device_memory="8GiB",
        batch=(torch.randn(2, 512),),
        precisions=("32-true", "bf16-master"),
        activation_checkpointing=None,
    )
    # AdamW: exp_avg, exp_avg_sq (FP32) per trainable element and a step per trainable tensor
    assert p.states.optimizer_state == 2 * 4 * trainable + 4 * 2
    assert p.states.trainable_bytes == 4 * trainable
    for row in p.rows:
        # at most the FP32 (master) gradients and the half ones of the trainable parameters, never the base's
        assert row.gradients_bytes <= 6 * trainable, row
        # the state and the step's temporaries (foreach): a few FP32 copies of the adapters, never of the base
        assert row.optimizer_state_bytes <= 4 * 4 * trainable + 4 * 2, row


def test_selective_checkpointing_is_traced_from_the_config_and_the_argument_and_named_in_the_strategy_line(tmp_path):
    """The "with AC" candidates are traced with what each block keeps: the config's ``activation_checkpointing_save``
    (the transformer sample's config, blocks as written) or the argument. Keeping the matmuls holds more than whole
    blocks and less than no checkpointing; a larger budget holds more; the strategy line passes the choice on."""
    sample = Path(__file__).resolve().parents[3] / "configs" / "transformer.yaml"
    text = sample.read_text()
    key = "      activation_checkpointing: [TransformerEncoderLayer, ConvBlock]\n"
    assert key in text
    config = tmp_path / "selective.yaml"
    config.write_text(text.replace(key, key + "      activation_checkpointing_save: matmuls\n"))
    kwargs: dict[str, Any] = {"devices": 2, "device_memory": "1GiB", "precisions": ("32-true",)}

    def activations(result: Any, ac: bool) -> int:
        return result.row("mgpu_ddp", "32-true", ac).activations_bytes

    layouts = plan_layouts(str(config), **kwargs)
    matmuls = layouts.memory  # the memory plan of the same trace (what plan(config) answers)
    plain = plan(str(sample), **kwargs)
    assert activations(plain, True) < activations(matmuls, True) < activations(plain, False)
    small, large = (plan(str(config), activation_checkpointing_save=b, **kwargs) for b in (0.2, 0.6))
    assert activations(plain, True) < activations(small, True) < activations(large, True)
    line = layouts.strategy_line(next(x for x in layouts.layouts if x.activation_checkpointing and x.buildable))
    assert "activation_checkpointing_save='matmuls'" in line, line


def test_a_4bit_base_is_counted_at_its_packed_bytes_and_traced_as_it_computes():
    """``quantize_frozen``'s weights stand in as 4-bit weights of fake packed pieces: the model states count their
    packed bytes (about 1/7 of float32 with torchao's default blocks), the traced step runs their dequantising
    forward, and only the trainable head has gradients. Negative control: the same model unpacked is counted at
    its float bytes, so the check tells the two apart."""
    pytest.importorskip("torchao")
    from lightning_mgpu.planning.stand_in import stand_in_factory
    from lightning_mgpu.planning.trace import trace_step
    from lightning_mgpu.quantization import quantize_frozen, stored_bytes

    def model(packed: bool) -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
        m[0].requires_grad_(False)
        m[2].requires_grad_(False)
        if packed:
            assert quantize_frozen(m) == ["0.weight", "2.weight"]
        return m

    packed, plain = model(True), model(False)
    batch = torch.randn(8, 256)
    weights = stored_bytes(packed[0].weight) + stored_bytes(packed[2].weight)
    floats = 4 * (2 * 256 + 256 * 4 + 4)  # the biases and the head stay float32
    assert 2 * 256 * 256 * 4 / 8 < weights < 2 * 256 * 256 * 4 / 6  # 4-bit codes and their scalers
    states = count_model_states(stand_in_factory(packed))
    assert states.parameters == {"float32": floats, "nf4": weights} and states.four_bit_count == 2 * 256 * 256
    assert states.trainable_bytes == 4 * (256 * 4 + 4)
    trace = trace_step(stand_in_factory(packed), batch, "32-true", forward=True)
    assert trace.parameters == floats + weights and trace.gradients == 4 * (256 * 4 + 4)
    assert trace.activations > 256 * 256 * 4  # one weight dequantised to float32 while its layer computes
    # negative control: unpacked, the same weights count at 4 bytes each
    unpacked = count_model_states(stand_in_factory(plain))
    assert unpacked.parameters == {"float32": floats + 2 * 256 * 256 * 4} and unpacked.four_bit_count == 0
    assert isinstance(packed[0].weight, nn.Parameter) and not packed[0].weight.requires_grad  # the module untouched
    # offloaded: over 2 shards each rank's share of the 4-bit base goes to the host; over one shard the 4-bit base
    # stays outside FSDP2, whole on the device (the strategy's rule), and only the rest is offloaded
    kw = dict(batch=batch, precisions=("32-true",), strategies=("mgpu_zero3",), offload=True)
    two, one = plan(packed, devices=2, device_memory="1GiB", **kw), plan(packed, devices=1, device_memory="1GiB", **kw)
    trained, adam = 4 * (256 * 4 + 4), two.states.optimizer_state + two.states.optimizer_transient
    assert two.row("mgpu_zero3").host_bytes == (floats + weights) // 2 + trained // 2 + adam // 2
    assert one.row("mgpu_zero3").host_bytes == floats + trained + adam  # no 4-bit byte on the host
    assert one.row("mgpu_zero3").states_bytes == weights  # kept on the device between steps
