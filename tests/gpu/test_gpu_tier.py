"""The CUDA paths, through ``Trainer(strategy=...).fit`` on one GPU (NCCL at world size 1). Each case runs in a fresh
interpreter (``tests/gpu/worker.py``); the multi-rank agreement of the same features is proved on CPU (gloo) by the
default suite, and memory per rank at world sizes 2-8 by ``benchmarks/gpu/bench_memory_per_rank.py``.

Run: ``make test-gpu``. Skipped with "no CUDA device" elsewhere (tests/gpu/conftest.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from lightning_mgpu import PRESETS
from tests.gpu.worker import DEVICE
from tests.scripts import Scripts

ROOT = Path(__file__).resolve().parents[2]
SPLIT_SIZES = ("tensor_parallel_size", "pipeline_parallel_size")
ON_CUDA = DEVICE == "cuda"
_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

#: a test that only CUDA hardware can answer (the allocator's bytes, NVML, pinned memory, CUDA before a fork):
#: skipped in the tier's CPU mode (``MGPU_TIER_DEVICE=cpu``, ``make test-gpu-cpu``)
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="needs CUDA hardware (MGPU_TIER_DEVICE=cpu)")

#: run in the CPU mode besides each test's first parameters (tests/gpu/conftest.py): a preset of every launch
#: (their step count, backend and device are read where they train) and FSDP2's master modes
CPU_ALSO = (
    "test_every_preset_fits_on_nccl[mgpu_ddp_spawn]",
    "test_every_preset_fits_on_nccl[mgpu_ddp_fork]",
    "test_a_split_layout_preset_on_one_gpu_names_the_size_and_the_fix_before_launch[mgpu_tensor_parallel]",
    "test_precisions_train_on_cuda[16-master-mgpu_ddp]",
    "test_precisions_train_on_cuda[bf16-master-mgpu_zero3]",
)


#: the CPU mode's runner (started for the session by ``tests/gpu/conftest.py``): one interpreter that has imported
#: the worker (torch, Lightning, the pack) forks each case. What the mode checks is the tier's code, not an
#: interpreter's start, and each case would otherwise spend most of its time importing; on CUDA every case keeps its
#: fresh interpreter (CUDA state must not cross a fork).
cpu_runner: Scripts | None = None


def start_cpu_runner() -> Scripts:
    return Scripts(("tests.gpu.worker", "tests.gpu.worker_features"), cwd=ROOT, env=_ENV)


def run(case: str, timeout: float = 600, **args: Any) -> dict[str, Any]:
    argv = [case, json.dumps(args)]
    if cpu_runner is not None:
        output = Path(tempfile.mkdtemp()) / case
        done = cpu_runner.run_module("tests.gpu.worker", argv, cwd=ROOT, output=output, timeout=timeout)
    else:
        cmd = [sys.executable, "-m", "tests.gpu.worker", *argv]
        done = subprocess.run(cmd, cwd=ROOT, env=_ENV, capture_output=True, text=True, timeout=timeout, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"{case}{args} failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def _needs(preset_name: str) -> str | None:
    p = next(p for p in PRESETS if p.name == preset_name)
    if p.init_params.get("backend") == "fairscale" and importlib.util.find_spec("fairscale") is None:
        return "the optional fairscale backend is not installed (pip install 'lightning-mgpu[fairscale]')"
    return None


#: the presets whose layout splits the model over several ranks (tensor or pipeline): one GPU cannot hold them
SPLIT = {p.name: p.init_params for p in PRESETS if any(p.init_params.get(k, 1) > 1 for k in SPLIT_SIZES)}


@pytest.mark.parametrize("name", [p.name for p in PRESETS if p.name not in SPLIT])
def test_every_preset_fits_on_nccl(name: str) -> None:
    reason = _needs(name)
    if reason:
        pytest.skip(reason)
    r = run("preset", name=name)
    assert r["backend"] == ("nccl" if ON_CUDA else "gloo"), r
    assert r["device"].startswith(DEVICE) and "," not in r["device"], r  # computed on the device, one device
    offloaded = next(p for p in PRESETS if p.name == name).init_params.get("offload") == "cpu"
    assert r["parameters_device"] == ("cpu" if offloaded else r["device"]), r
    assert r["steps"] == 4 and r["finite"] and r["moved"] > 0, r


@pytest.mark.parametrize("name", sorted(SPLIT))
def test_a_split_layout_preset_on_one_gpu_names_the_size_and_the_fix_before_launch(name: str) -> None:
    """``mgpu_tensor_parallel`` and ``mgpu_pipeline`` need 2 ranks per group: on one device the Trainer's
    construction refuses, naming the size, the world size and both fixes, and no process is started."""
    r = run("preset_refused", name=name)
    key = next(k for k in SPLIT_SIZES if SPLIT[name].get(k, 1) > 1)
    assert r["raised"] == "ValueError" and r["at"] == "Trainer", r
    message = r["message"]
    assert f"{key}={SPLIT[name][key]}" in message and "world size 1" in message, message
    assert f"{key}=1" in message and f"multiple of {SPLIT[name][key]}" in message, message


@needs_cuda
@pytest.mark.parametrize("name", [p.name for p in PRESETS if p.launch == "fork"])
def test_fork_presets_after_cuda_init_name_the_fix(name: str) -> None:
    r = run("fork_after_cuda", name=name)
    assert r["raised"] is not None, "a fork launch after CUDA was initialised must be refused"
    message = r["message"]
    assert "CUDA" in message and ("restart" in message or "spawn" in message), message


@pytest.mark.parametrize("strategy", ["mgpu_ddp", "mgpu_zero1", "mgpu_sharded", "mgpu_zero3"])
def test_fp16_overflow_skips_the_step_counts_and_logs_it(strategy: str) -> None:
    r = run("fp16_overflow", strategy=strategy)
    assert r["plugin"] == "MGPUPrecision", r
    # the injected step is skipped on top of any step the scaler's high first guess (65536) overflows on its own
    # (the control fit without the injection, same seed, says which); each skip is counted once and logged
    natural_before = [s for s in r["natural_skipped_at"] if s < 2]
    assert [s for s in r["skipped_at"] if s <= 2] == [*natural_before, 2], r
    assert r["skipped_steps"] == len(r["skipped_at"]) and r["logged_skipped"] == float(r["skipped_steps"]), r
    assert r["step2_left_weights_unchanged"], r
    assert r["finite"] and r["loss_scale"] < 65536.0, r
    if ON_CUDA:  # the scaler halves its scale once per skipped step (no growth within 2000 steps)
        assert r["loss_scale"] == 65536.0 * 0.5 ** r["skipped_steps"], r


@pytest.mark.parametrize("strategy", ["mgpu_ddp", "mgpu_sharded", "mgpu_zero3"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-master", "bf16-master"])
def test_precisions_train_on_cuda(strategy: str, precision: str) -> None:
    r = run("precision_fit", strategy=strategy, precision=precision)
    assert r["finite"] and r["moved"] > 0, r
    half = "torch.float16" if precision.startswith("16") else "torch.bfloat16"
    assert r["compute_dtypes"] == [half], r  # every mode computes in half precision
    if precision.endswith("-master") and strategy == "mgpu_ddp":
        assert r["dtypes"] == [half], r  # half weights; the optimizer steps FP32 copies
    else:
        # mixed: FP32 weights under autocast; master modes under FSDP2: the stored (sharded) parameters are the
        # FP32 masters, gathered as half for the forward and backward
        assert r["dtypes"] == ["torch.float32"], r


@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd"])
def test_comm_hooks_on_nccl_and_their_bytes(hook: str) -> None:
    if hook == "bf16" and not ON_CUDA:
        pytest.skip("torch's bf16 compression hook needs NCCL (the pack refuses it on gloo, naming the fix)")
    r = run("comm_hook", hook=hook)
    assert r["finite"] and r["sync_rounds"] == r["optimizer_steps"] == 6, r
    full = r["gradient_bytes"] * r["sync_rounds"]
    if hook in ("fp16", "bf16"):
        assert r["allreduce_bytes"] == full // 2, r  # half-width payload, every bucket, every step
    else:
        assert 0 < r["allreduce_bytes"] < full, r  # rank-1 factors after the first (uncompressed) round


@pytest.mark.parametrize("stage,checkpoint", [(1, "consolidated"), (2, "consolidated"), (2, "sharded"), (3, "sharded")])
def test_sharded_stage_resumes_exactly_on_cuda(stage: int, checkpoint: str) -> None:
    r = run("sharded_resume", stage=stage, checkpoint=checkpoint)
    assert r["finite"] and r["saved_as_dir"] == (checkpoint == "sharded"), r
    assert r["max_abs_diff"] == 0.0, r


def test_activation_checkpointing_memory_and_batchnorm_on_cuda() -> None:
    r = run("activation_checkpointing", batch=512 if ON_CUDA else 16)  # on CPU no bytes are measured
    print(json.dumps(r, indent=1))
    if ON_CUDA:  # the allocator's bytes (not measured on CPU: -1)
        assert r["held_bytes_mgpu"] < 0.5 * r["held_bytes_none"], r
        assert r["peak_bytes_mgpu"] < r["peak_bytes_none"], r
    assert r["batches_tracked_mgpu"] == r["batches_tracked_none"] == [4, 4], r  # once per step, not twice
    assert r["bn_stats_max_diff"] < 1e-12 and r["weights_max_diff"] < 1e-12, r


@needs_cuda
def test_device_monitor_reads_nvml() -> None:
    r = run("device_monitor")
    assert r["intervals"] == 3, r
    assert 0 <= r["gpu_util"] <= 100, r
    assert r["gpu_mem_mb"] > 0 and r["mem_peak_mb"] > 0 and r["step_ms"] > 0, r
    assert 10 <= r["gpu_temp_c"] <= 110, r
