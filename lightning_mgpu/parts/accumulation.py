"""Gradient accumulation for manual optimization (GANs, several optimizers).

Lightning 2.6 refuses ``Trainer(accumulate_grad_batches=k)`` when ``automatic_optimization = False``. Add the
:class:`ManualAccumulation` mixin to the module and the flag works: write ``training_step`` as if there were
no accumulation and the mixin

* divides the loss given to ``self.manual_backward`` by k (as Lightning's automatic optimization does),
* turns ``opt.step()`` into "accumulate" on micro-batches that do not end a window and steps at the window's
  end (including the last, shorter window of an epoch, exactly where automatic optimization steps),
* makes ``opt.zero_grad()`` clear gradients only when nothing is pending for that optimizer (so zero_grad
  before backward and zero_grad after step both work), with ``set_to_none=True``,
* steps the LR schedulers from ``self.lr_schedulers()`` once per window, not per micro-batch,
* blocks the gradient all-reduce on the micro-batches that only accumulate.

The synchronisation itself belongs to the strategy. ``mgpu_ddp`` averages each optimizer's gradients once,
when that optimizer steps (see ``MGPUDDPStrategy``), so toggling the other optimizer's parameters off
needs no ``find_unused_parameters=True``. On one device (no strategy, or ``devices=1``) nothing is synced
and the same module accumulates the same way.

Example::

    import lightning_mgpu
    from lightning_mgpu import ManualAccumulation

    class GAN(ManualAccumulation, pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            ...

        def training_step(self, batch, batch_idx):
            g_opt, d_opt = self.optimizers()
            fake = self.generator(noise)
            with d_opt.toggle_model():
                self.manual_backward(d_loss(real, fake.detach()))
            with g_opt.toggle_model():
                self.manual_backward(g_loss(fake))
            d_opt.step(); d_opt.zero_grad()
            g_opt.step(); g_opt.zero_grad()

    Trainer(strategy="mgpu_ddp", devices=2, accumulate_grad_batches=4).fit(GAN(), datamodule)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Generator, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.core.optimizer import LightningOptimizer
from pytorch_lightning.strategies import DDPStrategy, ParallelStrategy
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_mgpu._compat import (
    attached_trainer,
    share_optimizer_strategy,
    should_accumulate,
    strategy_ddp_kwargs,
    unwrap_optimizer,
)
from lightning_mgpu.comm_hooks import allreduce_gradients
from lightning_mgpu.ledger import CommStats

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle


def check_accumulate_grad_batches(value: Any) -> int:
    """``accumulate_grad_batches`` must be an int >= 1 (Lightning 2.6 does not check: 0 divides by zero
    deep in the loop)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MisconfigurationException(
            f"Trainer(accumulate_grad_batches={value!r}) is invalid: it must be an int >= 1 (1 = no "
            f"accumulation). For a global batch of G samples on N devices with batch b per device, use "
            f"accumulate_grad_batches = G // (N * b)."
        )
    return value


def check_manual_accumulation(trainer: pl.Trainer, model: pl.LightningModule) -> None:
    """Refuse the combinations that would train wrongly; each message names the fix. Called before any
    process starts (mgpu launchers) and again at fit start (the mixin, for every strategy)."""
    k = check_accumulate_grad_batches(trainer.accumulate_grad_batches)
    uses_mixin = isinstance(model, ManualAccumulation)
    name = type(model).__name__
    if uses_mixin and model.automatic_optimization:
        raise MisconfigurationException(
            f"{name} inherits lightning_mgpu.ManualAccumulation but uses automatic optimization: the mixin is for "
            f"`self.automatic_optimization = False` only (Lightning already accumulates automatic optimization). "
            f"Remove ManualAccumulation from {name}'s bases, or set `self.automatic_optimization = False` in "
            f"its __init__ and step the optimizers yourself."
        )
    if not model.automatic_optimization and k > 1 and not uses_mixin:
        raise MisconfigurationException(
            f"Trainer(accumulate_grad_batches={k}) with manual optimization needs the accumulation mixin: "
            f"declare `class {name}(lightning_mgpu.ManualAccumulation, LightningModule)` (it scales the loss by "
            f"1/{k}, steps once per {k} micro-batches and syncs gradients only then), or remove "
            f"accumulate_grad_batches and accumulate by hand."
        )


class _AccumulatingOptimizer(LightningOptimizer):
    """What ``self.optimizers()`` returns under :class:`ManualAccumulation`: Lightning's optimizer wrapper
    whose ``step``, ``zero_grad`` and ``toggle_model`` know where the accumulation window ends. Still an
    instance of the user's optimizer class (Lightning's dynamic-subclass trick)."""

    def __init__(self, inner: LightningOptimizer, module: ManualAccumulation, index: int) -> None:
        super().__init__(inner.optimizer)
        share_optimizer_strategy(inner, self)  # Lightning's step machinery of this wrapper needs the strategy
        self._inner = inner
        self._owner = module
        self._index = index
        self.absorbed_steps = 0
        """``step()`` calls taken as "accumulate" since this optimizer last stepped."""

    @contextlib.contextmanager
    def toggle_model(self, sync_grad: Optional[bool] = None) -> Generator[None, None, None]:
        """Lightning's ``toggle_model``; ``sync_grad`` defaults to "only on the micro-batch that steps"."""
        if sync_grad is None:
            sync_grad = not self._owner.is_accumulating
        _refuse_toggling_under_plain_ddp(attached_trainer(self._owner).strategy)
        with self._inner.toggle_model(sync_grad=sync_grad):
            yield

    @override
    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        if self._owner.is_accumulating:
            self.absorbed_steps += 1
            return closure() if closure is not None else None
        self.absorbed_steps = 0
        return self._inner.step(closure, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears gradients only if no accumulated micro-batch of this optimizer is waiting for its step."""
        if self.absorbed_steps == 0:
            self._inner.optimizer.zero_grad(set_to_none=set_to_none)


class _WindowScheduler:
    """An LR scheduler whose ``step()`` only acts on the micro-batch that ends an accumulation window (and
    outside ``training_step``, e.g. in ``on_train_epoch_end``). Everything else is the wrapped scheduler's."""

    def __init__(self, scheduler: Any, module: ManualAccumulation) -> None:
        self.scheduler = scheduler
        self._owner = module

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self._owner.is_accumulating:
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, item: str) -> Any:
        return getattr(self.scheduler, item)


def _refuse_toggling_under_plain_ddp(strategy: Any) -> None:
    # Lightning's DDPStrategy cannot sync a backward pass in which the other optimizer's parameters were
    # toggled off: the reducer waits for their gradients ("Expected to have finished reduction ...").
    # mgpu_ddp syncs each optimizer at its step (it says so by a class attribute: no import of the strategy).
    if isinstance(strategy, DDPStrategy) and not getattr(strategy, "syncs_manual_optimization", False):
        if not strategy_ddp_kwargs(strategy).get("find_unused_parameters", False):
            raise MisconfigurationException(
                "toggle_model() under Lightning's DDPStrategy without find_unused_parameters=True fails at the "
                "first synchronised backward (the other optimizer's parameters get no gradient). Use "
                "Trainer(strategy='mgpu_ddp'): it syncs each optimizer's gradients at its step and needs no "
                "find_unused_parameters."
            )


class ManualAccumulation:
    """Mixin for a :class:`~pytorch_lightning.LightningModule` with manual optimization that makes
    ``Trainer(accumulate_grad_batches=k)`` work; put it before ``LightningModule`` in the bases. See the
    module docstring for what changes; :attr:`is_accumulating` tells ``training_step`` where it is.

    Write ``training_step`` without any accumulation logic. For results identical to a k-times larger batch,
    run every ``manual_backward`` of a micro-batch before its optimizer steps (compute the discriminator's
    and the generator's gradients, then step both): an optimizer that steps before another model's
    backward changes what that backward sees on the last micro-batch only.

    Example (one process here; ``strategy="mgpu_ddp", devices=N`` accumulates the same way):

        >>> import pytorch_lightning as pl, torch
        >>> from torch import nn
        >>> from lightning_mgpu import ManualAccumulation
        >>> class Regression(ManualAccumulation, pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.automatic_optimization = False
        ...         self.net = nn.Linear(4, 1)
        ...     def training_step(self, batch, batch_idx):
        ...         opt = self.optimizers()
        ...         x, y = batch
        ...         self.manual_backward(nn.functional.mse_loss(self.net(x), y))
        ...         opt.step()  # accumulates on the first micro-batch of each window, steps on the last
        ...         opt.zero_grad()
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
        >>> data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
        >>> trainer = pl.Trainer(accelerator="cpu", max_epochs=1, accumulate_grad_batches=2, logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(Regression(), torch.utils.data.DataLoader(data, batch_size=4))
        >>> trainer.global_step  # 8 micro-batches, 4 optimizer steps
        4
    """

    _mgpu_wrapped: dict[int, Any]

    @property
    def is_accumulating(self) -> bool:
        """True inside a training micro-batch that does not end an accumulation window: ``step``,
        ``zero_grad`` and scheduler steps wait, and gradients are not synchronised."""
        trainer = attached_trainer(self)
        if trainer is None or not trainer.training or trainer.accumulate_grad_batches == 1:
            return False
        return should_accumulate(trainer)

    def _mgpu_wrap(self, obj: Any, make: Callable[[], Any]) -> Any:
        cache = self.__dict__.setdefault("_mgpu_wrapped", {})
        entry = cache.get(id(obj))
        if entry is None or entry[0] is not obj:
            entry = cache[id(obj)] = (obj, make())
        return entry[1]

    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        opts = super().optimizers(use_pl_optimizer)  # type: ignore[misc]
        if not use_pl_optimizer:
            return opts
        seq = opts if isinstance(opts, list) else [opts]
        wrapped = [
            self._mgpu_wrap(o, functools.partial(_AccumulatingOptimizer, o, self, i))
            if isinstance(o, LightningOptimizer)
            else o
            for i, o in enumerate(seq)
        ]
        return wrapped if isinstance(opts, list) else wrapped[0]

    def lr_schedulers(self) -> Any:
        schedulers = super().lr_schedulers()  # type: ignore[misc]
        if schedulers is None:
            return None
        seq = schedulers if isinstance(schedulers, list) else [schedulers]
        wrapped = [self._mgpu_wrap(s, functools.partial(_WindowScheduler, s, self)) for s in seq]
        return wrapped if isinstance(schedulers, list) else wrapped[0]

    def manual_backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        trainer = attached_trainer(self)
        k = trainer.accumulate_grad_batches if trainer is not None and trainer.training else 1
        if k > 1:
            # Lightning's automatic optimization divides by k on every micro-batch, the last shorter window
            # of an epoch included; so do we, so that both modes give the same weights.
            loss = loss / k
        strategy = trainer.strategy if trainer is not None else None
        if self.is_accumulating and isinstance(strategy, ParallelStrategy):
            with strategy.block_backward_sync():
                super().manual_backward(loss, *args, **kwargs)  # type: ignore[misc]
        else:
            super().manual_backward(loss, *args, **kwargs)  # type: ignore[misc]

    def configure_callbacks(self) -> Union[Sequence[Callback], Callback]:
        callbacks = super().configure_callbacks()  # type: ignore[misc]
        trainer = attached_trainer(self)
        if trainer is None:
            return callbacks
        callbacks = list(callbacks) if isinstance(callbacks, Sequence) else [callbacks]
        check_manual_accumulation(trainer, self)  # type: ignore[arg-type]
        # Lightning's configuration validator refuses accumulate_grad_batches for manual optimization; it
        # runs right after this hook. Hide the value from it; the guard's setup() (the next thing Lightning
        # runs) puts it back, so the loop's window bookkeeping and estimated_stepping_batches use it.
        existing = [c for c in trainer.callbacks if isinstance(c, _AccumulationGuard)]
        if existing:  # a second fit/test on the same Trainer: reuse it (a new one would replace it, with a warning)
            existing[0].accumulate_grad_batches = trainer.accumulate_grad_batches
        else:
            callbacks.append(_AccumulationGuard(trainer.accumulate_grad_batches))
        trainer.accumulate_grad_batches = 1
        return callbacks


class _AccumulationGuard(Callback):
    """Restores ``accumulate_grad_batches`` after Lightning's validator, and refuses optimizer steps that
    bypass the window: a raw ``torch.optim`` step on an accumulating micro-batch, or an optimizer that
    accumulated during the window but was not stepped on its last micro-batch."""

    def __init__(self, accumulate_grad_batches: int) -> None:
        self.accumulate_grad_batches = accumulate_grad_batches
        self._hook_handles: list[RemovableHandle] = []

    def _restore(self, trainer: pl.Trainer) -> None:
        trainer.accumulate_grad_batches = self.accumulate_grad_batches

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore(trainer)
        self._remove_hooks()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert isinstance(pl_module, ManualAccumulation)
        module = pl_module

        def refuse_raw_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            if module.is_accumulating:
                raise MisconfigurationException(
                    f"{type(optimizer).__name__}.step() was called directly on micro-batch "
                    f"{trainer.fit_loop.epoch_loop.batch_idx}, which only accumulates "
                    f"(accumulate_grad_batches={trainer.accumulate_grad_batches}). Step through "
                    f"`self.optimizers()` (not `self.optimizers(use_pl_optimizer=False)` or a stored "
                    f"torch optimizer): it waits for the end of the window and syncs gradients there."
                )

        self._hook_handles = [opt.register_step_pre_hook(refuse_raw_step) for opt in trainer.optimizers]

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not isinstance(pl_module, ManualAccumulation) or pl_module.is_accumulating:
            return
        for obj, wrapped in getattr(pl_module, "_mgpu_wrapped", {}).values():
            if isinstance(wrapped, _AccumulatingOptimizer) and wrapped.absorbed_steps:
                raise MisconfigurationException(
                    f"Optimizer {wrapped._index} ({type(obj.optimizer).__name__}) accumulated "
                    f"{wrapped.absorbed_steps} micro-batch(es) but was not stepped on micro-batch "
                    f"{trainer.fit_loop.epoch_loop.batch_idx}, the last of its window "
                    f"(accumulate_grad_batches={trainer.accumulate_grad_batches}). With ManualAccumulation, "
                    f"call opt.step() on every micro-batch and let the mixin decide when it steps; remove your "
                    f"own `if (batch_idx + 1) % k == 0` condition (or drop accumulate_grad_batches and keep it)."
                )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []


# ----------------------------------------------------------------------------------------------------
# Gradient-sync control for accumulation: a context manager that skips the gradient collective of the
# backward passes inside it (it does nothing when disabled and never flips DDP's private flags; Fabric's
# ``_DDPBackwardSyncControl`` is the model).
#
# It does nothing when ``enabled`` is False, and raises ``TypeError`` when the module is not the wrapper it
# controls, instead of silently syncing every micro-batch. Never flip a wrapper's private flags by hand.
#
# Example::
#
#     control = DDPSyncControl()
#     with control.no_backward_sync(ddp_model, enabled=not last_micro_batch):
#         loss.backward()


class BackwardSyncControl:
    """Base: skip the gradient sync of the backward passes run inside :meth:`no_backward_sync`."""

    wrapper = "a data-parallel wrapper"

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return contextlib.nullcontext()
        if not self.controls(module):
            raise TypeError(
                f"Blocking the gradient sync needs the model wrapped in {self.wrapper}, got {type(module).__name__}. "
                f"The strategy's setup wraps it; call this only on the model the strategy trains."
            )
        return self._block(module)

    def controls(self, module: nn.Module) -> bool:
        raise NotImplementedError

    def _block(self, module: nn.Module) -> AbstractContextManager:
        raise NotImplementedError


class DDPSyncControl(BackwardSyncControl):
    """torch ``DistributedDataParallel``: its ``no_sync()`` (the reducer skips the all-reduce)."""

    wrapper = "torch's DistributedDataParallel"

    def controls(self, module: nn.Module) -> bool:
        return isinstance(module, DistributedDataParallel)

    def _block(self, module: nn.Module) -> AbstractContextManager:
        assert isinstance(module, DistributedDataParallel)
        return module.no_sync()


class FSDP2SyncControl(BackwardSyncControl):
    """torch FSDP2 (``fully_shard``): ``set_requires_gradient_sync(False)`` for the root and every unit."""

    wrapper = "torch FSDP2 (fully_shard)"

    def controls(self, module: nn.Module) -> bool:
        from torch.distributed.fsdp import FSDPModule

        return isinstance(module, FSDPModule)

    @contextlib.contextmanager
    def _block(self, module: nn.Module) -> Generator[None, None, None]:
        module.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)  # type: ignore[operator]


class ShardedDDPSyncControl(BackwardSyncControl):
    """fairscale ``ShardedDataParallel``: its ``no_sync()``."""

    wrapper = "fairscale's ShardedDataParallel"

    def controls(self, module: nn.Module) -> bool:
        from fairscale.nn.data_parallel import ShardedDataParallel

        return isinstance(module, ShardedDataParallel)

    def _block(self, module: nn.Module) -> AbstractContextManager:
        return module.no_sync()  # type: ignore[operator]


# ----------------------------------------------------------------------------------------------------
# Manual optimization under DDP: each optimizer's gradients are averaged once, when it steps.
#
# DDP's reducer stays out of the step (it would sync every backward, and wait forever for the gradients of
# the parameters ``toggle_model`` switched off); this part syncs what the stepping optimizer needs, in the
# step's closure (after its backward, before unscaling and ``on_before_optimizer_step``), or earlier when the
# precision plugin asks (``clip_gradients`` between ``manual_backward`` and ``opt.step()`` clips the global
# gradient).


class ManualGradientSync:
    """Per optimizer: the parameters to average (trainable at set-up, in optimizer order), and a guard that
    refuses a raw ``torch.optim`` step (its gradients would not be averaged).

    Example::

        sync = ManualGradientSync(compress=None, bucket_cap_mb=25.0)
        sync.setup(optimizers, world_size=2)
        with sync.stepping():
            optimizer.step(sync.wrap_closure(optimizer, closure, group, ledger))
    """

    def __init__(self, compress: Optional[str], bucket_cap_mb: float = 25.0) -> None:
        self.compress = compress
        self.bucket_cap_mb = bucket_cap_mb
        self._params: dict[int, list[torch.Tensor]] = {}
        self._synced: set[int] = set()
        self._guards: list[RemovableHandle] = []
        self._in_step = False
        self._ranks = 1

    def setup(
        self,
        optimizers: Iterable[Optimizer],
        world_size: int,
        model_parameter: Callable[[torch.Tensor], torch.Tensor] = lambda p: p,
    ) -> None:
        """``model_parameter``: the parameter whose gradient backward writes (master-weight precision keeps FP32
        copies in the optimizer; their half-precision model parameters are synced, before the copy)."""
        self.teardown()
        self._ranks = world_size
        for opt in optimizers:
            seen: set[int] = set()  # per optimizer: a parameter shared by two optimizers is synced for each
            params = []
            for group in opt.param_groups:
                for p in group["params"]:
                    p = model_parameter(p)
                    if p.requires_grad and id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
            self._params[id(opt)] = params
            self._guards.append(opt.register_step_pre_hook(self._refuse_unsynced_step))

    def teardown(self) -> None:
        for handle in self._guards:
            handle.remove()
        self._guards = []
        self._params = {}

    @contextlib.contextmanager
    def stepping(self) -> Generator[None, None, None]:
        """Around the strategy's optimizer step: a raw step outside it is refused; each optimizer syncs once."""
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False
            self._synced.clear()

    def wrap_closure(self, optimizer: Any, closure: Callable[[], Any], group: Any, ledger: CommStats) -> Callable:
        inner = unwrap_optimizer(optimizer)
        if id(inner) not in self._params:
            raise MisconfigurationException(
                f"{type(inner).__name__} was not returned by configure_optimizers, so mgpu_ddp cannot sync its "
                f"gradients. Create every optimizer in configure_optimizers."
            )

        def synced_closure() -> Any:
            out = closure()
            self.sync(inner, group, ledger)
            return out

        return synced_closure

    def sync(self, optimizer: Any, group: Any, ledger: CommStats) -> None:
        """Average ``optimizer``'s gradients across ranks, once per step."""
        inner = unwrap_optimizer(optimizer)
        params = self._params.get(id(inner))
        if params is None or id(inner) in self._synced:
            return
        allreduce_gradients(
            params, group=group, compress=self.compress, ledger=ledger, bucket_cap_mb=self.bucket_cap_mb
        )
        self._synced.add(id(inner))

    def _refuse_unsynced_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if not self._in_step:
            raise MisconfigurationException(
                f"{type(optimizer).__name__}.step() was called on the raw torch optimizer, so its gradients were "
                f"not averaged across the {self._ranks} ranks and the replicas would drift apart. Step through "
                f"Lightning's wrapper: `opt = self.optimizers()` (not `use_pl_optimizer=False` or an optimizer "
                f"kept from configure_optimizers), then `opt.step()`."
            )
