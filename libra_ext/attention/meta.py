"""Per-step attention metadata: a StepPlan turned, once per (replica, slot), into flat index
arrays that the operator hands to device gathers, scatters, all-to-alls and batched kernel calls.

Built off the critical path (the sampler's background thread, one step ahead), in vectorized
numpy: nothing here loops over tiles or documents in Python (loops run over pool members,
chunks and the at most two head classes of a call). `upload` copies every array of a slot to the
compute device in one pinned, non-blocking copy; every layer and the backward reuse the result.

Legend (all counts are in *vectors*: one head of one token, `d` elements):
  C cp ranks, t local slots per rank, S tokens of the sequence, hl query heads and kvl KV heads
  of a rank's Ulysses slice, gl = hl / kvl query heads per KV head, W = hl + 2 kvl vectors per
  token in the Ulysses buffer X ([C*t, W, d]: q heads, k heads, v heads of every slot, rank-major
  as the all-to-all delivers them), px members of the exchange pool.

What runs where (see exchange.py for the operator):
  local block   tiles a member owns and executes: one gather from X, <= 2 kernel calls, O
                scattered into the output buffer [C*t*hl, d];
  chunk k       tiles moved to a member, cut into chunks balanced by bytes; every member sends
                [Q | K | V] vectors to each executor in one all-to-all per chunk (KV prefixes go
                once per destination, in increments, so a later chunk may read KV of an earlier
                one); the executor gathers its pack from the receive buffer, runs <= 2 kernel
                calls and returns O in one all-to-all per chunk.
A *segment* of a kernel call is query rows [a, b) of one document against its prefix [0, b);
tiles of one document with adjacent rows, the same heads and the same owner run as one segment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from libra_ext.attention import thd
from libra_ext.attention.kernels import Segments
from libra_ext.planner import StepPlan

_I64 = np.int64


# ------------------------------------------------------------------------------------------
# Host programs
# ------------------------------------------------------------------------------------------


@dataclass
class CallSpec:
    """One batched kernel call: segments with hc query heads and hk KV heads each."""

    hc: int
    hk: int
    n_q: int
    """Query rows (tokens) of the call."""
    n_k: int
    """Key rows of the call."""
    cu_q: np.ndarray
    cu_k: np.ndarray
    q_off: int
    """Offset (vectors) of the call's Q [n_q, hc] in its block's pack; K and V follow."""
    out_off: int
    """Offset (vectors) of the call's O [n_q, hc] among the block's outputs."""
    seg: Segments | None = None
    """The device layout, set by `upload`."""

    @property
    def k_off(self) -> int:
        return self.q_off + self.n_q * self.hc

    @property
    def v_off(self) -> int:
        return self.k_off + self.n_k * self.hk

    @property
    def n_out(self) -> int:
        return self.n_q * self.hc

    def parts(self) -> list:
        """(offset, vectors, heads) of the call's Q, K and V inside its block's pack."""
        nk = self.n_k * self.hk
        return [(self.q_off, self.n_q * self.hc, self.hc), (self.k_off, nk, self.hk),
                (self.v_off, nk, self.hk)]

    def views(self, pack, d: int) -> tuple:
        """The call's (q [n_q, hc, d], k, v [n_k, hk, d]) as views of its block's pack."""
        return tuple(pack[o : o + n].view(-1, h, d) for o, n, h in self.parts())


@dataclass
class Block:
    """One gather + up to two kernel calls."""

    gather: np.ndarray | torch.Tensor
    """[n_pack] source vectors of the pack (X for the local block, the receive buffer else)."""
    calls: list
    out: np.ndarray | torch.Tensor | None
    """local block: output-buffer vector of every O vector; chunk block: position of every O
    vector in the chunk's O message (None: the outputs are already in message order)."""


@dataclass
class Chunk:
    """One all-to-all round of the pool exchange (counts in vectors per member)."""

    qkv_send: list
    qkv_recv: list
    o_send: list
    o_recv: list
    send_off: int
    """Offset of this chunk's messages in the send buffer (recv, o_send, o_recv: the same in
    theirs)."""
    recv_off: int
    o_send_off: int
    o_recv_off: int
    block: Block | None
    """What this member executes for others in this chunk (None: nothing)."""
    q_send: list = field(default_factory=list)
    """Of qkv_send, the Q vectors (each message is [Q | K | V]: the rest is K/V rows)."""

    @property
    def n_send(self) -> int:
        return sum(self.qkv_send)

    @property
    def n_recv(self) -> int:
        return sum(self.qkv_recv)

    @property
    def n_o_send(self) -> int:
        return sum(self.o_send)

    @property
    def n_o_recv(self) -> int:
        return sum(self.o_recv)


@dataclass
class SlotProgram:
    """Everything one rank runs for one (replica, slot) of a plan (libra, distca, ulysses)."""

    replica: int
    slot: int
    cp: int
    t: int
    """Local slots per cp rank (documents padded to multiples of 2C)."""
    tokens: int
    heads_local: int
    kv_heads_local: int
    head_dim: int
    members: int
    """px: members of the exchange pool."""
    local: Block | None
    chunks: list
    send_idx: np.ndarray | torch.Tensor
    """[sum n_send] X vectors of every chunk's outgoing [Q | K | V] messages."""
    o_out_idx: np.ndarray | torch.Tensor
    """[sum n_o_recv] output-buffer vector of every O vector received back."""
    local_unique: bool
    """No X vector appears twice in the local pack (its gradient can be copied, not added)."""
    tiles_executed: int
    _keep: list = field(default_factory=list, repr=False)

    @property
    def n_send(self) -> int:
        return sum(c.n_send for c in self.chunks)

    @property
    def n_recv(self) -> int:
        return sum(c.n_recv for c in self.chunks)

    @property
    def n_o_send(self) -> int:
        return sum(c.n_o_send for c in self.chunks)

    @property
    def n_o_recv(self) -> int:
        return sum(c.n_o_recv for c in self.chunks)

    @property
    def blocks(self) -> list:
        """Blocks with work: local tiles, and each chunk that brings this rank tiles."""
        return [b for b in [self.local] + [c.block for c in self.chunks] if b is not None]

    @property
    def calls(self) -> list:
        return [call for b in self.blocks for call in b.calls]

    @property
    def exec_blocks(self) -> int:
        return len(self.blocks)

    @property
    def kernel_calls(self) -> int:
        return len(self.calls)


@dataclass
class WlbProgram:
    """Per-document CP (WLB-LLM) for one cp rank: its two chunks of every document against the
    all-gathered KV, as one kernel call."""

    cp: int
    t: int
    tokens: int
    call: CallSpec
    kv_rows: np.ndarray | torch.Tensor
    """[n_k] rows of the all-gathered KV ([C*t] rank-major) that form the key pack."""
    real: np.ndarray | torch.Tensor
    """[t] 1 for slots that hold a token, 0 for padding."""
    tiles_executed: int
    _keep: list = field(default_factory=list, repr=False)

    @property
    def calls(self) -> list:
        return [self.call]


# ------------------------------------------------------------------------------------------
# Compilation
# ------------------------------------------------------------------------------------------


def _excl(x: np.ndarray) -> np.ndarray:
    return np.cumsum(x) - x


def _group_excl(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Exclusive cumulative sum of `values` inside runs of equal `groups` (already sorted)."""
    c = np.cumsum(values)
    start = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]]) if len(groups) else groups
    base = np.repeat(c[start] - values[start], np.diff(np.r_[start, len(groups)]))
    return c - values - base


def _elements(rows: np.ndarray, hc: np.ndarray):
    """For pieces of `rows` rows x `hc` heads: (piece, row, head) of every vector, row-major."""
    n = rows * hc
    piece = np.repeat(np.arange(len(n)), n)
    e = thd.within(n)
    return piece, e // hc[piece], e % hc[piece]


def _doc_starts(plan: StepPlan) -> np.ndarray:
    cached = getattr(plan, "_doc_start", None)
    if cached is None:
        L = plan.doc_lengths.astype(_I64)
        off = plan.seq_doc_offsets.astype(_I64)
        cum = np.cumsum(L) - L
        seq = np.repeat(np.arange(plan.n_seq), np.diff(off))
        cached = cum - cum[off[seq]] if len(L) else cum
        plan._doc_start = cached
    return cached


def sequence_lengths(plan: StepPlan, replica: int, slot: int) -> np.ndarray:
    """Document lengths of the sequence the plan places at (replica, slot)."""
    seq = plan.sequence_at(replica, slot)
    off = plan.seq_doc_offsets
    return plan.doc_lengths[off[seq] : off[seq + 1]].astype(_I64)


@dataclass
class _Pieces:
    """Head pieces of segments (struct of arrays)."""

    seg: np.ndarray
    h0: np.ndarray
    hc: np.ndarray
    hk: np.ndarray

    def take(self, idx) -> "_Pieces":
        return _Pieces(self.seg[idx], self.h0[idx], self.hc[idx], self.hk[idx])


def _native_pieces(seg_h0, seg_hc, gl: int) -> _Pieces:
    """Cut every segment's head range into pieces a GQA kernel runs natively: inside one KV
    group (hk = 1) or whole aligned groups (hk = hc / gl)."""
    g0, g1 = seg_h0 // gl, (seg_h0 + seg_hc - 1) // gl
    aligned = (seg_h0 % gl == 0) & (seg_hc % gl == 0)
    n = np.where(aligned | (g0 == g1), 1, g1 - g0 + 1)
    seg = np.repeat(np.arange(len(seg_h0)), n)
    i = thd.within(n)
    split = n[seg] > 1
    h0 = np.where(split, np.maximum(seg_h0[seg], (g0[seg] + i) * gl), seg_h0[seg])
    h1 = np.where(
        split, np.minimum(seg_h0[seg] + seg_hc[seg], (g0[seg] + i + 1) * gl), h0 + seg_hc[seg]
    )
    hc = h1 - h0
    hk = np.where(aligned[seg] & (hc >= gl), hc // gl, 1)
    return _Pieces(seg, h0, hc, hk)


def _two_classes(p: _Pieces, rows: np.ndarray, gl: int) -> _Pieces:
    """At most two (hc, hk) classes per block: the class with the most work stays, every other
    piece is cut into units of u heads (u divides their head counts and, when whole KV groups
    are among them, the group size), which keeps the call count independent of the tiles."""
    keys = p.hc * 1_000_003 + p.hk
    uk = np.unique(keys)
    if len(uk) <= 2:
        return p
    vol = np.array([int((rows[keys == k] * p.hc[keys == k]).sum()) for k in uk])
    top = uk[np.lexsort((-(uk // 1_000_003), -vol))[0]]
    other = keys != top
    u = int(np.gcd.reduce(p.hc[other]))
    if (p.hk[other] > 1).any():
        u = math.gcd(u, gl)
    n = np.where(other, p.hc // u, 1)
    idx = np.repeat(np.arange(len(n)), n)
    i = thd.within(n)
    cut = other[idx]
    return _Pieces(
        p.seg[idx],
        np.where(cut, p.h0[idx] + i * u, p.h0[idx]),
        np.where(cut, u, p.hc[idx]),
        np.where(cut, 1, p.hk[idx]),
    )


class _Group:
    """The exchange group of (replica, slot): its tiles cut into segments, the moved ones
    assigned to chunks, with the message layouts every member agrees on."""

    def __init__(self, plan: StepPlan, replica: int, slot: int, chunks: int):
        self.plan = plan
        px = self.px = plan.exchange_pool
        hl, kvl = plan.heads_local, plan.kv_heads_local
        self.hl, self.kvl, self.gl, self.W = hl, kvl, hl // kvl, hl + 2 * kvl
        self.base = (replica // px) * px
        self.me = replica - self.base
        g = plan.group_of(replica, slot)
        tiles = plan.send_order[plan.send_group_offsets[g] : plan.send_group_offsets[g + 1]]
        tiles = np.asarray(tiles, dtype=_I64)
        if (plan.tile_cp[tiles] != -1).any():
            raise ValueError("plan tiles name a cp rank: a per-document CP plan (wlb)")
        self.tiles = tiles
        n_doc = len(plan.doc_lengths)
        self.n_doc = n_doc
        ds_all = _doc_starts(plan)
        # -- segments: one per (tile, document); prefix segments [a, b) of their document
        cnt = plan.tile_doc_count[tiles].astype(_I64)
        st = np.repeat(np.arange(len(tiles)), cnt)  # segment -> tile (position in `tiles`)
        doc = plan.tile_doc[tiles][st] + thd.within(cnt)
        single = cnt[st] == 1
        ds = ds_all[doc]
        t = tiles[st]
        a = np.where(single, plan.tile_q_start[t] - ds, 0)
        b = np.where(single, a + plan.tile_q_len[t], plan.doc_lengths[doc])
        bad = single & ((plan.tile_kv_start[t] != ds) | (plan.tile_kv_len[t] != b))
        if bad.any():
            i = int(t[np.argmax(bad)])
            raise ValueError(
                f"plan tile {i}: its KV range must be its document's prefix up to its last row"
            )
        self.s_tile, self.s_doc, self.s_a, self.s_b, self.s_ds = st, doc, a, b, ds
        self.s_h0 = plan.tile_head_start[t].astype(_I64)
        self.s_hc = plan.tile_head_count[t].astype(_I64)
        self.t_owner = plan.tile_owner[tiles].astype(_I64) - self.base
        self.t_exec = plan.tile_executor[tiles].astype(_I64) - self.base
        self.s_owner, self.s_exec = self.t_owner[st], self.t_exec[st]
        self._assign_chunks(chunks)

    # -- chunks and message layout ------------------------------------------------------------
    def _assign_chunks(self, chunks: int) -> None:
        plan, px, gl = self.plan, self.px, self.gl
        tiles = self.tiles
        nt = len(tiles)
        moved = self.t_owner != self.t_exec
        t_q0 = plan.tile_q_start[tiles].astype(_I64)
        t_h0 = plan.tile_head_start[tiles].astype(_I64)
        t_hc = plan.tile_head_count[tiles].astype(_I64)
        t_ql = plan.tile_q_len[tiles].astype(_I64)
        self.t_q0, self.t_h0, self.t_hc = t_q0, t_h0, t_hc
        # canonical order of tiles: executor, owner, first document, rows, heads, id
        order = np.lexsort(
            (tiles, t_h0, t_q0, plan.tile_doc[tiles], self.t_owner, self.t_exec)
        )
        rank = np.empty(nt, dtype=_I64)
        rank[order] = np.arange(nt)
        self.t_rank = rank
        # KV prefix needs of moved segments, per KV head, in canonical order
        ms = np.flatnonzero(moved[self.s_tile])
        k0 = self.s_h0[ms] // gl
        k1 = (self.s_h0[ms] + self.s_hc[ms] - 1) // gl
        nk = k1 - k0 + 1
        r_seg = np.repeat(ms, nk)
        r_kh = np.repeat(k0, nk) + thd.within(nk)
        r_exec = self.s_exec[r_seg]
        r_key = (r_exec * self.n_doc + self.s_doc[r_seg]) * self.kvl + r_kh
        o = np.lexsort((self.t_rank[self.s_tile[r_seg]], r_key))
        r_seg, r_kh, r_key = r_seg[o], r_kh[o], r_key[o]
        b = self.s_b[r_seg]
        gid = np.cumsum(np.r_[True, r_key[1:] != r_key[:-1]]) - 1 if len(r_key) else r_key
        big = np.int64(1) << 40
        cm = np.maximum.accumulate(b + gid * big) - gid * big if len(b) else b
        first = np.r_[True, r_key[1:] != r_key[:-1]] if len(r_key) else np.zeros(0, bool)
        prev = np.where(first, 0, np.r_[0, cm[:-1]]) if len(b) else b
        r_from, r_to = prev, np.maximum(prev, b)
        keep = r_to > r_from
        r_seg, r_kh, r_from, r_to = r_seg[keep], r_kh[keep], r_from[keep], r_to[keep]
        r_tile = self.s_tile[r_seg]
        # Each executor's incoming vectors as one stream in canonical tile order - a tile's K/V
        # increments (2 vectors a row), then its Q - cut into `chunks` equal parts. A unit that
        # straddles a cut is split there (KV at whole rows): KV reaches an executor ahead of the
        # tile that needs it, and a tile runs in the chunk where its last Q vector arrives.
        mv = order[moved[order]]  # moved tiles in canonical order (grouped by executor)
        n_rec = len(r_tile)
        u_tile = np.r_[r_tile, mv]
        u_kind = np.r_[np.zeros(n_rec, dtype=_I64), np.ones(len(mv), dtype=_I64)]
        u_sub = np.r_[np.arange(n_rec), np.zeros(len(mv), dtype=_I64)]
        u_size = np.r_[2 * (r_to - r_from), t_ql[mv] * t_hc[mv]]
        uo = np.lexsort((u_sub, u_kind, rank[u_tile], self.t_exec[u_tile]))
        u_tile, u_kind, u_sub, u_size = u_tile[uo], u_kind[uo], u_sub[uo], u_size[uo]
        u_exec = self.t_exec[u_tile]
        pos0 = _group_excl(u_size, u_exec)
        total = np.bincount(u_exec, weights=u_size, minlength=px).astype(_I64)
        tot = np.maximum(total[u_exec], 1)
        n = chunks
        c0 = np.minimum(n - 1, (pos0 * n) // tot)
        c1 = np.minimum(n - 1, ((pos0 + u_size - 1) * n) // tot)
        npc = c1 - c0 + 1
        pu = np.repeat(np.arange(len(u_size)), npc)  # piece -> unit
        pk = c0[pu] + thd.within(npc)  # piece chunk
        cut = -(-(pk * tot[pu]) // n)  # first stream vector of chunk pk: ceil(k * total / n)
        lo = np.maximum(pos0[pu], cut) - pos0[pu]
        hi = np.minimum(pos0[pu] + u_size[pu], -(-((pk + 1) * tot[pu]) // n)) - pos0[pu]
        hi = np.where(pk == c1[pu], u_size[pu], hi)
        kv = u_kind[pu] == 0
        lo = np.where(kv, lo + lo % 2, lo)  # KV pieces hold whole rows (K and V vector)
        hi = np.where(kv, hi + hi % 2, hi)
        keep = hi > lo
        pu, pk, lo, hi = pu[keep], pk[keep], lo[keep], hi[keep]
        # chunks with any traffic, renumbered without gaps
        active = np.unique(pk)
        pk = np.searchsorted(active, pk)
        self.n_chunks = len(active)
        t_chunk = np.zeros(nt, dtype=_I64)
        qp = u_kind[pu] == 1
        t_chunk[u_tile[pu[qp]]] = pk[qp]  # pieces in stream order: the last one wins
        self.moved, self.t_chunk = moved, t_chunk
        # message layout: cell (chunk, owner, executor) = [Q pieces | K pieces | V pieces], each
        # in stream order
        n_cells = max(1, self.n_chunks) * px * px
        p_tile = u_tile[pu]
        p_cell = (pk * px + self.t_owner[p_tile]) * px + self.t_exec[p_tile]
        q_i = np.flatnonzero(qp)
        q_i = q_i[np.argsort(p_cell[q_i], kind="stable")]
        self.qp_tile, self.qp_cell = p_tile[q_i], p_cell[q_i]
        self.qp_start, self.qp_len = lo[q_i], hi[q_i] - lo[q_i]
        self.qp_off = _group_excl(self.qp_len, self.qp_cell)
        self.nq = np.bincount(self.qp_cell, weights=self.qp_len, minlength=n_cells).astype(_I64)
        k_i = np.flatnonzero(~qp)
        k_i = k_i[np.argsort(p_cell[k_i], kind="stable")]
        rec = u_sub[pu[k_i]]
        self.kp_seg, self.kp_kh = r_seg[rec], r_kh[rec]
        self.kp_from = r_from[rec] + lo[k_i] // 2
        self.kp_to = r_from[rec] + hi[k_i] // 2
        self.kp_cell = p_cell[k_i]
        inc = self.kp_to - self.kp_from
        self.kp_off = _group_excl(inc, self.kp_cell)
        self.nkv = np.bincount(self.kp_cell, weights=inc, minlength=n_cells).astype(_I64)
        self.msg = (self.nq + 2 * self.nkv).reshape(-1, px, px)  # [chunk, owner, executor]

    # -- execution blocks (piece level, for any executor) ---------------------------------------
    def blocks_of(self, e: int) -> list:
        """Executor e's blocks: [local, chunk 0, ...] as ordered piece lists (or None)."""
        sel_e = self.s_exec == e
        out = []
        for k in range(-1, self.n_chunks):
            if k < 0:
                s = np.flatnonzero(sel_e & (self.s_owner == e))
            else:
                s = np.flatnonzero(
                    sel_e & (self.s_owner != e) & (self.t_chunk[self.s_tile] == k)
                )
            out.append(self._block_pieces(s) if len(s) else None)
        return out

    def _block_pieces(self, segs: np.ndarray):
        p = _native_pieces(self.s_h0[segs], self.s_hc[segs], self.gl)
        p.seg = segs[p.seg]
        rows = self.s_b[p.seg] - self.s_a[p.seg]
        p = _two_classes(p, rows, self.gl)
        cls_key = p.hc * 1_000_003 + p.hk
        classes = np.unique(cls_key)
        cls = np.searchsorted(classes, cls_key)
        # order: class, owner, document, heads, rows
        o = np.lexsort(
            (self.s_a[p.seg], p.hc, p.h0, self.s_doc[p.seg], self.s_owner[p.seg], cls)
        )
        p, cls = p.take(o), cls[o]
        s = p.seg
        same = (
            (cls[1:] == cls[:-1])
            & (self.s_owner[s][1:] == self.s_owner[s][:-1])
            & (self.s_doc[s][1:] == self.s_doc[s][:-1])
            & (p.h0[1:] == p.h0[:-1])
            & (p.hc[1:] == p.hc[:-1])
            & (self.s_a[s][1:] == self.s_b[s][:-1])
        )
        run = np.cumsum(np.r_[True, ~same]) - 1
        return p, cls, run

    # -- element-level index arrays (only for what this member needs) --------------------------
    def _positions(self, p: _Pieces):
        """(piece, head within the piece, token position in the owner's sequence) of every
        element of pieces p (rows x heads, row-major), and each piece's rows."""
        s = p.seg
        rows = self.s_b[s] - self.s_a[s]
        pi, r, hh = _elements(rows, p.hc)
        return pi, hh, self.s_ds[s][pi] + self.s_a[s][pi] + r, rows

    def q_source(self, p: _Pieces, local: bool, xrow, qloc):
        """Source vector of every Q element of pieces p (row-major) and the pieces' rows: in X
        for local pieces, else in the receive buffer (`qloc` = (location of every received Q
        vector, offset of each tile's first one))."""
        pi, hh, pos, rows = self._positions(p)
        if local:
            return xrow[pos] * self.W + p.h0[pi] + hh, rows
        t = self.s_tile[p.seg][pi]
        q_loc, qbase = qloc
        at = qbase[t] + (pos - self.t_q0[t]) * self.t_hc[t] + (p.h0[pi] - self.t_h0[t]) + hh
        return q_loc[at], rows

    def out_index(self, p: _Pieces, xrow):
        """Output-buffer vector ([C*t*hl]) of every O element of pieces p (row-major)."""
        pi, hh, pos, _ = self._positions(p)
        return xrow[pos] * self.hl + p.h0[pi] + hh


def _block(g: _Group, pieces, local: bool, xrow, qloc, kv_loc) -> Block:
    """Pack indices and calls of one block (outputs in piece order: pieces are sorted by class
    first); `out` is left to the caller."""
    p, cls, run = pieces
    gl, W, hl, kvl = g.gl, g.W, g.hl, g.kvl
    gathers, calls = [], []
    off = out_off = 0
    for c in range(int(cls.max()) + 1):
        sel = np.flatnonzero(cls == c)
        pc = p.take(sel)
        q_idx, rows = g.q_source(pc, local, xrow, qloc)
        r = run[sel]
        first = np.r_[True, r[1:] != r[:-1]]
        last = np.r_[r[1:] != r[:-1], True]
        run_rows = np.add.reduceat(rows, np.flatnonzero(first)) if len(rows) else rows
        s_last = pc.seg[last]
        run_b = g.s_b[s_last]
        run_doc = g.s_doc[s_last]
        run_k0 = pc.h0[last] // gl
        hc, hk = int(pc.hc[0]), int(pc.hk[0])
        # K elements: prefix positions p < b of each run, KV heads k0..k0+hk-1 (p outer)
        n_el = run_b * hk
        ri = np.repeat(np.arange(len(run_b)), n_el)
        e = thd.within(n_el)
        pos, kh = e // hk, run_k0[ri] + e % hk
        if local:
            rowx = xrow[g.s_ds[s_last][ri] + pos] * W
            k_idx, v_idx = rowx + hl + kh, rowx + hl + kvl + kh
        else:
            loc_k, loc_v, keys, key_off = kv_loc
            kidx = np.searchsorted(keys, run_doc[ri] * kvl + kh)
            at = key_off[kidx] + pos
            k_idx, v_idx = loc_k[at], loc_v[at]
        cu_q = np.r_[0, np.cumsum(run_rows)].astype(_I64)
        cu_k = np.r_[0, np.cumsum(run_b)].astype(_I64)
        n_q, n_k = int(cu_q[-1]), int(cu_k[-1])
        calls.append(CallSpec(hc, hk, n_q, n_k, cu_q, cu_k, off, out_off))
        gathers += [q_idx, k_idx, v_idx]
        off += len(q_idx) + 2 * len(k_idx)
        out_off += n_q * hc
    return Block(np.concatenate(gathers).astype(_I64), calls, None)


def compile_slot(plan: StepPlan, replica: int, slot: int, chunks: int = 4) -> SlotProgram:
    """The program of rank (replica, any cp rank) for `slot` of `plan` (libra, distca or
    ulysses; the same for every cp rank of the replica)."""
    if plan.system == "wlb":
        raise ValueError("compile_slot serves libra, distca and ulysses plans; use compile_wlb")
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    if not 0 <= replica < plan.dp or not 0 <= slot < plan.slots:
        raise ValueError(
            f"(replica, slot) = ({replica}, {slot}) outside the plan's {plan.dp} x {plan.slots}"
        )
    C = plan.cp
    L = sequence_lengths(plan, replica, slot)
    t = int(2 * (thd.padded_lengths(L, C) // (2 * C)).sum())
    xrow = thd.gather_order(L, C) if len(L) else np.zeros(0, dtype=_I64)
    g = _Group(plan, replica, slot, chunks)
    px, me = g.px, g.me
    n_ch = g.n_chunks
    msg = g.msg  # [chunk, owner, executor] vectors
    # -- my outgoing [Q | K | V] messages (I own): positions in the send buffer
    send_sizes = msg[:, me, :] if n_ch else np.zeros((0, px), dtype=_I64)
    send_base = _excl(send_sizes.reshape(-1)).reshape(send_sizes.shape)
    n_send = int(send_sizes.sum())
    send_idx = np.zeros(n_send, dtype=_I64)
    cells_per_chunk = px * px
    qs = np.flatnonzero(g.qp_cell % cells_per_chunk // px == me)  # Q pieces I send
    if len(qs):
        pi = np.repeat(qs, g.qp_len[qs])
        j = g.qp_start[pi] + thd.within(g.qp_len[qs])
        tm, cell = g.qp_tile[pi], g.qp_cell[pi]
        dst = send_base[cell // cells_per_chunk, cell % px] + g.qp_off[pi] + j - g.qp_start[pi]
        send_idx[dst] = xrow[g.t_q0[tm] + j // g.t_hc[tm]] * g.W + g.t_h0[tm] + j % g.t_hc[tm]
    ks = np.flatnonzero(g.kp_cell % cells_per_chunk // px == me)  # KV pieces I send
    if len(ks):
        inc = g.kp_to[ks] - g.kp_from[ks]
        ri = np.repeat(ks, inc)
        pos = g.kp_from[ri] + thd.within(inc)
        cell = g.kp_cell[ri]
        kdst = send_base[cell // cells_per_chunk, cell % px] + g.nq[cell] + g.kp_off[ri]
        kdst = kdst + (pos - g.kp_from[ri])
        rowx = xrow[g.s_ds[g.kp_seg[ri]] + pos] * g.W + g.hl + g.kp_kh[ri]
        send_idx[kdst] = rowx
        send_idx[kdst + g.nkv[cell]] = rowx + g.kvl
    # -- my incoming messages (I execute): where each received Q vector and KV row lands
    recv_sizes = msg[:, :, me] if n_ch else np.zeros((0, px), dtype=_I64)
    recv_base = _excl(recv_sizes.reshape(-1)).reshape(recv_sizes.shape)
    qr = np.flatnonzero(g.qp_cell % px == me)  # Q pieces I receive, by tile then start
    qr = qr[np.lexsort((g.qp_start[qr], g.qp_tile[qr]))]
    cell = g.qp_cell[qr]
    qpos = recv_base[cell // cells_per_chunk, cell // px % px] + g.qp_off[qr]
    q_loc = thd.ranges(qpos, g.qp_len[qr])
    qbase = np.zeros(len(g.tiles), dtype=_I64)  # offset of a tile's first Q vector in q_loc
    first = np.r_[True, g.qp_tile[qr][1:] != g.qp_tile[qr][:-1]] if len(qr) else qr.astype(bool)
    qbase[g.qp_tile[qr][first]] = _excl(g.qp_len[qr])[first]
    rin = np.flatnonzero(g.kp_cell % px == me)
    if len(rin):
        inc = g.kp_to[rin] - g.kp_from[rin]
        cell = g.kp_cell[rin]
        kpos = recv_base[cell // cells_per_chunk, cell // px % px] + g.nq[cell] + g.kp_off[rin]
        key = g.s_doc[g.kp_seg[rin]] * g.kvl + g.kp_kh[rin]
        o = np.lexsort((g.kp_from[rin], key))
        key, inc, kpos, vpos = key[o], inc[o], kpos[o], kpos[o] + g.nkv[cell][o]
        loc_k, loc_v = thd.ranges(kpos, inc), thd.ranges(vpos, inc)
        keys, first = np.unique(key, return_index=True)
        key_off = _excl(inc)[first]
        kv_loc = (loc_k, loc_v, keys, key_off)
    else:
        kv_loc = None
    # -- execution: my local block and my chunk blocks; O message layout of every executor
    blocks_by_exec = [g.blocks_of(e) for e in range(px)]
    local = None
    mine_blocks = blocks_by_exec[me]
    if mine_blocks[0] is not None:
        local = _block(g, mine_blocks[0], True, xrow, None, None)
        out = g.out_index(mine_blocks[0][0], xrow).astype(_I64)  # piece order
        # outputs already in output-buffer order (one rank's whole sequence in order): no scatter
        local.out = None if np.array_equal(out, np.arange(C * t * g.hl)) else out
    chunk_list, o_out = [], []
    send_off = recv_off = o_send_off = o_recv_off = 0
    for k in range(n_ch):
        # O sizes: what each executor returns to each owner in chunk k
        o_send = [0] * px
        o_recv = [0] * px
        block = None
        for e in range(px):
            pieces = blocks_by_exec[e][k + 1]
            if pieces is None:
                continue
            p = pieces[0]
            rows = g.s_b[p.seg] - g.s_a[p.seg]
            vecs = rows * p.hc
            owners = g.s_owner[p.seg]
            # a block's outputs come in piece order (pieces are sorted by class first); the O
            # message to each owner holds its pieces' outputs in that order
            if e == me:
                for o in range(px):
                    o_send[o] = int(vecs[owners == o].sum())
                block = _block(g, pieces, False, None, (q_loc, qbase), kv_loc)
                msg_base = _excl(np.bincount(owners, weights=vecs, minlength=px).astype(_I64))
                ret = thd.ranges(msg_base[owners] + _group_excl_by(vecs, owners), vecs)
                block.out = None if np.array_equal(ret, np.arange(len(ret))) else ret
            mine_p = np.flatnonzero(owners == me)
            if len(mine_p):  # O vectors I get back from e, in e's order
                o_recv[e] = int(vecs[mine_p].sum())
                o_out.append(g.out_index(p.take(mine_p), xrow))
        chunk_list.append(
            Chunk(
                qkv_send=[int(x) for x in send_sizes[k]],
                q_send=[int(x) for x in g.nq.reshape(-1, px, px)[k, me, :]],
                qkv_recv=[int(x) for x in recv_sizes[k]],
                o_send=o_send,
                o_recv=o_recv,
                send_off=send_off,
                recv_off=recv_off,
                o_send_off=o_send_off,
                o_recv_off=o_recv_off,
                block=block,
            )
        )
        send_off += int(send_sizes[k].sum())
        recv_off += int(recv_sizes[k].sum())
        o_send_off += sum(o_send)
        o_recv_off += sum(o_recv)
    o_out_idx = np.concatenate(o_out).astype(_I64) if o_out else np.zeros(0, dtype=_I64)
    unique = local is None or not len(local.gather) or (
        np.bincount(local.gather, minlength=C * t * g.W).max() <= 1
    )
    executed = np.flatnonzero(g.t_exec == me)
    return SlotProgram(
        replica=replica,
        slot=slot,
        cp=C,
        t=t,
        tokens=int(L.sum()),
        heads_local=g.hl,
        kv_heads_local=g.kvl,
        head_dim=plan.head_dim,
        members=px,
        local=local,
        chunks=chunk_list,
        send_idx=send_idx,
        o_out_idx=o_out_idx,
        local_unique=bool(unique),
        tiles_executed=int(len(executed)),
    )


def _group_excl_by(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Exclusive cumulative sum of `values` among earlier entries of the same group (groups
    need not be sorted; order inside a group is kept)."""
    o = np.argsort(groups, kind="stable")
    out = np.empty_like(values)
    out[o] = _group_excl(values[o], groups[o])
    return out


def compile_wlb(doc_lengths, cp: int, cp_rank: int) -> WlbProgram:
    """Per-document CP of cp rank `cp_rank`: segments are its chunks (c and 2C-1-c of every
    document, in local slot order) against their document prefix up to the chunk's end; slots
    past a document's end are padding whose keys repeat the document's last token (only
    padding rows can see them) and whose outputs are zeroed."""
    L = np.asarray(doc_lengths, dtype=_I64).reshape(-1)
    C, c = cp, cp_rank
    z = thd.zigzag_split(L, C, c)
    ch = thd.padded_lengths(L, C) // (2 * C)
    t = int(2 * ch.sum())
    xrow = thd.gather_order(L, C) if len(L) else np.zeros(0, dtype=_I64)
    n = len(L)
    # segment 2j: chunk c of document j, 2j+1: chunk 2C-1-c
    q_len = np.repeat(ch, 2)
    chunk = np.tile(np.array([c, 2 * C - 1 - c], dtype=_I64), n)
    k_len = (chunk + 1) * q_len
    doc = np.repeat(np.arange(n), 2)
    starts = np.cumsum(L) - L
    pos = thd.within(k_len)
    sd = np.repeat(doc, k_len)
    kv_rows = xrow[starts[sd] + np.minimum(pos, L[sd] - 1)] if len(pos) else pos
    cu_q = np.r_[0, np.cumsum(q_len)].astype(_I64)
    cu_k = np.r_[0, np.cumsum(k_len)].astype(_I64)
    call = CallSpec(0, 0, int(cu_q[-1]), int(cu_k[-1]), cu_q, cu_k, 0, 0)
    return WlbProgram(
        cp=C,
        t=t,
        tokens=int(L.sum()),
        call=call,
        kv_rows=kv_rows.astype(_I64),
        real=(z.token_index >= 0).astype(_I64),
        tiles_executed=int(2 * n),
    )


# ------------------------------------------------------------------------------------------
# Upload: every index array of a program in one pinned, non-blocking host-to-device copy
# ------------------------------------------------------------------------------------------


def _walk(prog):
    """(holder, attribute) of every numpy array of a program, in a fixed order (a call's cu_q
    right before its cu_k)."""
    if isinstance(prog, SlotProgram):
        out = [(prog, "send_idx"), (prog, "o_out_idx")]
        for b in prog.blocks:
            out.append((b, "gather"))
            if b.out is not None:
                out.append((b, "out"))
    else:
        out = [(prog, "kv_rows"), (prog, "real")]
    for call in prog.calls:
        out += [(call, "cu_q"), (call, "cu_k")]
    return out


@dataclass
class Staged:
    """A program whose index arrays sit in one flat host tensor (pinned when asked), ready for
    one host-to-device copy."""

    prog: object
    host: torch.Tensor
    sizes: list


def _clone(prog):
    """A copy of a program's structure (programs, chunks, blocks, calls) sharing its arrays, so
    that uploading it leaves the host program as it was."""

    def block(b):
        return None if b is None else replace(b, calls=[replace(c) for c in b.calls])

    if isinstance(prog, WlbProgram):
        return replace(prog, call=replace(prog.call), _keep=[])
    return replace(
        prog,
        local=block(prog.local),
        chunks=[replace(c, block=block(c.block)) for c in prog.chunks],
        _keep=[],
    )


INDEX_DTYPE = np.int32
"""The staged (and device) index arrays' dtype: every index of a rank's buffers is below 2^31,
and the device ops take int32 indices (index_select, index_add_, index_put_; cu_seqlens are
int32 anyway), so a step's metadata is half the bytes of int64 - on the host, in the upload
and on the device."""


def stage(prog, pin: bool = False) -> Staged:
    """Flatten a host program's arrays into one int32 host tensor (pinned: for a non-blocking
    copy). Runs off the critical path (the sampler's thread)."""
    prog = _clone(prog)
    arrays = [np.asarray(getattr(h, a)).reshape(-1) for h, a in _walk(prog)]
    top = max((int(x.max()) for x in arrays if len(x)), default=0)
    if top >= 2**31:
        raise ValueError(f"an index of this rank's program ({top}) does not fit in int32")
    flat = (np.concatenate(arrays).astype(INDEX_DTYPE, copy=False) if arrays
            else np.zeros(0, dtype=INDEX_DTYPE))
    host = torch.from_numpy(flat)
    if pin:
        host = host.pin_memory()
    return Staged(prog, host, [len(x) for x in arrays])


def upload(prog, device: torch.device | str, pin: bool | None = None, device_buffer=None):
    """The program with every index array on `device` (int32, INDEX_DTYPE), copied in one
    host-to-device transfer (non-blocking, from pinned memory on CUDA). `prog` is a host
    program or a `Staged` one; a new program is returned (CallSpecs keep their host offsets in
    `seg`, for the reference kernel). `device_buffer`: the staged arrays already on the device
    (a copy the caller made together with other data)."""
    device = torch.device(device)
    if not isinstance(prog, Staged):
        prog = stage(prog, pin=device.type == "cuda" if pin is None else pin)
    dev, host = prog.prog, prog.host
    if device_buffer is not None:
        buf = device_buffer
    else:
        buf = host.to(device, non_blocking=True) if device.type != "cpu" else host
    host_np = host.numpy()
    o = 0
    for (h, a), n in zip(_walk(dev), prog.sizes):
        v, hv = buf[o : o + n], host_np[o : o + n]
        o += n
        if a == "cu_q":
            cu_q = (v, hv)
        elif a == "cu_k":  # right after the same call's cu_q
            h.cu_q, h.cu_k = cu_q[0], v
            # on CPU the reference kernel runs: its work items are made here, ahead of the call
            h.seg = Segments.from_host(h.cu_q, h.cu_k, cu_q[1], hv,
                                       reference_work=device.type == "cpu")
        else:
            setattr(h, a, v)
    dev._keep = [host, buf]
    return dev
