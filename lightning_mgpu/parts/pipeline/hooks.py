"""``StageHooks``: the user's step run as one pipeline stage, unchanged (the package's docstring,
``parts/pipeline/__init__.py``, says how): the blocks before the stage skipped (a passthrough in place of their
``forward``, a compiled or checkpointed one put back after), the stage's first block fed the activation received,
:class:`~lightning_mgpu.parts.pipeline.stages._StageOutput` raised after its last block; its ``self.log`` calls
captured per micro-batch; and the probe, one forward of the whole step that checks the model has the shape the
pipeline needs and measures the activations at the stage boundaries."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Generator
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_mgpu.parts.pipeline.batches import _first_tensor
from lightning_mgpu.parts.pipeline.blocks import HeldBlocks
from lightning_mgpu.parts.pipeline.plan import SHAPE_NEEDED, PipelineError
from lightning_mgpu.parts.pipeline.stages import _StageOutput
from lightning_mgpu.parts.token_loss import TokenNormalization


def _restore_forward(block: nn.Module, previous: Any) -> None:
    """Put back the ``forward`` a skipped block had before its passthrough: its class's, or the instance
    ``forward`` that compilation or activation checkpointing put there (kept across steps, so that the block
    runs compiled in a later whole-model evaluation and after fit)."""
    if previous is None:
        del block.forward
    else:
        block.__dict__["forward"] = previous


class StageHooks:
    """The hooks that run the user's step as one stage of ``held``'s blocks (see the module docstring);
    ``token_loss``: ``loss_normalization="tokens"`` (the probe checks the step returns ``num_tokens``)."""

    def __init__(self, held: HeldBlocks, token_loss: bool = False) -> None:
        self.held = held
        self.token_loss = token_loss
        self.logged: dict[int, list[tuple[str, Any, dict[str, Any]]]] = {}  # the captured logs, per micro-batch
        self.chunk = 0  # the micro-batch whose logs are captured
        self.logs_wanted = False  # the last stage's calls: the loss exists there only
        self.tuple_outputs: dict[int, int] = {}  # the blocks that return a tuple: its length after the first

    @contextlib.contextmanager
    def logs_captured(self, module: Any) -> Generator[None, None, None]:
        signature = inspect.signature(type(module).log)
        hooks = self

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(module, name, value, *args, **kwargs).arguments
            given = {k: v for k, v in bound.items() if k not in ("self", "name", "value")}
            given.update(given.pop("kwargs", {}))
            if hooks.logs_wanted:  # the last stage's calls: the loss exists there only
                hooks.logged.setdefault(hooks.chunk, []).append((name, value, given))

        module.log = log
        try:
            yield
        finally:
            del module.log

    @contextlib.contextmanager
    def stage_hooks(self, stage: int, received: Optional[Tensor], taken: list[int]) -> Generator[None, None, None]:
        """The forward of the user's step as stage ``stage``: the blocks before the stage's skipped, its first block
        fed ``received`` (each time: counted in ``taken``), :class:`_StageOutput` raised after its last block
        (unless it is the last stage)."""
        assert self.held.plan is not None
        blocks = self.held.blocks
        start, end = self.held.plan.bounds[stage]
        handles: list[Any] = []
        skipped: list[tuple[nn.Module, Any]] = []  # each with its instance forward (compiled, checkpointed) or None
        for j in range(start):
            block = blocks[j]
            skipped.append((block, block.__dict__.get("forward")))
            block.forward = self._passthrough(j)
        if stage != 0:

            def take(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                taken.append(1)
                return (received, *args[1:]), kwargs

            handles.append(blocks[start].register_forward_pre_hook(take, with_kwargs=True))
        if stage != self.held.stages - 1:

            def stop(block: nn.Module, args: Any, output: Any) -> None:
                tensor = _first_tensor(output)
                if tensor is None:
                    raise PipelineError(
                        f"The last block of pipeline stage {stage} returned {type(output).__name__}, not a tensor (or "
                        f"a tuple starting with one). The pipeline needs {SHAPE_NEEDED}."
                    )
                raise _StageOutput(tensor)

            handles.append(blocks[end - 1].register_forward_hook(stop))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            for block, previous in skipped:
                _restore_forward(block, previous)

    def _passthrough(self, index: int) -> Callable[..., Any]:
        extra = self.tuple_outputs.get(index, 0)

        def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
            return (x, *([None] * extra)) if extra else x

        return forward

    def portable_logs(self, module: Any) -> list[tuple[str, Any, dict[str, Any]]]:
        """The last stage's captured ``self.log`` calls, with tensors on the CPU and a metric (a submodule, such as
        a torchmetrics ``Metric``) by its name in the module: the other ranks log their own copy of it, whose
        states (never updated there) add nothing when it is synced over the ranks."""
        names = {id(m): n for n, m in module.named_modules()}
        out: list[tuple[str, Any, dict[str, Any]]] = []
        for name, value, given in self.logged.get(0, []):
            if isinstance(value, nn.Module) and id(value) in names:
                out.append((name, ("module", names[id(value)]), given))
            elif isinstance(value, (Tensor, int, float)):
                out.append((name, torch.as_tensor(value).detach().cpu(), given))
            else:
                raise PipelineError(
                    f"self.log({name!r}, {type(value).__name__}) in an evaluation step under pipeline parallelism: "
                    f"log a number, a tensor, or a metric that is an attribute of the LightningModule."
                )
        return out

    def probe(
        self, module: Any, batch: Any, batch_idx: int
    ) -> tuple[list[tuple[torch.Size, torch.dtype]], tuple[torch.Size, torch.dtype]]:
        """One forward of the whole ``training_step`` on ``batch`` (micro-batch 0; no gradients, evaluation mode,
        the random state restored, logs dropped): the blocks' order, the activation at each stage boundary and the
        loss's shape. Raises :class:`PipelineError` where the model does not have the shape the pipeline needs."""
        held = self.held
        assert held.plan is not None
        calls: list[int] = []
        inputs: dict[int, Any] = {}
        outputs: dict[int, Any] = {}
        handles = []
        for j, block in enumerate(held.blocks):

            def pre(b: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], j: int = j) -> None:
                calls.append(j)
                inputs[j] = args[0] if args else None

            def post(b: nn.Module, args: Any, output: Any, j: int = j) -> None:
                outputs[j] = output

            handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(block.register_forward_hook(post))
        refree = bool(held.freed)  # a new shape after the first step: the whole model for one forward
        held.gather_blocks()
        training = module.training
        module.eval()
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad(), self.logs_captured(module):
                out = module.training_step(batch, batch_idx)
        finally:
            module.train(training)
            for h in handles:
                h.remove()
            if refree:
                held.free_blocks()
        self.logged = {}
        names = held.plan.names
        if calls != list(range(len(held.blocks))):
            order = [names[j] for j in calls]
            raise PipelineError(
                f"The training_step of {type(module).__name__} calls the blocks of {held.plan.container!r} in the "
                f"order {order}, not each once in order. The pipeline needs {SHAPE_NEEDED}."
            )
        boundaries = []
        for s in range(held.stages - 1):
            end = held.plan.bounds[s][1]
            sent, taken = _first_tensor(outputs[end - 1]), inputs[end]
            if type(sent).__name__ == "DTensor":
                raise PipelineError(
                    f"The output of {names[end - 1]!r} at a pipeline stage boundary is a DTensor (the tensor-parallel "
                    f"plan leaves it distributed): stages send plain tensors. Use tensor_parallel_plan='auto', or "
                    f"a plan whose last layer of each block hands out a plain tensor (use_local_output=True, the "
                    f"styles' default)."
                )
            if (
                sent is None
                or not isinstance(taken, Tensor)
                or sent.shape != taken.shape
                or not torch.equal(sent, taken)
            ):
                raise PipelineError(
                    f"At the stage boundary before {names[end]!r}, the forward does not hand the output of "
                    f"{names[end - 1]!r} (its first tensor) to {names[end]!r} as its first argument unchanged. The "
                    f"pipeline needs {SHAPE_NEEDED}. Choose other split points (pipeline_split) where it does."
                )
            boundaries.append((sent.shape, sent.dtype))
        for j, output in outputs.items():
            if isinstance(output, (tuple, list)):
                self.tuple_outputs[j] = len(output) - 1
        loss = out["loss"] if isinstance(out, dict) else out
        if not isinstance(loss, Tensor):
            raise PipelineError(
                f"training_step of {type(module).__name__} returned {type(out).__name__}; under pipeline parallelism "
                f"it must return the loss tensor (or a dict with 'loss')."
            )
        if self.token_loss:  # on every rank, before any stage runs: refused together, not in the last stage only
            TokenNormalization.tokens_of(out)
        return boundaries, (loss.shape, loss.dtype)
