"""A straightforward pure-Python implementation of Libra's planner (VRSP + TAP).

It makes the same decisions as the C++ core, in the same order and with the same tie-breaks, so
tests can require identical placements, and `libra bench planner` can time the C++ core against
it. It is the readable statement of the algorithm, not a production path.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from libra_ext.workload import ATTN_BWD_FACTOR, block_pairs, causal_pairs


@dataclass
class ReferencePlan:
    seq_replica: list[int]
    seq_slot: list[int]
    # (seq, doc, doc_count, q_start, q_len, head_start, head_count, kv_start, kv_len, owner,
    #  executor)
    tiles: list[tuple]
    max_group: float
    lower_bound: float


def lpt(loads: list[float], n_groups: int, card: int) -> list[int]:
    """Exact-cardinality LPT, then swaps between the heaviest group and another."""
    order = sorted(range(len(loads)), key=lambda i: -loads[i])  # stable: ties by index
    heap = [(0.0, g) for g in range(n_groups)]
    count = [0] * n_groups
    group = [-1] * len(loads)
    for i in order:
        load, g = heapq.heappop(heap)
        group[i] = g
        count[g] += 1
        if count[g] < card:
            heapq.heappush(heap, (load + loads[i], g))
    return refine_by_swaps(loads, group, n_groups)


def refine_by_swaps(loads: list[float], group: list[int], n_groups: int) -> list[int]:
    """Swap an item of the heaviest group with a lighter one of another group while that lowers
    the heavier of the two below the current maximum."""
    group = list(group)
    gl = [0.0] * n_groups
    members: list[list[int]] = [[] for _ in range(n_groups)]
    for i, g in enumerate(group):
        gl[g] += loads[i]
        members[g].append(i)
    for _ in range(4 * len(loads)):
        hi = gl.index(max(gl))
        best, best_h, best_a, best_b = gl[hi], -1, 0, 0
        for h in range(n_groups):
            if h == hi:
                continue
            for a, ia in enumerate(members[hi]):
                for b, ib in enumerate(members[h]):
                    delta = loads[ia] - loads[ib]
                    if not delta > 0:
                        continue
                    pair_max = max(gl[hi] - delta, gl[h] + delta)
                    if pair_max < best:
                        best, best_h, best_a, best_b = pair_max, h, a, b
        if best_h < 0:
            break
        ia, ib = members[hi][best_a], members[best_h][best_b]
        delta = loads[ia] - loads[ib]
        gl[hi] -= delta
        gl[best_h] += delta
        members[hi][best_a], members[best_h][best_b] = ib, ia
        group[ia], group[ib] = best_h, hi
    return group


def lower_bound(loads: list[float], n_groups: int, card: int) -> float:
    x = sorted(loads, reverse=True)
    prefix = [0.0]
    for v in x:
        prefix.append(prefix[-1] + v)
    n = len(x)
    bound = prefix[n] / n_groups
    for j in range(1, card + 1):
        top = (j - 1) * n_groups + 1
        bound = max(bound, prefix[top] - prefix[top - j] + prefix[n] - prefix[n - (card - j)])
    for k in range(2, min(n_groups, n) + 1):
        least = min(
            (prefix[k] + prefix[n] - prefix[n - (q * card - k)]) / q
            for q in range((k + card - 1) // card, k + 1)
        )
        bound = max(bound, least)
    if card == 2:  # pairing the i-th heaviest with the i-th lightest is optimal
        for i in range(n // 2):
            bound = max(bound, x[i] + x[n - 1 - i])
    return bound


REFINE_MIN_GAIN = 5e-4


def min_split_rows(context: int) -> int:
    """Rows below which a tile is not split further: 128, or context / 32 for short contexts."""
    return max(1, min(128, context // 32))


def split_tile(t: list, doc_off: int, max_load: float, out: list, min_rows: int) -> None:
    """Split a single-document tile heavier than max_load: rows at the midpoint of work while it
    has at least 2 * min_rows rows, then heads in halves."""
    s, doc, cnt, q0, ql, h0, hc, kv0, kvl, pairs = t
    if max_load <= 0 or float(pairs) * float(hc) <= max_load or (hc == 1 and ql < 2 * min_rows):
        out.append(t)
        return
    if ql < 2 * min_rows:
        half = hc // 2
        split_tile(
            [s, doc, cnt, q0, ql, h0, half, kv0, kvl, pairs], doc_off, max_load, out, min_rows
        )
        split_tile(
            [s, doc, cnt, q0, ql, h0 + half, hc - half, kv0, kvl, pairs],
            doc_off,
            max_load,
            out,
            min_rows,
        )
        return
    a = q0 - doc_off
    b = a + ql
    mid = ((float(a) * (a + 1) + float(b) * (b + 1)) / 2.0) ** 0.5
    c = min(b - min_rows, max(a + min_rows, int(mid)))
    split_tile(
        [s, doc, cnt, q0, c - a, h0, hc, kv0, c, block_pairs(a, c)],
        doc_off,
        max_load,
        out,
        min_rows,
    )
    split_tile(
        [s, doc, cnt, doc_off + c, b - c, h0, hc, kv0, kvl, block_pairs(c, b)],
        doc_off,
        max_load,
        out,
        min_rows,
    )


def split_run(
    t: list, lengths: list, max_load: float, out: list, min_rows: int
) -> None:
    """Split a run of whole documents heavier than max_load at the document boundary that best
    halves its work; one document becomes a one-document tile, split by split_tile."""
    s, doc, cnt, q0, ql, h0, hc, kv0, kvl, pairs = t
    if cnt == 1:
        split_tile(t, q0, max_load, out, min_rows)
        return
    if max_load <= 0 or float(pairs) * float(hc) <= max_load:
        out.append(t)
        return
    left = left_len = 0
    best = None  # (worst side, k, left pairs, left tokens)
    for k in range(1, cnt):
        l = lengths[doc + k - 1]
        left += causal_pairs(l)
        left_len += l
        worst = max(left, pairs - left)
        if best is None or worst < best[0]:
            best = (worst, k, left, left_len)
    _, k, lp, ll = best
    split_run([s, doc, k, q0, ll, h0, hc, q0, ll, lp], lengths, max_load, out, min_rows)
    split_run(
        [s, doc + k, cnt - k, q0 + ll, ql - ll, h0, hc, q0 + ll, ql - ll, pairs - lp],
        lengths,
        max_load,
        out,
        min_rows,
    )


def production_slot(q: int, dp: int, m: int, order: str, micro_batch_size: int) -> tuple[int, int]:
    """(replica, slot) of input sequence q in production order: Megatron-LM's pretraining
    sampler hands each micro-batch round's samples to data-parallel ranks in turn,
    micro_batch_size at a time; contiguous gives replica q // m the slots q % m."""
    if order == "contiguous":
        return q // m, q % m
    per_round = micro_batch_size * dp
    within = q % per_round
    slot = (q // per_round) * micro_batch_size + within % micro_batch_size
    return within // micro_batch_size, slot


def plan_libra(sequences, layout, model, options) -> ReferencePlan:
    """Plan one libra step: `sequences` (lists of document lengths), `layout`
    (planner.LayoutConfig), `model` (workload.ModelConfig) and `options` (planner.PlannerOptions),
    as the C++ core does - VRSP, then TAP in every group."""
    step = _Step(sequences, layout, model, options)
    replica, slot, group_seqs, gload = _vrsp(step)
    tiles: list = []
    for g in range(step.B // layout.pool_size):
        _GroupPlacer(step, group_seqs[g], replica, tiles).place()
    return ReferencePlan(replica, slot, [tuple(t) for t in tiles], max(gload),
                         lower_bound(step.loads, step.B // layout.pool_size, layout.pool_size))


class _Step:
    """What every part of a step's plan reads: the sizes, the resolved block and head group,
    and each sequence's attention load."""

    def __init__(self, sequences, layout, model, options):
        self.sequences, self.layout, self.options = sequences, layout, options
        self.B = len(sequences)
        self.m = self.B // layout.dp
        self.hl = model.heads // (layout.cp * layout.tp)
        kvh_local = max(1, self.hl // (model.heads // model.kv_heads))
        self.q_per_kv = self.hl // kvh_local
        self.head_dim = model.head_dim
        self.block = options.block or max(1024, layout.context // 16)
        hg = options.head_group
        self.hg = min(hg, self.hl) if hg > 0 else self.hl
        bwd = 1.0 + ATTN_BWD_FACTOR
        self.loads = []
        for seq in sequences:
            pairs = float(sum(causal_pairs(l) for l in seq))  # one integer sum per sequence
            self.loads.append(4.0 * model.head_dim * self.hl * pairs * bwd)
        self.lengths = [l for seq in sequences for l in seq]
        self.min_rows = min_split_rows(layout.context)


def _vrsp(step: _Step):
    """VRSP: sequences -> pools of P*m (LPT + swaps on pool totals), then each pool's sequences
    -> m groups of P; Megatron's production grouping instead when its heaviest pool (then group)
    is lighter. Returns (replica, slot, group -> its sequences heaviest first, group loads)."""
    B, m, loads = step.B, step.m, step.loads
    dp, pool = step.layout.dp, step.layout.pool_size
    n_groups, n_pools = B // pool, dp // pool

    def evaluate(seq_group, group_pool):
        gl = [0.0] * n_groups
        for s, g in enumerate(seq_group):
            gl[g] += loads[s]
        pl = [0.0] * n_pools
        for g in range(n_groups):
            pl[group_pool[g]] += gl[g]
        return max(pl), max(gl)

    seq_pool = lpt(loads, n_pools, pool * m)
    seq_group = [-1] * B
    for k in range(n_pools):
        in_pool = [s for s in range(B) if seq_pool[s] == k]
        sub = lpt([loads[s] for s in in_pool], m, pool)
        for s, g in zip(in_pool, sub):
            seq_group[s] = k * m + g
    group_pool = [g // m for g in range(n_groups)]
    prod = []
    for q in range(B):
        r, sl = production_slot(q, dp, m, step.options.order, step.options.micro_batch_size)
        prod.append((r // pool) * m + sl)
    (p1, g1), (p2, g2) = evaluate(seq_group, group_pool), evaluate(prod, group_pool)
    tol = 1e-9 * max(1.0, abs(p1))
    if p2 < p1 - tol or (not p2 > p1 + tol and g2 < g1):
        seq_group = prod
    gload = [0.0] * n_groups  # recomputed in sequence order, as the core does
    members = [[] for _ in range(n_groups)]
    for s, g in enumerate(seq_group):
        gload[g] += loads[s]
        members[g].append(s)
    replica, slot = [-1] * B, [-1] * B
    group_seqs = {}
    for k in range(n_pools):
        gs = sorted((g for g in range(n_groups) if group_pool[g] == k), key=lambda g: -gload[g])
        for sl, g in enumerate(gs):
            ms = sorted(members[g], key=lambda s: -loads[s])
            for i, s in enumerate(ms):
                replica[s], slot[s] = k * pool + i, sl
            group_seqs[k * m + sl] = ms
    return replica, slot, group_seqs, gload


class _GroupPlacer:
    """TAP inside one group: its members' tiles (appended to the step's `tiles`, executor set)
    and, per tile of the group (`gt`), (tile index, owner member, local document, load)."""

    def __init__(self, step: _Step, members: list, replica: list, tiles: list):
        self.step, self.ms, self.replica, self.tiles = step, members, replica, tiles
        self.start = len(tiles)  # this group's tiles are tiles[start:], in gt order
        self.gt: list = []
        self._cut_tiles()
        P = self.P = len(members)
        self.total = 0.0
        for x in self.gt:
            self.total += x[3]
        self.cap = (1.0 + step.options.epsilon) * self.total / P
        self.load = [0.0] * P
        self.exe = [-1] * len(self.gt)
        self.have = [dict() for _ in range(P)]

    # -- the tiles -----------------------------------------------------------------------------
    def _cut_tiles(self) -> None:
        """Every member sequence cut into tiles (query blocks of long documents, runs of short
        ones, split when heavier than max_tile_share of a member's mean)."""
        step = self.step
        group_total = 0.0
        for s in self.ms:
            for l in step.sequences[s]:
                group_total += float(causal_pairs(l)) * float(step.hl)
        self.max_load = step.options.max_tile_share * group_total / len(self.ms)
        n_docs = 0
        for i, s in enumerate(self.ms):
            self._cut_sequence(i, s, n_docs)
            n_docs += len(step.sequences[s])

    def _cut_sequence(self, i: int, s: int, n_docs: int) -> None:
        step = self.step
        owner = self.replica[s]
        doc0 = sum(len(x) for x in step.sequences[:s])

        def emit(doc, cnt, q0, ql, kv0, kvl, pairs, doc_off):
            for h0 in range(0, step.hl, step.hg):
                pieces = []
                t = [s, doc, cnt, q0, ql, h0, min(step.hg, step.hl - h0), kv0, kvl, pairs]
                if cnt == 1:
                    split_tile(t, doc_off, self.max_load, pieces, step.min_rows)
                else:
                    split_run(t, step.lengths, self.max_load, pieces, step.min_rows)
                for p in pieces:
                    self.gt.append((len(self.tiles), i, n_docs + p[1] - doc0,
                                    float(p[9]) * float(p[6])))
                    self.tiles.append(p[:9] + [owner, owner])

        run = None  # [first doc, count, start, length, pairs]
        off = 0
        for j, l in enumerate(step.sequences[s]):
            doc = doc0 + j
            if l >= step.block:
                if run:
                    emit(run[0], run[1], run[2], run[3], run[2], run[3], run[4], run[2])
                    run = None
                for a in range(0, l, step.block):
                    b = min(l, a + step.block)
                    emit(doc, 1, off + a, b - a, off, b, block_pairs(a, b), off)
            else:
                if run and run[3] + l > step.block:
                    emit(run[0], run[1], run[2], run[3], run[2], run[3], run[4], run[2])
                    run = None
                if run is None:
                    run = [doc, 0, off, 0, 0]
                run[1] += 1
                run[3] += l
                run[4] += causal_pairs(l)
            off += l
        if run:
            emit(run[0], run[1], run[2], run[3], run[2], run[3], run[4], run[2])

    # -- bytes and moves -----------------------------------------------------------------------
    def qo(self, ql, hc):
        return 4 * ql * hc * self.step.head_dim * self.step.options.dtype_bytes

    def kvb(self, n):
        return 4 * n * self.step.head_dim * self.step.options.dtype_bytes

    def kv_heads_of(self, t):
        q = self.step.q_per_kv
        return range(t[5] // q, (t[5] + t[6] - 1) // q + 1)

    def increment(self, k, j):
        t = self.tiles[self.gt[k][0]]
        return self.increment_rows(k, j, t[4], t[8])

    def increment_rows(self, k, j, q_len, kv_len, ldoc=None):
        ti, owner, tile_ldoc, _ = self.gt[k]
        if owner == j:
            return 0
        ldoc = tile_ldoc if ldoc is None else ldoc
        t = self.tiles[ti]
        inc = self.qo(q_len, t[6])
        for kh in self.kv_heads_of(t):
            r = self.have[j].get((ldoc, kh), 0)
            if kv_len > r:
                inc += self.kvb(kv_len - r)
        return inc

    def assign(self, k, j):
        ti, owner, ldoc, w = self.gt[k]
        if self.exe[k] >= 0:
            self.load[self.exe[k]] -= w
        self.exe[k] = j
        self.load[j] += w
        if owner != j:
            t = self.tiles[ti]
            for kh in self.kv_heads_of(t):
                self.have[j][(ldoc, kh)] = max(self.have[j].get((ldoc, kh), 0), t[8])

    def per_byte(self, k):
        t = self.tiles[self.gt[k][0]]
        return self.gt[k][3] / float(self.qo(t[4], t[6]) + len(self.kv_heads_of(t))
                                     * self.kvb(t[8]))

    def split_tail(self, k, at):
        """Tile k gives up its tail - its documents from index `at` on, or rows [at, b) of a
        one-document tile - as a new tile executed nowhere yet; tile k's executor (if any) loses
        the tail's load. Returns the new tile's group index."""
        gt, tiles = self.gt, self.tiles
        ti, owner, ldoc, wk = gt[k]
        t = tiles[ti]
        if t[2] > 1:  # whole documents [at, count)
            ls = self.step.lengths[t[1] + at : t[1] + t[2]]
            tokens, pairs = sum(ls), sum(causal_pairs(l) for l in ls)
            start = t[3] + t[4] - tokens
            tiles.append([t[0], t[1] + at, t[2] - at, start, tokens, t[5], t[6], start, tokens,
                          t[9], t[9]])
            t[2], t[4], t[8] = at, t[4] - tokens, t[8] - tokens
            tail_ldoc = ldoc + at
        else:  # rows [at, b) against the prefix [0, b)
            a = t[3] - t[7]
            b = a + t[4]
            tiles.append([t[0], t[1], 1, t[7] + at, b - at, t[5], t[6], t[7], b, t[9], t[9]])
            t[4], t[8] = at - a, at
            pairs = block_pairs(at, b)
            tail_ldoc = ldoc
        w = float(pairs) * float(t[6])
        gt[k] = (ti, owner, ldoc, wk - w)
        if self.exe[k] >= 0:
            self.load[self.exe[k]] -= w
        gt.append((len(tiles) - 1, owner, tail_ldoc, w))
        self.exe.append(-1)
        return len(gt) - 1

    # -- the passes ----------------------------------------------------------------------------
    def place(self) -> None:
        if not self.gt:
            return
        self.keep_own_tiles()
        if self.step.options.refine and self.P > 1:
            self.refine()
        if self.P > 1:
            self.contiguous_pieces()
        self.settle()

    def keep_own_tiles(self) -> None:
        """Pass 1, owner by owner: all its tiles if they fit under the cap, else least work per
        byte first while they fit; then pass 2, heaviest first: the member under the cap with
        the smallest byte increment, then the lightest; if none fits, the lightest."""
        gt, load, cap = self.gt, self.load, self.cap
        rest = []
        for j in range(self.P):
            own = [k for k in range(len(gt)) if gt[k][1] == j]
            own_total = 0.0
            for k in own:
                own_total += gt[k][3]
            if own_total > cap:
                own.sort(key=lambda k: (self.per_byte(k), k))
            for k in own:
                if own_total <= cap or load[j] + gt[k][3] <= cap:
                    self.assign(k, j)
                else:
                    rest.append(k)
        rest.sort(key=lambda k: (-gt[k][3], k))
        for k in rest:
            self.assign(k, self._best_member(k))

    def _best_member(self, k) -> int:
        w, load = self.gt[k][3], self.load
        best, best_inc = -1, 0
        for j in range(self.P):
            if load[j] + w > self.cap:
                continue
            inc = self.increment(k, j)
            if best < 0 or inc < best_inc or (inc == best_inc and load[j] < load[best]):
                best, best_inc = j, inc
        if best < 0:
            for j in range(self.P):
                if best < 0 or load[j] < load[best]:
                    best, best_inc = j, self.increment(k, j)
                elif load[j] == load[best]:
                    inc = self.increment(k, j)
                    if inc < best_inc:
                        best, best_inc = j, inc
        return best

    def refine(self) -> None:
        """Between the most and least loaded member, while it lowers their maximum by more than
        REFINE_MIN_GAIN of the mean: the whole tile with the lowest new maximum (then fewest
        bytes); else a tail cut; else a heavy document isolated for the next round."""
        P, load, gt = self.P, self.load, self.gt
        min_gain = REFINE_MIN_GAIN * self.total / P
        on = [[k for k in range(len(gt)) if self.exe[k] == j] for j in range(P)]
        for _ in range(64 * P):
            hi = load.index(max(load))
            lo = load.index(min(load))
            # no move lowers the pair's maximum by more than half the gap
            if hi == lo or not (load[hi] - load[lo]) / 2.0 > min_gain:
                break
            pick, pick_pos, pick_max, pick_inc = None, 0, 0.0, 0
            for pos, k in enumerate(on[hi]):
                w = gt[k][3]
                new_max = max(load[hi] - w, load[lo] + w)
                if not new_max < load[hi] - min_gain:
                    continue
                inc = self.increment(k, lo)
                if pick is None or new_max < pick_max or (new_max == pick_max and inc < pick_inc):
                    pick, pick_pos, pick_max, pick_inc = k, pos, new_max, inc
            if pick is not None:
                self.assign(pick, lo)
                del on[hi][pick_pos]
                on[lo].append(pick)
                on[lo].sort()
                continue
            cut = self.best_cut(on[hi], hi, lo, min_gain)
            if cut is None:
                if not self.isolate_heavy_document(on[hi], hi, (load[hi] - load[lo]) / 2.0):
                    break
                continue
            _, _, k, c, _ = cut
            piece = self.split_tail(k, c)
            self.assign(piece, lo)
            on[lo].append(piece)

    def isolate_heavy_document(self, on_hi: list, hi: int, want: float) -> bool:
        """Whole documents too coarse: the heaviest document of a multi-document tile on hi
        heavier than half the gap gets a tile of its own (cut next round)."""
        min_rows = self.step.min_rows
        pk, pi, pw = None, 0, 0.0
        for k in on_hi:
            t = self.tiles[self.gt[k][0]]
            if t[2] < 2 or not self.gt[k][3] > want:
                continue
            for i in range(t[2]):
                l = self.step.lengths[t[1] + i]
                w = float(causal_pairs(l)) * float(t[6])
                if l >= 2 * min_rows and w > want and w > pw:
                    pk, pi, pw = k, i, w
        if pk is None:
            return False
        # tile pk keeps the documents before pi (or document pi alone); new tiles take
        # document pi and the documents after it, all still on hi
        fresh = [self.split_tail(pk, pi)] if pi > 0 else []
        single = fresh[-1] if pi > 0 else pk
        if self.tiles[self.gt[single][0]][2] > 1:
            fresh.append(self.split_tail(single, 1))
        for k in fresh:
            self.assign(k, hi)
            on_hi.append(k)
        return True

    def best_cut(self, on_hi, hi, lo, min_gain):
        """The tail cut of a tile on hi that best moves half the gap to lo - rows [c, b) of a
        one-document tile, or the documents after the first c of a multi-document tile:
        (new max, bytes, tile, c, load) or None."""
        load, gt, min_rows = self.load, self.gt, self.step.min_rows
        want = (load[hi] - load[lo]) / 2.0
        best = None

        def consider(k, c, w, ldoc, q_len, kv_len):
            nonlocal best
            new_max = max(load[hi] - w, load[lo] + w)
            if not new_max < load[hi] - min_gain:
                return
            if best is not None and new_max > best[0]:
                return
            nbytes = self.increment_rows(k, lo, q_len, kv_len, ldoc)
            if best is None or new_max < best[0] or nbytes < best[1]:
                best = (new_max, nbytes, k, c, w)

        for k in on_hi:
            if not gt[k][3] > want:  # it would have moved whole: only heavier ones are cut
                continue
            t = self.tiles[gt[k][0]]
            if t[2] > 1:
                hc = float(t[6])
                acc, tail = 0.0, 0
                for i in range(t[2] - 1, 0, -1):
                    l = self.step.lengths[t[1] + i]
                    prev = acc
                    acc += float(causal_pairs(l)) * hc
                    tail += l
                    if acc >= want or i == 1:
                        consider(k, i, acc, gt[k][2] + i, tail, tail)
                        if i + 1 <= t[2] - 1:
                            consider(k, i + 1, prev, gt[k][2] + i + 1, tail - l, tail - l)
                        break
                continue
            if t[4] < 2 * min_rows:
                continue
            a = t[3] - t[7]
            b = a + t[4]
            hc = float(t[6])
            x = float(b) * float(b + 1) - 2.0 * want / hc
            c = int(math.ceil((-1.0 + math.sqrt(1.0 + 4.0 * max(0.0, x))) / 2.0))
            c = min(max(c, a + min_rows), b - min_rows)
            while c > a + min_rows and float(block_pairs(c - 1, b)) * hc <= want:
                c -= 1
            while c < b - min_rows and float(block_pairs(c, b)) * hc > want:
                c += 1
            for cc in (c, c - 1):
                if cc < a + min_rows or cc > b - min_rows:
                    continue
                consider(k, cc, float(block_pairs(cc, b)) * hc, gt[k][2], b - cc, b)
        return best

    def contiguous_pieces(self) -> None:
        """A document's rows (one head range) that the placement left fragmented - the owner
        keeping rows after moved ones, or a member running separate blocks - re-cut into one
        contiguous piece per member with the work it had: the owner's first, then the
        executors by the longest prefix they read (ties by member); only where the tiles cover
        the document and the re-cut ships no more bytes. Loads follow; dropped tiles go."""
        gt, tiles, exe, load, P = self.gt, self.tiles, self.exe, self.load, self.P

        def key(k):
            t = tiles[gt[k][0]]
            return (gt[k][2], t[5], t[6], t[3], k)

        idx = sorted((k for k in range(len(gt)) if tiles[gt[k][0]][2] == 1), key=key)
        dead = set()
        i = 0
        while i < len(idx):
            j = i + 1
            while j < len(idx) and key(idx[j])[:3] == key(idx[i])[:3]:
                j += 1
            run, i = idx[i:j], j
            if len(run) < 2:
                continue
            t0 = tiles[gt[run[0]][0]]
            l = self.step.lengths[t0[1]]
            row = 0
            for k in run:
                t = tiles[gt[k][0]]
                if t[3] - t[7] != row or t[4] <= 0:
                    row = -1
                    break
                row += t[4]
            if row != l:
                continue
            owner = gt[run[0]][1]
            runs = []
            for k in run:
                if not runs or runs[-1] != exe[k]:
                    runs.append(exe[k])
            if not (len(set(runs)) < len(runs) or owner in runs[1:]):
                continue
            work, ends, before = [0.0] * P, [-1] * P, 0
            kv_n = len(self.kv_heads_of(t0))
            for k in run:
                t = tiles[gt[k][0]]
                work[exe[k]] += gt[k][3]
                ends[exe[k]] = max(ends[exe[k]], t[8])
                if exe[k] != owner:
                    before += self.qo(t[4], t[6])
            rest = [e for e in range(P) if e != owner and ends[e] >= 0]
            for e in rest:
                before += kv_n * self.kvb(ends[e])
            order = ([owner] if ends[owner] >= 0 else []) + sorted(rest, key=lambda e: ends[e])
            hc = t0[6]

            def prefix(c):
                return float(block_pairs(0, c)) * float(hc)

            cut = [0] * len(order) + [l]
            target = 0.0
            for p in range(len(order) - 1):
                target += work[order[p]]
                lo, hi = cut[p] + 1, l - (len(order) - 1 - p)
                if lo > hi:
                    cut = None
                    break
                while lo < hi:  # the smallest c with prefix(c) >= target (hi if none)
                    mid = lo + (hi - lo) // 2
                    if prefix(mid) >= target:
                        hi = mid
                    else:
                        lo = mid + 1
                if lo > cut[p] + 1 and target - prefix(lo - 1) <= prefix(lo) - target:
                    lo -= 1
                cut[p + 1] = lo
            if cut is None:
                continue
            after = sum(self.qo(cut[p + 1] - cut[p], hc) + kv_n * self.kvb(cut[p + 1])
                        for p in range(len(order)) if order[p] != owner)
            if after > before:
                continue
            for k in run:
                load[exe[k]] -= gt[k][3]
            for p, e in enumerate(order):
                ti, ow, ldoc, _ = gt[run[p]]
                t = tiles[ti]
                t[3], t[4], t[8] = t[7] + cut[p], cut[p + 1] - cut[p], cut[p + 1]
                w = float(block_pairs(cut[p], cut[p + 1])) * float(hc)
                gt[run[p]] = (ti, ow, ldoc, w)
                exe[run[p]] = e
                load[e] += w
            dead.update(run[len(order):])
        if not dead:
            return
        keep = [k for k in range(len(gt)) if k not in dead]
        self.tiles[self.start:] = [tiles[gt[k][0]] for k in keep]
        self.gt = [(self.start + i, gt[k][1], gt[k][2], gt[k][3]) for i, k in enumerate(keep)]
        self.exe = [exe[k] for k in keep]

    def settle(self) -> None:
        """Each tile's executor; never worse than no moves."""
        own = [0.0] * self.P
        for _, owner, _, w in self.gt:
            own[owner] += w
        keep_owners = max(own) < max(self.load)
        for k, (ti, owner, _, _) in enumerate(self.gt):
            self.tiles[ti][10] = self.replica[self.ms[owner if keep_owners else self.exe[k]]]
