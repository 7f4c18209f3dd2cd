"""Tile execution for one (replica, slot): the pool exchange of Libra and DistCA, and local
execution for Ulysses, as one autograd Function with an explicit, mirrored backward.

Forward, per head chunk: owners send each moved tile's Q rows and (once per destination) the KV
prefix it needs; executors run the tiles and return O and the softmax LSE; owners place O rows.
Backward mirrors it: dO to executors, dQ back to owners, dK/dV summed back to owners. With the
pipeline on, chunk i+1's transfer is in flight while chunk i computes (async work handles).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from libra_ext.attention.comm import ByteCounter, all_to_all
from libra_ext.planner import StepPlan


@dataclass
class _Piece:
    """Where a tile's inputs live on its executor."""

    tile: int
    owner: int  # member index
    q_rows: np.ndarray  # local: flat q rows; received: unused
    kv_src: list  # per kv head: ("local", rows) or ("recv", chunk, src, offset, kv_len_entry)
    q_recv: tuple | None  # (chunk, src, offset) into the receive buffer for received tiles


@dataclass
class ChunkSpec:
    send_q: list  # [peer] flat q rows of tiles I own that peer executes
    send_kv: list  # [peer] flat kv rows of KV entries I send to peer
    recv_q_elems: list  # [peer] elements of Q I receive from peer
    recv_kv_elems: list  # [peer] elements of K (= of V) I receive from peer
    exec_tiles: list = field(default_factory=list)  # _Piece, in execution order
    back_rows: list = field(default_factory=list)  # [peer] flat q rows of my tiles peer returns
    return_tiles: list = field(default_factory=list)  # [peer] tile ids I return to peer, in order


@dataclass
class ExchangeSpec:
    """Everything one rank needs to run its slot of a StepPlan (identical layout on every rank
    of the exchange group, derived from the plan alone)."""

    me: int
    members: list
    seq: int
    tokens: int
    heads: int
    kv_heads: int
    chunks: list
    tile_shape: dict  # tile -> (q_len, hc, kv_len, h0, doc_lengths or None)
    active: list  # per chunk: does any member of the group move a tile (same on every member)
    entry_lengths: dict  # (chunk, src, offset) -> rows of a received KV entry
    any_kv: bool  # does the group ship any KV entry


def build_spec(plan: StepPlan, replica: int, slot: int, chunks: int) -> ExchangeSpec:
    """The exchange of (replica, slot) in `plan`, cut into `chunks` head chunks."""
    px = plan.exchange_pool
    g = plan.group_of(replica, slot)
    base = (replica // px) * px
    members = list(range(base, base + px))
    me = replica - base
    seqs = np.flatnonzero((plan.seq_replica == replica) & (plan.seq_slot == slot))
    if len(seqs) != 1:
        raise ValueError(f"plan has {len(seqs)} sequences at replica {replica}, slot {slot}")
    seq = int(seqs[0])
    hl, kvl = plan.heads_local, plan.kv_heads_local
    gl = hl // kvl
    off = plan.seq_doc_offsets
    lens = plan.doc_lengths
    doc_start = {}
    for s in range(plan.n_seq):
        acc = 0
        for dd in range(off[s], off[s + 1]):
            doc_start[dd] = (s, acc)
            acc += int(lens[dd])
    start_doc = {v: k for k, v in doc_start.items()}
    tokens = int(lens[off[seq] : off[seq + 1]].sum())
    hpc = -(-hl // chunks)
    order = plan.send_order[plan.send_group_offsets[g] : plan.send_group_offsets[g + 1]]

    def chunk_of(t):
        return min(int(plan.tile_head_start[t]) // hpc, chunks - 1)

    def kv_heads_of(t):
        h0, hc = int(plan.tile_head_start[t]), int(plan.tile_head_count[t])
        return list(range(h0 // gl, (h0 + hc - 1) // gl + 1))

    # KV entries of this group: (src, dst, doc, kh) -> (kv_start, kv_len); in plan order per cell.
    in_group = np.flatnonzero(plan.kv_group == g)
    entries = []
    for e in in_group:
        doc = start_doc[(int(plan.kv_seq[e]), int(plan.kv_start[e]))]
        entries.append(
            (
                int(plan.kv_src[e]),
                int(plan.kv_dst[e]),
                doc,
                int(plan.kv_head[e]),
                int(plan.kv_start[e]),
                int(plan.kv_len[e]),
            )
        )
    tiles_by = {}
    for t in order:
        a, b = int(plan.tile_owner[t]) - base, int(plan.tile_executor[t]) - base
        tiles_by.setdefault((a, b), []).append(int(t))
    entry_chunk = {}
    for (a, b), ts in tiles_by.items():
        if a == b:
            continue
        for t in ts:
            for kh in kv_heads_of(t):
                key = (a, b, int(plan.tile_doc[t]), kh)
                entry_chunk[key] = min(entry_chunk.get(key, chunks), chunk_of(t))

    def q_rows(t):
        q0, ql = int(plan.tile_q_start[t]), int(plan.tile_q_len[t])
        h0, hc = int(plan.tile_head_start[t]), int(plan.tile_head_count[t])
        pos = np.arange(q0, q0 + ql)[:, None]
        return (pos * hl + np.arange(h0, h0 + hc)[None, :]).reshape(-1)

    def kv_rows(start, length, kh):
        return np.arange(start, start + length) * kvl + kh

    specs = []
    for ch in range(chunks):
        spec = ChunkSpec(send_q=[], send_kv=[], recv_q_elems=[], recv_kv_elems=[])
        for j in range(px):
            mine = [t for t in tiles_by.get((me, j), []) if chunk_of(t) == ch] if j != me else []
            spec.send_q.append(
                np.concatenate([q_rows(t) for t in mine]) if mine else np.zeros(0, dtype=np.int64)
            )
            ents = [
                e
                for e in entries
                if e[0] == me and e[1] == j and entry_chunk[(me, j, e[2], e[3])] == ch
            ]
            spec.send_kv.append(
                np.concatenate([kv_rows(e[4], e[5], e[3]) for e in ents])
                if ents
                else np.zeros(0, dtype=np.int64)
            )
            theirs = [t for t in tiles_by.get((j, me), []) if chunk_of(t) == ch] if j != me else []
            spec.recv_q_elems.append(
                sum(int(plan.tile_q_len[t] * plan.tile_head_count[t]) for t in theirs)
            )
            ents_in = [
                e
                for e in entries
                if e[0] == j and e[1] == me and entry_chunk[(j, me, e[2], e[3])] == ch
            ]
            spec.recv_kv_elems.append(sum(e[5] for e in ents_in))
            spec.back_rows.append(spec.send_q[-1])
            spec.return_tiles.append(theirs)
        specs.append(spec)
    active = [
        any(a != b and chunk_of(t) == ch for (a, b), ts in tiles_by.items() for t in ts)
        for ch in range(chunks)
    ]
    entry_lengths = {}
    # Where each executed tile's inputs are: local rows, or offsets in a chunk's receive buffer.
    recv_entry = {}  # (src, doc, kh) -> (chunk, offset in K block of src, kv_len)
    for ch, spec in enumerate(specs):
        for j in range(px):
            if j == me:
                continue
            offset = 0
            for e in entries:
                if e[0] == j and e[1] == me and entry_chunk[(j, me, e[2], e[3])] == ch:
                    recv_entry[(j, e[2], e[3])] = (ch, offset, e[5])
                    entry_lengths[(ch, j, offset)] = e[5]
                    offset += e[5]
    shape = {}
    for ch, spec in enumerate(specs):
        for j in range(px):
            ts = [t for t in tiles_by.get((j, me), []) if chunk_of(t) == ch]
            q_off = 0
            for t in ts:
                doc, cnt = int(plan.tile_doc[t]), int(plan.tile_doc_count[t])
                shape[t] = (
                    int(plan.tile_q_len[t]),
                    int(plan.tile_head_count[t]),
                    int(plan.tile_kv_len[t]),
                    int(plan.tile_head_start[t]),
                    [int(x) for x in lens[doc : doc + cnt]] if cnt > 1 else None,
                )
                if j == me:
                    continue  # my own tiles: merged into runs below
                else:
                    kv = [("recv",) + recv_entry[(j, doc, kh)][:2] + (j,) for kh in kv_heads_of(t)]
                    spec.exec_tiles.append(
                        _Piece(t, j, np.zeros(0, dtype=np.int64), kv, (ch, j, q_off))
                    )
                    q_off += shape[t][0] * shape[t][1]
        own = [t for t in tiles_by.get((me, me), []) if chunk_of(t) == ch]
        for run in _local_runs(plan, own):
            t0, tl = run[0], run[-1]
            key = int(t0) if len(run) == 1 else ("run", int(t0))
            kv_start, kv_len = int(plan.tile_kv_start[tl]), int(plan.tile_kv_len[tl])
            shape[key] = (sum(shape[t][0] for t in run), *shape[tl][1:])
            kv = [("local", kv_rows(kv_start, kv_len, kh)) for kh in kv_heads_of(tl)]
            spec.exec_tiles.append(
                _Piece(key, me, np.concatenate([q_rows(t) for t in run]), kv, None)
            )
    return ExchangeSpec(
        me=me,
        members=members,
        seq=seq,
        tokens=tokens,
        heads=hl,
        kv_heads=kvl,
        chunks=specs,
        tile_shape=shape,
        active=active,
        entry_lengths=entry_lengths,
        any_kv=bool(entries),
    )


def _local_runs(plan: StepPlan, tiles: list) -> list[list]:
    """An owner's own tiles, grouped into runs it executes with one kernel call each: tiles of
    one document and head range whose query rows follow each other, each seeing the document's
    prefix up to its last row, form one tile (its rows against the longest prefix, causal from
    the bottom right). For Ulysses and for groups that move nothing this is one call per
    document instead of one per tile; results are the same up to float summation order."""

    def key(t):
        return (
            int(plan.tile_doc[t]),
            int(plan.tile_head_start[t]),
            int(plan.tile_head_count[t]),
            int(plan.tile_q_start[t]),
        )

    def mergeable(t):  # one document, seeing its prefix up to the tile's last row
        end_q = int(plan.tile_q_start[t]) + int(plan.tile_q_len[t])
        end_kv = int(plan.tile_kv_start[t]) + int(plan.tile_kv_len[t])
        return int(plan.tile_doc_count[t]) == 1 and end_q == end_kv

    runs: list[list] = []
    for t in sorted(tiles, key=key):
        prev = runs[-1][-1] if runs else None
        if (
            prev is not None
            and mergeable(t)
            and mergeable(prev)
            and key(prev)[:3] == key(t)[:3]
            and int(plan.tile_kv_start[prev]) == int(plan.tile_kv_start[t])
            and key(prev)[3] + int(plan.tile_q_len[prev]) == key(t)[3]
        ):
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs


def _exchange(
    send, recv_splits, send_splits, active: bool, group, counter, kind: str, async_op: bool
):
    """Receive buffer and work handle of one all-to-all-v of the pool group; no collective when
    no member of the group moves anything in this chunk (`active` is the same on all members)."""
    recv = send.new_empty(sum(recv_splits))
    if group is None or not active:
        return recv, None
    return recv, all_to_all(
        recv, send, recv_splits, send_splits, group, counter, kind, async_op=async_op
    )


def _output_splits(spec: ExchangeSpec, c: ChunkSpec, d: int) -> tuple[list, list]:
    """Elements per peer of a chunk's O return: (what I send as executor, what I receive as
    owner). dO in the backward flows the other way with the same sizes."""
    px = len(spec.members)
    executor = [
        sum(spec.tile_shape[t][0] * spec.tile_shape[t][1] for t in c.return_tiles[j]) * d
        for j in range(px)
    ]
    owner = [len(c.back_rows[j]) * d for j in range(px)]
    return executor, owner


def _input_splits(c: ChunkSpec, d: int) -> tuple[list, list]:
    """Elements per peer of a chunk's Q + KV transfer: (what I send as owner, what I receive)."""
    send = [(len(c.send_q[j]) + 2 * len(c.send_kv[j])) * d for j in range(len(c.send_q))]
    recv = [(c.recv_q_elems[j] + 2 * c.recv_kv_elems[j]) * d for j in range(len(c.send_q))]
    return send, recv


class TileExchange(torch.autograd.Function):
    """(q_full [S, hl, d], k_full, v_full [S, kvl, d]) -> out_full [S, hl, d] for one slot."""

    @staticmethod
    def forward(
        ctx,
        q_full,
        k_full,
        v_full,
        spec: ExchangeSpec,
        group,
        kernel,
        scale,
        counter: ByteCounter | None,
        pipelined: bool,
    ):
        d = q_full.shape[-1]
        S, hl = q_full.shape[0], spec.heads
        qf, kf, vf = q_full.reshape(-1, d), k_full.reshape(-1, d), v_full.reshape(-1, d)
        px, me = len(spec.members), spec.me
        out = torch.zeros_like(qf)
        recv_bufs = [None] * len(spec.chunks)
        pending = []

        def post(ch):
            c = spec.chunks[ch]
            send_splits, recv_splits = _input_splits(c, d)
            parts = []
            for j in range(px):
                parts += [qf[c.send_q[j]], kf[c.send_kv[j]], vf[c.send_kv[j]]]
            send = torch.cat([p.reshape(-1) for p in parts]) if parts else qf.new_zeros(0)
            recv, work = _exchange(
                send,
                recv_splits,
                send_splits,
                spec.active[ch],
                group,
                counter,
                "pool.qkv",
                pipelined,
            )
            return recv, work, recv_splits

        def views(ch):
            return _recv_views(recv_bufs[ch][0], spec.chunks[ch], px, d)

        recv_bufs[0] = post(0)
        for ch in range(len(spec.chunks)):
            if pipelined and ch + 1 < len(spec.chunks):
                recv_bufs[ch + 1] = post(ch + 1)  # in flight while chunk ch computes
            if recv_bufs[ch][1] is not None:
                recv_bufs[ch][1].wait()
            outs = _run_tiles(spec, ch, qf, kf, vf, views, d, kernel, scale)
            # Return O (and LSE) of tiles I ran for other owners; place my own.
            c = spec.chunks[ch]
            o_parts, l_parts = [], []
            for j in range(px):
                for t in c.return_tiles[j]:
                    o_parts.append(outs[t][0].reshape(-1))
                    l_parts.append(outs[t][1].reshape(-1))
            for p in c.exec_tiles:
                if p.owner == me:
                    out[torch.as_tensor(p.q_rows)] = outs[p.tile][0].reshape(-1, d)
            o_send_splits, o_recv_splits = _output_splits(spec, c, d)
            if group is not None and spec.active[ch]:
                o_send = torch.cat(o_parts) if o_parts else qf.new_zeros(0)
                o_recv, w1 = _exchange(
                    o_send, o_recv_splits, o_send_splits, True, group, counter, "pool.o", pipelined
                )
                l_send = (torch.cat(l_parts) if l_parts else qf.new_zeros(0)).float()
                _, w2 = _exchange(
                    l_send,
                    [x // d for x in o_recv_splits],
                    [x // d for x in o_send_splits],
                    True,
                    group,
                    counter,
                    "pool.lse",
                    pipelined,
                )
                pending.append((o_recv, c, w1, w2))
            if not pipelined and ch + 1 < len(spec.chunks):
                recv_bufs[ch + 1] = post(ch + 1)
        for o_recv, c, w1, w2 in pending:
            if w1 is not None:
                w1.wait()
                w2.wait()
            pos = 0
            for j in range(px):
                n = len(c.back_rows[j])
                if n:
                    out[torch.as_tensor(c.back_rows[j])] = o_recv[pos : pos + n * d].reshape(n, d)
                pos += n * d
        ctx.save_for_backward(q_full, k_full, v_full)
        ctx.spec, ctx.group, ctx.kernel, ctx.scale = spec, group, kernel, scale
        ctx.counter, ctx.pipelined = counter, pipelined
        ctx.recv_bufs = [(r[0], None, r[2]) for r in recv_bufs]
        return out.reshape(S, hl, d)

    @staticmethod
    def backward(ctx, grad_out):
        q_full, k_full, v_full = ctx.saved_tensors
        spec, group, counter, pipelined = ctx.spec, ctx.group, ctx.counter, ctx.pipelined
        d = q_full.shape[-1]
        qf, kf, vf = q_full.reshape(-1, d), k_full.reshape(-1, d), v_full.reshape(-1, d)
        gf = grad_out.reshape(-1, d)
        dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
        px, me = len(spec.members), spec.me
        recv_bufs = ctx.recv_bufs

        def views(ch):
            return _recv_views(recv_bufs[ch][0], spec.chunks[ch], px, d)

        def post_do(ch):
            c = spec.chunks[ch]
            recv_splits, send_splits = _output_splits(spec, c, d)  # dO: O's reverse
            send = torch.cat([gf[torch.as_tensor(c.back_rows[j])].reshape(-1) for j in range(px)])
            recv, work = _exchange(
                send,
                recv_splits,
                send_splits,
                spec.active[ch],
                group,
                counter,
                "pool.do",
                pipelined,
            )
            return recv, work

        # Gradients of received KV entries accumulate over every chunk that uses them, so they go
        # back in one message after the last chunk; dQ goes back chunk by chunk.
        kv_grads = {}
        do_bufs = [None] * len(spec.chunks)
        do_bufs[0] = post_do(0)
        pending = []
        for ch in range(len(spec.chunks)):
            if do_bufs[ch] is None:
                do_bufs[ch] = post_do(ch)
            if pipelined and ch + 1 < len(spec.chunks):
                do_bufs[ch + 1] = post_do(ch + 1)  # in flight while chunk ch computes
            if do_bufs[ch][1] is not None:
                do_bufs[ch][1].wait()
            c = spec.chunks[ch]
            do_of, pos = {}, 0
            for j in range(px):
                for t in c.return_tiles[j]:
                    n = spec.tile_shape[t][0] * spec.tile_shape[t][1] * d
                    do_of[t] = do_bufs[ch][0][pos : pos + n]
                    pos += n
            dq_parts = {j: [] for j in range(px)}
            for p in c.exec_tiles:
                ql, hc, kvlen, h0, docs = spec.tile_shape[p.tile]
                q_t, k_t, v_t = _tile_inputs(p, spec, ql, hc, kvlen, qf, kf, vf, views, d)
                q_t, k_t, v_t = (x.detach().requires_grad_(True) for x in (q_t, k_t, v_t))
                mine = p.owner == me
                g_t = (gf[torch.as_tensor(p.q_rows)] if mine else do_of[p.tile]).reshape(ql, hc, d)
                with torch.enable_grad():
                    o_t, _ = _kernel_call(ctx.kernel, q_t, k_t, v_t, h0, spec, ctx.scale, docs)
                    gq, gk, gv = torch.autograd.grad(o_t, (q_t, k_t, v_t), g_t)
                if mine:
                    dq.index_add_(0, torch.as_tensor(p.q_rows), gq.reshape(-1, d))
                    for i, src in enumerate(p.kv_src):
                        rows = torch.as_tensor(src[1])
                        dk.index_add_(0, rows, gk[:, i])
                        dv.index_add_(0, rows, gv[:, i])
                    continue
                dq_parts[p.owner].append(gq.reshape(-1))  # exec order == return order
                for i, (_, ech, eoff, j) in enumerate(p.kv_src):
                    key = (j, ech, eoff)
                    if key not in kv_grads:
                        n_entry = spec.entry_lengths[(ech, j, eoff)]
                        kv_grads[key] = [gf.new_zeros(n_entry, d), gf.new_zeros(n_entry, d)]
                    kv_grads[key][0][:kvlen] += gk[:, i]
                    kv_grads[key][1][:kvlen] += gv[:, i]
            if group is not None and spec.active[ch]:
                send_splits = [sum(x.numel() for x in dq_parts[j]) for j in range(px)]
                recv_splits = [len(c.send_q[j]) * d for j in range(px)]
                parts = [x for j in range(px) for x in dq_parts[j]]
                send = torch.cat(parts) if parts else gf.new_zeros(0)
                recv, w = _exchange(
                    send, recv_splits, send_splits, True, group, counter, "pool.dq", pipelined
                )
                pending.append((recv, c, w))
        for recv, c, w in pending:
            if w is not None:
                w.wait()
            pos = 0
            for j in range(px):
                nq = len(c.send_q[j]) * d
                if nq:
                    dq.index_add_(
                        0, torch.as_tensor(c.send_q[j]), recv[pos : pos + nq].reshape(-1, d)
                    )
                pos += nq
        if group is not None and spec.any_kv:
            # per peer: dK then dV of every entry it sent me, in (chunk, offset) order
            send_parts, send_splits, recv_splits = [], [], []
            for j in range(px):
                keys = sorted(k for k in kv_grads if k[0] == j)
                ks = [kv_grads[k][0].reshape(-1) for k in keys]
                vs = [kv_grads[k][1].reshape(-1) for k in keys]
                send_parts += ks + vs
                send_splits.append(sum(x.numel() for x in ks + vs))
                recv_splits.append(2 * sum(len(c.send_kv[j]) for c in spec.chunks) * d)
            send = torch.cat(send_parts) if send_parts else gf.new_zeros(0)
            recv = gf.new_empty(sum(recv_splits))
            all_to_all(recv, send, recv_splits, send_splits, group, counter, "pool.dkv")
            pos = 0
            for j in range(px):
                rows = np.concatenate([c.send_kv[j] for c in spec.chunks])
                n = len(rows) * d
                if n:
                    rows_t = torch.as_tensor(rows)
                    dk.index_add_(0, rows_t, recv[pos : pos + n].reshape(-1, d))
                    dv.index_add_(0, rows_t, recv[pos + n : pos + 2 * n].reshape(-1, d))
                pos += 2 * n
        return (
            dq.reshape(q_full.shape),
            dk.reshape(k_full.shape),
            dv.reshape(v_full.shape),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def _recv_views(recv: torch.Tensor, c: ChunkSpec, px: int, d: int) -> dict:
    """Per source member: its Q block, K block and V block in a chunk's receive buffer."""
    out, pos = {}, 0
    for j in range(px):
        nq, nk = c.recv_q_elems[j] * d, c.recv_kv_elems[j] * d
        out[j] = (
            recv[pos : pos + nq],
            recv[pos + nq : pos + nq + nk],
            recv[pos + nq + nk : pos + nq + 2 * nk],
        )
        pos += nq + 2 * nk
    return out


def _tile_inputs(p: _Piece, spec, ql, hc, kvlen, qf, kf, vf, views, d):
    if p.q_recv is None:
        q_t = qf[torch.as_tensor(p.q_rows)].reshape(ql, hc, d)
    else:
        ch, j, off = p.q_recv
        q_t = views(ch)[j][0][off * d : (off + ql * hc) * d].reshape(ql, hc, d)
    ks, vs = [], []
    for src in p.kv_src:
        if src[0] == "local":
            rows = torch.as_tensor(src[1])
            ks.append(kf[rows])
            vs.append(vf[rows])
        else:
            _, ech, eoff, j = src
            v_ = views(ech)[j]
            ks.append(v_[1][eoff * d : (eoff + kvlen) * d].reshape(kvlen, d))
            vs.append(v_[2][eoff * d : (eoff + kvlen) * d].reshape(kvlen, d))
    return q_t, torch.stack(ks, dim=1), torch.stack(vs, dim=1)


def _kernel_call(kernel, q_t, k_t, v_t, h0, spec, scale, docs):
    """Run a tile: expand its KV heads to one per query head (GQA) and call the kernel."""
    hc = q_t.shape[1]
    gl = spec.heads // spec.kv_heads
    kh0 = h0 // gl
    idx = torch.as_tensor([(h0 + i) // gl - kh0 for i in range(hc)])
    return kernel(q_t, k_t[:, idx], v_t[:, idx], scale, docs)


def _run_tiles(spec, ch, qf, kf, vf, views, d, kernel, scale):
    outs = {}
    for p in spec.chunks[ch].exec_tiles:
        ql, hc, kvlen, h0, docs = spec.tile_shape[p.tile]
        q_t, k_t, v_t = _tile_inputs(p, spec, ql, hc, kvlen, qf, kf, vf, views, d)
        outs[p.tile] = _kernel_call(kernel, q_t, k_t, v_t, h0, spec, scale, docs)
    return outs
