"""The ``lightning-mgpu`` command: Lightning's own ``LightningCLI`` with this pack imported.

    lightning-mgpu fit --config configs/ddp.yaml            # the console script
    python -m lightning_mgpu fit --config configs/ddp.yaml  # the same
    lightning-mgpu fit --config configs/ddp.yaml --print_config
    lightning-mgpu --list                                   # the presets

Nothing here replaces Lightning: the model and the data module are chosen by ``class_path`` in the YAML
(any ``LightningModule`` / ``LightningDataModule``), and ``fit`` / ``validate`` / ``test`` / ``predict`` are
Lightning's subcommands. What the pack adds is (1) importing it, so ``trainer.strategy: mgpu_ddp`` resolves;
(2) a hint under jsonargparse's own message when a config names an unknown strategy or misspells an option
(the presets, and the closest valid names); (3) leaving the process group on every rank before exit.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from typing import Any, NoReturn, Optional

from jsonargparse import ActionConfigFile
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI
from pytorch_lightning.strategies import StrategyRegistry
from typing_extensions import override

from lightning_mgpu import _namespace
from lightning_mgpu.migration import REMOVED_TRAINER_ARGUMENTS

__all__ = ["MGPUCLI", "MGPUArgumentParser", "in_namespace", "main", "strategy_hint"]

# "lightning_mgpu" here, "lightning_mgpu.lightning" in the `lightning` namespace's copy of this module
_PACKAGE = __name__.rpartition(".")[0]
# the Lightning namespace this module serves: "lightning" in the copy, and in `lightning_mgpu` itself when only the
# `lightning` distribution is installed (its imports are rewritten then)
_RUNNING = "lightning" if LightningCLI.__module__.startswith("lightning.") else "pytorch_lightning"


def _version() -> str:
    from lightning_mgpu import __version__

    return __version__


def strategy_hint(name: Optional[str] = None) -> str:
    """The presets, one line; with ``name``, the closest preset or Lightning strategy names first
    (:func:`lightning_mgpu.presets.preset_hint`, which the Trainer's refusal says too); then how to name a class."""
    from lightning_mgpu.presets import preset_hint

    lines = [preset_hint(name)]
    lines.append(
        "A strategy class works without importing the pack: "
        f"`strategy: {{class_path: {_PACKAGE}.MGPUDDPStrategy, init_args: {{...}}}}`."
    )
    return "\n".join(lines)


_BAD_STRATEGY = re.compile(r"trainer\.strategy: '([^']+)' is not a registered strategy name")
# jsonargparse's wordings (4.53) for an option it does not know: in a config file ("Subcommand 'fit' does not
# accept option 'trainer.stratgey'"), on the command line ("unrecognized arguments: --trainer.stratgy"), and in
# a class's init_args ("Problem with given class_path 'X': ... Option 'comm_hok' is not accepted"). A message
# in another wording still gets the preset list when it is about the strategy, only not the closest option.
_UNKNOWN_KEY = re.compile(r"does not accept option '([\w.]+)'|unrecognized arguments: --([\w.]+)", re.IGNORECASE)
_UNKNOWN_INIT_ARG = re.compile(r"class_path '([\w.]+)'.*?Option '(\w+)' is not accepted", re.DOTALL)


def _init_arg_names(class_path: str) -> list[str]:
    """The keyword arguments ``class_path``'s constructor takes (its bases' too, for ``**kwargs`` chains)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return []
    names: list[str] = []
    for klass in getattr(cls, "__mro__", (cls,)):
        init = klass.__dict__.get("__init__") if isinstance(klass, type) else klass
        if init is None:
            continue
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            continue
        names += [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]
    return list(dict.fromkeys(names))


def _inline_class_problem(value: str) -> str:
    """Why ``{"class_path": ..., "init_args": {...}}`` given inline could not be built: an unknown argument (with
    the closest valid one), or an unreadable value."""
    import yaml

    try:
        spec = yaml.safe_load(value)
    except yaml.YAMLError as err:
        return f"{value!r} is neither a strategy name nor a readable class (JSON/YAML): {err}"
    class_path = spec.get("class_path") if isinstance(spec, dict) else None
    if not isinstance(class_path, str):
        return f'{value!r} names no class_path: write {{"class_path": "{_PACKAGE}.MGPUDDPStrategy", ...}}.'
    known = _init_arg_names(class_path)
    if not known:
        return f"class_path {class_path!r} cannot be imported."
    from lightning_mgpu.settings import REPLACED_KWARGS

    known = [k for k in known if k not in REPLACED_KWARGS]  # Lightning's names the mgpu strategies refuse
    init_args = spec.get("init_args") or {}
    unknown = [k for k in init_args if k not in known]
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(k, known, n=2, cutoff=0.6)
            hints.append(f"{k!r}" + (f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""))
        return f"{class_path} does not take {', '.join(hints)}."
    return f"{class_path} could not be built from init_args {init_args!r}: check each value's type."


# Lightning's and the pack's class paths, in each namespace: the prefix of a class in `pytorch_lightning` and the
# prefix of the same class in `lightning` (with both distributions installed; see `_namespace.py`)
_SAME_CLASS = (
    ("pytorch_lightning.", "lightning.pytorch."),
    ("lightning_fabric.", "lightning.fabric."),
    ("lightning_mgpu.", "lightning_mgpu.lightning."),
)
_CLASS_PATH = re.compile(r"^(?:lightning_mgpu|pytorch_lightning|lightning_fabric|lightning)\.[\w.]+$")


def in_namespace(class_path: str, namespace: str = _RUNNING) -> str:
    """``class_path`` of one of Lightning's or the pack's classes, written for the Lightning ``namespace``
    (``"lightning"`` or ``"pytorch_lightning"``): ``lightning_mgpu.DeviceMonitor`` becomes
    ``lightning_mgpu.lightning.DeviceMonitor`` and ``pytorch_lightning.callbacks.ModelCheckpoint`` becomes
    ``lightning.pytorch.callbacks.ModelCheckpoint`` for a ``lightning`` run, and back for a ``pytorch_lightning``
    one. Any other path (the user's own classes) is returned unchanged. So one config serves a model written
    with ``import lightning as L`` and one written with ``import pytorch_lightning as pl``."""
    for pl_prefix, lightning_prefix in _SAME_CLASS:
        if namespace == "lightning":
            if pl_prefix == "lightning_mgpu." and not _namespace.two_namespaces():
                continue  # `lightning` only: lightning_mgpu itself serves it
            if class_path.startswith(pl_prefix) and not class_path.startswith(lightning_prefix):
                return lightning_prefix + class_path[len(pl_prefix) :]
        elif class_path.startswith(lightning_prefix):
            return pl_prefix + class_path[len(lightning_prefix) :]
    return class_path


def _to_namespace(value: Any) -> Any:
    """Every ``class_path`` in a loaded config value (and a bare class path given as a value), in this run's
    namespace (:func:`in_namespace`)."""
    if isinstance(value, dict):
        return {
            k: (in_namespace(v) if k == "class_path" and isinstance(v, str) else _to_namespace(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_to_namespace(v) for v in value]
    if isinstance(value, str) and _CLASS_PATH.match(value):
        return in_namespace(value)
    return value


_PARSER_MODE = f"yaml+{_RUNNING}"  # jsonargparse's YAML loader, then the class paths in this run's namespace


def _load(text: str) -> Any:
    from jsonargparse import get_loader

    return _to_namespace(get_loader("yaml")(text))


def _register_loader() -> None:
    import yaml
    from jsonargparse import set_loader

    set_loader(_PARSER_MODE, _load, exceptions=(yaml.YAMLError,))


class MGPUArgumentParser(LightningArgumentParser):
    """``LightningArgumentParser`` whose errors end with a hint: the closest valid option for a misspelled one,
    and the presets when the strategy is involved. jsonargparse's own message comes first, unchanged, except for a
    class of the other Lightning namespace that cannot be resolved: that is said on the first line."""

    def _known_keys(self) -> list[str]:
        keys: list[str] = []
        for action in self._actions:
            keys += [s.lstrip("-") for s in action.option_strings if s.startswith("--")]
        subcommands = getattr(self, "_subcommands_action", None)
        for sub in getattr(subcommands, "_name_parser_map", {}).values():
            if isinstance(sub, MGPUArgumentParser):
                keys += sub._known_keys()
        return list(dict.fromkeys(k for k in keys if not k.endswith(".help")))

    def hint(self, message: str) -> str:
        lines = []
        mixed = _namespace_hint(message)
        if mixed:
            lines.append(mixed)
        unknown = _UNKNOWN_KEY.search(message)
        key = next((g for g in unknown.groups() if g), None) if unknown else None
        removed = key.split(".", 1)[1] if key and key.startswith("trainer.") else None
        if removed in REMOVED_TRAINER_ARGUMENTS:
            replacement = REMOVED_TRAINER_ARGUMENTS[removed].format(value="N")
            lines.append(f"{key} was removed in Lightning 2.0: write {replacement}.")
        elif key:
            close = difflib.get_close_matches(key, self._known_keys(), n=3, cutoff=0.75)
            if close:
                lines.append(f"did you mean {' or '.join(f'{c!r}' for c in close)} instead of {key!r}?")
        init_arg = _UNKNOWN_INIT_ARG.search(message)
        if init_arg:
            class_path, key = init_arg.groups()
            close = difflib.get_close_matches(key, _init_arg_names(class_path), n=3, cutoff=0.6)
            if close:
                lines.append(f"did you mean {' or '.join(f'{c!r}' for c in close)} instead of {key!r} ({class_path})?")
        if "strategy" in message or (key and "strategy" in " ".join(lines)):
            named = _BAD_STRATEGY.search(message)
            lines.append(strategy_hint(named.group(1) if named else None))
        return "\n".join(lines)

    @override
    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        hint = self.hint(message)
        mixed = _namespace_hint(message)
        if mixed and getattr(self, "exit_on_error", True):  # the top-level parser, which prints and exits
            print(f"lightning-mgpu: error: {mixed}", file=sys.stderr, flush=True)  # first, before the usage
        super().error(f"{message}\n{hint}" if hint else message, ex)


class MGPUCLI(LightningCLI):
    """``LightningCLI`` for any model and data module (chosen by ``class_path``), with the pack imported.

    A user's own ``LightningCLI`` script needs only ``import lightning_mgpu`` for the preset names; use this
    class (same arguments as ``LightningCLI``) to also get the hints::

        from lightning_mgpu.cli import MGPUCLI
        MGPUCLI(MyModel, MyData)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import lightning_mgpu  # noqa: F401  (registers the preset names before the config is parsed)

        super().__init__(*args, **kwargs)

    @override
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # LightningCLI's own init_parser with MGPUArgumentParser (its `parser_class` argument exists only since
        # Lightning 2.6; this hook is in every 2.x release)
        kwargs.setdefault("dump_header", [f"lightning-mgpu=={_version()}"])
        if kwargs.get("parser_mode", "yaml") == "yaml":  # class paths in the model's namespace (in_namespace)
            _register_loader()
            kwargs["parser_mode"] = _PARSER_MODE
        parser = MGPUArgumentParser(**kwargs)
        parser.add_argument(
            "-c", "--config", action=ActionConfigFile, help="Path to a configuration file in json or yaml format."
        )
        return parser

    @override
    def before_instantiate_classes(self) -> None:
        """An unknown strategy *name* passes parsing (``trainer.strategy`` is ``Union[str, Strategy]``) and would
        only fail inside ``Trainer``; refuse it here, before any process starts, with the parser's usage
        (jsonargparse style) plus the hint. A dropped Lightning 1.x name gets its migration message."""
        from lightning_mgpu.presets import renamed

        config = self.config.get(self.subcommand) if self.subcommand else self.config
        for key in ("trainer.strategy", "trainer.accelerator"):
            value = config.get(key) if config is not None else None
            if not isinstance(value, str):
                continue
            old = renamed(key.split(".")[1], value)
            if old is not None:
                self.parser.error(f"{key}: {old.message}")
            if key == "trainer.strategy" and value.lstrip().startswith("{"):
                # a class given inline (JSON on the command line) that jsonargparse could not build falls back to
                # the `str` of `Union[str, Strategy]`: say what is wrong with it, as it says for a YAML config
                self.parser.error(f"trainer.strategy: {_inline_class_problem(value)}")
            if key == "trainer.strategy" and value != "auto" and value.lower() not in StrategyRegistry:
                self.parser.error(f"trainer.strategy: {value!r} is not a registered strategy name.")


def _current_directory_importable() -> None:
    """Put the current directory first on ``sys.path``, as ``python -m`` does, so that a config's
    ``class_path: mymodel.MyModel`` finds ``mymodel.py`` where the command runs (the console script's
    ``sys.path[0]`` is its own ``bin`` directory). Nothing changes when it is there already."""
    cwd = os.getcwd()
    here = {os.path.realpath(p or os.curdir) for p in sys.path}
    if os.path.realpath(cwd) not in here:
        sys.path.insert(0, cwd)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``lightning-mgpu`` and ``python -m lightning_mgpu``."""
    _current_directory_importable()
    import lightning_mgpu
    from lightning_mgpu.strategies.launchers import release_process_group

    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["export"]:  # a checkpoint as a Hugging Face folder or one file: lightning_mgpu/export.py
        from lightning_mgpu.export import main as export_main

        return export_main(args[1:])
    if __name__ == "lightning_mgpu.cli" and _namespace.two_namespaces() and _model_namespace(args) == "lightning":
        # a model written against `import lightning as L`: the same CLI, from the `lightning` copy of the pack
        from lightning_mgpu.lightning.cli import main as lightning_main

        return lightning_main(argv)
    if args[:1] == ["--list"]:
        print(lightning_mgpu.preset_table())
        return 0
    if args[:1] == ["plan"]:  # the memory plan, before launch: lightning_mgpu/planning (no Trainer, no processes)
        from lightning_mgpu.planning.cli import main as plan_main

        return plan_main(args[1:])
    if args[:1] == ["--version"]:
        print(f"lightning-mgpu {lightning_mgpu.__version__}")
        return 0
    description = (
        f"{(lightning_mgpu.__doc__ or '').strip()}\n\n"
        "Lightning's LightningCLI with the pack imported: `lightning-mgpu fit --config configs/ddp.yaml`. "
        "`lightning-mgpu --list` prints the presets, `--version` the version, `lightning-mgpu plan --help` the "
        "memory planner, `lightning-mgpu export --help` the export of a checkpoint for Hugging Face."
    )
    # args=None lets LightningCLI read sys.argv itself (it warns when given both)
    MGPUCLI(
        args=argv,
        seed_everything_default=0,
        parser_kwargs={"prog": "lightning-mgpu", "description": description},
        trainer_defaults={"callbacks": [FitSummary()]},  # appended to the config's callbacks
    )
    release_process_group()
    return 0


def _model_class_paths(args: list[str]) -> list[str]:
    """The ``model`` class paths named by ``args``: ``--model X``, ``--model.class_path X`` or in a ``--config``
    file (at its top level or under a subcommand). Unreadable configs are left to LightningCLI to report."""
    import yaml

    found: list[str] = []
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        if key in ("--model", "--model.class_path") and value and not value.lstrip().startswith("{"):
            found.append(value)
        elif key in ("--config", "-c") and value:
            try:
                with open(value) as f:
                    config = yaml.safe_load(f)
            except (OSError, yaml.YAMLError):
                continue
            sections = (
                [config] + [v for v in config.values() if isinstance(v, dict)] if isinstance(config, dict) else []
            )
            for section in sections:
                model = section.get("model")
                path = model.get("class_path") if isinstance(model, dict) else model
                if isinstance(path, str):
                    found.append(path)
    return found


def _class_namespace(class_path: str) -> Optional[str]:
    """``"lightning"`` or ``"pytorch_lightning"``: the Lightning namespace the class at ``class_path`` is built
    on (the first Lightning class in its MRO); None if it cannot be imported or is not a Lightning class."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    for klass in getattr(cls, "__mro__", ()):
        if klass.__module__.startswith(("lightning.pytorch.", "lightning.fabric.")):
            return "lightning"
        if klass.__module__.startswith(("pytorch_lightning.", "lightning_fabric.")):
            return "pytorch_lightning"
    return None


def _model_namespace(args: list[str]) -> str:
    """``"lightning"`` when the model class named in ``args`` subclasses ``lightning.pytorch.LightningModule``
    (``import lightning as L``), else ``"pytorch_lightning"``. The last one named wins, as in LightningCLI."""
    for path in reversed(_model_class_paths(args)):
        namespace = _class_namespace(path)
        if namespace is not None:
            return namespace
    return "pytorch_lightning"


_NOT_A_SUBCLASS = re.compile(r"Import path ([\w.]+) does not correspond to a subclass of")
# jsonargparse 4.53 names the path elsewhere in a Union's errors: "Given value: mydata.MyData", "class_path 'X'"
_GIVEN_PATH = re.compile(r"Given value: ([\w.]+)\s*$|class_path '([\w.]+)'", re.MULTILINE)


def _namespace_hint(message: str) -> Optional[str]:
    """A class of the other Lightning namespace than this CLI's: say so, and name the class to write instead."""
    running = _RUNNING
    paths = _NOT_A_SUBCLASS.findall(message)
    if "does not correspond to a subclass of" in message:
        paths += [a or b for a, b in _GIVEN_PATH.findall(message)]
    for path in dict.fromkeys(paths):
        namespace = _class_namespace(path)
        if namespace is None or namespace == running:
            continue
        if running == "lightning" and path.startswith("lightning_mgpu.") and not path.startswith(_PACKAGE):
            instead = f"lightning_mgpu.lightning.{path[len('lightning_mgpu.') :]}"
        elif running == "pytorch_lightning" and path.startswith("lightning_mgpu.lightning."):
            instead = f"lightning_mgpu.{path[len('lightning_mgpu.lightning.') :]}"
        else:
            mine, theirs = ("lightning as L", "pytorch_lightning as pl")
            if running != "lightning":
                mine, theirs = theirs, mine
            instead = f"{path} with `import {mine}` (as the model is), or the model with `import {theirs}`"
        return (
            f"{path} is built on `{namespace}`, but this run uses `{running}` (chosen by the model class): every "
            f"class of one run must come from one Lightning namespace. Write {instead}."
        )
    return None


class FitSummary(Callback):
    """Prints :func:`fit_summary` on global rank 0 when ``fit`` ends, inside the worker: after a fork or spawn
    launch the main process's Trainer does not carry the workers' step counts."""

    @override
    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.is_global_zero:
            print(fit_summary(trainer), flush=True)


def fit_summary(trainer: Any) -> str:
    """What a finished ``fit`` did, for rank 0 to print: strategy, processes, steps and the last metrics."""
    strategy = trainer.strategy
    metrics = ", ".join(f"{k} {float(v):.4g}" for k, v in sorted(trainer.callback_metrics.items()) if v.numel() == 1)
    name = getattr(strategy, "public_name", type(strategy).__name__)  # MGPUShardedStrategy, not its stage class
    decision = getattr(strategy, "auto_decision", None)  # mgpu_auto became the strategy it chose at set-up
    name = "MGPUAutoStrategy" if decision is not None else name
    lines = [
        f"lightning-mgpu fit: {name} on {trainer.world_size} process(es) "
        f"({type(trainer.accelerator).__name__}, {trainer.num_nodes} node(s)), {trainer.current_epoch} epoch(s), "
        f"{trainer.global_step} optimizer step(s)",
        f"metrics: {metrics or '(none logged)'}",
    ]
    if decision is not None:
        lines.insert(1, decision.reason)
    stats = getattr(strategy, "comm_stats", None)
    if stats is not None and hasattr(stats, "summary"):
        lines.append(f"comm ledger (rank 0): {stats.summary()}")
    return "\n".join(lines)
