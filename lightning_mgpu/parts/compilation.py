"""Compilation: ``torch.compile`` applied by the strategy, in place, once the model is wrapped or sharded.

Lightning's Trainer does not compile a model for its DDP and FSDP strategies; a model compiled by the user before
``Trainer.fit`` compiles whole ``training_step`` s, and a sharded model is best compiled block by block after
sharding, which needs the strategy. With ``compile=True`` (or a dict of :func:`torch.compile` keyword arguments) the
strategy compiles, after SyncBatchNorm conversion, activation checkpointing and DDP wrapping or sharding (the
development page's order of model transforms):

* under DDP (``mgpu_ddp``, ``mgpu_zero1``, ``mgpu_local_sgd``, ...): the whole model, i.e. the LightningModule's
  ``forward`` (what ``self(x)`` in ``training_step`` runs); a LightningModule without a ``forward`` of its own
  gets its blocks compiled instead, as below;
* under the sharded stages 2 and 3: each block that the one rule for FSDP units chooses
  (``lightning_mgpu.parts.sharding.fsdp_unit_roots``: the transformer layers, ``wrap_modules``, else each direct
  child with parameters), as large training code bases compile their transformer blocks one by one: identical
  blocks share one compiled graph, and each block's gradients are ready (and reduced) as its backward ends.

Only the ``forward`` of each chosen module is replaced, by an instance attribute (as activation checkpointing
patches it): the module object, its hooks (DDP's, FSDP's unshard and reshard, which stay eager) and its
``state_dict`` keys are unchanged, so checkpoints load with or without compilation (no ``_orig_mod.`` prefix).
The strategy's teardown puts the eager ``forward`` back.

Example::

    from lightning_mgpu import MGPUShardedStrategy

    Trainer(strategy=MGPUShardedStrategy(stage=3, compile=True))              # inductor, each block
    Trainer(strategy=MGPUDDPStrategy(compile={"mode": "max-autotune"}))       # the whole forward
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Union

import torch
from pytorch_lightning import LightningModule
from torch import nn

from lightning_mgpu import _compat
from lightning_mgpu.parts.sharding import fsdp_unit_roots

__all__ = [
    "Compilation",
    "compile_forward",
    "compiled_modules",
    "log_eagerly",
    "remove_compilation",
    "user_compiled_message",
    "user_compiled_sharded_message",
]


class _CompiledForward:
    """Instance ``forward`` of a compiled module: the compiled callable and the ``forward`` it replaced (the
    class's, or activation checkpointing's instance ``forward``), so that removal restores exactly that. A copy
    (``copy.deepcopy``, pickling) of the module compiles the copy's own ``forward`` with the same options."""

    def __init__(self, module: nn.Module, previous: Optional[Any], options: dict[str, Any]) -> None:
        self.module = module
        self.previous = previous
        self.options = options
        # activation checkpointing's instance forward when there is one: its checkpoint is traced into the graph
        target = previous if previous is not None else functools.partial(type(module).forward, module)
        self.compiled = torch.compile(target, **options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        # the compiled callable holds the original module: a copy compiles its own forward instead
        return (_CompiledForward, (self.module, self.previous, self.options))


class _EagerLog:
    """Instance ``log`` of a LightningModule whose code is compiled (by the strategy, or by the user before
    ``Trainer.fit``): Lightning's ``log``, run outside any compiled graph (``torch.compiler.disable``). Logging is
    bookkeeping in Python; since torch 2.12 dynamo traces into the signature check inside ``LightningModule.log``
    (``inspect.getfullargspec`` of ``training_step``) and fails with "'method' object has no attribute
    '__dict__'" where an earlier torch broke the graph there (Lightning's own fix, on its master branch, disables
    compilation of ``log`` the same way). A copy of the module gets its own."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.eager = torch.compiler.disable(functools.partial(type(module).log, module))  # type: ignore[attr-defined]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.eager(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_EagerLog, (self.module,))


def log_eagerly(module: nn.Module) -> None:
    """``self.log`` of the LightningModule ``module`` runs eagerly, also when called inside compiled code (a
    compiled ``forward`` or ``training_step``); :func:`remove_compilation` puts Lightning's back."""
    if isinstance(module, LightningModule) and not isinstance(module.__dict__.get("log"), _EagerLog):
        module.__dict__["log"] = _EagerLog(module)


def compile_forward(module: nn.Module, options: dict[str, Any]) -> bool:
    """Compile ``module.forward`` in place with ``torch.compile(**options)``; False if it was compiled already.

    Example:

        >>> from torch import nn
        >>> from lightning_mgpu.parts.compilation import compile_forward, compiled_modules
        >>> net = nn.Sequential(nn.Linear(2, 2))
        >>> compile_forward(net[0], {"backend": "eager"}), compiled_modules(net)
        (True, ['0'])
        >>> list(net.state_dict())  # the keys are unchanged
        ['0.weight', '0.bias']
    """
    current = module.__dict__.get("forward")
    if isinstance(current, _CompiledForward):
        return False
    module.__dict__["forward"] = _CompiledForward(module, current, dict(options))
    return True


def remove_compilation(module: nn.Module) -> int:
    """Put back the ``forward`` of every compiled module of ``module`` (and Lightning's ``log``, see
    :func:`log_eagerly`); returns how many forwards were restored."""
    if isinstance(module.__dict__.get("log"), _EagerLog):
        del module.__dict__["log"]
    restored = 0
    for m in module.modules():
        patched = m.__dict__.get("forward")
        if isinstance(patched, _CompiledForward):
            if patched.previous is None:
                del m.__dict__["forward"]
            else:
                m.__dict__["forward"] = patched.previous
            restored += 1
    return restored


def compiled_modules(module: nn.Module) -> list[str]:
    """Names of the modules of ``module`` whose ``forward`` is compiled (``""``: the module itself)."""
    return [n for n, m in module.named_modules() if isinstance(m.__dict__.get("forward"), _CompiledForward)]


def defines_forward(module: nn.Module) -> bool:
    """Whether ``module``'s class has a ``forward`` of its own (LightningModule's and torch's are stubs)."""
    forward = type(module).forward
    return forward is not LightningModule.forward and forward is not nn.Module.forward


def user_compiled_sharded_message(strategy: str, candidates: Any) -> str:
    return (
        f"The model passed to Trainer.fit was compiled with torch.compile, and {strategy} may choose a sharded "
        f"stage ({', '.join(candidates)}), where Lightning compiles the user-compiled model's whole training_step "
        f"around FSDP's hooks (Lightning refuses compiled models for its own FSDP too; here BatchNorm statistics "
        f"were updated more than once per step). Pass the model itself, trainer.fit(model) instead of "
        f"trainer.fit(torch.compile(model)), and {strategy}(compile=True) (or compile={{...}}): the chosen "
        f"strategy compiles it after sharding. Or keep torch.compile(model) with strategies=['mgpu_ddp', "
        f"'mgpu_zero1']."
    )


def user_compiled_message(strategy: str) -> str:
    return (
        f"The model passed to Trainer.fit was compiled with torch.compile, and {strategy} was built with compile=... "
        f"as well: the model would be compiled twice (Lightning compiles the user-compiled model's whole "
        f"training_step). Pass the model itself, trainer.fit(model) instead of trainer.fit(torch.compile(model)), "
        f"and give torch.compile's arguments to the strategy: {strategy}(compile={{'mode': ...}}) (or compile=True); "
        f"or keep torch.compile(model) and leave compile=False."
    )


class Compilation:
    """The strategy's compilation part: built from the ``compile`` setting, applied after wrapping or sharding,
    removed at teardown.

    Example::

        part = Compilation({"backend": "aot_eager"})
        part.check(module, "MGPUDDPStrategy")     # before launch: a model compiled by the user is refused
        part.compile_model(module)                # DDP: after the wrap (the LightningModule's forward)
        part.compile_blocks(module, wrap_modules) # sharded: after fully_shard (each FSDP unit's block)
        part.compile_pipeline_blocks(module, blocks)  # pipeline: each of its blocks (the stage hooks stay eager)
        part.remove(module)                       # teardown: the eager forwards back
    """

    def __init__(self, setting: Union[bool, dict[str, Any]] = False) -> None:
        self.options: Optional[dict[str, Any]] = {} if setting is True else (dict(setting) if setting else None)

    @property
    def enabled(self) -> bool:
        return self.options is not None

    def check(self, module: nn.Module, strategy: str, sharded_choices: tuple[str, ...] = ()) -> None:
        """Before launch: refuse a model the user compiled when the strategy compiles too, or when it may become a
        sharded stage (``sharded_choices``: ``mgpu_auto``'s sharded candidates)."""
        if not _compat.compiled_by_user(module):
            return
        if self.enabled:
            raise ValueError(user_compiled_message(strategy))
        if sharded_choices:
            raise ValueError(user_compiled_sharded_message(strategy, sharded_choices))

    def log_eagerly(self, module: nn.Module) -> None:
        """``self.log`` outside compiled code (:func:`log_eagerly`) when the LightningModule's code is compiled: by
        this strategy (``compile=...``), or by the user (``trainer.fit(torch.compile(model))``, whose
        ``training_step`` Lightning compiles)."""
        if self.enabled or _compat.compiled_by_user(module):
            log_eagerly(module)

    def compile_model(self, module: Optional[nn.Module]) -> list[str]:
        """Under DDP: the LightningModule's ``forward`` (the whole model); without a ``forward`` of its own, its
        blocks (:meth:`compile_blocks`). Returns the names compiled."""
        if module is None:
            return []
        self.log_eagerly(module)
        if self.options is None:
            return []
        if defines_forward(module):
            compile_forward(module, self.options)
            return compiled_modules(module)
        return self.compile_blocks(module, None)

    def compile_blocks(
        self, module: Optional[nn.Module], wrap_modules: Optional[tuple[type[nn.Module], ...]]
    ) -> list[str]:
        """Under the sharded stages: each block the FSDP unit rule chooses (``wrap_modules`` as the strategy's).
        Returns the names compiled."""
        if module is None:
            return []
        self.log_eagerly(module)
        if self.options is None:
            return []
        for unit in fsdp_unit_roots(module, wrap_modules):
            compile_forward(unit, self.options)
        return compiled_modules(module)

    def compile_pipeline_blocks(self, module: Optional[nn.Module], blocks: list[nn.Module]) -> list[str]:
        """Under pipeline parallelism: each of the pipeline's ``blocks`` (its stages' hooks and the user's
        ``training_step`` stay eager). Returns the names compiled."""
        if module is None or self.options is None:
            return []
        for block in blocks:
            compile_forward(block, self.options)
        return compiled_modules(module)

    def remove(self, module: Optional[nn.Module]) -> None:
        if module is not None:
            remove_compilation(module)
