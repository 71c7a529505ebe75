"""Sample LightningModules and data that ship with the package (no download at run time)."""

from lightning_mgpu.examples.classifier import DigitsClassifier, DigitsCNN
from lightning_mgpu.examples.digits import DigitsDataModule, load_digits
from lightning_mgpu.examples.gan import DigitsGAN
from lightning_mgpu.examples.transformer import ConvBlock, DigitsTransformer

__all__ = [
    "ConvBlock",
    "DigitsCNN",
    "DigitsClassifier",
    "DigitsDataModule",
    "DigitsGAN",
    "DigitsTransformer",
    "load_digits",
]
