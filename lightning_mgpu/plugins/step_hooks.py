"""The step hooks a precision plugin dispatches, and which of them anybody listens to.

Lightning's precision plugin dispatches ``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``
and the clipping (``configure_gradient_clipping``) in every optimizer step, to the module and to every callback,
whether anything overrides them or not. Each dispatch is a profiler context, two writes of the module's hook name
and a loop over every callback, for a hook that then does nothing. :class:`ListenedHooks` decides once per Trainer
call which of them do something in this fit, and :class:`~lightning_mgpu.MGPUPrecision` dispatches only those; the
step's result is the same. Whether the Trainer clips is read at every step (a callback may set
``trainer.gradient_clip_val`` during the fit); with a profiler on, every hook is dispatched, so the profiler's report
lists what Lightning's would.

Example::

    hooks = ListenedHooks(custom_clipping=False)   # in the plugin's __init__
    if hooks.after_closure(module):                # after the closure: on_before_optimizer_step, then clipping
        ...
    hooks.forget()                                 # at the plugin's teardown
"""

from __future__ import annotations

from typing import Any, Optional

import pytorch_lightning as pl
from pytorch_lightning.profilers import PassThroughProfiler
from pytorch_lightning.utilities.model_helpers import is_overridden

from lightning_mgpu._compat import attached_trainer

__all__ = ["STEP_HOOKS", "ListenedHooks", "listened_step_hooks"]

#: The hooks Lightning's precision plugin dispatches in every optimizer step, around the backward and after the
#: closure; ``"configure_gradient_clipping"`` stands for the clipping that follows ``on_before_optimizer_step``.
STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping")


def listened_step_hooks(trainer: Any, module: Any, custom_clipping: bool = False) -> frozenset[str]:
    """Which of :data:`STEP_HOOKS` do something in ``trainer``'s fit of ``module``: the ones the module or a callback
    overrides, and clipping when the module or the plugin (``custom_clipping``: a subclass that changes
    ``clip_gradients``) changes how. With a profiler on (or no Trainer), all of them.

    Example::

        listened_step_hooks(trainer, module)  # frozenset({'on_after_backward'}): a callback reads gradients
    """
    if trainer is None or not isinstance(trainer.profiler, PassThroughProfiler):
        return frozenset(STEP_HOOKS)
    listened = {
        hook
        for hook in STEP_HOOKS[:3]
        if is_overridden(hook, module, parent=pl.LightningModule)
        or any(is_overridden(hook, callback, parent=pl.Callback) for callback in trainer.callbacks)
    }
    if (
        custom_clipping
        or is_overridden("configure_gradient_clipping", module, parent=pl.LightningModule)
        or is_overridden("clip_gradients", module, parent=pl.LightningModule)
    ):
        listened.add("configure_gradient_clipping")
    return frozenset(listened)


class ListenedHooks:
    """The step hooks listened to in the current Trainer call (:func:`listened_step_hooks`), decided at the first
    step of a module and kept until :meth:`forget` (the plugin's teardown: the next call may have other callbacks).

    ``custom_clipping``: the plugin is a subclass that changes ``clip_gradients`` (clipping is then always run)."""

    def __init__(self, custom_clipping: bool = False) -> None:
        self.custom_clipping = custom_clipping
        self._decided: Optional[tuple[Any, frozenset[str]]] = None  # (module, its listened hooks)

    def of(self, module: Any) -> frozenset[str]:
        """The hooks somebody listens to in ``module``'s current Trainer call."""
        decided = self._decided
        if decided is None or decided[0] is not module:
            hooks = listened_step_hooks(attached_trainer(module), module, self.custom_clipping)
            decided = self._decided = (module, hooks)
        return decided[1]

    def after_closure(self, module: Any) -> bool:
        """Whether the hooks after the closure run this step: ``on_before_optimizer_step`` is listened to, or the
        step clips (automatic optimization, with clipping listened to or the Trainer's ``gradient_clip_val`` set)."""
        listened = self.of(module)
        if "on_before_optimizer_step" in listened:
            return True
        if not module.automatic_optimization:
            return False
        return "configure_gradient_clipping" in listened or _clips(module)

    def forget(self) -> None:
        self._decided = None


def _clips(module: Any) -> bool:
    """Whether the Trainer ``module`` is attached to clips gradients now (``Trainer(gradient_clip_val=...)``)."""
    trainer = attached_trainer(module)
    return trainer is not None and bool(trainer.gradient_clip_val)
