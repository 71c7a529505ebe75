"""The features on CUDA, each through ``Trainer(strategy=...).fit`` on NCCL in a fresh interpreter
(``tests/gpu/worker_features.py``): the token-normalised loss, the non-finite check, global-norm clipping on FSDP2,
micro-batching against a real CUDA out-of-memory error, local SGD and DiLoCo, asynchronous checkpoints,
``mgpu_auto``, the planner against the CUDA allocator, offload to host memory and adapters over a 4-bit base.

Run: ``make test-gpu``. Skipped with "no CUDA device" elsewhere (tests/gpu/conftest.py)."""

from __future__ import annotations

import json

import pytest

from tests.gpu.test_gpu_tier import DEVICE, ON_CUDA, run

#: the planner's prediction against the CUDA allocator: the tolerance the CPU suite holds it to
#: (tests/unit/planning/test_planning.py)
PLANNER_TOLERANCE = 0.15


@pytest.mark.parametrize("stage", [0, 3], ids=["mgpu_ddp", "mgpu_zero3"])
def test_token_loss_equals_the_mean_over_every_token_of_the_step(stage: int) -> None:
    r = run("token_loss", stage=stage)
    assert r["steps"] == r["expected_steps"], r
    assert r["tokens"] == r["expected_tokens"], r  # each step counted its own tokens, once
    assert len(set(r["tokens"])) > 1, "the steps hold different token counts: the check can fail"
    assert r["max_abs_diff"] < 1e-10 < r["moved"], r
    assert r["loss_per_token"] == pytest.approx(r["expected_loss_per_token"], rel=1e-6), r


@pytest.mark.parametrize("stage", [0, 3], ids=["mgpu_ddp", "mgpu_zero3"])
def test_nonfinite_error_names_the_rank_and_parameter_on_cuda(stage: int) -> None:
    r = run("nonfinite", stage=stage)
    assert r["raised"] == "FloatingPointError", r
    assert f"optimizer step 1 (rank 0: parameter {r['poisoned']!r}" in r["message"], r
    assert r["global_step"] == 1 and r["finite"], r  # the poisoned step was not taken


@pytest.mark.parametrize("stage", [2, 3])
def test_global_norm_clipping_on_fsdp2_equals_clipping_the_whole_gradient(stage: int) -> None:
    r = run("clip_fsdp2", stage=stage)
    assert r["strategy"] == "MGPUShardedStrategy" and r["dtensor"], r
    assert min(r["expected_norms"]) > 0.05, "clipping must bite in every step for the comparison to mean anything"
    assert r["norms"] == pytest.approx(r["expected_norms"], rel=1e-9), r
    assert r["max_abs_diff"] < 1e-10 < r["unclipped_diff"], r


def test_auto_micro_batch_backs_off_on_a_real_cuda_out_of_memory_error() -> None:
    r = run("micro_batch_oom")
    print(json.dumps(r, indent=1))
    assert r["simulated"] == (not ON_CUDA), r
    if ON_CUDA:  # the caching allocator's own error, under the cap the case sets
        assert r["limit_bytes"] > 0, r
        assert r["errors"] and all("CUDA out of memory" in e for e in r["errors"]), r
    else:  # CPU mode: training_step raises the out-of-memory error on purpose above 4 rows
        assert r["errors"] and all("raised on purpose" in e for e in r["errors"]), r
    assert r["backoffs"] and r["backoffs"][0][0] == 32, r
    assert all(b[1] == b[0] // 2 and b[2] == [0] for b in r["backoffs"]), r
    assert r["size"] == r["backoffs"][-1][1] < 32, r
    assert r["global_step"] == 4 and r["finite"], r


def test_local_sgd_and_diloco_on_nccl() -> None:
    r = run("periodic_sync")
    for name in ("local_sgd", "diloco_plain", "diloco"):
        assert r[name]["syncs"] == 3 and r[name]["finite"], r
    # averaging one rank leaves its weights: local SGD and a plain outer step are mgpu_ddp
    assert r["local_sgd"]["diff_to_ddp"] < 1e-12 and r["diloco_plain"]["diff_to_ddp"] < 1e-12, r
    assert r["diloco"]["diff_to_ddp"] > 1e-6, r  # the Nesterov outer step moves elsewhere


@pytest.mark.parametrize(
    "stage,checkpoint", [(0, "consolidated"), (2, "consolidated"), (3, "sharded")], ids=["ddp", "zero2", "zero3_dir"]
)
def test_async_checkpoint_on_nccl_holds_its_step_and_resumes_exactly(stage: int, checkpoint: str) -> None:
    r = run("async_checkpoint", stage=stage, checkpoint=checkpoint)
    assert r["saved_step"] == 3 and r["saved_exact"] and r["trained_on_after_save"], r
    assert r["saved_as_dir"] == (checkpoint == "sharded"), r
    assert r["resume_max_abs_diff"] == 0.0, r


def test_mgpu_auto_records_its_decision_and_fits_on_cuda() -> None:
    r = run("auto")
    device, tight = r["device"], r["tight"]
    assert device["class"] == "MGPUDDPStrategy" and device["decision"] == ["mgpu_ddp", False], r
    if ON_CUDA:
        assert device["usable_bytes"] == int(r["device_total_bytes"] * 0.9), r  # the device's own memory, 10% kept
    assert tight["decision"] == ["mgpu_ddp", True] and tight["checkpointing"], r
    assert "Faster candidates that do not fit: mgpu_ddp 1 (32-true) needs" in tight["reason"], r
    for fit in (device, tight):
        assert fit["steps"] == 4 and fit["finite"], r


@pytest.mark.parametrize(
    "strategy,precision,ac",
    [
        ("mgpu_ddp", "32-true", False),
        ("mgpu_ddp", "bf16-mixed", False),
        ("mgpu_ddp", "32-true", True),
        ("mgpu_zero3", "32-true", False),
    ],
)
def test_planner_prediction_against_the_cuda_allocator(strategy: str, precision: str, ac: bool) -> None:
    # CPU mode: the case itself (plan, fit, the figures it returns) on a small model; there is no allocator to read
    small = {} if ON_CUDA else {"vocab": 64, "d_model": 32, "heads": 2, "layers": 2, "batch": 2, "seq": 16}
    r = run("planner_vs_allocator", strategy=strategy, precision=precision, ac=ac, **small)
    print(json.dumps(r, indent=1))
    assert r["steps"] == 3 and r["predicted_measurable_bytes"] > 0, r
    if ON_CUDA:
        assert r["measured_peak_bytes"] > 0, r
        # DDP may or may not still hold its first buckets when it rebuilds them (allocation timing): the plan counts
        # them, so the measured peak must lie between the plan without them and the plan, each within the tolerance
        low = r["predicted_measurable_bytes"] - r["predicted_rebuilt_buckets_bytes"]
        assert (1 - PLANNER_TOLERANCE) * low <= r["measured_less_workspaces"], r
        assert r["ratio"] <= 1 + PLANNER_TOLERANCE, r
    else:
        assert r["measured_peak_bytes"] == -1 and r["ratio"] == -1.0, r


@pytest.mark.parametrize("stage", [0, 3], ids=["mgpu_ddp", "mgpu_zero3"])
def test_exact_evaluation_logs_the_one_process_values_on_the_device(stage: int) -> None:
    r = run("exact_evaluation", stage=stage)
    n = r["n"]
    assert sorted(r["fit_seen"]) == sorted(r["seen"]["val"]) == sorted(r["seen"]["test"]) == list(range(n)), r
    assert sorted(r["seen"]["predict"]) == list(range(n)), r  # every sample once
    for key in ("fit_val_mse", "val_mse", "val_tm", "test_mse", "test_tm"):
        assert r[key] == pytest.approx(r["expected_mse"], rel=1e-12), (key, r)
    assert r["predictions_shape"] == [n, 3] and r["predictions_max_abs_diff"] < 1e-12, r


#: run in CPU mode too (besides each test's first parameters): the sharded cases of the device test
CPU_ALSO = (
    "test_a_module_sharded_in_place_stays_on_the_device_between_stages[mgpu_sharded]",
    "test_a_module_sharded_in_place_stays_on_the_device_between_stages[mgpu_zero3]",
)


@pytest.mark.parametrize("stage", [0, 2, 3], ids=["mgpu_ddp", "mgpu_sharded", "mgpu_zero3"])
def test_a_module_sharded_in_place_stays_on_the_device_between_stages(stage: int) -> None:
    # Lightning's teardown moves the module to the CPU after each stage; FSDP2 keeps its shards on the device, so the
    # move would leave the root module's buffer on the CPU for the next validate (CUDA: two devices in forward). On
    # CPU the move is a no-op: the count of moves is what tells; mgpu_ddp (not sharded in place) is the control.
    r = run("sharded_module_stays_on_device", stage=stage)
    assert r["devices_in_validate"] == [r["root_device"]], r
    if stage == 0:  # negative control: Lightning's teardown moves the module to the CPU after each stage
        assert r["cpu_calls_after_fit"] == 1 and r["cpu_calls"] == 2 and r["offset_device_after"] == "cpu", r
    else:
        assert r["cpu_calls_after_fit"] == 0 and r["cpu_calls"] == 0, r
        assert r["offset_device_after"] == r["root_device"], r


@pytest.mark.parametrize("stage", [3, 2], ids=["mgpu_zero3_offload", "mgpu_sharded-offload"])
def test_offload_keeps_the_shards_and_the_optimizer_state_on_the_host_and_trains_the_same_weights(stage: int) -> None:
    r = run("offload", stage=stage)
    print(json.dumps(r, indent=1))
    assert r["steps"] == [6, 6], r
    assert r["moved"] > 1e-3, r  # training moved the weights: the comparison has something to prove
    # the optimizer steps on the host instead of the device: float64 sums in another order at most
    assert r["max_abs_diff"] < 1e-12, r
    assert r["where"]["cpu"] == {"params": ["cpu"], "grads": ["cpu"], "state": ["cpu"]}, r
    if ON_CUDA:  # the control: without offload all of it is on the device, and the device holds more
        assert r["where"]["device"] == {"params": ["cuda"], "grads": ["cuda"], "state": ["cuda"]}, r
        assert r["peak_bytes"]["cpu"] < r["peak_bytes"]["device"], r


#: compiled against eager weights after 8 steps: FP32 (inductor fuses and reorders sums; a few float32 ulps per
#: step) and bf16-mixed (both runs round to bf16, not always the same way), relative to the largest weight
COMPILE_TOLERANCE = {"32-true": 1e-4, "bf16-mixed": 2e-2}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("stage", [0, 3], ids=["mgpu_ddp", "mgpu_zero3"])
def test_compile_with_inductor_trains_the_eager_weights_without_recompiling(stage: int, precision: str) -> None:
    # CPU mode: AOTAutograd's graphs run eagerly (the graphs inductor would get, no C++ build on CI)
    backend = "inductor" if ON_CUDA else "aot_eager"
    r = run("compile_parity", stage=stage, precision=precision, backend=backend)
    print(json.dumps(r, indent=1))
    assert r["steps"] == [8, 8], r
    assert r["compiled_modules"], r  # the strategy compiled something
    assert r["eager_graphs"] == 0 < r["graphs_warm"], r
    assert r["graphs_end"] == r["graphs_warm"], r  # no graph compiled after warm-up
    bound = COMPILE_TOLERANCE[precision] * max(1.0, r["max_abs_weight"])
    assert r["max_abs_diff"] <= bound < r["moved"], r


@pytest.mark.parametrize("stage", [0, 1], ids=["mgpu_ddp", "mgpu_zero1"])
def test_ddp_on_the_default_stream_raises_no_stream_warning(stage: int) -> None:
    r = run("stream_warning", stage=stage)
    assert r["global_step"] == 4, r
    assert r["stream_warnings"] == [], r


def test_adapters_over_a_4bit_base_train_the_same_on_the_device_sharded_and_offloaded() -> None:
    pytest.importorskip("torchao", reason="the optional torchao backend is not installed (lightning-mgpu[torchao])")
    pytest.importorskip("peft", reason="the QLoRA tutorial's model needs peft")
    r = run("four_bit")
    print(json.dumps(r, indent=1))
    for name in ("zero3", "zero3_offload"):
        assert r[name]["steps"] == r["lightning"]["steps"] == 4, r
        assert r[name]["moved"] > 1e-3, r  # training moved the adapters: the comparison has something to prove
        assert r[name]["max_abs_diff"] < 1e-10, r  # float64; offload steps AdamW on the host
        assert r[name]["base_max_abs_diff"] == 0.0, r  # the frozen base is the same 4-bit base
        assert r[name]["nf4"][0] == r[name]["nf4"][1] > 0, r  # still 4-bit after fit, every packed weight
    # one device is one shard: the strategy keeps a 4-bit base outside FSDP2, whole on the device, offloaded or not
    # (the planner counts it so); only the adapters' shards, gradients and optimizer state go to the host
    assert r["zero3_offload"]["base_on"] == r["zero3"]["base_on"] == r["lightning"]["base_on"] == [DEVICE], r
