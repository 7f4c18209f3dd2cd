"""`libra plan --explain`: why a step's plan balances as it does, pool by pool.

For each layout pool (P replicas, all their slots): the per-rank load the pool could reach (its
total over P, or the largest piece TAP cannot cut, whichever is larger), what each member got,
what kept the busiest member above the bound, and the largest tiles moved with their work and
bytes. Work is the planner's: causal pairs x heads, or a cost table's predicted time when the
plan was made with one (pass the same table). Loads are shown over the step's mean rank load,
so 1.000 is a perfectly balanced step.
"""

from __future__ import annotations

import numpy as np

from libra_ext.planner import StepPlan
from libra_ext.workload import block_pairs

REFINE_MIN_GAIN = 5e-4
"""TAP's refinement stops when a move would gain less than this share of the member mean
(`kRefineMinGain` in cpp/src/tap.cpp)."""


def _min_split_rows(context: int) -> int:
    return max(1, min(128, context // 32))


def tile_work(plan: StepPlan, table=None) -> np.ndarray:
    """Each tile's work: pairs x heads, or the table's time (cost.h's pricing)."""
    heads = plan.tile_head_count.astype(np.float64)
    if table is None:
        return plan.tile_pairs.astype(np.float64) * heads
    core = table.to_core()
    out = np.empty(plan.n_tiles)
    for t in range(plan.n_tiles):
        h, n = int(plan.tile_head_count[t]), int(plan.tile_doc_count[t])
        if n == 1:
            kv = int(plan.tile_kv_len[t])
            out[t] = core.rows(kv - int(plan.tile_q_len[t]), kv, h)
        else:
            d0 = int(plan.tile_doc[t])
            out[t] = sum(core.rows(0, int(x), h) for x in plan.doc_lengths[d0:d0 + n])
    return out


def explain(plan: StepPlan, epsilon: float = 0.02, table=None, top: int = 3) -> dict:
    """Per layout pool: bound, member loads, what held the busiest member above the bound and
    the largest moves (see the module's docstring)."""
    work = tile_work(plan, table)
    shared = plan.tile_cp < 0  # tiles every cp rank runs on its own heads (not wlb's)
    load = np.bincount(plan.tile_executor[shared], weights=work[shared], minlength=plan.dp)
    mean_all = float(load.mean()) if load.mean() > 0 else 1.0
    elem = plan.dtype_bytes * plan.head_dim
    g = max(1, plan.heads_local // max(1, plan.kv_heads_local))
    rows_min = _min_split_rows(plan.context)
    seq_of = plan.tile_seq
    pools = []
    for pool in range(plan.dp // plan.pool):
        members = np.arange(pool * plan.pool, (pool + 1) * plan.pool)
        mine = shared & np.isin(plan.tile_executor, members)
        L = load[members]
        mu = float(L.mean())
        busiest = int(members[int(np.argmax(L))])
        # the largest piece TAP cannot cut: the last rows_min rows of the pool's longest
        # document, one head
        seqs = np.flatnonzero(np.isin(plan.seq_replica, members))
        docs = np.concatenate([np.arange(plan.seq_doc_offsets[s], plan.seq_doc_offsets[s + 1])
                               for s in seqs]) if len(seqs) else np.array([], dtype=np.int64)
        longest = int(plan.doc_lengths[docs].max()) if len(docs) else 0
        rows = min(longest, rows_min)
        if table is None:
            unit = float(block_pairs(longest - rows, longest))
        else:
            unit = table.to_core().rows(longest - rows, longest, 1) if longest else 0.0
        bound = max(mu, unit)
        peak = float(L.max())
        on_busiest = np.flatnonzero(mine & (plan.tile_executor == busiest))
        # the least work the refinement can move off the busiest member: a whole tile, or the
        # last rows_min rows of a one-document tile long enough to cut
        least = np.inf
        for t in on_busiest.tolist():
            q, kv, h = (int(plan.tile_q_len[t]), int(plan.tile_kv_len[t]),
                        int(plan.tile_head_count[t]))
            piece = float(work[t])
            if plan.tile_doc_count[t] == 1 and q >= 2 * rows_min:
                piece = (float(block_pairs(kv - rows_min, kv) * h)
                         if table is None else table.to_core().rows(kv - rows_min, kv, h))
            least = min(least, piece)
        excess = peak - mu
        if peak <= bound * (1 + 1e-9):
            why = "at the bound"
        elif peak <= (1 + epsilon) * mu and excess <= 2 * REFINE_MIN_GAIN * mu + 1e-12:
            why = (f"the refinement's least gain: no move gains {REFINE_MIN_GAIN:g} of the "
                   "pool mean")
        elif least > excess:
            why = (f"indivisible work: the least TAP can move off the busiest member (a tile, "
                   f"or the last {rows_min} rows of one: {least / mean_all:.4f} of the mean "
                   f"rank) exceeds its excess over the pool mean ({excess / mean_all:.4f})")
        elif peak <= (1 + epsilon) * mu:
            why = (f"the soft cap: the busiest member is within (1 + epsilon) = {1 + epsilon:g} "
                   "of the pool mean, where TAP's greedy stops taking moves")
        else:
            why = "the refinement's move limit (max_refine_moves) or a cut it could not make"
        moved = np.flatnonzero(mine & (plan.tile_owner != plan.tile_executor))
        moved = moved[np.argsort(-work[moved], kind="stable")][:top]
        moves = []
        for t in moved.tolist():
            q, kv = int(plan.tile_q_len[t]), int(plan.tile_kv_len[t])
            h = int(plan.tile_head_count[t])
            kvh = max(1, -(-h // g))
            moves.append({
                "sequence": int(seq_of[t]), "document": int(plan.tile_doc[t]),
                "documents": int(plan.tile_doc_count[t]), "rows": q, "kv_len": kv, "heads": h,
                "owner": int(plan.tile_owner[t]), "executor": int(plan.tile_executor[t]),
                "work": float(work[t] / mean_all),
                # Q and O each way (fwd + bwd: dQ, dO) and the KV prefix with dK, dV, before
                # what is already resident on the executor
                "bytes": int(4 * q * h * elem + 4 * kv * kvh * elem),
            })
        pools.append({
            "pool": pool,
            "replicas": members.tolist(),
            "total": float(L.sum() / mean_all),
            "bound": float(bound / mean_all),
            "busiest": busiest,
            "max": float(peak / mean_all),
            "loads": (L / mean_all).tolist(),
            "why": why,
            "moves": moves,
            "moved_tiles": int((mine & (plan.tile_owner != plan.tile_executor)).sum()),
        })
    return {"system": plan.system, "mean_rank_load": mean_all, "pools": pools,
            "max_over_mean": float(load.max() / mean_all),
            "achievable_max_over_mean": float(plan.achievable_max_over_mean)}


def render(ex: dict) -> list[str]:
    """The explanation as text lines."""
    out = [f"explain: per-rank attention load over the step's mean rank (1.000 = balanced); "
           f"max/mean {ex['max_over_mean']:.4f}, achievable {ex['achievable_max_over_mean']:.4f}"]
    for p in ex["pools"]:
        out.append(f"  pool {p['pool']} (replicas {p['replicas'][0]}-{p['replicas'][-1]}): "
                   f"bound {p['bound']:.4f}, busiest replica {p['busiest']} at {p['max']:.4f}; "
                   f"held by {p['why']}")
        out.append("    member loads: " + " ".join(f"{x:.4f}" for x in p["loads"]) +
                   f"; {p['moved_tiles']} tile(s) moved")
        for m in p["moves"]:
            what = (f"rows of doc {m['document']} ({m['rows']} rows, prefix {m['kv_len']})"
                    if m["documents"] == 1 else
                    f"docs {m['document']}-{m['document'] + m['documents'] - 1} "
                    f"({m['rows']} tokens)")
            out.append(f"    move {what}, {m['heads']} head(s): replica {m['owner']} -> "
                       f"{m['executor']}, work {m['work']:.4f}, {m['bytes'] / 2**20:.2f} MiB")
    return out
