"""The planner's edges: checkpointed states are untrusted input, WLB-LLM keeps its delay promise
under flush and at wlb_max_delay = 0, DistCA's achievable bound is over its one global pool, and
every input is taken as it is or refused naming the field and the value."""

import random

import numpy as np
import pytest

from libra_ext import _planner as core
from libra_ext.planner import LayoutConfig, Planner, PlannerOptions
from libra_ext.workload import LengthSource, ModelConfig, PackedBatch, block_pairs

MODEL = ModelConfig(heads=8, kv_heads=2, head_dim=64)
LAYOUT = LayoutConfig(dp=4, cp=2, pool_size=2, context=4096)


def P(system="libra", layout=LAYOUT, model=MODEL, **opts):
    return Planner(layout, model, PlannerOptions(system=system, **opts))


def tiny(dp=1, context=100, **opts):
    """D replicas of one cp rank, one head: WLB-LLM's packing alone decides."""
    model = ModelConfig(hidden=8, heads=1, kv_heads=1, head_dim=8, ffn=8, layers=1, moe_topk=0)
    return P("wlb", LayoutConfig(dp=dp, cp=1, pool_size=1, context=context), model, **opts)


# --- checkpointed states -----------------------------------------------------------------------


def test_a_state_whose_counts_overflow_is_refused_without_reading_past_it():
    # 4 * (nq + ns) wraps to 0 for nq = 2^62: the count is checked against the length first
    with pytest.raises(ValueError, match=r"length does not match its queue and spill counts"):
        P("wlb").load_state_dict({"planner_state": [2, 0, 0, 2**62, 0]})
    for counts in ([2**62, 2**62], [1, 2**63 - 1], [-1, 1], [2**61, 0]):
        with pytest.raises(ValueError, match=r"length does not match"):
            core.PlannerState.deserialize([2, 9, 0, *counts, 0, 1, 1, 0])


def test_a_crafted_state_cannot_hang_the_planner():
    # a held length of 2^62 overflowed the outlier level's doubling and looped forever
    p = P("wlb")
    with pytest.raises(ValueError, match=r"entry\[0\] \(queue\[0\]\): length 4611686018427387904"):
        p.load_state_dict({"planner_state": [2, 1, 0, 1, 0, 0, 2**62, 0, 0]})
    assert p.plan([[100]] * 4).n_seq == 4  # the refused state left the planner as it was
    # an outlier threshold near 2^63 makes no level loop either
    far = P("wlb", wlb_outlier_len=2**62).plan([[4096]] * 4)
    assert sorted(far.doc_lengths.tolist()) == [4096] * 4


@pytest.mark.parametrize(
    "flat, message",
    [
        ([2, 1, 0, 1, 0, 0, 5000, 1, 0], r"entry\[0\]: length 5000 exceeds context 4096"),
        ([2, 3, 0, 2, 0, 1, 10, 1, 0, 1, 20, 1, 1], r"document id 1 is held twice"),
        ([2, 2, 0, 1, 0, 2, 10, 1, 0], r"id 2 must be in \[0, next_doc_id = 2\)"),
        ([2, 2**63 - 2, 0, 0, 0], r"state\[1\] \(next_doc_id\) must be in \[0, 2\^62\]"),
        ([2, 5, -1, 0, 0], r"state\[2\] \(steps\) must be in \[0, 2\^62\]"),
        ([2, 1, 0, 1, 0, 0, 10, 9, 0], r"waited 9 steps; .* at most wlb_max_delay = 4"),
        ([2, 1, 0, 1, 0, 0, 10, 0, 0], r"waited 0 steps; a held document has waited at least 1"),
        ([2, 1, 0, 1, 0, 0, 10, -3, 0], r"steps waited -3 must be >= 0"),
        ([2, 1, 0, 1, 0, 0, 10, 1, -2], r"input sequence -2 must be >= 0"),
        ([2, 3, 0, 2, 0, 0, 3000, 2, 1, 1, 3000, 2, 1], r"from input sequence 1 of 2 steps ago "
         r"hold 6000 tokens, more than context 4096"),
        ([3, 0, 0, 0, 0], r"state\[0\] \(version\) must be 1 or 2"),
        ([2, 0, 0], r"planner state holds 3 entries; a state starts with 5"),
        ([2, 1, 0, 1, 0, 0, 10, 1, "x"], r"planner_state\[8\] must be an integer, got 'x'"),
        ([2, 1, 0, 1, 0, 0, 10, 1, 2**63], r"planner_state\[8\] = 9223372036854775808 is out of"),
        ([2, 1, 0, 1, 0, 0, 10, True, 0], r"planner_state\[7\] must be an integer, got True"),
    ],
)
def test_a_state_from_disk_is_validated_entry_by_entry(flat, message):
    p = P("wlb", wlb_release_count=8)
    p.plan([[3000]] * 4)  # holds four outliers (their level is released at eight)
    assert p.pending_documents == 4
    before = p.state_dict()
    with pytest.raises(ValueError, match=message):
        p.load_state_dict({"planner_state": flat})
    assert p.state_dict() == before  # nothing is lost


def test_a_state_is_refused_by_a_system_that_carries_none():
    held = P("wlb", wlb_release_count=8)
    held.plan([[3000]] * 4)
    assert held.pending_documents == 4
    with pytest.raises(ValueError, match=r"holds 4 documents, but only wlb carries any \(system "
                                         r"is libra\)"):
        P("libra").load_state_dict(held.state_dict())
    P("libra").load_state_dict(P("libra").state_dict())  # an empty one is fine


def test_a_held_document_of_an_input_sequence_the_step_does_not_have_is_refused():
    p = P("wlb")
    p.load_state_dict({"planner_state": [2, 1, 0, 1, 0, 0, 10, 1, 7]})
    with pytest.raises(ValueError, match=r"input sequence 7 is not below the step's 4 sequences"):
        p.plan([[5]] * 4)


def test_ids_stay_far_from_overflow():
    p = P("wlb")
    p.load_state_dict({"planner_state": [2, 2**62 - 2, 0, 0, 0]})
    with pytest.raises(ValueError, match=r"next_doc_id 4611686018427387902 \+ this step's 4 "
                                         r"documents would pass 2\^62"):
        p.plan([[5]] * 4)
    p.plan([[]] * 4)  # no new documents: nothing overflows
    assert (p.plan([[]] * 4).doc_ids >= 0).all()


def test_the_state_a_plan_leaves_always_loads_again():
    rng = random.Random(5)
    for trial in range(150):
        dp, context = rng.choice([1, 2, 4]), rng.randint(8, 300)
        p = tiny(dp=dp, context=context, wlb_max_delay=rng.randint(0, 3),
                 wlb_release_count=rng.randint(0, 3), wlb_outlier_len=rng.randint(0, 40))
        B = dp * rng.randint(1, 2)
        for step in range(6):
            seqs = []
            for _ in range(B):
                room, s = context, []
                while room > 0 and rng.random() < 0.7:
                    x = rng.randint(1, room)
                    s.append(x)
                    room -= x
                seqs.append(s)
            p.plan(seqs, flush=rng.random() < 0.2)
            again = tiny(dp=dp, context=context, **{k: getattr(p.options, k) for k in (
                "wlb_max_delay", "wlb_release_count", "wlb_outlier_len")})
            again.load_state_dict(p.state_dict())
            assert again.state_dict() == p.state_dict()


# --- WLB-LLM's delay promise -------------------------------------------------------------------


def test_due_documents_go_first_in_a_flushed_step():
    p = tiny(wlb_max_delay=1, wlb_release_count=2)
    assert p.plan([[30]]).doc_lengths.tolist() == []  # an outlier, held
    flushed = p.plan([[100]], flush=True)
    assert flushed.doc_ids.tolist() == [0]  # the 30-token document is due: it trains now
    assert p.pending_documents == 1  # the new 100-token one waits (not due, no room)
    assert p.plan([[]]).doc_ids.tolist() == [1]  # and trains on its deadline


def test_due_documents_of_a_known_input_go_before_a_version_1_states_in_a_flushed_step():
    # A version-1 state (no input sequences) holds 66 and 62 tokens that fall due in the same
    # step as documents of step 0 (39, 71, 57, from three input sequences). Due, they are 295
    # tokens for 4 x 77: no packing holds all five. Those of known input fit as their input held
    # them and must train; before, the version-1 documents were packed first and the 39-token
    # document of input sequence 0 was left over past its deadline - in a state that then failed
    # to load ("the documents held from input sequence 0 of 2 steps ago hold 78 tokens").
    p = P("wlb", LayoutConfig(dp=4, cp=1, pool_size=2, context=77),
          ModelConfig(hidden=8, heads=2, kv_heads=1, head_dim=4, ffn=8, layers=1, moe_topk=0),
          wlb_max_delay=2, wlb_release_count=2**31)
    p.load_state_dict({"planner_state": [1, 64, 3, 3, 0, 0, 11, 2, 3, 66, 0, 8, 62, 0]})
    seqs = [[17, 39, 4], [71], [11, 2], [57]]  # documents 64.., 71.., 78.. of steps 0, 1, 2
    p.plan(seqs)
    p.plan(seqs)
    trained = p.plan(seqs, flush=True).doc_ids.tolist()
    assert {65, 67, 70} <= set(trained)  # every due document of known input
    p.load_state_dict(p.state_dict())  # the state it leaves loads again
    # what stays is one version-1 document, still due (its input is unknown)
    held = p.state_dict()["planner_state"]
    assert [held[i:i + 4] for i in range(5, len(held), 4) if held[i + 3] < 0] == [[8, 62, 2, -1]]


def test_wlb_max_delay_zero_holds_nothing():
    p = tiny(wlb_max_delay=0)
    plan = p.plan([[20] * 5, [24, 24, 24, 24, 4]])
    assert sorted(plan.doc_ids.tolist()) == list(range(10))
    assert p.pending_documents == 0
    rng = random.Random(1)
    q = tiny(dp=2, context=64, wlb_max_delay=0, wlb_outlier_len=8)
    first = 0
    for _ in range(200):
        seqs = []
        for _ in range(4):
            room, s = 64, []
            while room > 0 and rng.random() < 0.8:
                x = rng.randint(1, room)
                s.append(x)
                room -= x
            seqs.append(s)
        n = sum(len(s) for s in seqs)
        plan = q.plan(seqs)
        assert sorted(plan.doc_ids.tolist()) == list(range(first, first + n))
        assert q.pending_documents == 0
        first += n


def test_every_document_trains_within_the_delay_under_random_flushes():
    rng = random.Random(2)
    worst_gap = 0
    for trial in range(120):
        dp, context, delay = rng.choice([1, 2, 3]), rng.randint(16, 200), rng.randint(0, 3)
        p = tiny(dp=dp, context=context, wlb_max_delay=delay, wlb_release_count=rng.randint(0, 3),
                 wlb_outlier_len=rng.randint(0, context))
        arrival, trained = [], {}
        B = dp * rng.randint(1, 2)
        for step in range(8):
            seqs = []
            for _ in range(B):
                room, s = context, []
                while room > 0 and rng.random() < 0.75:
                    x = rng.randint(1, room)
                    s.append(x)
                    room -= x
                seqs.append(s)
            arrival.extend([step] * sum(len(s) for s in seqs))
            plan = p.plan(seqs, flush=rng.random() < 0.3)
            for i in plan.doc_ids.tolist():
                assert i not in trained
                trained[i] = step
        for i, step in trained.items():
            worst_gap = max(worst_gap, step - arrival[i] - delay)
        held = [i for i in range(len(arrival)) if i not in trained]
        assert all(7 - arrival[i] < delay for i in held)  # none past its deadline
    assert worst_gap <= 0


# --- DistCA's bound ------------------------------------------------------------------------------


def test_distca_achievable_bound_is_over_all_replicas():
    # layout pools of 2: pool 0 draws both long documents, so tiles kept inside layout pools
    # cannot reach the mean; DistCA moves tiles between any replicas (one global pool)
    layout = LayoutConfig(dp=4, cp=1, pool_size=2, context=4096)
    seqs = [[4096], [4096], [64] * 64, [64] * 64]  # production order: sample q on replica q
    ulysses = P("ulysses", layout).plan(seqs)
    distca = P("distca", layout).plan(seqs)
    pool_of = ulysses.seq_replica // 2
    loads = np.array([sum(block_pairs(0, l) for l in s) for s in seqs], dtype=float)
    pools = np.array([loads[pool_of == k].sum() for k in range(2)])
    assert ulysses.achievable_max_over_mean == pytest.approx(pools.max() / pools.mean())
    assert ulysses.achievable_max_over_mean > 1.5
    assert distca.achievable_max_over_mean == pytest.approx(1.0)


def test_the_uncut_piece_keeps_one_row_below_32_tokens():
    # S = 16: max(1, min(128, S // 32)) = 1 row of the longest document on one head is the piece
    # TAP cannot cut; with 16 replicas sharing one pool it is the achievable figure
    model = ModelConfig(hidden=8, heads=1, kv_heads=1, head_dim=8, ffn=8, layers=1, moe_topk=0)
    layout = LayoutConfig(dp=16, cp=1, pool_size=16, context=16)
    plan = Planner(layout, model, PlannerOptions()).plan([[16]] + [[1]] * 15)
    mean = (block_pairs(0, 16) + 15) / 16
    assert plan.achievable_max_over_mean == pytest.approx(block_pairs(15, 16) / mean)


# --- strict inputs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seqs, message",
    [
        ([np.array([100.7, 200.2])] * 4, r"sequences\[0\] must be a 1-D integer array of document "
         r"lengths, got a 1-D float64 array"),
        ([np.array([1.0, np.nan])] * 4, r"sequences\[0\] must be a 1-D integer array.*float64"),
        ([[True, True]] * 4, r"sequences\[0\]\[0\] must be an integer, got True"),
        ([np.array([True, False])] * 4, r"sequences\[0\] must be a 1-D integer array.*bool"),
        ([[np.float64(3.0)]] * 4, r"sequences\[0\]\[0\] must be an integer, got "),
        ([[np.bool_(True)]] * 4, r"sequences\[0\]\[0\] must be an integer"),
        ([np.array([[1, 2]])] * 4, r"sequences\[0\] must be a 1-D integer array.*2-D"),
        ([np.array([2**64 - 1], dtype=np.uint64)] * 4, r"sequences\[0\]\[0\] = 18446744073709551615 "
         r"is out of range"),
        ("abc", r"sequences must be a list of lists of document lengths, got 'abc'"),
    ],
)
def test_sequences_are_taken_as_they_are_or_refused(seqs, message):
    with pytest.raises(ValueError, match=message):
        P().plan(seqs)


def test_integer_arrays_and_numpy_scalars_plan_like_lists():
    seqs = [[100, 200], [3000], [1, 2, 3], [7]]
    want = P().plan(seqs).hash
    assert P().plan([np.array(s, dtype=np.int32) for s in seqs]).hash == want
    assert P().plan([np.array(s, dtype=np.uint16) for s in seqs]).hash == want
    assert P().plan([[np.int64(x) for x in s] for s in seqs]).hash == want
    assert P().plan(tuple(tuple(s) for s in seqs)).hash == want
    assert P().plan(PackedBatch.from_lists(seqs)).hash == want


def test_flat_input_is_checked_like_nested_input():
    ok = PackedBatch.from_lists([[100, 200], [3000], [1], [7]])
    with pytest.raises(ValueError, match=r"sequences\[1\]\[0\] = 5000 exceeds the limit 4096"):
        P().plan(PackedBatch.from_lists([[100], [5000], [1], [7]]))
    with pytest.raises(ValueError, match=r"offsets\[2\] = 9 must lie in \[offsets\[1\] = 2, "
                                         r"len\(lengths\) = 5\]"):
        core.plan_step_flat(ok.lengths, np.array([0, 2, 9, 4, 5]), LAYOUT.to_core(),
                            MODEL.to_core(), PlannerOptions().to_core())
    with pytest.raises(ValueError, match=r"offsets\[0\] must be 0, got 1"):
        core.plan_step_flat(ok.lengths, np.array([1, 2, 3, 4, 5]), LAYOUT.to_core(),
                            MODEL.to_core(), PlannerOptions().to_core())
    with pytest.raises(ValueError, match=r"lengths must be a 1-D contiguous int64 array"):
        core.plan_step_flat(ok.lengths.astype(np.float64), ok.offsets, LAYOUT.to_core(),
                            MODEL.to_core(), PlannerOptions().to_core())
    with pytest.raises(ValueError, match=r"lengths must be a 1-D contiguous int64 array"):
        core.plan_step_flat(np.arange(10)[::2], ok.offsets, LAYOUT.to_core(),
                            MODEL.to_core(), PlannerOptions().to_core())


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: PlannerOptions(tap=None), r"tap must be true or false, got None"),
        (lambda: PlannerOptions(refine=2), r"refine must be true or false, got 2"),
        (lambda: PlannerOptions(vrsp="yes"), r"vrsp must be true or false, got 'yes'"),
        (lambda: PlannerOptions(epsilon=True), r"epsilon must be a number, got True"),
        (lambda: PlannerOptions(epsilon=float("nan")), r"epsilon must be >= 0, got nan"),
        (lambda: PlannerOptions(order=3), r"order must be a string, got 3"),
        (lambda: P().plan([[1]] * 4, flush="yes"), r"flush must be True or False, got 'yes'"),
        (lambda: P(dtype_bytes=65), r"dtype_bytes must be at most 64, got 65"),
        (lambda: P(wlb_max_delay=2**31), r"wlb_max_delay must be at most 2\^30"),
        (lambda: P(block=2**31), r"block must be at most 2\^30, got 2147483648"),
        (lambda: ModelConfig(head_dim=2**52), r"model.head_dim must be at most 2\^16, got 4503"),
        (lambda: LayoutConfig(dp=2**25, cp=1, pool_size=1, context=64), r"dp must be at most 2\^24"),
        (lambda: LayoutConfig(dp=1, cp=2**17, pool_size=1, context=64), r"cp must be at most 2\^16"),
        (lambda: P(layout=LayoutConfig(dp=4, cp=2, pool_size=2, context=2**30),
                   model=ModelConfig(heads=8192, kv_heads=8192, head_dim=8192)).plan([[1]] * 4),
         r"context x model.heads x model.head_dim x dtype_bytes = 1073741824 x 8192 x 8192 x 2 "
         r"exceeds 2\^56"),
    ],
)
def test_options_are_not_coerced(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "field", ["dp", "cp", "tp", "pool_size", "context", "head_dim", "block", "head_group",
              "micro_batch_size", "threads", "wlb_outlier_len", "wlb_max_delay"],
)
def test_a_value_past_64_bits_names_its_field(field):
    big = 2**63
    with pytest.raises(ValueError, match=rf"{field} = {big} is out of range"):
        if field in ("dp", "cp", "tp", "pool_size", "context"):
            args = dict(dp=1, cp=1, pool_size=1, context=64)
            args[field] = big
            LayoutConfig(**args)
        elif field == "head_dim":
            ModelConfig(head_dim=big)
        else:
            PlannerOptions(**{field: big})


# --- a seeded random property test over states and options -------------------------------------


_EDGES = [0, 1, -1, 2, 3, 100, 4096, 2**30, 2**30 + 1, 2**62, 2**63 - 1, -(2**63)]


def _edge(rng, lo, hi):
    return rng.choice(_EDGES) if rng.random() < 0.3 else rng.randint(lo, hi)


def test_random_states_and_options_plan_or_are_refused_by_name():
    rng = random.Random(27)
    refused, planned = 0, 0
    for case in range(3000):
        opts = dict(system=rng.choice(["wlb", "wlb", "libra", "distca", "ulysses"]))
        for name, lo, hi in (("wlb_max_delay", 0, 3), ("wlb_release_count", 0, 3),
                             ("wlb_outlier_len", 0, 80), ("head_group", 0, 4)):
            if rng.random() < 0.4:
                opts[name] = _edge(rng, lo, hi)
        if rng.random() < 0.2:
            opts["epsilon"] = rng.choice([0.0, 0.02, 1e300, float("inf"), float("nan"), -1.0])
        if rng.random() < 0.2:
            opts["block"] = _edge(rng, 1, 64)
        flat = [rng.choice([1, 2, 2, 2]), 64, rng.randint(0, 9), rng.randint(0, 3), rng.randint(0, 3)]
        width = 3 if flat[0] == 1 else 4
        for k in range((flat[3] + flat[4]) * width if rng.random() < 0.8 else rng.randint(0, 9)):
            flat.append([3 * (k // width) + rng.randint(0, 2), rng.randint(1, 120),
                         rng.randint(1, 2), rng.randint(-1, 3)][k % width])
        if rng.random() < 0.4:  # one field at an edge
            flat[rng.randrange(len(flat))] = _edge(rng, -2, 300)
        try:
            p = P(layout=LayoutConfig(dp=2, cp=1, pool_size=2, context=128),
                  model=ModelConfig(hidden=8, heads=2, kv_heads=1, head_dim=8, ffn=8, layers=1,
                                    moe_topk=0), **opts)
            p.load_state_dict({"planner_state": flat})
            seqs = [[rng.randint(1, 60) for _ in range(rng.randint(0, 2))] for _ in range(4)]
            plan = p.plan(seqs, flush=rng.random() < 0.3)
        except ValueError as e:
            refused += 1
            text = str(e)
            assert text and "incompatible function arguments" not in text
            assert any(ch.isdigit() for ch in text) or "must be" in text, text
            continue
        planned += 1
        assert len(set(plan.doc_ids.tolist())) == len(plan.doc_ids)
        assert all(sum(s) <= 128 for s in plan.sequences())
        again = Planner(p.layout, p.model, p.options)
        again.load_state_dict(p.state_dict())  # what a plan leaves loads again
    assert refused > 500 and planned > 500


# --- automatic threads on a busy host -------------------------------------------------------


def _spin(stop):
    while not stop.is_set():
        pass


def test_automatic_threads_leave_the_cores_other_processes_hold():
    import multiprocessing as mp
    import time

    cores = core.usable_cores()
    assert 1 <= core.idle_cores() <= cores
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(cores)]
    for proc in procs:
        proc.start()
    try:
        time.sleep(1.0)
        # every core is taken by a busy loop: a plan runs on one thread
        assert max(core.idle_cores() for _ in range(20)) == 1
    finally:
        stop.set()
        for proc in procs:
            proc.join(timeout=5)


# --- memory ------------------------------------------------------------------------------------


def test_a_plans_large_arrays_reuse_the_blocks_a_dropped_plan_freed():
    """The plan's arrays come from the core's block pool: once a plan is dropped, the next one of
    the same size takes its blocks again instead of fresh pages from the system (which glibc may
    or may not hand back, depending on the process's earlier allocations) - also when earlier,
    differently sized plans filled the pool (their size classes make room)."""
    big = Planner(LayoutConfig(dp=256, cp=8, pool_size=8, context=262144), ModelConfig(),
                  PlannerOptions(system="libra"))
    seqs = LengthSource(preset="libra-256k").step(8 * 256, 262144, 0, 0)
    held = []  # plans of another size, held together and dropped: the pool fills with them
    while sum(a.nbytes for p in held for a in vars(p).values()
              if isinstance(a, np.ndarray)) < 1 << 28:
        held.append(big.plan(seqs))
    del held
    assert core.block_pool()["kept_bytes"] > (1 << 28) * 0.75
    layout = LayoutConfig(dp=64, cp=8, pool_size=8, context=262144)
    planner = Planner(layout, ModelConfig(), PlannerOptions(system="libra"))
    seqs = LengthSource(preset="libra-256k").step(8 * 64, 262144, 0, 0)
    for _ in range(2):  # the first plan takes fresh blocks, the second may still grow classes
        plan = planner.plan(seqs)
        assert plan.tile_seq.nbytes >= 1 << 16  # arrays large enough to be pooled
        del plan
    before = core.block_pool()
    assert before["kept_bytes"] > 0
    for _ in range(3):
        plan = planner.plan(seqs)
        del plan
    after = core.block_pool()
    assert after["reused"] > before["reused"]
    assert after["fresh"] == before["fresh"]  # the same step again: every block a kept one
    assert after["kept_bytes"] <= 1 << 28 and after["evicted"] > 0
