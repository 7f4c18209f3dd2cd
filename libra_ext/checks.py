"""Independent checks of a StepPlan, written without the planner's code.

`pairs_exact` proves every causal (query, key) pair of every document is computed exactly once
per head; `samples_preserved` proves the step trains on exactly its input sequences.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from libra_ext.planner import StepPlan


def _doc_starts(plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
    """Per document: its sequence and its first token inside that sequence."""
    n_doc = len(plan.doc_lengths)
    off = plan.seq_doc_offsets
    doc_seq = np.repeat(np.arange(plan.n_seq), np.diff(off))
    cum = np.concatenate([[0], np.cumsum(plan.doc_lengths)])
    seq_first = cum[off[:-1]]  # token index (over all sequences) of each sequence's start
    start = cum[:n_doc] - seq_first[doc_seq] if n_doc else np.zeros(0, dtype=np.int64)
    return doc_seq, start


def pairs_exact(plan: StepPlan) -> tuple[bool, str]:
    """True iff the tiles cover every causal pair of every document exactly once per head.

    A tile covering one document must be query rows [a, b) of it with KV = the document's first b
    tokens; a tile of several whole documents has KV = its query range. For each document and each
    head (cp == -1 tiles: heads of one Ulysses slice; cp >= 0 tiles: the tp slice, split across cp
    ranks) the query row ranges must tile [0, length) without gap or overlap.
    """
    n_doc = len(plan.doc_lengths)
    if plan.n_tiles == 0:
        return (n_doc == 0, "no tiles" if n_doc else "ok")
    doc_seq, start = _doc_starts(plan)
    L = plan.doc_lengths
    t_doc, t_cnt = plan.tile_doc, plan.tile_doc_count
    if (t_doc < 0).any() or (t_doc + t_cnt > n_doc).any() or (t_cnt < 1).any():
        return False, "tile document index out of range"
    if (doc_seq[t_doc] != plan.tile_seq).any() or (
        doc_seq[t_doc + t_cnt - 1] != plan.tile_seq
    ).any():
        return False, "tile documents not in the tile's sequence"
    ulysses_like = plan.tile_cp < 0
    if ulysses_like.any() and not ulysses_like.all():
        return False, "a plan mixes cp == -1 tiles and per-cp tiles"
    space = plan.heads_local if ulysses_like.all() else plan.heads_local * plan.cp
    hs, hc = plan.tile_head_start, plan.tile_head_count
    if (hs < 0).any() or (hc < 1).any() or (hs + hc > space).any():
        return False, "tile heads outside the head slice"
    if (plan.tile_cp >= plan.cp).any():
        return False, "tile cp rank out of range"
    # Expand tiles to rows (doc, head segment, a, b) over the head boundaries used by any tile.
    bounds = np.unique(np.concatenate([[0, space], hs, hs + hc]))
    seg_lo = np.searchsorted(bounds, hs)
    seg_hi = np.searchsorted(bounds, hs + hc)
    n_seg = len(bounds) - 1
    rows_doc, rows_a, rows_b, rows_tile = [], [], [], []
    single = t_cnt == 1
    # Single-document tiles.
    idx = np.flatnonzero(single)
    a = plan.tile_q_start[idx] - start[t_doc[idx]]
    b = a + plan.tile_q_len[idx]
    if (a < 0).any() or (b > L[t_doc[idx]]).any() or (plan.tile_q_len[idx] < 1).any():
        return False, "a tile's query rows leave its document"
    if (plan.tile_kv_start[idx] != start[t_doc[idx]]).any() or (plan.tile_kv_len[idx] != b).any():
        return False, "a tile's KV range is not the causal prefix of its last query row"
    if (plan.tile_pairs[idx] != (b * (b + 1) - a * (a + 1)) // 2).any():
        return False, "a tile's pair count does not match its rows"
    rows_doc.append(t_doc[idx])
    rows_a.append(a)
    rows_b.append(b)
    rows_tile.append(idx)
    # Multi-document tiles: expand to their whole documents.
    idx = np.flatnonzero(~single)
    for t in idx:
        d0, k = int(t_doc[t]), int(t_cnt[t])
        docs = np.arange(d0, d0 + k)
        q0, q1 = int(plan.tile_q_start[t]), int(plan.tile_q_start[t] + plan.tile_q_len[t])
        if int(start[d0]) != q0 or int(start[d0 + k - 1] + L[d0 + k - 1]) != q1:
            return False, f"tile {t}: query range is not its documents"
        if int(plan.tile_kv_start[t]) != q0 or int(plan.tile_kv_len[t]) != q1 - q0:
            return False, f"tile {t}: KV range of a multi-document tile must equal its query range"
        if int(plan.tile_pairs[t]) != int((L[docs] * (L[docs] + 1) // 2).sum()):
            return False, f"tile {t}: pair count does not match its documents"
        rows_doc.append(docs)
        rows_a.append(np.zeros(k, dtype=np.int64))
        rows_b.append(L[docs])
        rows_tile.append(np.full(k, t))
    tile_of_row = np.concatenate(rows_tile)
    doc = np.concatenate(rows_doc)
    ra = np.concatenate(rows_a)
    rb = np.concatenate(rows_b)
    reps = (seg_hi - seg_lo)[tile_of_row]
    doc, ra, rb = np.repeat(doc, reps), np.repeat(ra, reps), np.repeat(rb, reps)
    first_seg = np.repeat(seg_lo[tile_of_row], reps)
    within = np.arange(len(doc)) - np.repeat(np.cumsum(reps) - reps, reps)
    seg = first_seg + within
    order = np.lexsort((ra, seg, doc))
    doc, seg, ra, rb = doc[order], seg[order], ra[order], rb[order]
    key = doc * n_seg + seg
    new_key = np.concatenate([[True], key[1:] != key[:-1]])
    last_of_key = np.concatenate([new_key[1:], [True]])
    if len(np.unique(key)) != n_doc * n_seg:
        return False, "some (document, head) is not covered at all"
    if (ra[new_key] != 0).any():
        return False, "a document's first query rows are not covered"
    if (rb[last_of_key] != L[doc[last_of_key]]).any():
        return False, "a document's last query rows are not covered"
    cont = ~new_key[1:]
    if (ra[1:][cont] != rb[:-1][cont]).any():
        return False, "query rows of a document overlap or leave a gap"
    return True, "ok"


def samples_preserved(inputs: Sequence[Sequence[int]], plan: StepPlan) -> tuple[bool, str]:
    """True iff the plan executes exactly the input sequences, each at one distinct
    (replica, slot), every (replica, slot) used once. (wlb repacks; check it with
    `documents_preserved` over a whole run instead.)"""
    if plan.sequences() != [list(map(int, s)) for s in inputs]:
        return False, "executed sequences differ from the input"
    pairs = plan.seq_replica * plan.slots + plan.seq_slot
    if ((plan.seq_replica < 0) | (plan.seq_replica >= plan.dp)).any():
        return False, "replica out of range"
    if ((plan.seq_slot < 0) | (plan.seq_slot >= plan.slots)).any():
        return False, "slot out of range"
    if len(np.unique(pairs)) != plan.n_seq or plan.n_seq != plan.dp * plan.slots:
        return False, "a (replica, slot) holds two sequences or none"
    return True, "ok"


def documents_preserved(
    input_lengths: Sequence[int], plans: Sequence[StepPlan]
) -> tuple[bool, str]:
    """For a run of wlb plans (flushed at the end): every input document (ids in input order) is
    executed exactly once with its length."""
    ids = np.concatenate([p.doc_ids for p in plans]) if plans else np.zeros(0, dtype=np.int64)
    lens = np.concatenate([p.doc_lengths for p in plans]) if plans else np.zeros(0, dtype=np.int64)
    want = np.asarray(list(input_lengths), dtype=np.int64)
    if len(ids) != len(want) or len(np.unique(ids)) != len(ids):
        return False, f"{len(ids)} documents executed for {len(want)} input documents"
    if ids.min(initial=0) < 0 or ids.max(initial=-1) >= len(want):
        return False, "document id out of range"
    if (want[ids] != lens).any():
        return False, "a document changed length"
    return True, "ok"
