"""The C++ core and the pure-Python reference make the same VRSP and TAP decisions."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from libra_ext import _planner as core
from libra_ext.planner import Planner, PlannerOptions
from libra_ext.reference import lower_bound, lpt, plan_libra

from .strategies import layouts, step_inputs


@settings(max_examples=30)
@given(data=st.data())
def test_core_matches_reference_planner(data):
    layout, model = data.draw(layouts())
    seqs = data.draw(step_inputs(layout))
    block = data.draw(st.sampled_from([None, 16, 100]))
    head_group = data.draw(st.sampled_from([0, 1]))
    share = data.draw(st.sampled_from([0.0, 0.1]))
    plan = Planner(
        layout, model, PlannerOptions(block=block, head_group=head_group, max_tile_share=share)
    ).plan(seqs)
    ref = plan_libra(
        seqs,
        layout.dp,
        layout.cp,
        layout.tp,
        layout.pool_size,
        layout.context,
        model.heads,
        model.kv_heads,
        model.head_dim,
        block=block or 0,
        head_group=head_group,
        max_tile_share=share,
    )
    assert ref.seq_replica == plan.seq_replica.tolist()
    assert ref.seq_slot == plan.seq_slot.tolist()
    got = list(
        zip(
            plan.tile_seq.tolist(),
            plan.tile_doc.tolist(),
            plan.tile_doc_count.tolist(),
            plan.tile_q_start.tolist(),
            plan.tile_q_len.tolist(),
            plan.tile_head_start.tolist(),
            plan.tile_head_count.tolist(),
            plan.tile_kv_start.tolist(),
            plan.tile_kv_len.tolist(),
            plan.tile_owner.tolist(),
            plan.tile_executor.tolist(),
        )
    )
    assert got == ref.tiles
    assert abs(plan.vrsp_lower_bound - ref.lower_bound) <= 1e-9 * max(1.0, ref.lower_bound)


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=24), st.integers(1, 4))
def test_lpt_and_lower_bound_match_reference(loads, card):
    n = len(loads) - len(loads) % card
    if n == 0:
        return
    loads = loads[:n]
    groups = n // card
    assert list(core.exact_cardinality_lpt(loads, groups, card)) == lpt(loads, groups, card)
    bound = core.exact_cardinality_lower_bound(loads, groups, card)
    assert math.isclose(bound, lower_bound(loads, groups, card), rel_tol=1e-12, abs_tol=1e-9)
