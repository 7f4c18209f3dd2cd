"""VRSP's exact-cardinality placement and its lower bound against brute force."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra_ext import _planner as core


def _brute_force_optimum(loads, groups, card):
    best = float("inf")
    items = list(range(len(loads)))

    def rec(remaining, current_max):
        nonlocal best
        if current_max >= best:
            return
        if not remaining:
            best = current_max
            return
        first = remaining[0]  # fix the first item's group to break symmetry
        for rest in itertools.combinations(remaining[1:], card - 1):
            g = (first,) + rest
            left = [i for i in remaining if i not in g]
            rec(left, max(current_max, sum(loads[i] for i in g)))

    rec(items, 0.0)
    return best


@settings(max_examples=60)
@given(st.integers(1, 3), st.integers(1, 3), st.data())
def test_lower_bound_is_valid_and_lpt_is_near_it(groups, card, data):
    loads = data.draw(
        st.lists(st.integers(0, 1000).map(float), min_size=groups * card, max_size=groups * card)
    )
    placement = list(core.exact_cardinality_lpt(loads, groups, card))
    assert sorted(placement.count(g) for g in range(groups)) == [card] * groups
    achieved = max(sum(l for l, g in zip(loads, placement) if g == k) for k in range(groups))
    optimum = _brute_force_optimum(loads, groups, card)
    bound = core.exact_cardinality_lower_bound(loads, groups, card)
    assert bound <= optimum + 1e-9 <= achieved + 2e-9


def test_one_heavy_item_bound_includes_the_lightest_companions():
    loads = [100.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    # the group holding 100 has two more members, at least 1 + 2
    assert core.exact_cardinality_lower_bound(loads, 2, 3) == 103.0
    assert sorted(core.exact_cardinality_lpt(loads, 2, 3)) == [0, 0, 0, 1, 1, 1]


def test_wrong_item_count_is_rejected():
    with pytest.raises(ValueError, match="n_groups \\* cardinality = 6"):
        core.exact_cardinality_lpt([1.0] * 5, 2, 3)
    with pytest.raises(ValueError, match="n_groups"):
        core.exact_cardinality_lower_bound([1.0], 0, 1)


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf"), float("-inf")])
def test_loads_that_are_not_finite_and_non_negative_are_rejected(bad):
    loads = [1.0] * 600
    loads[517] = bad
    with pytest.raises(ValueError, match=r"loads\[517\] must be a finite number >= 0"):
        core.exact_cardinality_lpt(loads, 100, 6)
    with pytest.raises(ValueError, match=r"loads\[517\]"):
        core.exact_cardinality_lower_bound(loads, 100, 6)


def test_a_group_count_whose_product_overflows_is_rejected():
    with pytest.raises(ValueError, match="n_groups"):
        core.exact_cardinality_lpt([1.0] * 4, 2**62, 4)
