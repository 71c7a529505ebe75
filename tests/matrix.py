"""Parity matrices that prove each interaction once: the pairwise cover of a parametrized product.

A matrix of axes (the ZeRO stage with its backend, ``k``, the optimizer, ...) fails for one of two reasons: a value
that is wrong on its own, or two values that are wrong together (a stage whose accumulation skips a sync, an
optimizer whose state a layout saves badly). Every cell of the *pairwise cover* below has its parity test; together
they meet every value of every axis and every pair of values of two axes at least once, in about the number of cells
of the two largest axes multiplied, where the whole product grows with every axis. The other cells of the product are
marked ``full_matrix``: the suites CI runs leave them out (``-m "not full_matrix"``), ``pytest -m full_matrix`` runs
them.

    STAGES = {"zero1-torch": (1, "torch"), "zero3-fsdp2": (3, "torch")}  # an id, and the arguments it fills

    @pytest.mark.parametrize(("stage", "backend", "k", "optimizer"), pairwise(STAGES, [1, 2], ["sgd", "adam"]))
    def test_parity(stage, backend, k, optimizer): ...
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Union

import pytest

#: an axis: a list of values, or ``{id: value}``; a value that is a tuple fills several argument names
Axis = Union[Sequence[Any], Mapping[str, Any]]


def _values_and_ids(axis: Axis) -> list[tuple[tuple[Any, ...], str]]:
    items = axis.items() if isinstance(axis, Mapping) else [(str(v), v) for v in axis]
    return [(v if isinstance(v, tuple) else (v,), i) for i, v in items]


def cover(sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Indices of a pairwise cover of the product of axes of ``sizes``, greedily: the first cell, in the product's
    order, that covers the most pairs not yet covered, until every pair is."""
    cells = list(itertools.product(*(range(n) for n in sizes)))
    if len(sizes) < 2:
        return cells
    pairs = list(itertools.combinations(range(len(sizes)), 2))
    missing = {(a, b, x, y) for a, b in pairs for x in range(sizes[a]) for y in range(sizes[b])}
    chosen: list[tuple[int, ...]] = []
    while missing:
        best = max(cells, key=lambda c: sum((a, b, c[a], c[b]) in missing for a, b in pairs))
        chosen.append(best)
        missing -= {(a, b, best[a], best[b]) for a, b in pairs}
    return sorted(chosen)


def pairwise(*axes: Axis) -> list[Any]:
    """Every cell of the product of ``axes`` as a ``pytest.param`` (arguments in the axes' order, id the ids joined by
    ``-``), those outside the pairwise cover marked ``full_matrix``. An axis is a list of values, or ``{id: value}``;
    a value that is a tuple fills several argument names."""
    named = [_values_and_ids(axis) for axis in axes]
    kept = set(cover([len(axis) for axis in named]))
    params = []
    for index in itertools.product(*(range(len(axis)) for axis in named)):
        chosen = [named[a][i] for a, i in enumerate(index)]
        values = tuple(v for value, _ in chosen for v in value)
        marks = () if index in kept else (pytest.mark.full_matrix,)
        params.append(pytest.param(*values, id="-".join(i for _, i in chosen), marks=marks))
    return params


def tiers(cells: Mapping[str, Any], slow: Collection[str]) -> list[Any]:
    """``{id: value}`` as ``pytest.param``s (a tuple value fills several argument names), the cells named in ``slow``
    marked ``slow``: what the cells left in the default suite already prove apart (each value of each axis stays in
    the default suite once; CI runs both tiers). A name in ``slow`` that is no cell's id is an error."""
    unknown = set(slow) - set(cells)
    if unknown:
        raise ValueError(f"not a cell: {sorted(unknown)}")
    return [
        pytest.param(
            *(value if isinstance(value, tuple) else (value,)),
            id=name,
            marks=(pytest.mark.slow,) if name in slow else (),
        )
        for name, value in cells.items()
    ]
