"""Production order: Megatron-LM's pretraining sampler against the plan's placement."""

import numpy as np
import pytest

from libra_ext.planner import LayoutConfig, Planner, PlannerOptions
from libra_ext.workload import LengthSource, ModelConfig


def megatron_sampler_assignment(gbs: int, dp: int, micro_batch_size: int) -> dict[int, tuple]:
    """The sampler's rule, written out: the global batch is consumed in rounds of
    micro_batch_size * dp consecutive samples; data-parallel rank r takes the r-th slice of
    micro_batch_size samples of each round; a rank's samples form its micro-batches in order."""
    out = {}
    per_round = micro_batch_size * dp
    seen = [0] * dp  # samples a rank has taken so far = its next slot
    for start in range(0, gbs, per_round):
        batch = list(range(start, start + per_round))
        for r in range(dp):
            for q in batch[r * micro_batch_size : (r + 1) * micro_batch_size]:
                out[q] = (r, seen[r])
                seen[r] += 1
    return out


@pytest.mark.parametrize("dp,gbs,mbs", [(4, 8, 1), (4, 16, 2), (2, 12, 3), (8, 8, 1), (3, 12, 4)])
def test_megatron_order_is_the_pretraining_samplers_assignment(dp, gbs, mbs):
    seqs = LengthSource(preset="libra-256k").step(gbs, 4096, 1, 0)
    plan = Planner(
        LayoutConfig(dp=dp, cp=1, pool_size=1, context=4096),
        ModelConfig(heads=4, kv_heads=4),
        PlannerOptions(system="ulysses", micro_batch_size=mbs),
    ).plan(seqs)
    want = megatron_sampler_assignment(gbs, dp, mbs)
    got = {q: (int(plan.seq_replica[q]), int(plan.seq_slot[q])) for q in range(gbs)}
    assert got == want


def test_contiguous_order_gives_each_replica_a_block():
    seqs = LengthSource(preset="libra-256k").step(12, 4096, 1, 0)
    plan = Planner(
        LayoutConfig(dp=3, cp=1, pool_size=1, context=4096),
        ModelConfig(heads=4, kv_heads=4),
        PlannerOptions(system="ulysses", order="contiguous"),
    ).plan(seqs)
    assert plan.seq_replica.tolist() == [q // 4 for q in range(12)]
    assert plan.seq_slot.tolist() == [q % 4 for q in range(12)]


def test_before_figures_follow_the_order():
    # the same step in both orders: Ulysses' plan is the production order, so its balance is the
    # "before" figure of every system planned in that order
    seqs = LengthSource(preset="libra-256k").step(128, 262_144, 0, 0)
    layout = LayoutConfig(dp=16, cp=8, pool_size=8, context=262_144)
    for order in ("megatron", "contiguous"):
        uly_options = PlannerOptions(system="ulysses", order=order)
        uly = Planner(layout, ModelConfig(), uly_options).plan(seqs)
        lib = Planner(layout, ModelConfig(), PlannerOptions(order=order)).plan(seqs)
        assert uly.max_over_mean == pytest.approx(uly.max_over_mean_before)
        assert lib.max_over_mean_before == pytest.approx(uly.max_over_mean)
        assert np.allclose(lib.rank_load_before, uly.rank_load)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(order="sorted"), "order"),
        (dict(micro_batch_size=0), "micro_batch_size"),
    ],
)
def test_bad_order_options_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        PlannerOptions(**kw)


def test_micro_batch_size_must_divide_the_slots():
    seqs = LengthSource(preset="libra-256k").step(12, 4096, 1, 0)
    planner = Planner(
        LayoutConfig(dp=3, cp=1, pool_size=1, context=4096),
        ModelConfig(heads=4, kv_heads=4),
        PlannerOptions(system="ulysses", micro_batch_size=3),
    )
    with pytest.raises(ValueError, match="micro_batch_size"):
        planner.plan(seqs)
