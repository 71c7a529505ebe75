"""Lightning's launchers with one addition: a check of the Trainer and the module in the main process,
before any worker process is started (``Trainer.fit`` sets the module on the strategy just before it
launches). Subclasses, so Lightning's ``isinstance`` checks on launchers still hold."""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from pytorch_lightning.strategies.launchers.multiprocessing import _WorkerOutput

from lightning_mgpu.precision import MGPUPrecision

PreLaunchCheck = Callable[["pl.Trainer"], None]


class _PreLaunchCheck:
    """Put first in the bases of a Lightning launcher; takes the check as its first argument."""

    def __init__(self, check: PreLaunchCheck, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._check = check

    def launch(self, function: Callable, *args: Any, trainer: Optional[pl.Trainer] = None, **kwargs: Any) -> Any:
        if trainer is not None:
            self._check(trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


class _CheckedSubprocessScriptLauncher(_PreLaunchCheck, _SubprocessScriptLauncher):
    pass


class _CheckedMultiProcessingLauncher(_PreLaunchCheck, _MultiProcessingLauncher):
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        # The worker process ends right after this: leave the process group together first.
        release_process_group()

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Optional[_WorkerOutput]:
        output = super()._collect_rank_zero_results(trainer, results)
        plugin = trainer.precision_plugin
        if (
            output is not None
            and output.weights_path is not None
            and isinstance(plugin, MGPUPrecision)
            and plugin.holds_masters
        ):
            # the main process's model gets the FP32 masters, not their half rounding (written again: only then)
            module = trainer.lightning_module
            self._strategy.checkpoint_io.save_checkpoint(
                plugin.fp32_state_dict(module, module.state_dict()), output.weights_path
            )
        return output


def release_process_group() -> None:
    """Every rank leaves the process group together. Left to interpreter exit, the group's C++ threads were
    sometimes destroyed while still running ("terminate called without an active exception", SIGABRT, seen
    intermittently here on spawn workers and on the popen rank 0)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
