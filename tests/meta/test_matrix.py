"""The pairwise cover of the parity matrices (tests/matrix.py): every value and every pair of values is met."""

from __future__ import annotations

import itertools

import pytest

from tests.matrix import cover, pairwise, tiers


@pytest.mark.parametrize("sizes", [(5, 2, 3), (5, 2, 2), (3, 3, 3), (2, 4), (4, 3, 2, 2)])
def test_the_cover_meets_every_pair_of_values_in_fewer_cells_than_the_product(sizes):
    cells = cover(sizes)
    product = set(itertools.product(*(range(n) for n in sizes)))
    assert set(cells) <= product and len(set(cells)) == len(cells)
    for a, b in itertools.combinations(range(len(sizes)), 2):
        met = {(c[a], c[b]) for c in cells}
        assert met == set(itertools.product(range(sizes[a]), range(sizes[b]))), (sizes, a, b)
    if len(sizes) > 2:
        assert len(cells) < len(product)
    else:
        assert set(cells) == product  # two axes: every cell is a pair of its own


def test_a_pair_left_out_is_seen_negative_control():
    # the check above can fail: the cover less any one cell leaves some pair unmet
    cells = cover((5, 2, 3))
    for dropped in cells:
        rest = [c for c in cells if c != dropped]
        pairs = {(a, b, c[a], c[b]) for c in rest for a, b in itertools.combinations(range(3), 2)}
        assert len(pairs) < 5 * 2 + 5 * 3 + 2 * 3


def test_the_cells_outside_the_cover_are_marked_full_matrix_with_their_usual_ids():
    params = pairwise({"zero1-torch": (1, "torch"), "zero3-fsdp2": (3, "torch")}, [1, 2], ["sgd", "adam"])
    assert [p.id for p in params] == [
        f"{s}-{k}-{o}" for s in ("zero1-torch", "zero3-fsdp2") for k in (1, 2) for o in ("sgd", "adam")
    ]
    assert params[0].values == (1, "torch", 1, "sgd")
    kept = [p for p in params if not p.marks]
    assert all([m.name for m in p.marks] == ["full_matrix"] for p in params if p.marks)
    assert 4 <= len(kept) < len(params)
    for axis in range(3):  # every value of every axis is kept at least once
        values = {p.values[axis + (axis > 0)] for p in params}
        assert {p.values[axis + (axis > 0)] for p in kept} == values


def test_tiers_mark_the_named_cells_slow_and_refuse_a_name_that_is_no_cell():
    params = tiers({"zero1": (1, "torch"), "zero3": (3, "torch"), "ddp": "ddp"}, slow={"zero1"})
    assert [(p.id, p.values, [m.name for m in p.marks]) for p in params] == [
        ("zero1", (1, "torch"), ["slow"]),
        ("zero3", (3, "torch"), []),
        ("ddp", ("ddp",), []),
    ]
    with pytest.raises(ValueError, match=r"not a cell: \['zero2'\]"):
        tiers({"zero1": 1}, slow={"zero2"})  # a typo would otherwise keep the cell in the default suite silently
