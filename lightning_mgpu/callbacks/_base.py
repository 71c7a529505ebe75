"""What every callback of the pack shares: a clear error when it is given to the Trainer of the other Lightning
namespace (Lightning accepts any object with hook methods as a callback, so a mix-up would otherwise half work)."""

from __future__ import annotations

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback
from typing_extensions import override


class MGPUCallback(Callback):
    """Base of the pack's callbacks: refuses, at ``setup``, a Trainer of the other Lightning namespace."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(trainer, pl.Trainer):
            ours, theirs = pl.Trainer.__module__.split(".")[0], type(trainer).__module__.split(".")[0]
            package = type(self).__module__.split(".callbacks")[0]
            other = "lightning_mgpu.lightning" if package == "lightning_mgpu" else "lightning_mgpu"
            raise TypeError(
                f"{package}.{type(self).__name__} serves `{ours}`, but this Trainer is `{theirs}`'s. Use "
                f"{other}.{type(self).__name__}: `lightning_mgpu.X` serves `import pytorch_lightning`, "
                f"`lightning_mgpu.lightning.X` serves `import lightning`."
            )
        super().setup(trainer, pl_module, stage)
