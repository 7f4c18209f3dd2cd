"""The PyTorch reference attention: exact math on the host's segment offsets, the CPU path of the
backend ladder (`kernels.ReferenceBackend`), and `reference_attention`, the dense independent
check the tests and `libra verify attention` compare every system against.

The reference runs a batched varlen call (`kernels.Segments`) in work items made ahead of the
call (`work_items`): long segments by row pieces, short ones batched by key length, each piece
small enough that its scores stay in cache-sized temporaries, so its cost follows the causal
pairs whatever the lengths. Its backward is analytic, from the saved output and log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from libra_ext.attention.counters import inside_kernel

_PIECE_ELEMS = 1 << 17
"""Score elements per head computed at once by the reference (rows x keys). Small enough that
a piece's scores over a rank's heads stay in cache-sized temporaries (a few MiB), so the cost of
a piece follows its elements whatever the segment lengths; large pieces (4M elements) run
2-3x slower per element and made the measured time of a rank depend on how its work was cut."""
_BATCH_SPREAD = 1.125
"""Largest ratio of key lengths batched together (bounds the padded-out work)."""
_ROW_BLOCKS = 4
"""Row blocks of a batch: each attends only as far as its causal end (bounds the masked-out
work to about 1 / _ROW_BLOCKS of the triangle)."""


@dataclass(frozen=True)
class _Rows:
    """Rows r0..r1-1 of one long segment s against its causal prefix."""

    s: int
    r0: int
    r1: int


@dataclass(frozen=True)
class _Batch:
    """Short segments of about one length, padded to (lq, lk) and run as one batched call:
    gather indices [n, lq] / [n, lk] into q and k (clipped), their validity, each segment's
    causal shift (kl - ql), and the row blocks [(i0, i1, k_end)]."""

    idx_q: torch.Tensor
    ok_q: torch.Tensor
    idx_k: torch.Tensor
    ok_k: torch.Tensor
    shift: torch.Tensor
    blocks: tuple


def work_items(seg, device) -> list:
    """The reference's work items: long segments (more than _PIECE_ELEMS scores) by row pieces,
    every other segment in a batch of segments of nearly the same key length, so that the work
    done follows the causal pairs (few padded or masked-out scores) whatever the lengths."""
    hq, hk = seg.host_q, seg.host_k
    ql, kl = np.diff(hq), np.diff(hk)
    items: list = []
    long = np.flatnonzero(ql * kl > _PIECE_ELEMS)
    for s in long.tolist():
        step = max(1, _PIECE_ELEMS // max(1, int(kl[s])))
        for r0 in range(0, int(ql[s]), step):
            items.append(_Rows(s, r0, min(int(ql[s]), r0 + step)))
    short = np.flatnonzero((ql * kl <= _PIECE_ELEMS) & (ql > 0) & (kl > 0))
    short = short[np.lexsort((ql[short], kl[short]))]  # by key length, then query length
    i = 0
    while i < len(short):
        # extend while the key lengths stay within _BATCH_SPREAD and the scores fit
        j, lq, lk = i, 0, 0
        while j < len(short):
            s = short[j]
            nlq, nlk = max(lq, int(ql[s])), max(lk, int(kl[s]))
            too_long = nlk > _BATCH_SPREAD * kl[short[i]]
            if j > i and (too_long or (j - i + 1) * nlq * nlk > _PIECE_ELEMS):
                break
            lq, lk, j = nlq, nlk, j + 1
        members = short[i:j]
        i = j
        rq, rk = np.arange(lq), np.arange(lk)
        ok_q = rq[None, :] < ql[members][:, None]
        ok_k = rk[None, :] < kl[members][:, None]
        idx_q = np.where(ok_q, hq[members][:, None] + rq[None, :], 0)
        idx_k = np.where(ok_k, hk[members][:, None] + rk[None, :], 0)
        shift = kl[members] - ql[members]
        edges = np.unique(np.linspace(0, lq, min(_ROW_BLOCKS, lq) + 1).astype(np.int64))
        blocks = tuple(
            (int(r0), int(r1), int(min(lk, r1 - 1 + int(shift.max()) + 1)))
            for r0, r1 in zip(edges[:-1], edges[1:])
        )
        items.append(_Batch(
            *(torch.as_tensor(x, device=device) for x in (idx_q, ok_q, idx_k, ok_k, shift)),
            blocks,
        ))
    return items


def _rows_ranges(item: _Rows, seg, device):
    """(q rows, k rows, mask [nq, nk] bool) of a long segment's row piece."""
    hq, hk = seg.host_q, seg.host_k
    s, r0, r1 = item.s, item.r0, item.r1
    ql, kl = int(hq[s + 1] - hq[s]), int(hk[s + 1] - hk[s])
    q0, q1 = int(hq[s]) + r0, int(hq[s]) + r1
    k_end = min(kl, r1 - 1 + kl - ql + 1)
    k0, k1 = int(hk[s]), int(hk[s]) + max(0, k_end)
    i = torch.arange(r0, r1, device=device)[:, None]
    j = torch.arange(0, k1 - k0, device=device)[None, :]
    return (q0, q1), (k0, k1), j <= i + (kl - ql)


def _batch_mask(b: _Batch, r0: int, r1: int, k_end: int) -> torch.Tensor:
    """[n, rows, k_end] bool: valid rows and keys, causal inside each segment."""
    i = torch.arange(r0, r1, device=b.shift.device)[None, :, None]
    j = torch.arange(k_end, device=b.shift.device)[None, None, :]
    causal = j <= i + b.shift[:, None, None]
    return causal & b.ok_q[:, r0:r1, None] & b.ok_k[:, None, :k_end]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _scores(q, k, mask, scale, g):
    kf = k.repeat_interleave(g, dim=1) if g > 1 else k
    s = torch.einsum("qhd,khd->hqk", q, kf) * scale
    return s.masked_fill(~mask, float("-inf"))


def _expand(x: torch.Tensor, g: int, dim: int) -> torch.Tensor:
    return x.repeat_interleave(g, dim=dim) if g > 1 else x


def _safe(m: torch.Tensor) -> torch.Tensor:
    """A log-sum-exp with fully masked rows (-inf) set to 0, to subtract from scores."""
    return m.masked_fill(torch.isinf(m), 0.0)


class ReferenceVarlen(torch.autograd.Function):
    """Exact varlen attention over `seg` (a `kernels.Segments`); backward from the saved output
    and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, seg, scale: float):
        with inside_kernel():
            return ReferenceVarlen._forward(ctx, q, k, v, seg, scale)

    @staticmethod
    def backward(ctx, dout):
        with inside_kernel():
            return ReferenceVarlen._backward(ctx, dout)

    @staticmethod
    def _forward(ctx, q, k, v, seg, scale: float):
        acc = _acc_dtype(q.dtype)
        n_q, hc, d = q.shape
        g = hc // max(1, k.shape[1])
        out = torch.zeros(n_q, hc, d, dtype=acc, device=q.device)
        lse = torch.full((hc, n_q), float("-inf"), dtype=acc, device=q.device)
        work = seg.work if seg.work is not None else work_items(seg, q.device)
        for item in work:
            if isinstance(item, _Rows):
                (q0, q1), (k0, k1), mask = _rows_ranges(item, seg, q.device)
                if q1 <= q0 or k1 <= k0:
                    continue
                s = _scores(q[q0:q1].to(acc), k[k0:k1].to(acc), mask, scale, g)
                m = torch.logsumexp(s, dim=-1)  # [hc, rows]
                p = torch.exp(s - _safe(m)[..., None])
                out[q0:q1] = torch.einsum("hqk,khd->qhd", p, _expand(v[k0:k1].to(acc), g, 1))
                lse[:, q0:q1] = m
                continue
            kb = _expand(k[item.idx_k].to(acc), g, 2)  # [n, lk, hc, d]
            vb = _expand(v[item.idx_k].to(acc), g, 2)
            for r0, r1, k_end in item.blocks:
                qb = q[item.idx_q[:, r0:r1]].to(acc)  # [n, rows, hc, d]
                s = torch.einsum("nqhd,nkhd->nhqk", qb, kb[:, :k_end]) * scale
                s = s.masked_fill(~_batch_mask(item, r0, r1, k_end)[:, None], float("-inf"))
                m = torch.logsumexp(s, dim=-1)  # [n, hc, rows]
                p = torch.exp(s - _safe(m)[..., None])
                o = torch.einsum("nhqk,nkhd->nqhd", p, vb[:, :k_end])
                ok = item.ok_q[:, r0:r1]
                rows = item.idx_q[:, r0:r1][ok]
                out[rows] = o[ok]
                lse[:, rows] = m.permute(1, 0, 2)[:, ok]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.seg, ctx.scale, ctx.work = seg, scale, work
        return out

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        seg, scale = ctx.seg, ctx.scale
        acc = _acc_dtype(q.dtype)
        hc, hk = q.shape[1], k.shape[1]
        g = hc // max(1, hk)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)

        def fold(x: torch.Tensor, dim: int) -> torch.Tensor:  # expanded heads -> KV heads
            if g == 1:
                return x
            shape = list(x.shape)
            shape[dim:dim + 1] = [hk, g]
            return x.reshape(shape).sum(dim + 1)

        for item in ctx.work:
            if isinstance(item, _Rows):
                (q0, q1), (k0, k1), mask = _rows_ranges(item, seg, q.device)
                if q1 <= q0 or k1 <= k0:
                    continue
                qf, kf, vf = q[q0:q1].to(acc), k[k0:k1].to(acc), v[k0:k1].to(acc)
                do, o = dout[q0:q1].to(acc), out[q0:q1].to(acc)
                s = _scores(qf, kf, mask, scale, g)
                p = torch.exp(s - _safe(lse[:, q0:q1])[..., None])  # [hc, r, c]
                dve = torch.einsum("hqk,qhd->khd", p, do)
                dp = torch.einsum("qhd,khd->hqk", do, _expand(vf, g, 1))
                delta = (do * o).sum(-1).transpose(0, 1)[..., None]  # [hc, r, 1]
                ds = p * (dp - delta) * scale
                dq[q0:q1] += torch.einsum("hqk,khd->qhd", ds, _expand(kf, g, 1))
                dk[k0:k1] += fold(torch.einsum("hqk,qhd->khd", ds, qf), 1)
                dv[k0:k1] += fold(dve, 1)
                continue
            kb = _expand(k[item.idx_k].to(acc), g, 2)  # [n, lk, hc, d]
            vb = _expand(v[item.idx_k].to(acc), g, 2)
            dkb = torch.zeros_like(kb)
            dvb = torch.zeros_like(vb)
            for r0, r1, k_end in item.blocks:
                idx = item.idx_q[:, r0:r1]
                qb, do, o = q[idx].to(acc), dout[idx].to(acc), out[idx].to(acc)
                mask = _batch_mask(item, r0, r1, k_end)[:, None]  # [n, 1, rows, k]
                s = torch.einsum("nqhd,nkhd->nhqk", qb, kb[:, :k_end]) * scale
                s = s.masked_fill(~mask, float("-inf"))
                m = lse[:, idx].permute(1, 0, 2)  # [n, hc, rows]
                p = torch.exp(s - _safe(m)[..., None])
                dvb[:, :k_end] += torch.einsum("nhqk,nqhd->nkhd", p, do)
                dp = torch.einsum("nqhd,nkhd->nhqk", do, vb[:, :k_end])
                delta = (do * o).sum(-1).permute(0, 2, 1)[..., None]  # [n, hc, rows, 1]
                ds = p * (dp - delta) * scale
                ok = item.ok_q[:, r0:r1]
                dq.index_add_(0, idx[ok], torch.einsum("nhqk,nkhd->nqhd", ds, kb[:, :k_end])[ok])
                dkb[:, :k_end] += torch.einsum("nhqk,nqhd->nkhd", ds, qb)
            okk = item.ok_k
            dk.index_add_(0, item.idx_k[okk], fold(dkb, 2)[okk])
            dv.index_add_(0, item.idx_k[okk], fold(dvb, 2)[okk])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    doc_lengths: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The independent check: q [n_q, hq, d], k/v [n_k, hk, d] -> (out [n_q, hq, d], lse
    [hq, n_q]), dense math, differentiable by autograd.

    Without `doc_lengths`: query i sees keys j <= i + n_k - n_q (bottom-right causal). With
    `doc_lengths` (q and k the same tokens): block-diagonal, causal inside every document.
    Computed in fp32 (or better) and cast back.
    """
    n_q, hq, d = q.shape
    n_k, hk = k.shape[0], k.shape[1]
    g = hq // hk
    acc = _acc_dtype(q.dtype)
    qf, kf, vf = q.to(acc), k.to(acc), v.to(acc)
    if g > 1:
        kf = kf.repeat_interleave(g, dim=1)
        vf = vf.repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    i = torch.arange(n_q, device=q.device)[:, None]
    j = torch.arange(n_k, device=q.device)[None, :]
    if doc_lengths is None:
        mask = j <= i + (n_k - n_q)
    else:
        doc = torch.repeat_interleave(
            torch.arange(len(doc_lengths), device=q.device),
            torch.as_tensor(doc_lengths, device=q.device),
        )
        mask = (j <= i) & (doc[:n_q, None] == doc[None, :n_k])
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [hq, n_q]
    p = torch.exp(scores - lse[..., None])
    out = torch.einsum("hqk,khd->qhd", p, vf)
    return out.to(q.dtype), lse
