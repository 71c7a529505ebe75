"""``lightning-mgpu plan``: the memory plan of a ``fit`` config, before anything is launched.

lightning-mgpu plan --config configs/transformer.yaml --devices 8 --device-memory 80GiB
lightning-mgpu plan --config configs/transformer.yaml --devices 8 --device-memory 80GiB --json
lightning-mgpu plan --config configs/transformer.yaml --devices 16 --num-nodes 2 --device-memory 80GiB
lightning-mgpu plan --config configs/auto.yaml     # devices, nodes, precision and device memory from the config
lightning-mgpu plan --config lm.yaml --devices 64 --num-nodes 8 --device-memory 80GiB --inter-node-link ethernet

One recommendation comes first, with the ``Trainer(...)`` line that builds it and the alternatives and why each
lost; then the memory plan of the data-parallel candidates and the layouts (data replicate x data shard x tensor x
pipeline) that fit, the recommended first (``--layouts --json``: every layout as JSON, the recommended marked).

``--devices``, ``--num-nodes`` and ``--precisions`` default to the config's ``trainer.devices`` (times
``trainer.num_nodes``: the world), ``trainer.num_nodes`` and ``trainer.precision``; ``--device-memory`` and
``--headroom`` and ``--strategies`` to an ``mgpu_auto`` strategy's ``init_args``; ``--offload`` to the config
strategy's ``offload`` (no flag turns a config's offload off). A flag overrides the config.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, Union

from lightning_mgpu.planning.layouts import DEFAULT_DEVICE_TFLOPS
from lightning_mgpu.planning.request import DEFAULT_PRECISIONS, LINK_SPEEDS, PRECISIONS, STRATEGIES, PlanError

__all__ = ["main"]


def main(argv: Optional[list[str]] = None) -> int:
    """Print the plan (markdown table, or ``--json`` rows); exit 2 with the reason on bad input or no fit."""
    from lightning_mgpu.planning import NoPlanFits, plan_layouts
    from lightning_mgpu.planning.choice import choose, no_layout_fits, report

    parser = argparse.ArgumentParser(prog="lightning-mgpu plan", description=__doc__.split("\n")[0])
    parser.add_argument("--config", "-c", required=True, help="a `lightning-mgpu fit` YAML config (model and data)")
    parser.add_argument(
        "--devices", type=int, help="ranks in all (data-parallel world size); default: the config's devices x num_nodes"
    )
    parser.add_argument("--device-memory", help="per device, e.g. 80GiB or 40GB; default: mgpu_auto's device_memory")
    parser.add_argument("--headroom", type=float, help="fraction kept free (default: the config's, else 0.10)")
    parser.add_argument(
        "--precisions",
        nargs="+",
        choices=PRECISIONS,
        help="default: the config's precision, else 32-true bf16-mixed bf16-master",
    )
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, help="default: all (mgpu_hsdp: --num-nodes > 1)")
    parser.add_argument(
        "--num-nodes", type=int, help="machines the --devices ranks are spread over (default: the config's, else 1)"
    )
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size (default 25)")
    parser.add_argument(
        "--offload",
        action="store_true",
        help="plan the sharded candidates with offload='cpu' (default: the config strategy's offload)",
    )
    parser.add_argument("--host-memory", help="one machine's host memory, e.g. 512GiB, checked when offloaded")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--layouts", action="store_true", help="with --json: print the layouts instead of the rows")
    parser.add_argument("--top", type=int, default=20, help="layouts shown in the table (default 20)")
    links = ", ".join(LINK_SPEEDS)
    parser.add_argument(
        "--intra-node-link", default="nvlink", help=f"{links}, or GB/s per device each way (default nvlink)"
    )
    parser.add_argument(
        "--inter-node-link", default="infiniband", help=f"{links}, or GB/s per device each way (default infiniband)"
    )
    parser.add_argument(
        "--device-tflops",
        type=float,
        default=DEFAULT_DEVICE_TFLOPS,
        help=f"the rate one device sustains, TFLOP/s (default {DEFAULT_DEVICE_TFLOPS:g}, an assumption)",
    )
    parser.add_argument("--pipeline-microbatches", type=int, help="micro-batches per batch (default: the batch size)")
    parser.add_argument(
        "--tensor-across-machines", action="store_true", help="allow tensor groups wider than one machine"
    )
    args = parser.parse_args(argv)
    config: dict[str, Any] = {}
    try:
        from lightning_mgpu.planning.source import config_trainer

        config = config_trainer(args.config)
        num_nodes = args.num_nodes if args.num_nodes is not None else config.get("num_nodes", 1)
        devices = args.devices
        if devices is None and "devices" in config:
            devices = config["devices"] * num_nodes  # Lightning's devices are per machine
        memory = args.device_memory if args.device_memory is not None else config.get("device_memory")
        keys = {"--devices": "trainer.devices", "--device-memory": "device_memory in an mgpu_auto strategy's init_args"}
        missing = [flag for flag, value in (("--devices", devices), ("--device-memory", memory)) if value is None]
        if missing:
            raise PlanError(
                f"{' and '.join(missing)} not given, and --config {args.config!r} has no "
                f"{' or '.join(keys[m] for m in missing)}: pass {' '.join(m + ' ...' for m in missing)}, e.g. "
                f"--devices 8 --device-memory 80GiB."
            )
        assert devices is not None and memory is not None
        precision = config.get("precision")
        precisions = tuple(args.precisions) if args.precisions else (precision,) if precision else DEFAULT_PRECISIONS
        offload = bool(args.offload or config.get("offload"))
        if args.host_memory is not None and not offload:
            raise PlanError(
                f"--host-memory {args.host_memory} is checked against what offload keeps in host memory, and this plan "
                f"does not offload: add --offload (or a config strategy with offload: cpu), or leave --host-memory out."
            )
        layouts = plan_layouts(
            args.config,
            devices=devices,
            device_memory=memory,
            headroom=args.headroom if args.headroom is not None else config.get("headroom", 0.10),
            precisions=precisions,
            strategies=tuple(args.strategies or config.get("strategies") or ()) or None,
            bucket_cap_mb=args.bucket_cap_mb,
            num_nodes=num_nodes,
            intra_node_link=_link(args.intra_node_link),
            inter_node_link=_link(args.inter_node_link),
            device_tflops=args.device_tflops,
            pipeline_microbatches=args.pipeline_microbatches,
            tensor_across_machines=args.tensor_across_machines,
            offload=offload,
            host_memory=args.host_memory,
        )
        result = layouts.memory
        assert result is not None
        if args.json and not args.layouts:
            if result.recommended is None:  # the rows' JSON marks a data-parallel recommendation only
                choose(layouts)  # raises where nothing buildable fits
                raise no_layout_fits(result, [])
            text = result.to_json()
        else:
            text = layouts.to_json() if args.json else report(layouts, args.top)
    except NoPlanFits as err:
        print(err.plan.to_json() if args.json else err.plan.table(), file=sys.stderr)
        parser.exit(2, f"lightning-mgpu plan: error: {err}\n")
    except PlanError as err:
        parser.exit(2, f"lightning-mgpu plan: error: {err}\n")
    print(text)
    return 0


def _link(value: str) -> Union[str, float]:
    """A link name, or a number of GB/s."""
    try:
        return float(value)
    except ValueError:
        return value
