"""``lightning-mgpu plan``: the memory plan of a ``fit`` config, before anything is launched.

lightning-mgpu plan --config configs/transformer.yaml --devices 8 --device-memory 80GiB
lightning-mgpu plan --config configs/transformer.yaml --devices 8 --device-memory 80GiB --json
lightning-mgpu plan --config configs/transformer.yaml --devices 16 --num-nodes 2 --device-memory 80GiB
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from lightning_mgpu.planning.request import PRECISIONS, STRATEGIES, PlanError

__all__ = ["main"]


def main(argv: Optional[list[str]] = None) -> int:
    """Print the plan (markdown table, or ``--json`` rows); exit 2 with the reason on bad input or no fit."""
    from lightning_mgpu.planning import NoPlanFits, plan

    parser = argparse.ArgumentParser(prog="lightning-mgpu plan", description=__doc__.split("\n")[0])
    parser.add_argument("--config", "-c", required=True, help="a `lightning-mgpu fit` YAML config (model and data)")
    parser.add_argument("--devices", type=int, required=True, help="ranks (data-parallel world size)")
    parser.add_argument("--device-memory", required=True, help="per device, e.g. 80GiB or 40GB")
    parser.add_argument("--headroom", type=float, default=0.10, help="fraction kept free (default 0.10)")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, help="default: 32-true bf16-mixed bf16-master")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, help="default: all (mgpu_hsdp: --num-nodes > 1)")
    parser.add_argument(
        "--num-nodes", type=int, default=1, help="machines the --devices ranks are spread over (default 1)"
    )
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size (default 25)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    try:
        result = plan(
            args.config,
            devices=args.devices,
            device_memory=args.device_memory,
            headroom=args.headroom,
            precisions=tuple(args.precisions) if args.precisions else None,
            strategies=tuple(args.strategies) if args.strategies else None,
            bucket_cap_mb=args.bucket_cap_mb,
            num_nodes=args.num_nodes,
        )
    except NoPlanFits as err:
        print(err.plan.to_json() if args.json else err.plan.table(), file=sys.stderr)
        parser.exit(2, f"lightning-mgpu plan: error: {err}\n")
    except PlanError as err:
        parser.exit(2, f"lightning-mgpu plan: error: {err}\n")
    print(result.to_json() if args.json else result.table())
    return 0
