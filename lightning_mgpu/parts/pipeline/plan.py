"""The stage plan of pipeline parallelism: which blocks of the model each stage trains (the container of the blocks
found, or named by ``pipeline_split``, the blocks balanced by their parameters), and the checks before launch that the
model, the split and the precision can be pipelined (``parts/pipeline/__init__.py`` says how the pipeline runs)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

#: what the container of the blocks must look like, for the errors
SHAPE_NEEDED = (
    "the blocks as the children of one nn.Sequential or nn.ModuleList that forward calls in order, each once, each "
    "block's output (or its first element) handed to the next block as its first argument: `self.blocks = "
    "nn.ModuleList([...])` and `for block in self.blocks: x = block(x)` (or `x = block(x)[0]`)"
)


class PipelineError(ValueError):
    """A model or batch the pipeline cannot split, with the shape it needs."""


@dataclass(frozen=True)
class StagePlan:
    """Where the stages begin: ``container`` (a module name, ``""`` for the LightningModule itself) holds the
    blocks ``names``; stage ``s`` trains ``names[bounds[s][0]:bounds[s][1]]``."""

    container: str
    names: tuple[str, ...]
    bounds: tuple[tuple[int, int], ...]

    @property
    def stages(self) -> int:
        return len(self.bounds)

    def begins(self) -> list[str]:
        """The module names where stages 1, 2, ... begin (``pipeline_split`` that gives this plan)."""
        return [self.names[start] for start, _ in self.bounds[1:]]


def _containers(module: nn.Module) -> dict[str, Any]:
    return {name: m for name, m in module.named_modules() if isinstance(m, (nn.Sequential, nn.ModuleList))}


def _full(prefix: str, child: str) -> str:
    return f"{prefix}.{child}" if prefix else child


def balanced_bounds(costs: Sequence[int], stages: int) -> tuple[tuple[int, int], ...]:
    """Consecutive ranges of ``costs`` (one per block), ``stages`` of them, each non-empty, whose largest sum is the
    smallest possible.

    >>> balanced_bounds([1, 1, 1, 1, 4], 2)
    ((0, 4), (4, 5))
    """
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the smallest largest-stage cost of the first i blocks in s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds = []
    end = n
    for s in range(stages, 0, -1):
        start = cut[s][end]
        bounds.append((start, end))
        end = start
    return tuple(reversed(bounds))


def plan_stages(module: nn.Module, split: Any, stages: int) -> StagePlan:
    """The stages of ``module``: from ``split`` (the module names where stages 1, 2, ... begin) or ``"auto"`` (the
    ``nn.Sequential`` or ``nn.ModuleList`` with the most parameters among those with at least ``stages`` children,
    cut into stages of balanced parameter count). Raises :class:`PipelineError` naming the fix."""
    owner = type(module).__name__
    containers = _containers(module)
    if split == "auto":
        candidates = [(n, c) for n, c in containers.items() if len(c) >= stages]
        if not candidates:
            largest = max((len(c) for c in containers.values()), default=0)
            raise PipelineError(
                f"pipeline_split='auto' found no nn.Sequential or nn.ModuleList in {owner} with at least {stages} "
                f"children (blocks) to make {stages} stages (the largest has {largest}). The pipeline needs "
                f"{SHAPE_NEEDED}. Use fewer stages, or give the model that shape."
            )
        name, container = max(
            candidates, key=lambda nc: (sum(p.numel() for p in nc[1].parameters()), len(nc[1]), -len(nc[0]))
        )
        children = [n for n, _ in container.named_children()]
        costs = [sum(p.numel() for p in child.parameters()) + 1 for child in container.children()]
        bounds = balanced_bounds(costs, stages)
        return StagePlan(name, tuple(_full(name, c) for c in children), bounds)
    names = list(split)
    modules = dict(module.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        close = [n for n in modules if n and any(n.endswith("." + m.split(".")[-1]) for m in missing)][:6]
        raise PipelineError(
            f"pipeline_split={names!r}: {owner} has no module named {missing[0]!r}. Give names from "
            f"{owner}.named_modules() where the stages after the first begin{f', e.g. {close}' if close else ''}."
        )
    parents = {n.rpartition(".")[0] for n in names}
    parent = parents.pop() if len(parents) == 1 else None
    if parent is None or parent not in containers:
        raise PipelineError(
            f"pipeline_split={names!r}: the names must be children of one nn.Sequential or nn.ModuleList (the "
            f"blocks), such as ['blocks.2'] for `self.blocks = nn.ModuleList(...)`. The pipeline needs "
            f"{SHAPE_NEEDED}."
        )
    children = [_full(parent, c) for c, _ in containers[parent].named_children()]
    starts = [children.index(n) for n in names]
    if starts != sorted(set(starts)) or starts[0] == 0:
        raise PipelineError(
            f"pipeline_split={names!r} must name blocks in increasing order, after the first block "
            f"({children[0]!r} begins stage 0): each name is where one stage after the first begins."
        )
    edges = [0, *starts, len(children)]
    bounds = tuple((edges[i], edges[i + 1]) for i in range(len(edges) - 1))
    return StagePlan(parent, tuple(children), bounds)


def check_stage_count(module: nn.Module, split: Any, stages: int) -> StagePlan:
    """:func:`plan_stages`, with the error for more stages than blocks."""
    plan = plan_stages(module, split, stages)
    if plan.stages != stages:  # only names can disagree; settings checked the count against the schedule
        raise PipelineError(f"pipeline_split makes {plan.stages} stages where {stages} are needed.")
    return plan


def master_precision_refusal(mode: str, size: int) -> str:
    """Why MGPUPrecision's master mode ``mode`` is refused with ``pipeline_parallel_size=size``, and the fix (the
    pipeline's check before launch, and the layout planner's for a pipelined layout of that precision).

    Example:

        >>> master_precision_refusal("bf16-master", 2).split(":")[0]
        "MGPUPrecision('bf16-master') with pipeline_parallel_size=2 is not supported yet"
    """
    return (
        f"MGPUPrecision({mode!r}) with pipeline_parallel_size={size} is not supported yet: each rank's optimizer "
        f"would step FP32 masters of every block, and those of the other stages' blocks are never trained on that "
        f"rank (the model and its checkpoint would get their stale values; at stage=3 the masters would be whole on "
        f"every rank, where ZeRO-3 shards the stage). Use precision='bf16-mixed' (or '16-mixed', '32-true'): the "
        f"weights stay FP32, autocast computes in half."
    )
