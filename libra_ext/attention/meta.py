"""Per-slot attention programs: a StepPlan turned, once per (replica, slot), into the compact
tables the operator runs (`exchange.py`), and their expansion on the device.

Host side (`compile_slot`, `compile_wlb`): O(documents + tiles) work, vectorized numpy, in the
sampler's thread one step ahead. A program holds only *descriptors* - kernel calls as
cu_seqlens, and gathers as runs (base, rows, width, row stride: the vectors base + i * stride +
j for i < rows, j < width) - never an index per token or vector. `stage` lays a program's
arrays out in one int32 buffer; `upload` copies it to the device in one pinned, non-blocking
transfer and expands every run into its index tensor there (`expand_runs`: a fixed number of
vectorized device ops per array, no host work per vector), once per slot; every layer and the
backward reuse the result.

Legend: C cp ranks, n real tokens of the packed sequence, t = ceil(n / C) slots per rank
(contiguous layout, `thd`), S' = C t rows of X (the Ulysses buffers Xq [S', hl, d] and Xk, Xv
[S', kvl, d]: the sequence in order, this rank's head slice), hl / kvl query / KV heads of the
slice, gl = hl / kvl query heads per KV head, px members of the exchange pool. A *vector* is one
head of one token (d elements); Xq flat is [S' hl, d], Xk flat [S' kvl, d].

What runs where (the Ulysses family: ulysses, libra, distca):
  direct   one kernel call over X itself (no copy): for every document of this rank's sequence
           its last local run of rows with all heads (rows [a, b) against the prefix [0, b));
           rows it does not run there are zero-key segments (no work, no gradient) and keys it
           does not read zero-query segments, so the call's cu_seqlens tile X in order. Its
           output is the layer's O buffer [S', hl, d]: whatever runs elsewhere is scattered in.
  lpack    the rare local rest (earlier runs of a document, head-partial pieces): gathered from
           X into packs, at most two (heads, KV heads) classes.
  units    moved work, one unit per (segment, KV head): rows [a, b) of a document, the unit's
           query heads of that KV group, against the prefix [0, b) of that KV head. A *stream*
           (document, KV head, executor) ships the longest prefix its units need once.
  chunks   streams (atomic, with their units) cut into `chunks` parts balanced by bytes, each
           split into a direct sub-chunk (streams with one unit of the full class gl: the
           executor's call reads the received Q/K/V as they arrive, no copy) and a pack
           sub-chunk (the rest, gathered from what arrived, at most two classes). Per sub-chunk
           one all-to-all per tensor (Q, K, V) carries each owner's units in canonical order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from libra_ext import _planner as _core
from libra_ext import costmodel
from libra_ext.attention import thd
from libra_ext.attention.kernels import Segments, rounded_max
from libra_ext.planner import StepPlan

_I64 = np.int64
INDEX_DTYPE = np.int32
"""The staged (and device) arrays' dtype: every index of a rank's buffers is below 2^31, and the
device ops take int32 indices (index_select, index_add_, index_put_; cu_seqlens are int32)."""

# ------------------------------------------------------------------------------------------
# Descriptors
# ------------------------------------------------------------------------------------------


@dataclass
class CallPlan:
    """One batched varlen kernel call: segments (cu_q, cu_k) with hc query and hk KV heads
    each; after `upload`, `seg` holds the device layout."""

    hc: int
    hk: int
    cu_q: np.ndarray | torch.Tensor
    cu_k: np.ndarray | torch.Tensor
    max_q: int
    max_k: int
    seg: Segments | None = None

    @staticmethod
    def of(hc: int, hk: int, q_len, k_len) -> "CallPlan":
        q_len, k_len = np.asarray(q_len, dtype=_I64), np.asarray(k_len, dtype=_I64)
        return CallPlan(hc, hk, np.r_[0, np.cumsum(q_len)].astype(_I64),
                        np.r_[0, np.cumsum(k_len)].astype(_I64), rounded_max(q_len),
                        rounded_max(k_len))

    @property
    def n_q(self) -> int:
        return int(self.seg.host_q[-1]) if self.seg is not None else int(self.cu_q[-1])

    @property
    def n_k(self) -> int:
        return int(self.seg.host_k[-1]) if self.seg is not None else int(self.cu_k[-1])


@dataclass
class Gather:
    """Vector indices as runs: [n_runs, 4] (base, rows, width, stride) -> the vectors base + i *
    stride + j, i < rows, j < width, run after run; `idx` the expanded device tensor."""

    runs: np.ndarray | torch.Tensor
    size: int
    idx: torch.Tensor | None = None

    @staticmethod
    def of(base, rows, width, stride) -> "Gather":
        cols = np.broadcast_arrays(*(np.asarray(x, dtype=_I64) for x in (base, rows, width,
                                                                          stride)))
        runs = np.stack([c.reshape(-1) for c in cols], axis=1)
        keep = runs[:, 1] * runs[:, 2] > 0
        runs = runs[keep]
        return Gather(runs, int((runs[:, 1] * runs[:, 2]).sum()))


@dataclass
class PackCall:
    """A kernel call on packs gathered from a source buffer: its queries' vectors (q) and its
    keys' vectors (k; values the same in the value buffer). Outputs and query gradients land on
    the query vectors (`out`: where, when they are not the q gather itself)."""

    call: CallPlan
    q: Gather
    k: Gather


@dataclass
class SubChunk:
    """One all-to-all round of the pool exchange (counts in vectors per member: Q vectors, and
    K vectors - V the same). `direct`: the executor runs its received units in one call on the
    receive buffers themselves; else `packs` gather them (at most two calls)."""

    direct: bool
    part: int
    """Which of the `chunks` byte-balanced parts it belongs to (each part: a direct and a pack
    sub-chunk, the empty ones left out)."""
    q_send: list
    kv_send: list
    q_recv: list
    kv_recv: list
    q_send_off: int
    kv_send_off: int
    q_ranges: list = field(default_factory=list)
    """This member's Q messages in send order as ranges (member, vectors, first Xq-flat vector
    - or -1 for a range that travels gathered): `_ranges`."""
    kv_ranges: list = field(default_factory=list)
    q_recv_ranges: list = field(default_factory=list)
    """The ranges this member receives, (member, vectors), in receive order: each sender's."""
    kv_recv_ranges: list = field(default_factory=list)
    call: CallPlan | None = None
    """direct: the call over this sub-chunk's received Q / K / V regions."""
    packs: list = field(default_factory=list)
    """not direct: PackCalls gathering from this sub-chunk's received regions (offsets relative
    to them)."""

    @property
    def n_q_send(self) -> int:
        return sum(self.q_send)

    @property
    def n_kv_send(self) -> int:
        return sum(self.kv_send)

    @property
    def n_q_recv(self) -> int:
        return sum(self.q_recv)

    @property
    def n_kv_recv(self) -> int:
        return sum(self.kv_recv)


@dataclass
class SlotProgram:
    """Everything one rank runs for one (replica, slot): the Ulysses family (libra, distca,
    ulysses; wlb at one cp rank)."""

    replica: int
    slot: int
    cp: int
    t: int
    """Slots per cp rank (contiguous layout)."""
    tokens: int
    heads_local: int
    kv_heads_local: int
    head_dim: int
    members: int
    """px: members of the exchange pool."""
    direct: CallPlan
    """Over X: one segment per document run, zero-key / zero-query segments elsewhere."""
    lpacks: list
    """Local PackCalls over X (at most two)."""
    subchunks: list
    send_q: Gather
    """Xq-flat vectors of every sub-chunk's outgoing Q messages, in send order (the same
    vectors take the returned O and dQ)."""
    send_kv: Gather
    """Xk-flat vectors of the outgoing K (and V) messages."""
    tiles_executed: int
    early_returns: bool = False
    """Under system.attention_memory = rebuild: run the executed units' backward, and wait for
    every return, before the direct call's backward (`early_return_groups`; the same for every
    member of the exchange group)."""
    _keep: list = field(default_factory=list, repr=False)
    _staged: tuple | None = field(default=None, repr=False, compare=False)
    """(its arrays as one int32 buffer in `_walk`'s order, their sizes), made by the C++
    compiler with the GIL released; `stage` takes it instead of concatenating the arrays."""
    messages: "Messages | None" = field(default=None, repr=False, compare=False)
    """Set by `upload` (with sub-chunks): where this rank's pool messages' ranges lie in its
    own buffers, which of them are sent and received in place."""

    @property
    def rows(self) -> int:
        return self.cp * self.t

    @property
    def calls(self) -> list:
        out = [self.direct] + [p.call for p in self.lpacks]
        for sc in self.subchunks:
            out += [sc.call] if sc.call is not None else [p.call for p in sc.packs]
        return out

    @property
    def exec_blocks(self) -> int:
        return 1 + sum(1 for sc in self.subchunks if sc.n_q_recv)

    @property
    def n_q_send(self) -> int:
        return sum(sc.n_q_send for sc in self.subchunks)

    @property
    def n_kv_send(self) -> int:
        return sum(sc.n_kv_send for sc in self.subchunks)

    @property
    def n_q_recv(self) -> int:
        return sum(sc.n_q_recv for sc in self.subchunks)

    @property
    def n_kv_recv(self) -> int:
        return sum(sc.n_kv_recv for sc in self.subchunks)


@dataclass
class WlbProgram:
    """Per-document CP (WLB-LLM) of one cp rank (cp > 1, zigzag layout): its two chunks of
    every document against the all-gathered K/V, one call; the keys gathered by runs of the
    gathered buffer (every chunk of a document is contiguous there)."""

    cp: int
    t: int
    tokens: int
    call: CallPlan
    kv: Gather
    """Rows of the all-gathered K (and V) [C t] forming the key pack, segment after segment."""
    pad: Gather
    """Local padding slots (zeroed in the output: they attend to nothing)."""
    tiles_executed: int
    _keep: list = field(default_factory=list, repr=False)

    @property
    def calls(self) -> list:
        return [self.call]


# ------------------------------------------------------------------------------------------
# Small vectorized helpers
# ------------------------------------------------------------------------------------------


def _excl(x: np.ndarray) -> np.ndarray:
    return np.cumsum(x) - x


def _runs_of(keys: np.ndarray) -> np.ndarray:
    """Run id of every element of a sorted key array."""
    return np.cumsum(np.r_[True, keys[1:] != keys[:-1]]) - 1 if len(keys) else keys


def _doc_starts(plan: StepPlan) -> np.ndarray:
    """Each plan document's first token inside its packed sequence."""
    L = plan.doc_lengths.astype(_I64)
    off = plan.seq_doc_offsets.astype(_I64)
    cum = np.cumsum(L) - L
    seq = np.repeat(np.arange(plan.n_seq), np.diff(off))
    return cum - cum[off[seq]] if len(L) else cum


PEAK_BASE = 3.6
"""A rank's backward peak without the pool exchange, over its X (Q/K/V in the kernel's layout):
X, O, dO (the layer's and in the kernel's layout) and dX with the kernel's own working memory -
what the fake-CUDA gate measures for one plain call (3.6x). `early_return_groups` weighs the
exchange buffers against it."""


def early_return_groups(plan: StepPlan) -> np.ndarray:
    """Per exchange group (`plan.group_of`), whether its members run the units they execute
    backward - and wait for every return - before their direct call's backward, when that
    lowers the group's modeled backward peak (system.attention_memory = rebuild). Member m,
    with X_m its X, E_m = 3 Q + K/V elements it executes (their Q and O kept or rebuilt, their
    dO received) and R_m = Q + K/V elements it moved out (their dQ, dK, dV returned):
    late (today's order), max_m PEAK_BASE X_m + E_m - the direct backward beside the executed
    units' memory; early, max_m max((PEAK_BASE - 1) X_m + E_m + R_m, PEAK_BASE X_m + R_m) -
    the executed units' backward before dX exists, then the direct backward beside the returns
    waiting to be added. Early where it is lower: a function of the plan alone, the same on
    every member. The early term is an upper bound: the operator lands returned dQ in dO, sums
    a K/V vector's returns before the direct backward and posts a sub-chunk ahead only where
    it fits (`exchange._Exchange`), so an early group holds less than R_m and E_m at once.
    Cached on the plan. The specification of the C++ compiler's `early_returns`
    (cpp/src/program.cpp), which the sampler's programs carry."""
    cached = getattr(plan, "_early_returns", None)
    if cached is not None:
        return cached
    px, m = plan.exchange_pool, plan.slots
    q, kv = (np.asarray(x, dtype=np.float64) for x in (plan.xchg_q, plan.xchg_kv))
    out = np.zeros(q.shape[0], dtype=bool)
    if px > 1 and q.any():
        tokens = np.zeros((plan.dp, m))
        tokens[plan.seq_replica, plan.seq_slot] = plan.sequence_tokens()
        rows = plan.cp * np.ceil(tokens / plan.cp)
        x = rows * (plan.heads_local + 2 * plan.kv_heads_local) * plan.head_dim  # [D, m]
        xg = x.reshape(-1, px, m).transpose(0, 2, 1).reshape(-1, px)  # [G, member]
        e = 3.0 * q.sum(axis=1) + kv.sum(axis=1)  # received, per member
        r = q.sum(axis=2) + kv.sum(axis=2)  # sent, per member
        late = (PEAK_BASE * xg + e).max(axis=1)
        early = np.maximum((PEAK_BASE - 1.0) * xg + e + r, PEAK_BASE * xg + r).max(axis=1)
        out = early < late
    plan._early_returns = out
    return out


def sequence_lengths(plan: StepPlan, replica: int, slot: int) -> np.ndarray:
    """Document lengths of the sequence the plan places at (replica, slot)."""
    seq = plan.sequence_at(replica, slot)
    off = plan.seq_doc_offsets
    return plan.doc_lengths[off[seq] : off[seq + 1]].astype(_I64)


# ------------------------------------------------------------------------------------------
# The group's segments: one per (tile, document), with owner and executor members
# ------------------------------------------------------------------------------------------


@dataclass
class _Segs:
    """Segments of an exchange group (struct of arrays): rows [a, b) of plan document `doc`
    (starting at `ds` in its sequence) against the prefix [0, b), heads [h0, h0 + hc) of the
    slice, owner and executor members."""

    doc: np.ndarray
    ds: np.ndarray
    a: np.ndarray
    b: np.ndarray
    h0: np.ndarray
    hc: np.ndarray
    owner: np.ndarray
    exe: np.ndarray

    def take(self, idx) -> "_Segs":
        return _Segs(*(getattr(self, f)[idx] for f in ("doc", "ds", "a", "b", "h0", "hc",
                                                      "owner", "exe")))

    def __len__(self) -> int:
        return len(self.doc)


def _group_segments(plan: StepPlan, replica: int, slot: int) -> tuple[_Segs, int, int]:
    """(the segments of the exchange group of (replica, slot), its first replica, the number
    of its tiles this replica executes)."""
    px = plan.exchange_pool
    base = (replica // px) * px
    g = plan.group_of(replica, slot)
    tiles = np.asarray(plan.send_order[plan.send_group_offsets[g] : plan.send_group_offsets[g + 1]],
                       dtype=_I64)
    if len(tiles) and (plan.tile_cp[tiles] != -1).any():
        raise ValueError("plan tiles name a cp rank: a per-document CP plan (wlb)")
    cnt = plan.tile_doc_count[tiles].astype(_I64)
    st = np.repeat(np.arange(len(tiles)), cnt)  # segment -> its tile
    t = tiles[st]
    doc = plan.tile_doc[t].astype(_I64) + thd.within(cnt)
    ds = _doc_starts(plan)[doc] if len(doc) else doc
    single = cnt[st] == 1
    a = np.where(single, plan.tile_q_start[t] - ds, 0)
    b = np.where(single, a + plan.tile_q_len[t], plan.doc_lengths[doc])
    bad = single & ((plan.tile_kv_start[t] != ds) | (plan.tile_kv_len[t] != b))
    if bad.any():
        raise ValueError(
            f"plan tile {int(t[np.argmax(bad)])}: its KV range must be its document's prefix "
            "up to its last row"
        )
    segs = _Segs(doc, ds, a.astype(_I64), b.astype(_I64),
                 plan.tile_head_start[t].astype(_I64), plan.tile_head_count[t].astype(_I64),
                 plan.tile_owner[t].astype(_I64) - base, plan.tile_executor[t].astype(_I64) - base)
    executed = int((plan.tile_executor[tiles] == replica).sum())
    return segs, base, executed


def _merge_rows(s: _Segs) -> _Segs:
    """Segments of one document, owner, executor and head range with adjacent rows merged
    (rows [a, c) and [c, b) become [a, b))."""
    if not len(s):
        return s
    o = np.lexsort((s.a, s.hc, s.h0, s.doc, s.exe, s.owner))
    s = s.take(o)
    same = ((s.owner[1:] == s.owner[:-1]) & (s.exe[1:] == s.exe[:-1]) & (s.doc[1:] == s.doc[:-1])
            & (s.h0[1:] == s.h0[:-1]) & (s.hc[1:] == s.hc[:-1]) & (s.a[1:] == s.b[:-1]))
    first = np.r_[True, ~same]
    run = np.cumsum(first) - 1
    out = s.take(np.flatnonzero(first))
    out.b = np.maximum.reduceat(s.b, np.flatnonzero(first)) if len(run) else out.b
    return out


# ------------------------------------------------------------------------------------------
# Local work: the direct call over X and the packs
# ------------------------------------------------------------------------------------------


def _direct_call(L: np.ndarray, runs: _Segs, hl: int, kvl: int, rows: int) -> CallPlan:
    """The call over X: per document of the sequence (lengths L), its run in `runs` (at most one
    per document: rows [a, b) against the prefix [0, b)); rows outside it zero-key segments,
    keys past it a zero-query segment; the padding rows [n, rows) one more zero-key segment."""
    n_doc = len(L)
    a, b = np.zeros(n_doc, dtype=_I64), np.zeros(n_doc, dtype=_I64)
    a[runs.doc], b[runs.doc] = runs.a, runs.b
    zero = np.zeros(n_doc, dtype=_I64)
    # per document: (q a, k 0) (q b - a, k b) (q L - b, k 0) (q 0, k L - b); without a run,
    # a = b = 0: its rows one zero-key segment, its keys one zero-query segment
    q = np.stack([a, b - a, L - b, zero], 1).reshape(-1)
    k = np.stack([zero, b, zero, L - b], 1).reshape(-1)
    keep = (q > 0) | (k > 0)
    q, k = q[keep], k[keep]
    n = int(L.sum())
    if rows > n:  # the padding rows past the sequence
        q, k = np.r_[q, rows - n], np.r_[k, 0]
    if not len(q):
        q, k = np.zeros(1, dtype=_I64), np.zeros(1, dtype=_I64)
    return CallPlan.of(hl, kvl, q, k)


def _native_pieces(h0: np.ndarray, hc: np.ndarray, gl: int):
    """Cut head ranges into pieces a GQA kernel runs natively: inside one KV group (hk 1) or
    whole aligned groups (hk = hc / gl). Returns (piece -> source, h0, hc, hk)."""
    g0, g1 = h0 // gl, (h0 + hc - 1) // gl
    aligned = (h0 % gl == 0) & (hc % gl == 0)
    n = np.where(aligned | (g0 == g1), 1, g1 - g0 + 1)
    src = np.repeat(np.arange(len(h0)), n)
    i = thd.within(n)
    split = n[src] > 1
    p0 = np.where(split, np.maximum(h0[src], (g0[src] + i) * gl), h0[src])
    p1 = np.where(split, np.minimum(h0[src] + hc[src], (g0[src] + i + 1) * gl), p0 + hc[src])
    pc = p1 - p0
    hk = np.where(aligned[src] & (pc >= gl), pc // gl, 1)
    return src, p0, pc, hk


def _two_classes(h0, hc, hk, rows, gl: int):
    """At most two (hc, hk) classes: the class with the most work stays, every other piece is
    cut into units of u heads (u divides their head counts and, where whole KV groups are among
    them, the group size). Returns (piece -> source, h0, hc, hk)."""
    keys = hc * 1_000_003 + hk
    uk = np.unique(keys)
    if len(uk) <= 2:
        return np.arange(len(h0)), h0, hc, hk
    vol = np.array([int((rows[keys == k] * hc[keys == k]).sum()) for k in uk])
    top = uk[np.lexsort((-(uk // 1_000_003), -vol))[0]]
    other = keys != top
    u = int(np.gcd.reduce(hc[other]))
    if (hk[other] > 1).any():
        u = math.gcd(u, gl)
    n = np.where(other, hc // u, 1)
    src = np.repeat(np.arange(len(n)), n)
    i = thd.within(n)
    cut = other[src]
    return (src, np.where(cut, h0[src] + i * u, h0[src]), np.where(cut, u, hc[src]),
            np.where(cut, 1, hk[src]))


@dataclass
class _Pieces:
    """Pieces of packed work: query rows r < rows of heads [h0, h0 + hc) at the vectors
    q_base + r * q_rstride + (h - q_h0), against keys r < k_rows of KV heads h // gl at
    k_base + r * k_rstride + (kv head - k_h0)."""

    q_base: np.ndarray
    q_rstride: np.ndarray
    q_h0: np.ndarray
    k_base: np.ndarray
    k_rstride: np.ndarray
    k_h0: np.ndarray
    rows: np.ndarray
    k_rows: np.ndarray
    h0: np.ndarray
    hc: np.ndarray

    def take(self, idx) -> "_Pieces":
        return _Pieces(*(getattr(self, f.name)[idx] for f in self.__dataclass_fields__.values()))


def _pack_calls(p: _Pieces, gl: int) -> list:
    """PackCalls (at most two (heads, KV heads) classes) for pieces; each piece is one segment:
    its query rows against its keys, bottom-right aligned."""
    if not len(p.h0):
        return []
    src, p0, pc, hk = _native_pieces(p.h0, p.hc, gl)
    src2, p0, pc, hk = _two_classes(p0, pc, hk, p.rows[src], gl)
    src = src[src2]
    s = p.take(src)
    out = []
    keys = pc * 1_000_003 + hk
    for key in np.unique(keys):
        sel = np.flatnonzero(keys == key)
        c, kk = int(pc[sel[0]]), int(hk[sel[0]])
        x = s.take(sel)
        q = Gather.of(x.q_base + p0[sel] - x.q_h0, x.rows, c, x.q_rstride)
        k = Gather.of(x.k_base + p0[sel] // gl - x.k_h0, x.k_rows, kk, x.k_rstride)
        out.append(PackCall(CallPlan.of(c, kk, x.rows, x.k_rows), q, k))
    return out


# ------------------------------------------------------------------------------------------
# Moved work: units, streams, sub-chunks
# ------------------------------------------------------------------------------------------


@dataclass
class _Units:
    """Moved units (one KV head each) with their streams and sub-chunks (struct of arrays)."""

    owner: np.ndarray
    exe: np.ndarray
    ds: np.ndarray
    a: np.ndarray
    b: np.ndarray
    h0: np.ndarray
    hc: np.ndarray
    kh: np.ndarray
    stream: np.ndarray  # stream id of each unit
    # per stream:
    s_owner: np.ndarray
    s_exe: np.ndarray
    s_ds: np.ndarray
    s_kh: np.ndarray
    s_len: np.ndarray
    s_direct: np.ndarray
    s_sub: np.ndarray  # sub-chunk of each stream


def _units(moved: _Segs, gl: int, kvl: int) -> tuple:
    """Moved segments cut into units, grouped into streams (document, KV heads, executor), in
    canonical order (executor, owner, document, KV head, first row, first head). A unit is
    one KV head of a segment - or, with kvl > 1 where every moved segment of a (document,
    executor) holds all the slice's heads, the segment over all its KV heads (a *whole* unit:
    its Q rows and its stream's K/V prefix are contiguous in X). Returns (unit arrays, first
    heads, head counts, KV heads, stream ids, stream arrays)."""
    hl = gl * kvl
    whole = np.zeros(len(moved), dtype=bool)
    if kvl > 1 and len(moved):
        key = moved.exe * (moved.doc.max(initial=0) + 1) + moved.doc
        _, inv = np.unique(key, return_inverse=True)
        part = np.zeros(inv.max(initial=-1) + 1, dtype=bool)
        np.logical_or.at(part, inv, moved.hc != hl)
        whole = ~part[inv]
    k0 = np.where(whole, kvl, moved.h0 // gl)
    k1 = np.where(whole, kvl, (moved.h0 + moved.hc - 1) // gl)
    n = k1 - k0 + 1
    src = np.repeat(np.arange(len(moved)), n)
    kh = k0[src] + thd.within(n)  # kvl: a whole unit (sorts after the document's KV heads)
    w = whole[src]
    h0 = np.where(w, 0, np.maximum(moved.h0[src], kh * gl))
    h1 = np.where(w, hl, np.minimum(moved.h0[src] + moved.hc[src], (kh + 1) * gl))
    u = moved.take(src)
    o = np.lexsort((h0, u.a, kh, u.doc, u.owner, u.exe))
    u, kh, h0, h1 = u.take(o), kh[o], h0[o], h1[o]
    skey = (u.exe * (u.doc.max(initial=0) + 1) + u.doc) * (kvl + 1) + kh
    stream = _runs_of(skey)
    first = np.r_[True, skey[1:] != skey[:-1]] if len(skey) else np.zeros(0, dtype=bool)
    sf = np.flatnonzero(first)
    n_units = np.diff(np.r_[sf, len(skey)])
    s_len = np.maximum.reduceat(u.b, sf) if len(sf) else np.zeros(0, dtype=_I64)
    s_whole = kh[sf] == kvl
    # the direct class: whole units with kvl > 1, one KV head's full group with kvl = 1
    direct = (n_units == 1) & (s_whole if kvl > 1 else (h1 - h0)[sf] == gl)
    return (u, h0, h1 - h0, kh, stream,
            dict(owner=u.owner[sf], exe=u.exe[sf], ds=u.ds[sf], kh=kh[sf], len=s_len,
                 width=np.where(s_whole, kvl, 1), direct=direct))


def _subchunks_of(s_exe, s_size, s_direct, px: int, chunks: int) -> np.ndarray:
    """Each stream's sub-chunk: per executor its streams (in canonical order) cut into `chunks`
    parts of about equal bytes (a stream lands where the middle of its bytes falls), each part
    split into its direct and its pack streams: sub-chunk = 2 part + (not direct)."""
    pos = np.zeros(len(s_exe), dtype=_I64)
    total = np.zeros(px, dtype=_I64)
    for e in range(px):  # (members, not streams)
        sel = np.flatnonzero(s_exe == e)
        pos[sel] = _excl(s_size[sel]) + s_size[sel] // 2
        total[e] = s_size[sel].sum()
    part = np.minimum(chunks - 1, (pos * chunks) // np.maximum(total[s_exe], 1))
    return 2 * part + (~s_direct).astype(_I64)


MAX_IN_PLACE = 4
"""In-place ranges per message at most (each one point-to-point transfer): beyond them a
message's smaller ranges travel gathered, so a message costs a bounded number of transfers
however many documents it carries."""


def _ranges(start, n, ok, limit: int = MAX_IN_PLACE) -> list:
    """A message's items - `n` vectors from `start` each, `ok` where they are one contiguous
    range - in send order, as ranges [(vectors, first vector or -1)]: consecutive ok items
    that continue one another form one range sent in place, consecutive other items one range
    that travels gathered (-1). Beyond `limit` in-place ranges the smaller ones (the later
    among equals) travel gathered too, merged with gathered neighbours."""
    rs = []  # [vectors, start, in place]
    for x, c, o in zip(start, n, ok):
        x, c, o = int(x), int(c), bool(o)
        if c == 0:
            continue
        if rs and (o and rs[-1][2] and rs[-1][1] + rs[-1][0] == x or not o and not rs[-1][2]):
            rs[-1][0] += c
        else:
            rs.append([c, x, o])
    placed = [i for i, r in enumerate(rs) if r[2]]
    if len(placed) > limit:
        keep = set(sorted(placed, key=lambda i: (-rs[i][0], i))[:limit])
        for i in placed:
            rs[i][2] = i in keep
    out = []
    for c, x, o in rs:
        if out and not o and out[-1][1] < 0:
            out[-1][0] += c
        else:
            out.append([c, x if o else -1])
    return [(c, x) for c, x in out]


def _message_ranges(units_info, u_sub, s_sub, k: int, owner: int, exe: int, hl: int,
                    kvl: int) -> tuple:
    """(Q ranges, K ranges) of the message of sub-chunk k from `owner` to `exe`: its units
    (streams) in canonical order, a unit's Q rows contiguous in Xq where it holds every head
    of the slice (or one row), a stream's prefix in Xk where it holds every KV head (or one
    row)."""
    u, uh0, uhc, ukh, stream, st = units_info
    su = np.flatnonzero((u.owner == owner) & (u.exe == exe) & (u_sub == k))
    q = _ranges((u.ds[su] + u.a[su]) * hl + uh0[su], (u.b[su] - u.a[su]) * uhc[su],
                (uhc[su] == hl) | (u.b[su] - u.a[su] == 1))
    ss = np.flatnonzero((st["owner"] == owner) & (st["exe"] == exe) & (s_sub == k))
    w = st["width"][ss]
    kv = _ranges(st["ds"][ss] * kvl + np.where(w > 1, 0, st["kh"][ss]), st["len"][ss] * w,
                 (w == kvl) | (st["len"][ss] == 1))
    return q, kv


def _exchange(units_info, px: int, me: int, chunks: int, hl: int, kvl: int) -> tuple:
    """The sub-chunks of the exchange seen from member `me` and its send gathers."""
    u, uh0, uhc, ukh, stream, st = units_info
    if not len(u):
        return [], Gather.of([], [], [], []), Gather.of([], [], [], [])
    q_vec = (u.b - u.a) * uhc  # per unit
    s_q = np.bincount(stream, weights=q_vec, minlength=len(st["len"])).astype(_I64)
    s_kv = st["len"] * st["width"]  # K vectors per stream (V the same)
    s_size = s_q + 2 * s_kv
    s_sub = _subchunks_of(st["exe"], s_size, st["direct"], px, chunks)
    u_sub = s_sub[stream]
    active = np.unique(s_sub)  # sub-chunks with traffic, renumbered without gaps
    s_sub, u_sub = np.searchsorted(active, s_sub), np.searchsorted(active, u_sub)
    n_sub = len(active)
    # vectors per (sub-chunk, owner, executor)
    cell_u = (u_sub * px + u.owner) * px + u.exe
    cell_s = (s_sub * px + st["owner"]) * px + st["exe"]
    nq = np.bincount(cell_u, weights=q_vec, minlength=n_sub * px * px).astype(_I64)
    nkv = np.bincount(cell_s, weights=s_kv, minlength=n_sub * px * px).astype(_I64)
    nq, nkv = nq.reshape(n_sub, px, px), nkv.reshape(n_sub, px, px)
    # my send gathers: units (and streams) I own, in (sub-chunk, executor, canonical) order
    mine_u = np.flatnonzero(u.owner == me)
    mine_u = mine_u[np.lexsort((mine_u, u.exe[mine_u], u_sub[mine_u]))]
    send_q = Gather.of((u.ds[mine_u] + u.a[mine_u]) * hl + uh0[mine_u], u.b[mine_u] - u.a[mine_u],
                       uhc[mine_u], hl)
    mine_s = np.flatnonzero(st["owner"] == me)
    mine_s = mine_s[np.lexsort((mine_s, st["exe"][mine_s], s_sub[mine_s]))]
    whole = st["width"][mine_s] > 1  # all KV heads: from the first
    send_kv = Gather.of(st["ds"][mine_s] * kvl + np.where(whole, 0, st["kh"][mine_s]),
                        st["len"][mine_s], st["width"][mine_s], kvl)
    subs = []
    q_send_off = kv_send_off = 0
    for k in range(n_sub):
        sc = SubChunk(direct=bool(active[k] % 2 == 0), part=int(active[k] // 2),
                      q_send=nq[k, me].tolist(), kv_send=nkv[k, me].tolist(),
                      q_recv=nq[k, :, me].tolist(),
                      kv_recv=nkv[k, :, me].tolist(), q_send_off=q_send_off,
                      kv_send_off=kv_send_off)
        q_send_off, kv_send_off = q_send_off + sc.n_q_send, kv_send_off + sc.n_kv_send
        for j in range(px):
            if sc.q_send[j] or sc.kv_send[j]:
                q, kv = _message_ranges(units_info, u_sub, s_sub, k, me, j, hl, kvl)
                sc.q_ranges += [(j, c, x) for c, x in q]
                sc.kv_ranges += [(j, c, x) for c, x in kv]
            if sc.q_recv[j] or sc.kv_recv[j]:
                q, kv = _message_ranges(units_info, u_sub, s_sub, k, j, me, hl, kvl)
                sc.q_recv_ranges += [(j, c) for c, _ in q]
                sc.kv_recv_ranges += [(j, c) for c, _ in kv]
        _executor_calls(sc, k, units_info, u_sub, s_sub, me, px, hl // kvl)
        subs.append(sc)
    return subs, send_q, send_kv


def _executor_calls(sc: SubChunk, k: int, units_info, u_sub, s_sub, me: int, px: int,
                    gl: int) -> None:
    """The calls member `me` runs on what sub-chunk k brings it: its units in receive order
    (owner by owner, canonical inside), each against its stream's prefix."""
    u, uh0, uhc, ukh, stream, st = units_info
    sel = np.flatnonzero((u.exe == me) & (u_sub == k))
    if not len(sel):
        return
    sel = sel[np.lexsort((sel, u.owner[sel]))]  # receive order: owner, then canonical
    rows = u.b[sel] - u.a[sel]
    if sc.direct:  # one unit per stream, the direct class: the received buffers as they are
        kvl = int(st["width"][stream[sel]].max())  # whole units, or one KV head's group
        sc.call = CallPlan.of(gl * kvl, kvl, rows, u.b[sel])
        return
    # streams of this sub-chunk in receive order, and where each unit's Q and stream's K land
    ss = np.flatnonzero((st["exe"] == me) & (s_sub == k))
    ss = ss[np.lexsort((ss, st["owner"][ss]))]
    s_off = np.zeros(len(st["len"]), dtype=_I64)
    s_off[ss] = _excl(st["len"][ss] * st["width"][ss])
    width = st["width"][stream[sel]]
    sc.packs = _pack_calls(_Pieces(
        q_base=_excl(rows * uhc[sel]), q_rstride=uhc[sel], q_h0=uh0[sel],
        k_base=s_off[stream[sel]], k_rstride=width, k_h0=np.where(width > 1, 0, ukh[sel]),
        rows=rows, k_rows=u.b[sel], h0=uh0[sel], hc=uhc[sel]), gl)


# ------------------------------------------------------------------------------------------
# Compilation
# ------------------------------------------------------------------------------------------


def compile_plain(doc_lengths, heads_local: int, kv_heads_local: int, head_dim: int,
                  cp: int = 1) -> SlotProgram:
    """The program of a sequence run whole on one rank's head slice (every document one
    segment, no exchange): what ulysses compiles to, and per-document CP at one cp rank."""
    L = np.asarray(doc_lengths, dtype=_I64).reshape(-1)
    t = thd.contiguous_slots(int(L.sum()), cp)
    runs = _Segs(*(np.zeros(0, dtype=_I64) for _ in range(8)))
    runs.doc, runs.a, runs.b = np.arange(len(L)), np.zeros(len(L), dtype=_I64), L.copy()
    empty = Gather.of([], [], [], [])
    return SlotProgram(
        replica=0, slot=0, cp=cp, t=t, tokens=int(L.sum()), heads_local=heads_local,
        kv_heads_local=kv_heads_local, head_dim=head_dim, members=1,
        direct=_direct_call(L, runs, heads_local, kv_heads_local, cp * t), lpacks=[],
        subchunks=[], send_q=empty, send_kv=replace(empty), tiles_executed=len(L))


def _check_slot_args(plan: StepPlan, replica: int, slot: int, chunks: int) -> None:
    if plan.system == "wlb":
        raise ValueError("compile_slot serves libra, distca and ulysses plans; use compile_wlb")
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    if not 0 <= replica < plan.dp or not 0 <= slot < plan.slots:
        raise ValueError(
            f"(replica, slot) = ({replica}, {slot}) outside the plan's {plan.dp} x {plan.slots}"
        )


def compile_slot(plan: StepPlan, replica: int, slot: int, chunks: int = 2) -> SlotProgram:
    """The program of rank (replica, any cp rank) for `slot` of `plan` (libra, distca,
    ulysses; the same for every cp rank of the replica). Compiled by the C++ core with the GIL
    released (`cpp/src/program.cpp`): a thread launching kernels runs on while the sampler's
    thread compiles. `compile_slot_reference` is its oracle, array for array."""
    return compile_slots(plan, replica, [slot], chunks)[0]


def compile_slots(plan: StepPlan, replica: int, slots, chunks: int = 2,
                  staged_only: bool = False) -> list:
    """`compile_slot` for each of `slots`, the plan read once and all of them compiled in one
    call with the GIL released. `staged_only`: each program is returned as the C++ compiler
    made it (`NativeProgram`), for `stage` and `upload` alone - the sampler's thread, which
    makes them one step ahead, then makes no Python object per call, gather or message while
    it holds the GIL; `upload` unpacks the program on the thread that runs it."""
    slots = [int(s) for s in slots]
    for slot in slots:
        _check_slot_args(plan, replica, slot, chunks)
    out = []
    for slot, (native, flat, sizes, early) in zip(
            slots, _core.compile_slots(plan, int(replica), slots, int(chunks)), strict=True):
        prog = NativeProgram(replica, slot, plan.cp, plan.heads_local, plan.kv_heads_local,
                             plan.head_dim, plan.exchange_pool, native,
                             (flat, sizes) if flat is not None else None, early)
        out.append(prog if staged_only else prog.unpack())
    return out


@dataclass
class NativeProgram:
    """A slot's program as the C++ compiler returns it: the compiled program (`native`, a
    `_planner.CompiledProgram`) and, where every entry fits in int32, its arrays staged as one
    int32 buffer. `unpack` makes the SlotProgram."""

    replica: int
    slot: int
    cp: int
    heads_local: int
    kv_heads_local: int
    head_dim: int
    members: int
    native: object
    _staged: tuple | None = field(default=None, repr=False)
    early_returns: bool = False

    def unpack(self, arrays: bool = True) -> SlotProgram:
        """The SlotProgram. `arrays`: its calls' cu_q / cu_k and its gathers' runs as numpy
        arrays; without, None (an upload reads them from the staged buffer)."""
        t, tokens, executed, direct, lpacks, subs, send_q, send_kv = self.native.unpack(arrays)
        return SlotProgram(
            replica=self.replica, slot=self.slot, cp=self.cp, t=t, tokens=tokens,
            heads_local=self.heads_local, kv_heads_local=self.kv_heads_local,
            head_dim=self.head_dim, members=self.members, direct=CallPlan(*direct),
            lpacks=[_pack_of(p) for p in lpacks],
            subchunks=[SubChunk(d, part, qs, ks, qr, kr, qo, ko, qg, kg, qrg, krg,
                                CallPlan(*call) if call is not None else None,
                                [_pack_of(p) for p in packs])
                       for d, part, qs, ks, qr, kr, qo, ko, call, packs, qg, kg, qrg, krg
                       in subs],
            send_q=Gather(*send_q), send_kv=Gather(*send_kv), tiles_executed=executed,
            early_returns=self.early_returns, _staged=self._staged)


def _pack_of(raw) -> PackCall:
    call, q, k = raw
    return PackCall(CallPlan(*call), Gather(*q), Gather(*k))


def compile_slot_reference(plan: StepPlan, replica: int, slot: int,
                           chunks: int = 2) -> SlotProgram:
    """`compile_slot` in vectorized numpy: the specification the C++ compiler is tested
    against (tests/unit/test_attention_meta.py), with the functions above as its steps."""
    _check_slot_args(plan, replica, slot, chunks)
    hl, kvl = plan.heads_local, plan.kv_heads_local
    gl = hl // kvl
    L = sequence_lengths(plan, replica, slot)
    t = thd.contiguous_slots(int(L.sum()), plan.cp)
    segs, base, executed = _group_segments(plan, replica, slot)
    me, px = replica - base, plan.exchange_pool
    first_doc = plan.seq_doc_offsets[plan.sequence_at(replica, slot)]
    local = _merge_rows(segs.take(np.flatnonzero((segs.owner == me) & (segs.exe == me))))
    local.doc = local.doc - first_doc  # documents of this rank's sequence, in order
    direct, lpacks = _local_work(L, local, hl, kvl, plan.cp * t)
    moved = _merge_rows(segs.take(np.flatnonzero(segs.owner != segs.exe)))
    subchunks, send_q, send_kv = _exchange(_units(moved, gl, kvl), px, me, chunks, hl, kvl)
    return SlotProgram(
        replica=replica, slot=slot, cp=plan.cp, t=t, tokens=int(L.sum()), heads_local=hl,
        kv_heads_local=kvl, head_dim=plan.head_dim, members=px, direct=direct, lpacks=lpacks,
        subchunks=subchunks, send_q=send_q, send_kv=send_kv, tiles_executed=executed,
        early_returns=bool(early_return_groups(plan)[plan.group_of(replica, slot)]))


def _local_work(L: np.ndarray, local: _Segs, hl: int, kvl: int, rows: int) -> tuple:
    """(the direct call, the local packs) of the owner's own segments: per document its last run
    with all heads runs directly on X; its other runs and every head-partial piece are packed."""
    full = local.hc == hl
    runs = local.take(np.flatnonzero(full))
    last = np.r_[runs.doc[1:] != runs.doc[:-1], True] if len(runs) else np.zeros(0, dtype=bool)
    # (_merge_rows sorted by document, heads, first row: a document's last run is last)
    direct = _direct_call(L, runs.take(np.flatnonzero(last)), hl, kvl, rows)
    rest = local.take(np.r_[np.flatnonzero(~full), np.flatnonzero(full)[~last]].astype(_I64))
    n = len(rest)
    lpacks = _pack_calls(_Pieces(
        q_base=(rest.ds + rest.a) * hl, q_rstride=np.full(n, hl, dtype=_I64),
        q_h0=np.zeros(n, dtype=_I64), k_base=rest.ds * kvl, k_rstride=np.full(n, kvl, dtype=_I64),
        k_h0=np.zeros(n, dtype=_I64), rows=rest.b - rest.a, k_rows=rest.b, h0=rest.h0,
        hc=rest.hc), hl // kvl)
    return direct, lpacks


def compile_wlb(doc_lengths, cp: int, cp_rank: int, heads_local: int, kv_heads_local: int,
                head_dim: int):
    """Per-document CP of cp rank `cp_rank` (zigzag layout): segments are its chunks (c and
    2C-1-c of every document, in local slot order): the chunk's real rows against the document's
    prefix up to them, its padding rows a zero-key segment. At one cp rank it is the plain
    program (`compile_plain`, with these head counts)."""
    L = np.asarray(doc_lengths, dtype=_I64).reshape(-1)
    C, c = cp, cp_rank
    if not 0 <= c < C:
        raise ValueError(f"cp_rank must be in [0, cp={C}), got {c}")
    if C == 1:
        return compile_plain(L, heads_local, kv_heads_local, head_dim)
    ch = thd.padded_lengths(L, C) // (2 * C)
    t = int(2 * ch.sum())
    n = len(L)
    slot0 = _excl(2 * ch)  # each document's first local slot (the same on every rank)
    # per document and local chunk (c, then 2C-1-c): real rows and padding rows
    m = np.stack([np.full(n, c), np.full(n, 2 * C - 1 - c)], 1).reshape(-1)
    doc = np.repeat(np.arange(n), 2)
    real = np.clip(L[doc] - m * ch[doc], 0, ch[doc])
    pad = ch[doc] - real
    q = np.stack([real, pad], 1).reshape(-1)
    k = np.stack([m * ch[doc] + real, np.zeros_like(real)], 1).reshape(-1)
    keep = q > 0
    call = CallPlan.of(0, 0, q[keep], k[keep])
    # key pack: each real segment's prefix, chunk by chunk k' <= m (rank rho(k'), its slot)
    seg = np.flatnonzero(real > 0)
    nk = m[seg] + 1
    ks = np.repeat(seg, nk)
    kc = thd.within(nk)  # chunk k' of the prefix
    rho = np.where(kc < C, kc, 2 * C - 1 - kc)
    d = doc[ks]
    kv_base = rho * t + slot0[d] + np.where(kc < C, 0, ch[d])
    kv_rows = np.where(kc < m[ks], ch[d], real[ks])
    pad_base = slot0[doc] + np.where(m == c, 0, ch[doc]) + real
    return WlbProgram(
        cp=C, t=t, tokens=int(L.sum()), call=call, kv=Gather.of(kv_base, kv_rows, 1, 1),
        pad=Gather.of(pad_base, pad, 1, 1), tiles_executed=int(2 * n))


def compile_rank(plan: StepPlan, replica: int, cp_rank: int, chunks: int,
                 staged_only: bool = False) -> list:
    """Host programs of every slot of rank (replica, cp_rank): what the sampler's background
    thread builds one step ahead (`staged_only`: as `compile_slots`)."""
    if plan.system != "wlb":
        return compile_slots(plan, replica, range(plan.slots), chunks, staged_only)
    out = []
    for slot in range(plan.slots):
        L = sequence_lengths(plan, replica, slot)
        if len(L) == 0:  # an empty repacked sequence trains as one padding document
            L = np.array([thd.empty_sequence_tokens(plan.cp, "zigzag")], dtype=_I64)
        out.append(compile_wlb(L, plan.cp, cp_rank, plan.heads_local * plan.cp,
                               plan.kv_heads_local, plan.head_dim))
    return out


def program_features(programs) -> np.ndarray:
    """The cost-model features [costmodel.FEATURES] of a rank's programs in a step: every
    segment of every call, the constant 1 - `costmodel.call_features` over their calls. A
    NativeProgram's are summed by the C++ compiler with the GIL released, without unpacking it
    (the sums are of integers, exact in any order: the same bits)."""
    out = np.zeros(costmodel.FEATURES)
    calls = []
    for prog in programs:
        if isinstance(prog, NativeProgram):
            out += prog.native.features()
        else:
            calls += prog.calls
    return out + costmodel.call_features(calls)


# ------------------------------------------------------------------------------------------
# Staging and upload: descriptors in one pinned buffer, one copy, indices expanded on device
# ------------------------------------------------------------------------------------------


@dataclass
class Messages:
    """This rank's pool messages, sent and received point to point as the compiler cut them
    into ranges (`SubChunk.q_ranges`, ...), in place where they can be: a range that is one
    contiguous run of X-flat vectors is sent from X itself, and its returned O / dQ land in O
    / dQ there; the other ranges travel through one fused gather (out) and one fused scatter
    (back). K and V gradients always come back into a buffer: they are summed per K/V vector
    (`kv_rows`, `kv_order`, `kv_offs`: a vector sent to several executors gets each one's) and
    added to the local ones."""

    q_send: list
    """[k]: (member, vectors, first Xq-flat vector or -1, offset in the gathered rest or -1,
    offset among all of send_q's vectors) per range, in send order. A source or destination
    that is not contiguous - the layer's own Q/K/V at C = 1 can be views into a fused QKV
    projection - sends and receives every range through the whole gather, at the last
    offset."""
    kv_send: list
    q_recv: list
    """[k]: (member, vectors, offset in the sub-chunk's receive buffer) per range."""
    kv_recv: list
    q_rest: torch.Tensor
    """Xq-flat vectors of the ranges that travel gathered, in send order (device)."""
    kv_rest: torch.Tensor
    q_in: torch.Tensor
    """Xq-flat vectors of the ranges sent in place, in send order (device)."""
    kv_rows: torch.Tensor
    """The distinct Xk-flat vectors sent, ascending (device; `kv_distinct` of them)."""
    kv_order: torch.Tensor
    """Positions among every sent K vector (send_kv's order), grouped by kv_rows, in send order
    within a group (device)."""
    kv_offs: torch.Tensor
    """kv_rows' groups in kv_order: [kv_distinct + 1] offsets (device)."""
    kv_distinct: int

    @property
    def in_place(self) -> int:
        """Ranges sent in place (Q and K/V counted apiece)."""
        return sum(x >= 0 for row in self.q_send + self.kv_send for _, _, x, _, _ in row)


def distinct_vectors(runs: np.ndarray) -> int:
    """How many distinct vectors a Gather's runs [n, 4] (base, rows, width, stride) address,
    from the runs alone (O(runs x width) host work, none per vector): each run's columns are
    intervals of rows in their residue class modulo the stride, and the classes' intervals are
    merged. Runs must keep within their row (base mod stride + width <= stride), as the
    compiler's do."""
    runs = np.asarray(runs, dtype=_I64).reshape(-1, 4)
    runs = runs[runs[:, 1] * runs[:, 2] > 0]
    if not len(runs):
        return 0
    base, rows, width, stride = runs.T
    if len(np.unique(stride)) > 1:
        raise ValueError("distinct_vectors: runs of several strides")
    if (stride <= 0).any() or (base % stride + width > stride).any():
        raise ValueError("distinct_vectors: a run leaves its row (base mod stride + width > "
                         "stride)")
    col = np.repeat(np.arange(len(runs)), width)
    j = np.arange(len(col)) - np.repeat(np.cumsum(width) - width, width)
    first = base[col] + j  # each column's first vector
    s = stride[col]
    span = int((first // s + rows[col]).max()) + 1
    start = (first % s) * span + first // s  # residue classes laid end to end
    end = start + rows[col]
    order = np.argsort(start, kind="stable")
    start, end = start[order], end[order]
    reach = np.maximum.accumulate(end)
    before = np.concatenate([[start[0]], reach[:-1]])
    return int(np.maximum(0, end - np.maximum(start, before)).sum())


def vector_groups(idx: torch.Tensor, distinct: int) -> tuple:
    """(the distinct vectors of idx ascending, positions of idx grouped by them in order, the
    groups' offsets): what `rowops.sum_rows_` sums repeated vectors by - a fixed number of
    device ops, sized from the host-known `distinct`."""
    if not idx.numel():
        return idx[:0], idx[:0], idx.new_zeros(1)
    srt, order = torch.sort(idx.long(), stable=True)
    new = torch.ones_like(srt, dtype=torch.bool)
    new[1:] = srt[1:] != srt[:-1]
    group = torch.cumsum(new, 0) - 1
    rows = srt.new_empty(distinct).scatter_(0, group, srt)
    offs = torch.searchsorted(group, torch.arange(distinct + 1, device=idx.device))
    return rows.to(torch.int32), order.to(torch.int32), offs.to(torch.int32)


def _messages(prog: "SlotProgram", kv_runs: np.ndarray) -> "Messages | None":
    """The layout of `prog`'s pool messages from its ranges (its send gathers' device indices
    expanded already; `kv_runs` send_kv's runs on the host): O(ranges), no work per vector;
    None without sub-chunks."""
    subs = prog.subchunks
    if not subs:
        return None

    def sends(attr, idx):
        out, parts, placed, pos, off = [], [], [], 0, 0
        for sc in subs:
            row = []
            for j, n, x in getattr(sc, attr):
                row.append((j, n, x, -1 if x >= 0 else off, pos))
                if x < 0:
                    parts.append((pos, n))
                    off += n
                else:
                    placed.append((pos, n))
                pos += n
            out.append(row)

        def cut(ps):
            return torch.cat([idx[a:a + n] for a, n in ps]) if ps else idx[:0]

        if off == pos:  # everything gathered: the whole gather's indices as they are
            return out, idx, idx[:0]
        return out, cut(parts), cut(placed)

    def recvs(attr):
        out = []
        for sc in subs:
            row, off = [], 0
            for i, n in getattr(sc, attr):
                row.append((i, n, off))
                off += n
            out.append(row)
        return out

    q_send, q_rest, q_in = sends("q_ranges", prog.send_q.idx)
    kv_send, kv_rest, _ = sends("kv_ranges", prog.send_kv.idx)
    distinct = distinct_vectors(kv_runs)
    return Messages(q_send, kv_send, recvs("q_recv_ranges"), recvs("kv_recv_ranges"),
                    q_rest, kv_rest, q_in, *vector_groups(prog.send_kv.idx, distinct),
                    distinct)


def _walk(prog):
    """(holder, attribute) of every host array of a program, in a fixed order (a call's cu_q
    right before its cu_k). `stage_program` in cpp/src/program.cpp lays out the C++ compiler's
    programs in this same order (`SlotProgram._staged`): change both together."""
    out = []
    if isinstance(prog, SlotProgram):
        calls = [prog.direct] + [p.call for p in prog.lpacks]
        gathers = [prog.send_q, prog.send_kv] + [g for p in prog.lpacks for g in (p.q, p.k)]
        for sc in prog.subchunks:
            if sc.call is not None:
                calls.append(sc.call)
            for p in sc.packs:
                calls.append(p.call)
                gathers += [p.q, p.k]
    else:
        calls, gathers = [prog.call], [prog.kv, prog.pad]
    for call in calls:
        out += [(call, "cu_q"), (call, "cu_k")]
    for g in gathers:
        out.append((g, "runs"))
    return out


@dataclass
class Staged:
    """A program whose arrays sit in one flat int32 host tensor (pinned when asked), ready for
    one host-to-device copy."""

    prog: object
    host: torch.Tensor
    sizes: list


def _copy(x, **changes):
    """A shallow copy of a dataclass instance with `changes` (what `dataclasses.replace` does,
    without its per-field work: this runs for every call and gather of every slot while the GIL
    is held)."""
    y = object.__new__(type(x))
    y.__dict__.update(x.__dict__)
    y.__dict__.update(changes)
    return y


def _clone(prog):
    """A copy of a program's structure sharing its arrays, so that uploading it leaves the host
    program as it was."""
    if isinstance(prog, WlbProgram):
        return _copy(prog, call=_copy(prog.call), kv=_copy(prog.kv), pad=_copy(prog.pad),
                     _keep=[])

    def pack(p):
        return PackCall(_copy(p.call), _copy(p.q), _copy(p.k))

    return _copy(
        prog, direct=_copy(prog.direct), lpacks=[pack(p) for p in prog.lpacks],
        send_q=_copy(prog.send_q), send_kv=_copy(prog.send_kv),
        subchunks=[_copy(sc, call=_copy(sc.call) if sc.call is not None else None,
                         packs=[pack(p) for p in sc.packs]) for sc in prog.subchunks],
        _keep=[], _staged=None)


def stage(prog, pin: bool = False, owned: bool = False) -> Staged:
    """Flatten a host program's arrays into one int32 host tensor (pinned: for a non-blocking
    copy). Runs off the critical path (the sampler's thread); a program of the C++ compiler
    comes flattened already (`SlotProgram._staged`). The upload fills in a copy of the program's
    structure, so the host program stays as it was - or, `owned` (a program compiled for this
    stage alone, as the sampler's are), the program itself: no copy while the GIL is held. A
    NativeProgram (`compile_slots(staged_only=True)`) is staged as it is and unpacked by
    `upload`; one whose entries do not fit in int32 is unpacked here, to be refused below."""
    staged = getattr(prog, "_staged", None)
    if isinstance(prog, NativeProgram):
        if staged is None:
            prog = prog.unpack()
    elif not owned:
        prog = _clone(prog)
    elif staged is not None:
        prog._staged = None  # (the host buffer below holds it)
    if staged is not None:
        flat, sizes = staged
        host = torch.from_numpy(flat)
        sizes = sizes.tolist()
    else:
        arrays = [np.asarray(getattr(h, a)).reshape(-1) for h, a in _walk(prog)]
        flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=_I64)
        if len(flat) and (int(flat.max()) >= 2**31 or int(flat.min()) < -(2**31)):
            top = int(np.abs(flat).max())
            raise ValueError(f"an index of this rank's program ({top}) does not fit in int32")
        host = torch.from_numpy(flat.astype(INDEX_DTYPE, copy=False))
        sizes = [len(x) for x in arrays]
    if pin:
        host = host.pin_memory()
    return Staged(prog, host, sizes)


def expand_runs(runs: torch.Tensor, size: int) -> torch.Tensor:
    """The vectors of runs [n, 4] (base, rows, width, stride), on the runs' device: a fixed
    number of vectorized ops over the output, whatever the number of runs."""
    if size == 0:
        return runs.new_zeros(0)
    runs = runs.long()
    base, rows, width, stride = runs.unbind(1)
    n = rows * width
    run = torch.repeat_interleave(torch.arange(len(runs), device=runs.device), n,
                                  output_size=size)
    e = torch.arange(size, device=runs.device) - (torch.cumsum(n, 0) - n)[run]
    w = width[run]
    return (base[run] + torch.div(e, w, rounding_mode="floor") * stride[run] + e % w).to(
        torch.int32)


def upload(prog, device: torch.device | str, pin: bool | None = None, device_buffer=None):
    """The program on `device`: its arrays copied in one host-to-device transfer (non-blocking,
    from pinned memory on CUDA) - or taken from `device_buffer`, that copy made already -, every
    call's segments laid out and every gather's indices expanded there. `prog` is a host program
    or a Staged one; a new program is returned."""
    device = torch.device(device)
    if not isinstance(prog, Staged):
        prog = stage(prog, pin=device.type == "cuda" if pin is None else pin)
    dev, host = prog.prog, prog.host
    if isinstance(dev, NativeProgram):  # unpacked here, on the thread that runs it
        dev = dev.unpack(arrays=False)
    if device_buffer is not None:
        buf = device_buffer
    else:
        buf = host.to(device, non_blocking=True) if device.type != "cpu" else host
    host_np = host.numpy()
    o = 0
    kv_runs = None
    for (h, a), n in zip(_walk(dev), prog.sizes):
        v, hv = buf[o : o + n], host_np[o : o + n]
        o += n
        if a == "cu_q":
            cu_q = (v, hv)
        elif a == "cu_k":  # right after the same call's cu_q
            h.cu_q, h.cu_k = cu_q[0], v
            # on CPU the reference kernel runs: its work items are made here, ahead of the call
            h.seg = Segments.from_host(h.cu_q, h.cu_k, cu_q[1], hv, max_q=h.max_q, max_k=h.max_k,
                                       reference_work=device.type == "cpu")
        else:
            h.runs = v.view(-1, 4)
            h.idx = expand_runs(h.runs, h.size)
            if isinstance(dev, SlotProgram) and h is dev.send_kv:
                kv_runs = hv
    dev._keep = [host, buf]
    if isinstance(dev, SlotProgram):
        dev.messages = _messages(dev, kv_runs)
    return dev
