"""``python -m lightning_mgpu --list`` (and the ``lightning-mgpu`` console script)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    import lightning_mgpu

    parser = argparse.ArgumentParser(prog="lightning-mgpu", description=lightning_mgpu.__doc__)
    parser.add_argument("--list", action="store_true", help="print the registered strategy presets")
    parser.add_argument("--version", action="version", version=lightning_mgpu.__version__)
    args = parser.parse_args(argv)
    if args.list:
        print(lightning_mgpu.preset_table())
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
