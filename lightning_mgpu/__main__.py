"""``python -m lightning_mgpu`` (and the ``lightning-mgpu`` console script): see :mod:`lightning_mgpu.cli`."""

from __future__ import annotations

import sys

from lightning_mgpu.cli import main

if __name__ == "__main__":
    sys.exit(main())
