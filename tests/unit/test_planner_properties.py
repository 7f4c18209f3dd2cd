"""Property tests of the planner over random workloads and layouts, for every system."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from libra_ext import _planner as _core
from libra_ext import checks
from libra_ext.planner import PLAN_PHASES, LayoutConfig, Planner, PlannerOptions, plan_step
from libra_ext.workload import LengthSource, ModelConfig, block_pairs
from tests.strategies import layouts, step_inputs

SYSTEMS = ["libra", "ulysses", "wlb", "distca", "distca-gpu"]
"""distca-gpu: distca with every GPU an attention server (planned at cp 1)."""


def _options(data, system):
    return PlannerOptions(
        system="distca" if system == "distca-gpu" else system,
        distca_server="gpu" if system == "distca-gpu" else "replica",
        block=data.draw(st.sampled_from([None, 1, 7, 64, 512])),
        head_group=data.draw(st.sampled_from([0, 1, 3])),
        epsilon=data.draw(st.sampled_from([0.0, 0.02, 0.2])),
        max_tile_share=data.draw(st.sampled_from([0.0, 0.1, 0.01])),
    )


def _expected_exchange(plan):
    """Q element counts recomputed from the tiles alone."""
    px = plan.exchange_pool
    q = np.zeros_like(plan.xchg_q)
    for t in range(plan.n_tiles):
        o, e = plan.tile_owner[t], plan.tile_executor[t]
        if o == e:
            continue
        assert o // px == e // px, "a tile left its exchange pool"
        g = plan.group_of(o, plan.seq_slot[plan.tile_seq[t]])
        n = plan.tile_q_len[t] * plan.tile_head_count[t]
        q[g, o % px, e % px] += n * plan.head_dim
    return q


@pytest.mark.parametrize("system", SYSTEMS)
@given(data=st.data())
def test_plan_is_exact_preserving_and_deterministic(system, data):
    layout, model = data.draw(layouts())
    if system == "distca-gpu":  # a GPU is a replica
        layout = dataclasses.replace(layout, cp=1)
    seqs = data.draw(step_inputs(layout))
    options = _options(data, system)
    plan = Planner(layout, model, options).plan(seqs, flush=True)
    ok, why = checks.pairs_exact(plan)
    assert ok, why
    if system == "wlb":
        ok, why = checks.documents_preserved([l for s in seqs for l in s], [plan])
    else:
        ok, why = checks.samples_preserved(seqs, plan)
    assert ok, why
    # exact cardinality: every (replica, slot) holds exactly one sequence
    assert sorted(zip(plan.seq_replica.tolist(), plan.seq_slot.tolist())) == [
        (r, s) for r in range(layout.dp) for s in range(plan.slots)
    ]
    # determinism: a fresh planner gives the same plan, byte for byte
    again = Planner(layout, model, options).plan(seqs, flush=True)
    assert again.hash == plan.hash
    for name in ("tile_executor", "tile_q_start", "seq_replica", "xchg_kv", "send_order"):
        assert np.array_equal(getattr(again, name), getattr(plan, name))
    # exchange counts agree with the tiles; bytes only where tiles move
    assert np.array_equal(_expected_exchange(plan), plan.xchg_q)
    assert np.array_equal(plan.xchg_o, np.swapaxes(plan.xchg_q, 1, 2))
    moved = plan.tile_owner != plan.tile_executor
    assert (plan.xchg_kv.sum() > 0) == bool(moved.any())
    if system in ("ulysses", "wlb") or (system == "libra" and layout.pool_size == 1):
        assert not moved.any() and plan.total_bytes == 0
    # loads: every rank's modeled load sums to the tiles' FLOPs
    flops = 4.0 * model.head_dim * (plan.tile_pairs * plan.tile_head_count) * 3.5
    per_rank_total = np.where(plan.tile_cp < 0, flops * plan.cp, flops).sum()
    assert np.isclose(plan.rank_load.sum(), per_rank_total)
    assert plan.max_over_mean >= 1.0 - 1e-12 or plan.rank_load.sum() == 0
    assert plan.vrsp_lower_bound_ratio >= 1.0 - 1e-9


@given(data=st.data())
def test_rank_slices_are_consistent_with_the_whole(data):
    layout, model = data.draw(layouts())
    system = data.draw(st.sampled_from(SYSTEMS))
    if system == "distca-gpu":
        layout = dataclasses.replace(layout, cp=1)
    seqs = data.draw(step_inputs(layout))
    plan = Planner(layout, model, _options(data, system)).plan(seqs, flush=True)
    px = plan.exchange_pool
    seen_seq, executed = [], np.zeros(plan.n_tiles, dtype=int)
    for r in range(layout.dp):
        for c in range(layout.cp):
            sl = plan.rank_slice(r, c)
            if c == 0:
                seen_seq.extend(sl["sequences"].tolist())
            executed[sl["tiles_executed"]] += 1
            assert (plan.tile_owner[sl["tiles_owned"]] == r).all()
            # what r sends to j is what j receives from r, slot by slot
            for slot in range(plan.slots):
                g = plan.group_of(r, slot)
                for j in range(px):
                    peer = (r // px) * px + j
                    peer_sl = plan.rank_slice(peer, c)
                    assert peer_sl["groups"][slot] == g
                    assert sl["xchg_q_send"][slot, j] == peer_sl["xchg_q_recv"][slot, r % px]
                    assert sl["xchg_kv_send"][slot, j] == peer_sl["xchg_kv_recv"][slot, r % px]
    assert sorted(seen_seq) == list(range(plan.n_seq))
    # Ulysses-style tiles run on every cp rank of their executor; per-cp tiles on one
    expected = np.where(plan.tile_cp < 0, layout.cp, 1)
    assert np.array_equal(executed, expected)
    with pytest.raises(ValueError, match="replica"):
        plan.rank_slice(layout.dp, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        plan.rank_slice(0, layout.cp)


def test_kv_prefix_is_shipped_once_per_destination():
    # one 4096-token document split into 8 query blocks of one head each (two heads reading
    # one KV head), P = 2: whatever moves needs one prefix
    from libra_ext.planner import LayoutConfig
    from libra_ext.workload import ModelConfig

    layout = LayoutConfig(dp=2, cp=1, pool_size=2, context=4096)
    model = ModelConfig(
        hidden=64, heads=2, kv_heads=1, head_dim=8, ffn=64, layers=1, moe_topk=0, moe_ffn=0
    )
    plan = Planner(layout, model, PlannerOptions(block=512, max_tile_share=0.0, head_group=1)).plan(
        [[4096], [16]]
    )
    moved = np.flatnonzero(plan.tile_owner != plan.tile_executor)
    assert len(moved) > 1
    assert len(plan.kv_len) == 1  # one (document, kv head, destination) entry
    assert plan.kv_len[0] == plan.tile_kv_len[moved].max()
    assert plan.xchg_kv.sum() == 2 * plan.kv_len[0] * model.head_dim
    # both members end up with the same attention work (up to one block's granularity)
    work = [plan.tile_pairs[plan.tile_executor == r].sum() for r in range(2)]
    assert abs(work[0] - work[1]) <= block_pairs(4096 - 512, 4096)


def test_a_documents_moved_rows_are_its_tail_in_one_piece_per_executor():
    # a long document's query blocks placed block by block leave the owner keeping rows after
    # moved ones; TAP re-cuts them: the owner keeps the first rows, each executor runs one
    # contiguous piece, with the same work (up to a row) and no more bytes
    from libra_ext.planner import LayoutConfig
    from libra_ext.workload import ModelConfig

    model = ModelConfig(hidden=256, heads=32, kv_heads=4, head_dim=8, ffn=64, layers=1,
                        moe_topk=0, moe_ffn=0)
    from libra_ext.costmodel import BINS, CostTable
    from libra_ext.reference import plan_libra

    timed = CostTable(np.where(np.arange(BINS) < 16, 4e-9, 1e-9), per_row=2e-8, per_segment=2e-5)
    rng = np.random.default_rng(0)
    for P, seqs in [(2, [[65536], rng.multinomial(65536 - 300, np.ones(300) / 300) + 1]),
                    (4, [[40000, 25536]] + [(rng.multinomial(65536 - 200, np.ones(200) / 200)
                                             + 1) for _ in range(3)])]:
        seqs = [[int(x) for x in s] for s in seqs]
        layout = LayoutConfig(dp=P, cp=1, pool_size=P, context=65536)
        for table in (None, timed):  # pairs, and a cost table's predicted time
            planner = Planner(layout, model, PlannerOptions(block=4096))
            planner.set_cost_model(table)
            plan = planner.plan(seqs)
            _assert_one_piece_per_member(plan)
            if table is None:  # the pure-Python twin re-cuts the same way
                ref = plan_libra(seqs, layout, model, PlannerOptions(block=4096))
                assert list(zip(*(getattr(plan, "tile_" + k).tolist() for k in (
                    "seq", "doc", "doc_count", "q_start", "q_len", "head_start", "head_count",
                    "kv_start", "kv_len", "owner", "executor")))) == ref.tiles


def _assert_one_piece_per_member(plan):
    checked = 0
    for d in np.flatnonzero(plan.doc_lengths >= 4096):
        mine = np.flatnonzero((plan.tile_doc == d) & (plan.tile_doc_count == 1))
        if not (plan.tile_owner[mine] != plan.tile_executor[mine]).any():
            continue
        checked += 1
        rows = plan.tile_q_start[mine] - plan.tile_kv_start[mine]
        order = mine[np.argsort(rows, kind="stable")]
        execs = plan.tile_executor[order]
        runs = execs[np.r_[True, execs[1:] != execs[:-1]]]
        assert len(set(runs.tolist())) == len(runs)  # one piece per member
        assert plan.tile_owner[order[0]] not in runs[1:]  # the owner's rows come first
    assert checked > 0
    assert plan.max_over_mean < 1.01


def test_libra_balances_a_skewed_step_and_ulysses_does_not():
    from libra_ext.planner import LayoutConfig
    from libra_ext.workload import LengthSource, ModelConfig

    src = LengthSource(preset="libra-256k-v1", shuffle_window=1)
    layout = LayoutConfig(dp=16, cp=8, pool_size=8, context=262144)
    seqs = src.step(128, 262144, seed=0, step=1)
    libra = Planner(layout, ModelConfig(), PlannerOptions(system="libra")).plan(seqs)
    uly = Planner(layout, ModelConfig(), PlannerOptions(system="ulysses")).plan(seqs)
    assert uly.max_over_mean > 1.5
    assert libra.max_over_mean < 1.02
    assert libra.vrsp_lower_bound_ratio < 1.005
    assert libra.inter_pool_imbalance < uly.inter_pool_imbalance
    assert libra.max_over_mean_before == uly.max_over_mean


@given(data=st.data())
def test_vrsp_never_raises_the_heaviest_pool_or_ties_with_a_heavier_group(data):
    # VRSP orders placements by their heaviest pool total (what a rank's attention time is, with
    # TAP), then by their heaviest (pool, slot) group; production order is one of the candidates
    layout, model = data.draw(layouts())
    seqs = data.draw(step_inputs(layout))
    no_vrsp = Planner(layout, model, PlannerOptions(vrsp=False, tap=False)).plan(seqs)
    vrsp = Planner(layout, model, PlannerOptions(vrsp=True, tap=False)).plan(seqs)
    tol = 1e-9 * max(1.0, no_vrsp.vrsp_max_pool)
    assert vrsp.vrsp_max_pool <= no_vrsp.vrsp_max_pool + tol
    if vrsp.vrsp_max_pool >= no_vrsp.vrsp_max_pool - tol:  # a tie on pools: groups decide
        assert vrsp.vrsp_max_group <= no_vrsp.vrsp_max_group * (1 + 1e-12)
    assert vrsp.vrsp_pool_lower_bound <= vrsp.vrsp_max_pool * (1 + 1e-12)


@pytest.mark.parametrize("system", SYSTEMS)
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_hash_of_arrays_hashed_while_written_matches_a_full_rehash(system, threads):
    """Document and tile arrays are hashed as they are written; that hash equals one computed
    from the finished arrays alone."""
    source = LengthSource(preset="libra-256k")
    gpu = system == "distca-gpu"
    layout = LayoutConfig(dp=16, cp=1 if gpu else 8, pool_size=4, context=262_144)
    opts = PlannerOptions(system="distca" if gpu else system, threads=threads,
                          distca_server="gpu" if gpu else "replica")
    for step in range(2):
        seqs = source.step(64, 262_144, 5, step)
        planned, rehashed = _core.plan_hashes(
            seqs, layout.to_core(), ModelConfig().to_core(), opts.to_core(), _core.PlannerState()
        )
        assert planned == rehashed


def test_plan_does_not_depend_on_worker_threads():
    """TAP's groups are placed by worker threads; the plan is the same for every count."""
    source = LengthSource(preset="libra-256k")
    layout = LayoutConfig(dp=16, cp=8, pool_size=4, context=262_144)
    steps = [source.step(64, 262_144, 3, s) for s in range(2)]
    for seqs in steps:
        plans = [
            Planner(layout, ModelConfig(), PlannerOptions(threads=t)).plan(seqs) for t in (1, 3, 8)
        ]
        assert len({p.hash for p in plans}) == 1
        for name in ("tile_seq", "tile_q_start", "tile_q_len", "tile_executor", "send_order"):
            for p in plans[1:]:
                assert np.array_equal(getattr(p, name), getattr(plans[0], name)), name


def test_phase_times_sum_to_plan_time():
    plan = plan_step(
        LengthSource(preset="libra-256k").step(32, 262_144, 0, 0),
        LayoutConfig(dp=8, cp=8, pool_size=4, context=262_144),
    )
    assert tuple(plan.phase_ms) == PLAN_PHASES
    assert all(v >= 0 for v in plan.phase_ms.values())
    assert sum(plan.phase_ms.values()) == pytest.approx(plan.plan_ms, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("threads", [-1, 1025])
def test_threads_out_of_range_is_refused(threads):
    with pytest.raises(ValueError, match="threads"):
        PlannerOptions(threads=threads)
