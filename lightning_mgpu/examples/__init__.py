"""Sample LightningModules and data that ship with the package (no download at run time)."""

from lightning_mgpu.examples.classifier import DigitsCNN
from lightning_mgpu.examples.digits import DigitsDataModule, load_digits
from lightning_mgpu.examples.gan import DigitsGAN

__all__ = ["DigitsCNN", "DigitsDataModule", "DigitsGAN", "load_digits"]
