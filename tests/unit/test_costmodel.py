"""The planner's cost model: bins, the C++ planner balancing a table's predicted time (and
bit-identical plans without one), the non-negative least squares, and the online fit."""

import numpy as np
import pytest

from libra_ext import _planner as core
from libra_ext import costmodel as cm
from libra_ext.planner import LayoutConfig, Planner, PlannerOptions
from libra_ext.workload import ModelConfig

MODEL = ModelConfig(heads=8, kv_heads=2, head_dim=64)
LAYOUT = LayoutConfig(dp=8, cp=1, pool_size=4, context=4096)


def _steps(seed=0, n=3):
    """Packed sequences of one long document or many short ones."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        seqs = []
        for _ in range(16):
            if rng.random() < 0.3:
                seqs.append([4096])
            else:
                L = rng.integers(8, 96, 200)
                L = L[np.cumsum(L) <= 4096]
                seqs.append([int(x) for x in L] + ([4096 - int(L.sum())] if L.sum() < 4096 else []))
        out.append(seqs)
    return out


def _short_heavy() -> cm.CostTable:
    """A device where short documents cost far more than their pairs: a per-segment cost and a
    slow rate below 256 keys."""
    per_pair = np.where(np.arange(cm.BINS) < 16, 4e-9, 1e-9)
    return cm.CostTable(per_pair, per_row=2e-8, per_segment=2e-5)


def _tile_work(plan, table) -> np.ndarray:
    """Per replica, the table's time of the tiles it executes (cost.h's formula)."""
    c = table.to_core()
    out = np.zeros(plan.dp)
    for t in range(len(plan.tile_seq)):
        h, docs = int(plan.tile_head_count[t]), int(plan.tile_doc_count[t])
        if docs == 1:  # per_segment only where the rows start the document
            kv = int(plan.tile_kv_len[t])
            w = c.rows(kv - int(plan.tile_q_len[t]), kv, h)
        else:
            d0 = int(plan.tile_doc[t])
            w = sum(c.segment(int(x), int(x), h) for x in plan.doc_lengths[d0:d0 + docs])
        out[plan.tile_executor[t]] += w
    return out


def test_bins_match_the_core_on_every_edge():
    ls = np.r_[np.arange(1, 3000), 2 ** np.arange(31), 2 ** np.arange(1, 31) - 1,
               np.random.default_rng(0).integers(1, 2**30, 5000)]
    assert np.array_equal(cm.bin_of(ls), [core.cost_bin(int(x)) for x in ls])
    assert core.cost_bin(1) == 0 and core.cost_bin(2) == 2 and core.cost_bin(3) == 3
    assert core.cost_bin(2**30) == cm.BINS - 1
    with pytest.raises(ValueError, match="kv_len"):
        core.cost_bin(0)
    # a segment's features, the core's and numpy's, for rows that span many bins
    rng = np.random.default_rng(1)
    for k in np.r_[1, 2, 3, 7, 8, 4095, 4096, rng.integers(1, 2**30, 50)]:
        for q in {1, int(k), int(rng.integers(1, k + 1))}:
            want = np.array(core.cost_features(q, int(k), 3))
            got = cm.segment_features([q], [int(k)], 3)
            assert np.array_equal(got, want), (q, k)
            pairs = 3 * (q * int(k) - q * (q - 1) // 2)
            assert got[: cm.BINS].sum() == pytest.approx(pairs, rel=1e-12)


def test_without_a_table_plans_are_unchanged_and_a_table_is_undone_by_none():
    seqs = _steps()[0]
    for system in ("libra", "distca", "ulysses", "wlb"):
        plain = Planner(LAYOUT, MODEL, PlannerOptions(system=system)).plan(seqs, flush=True)
        p = Planner(LAYOUT, MODEL, PlannerOptions(system=system))
        p.set_cost_model(_short_heavy())
        with_table = p.plan(seqs, flush=True)
        p = Planner(LAYOUT, MODEL, PlannerOptions(system=system))  # (wlb: a fresh delay queue)
        p.set_cost_model(_short_heavy())
        p.set_cost_model(None)
        again = p.plan(seqs, flush=True)
        assert again.hash == plain.hash, system
        if system == "ulysses":  # nothing to balance: the table changes nothing
            assert with_table.hash == plain.hash
        else:
            assert with_table.hash != plain.hash


def test_libra_and_distca_balance_the_tables_time():
    table = _short_heavy()
    for system in ("libra", "distca"):
        for seqs in _steps(1):
            pairs = Planner(LAYOUT, MODEL, PlannerOptions(system=system)).plan(seqs, flush=True)
            p = Planner(LAYOUT, MODEL, PlannerOptions(system=system))
            p.set_cost_model(table)
            timed = p.plan(seqs, flush=True)
            # the plan's loads are the table's time of each rank's tiles
            want = _tile_work(timed, table)
            assert np.allclose(timed.rank_load[:, 0], want, rtol=1e-9), system
            # and balanced in that time better than the pairs plan is
            got = _tile_work(pairs, table)
            assert want.max() / want.mean() < got.max() / got.mean(), system
            # same attention computed: every document's pairs, whatever the placement
            assert int((timed.tile_pairs * timed.tile_head_count).sum()) == int(
                (pairs.tile_pairs * pairs.tile_head_count).sum())


def test_wlbs_packing_balances_the_tables_time():
    # WLB-LLM packs whole documents: with a table each bucket's predicted time is balanced, not
    # its pairs (a mix of short documents, where the table's per-segment cost and slow short
    # rate dominate), and the plan's loads are the table's time of each rank's chunks
    table, c = _short_heavy(), _short_heavy().to_core()
    rng = np.random.default_rng(3)
    seqs = []
    for i in range(16):
        L = rng.integers(8, 64 if i % 2 else 1024, 400)
        seqs.append([int(x) for x in L[np.cumsum(L) <= 4096]])
    heads = MODEL.heads  # (cp 1, tp 1: a replica's heads)

    def spread(plan):
        w = [sum(c.segment(int(x), int(x), heads) for x in
                 plan.doc_lengths[plan.seq_doc_offsets[s]:plan.seq_doc_offsets[s + 1]])
             for s in range(len(plan.seq_doc_offsets) - 1)]
        return max(w) / np.mean(w)

    pairs = Planner(LAYOUT, MODEL, PlannerOptions(system="wlb")).plan(seqs, flush=True)
    p = Planner(LAYOUT, MODEL, PlannerOptions(system="wlb"))
    p.set_cost_model(table)
    timed = p.plan(seqs, flush=True)
    assert spread(timed) < spread(pairs) - 0.01, (spread(timed), spread(pairs))
    assert np.allclose(timed.rank_load[:, 0], _tile_work(timed, table), rtol=1e-9)
    assert sorted(timed.doc_lengths) == sorted(pairs.doc_lengths)  # the same documents


def test_a_tail_cut_is_the_first_row_within_the_budget():
    """TAP cuts a tile's tail rows where their price first fits half the gap; the O(log bins)
    search (bins' prefix sums, the quadratic inside a bin) lands on the row a scan of the
    planner's own prices finds, for any table, including zero rates and no per-row cost."""
    rng = np.random.default_rng(7)
    for trial in range(60):
        per_pair = rng.uniform(0.5e-9, 4e-9, cm.BINS)
        per_pair[rng.random(cm.BINS) < 0.2] = 0.0  # bins the device is free in
        per_pair[0] = 1e-9
        table = cm.CostTable(per_pair, per_row=float(rng.choice([0.0, 3e-8])),
                             per_segment=float(rng.choice([0.0, 1e-5])))
        c = table.to_core().prepared()  # priced as the planner prices
        b = int(rng.integers(8, 6000))
        heads = int(rng.integers(1, 9))
        lo = int(rng.integers(1, b // 2))
        hi = int(rng.integers(lo, b))
        prices = np.array([c.rows(x, b, heads) for x in range(lo, hi + 1)])
        wants = (0.0, prices.min(), prices.max(), float(rng.uniform(prices.min(), prices.max())),
                 float(prices[rng.integers(len(prices))]), 2 * prices.max())
        for want in wants:
            fits = np.flatnonzero(prices <= want)
            expect = lo + int(fits[0]) if len(fits) else hi
            assert c.tail_start(lo, hi, b, heads, want) == expect, (trial, lo, hi, b, heads, want)
    with pytest.raises(ValueError, match="hi must be in"):
        c.tail_start(5, 3, 100, 1, 1.0)
    with pytest.raises(ValueError, match="want must be finite"):
        c.tail_start(1, 3, 100, 1, float("nan"))


def test_a_re_cut_lands_on_the_row_a_binary_search_finds():
    """Where TAP re-cuts a fragmented document into contiguous pieces, each boundary is the
    first row whose prefix weighs at least the target; the O(log bins) inversion lands where a
    binary search over the planner's own prices does, for any table, zero rates included."""
    rng = np.random.default_rng(11)
    for trial in range(60):
        per_pair = rng.uniform(0.5e-9, 4e-9, cm.BINS)
        per_pair[rng.random(cm.BINS) < 0.2] = 0.0
        per_pair[0] = 1e-9
        table = cm.CostTable(per_pair, per_row=float(rng.choice([0.0, 3e-8])),
                             per_segment=float(rng.choice([0.0, 1e-5])))
        c = table.to_core().prepared()
        l = int(rng.integers(4, 40000))
        heads = int(rng.integers(1, 9))
        lo = int(rng.integers(1, l))
        hi = int(rng.integers(lo, l + 1))
        prices = np.array([c.rows(0, x, heads) for x in range(lo, hi + 1)])
        wants = (0.0, prices.min(), prices.max(), float(rng.uniform(prices.min(), prices.max())),
                 float(prices[rng.integers(len(prices))]), 2 * prices.max())
        for want in wants:
            a, b = lo, hi  # contiguous_pieces' binary search, before the inversion
            while a < b:
                mid = a + (b - a) // 2
                if c.rows(0, mid, heads) >= want:
                    b = mid
                else:
                    a = mid + 1
            assert c.prefix_end(lo, hi, heads, want) == a, (trial, lo, hi, heads, want)
    with pytest.raises(ValueError, match="hi must be in"):
        c.prefix_end(5, 3, 1, 1.0)
    with pytest.raises(ValueError, match="want must be finite"):
        c.prefix_end(1, 3, 1, float("inf"))


def test_a_table_changed_in_place_is_priced_anew():
    """Options keep their table's O(1) price tables from one plan to the next; an entry changed
    in place (options.cost.per_pair = ...) is priced and planned as a table set afresh."""
    a, b = _short_heavy(), cm.CostTable(np.full(cm.BINS, 1e-9), per_row=1e-8, per_segment=5e-6)
    changed = PlannerOptions(system="libra").to_core()
    changed.cost = a.to_core()
    changed.cost.per_pair = list(b.to_core().per_pair)
    changed.cost.per_row, changed.cost.per_segment = 1e-8, 5e-6
    fresh = PlannerOptions(system="libra").to_core()
    fresh.cost = b.to_core()
    for q, kv in ((1, 1), (100, 5000), (3000, 3000), (10, 200000)):
        assert changed.cost.segment(q, kv, 4) == fresh.cost.segment(q, kv, 4)
    seqs = _steps()[0]
    plans = []
    for opts in (changed, fresh):
        p = Planner(LAYOUT, MODEL, PlannerOptions(system="libra"))
        p._options = opts
        plans.append(p.plan(seqs))
    assert plans[0].hash == plans[1].hash
    with_a = Planner(LAYOUT, MODEL, PlannerOptions(system="libra"))
    with_a.set_cost_model(a)
    assert with_a.plan(seqs).hash != plans[0].hash


def test_a_bad_table_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"per_pair\[3\]"):
        cm.CostTable(np.r_[np.ones(3), -1.0, np.ones(cm.BINS - 4)])
    with pytest.raises(ValueError, match=f"{cm.BINS} entries"):
        cm.CostTable(np.ones(5))
    with pytest.raises(ValueError, match="at least one entry must be positive"):
        cm.CostTable(np.zeros(cm.BINS))
    with pytest.raises(ValueError, match="per_segment"):
        cm.CostTable(np.ones(cm.BINS), per_segment=float("nan"))
    with pytest.raises(ValueError, match=r"t\.per_pair\[2\]"):
        cm.CostTable.from_dict({"per_pair": [1.0, 1.0, "x"] + [1.0] * (cm.BINS - 3)}, "t")
    with pytest.raises(ValueError, match="unknown keys"):
        cm.CostTable.from_dict({"per_pair": [1.0] * cm.BINS, "rate": 1})
    d = _short_heavy().to_dict()
    assert cm.CostTable.from_dict(d).to_dict() == d


def _kkt(G, b, prior, alpha, x, tol):
    n = len(b)
    d = np.where(np.diag(G) > 0, np.diag(G), 1.0)
    H = G + alpha * np.diag(d)
    c = b + alpha * d * prior
    g = H @ x - c
    scale = np.abs(c).max()
    assert (x >= 0).all()
    assert np.all(np.abs(g[x > 0]) <= tol * scale)
    assert np.all(g[x == 0] >= -tol * scale)
    return n


def test_nnls_meets_its_optimality_conditions_and_is_deterministic():
    rng = np.random.default_rng(3)
    for trial in range(20):
        n = int(rng.integers(2, 40))
        A = rng.normal(size=(int(rng.integers(1, 60)), n)) * rng.lognormal(0, 3, n)
        y = rng.normal(size=len(A))
        G, b = A.T @ A, A.T @ y
        prior = rng.random(n)
        x, sweeps, ok = core.nnls_normal(G.ravel().tolist(), b.tolist(), prior.tolist(), 1e-3)
        assert ok, trial
        _kkt(G, b, prior, 1e-3, np.array(x), 1e-7)
        assert core.nnls_normal(G.ravel().tolist(), b.tolist(), prior.tolist(), 1e-3)[0] == x
    with pytest.raises(ValueError, match="G must be 2 x 2"):
        core.nnls_normal([1.0, 0.0, 0.0], [1.0, 1.0], [0.0, 0.0], 1e-3)
    with pytest.raises(ValueError, match=r"G\[1\] is not finite"):
        core.nnls_normal([1.0, float("nan"), 0.0, 1.0], [1.0, 1.0], [0.0, 0.0], 1e-3)
    with pytest.raises(ValueError, match="alpha"):
        core.nnls_normal([1.0], [1.0], [0.0], 0.0)


def _rank_rows(rng, table, n_ranks=8, noise=0.01):
    F = []
    for _ in range(n_ranks):  # ranks of many short documents beside ranks of a few long ones
        L = rng.lognormal(rng.uniform(3, 8), 1.0, int(rng.integers(5, 300))).astype(int) + 1
        f = cm.segment_features(L, L, 4)
        f[cm.CONSTANT] = 1
        F.append(f)
    F = np.array(F)
    return F, table.predict(F) * rng.normal(1, noise, len(F))


def test_online_fit_learns_the_device_drops_outliers_and_restores():
    rng = np.random.default_rng(1)
    true = cm.CostTable(np.where(np.arange(cm.BINS) < 16, 2e-9, 1e-9), 1e-7, 5e-5, 1e-3)
    fit = cm.OnlineFit()
    assert fit.fit() is None  # nothing measured yet: no table
    for step in range(12):
        F, y = _rank_rows(rng, true)
        if step == 8:
            y[0] *= 5  # a pre-empted rank
        fit.add(F, y)
        fit.fit()
    assert fit.dropped >= 1
    F, y = _rank_rows(rng, true, n_ranks=64, noise=0.0)
    assert cm.error_of(fit.table.predict(F), y) < 0.03
    # one segment at a time, across lengths: what the planner asks of it
    seg = np.array([cm.segment_features([x], [x], 4) for x in (30, 100, 400, 1500, 6000)])
    assert cm.error_of(fit.table.predict(seg), true.predict(seg)) < 0.1
    # the same rows give the same bits; the state round-trips
    other = cm.OnlineFit()
    other.load_state_dict(fit.state_dict())
    assert np.array_equal(other.table.coefficients(), fit.table.coefficients())
    F, y = _rank_rows(rng, true)
    fit.add(F, y)
    other.add(F, y)
    assert np.array_equal(fit.fit().coefficients(), other.fit().coefficients())
    with pytest.raises(ValueError, match="cost_fit: G must hold"):
        other.load_state_dict({"table": None, "G": [1.0], "b": []})
    with pytest.raises(ValueError, match="row 0"):
        fit.add(np.full((1, cm.FEATURES), np.nan), [1.0])


def test_profile_table_follows_the_profiles_efficiency():
    from libra_ext.simulator.hardware import HardwareProfile

    hw = HardwareProfile.load("h200-sxm")
    t = cm.CostTable.from_profile(hw, 128)
    # longer attended lengths run at a higher efficiency: less time per pair
    assert t.per_pair[cm.bin_of(512)] > t.per_pair[cm.bin_of(65536)] > 0
    assert t.per_segment == 0 and t.per_row == 0  # the call floor is per call, not segment


def _online_cfg(interval=2):
    from megatron.libra.config import TrainConfig

    return TrainConfig.load("configs/train/cpu_tiny.yaml", [
        "system.cost_model=online", f"system.cost_fit_interval={interval}"])


def _step_rows(rank: int, step: int):
    """A rank's features and seconds at a step: ranks measure different times."""
    rng = np.random.default_rng(100 * step + rank)
    L = rng.lognormal(rng.uniform(3, 7), 1.0, int(rng.integers(5, 80))).astype(int) + 1
    f = cm.segment_features(L, L, 2)
    f[cm.CONSTANT] = 1
    return f, float(_short_heavy().predict(f)) * (1 + 0.05 * rank) + 1e-3


def test_cost_models_plan_each_step_with_a_settled_table_and_restore_it():
    from megatron.libra.steps import CostModels

    cfg = _online_cfg(interval=2)
    costs = CostModels(cfg, start_step=0, layers=2)
    assert costs.active and costs.table_for(0) is None and costs.table_for(2) is None
    for step in range(4):
        costs.step_end(step, *_step_rows(0, step))
    # fits after steps 1 and 3 plan steps 4 and 6 on
    assert costs.table_for(3) is None
    t4, t6 = costs.table_for(4), costs.table_for(6)
    assert t4 is not None and t6 is not None and costs.table_for(5) is t4
    assert not np.array_equal(t4.coefficients(), t6.coefficients())
    assert costs.fit_ms and max(costs.fit_ms) < 50
    # a step past the settled ones waits; a stopping sampler is let go
    import threading

    stop = threading.Event()
    stop.set()
    assert costs.table_for(50, stop) is t6
    # a resume restores the tables and the fit: the same tables from here on
    again = CostModels(cfg, start_step=4, layers=2)
    again.load_state_dict(costs.state_dict())
    for step in (4, 5, 6):
        assert np.array_equal(again.table_for(step).coefficients(),
                              costs.table_for(step).coefficients())
    for c in (costs, again):
        c.step_end(4, *_step_rows(0, 4))
        c.step_end(5, *_step_rows(0, 5))
    assert np.array_equal(again.table_for(8).coefficients(), costs.table_for(8).coefficients())
    with pytest.raises(ValueError, match=r"ck: cost_model\.tables\[0\] must be"):
        again.load_state_dict({"mode": "online", "tables": [7]}, "ck: cost_model")
    # a state saved under another cost model is refused, naming both
    pairs = CostModels(_pairs_cfg(), 0)
    with pytest.raises(ValueError, match="cost_model = online, this run has pairs"):
        pairs.load_state_dict(costs.state_dict())


def _pairs_cfg():
    from megatron.libra.config import TrainConfig

    return TrainConfig.load("configs/train/cpu_tiny.yaml", [])


def _fit_worker(rank, world, port, out):
    import torch
    import torch.distributed as dist

    from megatron.libra.steps import CostModels

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        costs = CostModels(_online_cfg(interval=3), 0, layers=1 + rank)
        for step in range(6):
            costs.step_end(step, *_step_rows(rank, step))
        coef = torch.tensor(costs.table_for(8).coefficients())
        every = [torch.zeros_like(coef) for _ in range(world)]
        dist.all_gather(every, coef)
        if rank == 0:
            np.save(out, torch.stack(every).numpy())
    finally:
        dist.destroy_process_group()


def test_every_rank_fits_the_same_table_bit_for_bit(tmp_path):
    from libra_ext.distributed import free_port, run_ranks

    out = str(tmp_path / "coef.npy")
    run_ranks(_fit_worker, (3, free_port(), out), 3)
    coef = np.load(out)
    assert (coef[0] > 0).any()
    assert all(np.array_equal(coef[0], c) for c in coef[1:])  # bitwise, not approximately


def test_plan_explain_names_each_pools_bound_hold_and_moves(capsys, tmp_path):
    import json

    from libra_ext import explain
    from megatron.libra.cli import main

    args = ["plan", "--workload", "libra-256k", "--context", "32768", "--gbs", "16", "--dp", "8",
            "--cp", "2", "--pool-size", "4", "--steps", "2", "--explain"]
    assert main(args + ["--json"]) == 0
    pairs = json.loads(capsys.readouterr().out)
    ex = pairs["explain"]
    assert len(ex["pools"]) == 2
    loads = np.concatenate([p["loads"] for p in ex["pools"]])
    assert loads.mean() == pytest.approx(1.0) and loads.max() == pytest.approx(ex["max_over_mean"])
    for p in ex["pools"]:
        assert p["max"] >= p["bound"] - 1e-9 and p["why"]
        assert [m["work"] for m in p["moves"]] == sorted((m["work"] for m in p["moves"]),
                                                         reverse=True)
        assert all(m["owner"] != m["executor"] and m["bytes"] > 0 for m in p["moves"])
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "explain:" in text and "pool 1 (replicas 4-7)" in text and "held by" in text
    # a table from a file (a replay result's online_table, or the table itself) or a profile
    path = tmp_path / "replay.json"
    path.write_text(json.dumps({"online_table": _short_heavy().to_dict()}))
    assert main(args + ["--json", "--cost-table", str(path)]) == 0
    with_table = json.loads(capsys.readouterr().out)
    assert with_table["hashes"] != pairs["hashes"] and "explain" in with_table
    assert main(args + ["--cost-table", "profile"]) == 0 and "explain:" in capsys.readouterr().out
    assert main(args + ["--cost-table", str(tmp_path / "none.json")]) == 2
    assert "cannot open" in capsys.readouterr().err
    # under a table the work is the table's: the plan made with it is at its bound too
    seqs = _steps()[0]
    p = Planner(LAYOUT, MODEL, PlannerOptions(system="libra"))
    p.set_cost_model(_short_heavy())
    ex = explain.explain(p.plan(seqs), table=_short_heavy())
    assert ex["max_over_mean"] == pytest.approx(p.plan(seqs).max_over_mean, rel=1e-9)


def test_the_split_error_leaves_out_what_moves_every_rank_alike():
    # predictions off by one factor for the whole step split its time exactly
    measured = np.array([1.0, 2.0, 3.0, 4.0])
    assert cm.split_error_of(1.7 * measured, measured) == pytest.approx(0.0, abs=1e-15)
    assert cm.error_of(1.7 * measured, measured) == pytest.approx(0.7)
    # otherwise the split's error is the error of the predictions scaled to the measured total
    pred = np.array([1.1, 1.8, 3.3, 3.9])
    for c in (0.5, 1.0, 3.0):
        assert cm.split_error_of(c * pred, measured) == pytest.approx(
            cm.error_of(pred * measured.sum() / pred.sum(), measured))
    assert cm.split_error_of(np.zeros(4), measured) == cm.error_of(np.zeros(4), measured)
