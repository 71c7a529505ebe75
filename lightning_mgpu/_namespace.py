"""Both Lightning namespaces from one source: ``lightning_mgpu`` for ``pytorch_lightning``, and
``lightning_mgpu.lightning`` for ``lightning`` (``import lightning as L``, what Lightning's docs use).

Lightning ships its code twice: ``pytorch_lightning`` (the ``pytorch-lightning`` distribution) and
``lightning.pytorch`` (the ``lightning`` distribution) are the same source with separate classes and a
``StrategyRegistry`` each, and a Trainer accepts only strategies, plugins and callbacks of its own namespace
(``isinstance(strategy, Strategy)``). So the pack too exists once per namespace. Lightning makes its second
copy by rewriting the imports of its source when it builds the ``lightning`` wheel; this module does the same
when a module of ``lightning_mgpu.lightning`` is imported: it reads the file of the matching
``lightning_mgpu`` module and rewrites its *import statements* (nothing else: no string, no name),

    ``import pytorch_lightning as pl``        -> ``import lightning.pytorch as pl``
    ``from lightning_fabric.x import Y``      -> ``from lightning.fabric.x import Y``
    ``from lightning_mgpu.x import Y``        -> ``from lightning_mgpu.lightning.x import Y``
    ``import lightning_mgpu``                 -> ``import lightning_mgpu.lightning as lightning_mgpu``

so every file has one source of truth, tracebacks point at it, and the two copies cannot drift apart.

The pack depends on one Lightning distribution, whichever the user has (``pip install lightning-mgpu[lightning]``
or ``lightning-mgpu[pytorch-lightning]``). With both, ``lightning_mgpu`` serves ``pytorch_lightning`` and
``lightning_mgpu.lightning`` serves ``lightning``, as above. With ``lightning`` only (:func:`setup_namespaces`),
``lightning_mgpu`` itself is loaded with the ``pytorch_lightning`` / ``lightning_fabric`` imports rewritten to
``lightning.pytorch`` / ``lightning.fabric`` (:data:`LIGHTNING_ONLY_RENAMES`), and ``lightning_mgpu.lightning`` is
another name of the same modules: ``from lightning_mgpu import MGPUDDPStrategy`` and ``from
lightning_mgpu.lightning import MGPUDDPStrategy`` give one class, for ``lightning.Trainer``. With neither, ``import
lightning_mgpu`` raises an ``ImportError`` naming both install lines.
It also refuses, with an ``ImportError`` naming the upgrade line, a Lightning release older than
:data:`OLDEST_LIGHTNING` (:func:`unsafe_lightning_releases`): the declared range starts there for safety, not for
features.
``import lightning_mgpu`` imports the ``lightning`` copy too when ``lightning`` is installed (then, or as soon as
``lightning`` is imported: :func:`import_after`), so the preset names are registered in both namespaces whichever
Trainer the user builds. The copy is a real package:
``lightning_mgpu.lightning.MGPUDDPStrategy`` pickles and unpickles (spawn launches) by its module path.

This module imports nothing of torch or Lightning, so that it can be loaded on its own.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any, Optional

__all__ = [
    "COMPROMISED_LIGHTNING",
    "LIGHTNING_ONLY_RENAMES",
    "LIGHTNING_RENAMES",
    "NO_LIGHTNING",
    "OLDEST_LIGHTNING",
    "AfterImport",
    "AliasFinder",
    "MirrorFinder",
    "import_after",
    "install",
    "lightning_available",
    "pytorch_lightning_available",
    "rewrite_imports",
    "setup_namespaces",
    "two_namespaces",
    "unsafe_lightning_releases",
]

#: top-level module renames that turn the ``pytorch_lightning`` copy into the ``lightning`` one
LIGHTNING_RENAMES: Mapping[str, str] = {
    "pytorch_lightning": "lightning.pytorch",
    "lightning_fabric": "lightning.fabric",
    "lightning_mgpu": "lightning_mgpu.lightning",
}


#: the renames that make ``lightning_mgpu`` itself serve ``lightning`` when ``pytorch_lightning`` is not installed
LIGHTNING_ONLY_RENAMES: Mapping[str, str] = {
    "pytorch_lightning": "lightning.pytorch",
    "lightning_fabric": "lightning.fabric",
}

#: the error of ``import lightning_mgpu`` without either Lightning distribution
NO_LIGHTNING = (
    "lightning-mgpu needs one Lightning distribution, and neither is installed. With `import lightning as L`: "
    "pip install 'lightning-mgpu[lightning]' (or pip install lightning); with `import pytorch_lightning as pl`: "
    "pip install 'lightning-mgpu[pytorch-lightning]' (or pip install pytorch-lightning)."
)

#: The oldest Lightning release the pack accepts, in both distributions (``lightning``, ``pytorch-lightning``) and
#: in ``lightning-fabric`` where it is installed on its own. 2.6.6 fixed arbitrary code execution through a
#: checkpoint's hyper-parameters in ``load_from_checkpoint``, even under ``weights_only=True`` (advisory
#: GHSA-qqmf-gpg7-g8gw, CVE-2026-58659): the pack's guides treat a checkpoint as data, which holds only from 2.6.6 on.
OLDEST_LIGHTNING = "2.6.6"

#: Releases that were published with a credential-stealing payload (advisory GHSA-w37p-236h-pfx3): an environment
#: that has one installed has already run it, so the message says to rotate credentials, not only to upgrade.
COMPROMISED_LIGHTNING = frozenset({"2.6.2", "2.6.3"})

_LIGHTNING_DISTRIBUTIONS = ("lightning", "pytorch-lightning", "lightning-fabric")


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of ``version`` (``"2.6.6rc1"`` -> ``(2, 6, 6)``): enough to order Lightning's releases
    without importing ``packaging`` before the user's Lightning."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def unsafe_lightning_releases(version_of: Optional[Any] = None) -> Optional[str]:
    """The message refusing the installed Lightning distributions older than :data:`OLDEST_LIGHTNING` (naming each,
    the advisory and the upgrade line), or ``None`` when every installed one is safe. ``version_of`` maps a
    distribution name to its version and raises ``PackageNotFoundError`` for a missing one (default:
    ``importlib.metadata.version``)."""
    version_of = version_of or importlib.metadata.version
    found = {}
    for name in _LIGHTNING_DISTRIBUTIONS:
        try:
            found[name] = version_of(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    old = {name: v for name, v in found.items() if _release(v) < _release(OLDEST_LIGHTNING)}
    if not old:
        return None
    listed = ", ".join(f"{name} {v}" for name, v in old.items())
    upgrade = "pip install --upgrade " + " ".join(f"'{name}>={OLDEST_LIGHTNING}'" for name in old)
    message = (
        f"lightning-mgpu refuses {listed}: releases before {OLDEST_LIGHTNING} let a checkpoint's hyper-parameters "
        f"run arbitrary code in load_from_checkpoint, even with weights_only=True (advisory GHSA-qqmf-gpg7-g8gw). "
        f"Upgrade: {upgrade}"
    )
    compromised = sorted(f"{name} {v}" for name, v in old.items() if v in COMPROMISED_LIGHTNING)
    if compromised:
        message += (
            f". {', '.join(compromised)} was published with a credential-stealing payload (advisory "
            f"GHSA-w37p-236h-pfx3) that ran when it was installed: uninstall it, and rotate the credentials "
            f"(cloud keys, tokens, SSH keys) this environment could read"
        )
    return message + "."


def _renamed(module: str, renames: Mapping[str, str]) -> Optional[str]:
    """``module`` with its renamed prefix replaced (``pytorch_lightning.cli`` -> ``lightning.pytorch.cli``);
    None if no prefix applies. The longest prefix wins, and a name already in its target stays."""
    for old in sorted(renames, key=len, reverse=True):
        new = renames[old]
        if module == new or module.startswith(new + "."):
            return None
        if module == old or module.startswith(old + "."):
            return new + module[len(old) :]
    return None


class _ImportRewriter(ast.NodeTransformer):
    def __init__(self, renames: Mapping[str, str]) -> None:
        self.renames = renames

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.ImportFrom:
        if node.level == 0 and node.module:
            node.module = _renamed(node.module, self.renames) or node.module
        return node

    def visit_Import(self, node: ast.Import) -> ast.Import:
        names: list[ast.alias] = []
        for alias in node.names:
            new = _renamed(alias.name, self.renames)
            if new is None:
                names.append(alias)
            elif alias.asname is not None:  # import pytorch_lightning.cli as cli
                names.append(ast.alias(new, alias.asname))
            else:
                # `import a.b` binds `a`; bind the same local name to the renamed module instead, and import the
                # submodule first so that `a.b` is an attribute of it
                top = alias.name.split(".")[0]
                if "." in alias.name:
                    names.append(ast.alias(new))
                names.append(ast.alias(_renamed(top, self.renames) or top, top))
        node.names = names
        return node


def rewrite_imports(source: str, filename: str, renames: Mapping[str, str] = LIGHTNING_RENAMES) -> ast.Module:
    """The module ``source`` parsed, with the import statements of every renamed module rewritten (line numbers
    unchanged). Compile the result with ``compile(tree, filename, "exec")``."""
    tree = ast.parse(source, filename)
    tree = _ImportRewriter(renames).visit(tree)
    return ast.fix_missing_locations(tree)


class _MirrorLoader(importlib.machinery.SourceFileLoader):
    """Loads a source file under the mirror's name with its imports rewritten. Never reads or writes the
    bytecode cache: the cached file belongs to the original module."""

    def __init__(self, fullname: str, path: str, renames: Mapping[str, str]) -> None:
        super().__init__(fullname, path)
        self.renames = renames

    def get_code(self, fullname: str) -> Any:
        source = importlib.util.decode_source(self.get_data(self.path))
        return compile(rewrite_imports(source, self.path, self.renames), self.path, "exec", dont_inherit=True)


class MirrorFinder(importlib.abc.MetaPathFinder):
    """Finds ``target[.x.y]`` as the source file of ``source[.x.y]``, loaded with :func:`rewrite_imports`.

    Args:
        source: the package whose files are loaded again (``"lightning_mgpu"``).
        target: the name of the copy (``"lightning_mgpu.lightning"``).
        directories: where the source package's files are (its ``__path__``).
        renames: the import renames (default: :data:`LIGHTNING_RENAMES`).
        requires: a module the copy needs, named in the ``ImportError`` when it is missing.
    """

    def __init__(
        self,
        source: str,
        target: str,
        directories: Sequence[str],
        renames: Mapping[str, str] = LIGHTNING_RENAMES,
        requires: Optional[str] = None,
    ) -> None:
        self.source, self.target = source, target
        self.directories = list(directories)
        self.renames = renames
        self.requires = requires

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != self.target and not fullname.startswith(self.target + "."):
            return None
        if self.requires is not None and importlib.util.find_spec(self.requires) is None:
            raise ModuleNotFoundError(
                f"{fullname} serves the `{self.requires}` namespace (`import lightning as L`), but `{self.requires}` "
                f"is not installed: `pip install {self.requires}`. With `pytorch_lightning`, import from "
                f"{self.source} instead.",
                name=fullname,
            )
        parts = fullname[len(self.target) :].lstrip(".").split(".") if fullname != self.target else []
        for directory in self.directories:
            base = os.path.join(directory, *parts)
            package_init = os.path.join(base, "__init__.py")
            if os.path.isfile(package_init):
                loader = _MirrorLoader(fullname, package_init, self.renames)
                return importlib.util.spec_from_file_location(
                    fullname, package_init, loader=loader, submodule_search_locations=[base]
                )
            if parts and os.path.isfile(base + ".py"):
                loader = _MirrorLoader(fullname, base + ".py", self.renames)
                return importlib.util.spec_from_file_location(fullname, base + ".py", loader=loader)
        return None


def install(finder: Any) -> Any:
    """Put ``finder`` (a :class:`MirrorFinder` or :class:`AliasFinder`) first on ``sys.meta_path`` (before the
    path finders, which would load the same files under the copy's name without rewriting them); one finder per
    name it serves. Returns the installed finder."""
    for existing in sys.meta_path:
        if type(existing) is type(finder) and _serves(existing) == _serves(finder):
            return existing
    sys.meta_path.insert(0, finder)
    return finder


def _serves(finder: Any) -> str:
    return finder.alias if isinstance(finder, AliasFinder) else finder.target


def lightning_available() -> bool:
    """Whether the ``lightning`` distribution (``import lightning``) is installed."""
    return importlib.util.find_spec("lightning") is not None


def pytorch_lightning_available() -> bool:
    """Whether the ``pytorch-lightning`` distribution (``import pytorch_lightning``) is installed."""
    return importlib.util.find_spec("pytorch_lightning") is not None


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, module_name: str) -> None:
        self.module_name = module_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.module_name)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # already executed under its own name; the import system gave it the alias's spec: put its own back
        # (importlib.resources and pickling read it)
        module.__spec__ = self.spec


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``alias[.x.y]`` as the module ``target[.x.y]`` itself (one module object, two names)."""

    def __init__(self, alias: str, target: str) -> None:
        self.alias, self.target = alias, target

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != self.alias and not fullname.startswith(self.alias + "."):
            return None
        real = self.target + fullname[len(self.alias) :]
        if importlib.util.find_spec(real) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(real))


class _ThenLoader(importlib.abc.Loader):
    """The loader of a package that, once the package has run, imports another module (:class:`AfterImport`); every
    other attribute is the wrapped loader's."""

    def __init__(self, loader: Any, then: str, finder: AfterImport) -> None:
        self.loader, self.then, self.finder = loader, then, finder

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with contextlib.suppress(ValueError):  # imported now: the finder has done its work
            sys.meta_path.remove(self.finder)
        # the package's own loader back first: importlib.resources, inspect and pickling read it
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        importlib.import_module(self.then)


class AfterImport(importlib.abc.MetaPathFinder):
    """Imports ``then`` right after the top-level package ``package`` has run, the first time it is imported; once.

    ``import lightning_mgpu`` registers the preset names in ``lightning.pytorch``'s ``StrategyRegistry`` by importing
    the ``lightning`` copy, which imports ``lightning`` itself: about a second and a half, and half of a
    ``pytorch_lightning`` script's start-up, spent on a namespace it may never use. So where ``lightning`` is
    installed but not imported yet, the copy is imported when ``lightning`` is (whatever the user imports first:
    ``import lightning as L``, ``from lightning.pytorch import Trainer``, a ``LightningCLI`` config naming
    ``lightning.pytorch`` classes): ``lightning``'s own ``__init__`` imports ``lightning.pytorch`` whole, so the copy
    runs after the whole of it, as it would have under ``import lightning_mgpu`` after ``import lightning``.
    """

    def __init__(self, package: str, then: str) -> None:
        self.package, self.then = package, then
        self._looking = False

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != self.package or self._looking:
            return None
        # the other finders' spec, its loader wrapped; the finder stays until the package is imported (a look-up
        # without an import, `importlib.util.find_spec("lightning")`, leaves it in place)
        self._looking = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._looking = False
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenLoader(spec.loader, self.then, self)
        return spec


def import_after(package: str, then: str) -> None:
    """Import ``then`` now if ``package`` (top-level) is imported already, else right after it is
    (:class:`AfterImport`)."""
    if package in sys.modules:
        importlib.import_module(then)
    elif not any(isinstance(f, AfterImport) and (f.package, f.then) == (package, then) for f in sys.meta_path):
        sys.meta_path.insert(0, AfterImport(package, then))


_TWO_NAMESPACES: Optional[bool] = None


def two_namespaces() -> bool:
    """Whether ``lightning_mgpu`` serves ``pytorch_lightning`` and ``lightning_mgpu.lightning`` is its rewritten
    copy (``pytorch_lightning`` installed), rather than both names serving ``lightning`` (only ``lightning``)."""
    return _TWO_NAMESPACES if _TWO_NAMESPACES is not None else pytorch_lightning_available()


def setup_namespaces(package: str, directory: str) -> bool:
    """Install the finders of ``package`` (``"lightning_mgpu"``, whose files are in ``directory``) for the
    Lightning distributions installed; see the module docstring. Returns :func:`two_namespaces`. Raises
    ``ImportError`` (:data:`NO_LIGHTNING`) when neither is installed, and when one is older than
    :data:`OLDEST_LIGHTNING` (:func:`unsafe_lightning_releases`)."""
    global _TWO_NAMESPACES
    unsafe = unsafe_lightning_releases()
    if unsafe is not None:
        raise ImportError(unsafe, name=package)
    if pytorch_lightning_available():
        install(MirrorFinder(package, f"{package}.lightning", [directory], requires="lightning"))
        _TWO_NAMESPACES = True
    elif lightning_available():
        # every submodule of `package` is loaded with its Lightning imports rewritten; `package.lightning` is
        # another name of the same modules
        install(MirrorFinder(package, package, [directory], renames=LIGHTNING_ONLY_RENAMES))
        install(AliasFinder(f"{package}.lightning", package))
        _TWO_NAMESPACES = False
    else:
        raise ImportError(NO_LIGHTNING, name=package)
    return _TWO_NAMESPACES
