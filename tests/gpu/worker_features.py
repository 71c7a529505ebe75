"""The GPU tier's feature cases, run by ``python -m tests.gpu.worker CASE '{"arg": ...}'`` like the others.

Each case trains through ``Trainer(strategy=...).fit`` on one CUDA device (NCCL, world size 1), in a fresh
interpreter, and returns what ``tests/gpu/test_gpu_features.py`` checks: the token-normalised loss, the non-finite
check, global-norm clipping on FSDP2, micro-batching against a real CUDA out-of-memory error, local SGD and
DiLoCo, asynchronous checkpoints, ``mgpu_auto``, the planner against the CUDA allocator, exact evaluation,
``compile=True`` with inductor against eager, offload to host memory, adapters over a 4-bit base, and DDP's
stream. The agreement of the same features across ranks is proved on CPU (gloo, 2 processes) by the default suite.

With ``MGPU_TIER_DEVICE=cpu`` every case runs on CPU (gloo), to check the cases themselves without a GPU; the
allocator figures are then not measured (-1) and the out-of-memory error is raised on purpose.
"""

from __future__ import annotations

import gc
import os
import tempfile
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_mgpu import (
    MGPUAutoStrategy,
    MGPUDDPStrategy,
    MGPUDiLoCoStrategy,
    MGPULocalSGDStrategy,
    MGPUShardedStrategy,
    _compat,
    plan,
)
from lightning_mgpu.parts.compilation import compiled_modules
from lightning_mgpu.parts.token_loss import TokenNormalization
from tests.gpu import worker
from tests.gpu.worker import DEVICE, _finite, _flat
from tests.helpers import full
from tests.models import Regressor, make_data

CASES: dict[str, Callable[..., dict[str, Any]]] = {}


def case(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    CASES[fn.__name__] = fn
    return fn


def _trainer(strategy: Any, **kwargs: Any) -> pl.Trainer:
    """The tier's Trainer, with the loaders' own order (Lightning's automatic sampler would shuffle)."""
    return worker._trainer(strategy, use_distributed_sampler=False, **kwargs)


def _in_order(batch_size: int = 8, n: int = 96, dtype: torch.dtype = torch.float64) -> DataLoader:
    """The data in a fixed order: what a plain loop sees."""
    return DataLoader(make_data(n=n, dtype=dtype), batch_size=batch_size, shuffle=False)


def _sharded(stage: int, **kwargs: Any) -> Any:
    return MGPUDDPStrategy(**kwargs) if stage == 0 else MGPUShardedStrategy(stage=stage, **kwargs)


def _plain_sgd(steps: int, clip: Optional[float] = None) -> tuple[torch.Tensor, list[float]]:
    """One process, plain torch on the same device: ``steps`` SGD+momentum steps of :class:`Regressor` (float64) on
    :func:`_in_order`'s batches; with ``clip``, ``clip_grad_norm_`` before each step. Returns the weights and the
    pre-clip gradient norm of every step."""
    model = Regressor().double().to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=model.lr, momentum=0.9)
    norms: list[float] = []
    done = 0
    while done < steps:
        for x, y in _in_order():
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x.to(DEVICE)), y.to(DEVICE)).backward()
            grads = [p.grad for p in model.parameters()]
            norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            done += 1
            if done == steps:
                break
    return _flat(model), norms


# --- loss_normalization="tokens" ------------------------------------------------------------------------------


@case
def token_loss(stage: int = 0) -> dict[str, Any]:
    """``loss_normalization="tokens"`` with 3 accumulated micro-batches of different token counts (padding masks):
    the weights of one plain loop minimising the mean over every token of each step, the tokens each step counted
    (read where the strategy rescales), and the logged ``loss_per_token`` (float64)."""
    from tests.integration.parts.test_token_loss import B, K, TokenRegressor, token_data, token_losses

    steps = len(token_data()) // (B * K)
    counted: list[float] = []
    original = TokenNormalization.rescale

    def spy(self: TokenNormalization, *args: Any, **kwargs: Any) -> float:
        counted.append(self._tokens)  # this rank's count; at world size 1 the step's total
        return original(self, *args, **kwargs)

    TokenNormalization.rescale = spy  # type: ignore[method-assign]
    pl.seed_everything(0)
    model = TokenRegressor().double()
    trainer = _trainer(_sharded(stage, loss_normalization="tokens"), max_steps=steps, accumulate_grad_batches=K)
    trainer.fit(model, DataLoader(token_data(), batch_size=B, shuffle=False))
    TokenNormalization.rescale = original  # type: ignore[method-assign]
    logged = trainer.callback_metrics.get("loss_per_token")

    reference = Regressor().double().to(DEVICE)
    opt = torch.optim.SGD(reference.parameters(), lr=reference.lr, momentum=0.9)
    expected_tokens, last = [], float("nan")
    for batch in DataLoader(token_data(), batch_size=B * K, shuffle=False):
        opt.zero_grad()
        loss, tokens = token_losses(reference, [t.to(DEVICE) for t in batch])
        (loss / tokens).backward()
        opt.step()
        expected_tokens.append(float(tokens))
        last = float(loss.detach() / tokens)
    return {
        "steps": trainer.global_step,
        "expected_steps": steps,
        "tokens": counted,
        "expected_tokens": expected_tokens,
        "loss_per_token": None if logged is None else float(logged),
        "expected_loss_per_token": last,
        "max_abs_diff": float((_flat(model) - _flat(reference)).abs().max()),
        "moved": float((_flat(reference) - _flat(Regressor().double())).abs().max()),
    }


# --- nonfinite="error" ----------------------------------------------------------------------------------------


class _Poison(pl.Callback):
    """After the backward of optimizer step ``at``, a NaN in the first gradient (this rank's shard under FSDP2)."""

    def __init__(self, at: int = 1) -> None:
        self.at = at
        self.name: Optional[str] = None

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self.at or self.name is not None:
            return
        for name, p in pl_module.named_parameters():
            if p.grad is not None:
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                grad.view(-1)[0] = float("nan")
                self.name = name
                return


@case
def nonfinite(stage: int = 0) -> dict[str, Any]:
    """``nonfinite="error"``: a NaN put into a gradient at optimizer step 1 raises ``FloatingPointError`` naming the
    rank and the parameter, before the step is taken (the weights stay finite)."""
    pl.seed_everything(0)
    model, poison = Regressor().float(), _Poison(at=1)
    trainer = _trainer(_sharded(stage, nonfinite="error"), max_steps=4, callbacks=[poison])
    raised, message = None, ""
    try:
        trainer.fit(model, _in_order(dtype=torch.float32))
    except FloatingPointError as err:
        raised, message = type(err).__name__, str(err)
    return {
        "raised": raised,
        "message": message,
        "poisoned": poison.name,
        "global_step": trainer.global_step,
        "finite": _finite(model),
    }


# --- global-norm clipping on FSDP2 ----------------------------------------------------------------------------


class _PreClipNorms(pl.Callback):
    """The global gradient norm of every step before clipping (Lightning calls this hook before it clips)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        grads = [full(p.grad) for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))


@case
def clip_fsdp2(stage: int, max_norm: float = 0.05, steps: int = 6) -> dict[str, Any]:
    """``gradient_clip_val`` (norm) on FSDP2 stage 2 or 3, whose gradients are ``DTensor`` shards: every step's
    pre-clip norm and the final weights equal a plain loop that clips the whole (unsharded) gradients with
    ``torch.nn.utils.clip_grad_norm_`` (float64)."""
    pl.seed_everything(0)
    model, norms = Regressor().double(), _PreClipNorms()
    strategy = MGPUShardedStrategy(stage=stage)
    trainer = _trainer(
        strategy, max_steps=steps, gradient_clip_val=max_norm, gradient_clip_algorithm="norm", callbacks=[norms]
    )
    trainer.fit(model, _in_order())
    weights, expected_norms = _plain_sgd(steps, clip=max_norm)
    unclipped, _ = _plain_sgd(steps)
    return {
        "strategy": type(strategy).__name__,
        "dtensor": hasattr(next(model.parameters()), "full_tensor"),
        "norms": norms.norms,
        "expected_norms": expected_norms,
        "max_abs_diff": float((_flat(model) - weights).abs().max()),
        "unclipped_diff": float((unclipped - weights).abs().max()),
    }


# --- micro_batch_size="auto" against a real out-of-memory error -----------------------------------------------

# floats per hidden unit and row: 16 x 2**19 x 4 bytes = 32 MiB of activations per row; in the CPU mode, where the
# error is simulated, 2**10 (the same code path without a GiB of activations to compute on 2 cores)
WIDE = 2**19 if DEVICE == "cuda" else 2**10
BUDGET_ROWS = 16  # the memory left to the step: 16 rows' activations (512 MiB)
SIMULATED_LIMIT = 4  # MGPU_TIER_DEVICE=cpu: more rows than this raise torch.OutOfMemoryError on purpose


class _Wide(Regressor):
    """Each row's hidden units are spread over ``WIDE`` values kept for the backward (``tanh``'s output), so one
    row's activations take 32 MiB and a loader batch of 32 rows needs several GiB; float32."""

    def __init__(self) -> None:
        super().__init__()
        self.fan = nn.Parameter(torch.linspace(-1.0, 1.0, WIDE))
        self.errors: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        try:
            if DEVICE != "cuda" and x.shape[0] > SIMULATED_LIMIT:
                raise torch.OutOfMemoryError(f"out of memory: {x.shape[0]} rows (raised on purpose, CPU check)")
            wide = torch.tanh(self.net[0](x).unsqueeze(-1) * self.fan)  # (rows, 16, WIDE)
            return F.mse_loss(self.net[2](wide.mean(-1)), y)
        except torch.OutOfMemoryError as err:
            self.errors.append(str(err).splitlines()[0][:300])
            raise


class _CapMemory(pl.Callback):
    """Once the model is on the device: this process may hold only what it holds now plus ``BUDGET_ROWS`` rows'
    activations (``torch.cuda.set_per_process_memory_fraction``), so the CUDA caching allocator raises a real
    ``torch.OutOfMemoryError`` for larger micro-batches whatever else runs on the GPU."""

    def __init__(self) -> None:
        self.limit_bytes = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if DEVICE != "cuda":
            return
        total = torch.cuda.get_device_properties(0).total_memory
        self.limit_bytes = torch.cuda.memory_reserved() + BUDGET_ROWS * 16 * WIDE * 4
        torch.cuda.set_per_process_memory_fraction(self.limit_bytes / total)


@case
def micro_batch_oom(batch: int = 32, steps: int = 4) -> dict[str, Any]:
    """``micro_batch_size="auto"`` driven by a real CUDA out-of-memory error: a loader batch of 32 rows of 32 MiB
    of activations each exceeds the memory this process may use (:class:`_CapMemory`: 16 rows' worth), so
    the first micro-batches run out of memory; the size backs off by halves until it fits and training finishes.
    On CPU (``MGPU_TIER_DEVICE=cpu``) the error is simulated: ``training_step`` raises ``torch.OutOfMemoryError``
    above 4 rows."""
    pl.seed_everything(0)
    model, cap = _Wide(), _CapMemory()
    strategy = MGPUDDPStrategy(micro_batch_size="auto")
    trainer = _trainer(strategy, max_steps=steps, callbacks=[cap])
    trainer.fit(model, _in_order(batch_size=batch, dtype=torch.float32))
    mb = strategy.micro_batching
    return {
        "backoffs": [(b.from_size, b.to_size, list(b.ranks)) for b in mb.backoffs],
        "size": mb.size,
        "global_step": trainer.global_step,
        "finite": _finite(model),
        "errors": model.errors,
        "limit_bytes": cap.limit_bytes,
        "simulated": DEVICE != "cuda",
    }


# --- mgpu_local_sgd and mgpu_diloco ---------------------------------------------------------------------------


@case
def periodic_sync(steps: int = 6, sync_every: int = 2) -> dict[str, Any]:
    """Local SGD and DiLoCo on NCCL at world size 1, against mgpu_ddp (float64): averaging one rank leaves its
    weights, so local SGD and DiLoCo with a plain outer step (lr 1, no momentum) end with mgpu_ddp's weights; DiLoCo's
    Nesterov outer step (its default) ends elsewhere, finite. Each syncs every ``sync_every`` steps."""
    fits: dict[str, Any] = {}
    builds: dict[str, Callable[[], Any]] = {
        "ddp": MGPUDDPStrategy,
        "local_sgd": lambda: MGPULocalSGDStrategy(sync_every=sync_every),
        "diloco_plain": lambda: MGPUDiLoCoStrategy(
            sync_every=sync_every, outer_lr=1.0, outer_momentum=0.0, nesterov=False
        ),
        "diloco": lambda: MGPUDiLoCoStrategy(sync_every=sync_every),
    }
    for name, build in builds.items():
        pl.seed_everything(0)
        model, strategy = Regressor().double(), build()
        _trainer(strategy, max_steps=steps).fit(model, _in_order())
        sync = getattr(strategy, "periodic_sync", None)
        fits[name] = (_flat(model), sync.syncs if sync is not None else None, _finite(model))
    out: dict[str, Any] = {}
    for name in ("local_sgd", "diloco_plain", "diloco"):
        weights, syncs, finite = fits[name]
        out[name] = {"syncs": syncs, "finite": finite, "diff_to_ddp": float((weights - fits["ddp"][0]).abs().max())}
    return out


# --- async_checkpoint=True ------------------------------------------------------------------------------------


class _SaveAtRecording(pl.Callback):
    """``trainer.save_checkpoint`` right after optimizer step ``step``, keeping the weights it must hold."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path
        self.expected: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step and not self.expected:
            self.expected = {k: full(v).detach().cpu().clone() for k, v in pl_module.state_dict().items()}
            trainer.save_checkpoint(self.path)


def _saved_state(path: str) -> tuple[dict[str, torch.Tensor], int]:
    """The checkpoint's weights and global_step, from a consolidated file or a sharded directory."""
    if os.path.isfile(path):
        saved = torch.load(path, weights_only=False, map_location="cpu")
        return saved["state_dict"], saved["global_step"]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    converted = os.path.join(tempfile.mkdtemp(), "converted.pt")
    dcp_to_torch_save(path, converted)
    meta = torch.load(os.path.join(path, "meta.pt"), weights_only=False)
    return torch.load(converted, weights_only=False)["state_dict"], meta["global_step"]


@case
def async_checkpoint(stage: int, checkpoint: str = "consolidated", steps: int = 6, save: int = 3) -> dict[str, Any]:
    """``async_checkpoint=True`` on NCCL: the checkpoint saved after step 3 while training goes on holds exactly the
    weights of step 3 (its write ends after later steps changed them), and a run resumed from it ends with the
    uninterrupted run's weights (float64, exact)."""
    torch.use_deterministic_algorithms(True)
    kwargs: dict[str, Any] = {"async_checkpoint": True}
    if stage:
        kwargs["checkpoint"] = checkpoint
    path = os.path.join(tempfile.mkdtemp(), f"step{save}.ckpt")
    saver = _SaveAtRecording(save, path)
    # Lightning's automatic sampler, which the mgpu strategies make resumable mid-epoch
    whole = worker._regressor_fit(_sharded(stage, **kwargs), steps, save=saver)
    saved, saved_step = _saved_state(path)
    exact = sorted(saved) == sorted(saver.expected) and all(
        torch.equal(saved[k].cpu(), saver.expected[k]) for k in saver.expected
    )
    moved_after = any(not torch.equal(full(v).detach().cpu(), saver.expected[k]) for k, v in whole.state_dict().items())
    resumed = worker._regressor_fit(_sharded(stage, **kwargs), steps, ckpt_in=path)
    return {
        "saved_step": saved_step,
        "saved_exact": exact,
        "trained_on_after_save": moved_after,
        "saved_as_dir": os.path.isdir(path),
        "resume_max_abs_diff": float((_flat(whole) - _flat(resumed)).abs().max()),
    }


# --- mgpu_auto ------------------------------------------------------------------------------------------------


class _Deep(Regressor):
    """Blocks whose activations dominate (``tests/integration/strategies/test_auto.py``'s model): checkpointing
    them lowers the peak."""

    def __init__(self, blocks: int = 4, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(6, width)]
        for _ in range(blocks):
            layers.append(nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh()))
        self.net = nn.Sequential(*layers, nn.Linear(width, 3))


class _Chosen(pl.Callback):
    def __init__(self) -> None:
        self.record: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        s, d = trainer.strategy, trainer.strategy.auto_decision
        self.record = {
            "class": type(s).__name__,
            "decision": [d.strategy, d.activation_checkpointing],
            "checkpointing": s.activation_checkpointing is not None,
            "usable_bytes": d.usable_bytes,
            "reason": d.reason,
        }


@case
def auto(batch: int = 48) -> dict[str, Any]:
    """``strategy="mgpu_auto"`` on CUDA: planned for the device's own memory it takes mgpu_ddp; given a device memory
    between the plan's peaks with and without activation checkpointing it takes mgpu_ddp with checkpointing. Both
    fits finish, and the decision is recorded in ``trainer.strategy.auto_decision``."""
    out: dict[str, Any] = {}
    rows = tuple(t[:batch] for t in make_data().tensors)
    p = plan(_Deep().double(), devices=1, device_memory="1TiB", batch=rows, precisions=("32-true",))
    peaks = {(r.strategy, r.activation_checkpointing): r.predicted_peak_bytes_per_rank for r in p.rows}
    tight = (peaks["mgpu_ddp", True] + min(v for (_, ac), v in peaks.items() if not ac)) // 2
    for name, memory in (("device", None), ("tight", tight)):
        pl.seed_everything(0)
        model, chosen = _Deep().double(), _Chosen()
        strategy = MGPUAutoStrategy(device_memory=memory, headroom=0.0 if memory else 0.10)
        trainer = _trainer(strategy, max_steps=4, callbacks=[chosen])
        trainer.fit(model, _in_order(batch_size=batch))
        out[name] = chosen.record | {"steps": trainer.global_step, "finite": _finite(model)}
    out["device_total_bytes"] = torch.cuda.get_device_properties(0).total_memory if DEVICE == "cuda" else -1
    out["tight_bytes"] = tight
    return out


# --- the planner against the CUDA allocator -------------------------------------------------------------------


class _StepPeak(pl.Callback):
    """``torch.cuda.max_memory_allocated`` over the second training step (the first creates the optimizer state)."""

    def __init__(self) -> None:
        self.peak = -1

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if DEVICE == "cuda" and idx == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if DEVICE == "cuda" and int(args[-1]) == 1:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()


def _cublas_workspaces() -> int:
    """Bytes cuBLAS keeps in the caching allocator for its workspaces (the forward's thread and the backward's);
    the planner does not count them."""
    if DEVICE != "cuda":
        return -1
    before = torch.cuda.memory_allocated()
    for dtype in (torch.float32, torch.bfloat16):  # FP32 and BF16 matmuls, each forward and backward
        a = torch.randn(64, 64, device="cuda", dtype=dtype, requires_grad=True)
        (a @ a).float().sum().backward()
        del a
    torch.cuda.synchronize()
    gc.collect()
    return torch.cuda.memory_allocated() - before


@case
def planner_vs_allocator(
    strategy: str = "mgpu_ddp",
    precision: str = "32-true",
    ac: bool = False,
    vocab: int = 8192,
    d_model: int = 1024,
    heads: int = 16,
    layers: int = 8,
    batch: int = 8,
    seq: int = 128,
) -> dict[str, Any]:
    """The plan's peak per rank against ``torch.cuda.max_memory_allocated`` of the second step of a real fit on
    CUDA (a ~117M-parameter ``TransformerLM``, AdamW): ``PlanRow.one_device_bytes`` (for mgpu_ddp the model
    states and activations and the first buckets DDP may hold while it rebuilds them on the second step; for the
    FSDP stages the whole peak). The allocator's figure is given with and without cuBLAS's workspaces, which the
    plan does not count."""
    from lightning_mgpu.planning.lm import RandomTokens, TransformerLM

    data = RandomTokens(batch_size=batch, seq_len=seq, vocab=vocab, samples=4 * batch)
    data.setup("fit")
    sample = next(iter(data.train_dataloader()))
    make = lambda: TransformerLM(vocab=vocab, d_model=d_model, heads=heads, layers=layers)  # noqa: E731
    row = plan(make, devices=1, device_memory="1TiB", batch=sample, precisions=(precision,), strategies=(strategy,))
    predicted = row.row(strategy, precision, ac)
    workspaces = _cublas_workspaces()
    policy = {nn.TransformerEncoderLayer} if ac else None
    built = _sharded(
        {"mgpu_ddp": 0, "mgpu_zero1": 1, "mgpu_sharded": 2, "mgpu_zero3": 3}[strategy], activation_checkpointing=policy
    )
    torch.manual_seed(0)
    peak = _StepPeak()
    trainer = _trainer(built, max_steps=3, precision=precision, callbacks=[peak])
    trainer.fit(make(), data)
    measured = peak.peak - workspaces if peak.peak >= 0 else -1
    return {
        "predicted_peak_bytes": predicted.predicted_peak_bytes_per_rank,
        "predicted_measurable_bytes": predicted.one_device_bytes,
        "predicted_rebuilt_buckets_bytes": predicted.rebuilt_buckets_bytes,
        "measured_peak_bytes": peak.peak,
        "cublas_workspace_bytes": workspaces,
        "measured_less_workspaces": measured,
        "ratio": measured / predicted.one_device_bytes if measured > 0 else -1.0,
        "steps": trainer.global_step,
    }


# --- exact_evaluation on the device's collectives -------------------------------------------------------------


@case
def sharded_module_stays_on_device(stage: int) -> dict[str, Any]:
    """fit, then validate, with the module's buffer on the root module (outside every FSDP unit): how often the
    strategy moved the LightningModule to the CPU (Lightning's teardown does, after each stage), and where the
    buffer and the parameters are when ``validate`` runs its first step."""
    from tests.integration.parts.test_evaluation import EvalRegressor, indexed

    class _Spy(EvalRegressor):
        def __init__(self) -> None:
            super().__init__()
            self.cpu_calls = 0
            self.devices_in_validate: list[str] = []

        def cpu(self) -> Any:
            self.cpu_calls += 1
            return super().cpu()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0 and not self.trainer.sanity_checking:
                # a DTensor's device is its shard's; no gather (a collective inside inference mode cannot make a
                # parameter-sized copy of an inference tensor)
                devices = [self.offset.device, *(p.device for p in self.parameters())]
                self.devices_in_validate = sorted({str(d) for d in devices})
            super().validation_step(batch, batch_idx)

    pl.seed_everything(0)
    model = _Spy().double()
    trainer = _trainer(_sharded(stage), max_steps=-1, max_epochs=1, limit_val_batches=1.0)
    trainer.fit(model, DataLoader(indexed(16), batch_size=4))
    calls_after_fit = model.cpu_calls
    trainer.validate(model, DataLoader(indexed(8), batch_size=4), verbose=False)
    return {
        "cpu_calls_after_fit": calls_after_fit,
        "cpu_calls": model.cpu_calls,
        "devices_in_validate": model.devices_in_validate,
        "root_device": str(trainer.strategy.root_device),
        "offset_device_after": str(model.offset.device),
    }


@case
def exact_evaluation(stage: int = 0) -> dict[str, Any]:
    """``exact_evaluation=True`` (the default) on NCCL: fit (with validation), validate, test and predict on 37
    samples in batches of 4, 1 and 5 (uneven last batches). The logged epoch values, each batch weighted by its
    size, equal one plain forward over the whole set on the same device (float64); every sample is evaluated once;
    ``trainer.predict`` returns every prediction once, in dataset order."""
    from tests.integration.parts.test_evaluation import (
        PREDICT_BATCH,
        TEST_BATCH,
        VAL_BATCH,
        EvalRegressor,
        indexed,
    )

    pl.seed_everything(0)
    model = EvalRegressor().double()
    trainer = _trainer(_sharded(stage), max_steps=-1, max_epochs=1, limit_val_batches=1.0)
    data = indexed()
    trainer.fit(model, DataLoader(indexed(16), batch_size=4), DataLoader(data, batch_size=VAL_BATCH))
    out: dict[str, Any] = {"fit_val_mse": float(trainer.callback_metrics["val_mse"]), "fit_seen": model.seen["val"]}
    model.seen = {"val": [], "test": [], "predict": []}
    trainer.validate(model, DataLoader(data, batch_size=VAL_BATCH), verbose=False)
    out["val_mse"] = float(trainer.callback_metrics["val_mse"])
    out["val_tm"] = float(trainer.callback_metrics["val_tm"])
    trainer.test(model, DataLoader(data, batch_size=TEST_BATCH), verbose=False)
    out["test_mse"] = float(trainer.callback_metrics["test_mse"])
    out["test_tm"] = float(trainer.callback_metrics["test_tm"])
    predictions = trainer.predict(model, DataLoader(data, batch_size=PREDICT_BATCH))
    out["seen"] = model.seen
    x, y, _ = data.tensors
    reference = EvalRegressor().double().to(DEVICE)  # lr 0: the fit leaves the weights as they were
    with torch.no_grad():
        expected = reference(x.to(DEVICE))
    got = torch.cat([p.to(DEVICE) for p in predictions])  # type: ignore[union-attr]
    out["expected_mse"] = float(F.mse_loss(expected, y.to(DEVICE)))
    out["predictions_shape"] = list(got.shape)
    out["predictions_max_abs_diff"] = float((got - expected).abs().max()) if got.shape == expected.shape else -1.0
    out["n"] = len(data)
    return out


# --- compile=True with inductor -------------------------------------------------------------------------------


class _Graphs(pl.Callback):
    """Graphs compiled in this process, counted from a fresh compiler state at set-up: after the first 2 optimizer
    steps (warm-up: the graphs of a stepping and of an accumulating micro-batch) and at the end."""

    def __init__(self) -> None:
        self.warm = -1
        self.end = -1
        self.base = 0
        self.compiled: list[str] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        torch.compiler.reset()
        self.base = _compat.compiled_graph_count()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.compiled = compiled_modules(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == 2 and self.warm < 0:
            self.warm = _compat.compiled_graph_count() - self.base

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.end = _compat.compiled_graph_count() - self.base


@case
def compile_parity(stage: int, precision: str = "32-true", backend: str = "inductor", steps: int = 8) -> dict[str, Any]:
    """``compile=True`` (``backend`` inductor on CUDA) against eager: the residual BatchNorm blocks trained for
    ``steps`` optimizer steps with 2 accumulated micro-batches each and norm clipping, in ``precision``, compiled
    and eager, from the same weights and data. Returns both runs' weights (their largest difference and size, and
    how far training moved them) and the graphs compiled after warm-up and at the end."""
    from tests.models import BlockRegressor

    runs: dict[str, Any] = {}
    for name, options in (("eager", None), ("compiled", {"backend": backend})):
        torch.manual_seed(0)
        model = BlockRegressor(blocks=3, width=64, dropout=0.0)
        graphs = _Graphs()
        strategy = _sharded(stage, compile=options) if options else _sharded(stage)
        trainer = _trainer(
            strategy,
            max_steps=steps,
            precision=precision,
            accumulate_grad_batches=2,
            gradient_clip_val=1.0,
            callbacks=[graphs],
        )
        trainer.fit(model, _in_order(batch_size=16, n=512, dtype=torch.float32))
        runs[name] = (_flat(model), graphs, trainer.global_step)
    eager, compiled = runs["eager"][0], runs["compiled"][0]
    initial = _flat(BlockRegressor(blocks=3, width=64, dropout=0.0))
    graphs = runs["compiled"][1]
    return {
        "steps": [runs["eager"][2], runs["compiled"][2]],
        "max_abs_diff": float((compiled - eager).abs().max()),
        "max_abs_weight": float(eager.abs().max()),
        "moved": float((eager - initial).abs().max()),
        "compiled_modules": graphs.compiled,
        "graphs_warm": graphs.warm,
        "graphs_end": graphs.end,
        "eager_graphs": runs["eager"][1].end,
    }


# --- offload="cpu": FSDP2's shards, gradients and optimizer state in host memory --------------------------------


class _Where(pl.Callback):
    """Where the parameter shards, their gradients and the optimizer state are at the end of fit (device types)."""

    def __init__(self) -> None:
        self.seen: dict[str, list[str]] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = list(pl_module.parameters())
        state = [t for opt in trainer.optimizers for s in opt.state.values() for t in s.values()]
        self.seen["params"] = sorted({p.to_local().device.type for p in params})
        self.seen["grads"] = sorted({p.grad.to_local().device.type for p in params if p.grad is not None})
        self.seen["state"] = sorted({t.device.type for t in state if isinstance(t, torch.Tensor)})


class _SquareRegressor(Regressor):
    """The regressor with a square hidden layer of 2048 units: 32 MiB of float64 weights in it, so that the
    parameters, their gradients and the momentum outweigh what cuBLAS keeps for its workspaces (about 64 MiB on
    the device in both runs alike), and where they live shows in the device's peak."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 2048), nn.Tanh(), nn.Linear(2048, 2048), nn.Tanh(), nn.Linear(2048, 3))


@case
def offload(stage: int = 3, steps: int = 6) -> dict[str, Any]:
    """The same ``steps`` SGD steps (float64, gradient clipping) with ``offload=None`` and ``offload="cpu"``: both
    runs' weights, where each one's parameter shards, gradients and optimizer state were after the last step, and
    the device's peak allocated bytes of each above what the process held before it (-1 on CPU)."""
    runs: dict[str, Any] = {}
    for name in ("device", "cpu"):
        torch.manual_seed(0)
        model = _SquareRegressor().double()
        where = _Where()
        if DEVICE == "cuda":  # the peak above what this process held before the run (a run left nothing behind)
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()
        strategy = _sharded(stage, offload=None if name == "device" else "cpu")
        trainer = _trainer(strategy, max_steps=steps, gradient_clip_val=0.5, callbacks=[where])
        trainer.fit(model, _in_order())
        peak = torch.cuda.max_memory_allocated() - held if DEVICE == "cuda" else -1
        runs[name] = {"weights": _flat(model), "peak": peak, "steps": trainer.global_step, **where.seen}
        del trainer, model, strategy
        gc.collect()  # nothing of this run counts in the next one's peak
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    torch.manual_seed(0)
    initial = _flat(_SquareRegressor().double())
    return {
        "steps": [runs["device"]["steps"], runs["cpu"]["steps"]],
        "max_abs_diff": float((runs["cpu"]["weights"] - runs["device"]["weights"]).abs().max()),
        "moved": float((runs["device"]["weights"] - initial).abs().max()),
        "where": {name: {k: run[k] for k in ("params", "grads", "state")} for name, run in runs.items()},
        "peak_bytes": {name: run["peak"] for name, run in runs.items()},
    }


# --- DDP on the default stream --------------------------------------------------------------------------------


@case
def stream_warning(stage: int = 0) -> dict[str, Any]:
    """mgpu_ddp (or ZeRO-1, which builds DDP the same way) with accumulation: the warnings every backward raised.
    DDP built in a side stream made torch >= 2.10 warn "The AccumulateGrad node's stream does not match the stream
    of the node that produced the incoming gradient" on each one; built on the default stream, none."""
    import warnings

    pl.seed_everything(0)
    model = Regressor().float()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _trainer(_sharded(stage), max_steps=4, accumulate_grad_batches=2)
        trainer.fit(model, _in_order(dtype=torch.float32))
    stream = [str(w.message)[:300] for w in caught if "stream" in str(w.message).lower()]
    return {"global_step": trainer.global_step, "stream_warnings": stream, "warnings": len(caught)}


# --- a 4-bit frozen base (torchao's NF4) with LoRA adapters, offloaded or not ----------------------------------


def _adapters_and_base(model: pl.LightningModule) -> tuple[torch.Tensor, torch.Tensor, list[str], int]:
    """The adapters (gathered, flat), the base dequantised (flat), the devices the base's packed bytes are on and
    how many weights are still 4-bit."""
    from lightning_mgpu.quantization import is_nf4

    named = list(model.named_parameters())
    adapters = torch.cat([full(p.detach()).double().flatten().cpu() for n, p in named if "lora_" in n])
    local = [p.to_local() if hasattr(p, "to_local") else p for _, p in named]
    packed = [t for t in local if is_nf4(t)]
    base = torch.cat([full(p.detach()).double().flatten().cpu() for n, p in named if "lora_" not in n])
    return adapters, base, sorted({t.quantized_data.device.type for t in packed}), len(packed)


class _BaseDevices(pl.Callback):
    """Where the packed base is when training ends, before the strategy's teardown (Lightning's single-device strategy
    moves the module back to the host there)."""

    def __init__(self, seen: dict[str, list[str]]) -> None:
        self.seen = seen

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen["where"] = _adapters_and_base(pl_module)[2]


@case
def four_bit(steps: int = 4) -> dict[str, Any]:
    """A peft LoRA over a tiny Llama whose frozen linear weights ``quantize_frozen`` packed in 4 bits (torchao's
    NF4), float64, the same ``steps`` AdamW steps three ways on the device: Lightning's own single-device strategy,
    ``mgpu_zero3`` and ``mgpu_zero3`` with ``offload="cpu"``. Returns each run's adapters against Lightning's, how far
    training moved them, the base dequantised against Lightning's, and where the packed base was when training
    ended."""
    from tests.integration.test_quantization import QLoRALlama, tokens

    runs: dict[str, Any] = {}
    for name in ("lightning", "zero3", "zero3_offload"):
        strategy = {"lightning": "auto", "zero3": _sharded(3), "zero3_offload": _sharded(3, offload="cpu")}[name]
        model = QLoRALlama()
        start, _, _, packed = _adapters_and_base(model)
        seen: dict[str, list[str]] = {}
        trainer = _trainer(strategy, max_steps=steps, callbacks=[_BaseDevices(seen)])
        trainer.fit(model, DataLoader(tokens(), batch_size=4, shuffle=False))
        adapters, base, _, nf4 = _adapters_and_base(model)
        runs[name] = {"adapters": adapters, "base": base, "where": seen["where"], "nf4": [packed, nf4]}
        runs[name]["steps"], runs[name]["moved"] = trainer.global_step, float((adapters - start).abs().max())
        del trainer, model, strategy
        gc.collect()
    ref = runs["lightning"]
    return {
        name: {
            "steps": run["steps"],
            "moved": run["moved"],
            "max_abs_diff": float((run["adapters"] - ref["adapters"]).abs().max()),
            "base_max_abs_diff": float((run["base"] - ref["base"]).abs().max()),
            "base_on": run["where"],
            "nf4": run["nf4"],
        }
        for name, run in runs.items()
    }
