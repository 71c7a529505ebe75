"""``StageRunner``: the steps through the stages (the package's docstring, ``parts/pipeline/__init__.py``, says
what they compute): the schedule built once per micro-batch shape, a training step's forward and backward of every
micro-batch and its gradients handed to Lightning's closure (the loss scale of fp16 included), each stage's part of
the user's ``training_step``, the one reduce-scatter per optimizer step of the sharded stages, and an evaluation step
forward through the stages; with :class:`PipelineStats`, what one step of this rank sent and waited."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from lightning_mgpu import comm
from lightning_mgpu.ledger import CommStats
from lightning_mgpu.parts.pipeline.batches import (
    _leaves,
    _to_device,
    check_loader_batches,
    check_same_batch,
    combine_logs,
    split_batch,
)
from lightning_mgpu.parts.pipeline.blocks import HeldBlocks
from lightning_mgpu.parts.pipeline.hooks import StageHooks
from lightning_mgpu.parts.pipeline.plan import SHAPE_NEEDED, PipelineError
from lightning_mgpu.parts.pipeline.stages import _ChunkedStage, _PendingGradients, _Stage, _StageOutput
from lightning_mgpu.parts.token_loss import TokenNormalization


@dataclass(frozen=True)
class PipelineStats:
    """One pipeline step of this rank (``trainer.strategy.pipeline_stats()``): the bytes it sent to other stages
    (activations forward, their gradients backward, from their shapes), and the measured bubble (the fraction of the
    schedule's wall time this rank's stages did not compute) beside the formula, ``(P - 1) / (m + P - 1)`` for
    GPipe and 1F1B, divided by the stages per rank for interleaved 1F1B."""

    stages: int
    stages_per_rank: int
    microbatches: int
    bytes_sent: int
    bubble: float
    bubble_theory: float


def _module_device(module: Any) -> torch.device:
    return next(iter(module.parameters())).device


class StageRunner:
    """The steps through the stages of ``held``'s blocks, each stage's part run by ``hooks`` (see the module
    docstring). ``schedule``: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``; ``microbatches``: m;
    ``token_loss``: ``loss_normalization="tokens"`` (the micro-batches' loss sums added, their token counts
    returned)."""

    def __init__(
        self, held: HeldBlocks, hooks: StageHooks, schedule: str, microbatches: int, token_loss: bool = False
    ) -> None:
        self.held = held
        self.hooks = hooks
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.token_loss = token_loss
        self.ledger: Optional[CommStats] = None
        self._schedules: dict[Any, Any] = {}
        self._micro: list[Any] = []
        self._step_batch_index = 0
        self._losses: dict[int, Tensor] = {}
        self._tokens: dict[int, float] = {}  # token_loss: each micro-batch's num_tokens (the last stage's)
        self._scale = 1.0
        self._pending: list[tuple[nn.Parameter, Tensor]] = []
        self._loader_checked = False  # the training loader's batch sizes, once per fit
        self._batch_checked = False  # the first training batch the same on the pipeline's ranks, once per fit
        self._sends = (0, 0)  # (sends, bytes) of one step of this rank, from the boundary shapes
        self.busy_s = 0.0  # time in the stages' forward and backward computation during the last step
        self.last_stats: Optional[PipelineStats] = None
        self.stage_objects: dict[int, _ChunkedStage] = {}  # the latest PipelineStage of each local stage
        self.grad_scale: Optional[Tensor] = None  # what flowed into the step's loss (1 / k, x the loss scale)
        self._loss_scale = 1.0  # the fp16 loss scale the schedule's backward starts from (use_loss_scale)
        self._steps = 0  # training steps run (the same on the pipeline's ranks): each step's outputs say theirs

    def start_fit(self) -> None:
        """At set-up: the schedules built again for the new stages, the training loader checked again."""
        self._schedules.clear()
        self._loader_checked = self._batch_checked = False

    # --- one training step --------------------------------------------------------------------------------
    def check_training_loader(self, loader: Any, batches_run: float) -> None:
        """:func:`check_loader_batches` once per fit, at its first training batch (the loader Lightning prepared)."""
        if not self._loader_checked:
            self._loader_checked = True
            check_loader_batches(loader, self.microbatches, batches_run)

    def check_same_batch(self, batch: Any, method: str) -> None:
        """Every rank of the pipeline holds the same ``batch`` of ``method`` (a stage would otherwise compute its loss
        on another batch's activations): :func:`check_same_batch` over the pipeline's ranks."""
        check_same_batch(batch, method, self.held.pipeline_group, "one pipeline")

    def training_step(self, module: Any, accumulate: int, batch: Any, batch_idx: int = 0) -> Any:
        """Forward and backward of every micro-batch through the stages (the schedule's); returns the batch's loss
        (the mean of the micro-batches' losses, the same on every stage) as a tensor whose backward adds the
        schedule's gradients, for Lightning's closure. The gradients are in ``.grad``, scaled by ``1 / (m x
        accumulate)``. ``token_loss``: the loss is the sum of the micro-batches' sums, the gradients scaled by
        ``1 / accumulate``, and the step returns ``{"loss": ..., "num_tokens": <the batch's tokens>}``."""
        held, m = self.held, self.microbatches
        if not self._batch_checked:  # once per fit: a later batch comes from the same loaders and seeds
            self._batch_checked = True
            self.check_same_batch(batch, "training_step")
        micro = split_batch(batch, m)
        key = tuple((tuple(t.shape), t.dtype) for t in _leaves(micro[0]))
        self._micro, self._step_batch_index = micro, batch_idx
        self.hooks.logged, self._losses, self._tokens = {}, {}, {}
        self._scale = 1.0 if self.token_loss else 1.0 / m  # token sums add up; means are averaged
        schedule = self._schedule_for(module, key)  # a new shape: its probe runs the whole model
        held.free_blocks()  # this rank's stages only, from the first step and after each gather
        held.stale = True
        device = _module_device(module)
        first = 0 in held.local
        last = held.stages - 1 in held.local
        args = (torch.arange(m, device=device),) if first else ()
        target = torch.arange(m, device=device) if last else None
        # Lightning zeroes the gradients between the training step and its backward: the schedule's gradients
        # wait aside and are added by the backward of the loss returned (scaled by what flows into it: 1 / k)
        params = self._step_params(module)
        held_grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            with self.hooks.logs_captured(module):
                self.busy_s, start = 0.0, time.perf_counter()
                schedule.step(*args, target=target, return_outputs=False)
                elapsed = time.perf_counter() - start
            self._pending = [(p, p.grad) for p in params if p.grad is not None]
        finally:
            for p, g in zip(params, held_grads):
                p.grad = g
        if self.ledger is not None:
            self.ledger.record_stage_sends(*self._sends)
        theory = (held.size - 1) / (m + held.size - 1)
        if self.schedule_name == "interleaved_1f1b":
            theory /= len(held.local)
        measured = max(0.0, 1.0 - self.busy_s / elapsed) if elapsed > 0 else 0.0
        self.last_stats = PipelineStats(held.stages, len(held.local), m, self._sends[1], measured, theory)
        loss, tokens, logs = self._last_stage_outputs(last, device)
        for (name, kwargs), value in zip(logs, loss[1:]):
            module.log(name, value, **kwargs)
        pending = _PendingGradients.apply(loss[0].detach().requires_grad_(True), self)
        return {"loss": pending, "num_tokens": tokens} if self.token_loss else pending

    def _last_stage_outputs(
        self, last: bool, device: torch.device
    ) -> tuple[list[Tensor], float, list[tuple[str, dict[str, Any]]]]:
        """The step's loss and logged values, on every rank of the pipeline, from the last stage, with no host
        waiting for its device: the names, the log calls' arguments, the shapes and the token count (what the last
        stage's host knows) go from host to host through the store; the values, one device broadcast per dtype.
        Returns ``[loss, *values]``, the token count and each value's ``(name, kwargs)``."""
        held, m = self.held, self.microbatches
        src = held.owner(held.stages - 1)
        self._steps += 1
        values: Optional[list[Tensor]] = None
        meta: Any = None
        if last:
            losses = torch.stack([self._losses[i] for i in range(m)])
            tokens = sum(self._tokens[i] for i in range(m)) if self.token_loss else 0.0
            logs = combine_logs([self.hooks.logged.get(i, []) for i in range(m)], device)
            values = [losses.sum() if self.token_loss else losses.mean(), *(value for _, value, _ in logs)]
            names = [(name, kwargs) for name, _, kwargs in logs]
            meta = (self._steps, tokens, names, [(v.shape, v.dtype) for v in values])
        meta = comm.host_broadcast_object(meta, src=src, group=held.pipeline_group, channel="pipeline")
        step, tokens, names, layout = meta
        if step != self._steps:  # pragma: no cover - a store that kept an earlier fit's step
            raise RuntimeError(
                f"Pipeline step {self._steps} of this rank received the last stage's outputs of its step {step} "
                f"through the store: the store holds an earlier run's. Start the job with a fresh store."
            )
        return comm.broadcast_tensors(values, layout, src, held.pipeline_group, device), tokens, names

    def _step_params(self, module: nn.Module) -> list[nn.Parameter]:
        """The parameters whose gradients a training step holds aside while the schedule runs (see
        :meth:`training_step`): all that train, but the sharded stages' (FSDP2 accumulates those itself, unsharded,
        until :meth:`reduce_scatter_stages`)."""
        held = self.held
        sharded = {id(p) for s in held.sharded_stages for b in held.stage_blocks(s) for p in b.parameters()}
        return [p for p in module.parameters() if p.requires_grad and id(p) not in sharded]

    def run_stage(self, stage: int, chunk: int, received: Tensor) -> Tensor:
        """The user's ``training_step`` on micro-batch ``chunk``, run as stage ``stage``: see the package's
        docstring."""
        module: Any = self.held.module
        assert module is not None and self.held.plan is not None
        self.hooks.chunk, self.hooks.logs_wanted = chunk, stage == self.held.stages - 1
        try:
            with self.hooks.stage_hooks(stage, received, []):
                out = module.training_step(self._micro[chunk], self._step_batch_index)
        except _StageOutput as stage_output:
            return stage_output.output.contiguous()
        loss = out["loss"] if isinstance(out, dict) else out
        if not isinstance(loss, Tensor):
            raise PipelineError(
                "training_step returned no loss tensor on the last pipeline stage; return the loss (or a dict with "
                "'loss')."
            )
        self._losses[chunk] = loss.detach()
        if self.token_loss:
            self._tokens[chunk] = TokenNormalization.tokens_of(out)
        return loss

    def add_pending(self, scale: Tensor) -> None:
        """The backward of the loss :meth:`training_step` returned: the schedule's gradients, times ``scale`` (what
        flows into that loss: ``1 / accumulate_grad_batches``, times the loss scale under fp16), added to
        ``.grad``."""
        pending, self._pending = self._pending, []
        # the schedule's backward started from the loss times the loss scale already (use_loss_scale): what is left
        # to apply is 1 / accumulate_grad_batches
        scale = scale.detach() / self._loss_scale
        self.grad_scale = scale  # the sharded stages' gradients take it after their reduce-scatter
        with torch.no_grad():
            for p, g in pending:
                g = g * scale.to(g.dtype)
                p.grad = g if p.grad is None else p.grad + g

    def reduce_scatter_stages(self) -> None:
        """Once per optimizer step: each sharded stage's gradients, accumulated over the step's micro-batches and
        ``accumulate_grad_batches`` micro-steps, reduce-scattered (averaged) over the data dimension, then scaled by
        what flowed into the step's loss (``1 / accumulate_grad_batches``, times the loss scale under fp16)."""
        for s in sorted(self.held.sharded_stages):
            self.stage_objects[s].reduce_now()
        scale = self.grad_scale
        if scale is None:
            return
        with torch.no_grad():
            for p in self.held.sharded_params:
                if p.grad is not None:
                    local = comm.local_shard(p.grad)
                    local.mul_(scale.to(local.dtype))

    def use_loss_scale(self, scale: float) -> None:
        """Before each training step, under a loss scaler (fp16): the scale the backward of the step's loss will be
        multiplied by. The schedule's backward starts from the last stage's loss times ``scale``, as one process's
        backward of the scaled loss does: every stage's half-precision backward then runs on scaled gradients (small
        ones do not underflow; one that overflows turns to inf there and the scaler's agreed check skips the step on
        every rank), and :meth:`add_pending` applies only the rest of what flows into the loss returned."""
        self._loss_scale = float(scale)

    def _loss(self, output: Tensor, target: Tensor) -> Tensor:
        # a half loss times the loss scale in float32, as torch's GradScaler.scale does (in half it overflows at
        # 65504 where one process does not)
        if self._loss_scale != 1.0 and output.dtype in (torch.float16, torch.bfloat16):
            output = output.float()
        return output * (self._scale * self._loss_scale)

    # --- the stages, built once per micro-batch shape -------------------------------------------------------
    def _schedule_for(self, module: Any, key: Any) -> Any:
        if key in self._schedules:
            return self._schedules[key]
        held = self.held
        boundaries, loss_meta = self.hooks.probe(module, self._micro[0], self._step_batch_index)
        device = _module_device(module)
        stages: list[Any] = []
        for s in held.local:
            if s == 0:
                inputs: Tensor = torch.zeros(1, dtype=torch.long, device=device)
            else:
                shape, dtype = boundaries[s - 1]
                inputs = torch.empty(shape, dtype=dtype, device=device).requires_grad_(dtype.is_floating_point)
            if s == held.stages - 1:
                outputs = torch.empty(loss_meta[0], dtype=loss_meta[1], device=device).requires_grad_(True)
            else:
                shape, dtype = boundaries[s]
                outputs = torch.empty(shape, dtype=dtype, device=device).requires_grad_(dtype.is_floating_point)
            runner = held.sharded_stages[s] if s in held.sharded_stages else _Stage(self, s, held.stage_blocks(s))
            stage = _ChunkedStage(
                runner, s, held.stages, device, input_args=inputs, output_args=outputs, group=held.pipeline_group
            )
            stages.append(stage)
            self.stage_objects[s] = stage
        m = self.microbatches
        schedule: Any
        if self.schedule_name == "interleaved_1f1b":
            schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=self._loss, scale_grads=False)
        elif self.schedule_name == "gpipe":
            schedule = ScheduleGPipe(stages[0], m, loss_fn=self._loss, scale_grads=False)
        else:
            schedule = Schedule1F1B(stages[0], m, loss_fn=self._loss, scale_grads=False)
        sends, sent = 0, 0
        for s in held.local:  # an activation forward from each stage but the last, its gradient back from the next
            for boundary in ([boundaries[s]] if s != held.stages - 1 else []) + ([boundaries[s - 1]] if s else []):
                shape, dtype = boundary
                sends += m
                sent += m * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        self._sends = (sends, sent)
        self._schedules[key] = schedule
        return schedule

    # --- one evaluation step ------------------------------------------------------------------------------
    def evaluation_step(self, module: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        """The user's ``validation_step``, ``test_step`` or ``predict_step`` (``method``) through the stages,
        forward only: each stage runs it with the blocks of its own stages (the hooks of :meth:`run_stage`) on the
        whole batch, the activation at each stage boundary broadcast from the stage's rank to the pipeline's ranks;
        the last stage runs it to its end. Its ``self.log`` calls and its return value are then the same on every
        rank of the pipeline (logged there again, returned): Lightning's reduction over all ranks gives the value
        of one process. A collective of the pipeline's ranks, which hold the same batch (the evaluation loaders
        are sharded over the data replicas); a batch that differs between them raises :class:`PipelineError`."""
        held = self.held
        assert held.plan is not None and held.module is not None
        held.unshard_stages()  # stage=3: this rank's stages whole until the next training step
        device = _module_device(module)
        self.check_same_batch(args[0] if args else None, method)
        received: Optional[Tensor] = None
        last = held.stages - 1
        payload: Any = None
        failure: Optional[BaseException] = None  # this rank's, re-raised after the stage's collective
        for s in range(held.stages):
            owner = held.owner(s)
            sent: Any = None
            if s in held.local:
                try:
                    sent, out = self._evaluation_stage(module, method, s, received, args, kwargs)
                    if s == last:
                        payload = (_to_device(out, torch.device("cpu")), self.hooks.portable_logs(module))
                except Exception as error:  # the other ranks wait in the next collective: they raise too
                    failure = error
                    payload = f"{type(error).__name__}: {error}"
            if s == last:
                break
            meta: Any = (tuple(sent.shape), sent.dtype) if sent is not None else payload
            meta = comm.broadcast_object(meta if failure is None else payload, src=owner, group=held.pipeline_group)
            if isinstance(meta, str):
                raise failure if failure is not None else PipelineError(f"Pipeline stage {s} failed: {meta}")
            buffer = sent if sent is not None else torch.empty(meta[0], dtype=meta[1], device=device)
            comm.broadcast(buffer, src=owner, group=held.pipeline_group)  # not a training step's bytes
            received = buffer
        self.hooks.logged, self.hooks.logs_wanted = {}, False
        payload = comm.broadcast_object(payload, src=held.owner(last), group=held.pipeline_group)
        if isinstance(payload, str):
            raise failure if failure is not None else PipelineError(f"Pipeline stage {last} failed: {payload}")
        out, logs = payload
        named = dict(module.named_modules())
        for name, value, given in logs:
            module.log(name, named[value[1]] if isinstance(value, tuple) else value.to(device), **given)
        return _to_device(out, device)

    def _evaluation_stage(
        self, module: Any, method: str, stage: int, received: Optional[Tensor], args: Any, kwargs: Any
    ) -> tuple[Optional[Tensor], Any]:
        """The user's step run as ``stage`` (no gradients, its logs captured on the last stage): the activation it
        sends on (None on the last stage) and what the step returned (the last stage's)."""
        hooks = self.hooks
        assert self.held.plan is not None
        taken: list[int] = []
        last = stage == self.held.stages - 1
        hooks.chunk, hooks.logs_wanted, hooks.logged = 0, last, {}
        sent: Optional[Tensor] = None
        out: Any = None
        try:
            with torch.no_grad(), hooks.logs_captured(module), hooks.stage_hooks(stage, received, taken):
                out = getattr(module, method)(*args, **kwargs)
        except _StageOutput as stage_output:
            sent = stage_output.output.contiguous()
        if (stage != 0 and len(taken) != 1) or (not last and sent is None):
            raise PipelineError(
                f"The {method} of {type(module).__name__} does not call the blocks of {self.held.plan.container!r} "
                f"each once in order (the first block of pipeline stage {stage} ran {len(taken)} time(s)). Under "
                f"pipeline parallelism it needs {SHAPE_NEEDED}, as training_step does."
            )
        return sent, out
