"""Lightning's launchers with one addition: a check of the Trainer and the module in the main process,
before any worker process is started (``Trainer.fit`` sets the module on the strategy just before it
launches). Subclasses, so Lightning's ``isinstance`` checks on launchers still hold."""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytorch_lightning as pl
from pytorch_lightning.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

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
    pass
