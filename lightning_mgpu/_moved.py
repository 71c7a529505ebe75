"""Import paths that moved, and where to: ``import lightning_mgpu.precision`` still works, warns once with a
``DeprecationWarning`` that names the new path, and gives the module at its new home (the same module object, so
classes, ``isinstance`` checks and pickles of the old path keep working).

One table instead of a file per old path: a module that only forwards to another would be a second home for its
concept. Everything public is also importable from ``lightning_mgpu`` itself, which never moves.
This module imports nothing of torch or Lightning.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Optional

__all__ = ["MOVED", "MovedModuleFinder", "install"]

#: old module path (below the package) -> its home now
MOVED: Mapping[str, str] = {
    "precision": "plugins.precision",
    "_precision_modes": "plugins.precision",
    "parts.precision": "plugins.precision",
    "checkpoint_io": "plugins.checkpoint_io",
    "parts.checkpoint_io": "plugins.checkpoint_io",
    "parts.async_writer": "plugins.async_checkpoint",
    "checkpointing": "parts.activation_checkpointing",
    "sampler": "parts.resume",
    "accumulation": "parts.accumulation",
    "parts.sync_control": "parts.accumulation",
    "parts.manual_sync": "parts.accumulation",
    "parts.ledger": "comm",
    "parts.process_group": "comm",
    "parts.optimizers": "_compat",
    "parts.module_mode": "parts.sharding",
    "strategies._common": "strategies.runtime",
    "strategies._process_group": "strategies.runtime",
    "strategies._launchers": "strategies.launchers",
    "strategies._sharded_checkpoints": "strategies.sharded",
    "strategies._sharding": "parts.sharding",
    "strategies.zero1": "strategies.sharded",
    "strategies.fsdp": "strategies.sharded",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"`{self.old}` moved to `{self.new}`: import from `{self.new}` (or, for public names, from the package "
            f"itself). The old path will be removed in a future release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module at its new home is already executed


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds ``package.<old path>`` of :data:`MOVED` as the module at its new path.

    Args:
        package: ``"lightning_mgpu"``, or ``"lightning_mgpu.lightning"`` for the ``lightning`` namespace's copy.
    """

    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if not fullname.startswith(self.package + "."):
            return None
        new = MOVED.get(fullname[len(self.package) + 1 :])
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(fullname, f"{self.package}.{new}"))


def install(package: str) -> None:
    """Put a :class:`MovedModuleFinder` for ``package`` last on ``sys.meta_path`` (after the path finders, so it
    only answers for paths no file serves any more); once per package."""
    for existing in sys.meta_path:
        if isinstance(existing, MovedModuleFinder) and existing.package == package:
            return
    sys.meta_path.append(MovedModuleFinder(package))


def moved_attribute(package: str, name: str) -> ModuleType:
    """``lightning_mgpu.<name>`` for a moved top-level module (``lightning_mgpu.precision`` as an attribute,
    without an import statement); ``AttributeError`` for anything else."""
    if name not in MOVED:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return importlib.import_module(f"{package}.{name}")
