"""A stand-in of the user's module to plan with: its module tree with fake tensors, sharing everything else.

The planner steps a model under ``FakeTensorMode``; the model it is given (``plan(model)``, the module
``mgpu_auto`` was handed) holds real tensors and, often, much more: datasets, data loaders, tokenizers, locks,
open files, generators, loggers, a Trainer. Nothing of that is copied. Each :class:`~torch.nn.Module` of the
tree is copied one level (``copy.copy``: a new object whose attributes are the same objects), then in the copy

* each parameter and buffer, and each tensor kept as an attribute or as an item of an attribute list, tuple,
  set or dict, is replaced by a fake tensor of its shape and dtype (the same fake for the same tensor: tied
  weights stay tied); a 4-bit weight (``quantize_frozen``) by a 4-bit weight of fake packed pieces;
* each submodule, and each module kept in such a container, is replaced by its stand-in (the same stand-in for
  the same module);
* each list, dict and set attribute is a new container of the same items, so that what ``training_step`` appends
  or assigns stays in the stand-in;
* a lazy layer's parameters not materialized yet (``nn.LazyLinear``) are new ones, and its hook handles point at
  the stand-in's hooks, so that its first forward materializes the stand-in only.

Every other object (a dataset and the tensors inside it, a tokenizer, a lock) is shared, not copied: an
operation of ``training_step`` that reads a real tensor deeper inside such an object reads it as a constant
(``FakeTensorMode(allow_non_fake_inputs=True)``). The user's module is never modified.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter, is_lazy
from torch.utils.hooks import RemovableHandle

from lightning_mgpu import _compat
from lightning_mgpu.planning.request import PlanError
from lightning_mgpu.quantization import empty_packed, is_nf4

__all__ = ["attached_trainer", "lazy_parameters", "stand_in", "stand_in_factory"]


def lazy_parameters(module: nn.Module) -> list[str]:
    """Names of the parameters and buffers of ``module`` that are not materialized yet (``nn.LazyLinear``...)."""
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return [name for name, t in named if is_lazy(t)]


class _StandIn:
    """One stand-in tree: the fakes and stand-ins made so far, by the id of what they stand for."""

    def __init__(self) -> None:
        self.made: dict[int, Any] = {}
        self.keep: list[Any] = []  # the originals, alive while their ids are keys of ``made``

    def remember(self, original: Any, made: Any) -> Any:
        self.made[id(original)] = made
        self.keep.append(original)
        return made

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) in self.made:
            return self.made[id(t)]
        if is_lazy(t):  # not materialized yet: a fresh one, materialized by the stand-in's own first forward
            lazy: Any = UninitializedParameter if isinstance(t, nn.Parameter) else UninitializedBuffer
            return self.remember(t, lazy(requires_grad=t.requires_grad, dtype=t.dtype))
        # a 4-bit weight stands in as one: its packed pieces are what it holds, and it computes as the weight does
        fake = empty_packed(t) if is_nf4(t) else torch.empty(tuple(t.shape), dtype=t.dtype)
        if isinstance(t, nn.Parameter):
            fake = nn.Parameter(fake, requires_grad=t.requires_grad)
        return self.remember(t, fake)

    def item(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if isinstance(value, nn.Module):
            return self.module(value)
        return value

    def container(self, value: Any) -> Any:
        """A list, dict or set attribute: a new container of the items' stand-ins; a tuple holding tensors or
        modules: a new tuple of them; anything else: itself."""
        if isinstance(value, (torch.Tensor, nn.Module)):
            return self.item(value)
        if type(value) in (list, set):
            return type(value)(self.item(v) for v in value)
        if isinstance(value, dict) and type(value).__module__ in ("builtins", "collections"):
            new = copy.copy(value)
            for key, v in value.items():
                new[key] = self.item(v)
            return new
        if type(value) is tuple and any(isinstance(v, (torch.Tensor, nn.Module)) for v in value):
            return tuple(self.item(v) for v in value)
        return value

    def module(self, m: nn.Module) -> nn.Module:
        if id(m) in self.made:
            return self.made[id(m)]
        shell = copy.copy(m)  # a LightningModule's copy drops its Trainer (LightningModule.__getstate__)
        if type(shell) is not type(m) or shell is m:
            raise PlanError(f"{type(m).__qualname__} cannot be stood in for: copy.copy returned {shell!r}.")
        self.remember(m, shell)
        copies: dict[int, Any] = {}
        for key, value in list(vars(shell).items()):
            vars(shell)[key] = copies[id(value)] = self.container(value)
        for key, value in list(vars(shell).items()):
            if isinstance(value, RemovableHandle):
                vars(shell)[key] = _handle(value, copies)
        return shell


def _handle(handle: RemovableHandle, copies: dict[int, Any]) -> RemovableHandle:
    """``handle`` re-pointed at the stand-in's copies of its hook dicts: a lazy layer removes its initialisation
    hook through it once materialized, which must not touch the user's module."""
    hooks = handle.hooks_dict_ref()
    extra = [ref() for ref in handle.extra_dict_ref]
    if hooks is None or id(hooks) not in copies:
        return handle
    new = RemovableHandle(copies[id(hooks)], extra_dict=[copies.get(id(d), d) for d in extra if d is not None])
    new.id = handle.id
    return new


def attached_trainer(module: nn.Module) -> Optional[Any]:
    """The Trainer a LightningModule is attached to, else None (a plain module's own ``trainer`` attribute is not
    one)."""
    if not (hasattr(module, "configure_optimizers") and hasattr(module, "automatic_optimization")):
        return None
    return _compat.attached_trainer(module)


def stand_in(module: nn.Module) -> nn.Module:
    """A stand-in of ``module`` (see the module docstring), made inside the caller's ``FakeTensorMode``.

    A LightningModule's stand-in has no Trainer while it steps (its ``self.log`` is a no-op, its Trainer's results
    are not touched); when ``module`` is attached to one, its ``configure_optimizers`` sees that Trainer (a
    scheduler sized by ``self.trainer.estimated_stepping_batches``)."""
    shell: Any = _StandIn().module(module)
    trainer = attached_trainer(module)
    if trainer is not None:
        configure = type(shell).configure_optimizers

        def configure_optimizers() -> Any:
            shell.trainer = trainer
            try:
                return configure(shell)
            finally:
                shell.trainer = None

        vars(shell)["configure_optimizers"] = configure_optimizers
    return shell


def stand_in_factory(module: nn.Module) -> Callable[[], nn.Module]:
    """A factory of stand-ins of ``module`` (a new one each call, inside the caller's fake mode)."""

    def build() -> nn.Module:
        return stand_in(module)

    build.__qualname__ = type(module).__qualname__
    return build
