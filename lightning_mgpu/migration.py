"""Trainer arguments that Lightning 1.x took and 2.x dropped, and what to write now.

``Trainer(gpus=2)`` fails in Lightning 2 with Python's bare "unexpected keyword argument 'gpus'". Importing the
pack makes the Trainer of each namespace raise :class:`RemovedTrainerArgument` instead, naming the replacement;
every call Lightning accepts is passed through untouched (the wrapper only reads the keyword names). The
LightningCLI hint (``--trainer.gpus 2``) reads the same table.

Example::

    import lightning_mgpu
    import pytorch_lightning as pl

    pl.Trainer(gpus=2)
    # RemovedTrainerArgument: Trainer(gpus=2) was removed in Lightning 2.0: write
    # Trainer(accelerator='gpu', devices=2). ...
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytorch_lightning as pl

__all__ = ["REMOVED_TRAINER_ARGUMENTS", "RemovedTrainerArgument", "guard_trainer", "removed_argument_message"]

#: argument -> what to write instead (``{value}`` is the value the user passed)
REMOVED_TRAINER_ARGUMENTS: dict[str, str] = {
    "gpus": "Trainer(accelerator='gpu', devices={value}) (and strategy='mgpu_ddp' for several GPUs)",
    "tpu_cores": "Trainer(accelerator='tpu', devices={value})",
    "num_processes": "Trainer(accelerator='cpu', devices={value}, strategy='mgpu_ddp')",
    "auto_select_gpus": "Trainer(accelerator='gpu', devices=lightning_fabric.accelerators.find_usable_cuda_devices(N))",
    "resume_from_checkpoint": "trainer.fit(model, ckpt_path={value})",
    "replace_sampler_ddp": "Trainer(use_distributed_sampler={value})",
    "checkpoint_callback": "Trainer(enable_checkpointing={value})",
    "amp_backend": "Trainer(precision='16-mixed') (torch's native AMP is the only backend)",
    "amp_level": "Trainer(precision='16-mixed') (torch's native AMP is the only backend)",
    "auto_lr_find": "callbacks=[LearningRateFinder()] (or Tuner(trainer).lr_find(model))",
    "auto_scale_batch_size": "callbacks=[BatchSizeFinder()] (or Tuner(trainer).scale_batch_size(model))",
    "track_grad_norm": "self.log_dict(grad_norm(self, norm_type=2)) in on_before_optimizer_step "
    "(from pytorch_lightning.utilities import grad_norm)",
    "stochastic_weight_avg": "callbacks=[StochasticWeightAveraging(swa_lrs=...)]",
    "weights_summary": "Trainer(enable_model_summary=...) or callbacks=[ModelSummary(max_depth=...)]",
    "progress_bar_refresh_rate": "callbacks=[TQDMProgressBar(refresh_rate={value})]",
    "terminate_on_nan": "Trainer(detect_anomaly=True), or MGPUPrecision's non-finite checks",
    "move_metrics_to_cpu": "nothing: metrics are moved when they are logged",
}


class RemovedTrainerArgument(TypeError, ValueError):
    """A Lightning 1.x ``Trainer`` argument: a ``TypeError`` (what Python raises for an unknown keyword) and a
    ``ValueError`` (what the pack raises for a dropped name), with the replacement in the message.

    ``import lightning_mgpu`` makes Lightning's ``Trainer`` raise it (all dropped arguments at once, before
    anything starts).

    Example:

        >>> import lightning_mgpu
        >>> from pytorch_lightning import Trainer
        >>> try:
        ...     Trainer(gpus=2)
        ... except lightning_mgpu.RemovedTrainerArgument as err:
        ...     print(err)
        Trainer(gpus=2) was removed in Lightning 2.0: write Trainer(accelerator='gpu', devices=2) (and
        strategy='mgpu_ddp' for several GPUs).
    """


def removed_argument_message(name: str, value: Any = "...") -> str:
    """What to write instead of the Lightning 1.x Trainer argument ``name`` (KeyError if it is not one)."""
    replacement = REMOVED_TRAINER_ARGUMENTS[name].format(value=repr(value) if value != "..." else value)
    return f"Trainer({name}={value!r}) was removed in Lightning 2.0: write {replacement}."


def guard_trainer(trainer_class: type = pl.Trainer) -> type:
    """Make ``trainer_class(...)`` raise :class:`RemovedTrainerArgument` for Lightning 1.x arguments (all of
    them at once, with a dropped accelerator name too), and :class:`~lightning_mgpu.presets.UnknownPreset` for a
    misspelt preset name (``strategy="mgpu_pipline"``); idempotent. Returns the class."""
    init: Callable[..., None] = vars(trainer_class)["__init__"]
    if getattr(init, "_mgpu_guard", False):
        return trainer_class

    @functools.wraps(init)  # keeps the signature (``__wrapped__``) that LightningCLI reads
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        removed = [name for name in kwargs if name in REMOVED_TRAINER_ARGUMENTS]
        if removed:
            from lightning_mgpu.presets import renamed

            lines = [removed_argument_message(name, kwargs[name]) for name in removed]
            accelerator = kwargs.get("accelerator")
            old = renamed("accelerator", accelerator) if isinstance(accelerator, str) else None
            if old is not None:
                lines.append(old.message)
            raise RemovedTrainerArgument(" ".join(lines))
        if isinstance(kwargs.get("strategy"), str):  # a misspelt preset names the closest presets
            from lightning_mgpu.presets import check_strategy_name

            check_strategy_name(kwargs["strategy"])
        init(self, *args, **kwargs)

    __init__._mgpu_guard = True  # type: ignore[attr-defined]
    setattr(trainer_class, "__init__", __init__)  # noqa: B010 (a class attribute: mypy refuses the assignment)
    return trainer_class
