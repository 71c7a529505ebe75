"""What to plan: a model (class, class path, factory or instance) or a ``lightning-mgpu fit`` config, and a batch."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from lightning_mgpu.planning.request import PlanError
from lightning_mgpu.planning.stand_in import attached_trainer, lazy_parameters, stand_in_factory

__all__ = ["PlanSource", "config_trainer", "import_class", "resolve_source"]

_HOW = (
    "Name it by its full import path, e.g. 'lightning_mgpu.examples.DigitsCNN' (in YAML: model: {class_path: "
    "lightning_mgpu.examples.DigitsCNN, init_args: {...}}); a class of your own must be importable from the "
    "current directory or an installed package (pip install -e .)."
)


def import_class(path: str, what: str = "model") -> type:
    """The class at dotted ``path``; a :class:`PlanError` naming the path and how to name a class otherwise."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise PlanError(f"{what} class_path {path!r} is not a full import path. {_HOW}")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except ImportError as err:
        raise PlanError(
            f"{what} class_path {path!r}: module {module_name!r} cannot be imported ({err}). {_HOW}"
        ) from None
    except AttributeError:
        raise PlanError(f"{what} class_path {path!r}: module {module_name!r} has no {name!r}. {_HOW}") from None
    if not isinstance(cls, type):
        raise PlanError(f"{what} class_path {path!r} is {cls!r}, not a class. {_HOW}")
    return cls


@dataclass
class PlanSource:
    """A model to build under FakeTensorMode, a sample micro-batch, and the config's checkpointing policy."""

    factory: Callable[[], nn.Module]
    batch: Any
    name: str
    policy: Any = None
    save: Any = None
    """The config's ``activation_checkpointing_save`` (selective checkpointing)."""
    forward: bool = False
    """The batch is the module's ``example_input_array``: trace ``module(*batch)`` (its outputs summed as the
    loss) instead of ``training_step(batch, 0)``."""
    how_built: str = "fake"
    """How the factory builds the model: ``"fake"`` (constructed under FakeTensorMode), ``"meta"`` or ``"cpu"``
    (constructed once on the meta device, or for real on CPU, when construction under fake tensors fails;
    each build is then a stand-in of it with fake tensors: :mod:`~lightning_mgpu.planning.stand_in`)."""
    real: Optional[nn.Module] = None
    """The model with real weights where the planner was given one (an instance, ready as Lightning makes it) or
    built one (on CPU): tensor parallelism's auto plan is derived on it as at start-up, its structure included
    (:func:`~lightning_mgpu.planning.trace.tensor_split`). None where every build is fake or on the meta device."""


def _class_spec(spec: Any, what: str) -> tuple[type, dict[str, Any]]:
    if isinstance(spec, str):
        return import_class(spec, what), {}
    if isinstance(spec, dict) and isinstance(spec.get("class_path"), str):
        return import_class(spec["class_path"], what), dict(spec.get("init_args") or {})
    raise PlanError(f"config key {what!r} is {spec!r}: write {what}: {{class_path: package.Class, init_args: {{}}}}.")


def _read_config(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except OSError as err:
        raise PlanError(f"--config {path!r} cannot be read: {err.strerror}.") from None
    except yaml.YAMLError as err:
        raise PlanError(f"--config {path!r} is not valid YAML: {err}") from None
    if isinstance(config, dict) and "model" not in config and isinstance(config.get("fit"), dict):
        config = config["fit"]  # a config written for one subcommand
    if not isinstance(config, dict) or "model" not in config:
        raise PlanError(f"--config {path!r} has no 'model' section: it must be a `lightning-mgpu fit` config.")
    return config


#: Lightning's precision inputs -> the planner's names (the ones the planner does not model are refused)
_PRECISION_NAMES = {
    "32": "32-true",
    "32-true": "32-true",
    "16": "16-mixed",
    "16-mixed": "16-mixed",
    "bf16": "bf16-mixed",
    "bf16-mixed": "bf16-mixed",
    "bf16-master": "bf16-master",
    "16-master": "16-master",
}


def config_trainer(path: str) -> dict[str, Any]:
    """What a ``fit`` config says about the job to plan: ``devices``, ``num_nodes`` and ``precision`` of its
    ``trainer`` section, and ``device_memory``, ``headroom`` and ``strategies`` of an ``mgpu_auto`` strategy's
    ``init_args`` (``micro_batch_size`` keeps the strategies that micro-batch, as ``mgpu_auto`` does; with
    ``mgpu_auto`` and no precision, Lightning's default ``32-true``, which ``mgpu_auto`` plans with), and
    ``offload`` where the strategy offloads to host memory (the plan then models offload); only
    the keys the config sets. A :class:`PlanError` naming the key, its value and the flag to pass instead when a
    value cannot be planned for (``devices: auto``, a precision the planner does not model)."""
    trainer = _read_config(path).get("trainer") or {}
    if not isinstance(trainer, dict):
        return {}
    found: dict[str, Any] = {}
    devices = trainer.get("devices")
    if devices is not None:
        if isinstance(devices, str) and devices.strip().isdigit():
            devices = int(devices)
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise PlanError(
                f"--config {path!r}: trainer.devices is {devices!r}, not a number of devices to plan for. Pass "
                f"--devices N (the devices of one machine times --num-nodes)."
            )
        found["devices"] = devices
    nodes = trainer.get("num_nodes")
    if nodes is not None:
        found["num_nodes"] = int(nodes)
    precision = trainer.get("precision")
    if precision is not None:
        name = _PRECISION_NAMES.get(str(precision))
        if name is None:
            raise PlanError(
                f"--config {path!r}: trainer.precision is {precision!r}, which the planner does not model; pass "
                f"--precisions with one of {sorted(set(_PRECISION_NAMES.values()))}."
            )
        found["precision"] = name
    strategy = trainer.get("strategy")
    auto = str(strategy.get("class_path", "") if isinstance(strategy, dict) else strategy or "")
    if "precision" not in found and (auto.startswith("mgpu_auto") or auto.endswith("MGPUAutoStrategy")):
        found["precision"] = "32-true"  # Lightning's default, the one precision mgpu_auto then plans
    init_args = strategy.get("init_args") if isinstance(strategy, dict) else None
    if auto.endswith("_offload") or (isinstance(init_args, dict) and init_args.get("offload") is not None):
        found["offload"] = init_args.get("offload", "cpu") if isinstance(init_args, dict) else "cpu"
    if isinstance(init_args, dict):
        for key in ("device_memory", "headroom", "strategies"):
            if init_args.get(key) is not None:
                found[key] = init_args[key]
        if "strategies" not in found and init_args.get("micro_batch_size") is not None:
            found["strategies"] = ["mgpu_ddp", "mgpu_zero1"]  # as mgpu_auto: the strategies that micro-batch
    return found


def _from_config(path: str) -> tuple[type, dict[str, Any], Optional[Any], Any, Any]:
    config = _read_config(path)
    model_cls, init_args = _class_spec(config["model"], "model")
    data = _class_spec(config["data"], "data") if config.get("data") is not None else None
    strategy = (config.get("trainer") or {}).get("strategy")
    strategy_args = strategy.get("init_args", {}) if isinstance(strategy, dict) else {}
    policy, save = strategy_args.get("activation_checkpointing"), strategy_args.get("activation_checkpointing_save")
    return model_cls, init_args, data, policy, save


def _batch_from_data(data: Any) -> Any:
    try:
        data.setup("fit")
        return next(iter(data.train_dataloader()))
    except Exception as err:
        raise PlanError(
            f"could not draw a sample batch from {type(data).__name__}.train_dataloader() ({type(err).__name__}: "
            f"{err}). Pass one instead: plan(model, batch=...) with tensors (meta tensors work) of one micro-batch."
        ) from None


def _why(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def buildable(
    factory: Callable[[], nn.Module], name: str, batch: Any = None, forward: bool = False, configure: bool = True
) -> tuple[Callable[[], nn.Module], str, Optional[nn.Module]]:
    """A factory of the model made ready as Lightning makes it before training (:func:`ready`): ``factory``'s
    builds under FakeTensorMode when that works, else fake stand-ins of one build on the meta device, else of one
    real build on CPU; with how it builds (``"fake"``, ``"meta"``, ``"cpu"``).

    Some constructors fail under fake tensors though they train fine: ``self.double()``, ``.float()`` or
    ``.to(dtype)`` in ``__init__`` swap tensors in place, which fake tensors refuse, and lazy layers
    (``nn.LazyLinear``) cannot be made or materialized there. The meta device builds those without allocating;
    a real CPU build (memory of one replica) is the last resort. A :class:`PlanError` naming each failure when
    none of the three builds the model; with the build on CPU, where that is the one (else None).
    ``configure=False``: ``configure_model()`` ran already (a module attached
    to a Trainer, whose ``fit`` calls it before the strategy sets up)."""
    from lightning_mgpu._compat import fake_tensor_mode

    def fake_build() -> nn.Module:
        return ready(factory(), batch, forward, "fake", configure)

    fake_build.__qualname__ = getattr(factory, "__qualname__", "build")
    failures = []
    try:
        with fake_tensor_mode(), _quiet():
            fake_build()
        return fake_build, "fake", None
    except PlanError:
        raise
    except Exception as err:
        failures.append(f"under fake tensors: {_why(err)}")
    for device in ("meta", "cpu"):
        try:
            with torch.device(device), _quiet():
                template = ready(factory(), batch, forward, device, configure)
            with fake_tensor_mode(), _quiet():
                stand_in_factory(template)()
            return stand_in_factory(template), device, template if device == "cpu" else None
        except PlanError:
            raise
        except Exception as err:
            failures.append(f"on the {device} device: {_why(err)}")
    raise PlanError(
        f"{name} cannot be built to plan it: {'; '.join(failures)}. Check that the model builds with its default "
        f"arguments (or give them in the config's init_args), or pass an instance: plan(model, batch=...)."
    )


def ready(module: Any, batch: Any, forward: bool, device: str, configure: bool = True) -> nn.Module:
    """``module`` as Lightning makes it before it trains: ``configure_model()`` called (layers made there), and
    lazy layers (``nn.LazyLinear``) materialized by one forward of ``batch`` without gradients (what DDP asks of
    them before it wraps the model), on the build's ``device`` (``"fake"``, ``"meta"``, ``"cpu"``)."""
    from lightning_mgpu._compat import tree_map_tensors
    from lightning_mgpu.planning.trace import _loss

    if not isinstance(module, nn.Module):
        raise PlanError(f"the model built {type(module).__name__}, not an nn.Module.")
    if configure and hasattr(module, "configure_model") and not _is_lightning_default(type(module), "configure_model"):
        module.configure_model()  # type: ignore[operator]
    if lazy_parameters(module) and batch is not None:
        make = torch.zeros if device == "cpu" else torch.empty  # zeros: valid token ids for a real forward
        sample = tree_map_tensors(lambda t: make(tuple(t.shape), dtype=t.dtype), batch)
        with torch.no_grad():
            _loss(module, sample, forward)
    still = lazy_parameters(module)
    if still:
        raise RuntimeError(f"lazy parameters {still[:3]} are not materialized (shapes unknown) on {device}")
    return module


def _quiet() -> Any:
    from lightning_mgpu.planning.trace import _quiet as quiet

    return quiet()


def _is_lightning_default(cls: type, hook: str) -> bool:
    """Whether ``cls.hook`` is Lightning's own (not overridden by the user's class)."""
    fn = getattr(cls, hook, None)
    module = getattr(fn, "__module__", "") or ""
    return fn is None or module.startswith(("pytorch_lightning.", "lightning.pytorch.", "lightning.fabric."))


def _batch_from_module(module: nn.Module) -> tuple[Any, bool]:
    """The sample batch of a LightningModule without a data module, as Lightning finds its data: the first batch
    of its own ``train_dataloader()``, else its ``example_input_array`` (then traced through ``forward``).
    ``(None, False)`` when it has neither."""
    problem = None
    if hasattr(module, "train_dataloader") and not _is_lightning_default(type(module), "train_dataloader"):
        try:
            return next(iter(module.train_dataloader())), False  # type: ignore[operator]
        except Exception as err:
            problem = err
    example = getattr(module, "example_input_array", None)
    if example is not None:
        return example, True
    if problem is not None:
        raise PlanError(
            f"could not draw a sample batch from {type(module).__name__}.train_dataloader() ({_why(problem)}). "
            f"Pass one instead: plan(model, batch=...) with tensors (meta tensors work) of one micro-batch."
        )
    return None, False


def resolve_source(model_or_config: Any, batch: Any = None, datamodule: Any = None) -> PlanSource:
    """Turn what :func:`~lightning_mgpu.planning.plan` was given into a :class:`PlanSource`, before anything runs."""
    policy = save = None
    data_spec = None
    if isinstance(model_or_config, (str, os.PathLike)) and str(model_or_config).endswith((".yaml", ".yml")):
        model_cls, init_args, data_spec, policy, save = _from_config(str(model_or_config))
    elif isinstance(model_or_config, str):
        model_cls, init_args = import_class(model_or_config), {}
    elif isinstance(model_or_config, type):
        model_cls, init_args = model_or_config, {}
    elif isinstance(model_or_config, nn.Module):
        model_cls, init_args = None, {}
    elif callable(model_or_config):
        model_cls, init_args = None, {}
    else:
        raise PlanError(
            f"model_or_config={model_or_config!r}: give a LightningModule/nn.Module (class, instance, zero-argument "
            f"factory or import path) or the path of a `lightning-mgpu fit` YAML config."
        )
    if model_cls is not None and not issubclass(model_cls, nn.Module):
        raise PlanError(f"model class {model_cls.__module__}.{model_cls.__qualname__} is not an nn.Module. {_HOW}")

    factory: Callable[[], nn.Module]
    instance: Optional[nn.Module] = None
    if model_cls is not None:
        cls, kwargs = model_cls, init_args

        def factory() -> nn.Module:
            return cls(**kwargs)

        name = f"{cls.__module__}.{cls.__qualname__}"
    elif isinstance(model_or_config, nn.Module):
        instance = model_or_config
        factory, name = stand_in_factory(model_or_config), type(model_or_config).__qualname__
    else:
        factory, name = model_or_config, getattr(model_or_config, "__qualname__", repr(model_or_config))
    forward = False
    if batch is None:
        if datamodule is None and data_spec is not None:
            data_cls, data_args = data_spec
            datamodule = data_cls(**data_args)
        if datamodule is not None:
            batch = _batch_from_data(datamodule)
        else:
            if instance is None:  # the module's own data hooks, on a build that allocates nothing (meta)
                instance = _data_instance(factory)
            if instance is not None:
                batch, forward = _batch_from_module(instance)
        if batch is None:
            raise PlanError(
                f"no sample batch for {name}: it has no data module, no train_dataloader() of its own and no "
                f"example_input_array. Pass batch=... (tensors of one micro-batch per device; meta tensors work), "
                f"datamodule=..., or a config with a 'data' section."
            )
    configured = instance is not None and attached_trainer(instance) is not None  # Lightning called configure_model
    factory, how_built, real = buildable(factory, name, batch, forward, configure=not configured)
    if real is None and isinstance(model_or_config, nn.Module) and (configured or not _configures(model_or_config)):
        real = model_or_config  # as it trains: no configure_model of its own still to make layers
    return PlanSource(
        factory=factory,
        batch=batch,
        name=name,
        policy=policy,
        save=save,
        forward=forward,
        how_built=how_built,
        real=real,
    )


def _configures(module: nn.Module) -> bool:
    """Whether ``module`` has a ``configure_model`` of its own (which may make layers the instance lacks yet)."""
    return hasattr(module, "configure_model") and not _is_lightning_default(type(module), "configure_model")


def _data_instance(factory: Callable[[], nn.Module]) -> Optional[nn.Module]:
    """A module to call the data hooks of, allocating nothing: built on the meta device (the data its hooks make
    stays on CPU: they run outside the device context), else a fake build. None if neither builds."""
    from lightning_mgpu._compat import fake_tensor_mode

    for context in (lambda: torch.device("meta"), fake_tensor_mode):
        try:
            with context(), _quiet():
                return factory()
        except Exception:
            continue
    return None


def default_policy(factory: Callable[[], nn.Module]) -> Optional[Union[set[type[nn.Module]], Any]]:
    """Checkpoint the transformer layers when there are any, else every block of the outermost containers
    (``EveryNth(1)``); None (no "with activation checkpointing" candidates) when the model has neither, e.g.
    layers kept as plain attributes (``self.fc1``, ``self.fc2``)."""
    from lightning_mgpu._compat import fake_tensor_mode
    from lightning_mgpu.parts.activation_checkpointing import EveryNth, select_modules

    layers = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
    with fake_tensor_mode(), _quiet():
        module = factory()
        present = {type(m) for m in module.modules() if isinstance(m, layers)}
        if present:
            return present
        try:
            select_modules(module, EveryNth(1))
        except ValueError:
            return None
    return EveryNth(1)
