"""The C++ core and the pure-Python reference make the same VRSP and TAP decisions."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from libra_ext import _planner as core
from libra_ext.planner import Planner, PlannerOptions
from libra_ext.reference import lower_bound, lpt, plan_libra
from tests.strategies import layouts, step_inputs


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
    ref = plan_libra(seqs, layout, model,
                     PlannerOptions(block=block, head_group=head_group, max_tile_share=share))
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


@given(st.lists(st.integers(0, 10**12).map(float), min_size=1, max_size=40), st.integers(1, 6))
def test_lpt_and_lower_bound_match_reference(loads, card):
    # loads are FLOP counts: integer-valued, exact in doubles
    n = len(loads) - len(loads) % card
    if n == 0:
        return
    loads = loads[:n]
    groups = n // card
    assert list(core.exact_cardinality_lpt(loads, groups, card)) == lpt(loads, groups, card)
    bound = core.exact_cardinality_lower_bound(loads, groups, card)
    assert math.isclose(bound, lower_bound(loads, groups, card), rel_tol=1e-12, abs_tol=1e-9)


def test_core_matches_reference_when_refinement_cuts_tiles():
    # many 16-token documents and a few mid-length ones: the heaviest members hold tiles a bit
    # larger than the gap, so the refinement cuts tail rows off them
    import numpy as np

    from libra_ext.planner import LayoutConfig
    from libra_ext.workload import ModelConfig, pack_production

    rng = np.random.default_rng(3)
    lengths = np.where(rng.random(4000) < 0.01, 1500, 16).tolist()
    seqs = [s.doc_lengths for s in pack_production(lengths, 2048, 8)]
    layout = LayoutConfig(dp=4, cp=1, pool_size=4, context=2048)
    model = ModelConfig(hidden=64, heads=4, kv_heads=2, head_dim=8, ffn=64, layers=1, moe_topk=0,
                        moe_ffn=0)
    # tiles of at most a tenth of a member's mean to start from (the case was built for it)
    plan = Planner(layout, model, PlannerOptions(block=512, max_tile_share=0.1)).plan(seqs)
    uncut = Planner(
        layout, model, PlannerOptions(block=512, max_tile_share=0.1, refine=False)
    ).plan(seqs)
    assert plan.n_tiles > uncut.n_tiles  # the refinement cut tiles
    ref = plan_libra(seqs, layout, model, PlannerOptions(block=512, max_tile_share=0.1))
    assert ref.seq_replica == plan.seq_replica.tolist()
    got = list(zip(*(getattr(plan, "tile_" + k).tolist() for k in (
        "seq", "doc", "doc_count", "q_start", "q_len", "head_start", "head_count", "kv_start",
        "kv_len", "owner", "executor"))))
    assert got == ref.tiles
    assert plan.max_over_mean < uncut.max_over_mean


def test_lpt_matches_reference_on_large_inputs_with_ties_and_zeros():
    # from 512 loads on, the core orders them with a radix sort: the same order (heaviest
    # first, ties by index; groups' items by load, ties by position) as the comparison sort
    import random

    rng = random.Random(3)
    for n, card in [(512, 8), (1024, 16), (768, 4)]:
        loads = [float(rng.randrange(1, 10**12)) for _ in range(n)]
        for i in range(0, n, 7):
            loads[i] = loads[i // 7]  # ties
        for i in range(3, n, 61):
            loads[i] = 0.0
        groups = n // card
        assert list(core.exact_cardinality_lpt(loads, groups, card)) == lpt(loads, groups, card)
