"""Sample LightningModules and data that ship with the package (no download at run time)."""

from lightning_mgpu.examples.classifier import DigitsCNN
from lightning_mgpu.examples.digits import DigitsDataModule, load_digits

__all__ = ["DigitsCNN", "DigitsDataModule", "load_digits"]
