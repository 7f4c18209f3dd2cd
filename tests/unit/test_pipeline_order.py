"""The 1F1B schedule model and the workload-ordered micro-batches (libra_ext.pipeline), and
`libra plan --pp`."""

import itertools
import json

import numpy as np
import pytest

from libra_ext.pipeline import one_f_one_b, order_slots, stage_times


@pytest.mark.parametrize("m, p", [(1, 1), (5, 1), (4, 4), (8, 4), (3, 4), (16, 8)])
def test_uniform_micro_batches_give_the_textbook_1f1b_time(m, p):
    f = np.ones(m)
    assert one_f_one_b(f, 2 * f, p) == pytest.approx((m + p - 1) * 3.0)


def test_a_hand_worked_two_stage_schedule():
    # stage 0: F0 [0,1] F1 [1,3] B0 [4,6] B1 [10,14]; stage 1: F0 [1,2] B0 [2,4] F1 [4,6] B1 [6,10]
    assert one_f_one_b(np.array([1.0, 2.0]), np.array([2.0, 4.0]), 2) == pytest.approx(14.0)


def test_leading_dimensions_are_evaluated_side_by_side():
    rng = np.random.default_rng(0)
    f = rng.uniform(0.5, 2.0, size=(3, 5))
    together = one_f_one_b(f, 2 * f, 3)
    assert together.shape == (3,)
    for i in range(3):
        assert together[i] == pytest.approx(one_f_one_b(f[i], 2 * f[i], 3))


def test_balanced_order_keeps_the_slots_and_never_loses():
    rng = np.random.default_rng(1)
    slot = rng.lognormal(0.0, 1.0, size=(8, 6))
    for pool in (1, 2, 8):
        got = order_slots(slot, pool, 4)
        assert got.samples_preserved
        assert got.step_after <= got.step_before * (1 + 1e-12)
        assert got.bubble_after <= got.bubble_before + 1e-12 or got.step_after < got.step_before
        # one order per exchange pool: its replicas run each slot at the same position
        for k in range(8 // pool):
            rows = got.order[k * pool:(k + 1) * pool]
            assert (rows == rows[0]).all()
    none = order_slots(slot, 2, 4, "none")
    assert (none.order == np.arange(6)).all() and none.step_after == none.step_before


def test_balanced_order_is_close_to_the_best_permutation():
    """Against every permutation of 6 micro-batches (one replica, 3 stages)."""
    rng = np.random.default_rng(2)
    excess = []
    for _ in range(10):
        slot = rng.lognormal(0.0, 0.8, size=(1, 6))
        best = min(
            one_f_one_b(*stage_times(slot[:, list(perm)], 3), 3)[0]
            for perm in itertools.permutations(range(6))
        )
        got = order_slots(slot, 1, 3)
        excess.append(got.step_after / best - 1.0)
    assert max(excess) < 0.02, excess


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="pp_order must be one of none, balanced"):
        order_slots(np.ones((2, 2)), 1, 2, "greedy")
    with pytest.raises(ValueError, match=r"exchange pool \(3\) must divide the replicas \(4\)"):
        order_slots(np.ones((4, 2)), 3, 2)
    with pytest.raises(ValueError, match="pp must be >= 1"):
        order_slots(np.ones((4, 2)), 1, 0)


def test_plan_cli_reports_the_modeled_bubble(capsys):
    from megatron.libra.cli import main

    args = ["plan", "--system", "ulysses", "--gbs", "64", "--dp", "8", "--pool-size", "4",
            "--steps", "2", "--pp", "4", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pp"] == 4 and out["samples_preserved"]
    assert 0 < out["pp_bubble_after"] <= out["pp_bubble_before"] < 1
    assert out["pp_step_after_over_before"] <= 1.0
    assert main(args[:-3] + ["--pp", "0"]) != 0
