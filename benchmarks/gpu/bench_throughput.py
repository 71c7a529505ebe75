"""Tokens/s and model FLOPs utilisation (MFU) of transformer language models on one GPU, bf16, side by side: our
presets vs Lightning's built-in strategies vs a plain torch loop, eager and compiled, with the calls that make the host
wait for the device, and step time with vs without activation checkpointing, all in one run.

    python benchmarks/gpu/bench_throughput.py [--out benchmarks/results]     # the 368M model, eager, every runner
    python benchmarks/gpu/bench_throughput.py --models gpt2-124m --modes eager compiled
    python benchmarks/gpu/bench_throughput.py --cases proof --rounds 1 --warmup 3 --steps 10   # make gpu-proof's
    python benchmarks/gpu/bench_throughput.py --tiny [--modes eager compiled]  # a check of the script (CPU works)

Models (``--models``; :class:`lightning_mgpu.planning.lm.TransformerLM`: pre-norm causal ``nn.TransformerEncoderLayer``
blocks, FFN 4 x d_model, no position embedding, an untied head):

  lm-368m     24 layers, d_model 1024, 16 heads, vocab 32000, seq 1024, batch 8: 368M parameters (the default)
  gpt2-124m   GPT-2 small's shape: 12 layers, d_model 768, 12 heads, vocab 50257, seq 1024, batch 16: 162M
              parameters with the untied head, 124M without the token embedding (the parameters MFU counts)

Runners (one GPU, world size 1, ``bf16-mixed``, AdamW as the module configures it, the same data loader):

  torch             a plain loop: autocast bf16, backward, step, zero_grad
  torch+ac          the same with every transformer layer checkpointed (lightning_mgpu.apply_activation_checkpointing)
  lightning_ddp     Trainer(strategy="ddp")
  lightning_fsdp    Trainer(strategy=FSDPStrategy(auto_wrap_policy={TransformerEncoderLayer}))
  mgpu_ddp          Trainer(strategy="mgpu_ddp")
  mgpu_ddp+ac       MGPUDDPStrategy(activation_checkpointing={TransformerEncoderLayer})
  mgpu_ddp+sac      the same keeping each layer's matmuls and attention (activation_checkpointing_save="matmuls")
  lightning_fsdp+ac the same with FSDPStrategy(activation_checkpointing_policy={TransformerEncoderLayer})
  mgpu_sharded      Trainer(strategy="mgpu_sharded")    (FSDP2, gradients sharded: ZeRO-2)
  mgpu_sharded+ac   MGPUShardedStrategy(stage=2, activation_checkpointing={TransformerEncoderLayer})
  mgpu_zero3        Trainer(strategy="mgpu_zero3")      (FSDP2, parameters sharded: ZeRO-3)
  mgpu_zero3+ac     MGPUShardedStrategy(stage=3, activation_checkpointing={TransformerEncoderLayer})

Modes (``--modes``): ``eager`` (the default), and ``compiled`` (inductor, or ``--compile-backend``), each runner
compiled its framework's own way (the checkpointed runners are eager only):

  torch             torch.compile(model): the module's forward (the loss stays eager)
  lightning_ddp     Lightning's way, trainer.fit(torch.compile(model)): Lightning compiles the forward and the whole
                    training_step; the module's ``self.log`` runs outside the graph (torch.compiler.disable, as
                    Lightning's master branch does: since torch 2.12 dynamo fails inside ``LightningModule.log``)
  lightning_fsdp    the same under FSDPStrategy (not in the proof's cases)
  mgpu_ddp          MGPUDDPStrategy(compile=True): the forward, compiled after the DDP wrap
  mgpu_sharded      MGPUShardedStrategy(stage=2, compile=True): each transformer layer, after sharding
  mgpu_zero3        MGPUShardedStrategy(stage=3, compile=True): the same at stage 3

A compiled runner compiles once, in its warm-up steps (the table's ``run s`` is the runner's whole time, set-up and
compilation included); ``torch._dynamo`` is reset after each compiled runner, so each compiles its own graphs.
Inductor's on-disk caches (FX graphs, AOTAutograd, Triton kernels) are kept: a run after one that compiled the same
graphs compiles in a fraction of the time, which the proof uses (its ``compile-warm`` part).

``--cases proof``: the cases of ``make gpu-proof`` (:data:`PROOF_CASES`), in this order: gpt2-124m eager on torch,
mgpu_ddp, lightning_ddp, lightning_fsdp and mgpu_zero3; lm-368m eager on the same five and on torch+ac and mgpu_ddp+ac;
then gpt2-124m compiled on torch, mgpu_ddp, lightning_ddp and mgpu_zero3, last because their compile times are the
least certain. ``--models``, ``--modes`` and ``--only`` narrow any selection.

Each runner trains ``--warmup`` + ``--steps`` optimizer steps; the step time is the median of the timed steps, over
``--rounds`` rounds that visit the cases in turn. A step's end is a CUDA event recorded on the device's stream
(:class:`StepClock`): nothing waits for the device between steps, as in a real run, so a framework's host work between
two steps overlaps the device's work as it would in training. Results files record it (``"clock": "events"``); those
without the field synchronised the device at each step's end, which laid each runner's host work between two steps
bare. MFU counts model FLOPs (6 x non-embedding parameters + attention 12 x layers x d_model x seq per token;
recomputation is not counted) against the device's dense bf16 peak. The result is the ratios, each against the plain
torch loop of the same model and mode; absolute figures are reported with the device.

Host syncs per step (``syncs/step``): on CUDA, the synchronizing CUDA calls inside the timed steps as
``torch.cuda.set_sync_debug_mode("warn")`` reports them (a device-to-host copy, ``item()``, ``nonzero``,
``torch.cuda.synchronize``, ...: one warning each, captured and counted), divided by the timed steps. The mode is on
from the end of the warm-up to the end of the last timed step only: set-up, compilation and the read of the step clock
at the end are not counted. It costs nothing where nothing syncs and a Python warning where something does. On CPU
nothing waits for a device and the column reads ``-``: there the calls that would wait on a GPU are what the test
helper ``tests/host_syncs.py`` counts in the integration tests, through a torch function mode on every call, which
would slow the very steps timed here.

Activation checkpointing's cost: each ``+ac`` runner's step time against the same runner without, printed beside the
FLOPs that recomputing the checkpointed layers' forward adds (x1.30 for lm-368m, x1.24 for gpt2-124m: what a
compute-bound step would pay); what the measured ratio has beyond that is the recompute's host time and its
memory-bound kernels (layer norms, the activation function, residual adds) run again: ``--profile`` shows which.

After the table the goals (``goals.py``) are printed as met, missed or not measured (``mgpu_ddp`` >= 0.98x plain
torch; ``mgpu_zero3`` >= Lightning's ``FSDPStrategy``; the compiled gpt2-124m under ``mgpu_ddp`` >= 40% MFU), a missed
goal with the command of the profile that says where its time goes. Each case's row is written to the result file as
soon as it is measured (the file is rewritten after every case), so a run stopped at a time limit keeps the cases
before; a case that raises is reported (``failed``, with the error) and the other cases run; the script then exits 1.

``--profile N`` then runs each of ``--profile-runners`` (default: torch, Lightning's ``ddp`` and ``FSDPStrategy``,
``mgpu_ddp``, ``mgpu_zero3``) of each selected model and mode once more with N steps under ``torch.profiler`` and
prints, per step: the wall time, how long the device was busy (the union of its kernels and copies) and its share of
the wall time, the kernels launched, the calls that made the host wait for the device (``_local_scalar_dense`` is
``item()`` and its kin; the CUDA synchronizations), then, for each runner, the operators whose host self time and
device time differ most from the plain loop's: where a runner's step goes beyond plain torch. ``--rounds 0 --profile
5`` runs the profile alone (saved as ``gpu-profile-<device>-<date>.json``). On CPU (``--tiny``) the device columns
read 0. The profile is not measured on a GPU yet (``python benchmarks/gpu/bench_throughput.py --rounds 0 --profile 5
--models gpt2-124m --modes eager compiled --profile-runners torch mgpu_ddp``).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import pytorch_lightning as pl
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import goals
from env import environment, result_name

import lightning_mgpu
from lightning_mgpu.planning.lm import RandomTokens, TransformerLM

PEAK_BF16 = (("H100 PCIe", 756e12), ("H100", 989.4e12), ("H200", 989.4e12), ("A100", 312e12))
LAYER = nn.TransformerEncoderLayer
#: the models' shapes and batch per device (``--models``)
MODELS: dict[str, dict[str, int]] = {
    "lm-368m": {"d_model": 1024, "heads": 16, "layers": 24, "vocab": 32000, "seq": 1024, "batch": 8},
    "gpt2-124m": {"d_model": 768, "heads": 12, "layers": 12, "vocab": 50257, "seq": 1024, "batch": 16},
}
#: ``--tiny``: every model at this shape, to check the script
TINY: dict[str, int] = {"d_model": 64, "heads": 4, "layers": 2, "vocab": 512, "seq": 64, "batch": 2}
SHAPE = ("d_model", "heads", "layers", "vocab", "seq", "batch")
#: the runners with a compiled mode
COMPILED = ("torch", "lightning_ddp", "lightning_fsdp", "mgpu_ddp", "mgpu_sharded", "mgpu_zero3")
#: what the waits that ``torch.cuda.set_sync_debug_mode("warn")`` reports say
SYNC_WARNING = "called a synchronizing CUDA operation"


class Case(NamedTuple):
    model: str
    compiled: bool
    runner: str

    @property
    def label(self) -> str:
        return f"{self.model} {goals.mode(self.compiled)} {self.runner}"


_MAIN = ("torch", "mgpu_ddp", "lightning_ddp", "lightning_fsdp", "mgpu_zero3")
#: ``--cases proof``: what ``make gpu-proof`` measures, in order (the compiled cases last: their compile times are the
#: least certain, and a run stopped at its time limit keeps the cases before)
PROOF_CASES: tuple[Case, ...] = (
    *(Case("gpt2-124m", False, r) for r in _MAIN),
    *(Case("lm-368m", False, r) for r in (*_MAIN, "torch+ac", "mgpu_ddp+ac")),
    *(Case("gpt2-124m", True, r) for r in ("torch", "mgpu_ddp", "lightning_ddp", "mgpu_zero3")),
)


def peak_flops(device: str) -> float | None:
    return next((v for k, v in PEAK_BF16 if k in device), None)


class SyncCount:
    """The synchronizing CUDA calls between :meth:`start` and :meth:`stop`, as ``torch.cuda.set_sync_debug_mode``
    reports them (each a warning, captured and counted). ``count``: None until stopped, and on CPU (nothing waits
    for a device there)."""

    def __init__(self) -> None:
        self.count: Optional[int] = None
        self._caught: Optional[warnings.catch_warnings] = None
        self._log: list[warnings.WarningMessage] = []

    def start(self) -> None:
        if not torch.cuda.is_available() or self._caught is not None:
            return
        self._caught = warnings.catch_warnings(record=True)
        self._log = self._caught.__enter__()
        warnings.simplefilter("always")  # every call, not the first of each place
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        if self._caught is None:
            return
        torch.cuda.set_sync_debug_mode("default")
        self.count = sum(SYNC_WARNING in str(w.message) for w in self._log)
        self._caught.__exit__(None, None, None)
        self._caught, self._log = None, []


class StepClock:
    """Each step's end, without making the host wait: on a GPU a CUDA event recorded on the current stream (the
    device's own clock: a step whose host work outlasts its kernels shows as the device waiting), on CPU the host's
    clock. :meth:`stamps` waits for the device once, at the end. ``profiled``: told of each step's end. ``window``:
    ``(warmup, last)``: the host syncs are counted from the end of step ``warmup`` to the end of step ``last``
    (``syncs.count``)."""

    def __init__(self, profiled: Optional[Profiled] = None, window: Optional[tuple[int, int]] = None) -> None:
        self.marks: list[Any] = []
        self.profiled = profiled
        self.window = window
        self.syncs = SyncCount()

    def tick(self) -> int:
        """Marks a step's end; returns the steps marked so far."""
        if torch.cuda.is_available():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        done = len(self.marks)
        if self.window is not None:
            if done == self.window[0]:
                self.syncs.start()
            elif done == self.window[1]:
                self.syncs.stop()
        if self.profiled is not None:
            self.profiled.mark(done)
        return done

    def stamps(self) -> list[float]:
        """Each step's end in seconds (from the first mark on a GPU)."""
        self.syncs.stop()
        if self.marks and isinstance(self.marks[0], torch.cuda.Event):
            torch.cuda.synchronize()
            return [self.marks[0].elapsed_time(e) / 1e3 for e in self.marks]
        return list(self.marks)


class StepTimer(pl.Callback):
    def __init__(self, profiled: Optional[Profiled] = None, clock: Optional[StepClock] = None) -> None:
        self.clock = clock if clock is not None else StepClock(profiled)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.clock.tick()


class Profiled:
    """``torch.profiler`` over ``n`` steps of one run, after ``warmup`` steps: ``mark(done)`` is called as each step
    ends (``done`` steps so far)."""

    def __init__(self, warmup: int, n: int) -> None:
        self.warmup, self.n = warmup, n
        self.prof: Optional[torch.profiler.profile] = None

    def mark(self, done: int) -> None:
        if done == self.warmup:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.start()
        elif done == self.warmup + self.n and self.prof is not None:
            self.prof.stop()


def _model(args: argparse.Namespace) -> TransformerLM:
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # initialised where it trains: fast
        return TransformerLM(vocab=args.vocab, d_model=args.d_model, heads=args.heads, layers=args.layers)


def _data(args: argparse.Namespace) -> RandomTokens:
    total = args.batch * (args.warmup + args.steps + 1)
    return RandomTokens(batch_size=args.batch, seq_len=args.seq, vocab=args.vocab, samples=total)


def _lightning_compiled(args: argparse.Namespace, backend: str) -> Any:
    """The model as Lightning compiles it: ``torch.compile`` of the LightningModule before ``fit`` (Lightning then
    compiles its forward and its whole ``training_step``), with ``self.log`` outside the graph (torch.compiler.disable,
    as Lightning's master branch does: since torch 2.12 dynamo fails inside ``LightningModule.log``)."""
    model = _model(args)
    model.log = torch.compiler.disable(model.log)  # type: ignore[method-assign]
    return torch.compile(model, backend=backend)


def run_torch(
    args: argparse.Namespace,
    ac: bool,
    profiled: Optional[Profiled] = None,
    clock: Optional[StepClock] = None,
    backend: Optional[str] = None,
) -> list[float]:
    """The plain loop; ``backend``: ``torch.compile(model, backend=backend)`` (None: eager)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = _model(args).to(device)
    if ac:
        lightning_mgpu.apply_activation_checkpointing(model, {LAYER})
    opt = model.configure_optimizers()
    step: Any = torch.compile(model, backend=backend) if backend else model
    data = _data(args)
    data.setup("fit")
    clock = clock if clock is not None else StepClock(profiled)
    for tokens, targets in data.train_dataloader():
        tokens, targets = tokens.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = step(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if clock.tick() == args.warmup + args.steps:
            break
    return clock.stamps()


def run_trainer(
    args: argparse.Namespace,
    strategy: Callable[[], Any],
    model: Callable[[argparse.Namespace], Any] = _model,
    profiled: Optional[Profiled] = None,
    clock: Optional[StepClock] = None,
) -> list[float]:
    """``Trainer(strategy=strategy()).fit`` of ``model(args)`` on one device, bf16-mixed: each step's end time."""
    timer = StepTimer(profiled, clock)
    trainer = pl.Trainer(
        strategy=strategy(),
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=args.warmup + args.steps,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(model(args), _data(args))
    return timer.clock.stamps()


Runner = Callable[[argparse.Namespace, StepClock], list[float]]


def runners(tiny: bool, compiled: bool = False, backend: str = "inductor") -> dict[str, Runner]:
    """The runners of one mode, by name: each trains ``args``' model and marks each step's end on the clock given."""
    from pytorch_lightning.strategies import FSDPStrategy

    def trainer(strategy: Callable[[], Any], model: Callable[[argparse.Namespace], Any] = _model) -> Runner:
        return lambda a, c: run_trainer(a, strategy, model, clock=c)

    if compiled:
        pack: Any = True if backend == "inductor" else {"backend": backend}
        lightning = lambda a: _lightning_compiled(a, backend)  # noqa: E731
        out: dict[str, Runner] = {
            "torch": lambda a, c: run_torch(a, ac=False, clock=c, backend=backend),
            "lightning_ddp": trainer(lambda: "ddp", lightning),
            "lightning_fsdp": trainer(lambda: FSDPStrategy(auto_wrap_policy={LAYER}), lightning),
            "mgpu_ddp": trainer(lambda: lightning_mgpu.MGPUDDPStrategy(compile=pack)),
            "mgpu_sharded": trainer(lambda: lightning_mgpu.MGPUShardedStrategy(stage=2, compile=pack)),
            "mgpu_zero3": trainer(lambda: lightning_mgpu.MGPUShardedStrategy(stage=3, compile=pack)),
        }
        assert tuple(out) == COMPILED
    else:
        out = {
            "torch": lambda a, c: run_torch(a, ac=False, clock=c),
            "torch+ac": lambda a, c: run_torch(a, ac=True, clock=c),
            "lightning_ddp": trainer(lambda: "ddp"),
            "lightning_fsdp": trainer(lambda: FSDPStrategy(auto_wrap_policy={LAYER})),
            "lightning_fsdp+ac": trainer(
                lambda: FSDPStrategy(auto_wrap_policy={LAYER}, activation_checkpointing_policy={LAYER})
            ),
            "mgpu_ddp": trainer(lambda: "mgpu_ddp"),
            "mgpu_ddp+ac": trainer(lambda: lightning_mgpu.MGPUDDPStrategy(activation_checkpointing={LAYER})),
            "mgpu_ddp+sac": trainer(
                lambda: lightning_mgpu.MGPUDDPStrategy(
                    activation_checkpointing={LAYER}, activation_checkpointing_save="matmuls"
                )
            ),
            "mgpu_sharded": trainer(lambda: "mgpu_sharded"),
            "mgpu_sharded+ac": trainer(
                lambda: lightning_mgpu.MGPUShardedStrategy(stage=2, activation_checkpointing={LAYER})
            ),
            "mgpu_zero3": trainer(lambda: "mgpu_zero3"),
            "mgpu_zero3+ac": trainer(
                lambda: lightning_mgpu.MGPUShardedStrategy(stage=3, activation_checkpointing={LAYER})
            ),
        }
    if not torch.cuda.is_available():
        out.pop("lightning_fsdp")  # Lightning's FSDPStrategy runs on CUDA only
        out.pop("lightning_fsdp+ac", None)
    return out


def parse_arguments(
    description: str,
    layers: int,
    warmup: int,
    steps: int,
    rounds: Optional[int] = None,
    profile: bool = False,
    models: bool = False,
) -> argparse.Namespace:
    """The language model's shape, the steps, ``--only``, ``--tiny`` (a small model, to check the script) and
    ``--out``, with these defaults; ``rounds``: a ``--rounds`` option too; ``profile``: ``--profile`` and
    ``--profile-runners``; ``models``: ``--models``, ``--modes``, ``--cases`` and ``--compile-backend``, and the shape
    options then default to each model's own (given, they apply to every model)."""
    ap = argparse.ArgumentParser(description=description)
    fixed = {"d_model": 1024, "heads": 16, "layers": layers, "vocab": 32000, "seq": 1024, "batch": 8}
    for name, default in (dict.fromkeys(SHAPE) if models else fixed).items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--steps", type=int, default=steps)
    if rounds is not None:
        ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--only", nargs="*", default=None, help="runner names (default: all)")
    if models:
        ap.add_argument("--models", nargs="*", default=None, choices=sorted(MODELS), help="default: lm-368m")
        ap.add_argument("--modes", nargs="*", default=None, choices=("eager", "compiled"), help="default: eager")
        ap.add_argument("--cases", choices=("proof",), default=None, help="the proof's cases (PROOF_CASES)")
        ap.add_argument("--compile-backend", default="inductor", help="torch.compile's backend in compiled mode")
    if profile:
        ap.add_argument("--profile", type=int, default=0, help="then profile N steps of --profile-runners")
        ap.add_argument("--profile-runners", nargs="*", default=list(PROFILED), help="runners to profile")
    ap.add_argument("--tiny", action="store_true", help="a small model, to check the script")
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON result")
    args = ap.parse_args()
    if args.tiny:
        for name, value in TINY.items():
            setattr(args, name, value)
        args.warmup, args.steps = 1, 3
        if rounds is not None:
            args.rounds = min(args.rounds, 1)  # --rounds 0 (the profile alone) stays
    return args


def case_args(args: argparse.Namespace, model: str) -> argparse.Namespace:
    """``args`` with ``model``'s shape and batch, where the command line did not give them."""
    given = {k: getattr(args, k) for k in SHAPE if getattr(args, k) is not None}
    return argparse.Namespace(**{**vars(args), **MODELS[model], **given, "model": model})


def select_cases(args: argparse.Namespace) -> list[Case]:
    """``--cases``, or every runner of each of ``--models`` x ``--modes``; narrowed by ``--models``, ``--modes`` and
    ``--only``; without the runners this machine lacks (Lightning's FSDP off CUDA)."""
    if args.cases == "proof":
        cases = list(PROOF_CASES)
    else:
        modes = [m == "compiled" for m in (args.modes or ["eager"])]
        names = {c: list(runners(args.tiny, c, args.compile_backend)) for c in (False, True)}
        cases = [Case(m, c, r) for m in (args.models or [goals.DEFAULT_MODEL]) for c in modes for r in names[c]]
    if args.models:
        cases = [c for c in cases if c.model in args.models]
    if args.modes:
        cases = [c for c in cases if goals.mode(c.compiled) in args.modes]
    if args.only:
        known = set(runners(args.tiny)) | set(COMPILED)
        unknown = sorted(set(args.only) - known - {"lightning_fsdp+ac"})
        if unknown:
            raise SystemExit(f"--only: not runners: {unknown} (the runners: {sorted(known)})")
        cases = [c for c in cases if c.runner in args.only]
    available = {c: set(runners(args.tiny, c, args.compile_backend)) for c in (False, True)}
    missing = [c for c in cases if c.runner not in available[c.compiled]]
    if missing:
        print(f"not here (Lightning's FSDPStrategy runs on CUDA only): {', '.join(c.label for c in missing)}")
    return [c for c in cases if c.runner in available[c.compiled]]


def model_figures(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """``model``'s shape, its parameters (counted on the meta device: nothing allocated), the FLOPs per token that MFU
    counts and what recomputing the checkpointed layers' forward adds to them (``ac_flops_ratio``)."""
    a = case_args(args, model)
    with torch.device("meta"):
        lm = TransformerLM(vocab=a.vocab, d_model=a.d_model, heads=a.heads, layers=a.layers)
    params = sum(p.numel() for p in lm.parameters())
    layers = sum(p.numel() for p in lm.blocks.parameters())
    attention = 12 * a.layers * a.d_model * a.seq
    flops = 6 * (params - lm.embed.weight.numel()) + attention
    return {
        **{k: getattr(a, k) for k in SHAPE},
        "parameters": params,
        "flops_per_token": flops,
        # the forward is a third of the counted FLOPs: recomputing the layers' forward adds 2 x their parameters
        # and a third of the attention's
        "ac_flops_ratio": (flops + 2 * layers + attention / 3) / flops,
    }


def make_rows(
    cases: list[Case],
    times: dict[Case, list[float]],
    syncs: dict[Case, list[Optional[float]]],
    runner_s: dict[Case, list[float]],
    errors: dict[Case, str],
    figures: dict[str, dict[str, Any]],
    peak: Optional[float],
) -> list[dict[str, Any]]:
    """One row per case measured or failed so far, in the cases' order; ``vs_torch`` against the plain loop of the
    same model and mode."""
    medians = {c: statistics.median(ts) for c, ts in times.items() if ts}
    rows = []
    for case in cases:
        base = {"runner": case.runner, "model": case.model, "compiled": case.compiled}
        if case in errors:
            rows.append({**base, "error": errors[case]})
            continue
        if case not in medians:
            continue
        step = medians[case]
        fig = figures[case.model]
        tps = fig["batch"] * fig["seq"] / step
        torch_step = medians.get(Case(case.model, case.compiled, "torch"))
        counted = [s for s in syncs[case] if s is not None]
        rows.append(
            {
                **base,
                "step_ms": step * 1e3,
                "tokens_per_s": tps,
                "mfu": fig["flops_per_token"] * tps / peak if peak else None,
                "vs_torch": torch_step / step if torch_step else None,
                "timed_steps": len(times[case]),
                "host_syncs_per_step": statistics.median(counted) if counted else None,
                "runner_s": statistics.median(runner_s[case]),
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]], figures: dict[str, dict[str, Any]], env: dict[str, Any]) -> None:
    print(f"bf16-mixed, on {env['device']} (torch {env['torch']}, Lightning {env['pytorch_lightning']})")
    for name, f in figures.items():
        print(
            f"  {name}: {f['parameters'] / 1e6:.0f}M parameters ({f['layers']} layers, d_model {f['d_model']}, "
            f"vocab {f['vocab']}), batch {f['batch']} x seq {f['seq']}"
        )
    print(
        f"{'model':<11}{'mode':<10}{'runner':<18}{'step ms':>9}{'tokens/s':>11}{'MFU':>7}{'vs torch':>10}"
        f"{'syncs/step':>12}{'run s':>7}"
    )
    for r in rows:
        head = f"{r['model']:<11}{goals.mode(r['compiled']):<10}{r['runner']:<18}"
        if "error" in r:
            print(f"{head}failed: {r['error'][:200]}")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        rel = f"{r['vs_torch']:.3f}x" if r["vs_torch"] else "-"
        sync = f"{r['host_syncs_per_step']:.1f}" if r["host_syncs_per_step"] is not None else "-"
        print(f"{head}{r['step_ms']:>9.1f}{r['tokens_per_s']:>11.0f}{mfu:>7}{rel:>10}{sync:>12}{r['runner_s']:>7.1f}")
    if not torch.cuda.is_available():
        print("syncs/step: - on CPU, where nothing waits for a device (the docstring says why)")
    by = {(r["model"], r["compiled"], r["runner"]): r for r in rows if "error" not in r}
    for (model, compiled, plain), r in by.items():
        for kind, label in (("ac", "activation checkpointing"), ("sac", "selective checkpointing (matmuls kept)")):
            ac = by.get((model, compiled, f"{plain}+{kind}"))
            if ac is not None:
                print(
                    f"{label}, {model} {goals.mode(compiled)}, {plain}: step time x{ac['step_ms'] / r['step_ms']:.3f}"
                    + (
                        f" (recomputing the layers' forward adds x{figures[model]['ac_flops_ratio']:.2f} the FLOPs)"
                        if kind == "ac"
                        else ""
                    )
                )


#: the runners ``--profile`` profiles by default: the plain loop and the two strategies each of the pack's presets is
#: measured against
PROFILED = ("torch", "lightning_ddp", "mgpu_ddp", "lightning_fsdp", "mgpu_zero3")
#: the calls that make the host wait for the device, as the profiler names them
WAITS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _busy_us(kernels: list[tuple[float, float]]) -> float:
    """The time covered by the union of the device intervals ``(start, end)``, in microseconds."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(kernels):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def profile_summary(prof: torch.profiler.profile, n: int, wall_s: float) -> dict[str, Any]:
    """Per step of ``n`` profiled steps: wall time, how long the device was busy (the union of its kernels and copies),
    kernels launched, the calls that made the host wait, and each operator's host self time and device time."""
    events = prof.events()
    device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = _busy_us([(e.time_range.start, e.time_range.end) for e in device])
    host: dict[str, float] = {}
    dev: dict[str, float] = {}
    counts: dict[str, int] = {}
    for e in prof.key_averages():
        host[e.key] = e.self_cpu_time_total / n / 1e3
        counts[e.key] = e.count
    for e in device:
        dev[e.name] = dev.get(e.name, 0.0) + (e.time_range.end - e.time_range.start) / n / 1e3
    return {
        "wall_ms": wall_s / n * 1e3,
        "device_busy_ms": busy / n / 1e3,
        "kernels": len(device) / n,
        "waits": {w: counts.get(w, 0) / n for w in WAITS},
        "host_self_ms": host,
        "device_ms": dev,
    }


def print_profiles(profiles: dict[str, dict[str, Any]], top: int = 12) -> None:
    """The profiled runners side by side, then, for each, where its host and device time per step go beyond the plain
    torch loop's of the same model and mode (the operators with the largest differences). ``profiles``: by runner, or
    by ``"<model> <mode> <runner>"``."""
    print("\nprofile, per step (torch.profiler slows the host: read the figures as shares)")
    waits = " ".join(f"{w.split('::')[-1].replace('cuda', ''):>20}" for w in WAITS)
    print(f"{'runner':<32}{'wall ms':>9}{'device ms':>11}{'busy':>7}{'kernels':>9} {waits}")
    for name, p in profiles.items():
        busy = p["device_busy_ms"] / p["wall_ms"] if p["wall_ms"] else 0.0
        w = " ".join(f"{p['waits'][k]:>20.1f}" for k in WAITS)
        print(f"{name:<32}{p['wall_ms']:>9.1f}{p['device_busy_ms']:>11.1f}{busy:>7.1%}{p['kernels']:>9.0f} {w}")
    for name, p in profiles.items():
        ref_name = f"{name.rsplit(' ', 1)[0]} torch" if " " in name else "torch"
        ref = profiles.get(ref_name)
        if ref is None or name == ref_name:
            continue
        for what, key in (("host self ms", "host_self_ms"), ("device ms", "device_ms")):
            diff = {k: v - ref[key].get(k, 0.0) for k, v in p[key].items()}
            diff.update({k: -v for k, v in ref[key].items() if k not in p[key]})
            rows = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]
            print(f"\n{name} vs {ref_name}, {what} per step (+: {name} spends more), total {sum(diff.values()):+.2f}")
            for k, v in rows:
                print(f"  {v:>+9.3f}  {k[:110]}")


def profile_runners(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each of ``--profile-runners`` of each model and mode selected (``--models``, ``--modes``) run once more,
    ``--profile`` steps after the warm-up under ``torch.profiler``; keyed by the case's label."""
    out = {}
    models = args.models or [goals.DEFAULT_MODEL]
    for model, mode in itertools.product(models, args.modes or ["eager"]):
        compiled = mode == "compiled"
        available = runners(args.tiny, compiled, args.compile_backend)
        for name in args.profile_runners:
            if name not in available:
                print(f"profile: {model} {mode} {name} skipped (not a runner here: {sorted(available)})")
                continue
            run = argparse.Namespace(**{**vars(case_args(args, model)), "steps": args.profile})
            profiled = Profiled(args.warmup, args.profile)
            stamps = available[name](run, StepClock(profiled))
            assert profiled.prof is not None
            wall = stamps[-1] - stamps[args.warmup - 1]
            out[Case(model, compiled, name).label] = profile_summary(profiled.prof, args.profile, wall)
            del profiled
            _clean(compiled)
    return out


def _clean(compiled: bool) -> None:
    gc.collect()
    if compiled:
        torch._dynamo.reset()  # the next runner compiles its own graphs (inductor's on-disk caches stay)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _save(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)  # a run stopped while writing keeps the file before


def main() -> int:
    args = parse_arguments(__doc__.split("\n")[0], layers=24, warmup=5, steps=20, rounds=2, profile=True, models=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    env = environment()
    cases = select_cases(args)
    figures = {m: model_figures(args, m) for m in dict.fromkeys(c.model for c in cases)}
    peak = peak_flops(env["device"])
    path = args.out / result_name("throughput", env) if args.out and args.rounds > 0 else None
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"}
    times: dict[Case, list[float]] = {c: [] for c in cases}
    syncs: dict[Case, list[Optional[float]]] = {c: [] for c in cases}
    runner_s: dict[Case, list[float]] = {c: [] for c in cases}
    errors: dict[Case, str] = {}
    all_runners = {c: runners(args.tiny, c, args.compile_backend) for c in (False, True)}
    rows: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        for case in cases:
            if case in errors:
                continue
            a = case_args(args, case.model)
            clock = StepClock(window=(a.warmup, a.warmup + a.steps))
            start = time.perf_counter()
            try:
                stamps = all_runners[case.compiled][case.runner](a, clock)
            except Exception as err:  # the other cases still run; the script exits 1
                errors[case] = f"{type(err).__name__}: {err}"[:1000]
                print(f"{case.label}: failed: {errors[case][:300]}", flush=True)
            else:
                steps = [b - b0 for b0, b in zip(stamps[a.warmup - 1 :], stamps[a.warmup :])]
                times[case] += steps
                syncs[case].append(clock.syncs.count / len(steps) if clock.syncs.count is not None else None)
                runner_s[case].append(time.perf_counter() - start)
                print(
                    f"{case.label}: {statistics.median(steps) * 1e3:.1f} ms a step, {runner_s[case][-1]:.1f} s",
                    flush=True,
                )
            finally:
                clock.syncs.stop()
                _clean(case.compiled)
            rows = make_rows(cases, times, syncs, runner_s, errors, figures, peak)
            if path is not None:  # after every case: a run stopped at its time limit keeps the cases before
                _save(path, _result(env, config, figures, rows))
    if rows:
        print()
        print_table(rows, figures, env)
        print("goals:")
        on_cpu = None if torch.cuda.is_available() else "on CPU: a check of the script, not a measurement"
        print("\n".join(goals.lines(goals.evaluate(rows, not_judged=on_cpu))))
    sys.stdout.flush()  # the table first: the profile below takes a while
    profiles = profile_runners(args) if args.profile else {}
    if profiles:
        print_profiles(profiles)
    if args.out and (path is not None or profiles):
        result = _result(env, config, figures, rows)
        if profiles:  # the 40 largest operators of each, by host self time and by device time
            result["profiles"] = {
                k: {
                    **p,
                    "host_self_ms": dict(sorted(p["host_self_ms"].items(), key=lambda kv: -kv[1])[:40]),
                    "device_ms": dict(sorted(p["device_ms"].items(), key=lambda kv: -kv[1])[:40]),
                }
                for k, p in profiles.items()
            }
        # a profile alone (--rounds 0) is no throughput result: its own name, so the tables never read it as one
        path = path or args.out / result_name("profile", env)
        _save(path, result)
        print(f"saved {path}")
    return 1 if errors else 0


def _result(
    env: dict[str, Any], config: dict[str, Any], figures: dict[str, dict[str, Any]], rows: list[dict[str, Any]]
) -> dict[str, Any]:
    syncs = (
        "torch.cuda.set_sync_debug_mode('warn') warnings per timed step"
        if torch.cuda.is_available()
        else "not counted on CPU: nothing waits for a device"
    )
    return {
        "environment": env,
        "config": config,
        "clock": "events",
        "host_syncs": syncs,
        "models": figures,
        "rows": rows,
    }


if __name__ == "__main__":
    code = main()
    # Everything is printed and saved. Skip the interpreter's own teardown: many runners' CUDA and NCCL state (and
    # inductor's pool of compile workers) can keep the process alive past a timed run's budget although it measured
    # everything.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
