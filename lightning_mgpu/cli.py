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
import re
import sys
from typing import Any, NoReturn, Optional

from pytorch_lightning.callbacks import Callback
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI
from pytorch_lightning.strategies import StrategyRegistry
from typing_extensions import override

__all__ = ["MGPUCLI", "MGPUArgumentParser", "main", "strategy_hint"]


def _preset_names() -> list[str]:
    from lightning_mgpu.presets import PRESETS

    return [p.name for p in PRESETS]


def strategy_hint(name: Optional[str] = None) -> str:
    """The presets, one line; with ``name``, the closest preset or Lightning strategy names first."""
    presets = _preset_names()
    lines = []
    if name is not None:
        from lightning_mgpu.presets import RENAMED

        dropped = {r.old for r in RENAMED if r.registry == "strategy"}  # registered only to explain themselves
        names = [n for n in presets + StrategyRegistry.available_strategies() if n not in dropped]
        known = dict.fromkeys(names)  # ordered, no repeats
        close = difflib.get_close_matches(name.lower(), list(known), n=3)
        if close:
            lines.append(f"did you mean {' or '.join(repr(c) for c in close)}?")
    lines.append(f"lightning-mgpu presets: {', '.join(presets)} (`lightning-mgpu --list` describes them).")
    lines.append(
        "A strategy class works without importing the pack: "
        "`strategy: {class_path: lightning_mgpu.MGPUDDPStrategy, init_args: {...}}`."
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


class MGPUArgumentParser(LightningArgumentParser):
    """``LightningArgumentParser`` whose errors end with a hint: the closest valid option for a misspelled one,
    and the presets when the strategy is involved. jsonargparse's own message comes first, unchanged."""

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
        unknown = _UNKNOWN_KEY.search(message)
        key = next((g for g in unknown.groups() if g), None) if unknown else None
        if key:
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

        kwargs.setdefault("parser_class", MGPUArgumentParser)
        super().__init__(*args, **kwargs)

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
            if key == "trainer.strategy" and value != "auto" and value.lower() not in StrategyRegistry:
                self.parser.error(f"trainer.strategy: {value!r} is not a registered strategy name.")


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``lightning-mgpu`` and ``python -m lightning_mgpu``."""
    import lightning_mgpu
    from lightning_mgpu.strategies._launchers import release_process_group

    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["--list"]:
        print(lightning_mgpu.preset_table())
        return 0
    if args[:1] == ["--version"]:
        print(f"lightning-mgpu {lightning_mgpu.__version__}")
        return 0
    description = (
        f"{(lightning_mgpu.__doc__ or '').strip()}\n\n"
        "Lightning's LightningCLI with the pack imported: `lightning-mgpu fit --config configs/ddp.yaml`. "
        "`lightning-mgpu --list` prints the presets, `--version` the version."
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
    lines = [
        f"lightning-mgpu fit: {name} on {trainer.world_size} process(es) "
        f"({type(trainer.accelerator).__name__}, {trainer.num_nodes} node(s)), {trainer.current_epoch} epoch(s), "
        f"{trainer.global_step} optimizer step(s)",
        f"metrics: {metrics or '(none logged)'}",
    ]
    stats = getattr(strategy, "comm_stats", None)
    if stats is not None and hasattr(stats, "summary"):
        lines.append(f"comm ledger (rank 0): {stats.summary()}")
    return "\n".join(lines)
