"""DistCA as deployed, as a simulated peer: every GPU an attention server.

The project's planner runs `distca` with one attention server per replica (the heads split
evenly over its C GPUs by Ulysses): the stronger variant, named `distca-replica` in the
simulator. DistCA's own planner (hao-ai-lab/distca, `distca/planner/planner.py`) makes every GPU
a server, which is what the simulator's `distca` models (`system.distca_server: gpu`):

- layout: a micro-batch's D sequences (one per replica, the production order) laid out over
  the D*C GPUs in order, S/C tokens each; a document cut at a GPU boundary leaves on each GPU it
  touches one piece of two parts, the next rows from its front (head) and the next from its back
  (tail), half of the piece each (the head the smaller half);
- balance (`Planner.plan_items`): recipients are the GPUs below the mean, served in order of
  deficit (largest first, ties by GPU); a recipient takes work while its deficit exceeds
  `tolerance` x mean: among the pieces on GPUs with surplus (in list order, pieces split off
  appended), the one with the lowest priority - bytes to ship (its share of query rows times the
  hidden size, plus the document's whole KV) per unit of work it can give, min(donor's surplus,
  recipient's need, piece's work) - gives that much: the whole piece if it can, else
  m = floor(amount / (l + 1)) rows from each end of its head and tail (l: the document's
  length; no row: that recipient is done);
- work per part: q x kv - q (q - 1) / 2 (q rows ending at key kv: the causal pairs).

DistCA's split keeps its work accounting exact for documents of even length only (its planner
asserts so); here the work moved is counted row by row, so the two agree on even documents and
odd ones stay exact. `tools/compare_distca.py` runs DistCA's own code beside this on the
project's steps. `traffic` counts the rows a micro-batch ships between GPUs (the simulator's
all-to-all time for `distca`); where a GPU is a replica (cp 1) the planner makes the same
decisions (`distca_server = gpu`) and the operator runs them.
"""

from __future__ import annotations

import numpy as np


def pairs(q, kv):
    """Causal pairs of q query rows ending at key kv (DistCA's work of a part)."""
    return q * kv - q * (q - 1) // 2


def layout_pieces(sequences: list[list[int]], per_gpu: int, n_gpus: int, with_docs: bool = False):
    """DistCA's initial layout (`batch_to_items_general`): parallel arrays per piece - document
    length, GPU, head (q, kv), tail (q, kv; q = 0 for a whole document) - in DistCA's order;
    `with_docs`: and each piece's document (its index in the micro-batch)."""
    L, G, HQ, HK, TQ, TK, DOC = [], [], [], [], [], [], []
    budget = [per_gpu] * n_gpus
    g = 0
    for doc, length in enumerate(x for seq in sequences for x in seq):
        left, head_end, tail_start = length, 0, length
        while left > 0:
            while g < n_gpus and budget[g] == 0:
                g += 1
            if g >= n_gpus:
                raise ValueError(f"the micro-batch's documents exceed {n_gpus} x {per_gpu} tokens")
            chunk = min(left, budget[g])
            L.append(length)
            DOC.append(doc)
            G.append(g)
            if chunk == length:  # the whole document
                HQ.append(length), HK.append(length), TQ.append(0), TK.append(0)
            else:
                qh = chunk // 2
                qt = chunk - qh
                HQ.append(qh), HK.append(head_end + qh), TQ.append(qt), TK.append(tail_start)
                head_end += qh
                tail_start -= qt
            budget[g] -= chunk
            left -= chunk
    if with_docs:
        return [np.asarray(a, dtype=np.int64) for a in (L, G, HQ, HK, TQ, TK, DOC)]
    return [np.asarray(a, dtype=np.int64) for a in (L, G, HQ, HK, TQ, TK)]


def balance(sequences: list[list[int]], per_gpu: int, n_gpus: int, tolerance: float,
            hidden: int, kv_hidden: int, pieces: bool = False):
    """[n_gpus] attention work (causal pairs, all heads counted once) per GPU after DistCA's
    greedy on one micro-batch. `hidden` / `kv_hidden`: query and KV hidden sizes (heads x head
    dim), which weigh the bytes of a move. `pieces`: also return (initial layout, final pieces),
    each as parallel arrays (GPU, head q and kv, tail q and kv, document), for `traffic`."""
    L, G, HQ, HK, TQ, TK, DOC = layout_pieces(sequences, per_gpu, n_gpus, with_docs=True)
    home = (G, HQ, HK, TQ, TK, DOC)  # (the arrays grown below are new ones)
    cap = len(L) + 4 * n_gpus * 8 + 64  # pieces split off: a few per recipient
    def grow(a, fill=0):
        out = np.full(cap, fill, dtype=a.dtype)
        out[: len(a)] = a
        return out
    n = len(L)
    L, G, HQ, HK, TQ, TK, DOC = (grow(a) for a in (L, G, HQ, HK, TQ, TK, DOC))
    whole = np.zeros(cap, dtype=bool)
    whole[:n] = TQ[:n] == 0
    W = np.zeros(cap, dtype=np.float64)
    W[:n] = (pairs(HQ[:n], HK[:n]) + pairs(TQ[:n], TK[:n])).astype(np.float64)
    load = np.bincount(G[:n], weights=W[:n], minlength=n_gpus).astype(np.float64)
    mean = load.sum() / n_gpus
    surplus = load - mean
    threshold = mean * tolerance
    recipients = sorted(((i, s) for i, s in enumerate(surplus) if s < 0), key=lambda x: x[1])
    for r, deficit in recipients:
        need = -deficit
        while need > threshold:
            if not (surplus > 0).any():
                break
            ok = (surplus[G[:n]] > 0) & (W[:n] > 0)
            if not ok.any():
                break
            idx = np.flatnonzero(ok)
            s_d = surplus[G[idx]]
            w = W[idx]
            best = np.minimum(np.minimum(s_d, need), w)  # min(local surplus, remote deficit, work)
            q_len = best / (L[idx] + 1)
            comm = q_len * hidden + 2 * (L[idx] + 1) * kv_hidden
            prio = comm / best
            k = int(idx[int(np.argmin(prio))])
            amount = min(need, W[k], surplus[G[k]])
            donor = int(G[k])
            if amount >= W[k]:  # the whole piece moves
                moved = W[k]
                G[k] = r
            else:
                m = int(amount / (L[k] + 1))
                if m <= 0:
                    break
                if whole[k]:  # a whole document becomes its head and tail halves
                    q = HQ[k]
                    HQ[k], HK[k] = (q + 1) // 2, (q + 1) // 2
                    TQ[k], TK[k] = q // 2, q
                    whole[k] = False
                m = min(m, int(HQ[k]), int(TQ[k]))
                if m <= 0:
                    break
                before = W[k]
                HQ[k] -= m
                HK[k] -= m
                new_hq, new_hk = m, HK[k] + m  # the rows removed from the head's end
                TQ[k] -= m  # the tail's first m rows go: they end where the rest starts
                new_tq = m
                new_tk = TK[k] - TQ[k]
                W[k] = float(pairs(HQ[k], HK[k]) + pairs(TQ[k], TK[k]))
                moved = before - W[k]
                if n >= cap:
                    raise RuntimeError("distca_gpu: more pieces than planned for")
                L[n], G[n], HQ[n], HK[n], TQ[n], TK[n] = L[k], r, new_hq, new_hk, new_tq, new_tk
                DOC[n] = DOC[k]
                W[n] = float(pairs(new_hq, new_hk) + pairs(new_tq, new_tk))
                n += 1
            if not moved > 0:
                break
            surplus[donor] -= moved
            surplus[r] += moved
            need -= moved
    work = np.bincount(G[:n], weights=W[:n], minlength=n_gpus)
    if not pieces:
        return work
    return work, (home, (G[:n], HQ[:n], HK[:n], TQ[:n], TK[:n], DOC[:n]))


def _overlap(lo: int, hi: int, spans: list) -> int:
    """Rows of [lo, hi) inside the (lo, hi) spans."""
    return sum(max(0, min(hi, b) - max(lo, a)) for a, b in spans)


def traffic(layout: tuple, n_gpus: int) -> np.ndarray:
    """[n_gpus, 2] rows each GPU sends (and as many it receives) for one layer's attention,
    forward and backward: query-sized rows and KV rows. A server takes the query rows of its
    pieces that live elsewhere (`home`: DistCA's initial layout) and, per document, the KV rows
    of [0, its pieces' furthest key) that live elsewhere; it returns their outputs. Forward: Q
    and KV to the server, O back; backward: dO to the server, dQ and dKV back. So each query
    row crosses twice each way and each KV row once each way, for server and home alike."""
    (hG, hHQ, hHK, hTQ, hTK, hDOC), (G, HQ, HK, TQ, TK, DOC) = layout
    spans: dict = {}  # (doc, gpu) -> row spans living there
    for i in range(len(hG)):
        lst = spans.setdefault((int(hDOC[i]), int(hG[i])), [])
        if hHQ[i]:
            lst.append((int(hHK[i] - hHQ[i]), int(hHK[i])))
        if hTQ[i]:
            lst.append((int(hTK[i] - hTQ[i]), int(hTK[i])))
    homes: dict = {}  # doc -> the GPUs its rows live on
    for doc, g in spans:
        homes.setdefault(doc, []).append(g)
    q_rows, kv_rows = np.zeros(n_gpus), np.zeros(n_gpus)  # one way, at the server and the home
    need: dict = {}  # (doc, server) -> furthest key
    for i in range(len(G)):
        g, doc = int(G[i]), int(DOC[i])
        if homes[doc] == [g]:
            continue  # a document wholly on its server: nothing moves
        for q, kv in ((int(HQ[i]), int(HK[i])), (int(TQ[i]), int(TK[i]))):
            if q <= 0:
                continue
            for h in homes[doc]:
                if h != g:
                    rows = _overlap(kv - q, kv, spans[(doc, h)])
                    q_rows[g] += rows
                    q_rows[h] += rows
            need[(doc, g)] = max(need.get((doc, g), 0), kv)
    for (doc, g), kv in need.items():
        for h in homes[doc]:
            if h != g:
                rows = _overlap(0, kv, spans[(doc, h)])
                kv_rows[g] += rows
                kv_rows[h] += rows
    return np.stack([2 * q_rows, kv_rows], axis=1)


def slots_of(sequences: list, dp: int, order: str) -> list[list]:
    """The step's micro-batches: the D sequences of each slot, replica by replica, in the
    production order (docs/plan_contract.md; one sequence per micro-batch and replica)."""
    m = len(sequences) // dp
    if order == "contiguous":
        return [[sequences[r * m + k] for r in range(dp)] for k in range(m)]
    return [[sequences[k * dp + r] for r in range(dp)] for k in range(m)]
