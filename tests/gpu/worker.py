"""The GPU tier's runs, each in a fresh interpreter: ``python -m tests.gpu.worker CASE '{"arg": ...}'``.

Each case trains through ``Trainer(strategy=...).fit`` on one CUDA device (NCCL, world size 1) and prints one line
``RESULT <json>`` that the tests in ``tests/gpu/test_gpu_tier.py`` check. A fresh interpreter per case keeps CUDA
and the process group of one case out of the next (and lets a case initialise CUDA before a fork on purpose).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from typing import Any, Callable

import pytorch_lightning as pl
import torch
from torch import nn

import lightning_mgpu
from lightning_mgpu.examples import DigitsCNN, DigitsDataModule
from lightning_mgpu.examples.transformer import ConvBlock, DigitsTransformer
from tests.helpers import full
from tests.models import Regressor, make_data

# MGPU_TIER_DEVICE=cpu runs the cases on CPU (gloo), to check the worker itself on a machine without a GPU; the
# allocator figures are then not measured (-1).
DEVICE = os.environ.get("MGPU_TIER_DEVICE", "cuda")
CASES: dict[str, Callable[..., dict[str, Any]]] = {}


def case(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    CASES[fn.__name__] = fn
    return fn


def _trainer(strategy: Any, **kwargs: Any) -> pl.Trainer:
    """One device of the tier's kind, no logger, no checkpoints, no validation unless ``kwargs`` say otherwise."""
    flags: dict[str, Any] = {
        "max_steps": 4,
        "accelerator": "gpu" if DEVICE == "cuda" else "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    return pl.Trainer(strategy=strategy, **{**flags, **kwargs})


def _finite(module: nn.Module) -> bool:
    return all(bool(torch.isfinite(full(p.detach())).all()) for p in module.parameters())


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([full(p.detach()).double().flatten().cpu() for p in module.parameters()])


class Probe(pl.Callback):
    """What the training process saw, read there and written to a file by global rank 0 at the end of fit: the
    process group's backend, the device each training step's loss was computed on (under ``offload="cpu"`` the
    parameters themselves stay in host memory: their device is recorded beside it), ``global_step``, the
    parameters' dtypes as stored and the dtype the first layer computes in. After a spawn or fork launch the parent
    process gets back only the weights and the run state, not these; after an in-process or popen launch the file
    holds the same as the parent."""

    def __init__(self) -> None:
        self.path = os.path.join(tempfile.mkdtemp(), "probe.json")
        self.compute: set[str] = set()
        self.devices: set[str] = set()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        first = next(m for m in pl_module.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
        first.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        self.compute.add(str(output.dtype))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # the loss, not a layer's output: mgpu_auto's planner runs the forward under fake tensors first
        self.devices.add(str(outputs["loss"].device))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        dist = torch.distributed
        seen = {
            "backend": dist.get_backend() if dist.is_available() and dist.is_initialized() else None,
            "device": ",".join(sorted(self.devices)),
            "parameters_device": str(next(pl_module.parameters()).device),
            "global_step": trainer.global_step,
            "stored_dtypes": sorted({str(p.dtype) for p in pl_module.parameters()}),
            "compute_dtypes": sorted(self.compute),
        }
        with open(self.path, "w") as f:
            json.dump(seen, f)

    def result(self) -> dict[str, Any]:
        """What rank 0 wrote (raises if training never reached its end)."""
        with open(self.path) as f:
            return json.load(f)


@case
def preset(name: str) -> dict[str, Any]:
    """Every preset at world size 1 on NCCL: fit 4 steps of the digits CNN. The backend, device and step count are
    read in the training process (:class:`Probe`), the weights in this one (every launch copies them back)."""
    pl.seed_everything(0)
    model, probe = DigitsCNN(), Probe()
    before = _flat(model)
    trainer = _trainer(name, callbacks=[probe])
    trainer.fit(model, DigitsDataModule())
    seen = probe.result()
    return {
        "backend": seen["backend"],
        "device": seen["device"],
        "parameters_device": seen["parameters_device"],
        "steps": seen["global_step"],
        "finite": _finite(model),
        "moved": float((_flat(model) - before).abs().max()),
        "strategy": type(trainer.strategy).__name__,
    }


@case
def preset_refused(name: str) -> dict[str, Any]:
    """A preset whose layout one device cannot hold: where it is refused (``Trainer(...)`` or ``fit``) and why."""
    try:
        trainer = _trainer(name)
    except Exception as err:
        return {"at": "Trainer", "raised": type(err).__name__, "message": str(err)}
    try:
        trainer.fit(DigitsCNN(), DigitsDataModule())
    except Exception as err:
        return {"at": "fit", "raised": type(err).__name__, "message": str(err)}
    return {"at": None, "raised": None, "message": ""}


@case
def fork_after_cuda(name: str) -> dict[str, Any]:
    """A fork preset when this process has already initialised CUDA: the error a notebook user sees."""
    torch.zeros(1, device=DEVICE)
    try:
        _trainer(name).fit(DigitsCNN(), DigitsDataModule())
    except Exception as err:
        return {"raised": type(err).__name__, "message": str(err)}
    return {"raised": None, "message": ""}


class _Overflow(DigitsCNN):
    """The loss of optimizer step ``at`` is made infinite: fp16 gradients overflow on that step only."""

    def __init__(self, at: int = 2) -> None:
        super().__init__()
        self.at = at
        self.at_skip: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if batch_idx == self.at:  # first epoch, no accumulation: batch index == optimizer step
            self.at_skip = _flat(self).tolist()
            return loss * float("inf")
        return loss


class _Capture(pl.Callback):
    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}
        self.after: dict[int, list[float]] = {}
        self.skipped_at: list[int] = []
        self._skipped = 0

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
        self.after[int(args[-1])] = _flat(module).tolist()
        skipped = int(getattr(trainer.precision_plugin, "skipped_steps", 0))
        if skipped > self._skipped:  # the steps the scaler skipped, injected or not
            self.skipped_at.append(int(args[-1]))
        self._skipped = skipped
        for k, v in trainer.callback_metrics.items():
            if k.startswith("precision/"):
                self.metrics[k] = float(v)


@case
def fp16_overflow(strategy: str) -> dict[str, Any]:
    """16-mixed with the GradScaler: an infinite loss on step 2 is skipped, counted and logged; no NaN in weights.

    The scaler starts at 65536, a guess on the high side: fp16 gradients may overflow on their own in the first steps
    (they do for this model on CUDA). A control fit without the injected loss, same seed, says which steps overflow
    on their own, so the test can tell the injected skip from those."""
    pl.seed_everything(0)
    control = _Capture()
    _trainer(strategy, precision="16-mixed", max_steps=5, callbacks=[control]).fit(_Overflow(at=-1), DigitsDataModule())
    pl.seed_everything(0)
    model, capture = _Overflow(at=2), _Capture()
    trainer = _trainer(strategy, precision="16-mixed", max_steps=5, callbacks=[capture])
    trainer.fit(model, DigitsDataModule())
    plugin = trainer.precision_plugin
    unchanged = capture.after.get(2) == model.at_skip if model.at_skip else False
    return {
        "plugin": type(plugin).__name__,
        "natural_skipped_at": control.skipped_at,
        "skipped_at": capture.skipped_at,
        "skipped_steps": getattr(plugin, "skipped_steps", None),
        "logged_skipped": capture.metrics.get("precision/skipped_steps"),
        "loss_scale": getattr(plugin, "loss_scale", None),
        "finite": _finite(model),
        "step2_left_weights_unchanged": unchanged,
        "global_step": trainer.global_step,
    }


@case
def precision_fit(strategy: str, precision: str) -> dict[str, Any]:
    """bf16-mixed and the *-master modes on CUDA: the dtypes the parameters are stored in and the dtype the first
    layer computes in, read in the training process. Under DDP the master modes store half weights (the optimizer
    steps FP32 copies); under FSDP2 the stored parameters are FSDP's sharded FP32 masters, gathered as half for the
    forward (``MixedPrecisionPolicy(param_dtype=half)``)."""
    pl.seed_everything(0)
    model, probe = DigitsCNN(), Probe()
    before = _flat(model)
    plugins = [lightning_mgpu.MGPUPrecision(precision)] if precision.endswith("-master") else []
    kwargs = {} if plugins else {"precision": precision}
    trainer = _trainer(strategy, plugins=plugins, max_steps=6, callbacks=[probe], **kwargs)
    trainer.fit(model, DigitsDataModule())
    seen = probe.result()
    return {
        "finite": _finite(model),
        "moved": float((_flat(model) - before).abs().max()),
        "dtypes": seen["stored_dtypes"],
        "compute_dtypes": seen["compute_dtypes"],
    }


@case
def comm_hook(hook: str) -> dict[str, Any]:
    """The fp16/bf16 compression hooks and PowerSGD on NCCL: what the ledger counted."""
    pl.seed_everything(0)
    strategy = lightning_mgpu.MGPUDDPStrategy(comm_hook=hook)
    trainer = _trainer(strategy, max_steps=6)
    model = DigitsCNN()
    trainer.fit(model, DigitsDataModule())
    s = strategy.comm_stats
    return {
        "finite": _finite(model),
        "allreduce_calls": s.allreduce_calls,
        "allreduce_bytes": s.allreduce_bytes,
        "sync_rounds": s.sync_rounds,
        "gradient_bytes": s.gradient_bytes,
        "optimizer_steps": s.optimizer_steps,
    }


class _SaveAt(pl.Callback):
    """``trainer.save_checkpoint`` right after optimizer step ``step`` (mid-epoch, as ModelCheckpoint saves)."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and not os.path.exists(self.path):
            trainer.save_checkpoint(self.path)


def _regressor_fit(strategy: Any, steps: int, ckpt_in: str | None = None, save: Any = None) -> Regressor:
    pl.seed_everything(0)
    model = Regressor().double()
    trainer = _trainer(strategy, max_steps=steps, callbacks=[save] if save else [])
    # Lightning's automatic sampler, which the mgpu strategies make resumable mid-epoch (12 batches per epoch)
    loader = torch.utils.data.DataLoader(make_data(), batch_size=8, shuffle=True)
    trainer.fit(model, loader, ckpt_path=ckpt_in)
    return model


@case
def sharded_resume(stage: int, checkpoint: str) -> dict[str, Any]:
    """FSDP2 / ZeRO stages on CUDA: a run of 6 steps saves after step 3; resumed from there it ends with the same
    weights (float64)."""
    torch.use_deterministic_algorithms(True)
    make = lambda: lightning_mgpu.MGPUShardedStrategy(stage=stage, checkpoint=checkpoint)  # noqa: E731
    path = os.path.join(tempfile.mkdtemp(), "step3.ckpt")
    whole = _flat(_regressor_fit(make(), 6, save=_SaveAt(3, path)))
    resumed = _flat(_regressor_fit(make(), 6, ckpt_in=path))
    diff = float((whole - resumed).abs().max())
    return {"max_abs_diff": diff, "saved_as_dir": os.path.isdir(path), "finite": bool(torch.isfinite(resumed).all())}


def _saved_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """Bytes the CUDA allocator holds after the forward (what is kept for backward) and the step's peak."""
    if DEVICE != "cuda":
        nn.functional.cross_entropy(model(x), y).backward()
        return -1, -1
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = nn.functional.cross_entropy(model(x), y)
    held = torch.cuda.memory_allocated() - base
    loss.backward()
    peak = torch.cuda.max_memory_allocated() - base
    return held, peak


@case
def activation_checkpointing(batch: int = 512) -> dict[str, Any]:
    """Saved-activation bytes of the 8-block sample transformer (2 conv blocks + 6 encoder layers) with and without
    checkpointing, from the CUDA allocator; then BatchNorm statistics and weights of fits with and without it."""
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    policy = {ConvBlock, nn.TransformerEncoderLayer}
    x = torch.randn(batch, 1, 8, 8, device=DEVICE)
    y = torch.randint(0, 10, (batch,), device=DEVICE)
    out: dict[str, Any] = {}
    for name in ("none", "mgpu"):
        torch.manual_seed(0)
        model = DigitsTransformer(layers=6, dropout=0.0).to(DEVICE)
        if name == "mgpu":
            lightning_mgpu.apply_activation_checkpointing(model, policy)
        _saved_bytes(model, x, y)  # warm-up (cuBLAS workspaces, autotuning)
        model.zero_grad(set_to_none=True)
        out[f"held_bytes_{name}"], out[f"peak_bytes_{name}"] = _saved_bytes(model, x, y)
        del model
    fits = {}
    for name, ac in (("none", None), ("mgpu", policy)):
        pl.seed_everything(0)
        model = DigitsTransformer(layers=6, dropout=0.0)
        strategy = lightning_mgpu.MGPUDDPStrategy(activation_checkpointing=ac)
        _trainer(strategy, max_steps=4, precision="64-true").fit(model, DigitsDataModule(batch_size=min(batch, 32)))
        stats = [b.running_mean for b in model.modules() if isinstance(b, nn.BatchNorm2d)]
        stats += [b.running_var for b in model.modules() if isinstance(b, nn.BatchNorm2d)]
        fits[name] = (torch.cat([s.flatten().cpu() for s in stats]), _flat(model))
        out[f"batches_tracked_{name}"] = [
            int(b.num_batches_tracked) for b in model.modules() if isinstance(b, nn.BatchNorm2d)
        ]
    out["bn_stats_max_diff"] = float((fits["none"][0] - fits["mgpu"][0]).abs().max())
    out["weights_max_diff"] = float((fits["none"][1] - fits["mgpu"][1]).abs().max())
    return out


@case
def device_monitor() -> dict[str, Any]:
    """DeviceMonitor on CUDA with NVML: utilisation, memory and temperature per rank."""
    monitor = lightning_mgpu.DeviceMonitor(every_n_steps=2, nvml=True)
    trainer = _trainer("mgpu_ddp", max_steps=6, callbacks=[monitor])
    trainer.fit(DigitsCNN(), DigitsDataModule())
    last = monitor.history[-1] if monitor.history else {}
    pick = ("gpu_util", "gpu_mem_mb", "gpu_temp_c", "mem_peak_mb", "mem_mb", "step_ms")
    return {k: last.get(f"device/rank0/{k}", math.nan) for k in pick} | {"intervals": len(monitor.history)}


if __name__ == "__main__":
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the exact comparisons
    from tests.gpu.worker_features import CASES as FEATURES  # the feature cases (token loss, clipping, ...)

    CASES.update(FEATURES)
    name, args = sys.argv[1], json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}")
    result = CASES[name](**args)
    print("RESULT " + json.dumps(result), flush=True)
