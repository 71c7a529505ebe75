"""What to plan: a model (class, class path, factory or instance) or a ``lightning-mgpu fit`` config, and a batch."""

from __future__ import annotations

import copy
import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from lightning_mgpu.planning.request import PlanError

__all__ = ["PlanSource", "import_class", "resolve_source"]

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


def _class_spec(spec: Any, what: str) -> tuple[type, dict[str, Any]]:
    if isinstance(spec, str):
        return import_class(spec, what), {}
    if isinstance(spec, dict) and isinstance(spec.get("class_path"), str):
        return import_class(spec["class_path"], what), dict(spec.get("init_args") or {})
    raise PlanError(f"config key {what!r} is {spec!r}: write {what}: {{class_path: package.Class, init_args: {{}}}}.")


def _from_config(path: str) -> tuple[type, dict[str, Any], Optional[Any], Any]:
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
    model_cls, init_args = _class_spec(config["model"], "model")
    data = _class_spec(config["data"], "data") if config.get("data") is not None else None
    strategy = (config.get("trainer") or {}).get("strategy")
    policy = strategy.get("init_args", {}).get("activation_checkpointing") if isinstance(strategy, dict) else None
    return model_cls, init_args, data, policy


def _batch_from_data(data: Any) -> Any:
    try:
        data.setup("fit")
        return next(iter(data.train_dataloader()))
    except Exception as err:
        raise PlanError(
            f"could not draw a sample batch from {type(data).__name__}.train_dataloader() ({type(err).__name__}: "
            f"{err}). Pass one instead: plan(model, batch=...) with tensors (meta tensors work) of one micro-batch."
        ) from None


def _fake_copy_factory(module: nn.Module) -> Callable[[], nn.Module]:
    """A factory of copies of ``module`` whose parameters and buffers are fake (nothing copied, nothing allocated):
    ``deepcopy`` with each tensor pre-mapped to an empty tensor of its shape, made inside the caller's fake mode."""

    def build() -> nn.Module:
        memo: dict[int, Any] = {}
        for p in module.parameters():
            memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
        for b in module.buffers():
            memo[id(b)] = torch.empty(b.shape, dtype=b.dtype)
        return copy.deepcopy(module, memo)

    return build


def resolve_source(model_or_config: Any, batch: Any = None, datamodule: Any = None) -> PlanSource:
    """Turn what :func:`~lightning_mgpu.planning.plan` was given into a :class:`PlanSource`, before anything runs."""
    policy = None
    data_spec = None
    if isinstance(model_or_config, (str, os.PathLike)) and str(model_or_config).endswith((".yaml", ".yml")):
        model_cls, init_args, data_spec, policy = _from_config(str(model_or_config))
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
    if model_cls is not None:
        cls, kwargs = model_cls, init_args

        def factory() -> nn.Module:
            return cls(**kwargs)

        name = f"{cls.__module__}.{cls.__qualname__}"
    elif isinstance(model_or_config, nn.Module):
        factory, name = _fake_copy_factory(model_or_config), type(model_or_config).__qualname__
    else:
        factory, name = model_or_config, getattr(model_or_config, "__qualname__", repr(model_or_config))

    if batch is None:
        if datamodule is None and data_spec is not None:
            data_cls, data_args = data_spec
            datamodule = data_cls(**data_args)
        if datamodule is None:
            raise PlanError(
                f"no sample batch for {name}: pass batch=... (tensors of one micro-batch per device; meta tensors "
                f"work), datamodule=..., or a config with a 'data' section."
            )
        batch = _batch_from_data(datamodule)
    return PlanSource(factory=factory, batch=batch, name=name, policy=policy)


def default_policy(factory: Callable[[], nn.Module]) -> Union[set[type[nn.Module]], Any]:
    """Checkpoint the transformer layers when there are any, else every block of the outermost containers."""
    from lightning_mgpu._compat import fake_tensor_mode
    from lightning_mgpu.parts.activation_checkpointing import EveryNth

    layers = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
    with fake_tensor_mode():
        module = factory()
        present = {type(m) for m in module.modules() if isinstance(m, layers)}
    return present if present else EveryNth(1)
