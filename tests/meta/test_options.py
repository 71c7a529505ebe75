"""Each strategy option is declared once: a field of a settings dataclass, with its docstring (``settings.py``).

The constructor signatures LightningCLI reads (``__init__``) are checked against those fields here, in one place:
every keyword is a field of the strategy's settings with the same type and default, every field is a keyword, a
value given reaches the settings, and the ``Args:`` help of each keyword is its field's docstring."""

from __future__ import annotations

import inspect
from dataclasses import MISSING, fields
from datetime import timedelta
from typing import Any

import docstring_parser
import pytest
from torch import nn

from lightning_mgpu import (
    FaultTolerance,
    MGPUAutoStrategy,
    MGPUDDPStrategy,
    MGPUDiLoCoStrategy,
    MGPULocalSGDStrategy,
    MGPUShardedStrategy,
)
from lightning_mgpu.settings import (
    LIGHTNING_KEYWORDS,
    AutoSettings,
    CommonSettings,
    DDPSettings,
    DiLoCoSettings,
    LocalSGDSettings,
    ShardedSettings,
    option_doc,
)

# the settings each strategy builds, in the order their fields document its keywords
SETTINGS: dict[type, tuple[type, ...]] = {
    MGPUDDPStrategy: (DDPSettings,),
    MGPUShardedStrategy: (ShardedSettings, DDPSettings),
    MGPULocalSGDStrategy: (LocalSGDSettings, CommonSettings),
    MGPUDiLoCoStrategy: (DiLoCoSettings, CommonSettings),
    MGPUAutoStrategy: (AutoSettings, CommonSettings),
}
# fields a strategy takes through ``**kwargs`` only (handed to MGPUDDPStrategy), not as named keywords
NOT_NAMED = {
    MGPULocalSGDStrategy: {
        "fault_tolerance",
        "loss_normalization",
        "nonfinite",
        "micro_batch_size",
        "async_checkpoint",
        "checkpoint_params",
    },
    MGPUDiLoCoStrategy: {
        "fault_tolerance",
        "loss_normalization",
        "nonfinite",
        "micro_batch_size",
        "async_checkpoint",
        "checkpoint_params",
    },
    # fault tolerance: mgpu_auto chooses among layouts without it (refused as a keyword it does not take)
    MGPUAutoStrategy: {"activation_checkpointing_reentrant", "activation_checkpointing_save", "fault_tolerance"},
}
# a valid value other than the default, per option, and what it needs beside it (where the strategy has that keyword)
GIVEN: dict[str, Any] = {
    "start_method": "fork",
    "process_group_backend": "gloo",
    "timeout": timedelta(minutes=5),
    "log_comm_stats": False,
    "activation_checkpointing": "Linear",
    "activation_checkpointing_reentrant": True,
    "activation_checkpointing_save": "matmuls",
    "loss_normalization": "tokens",
    "nonfinite": "error",
    "micro_batch_size": 4,
    "async_checkpoint": True,
    "checkpoint_params": "trainable",
    "compile": {"mode": "default"},
    "exact_evaluation": False,
    "check_uneven_inputs": False,
    "comm_hook": "powersgd",
    "comm_state": {"matrix_approximation_rank": 2},
    "static_graph": True,
    "find_unused_parameters": True,
    "gradient_as_bucket_view": False,
    "fault_tolerance": FaultTolerance(lighthouse="http://localhost:29510", replica_group=0, replica_groups=2),
    "stage": 3,
    "backend": "torch",
    "checkpoint": "sharded",
    "wrap_modules": (nn.Linear,),
    "mesh": "hybrid",
    "shard_size": 2,
    "tensor_parallel_size": 2,
    "tensor_parallel_plan": {"layers.*.w1": "colwise", "layers.*.w2": "rowwise"},
    "tensor_comm_stats": True,
    "pipeline_parallel_size": 2,
    "pipeline_schedule": "gpipe",
    "pipeline_microbatches": 4,
    "pipeline_split": ("blocks.2",),
    "offload": "cpu",
    "sync_every": 3,
    "warmup_steps": 2,
    "comm_dtype": "bf16",
    "outer_lr": 0.5,
    "outer_momentum": 0.5,
    "nesterov": False,
    "device_memory": "8GiB",
    "headroom": 0.2,
    "strategies": ("mgpu_ddp",),
}
NEEDS: dict[str, dict[str, Any]] = {
    "comm_hook": {"stage": 1},
    "comm_state": {"stage": 1, "comm_hook": "powersgd"},
    "static_graph": {"stage": 1},
    "find_unused_parameters": {"stage": 1},
    "gradient_as_bucket_view": {"stage": 1},
    "micro_batch_size": {"stage": 1},
    "shard_size": {"mesh": "hybrid", "stage": 3},
    "mesh": {"stage": 3},
    "tensor_parallel_size": {"stage": 3},
    "tensor_parallel_plan": {"stage": 3, "tensor_parallel_size": 2},
    "tensor_comm_stats": {"stage": 3},
    "offload": {"stage": 3},
    "fault_tolerance": {"stage": 3},
}


def _keywords(cls: type) -> dict[str, inspect.Parameter]:
    return {
        name: p
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if name != "self" and name not in LIGHTNING_KEYWORDS and p.kind is not inspect.Parameter.VAR_KEYWORD
    }


def _fields(cls: type) -> dict[str, Any]:
    """Option -> its field, from the first settings class that declares it."""
    found: dict[str, Any] = {}
    for settings in SETTINGS[cls]:
        for f in fields(settings):
            if f.name != "ddp_kwargs" and f.name not in NOT_NAMED.get(cls, ()):
                found.setdefault(f.name, f)
    return found


def _settings_objects(strategy: Any) -> list[Any]:
    objects = [strategy.launch_settings, getattr(strategy, "settings", None)]
    objects += [getattr(strategy, "periodic_settings", None), getattr(strategy, "_auto", {}).get("settings")]
    return [o for o in objects if o is not None]


@pytest.mark.parametrize("cls", list(SETTINGS), ids=lambda c: c.__name__)
def test_each_keyword_is_a_settings_field_with_its_type_default_and_help_and_reaches_it(cls):
    keywords, options = _keywords(cls), _fields(cls)
    assert sorted(keywords) == sorted(options)  # every keyword is a field, every field a keyword
    documented = {p.arg_name: p.description for p in docstring_parser.parse(inspect.getdoc(cls) or "").params}
    for name, parameter in keywords.items():
        option = options[name]
        default = option.default if option.default is not MISSING else option.default_factory()
        assert parameter.default == default, (name, parameter.default, default)
        assert str(parameter.annotation).replace(" ", "") == str(option.type).replace(" ", ""), name
        doc = option_doc(name, SETTINGS[cls])
        assert doc and " ".join((documented.get(name) or "").split()) == " ".join(doc.split()), name
        given = {k: v for k, v in NEEDS.get(name, {}).items() if k in keywords}
        strategy = cls(**given, **{name: GIVEN[name]})
        values = [getattr(o, name) for o in _settings_objects(strategy) if hasattr(o, name)]
        assert GIVEN[name] in values, (name, values)


def test_the_check_sees_a_keyword_that_is_not_a_field():
    """Negative control: a strategy with a keyword of its own, not declared in its settings."""

    class Extra(MGPUDDPStrategy):
        def __init__(self, surprise: int = 1, **kwargs: Any) -> None:
            super().__init__(**kwargs)

    SETTINGS[Extra] = SETTINGS[MGPUDDPStrategy]
    try:
        assert "surprise" in _keywords(Extra) and "surprise" not in _fields(Extra)
    finally:
        del SETTINGS[Extra]
