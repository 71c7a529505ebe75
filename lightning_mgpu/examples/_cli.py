"""The samples' shared LightningCLI entry point: ``fit`` on the digits, then ``test`` and a summary."""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytorch_lightning as pl


def fit_then_test(
    model_class: type[pl.LightningModule],
    args: Optional[list[str]],
    report: Callable[[pl.Trainer, dict[str, float]], None],
) -> None:
    """``LightningCLI`` over ``model_class`` and :class:`DigitsDataModule`; after ``fit`` the held-out split
    is tested and ``report(trainer, test_result)`` prints on rank 0. Every rank leaves the process group."""
    from lightning_mgpu.cli import MGPUCLI
    from lightning_mgpu.examples.digits import DigitsDataModule
    from lightning_mgpu.strategies.launchers import release_process_group

    # subclass mode: the configs name their classes (class_path), so the general `lightning-mgpu fit` runs them too
    cli: Any = MGPUCLI(
        model_class,
        DigitsDataModule,
        args=args,
        seed_everything_default=0,
        subclass_mode_model=True,
        subclass_mode_data=True,
    )
    if cli.subcommand == "fit":
        (result,) = cli.trainer.test(cli.model, cli.datamodule, verbose=False)
        if cli.trainer.is_global_zero:
            report(cli.trainer, result)
    release_process_group()
