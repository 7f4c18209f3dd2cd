"""The operator's two autograd Functions, driven by the per-step programs of `meta`.

`PlannedAttention` (libra, distca, ulysses) for one rank and one micro-batch:

  forward   q, k, v [t, h|hkv, d] --Ulysses all-to-all--> X [C*t, W, d]
            send buffer = X[send_idx]; every chunk's [Q | K | V] all-to-all posted at once
            local block: pack = X[gather], <= 2 batched kernel calls, O scattered into the
                         output buffer [C*t*hl, d] (runs while the chunks are in flight)
            chunk k:     wait, pack = recv[gather], <= 2 kernel calls, O back (async)
            received O scattered into the output buffer --Ulysses all-to-all--> [t, h*d]
  backward  the mirror: dO to the executors (all chunks posted at once, last chunk first),
            local kernel backward, then chunks last to first: kernel backward, the chunk's
            dQ/dK/dV (summed in fp32 on the executor) back to its owners right away. A chunk
            may read KV an earlier chunk delivered, never a later one, so going backwards every
            chunk's gradients are complete when it is done. Owners sum returns in fp32.

`PerDocAttention` (wlb): K and V all-gathered in the CP group, the rank's chunks of every
document in one kernel call, dK/dV reduce-scattered back (summed in fp32).

Index arrays are int32 (meta.INDEX_DTYPE): gathers are index_select, scatters of distinct
vectors index_put_, sums index_add_ - all take int32 indices.

Every collective is issued inside these Functions in one fixed order on every rank, so
autograd never interleaves collectives differently on different ranks. Kernel calls go
through `kernels.Backend.attend` with their own autograd graph: the forward keeps each call's
(q, k, v leaves, output) and the backward runs the kernel's own backward from them.

Legend: t local slots, C cp ranks, h/hkv query/KV heads of this tp rank, hl/kvl the Ulysses
slice, W = hl + 2 kvl, d head dim; counts in the programs are vectors of d elements.

Shape legend (shared by the attention modules; `meta` gives the index-array details):
  S tokens of a packed sequence; C cp ranks; t = S / C (padded) tokens of one cp rank;
  h, h_kv query and KV heads of a rank (after tp); hl = h / C, kvl = max(1, h_kv / C) heads of
  its Ulysses slice; d head dim; W = hl + 2 kvl vectors per token of the Ulysses buffer
  X [C*t, W, d]; P pool members; n_q, n_k rows and hc, hk heads of one batched kernel call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from libra_ext.attention.comm import ByteCounter, all_gather_rows, all_to_all
from libra_ext.attention.counters import CallCounts, RuntimeStats
from libra_ext.attention.kernels import Backend
from libra_ext.attention.meta import Block, SlotProgram, WlbProgram


@dataclass
class ExecEnv:
    """What the Functions need besides tensors and the program."""

    kernel: Backend
    scale: float
    cp_group: object
    pool_group: object
    counter: ByteCounter | None
    stats: RuntimeStats
    pipelined: bool = True
    key: object = None
    """Names the calling layer (the TE backend keeps one module per layer)."""


def _put_kv(dst: torch.Tensor, src: torch.Tensor, C: int, hl: int) -> None:
    """dst [C, t, kvl, d] <- the KV heads each cp rank's query slice needs from src [t, hkv, d]."""
    t, hkv, d = src.shape
    g = (hl * C) // hkv  # query heads per KV head
    if hl >= g:  # rank j holds whole groups: KV heads [j*kvl, (j+1)*kvl)
        dst.copy_(src.reshape(t, C, hkv // C, d).transpose(0, 1))
    else:  # hl divides g: g/hl consecutive ranks share one KV head
        dst.view(hkv, g // hl, t, d).copy_(src.transpose(0, 1)[:, None].expand(hkv, g // hl, t, d))


def _take_kv(src: torch.Tensor, C: int, hl: int, hkv: int) -> torch.Tensor:
    """Gradient of _put_kv: src [C, t, kvl, d] -> [t, hkv, d] (shared heads summed in fp32)."""
    _, t, kvl, d = src.shape
    g = (hl * C) // hkv
    if hl >= g:
        return src.transpose(0, 1).reshape(t, hkv, d)
    s = src.reshape(hkv, g // hl, t, d).sum(1, dtype=torch.float32)
    return s.to(src.dtype).transpose(0, 1).contiguous()


def _run_calls(pack: torch.Tensor, block: Block, env: ExecEnv, d: int, counts: CallCounts):
    """Forward of a block's calls on views of its pack; returns (outputs, leaves)."""
    outs, leaves = [], []
    for call in block.calls:
        q, k, v = (x.detach().requires_grad_() for x in call.views(pack, d))
        with torch.enable_grad():
            outs.append(env.kernel.attend(q, k, v, call.seg, env.scale, env.key))
        leaves.append((q, k, v))
        counts.kernel_calls += 1
    return outs, leaves


def _backward_calls(outs, leaves, grads, counts: CallCounts):
    """The kernels' own backward for a block: [(dq, dk, dv)] per call."""
    flat = [x for qkv in leaves for x in qkv]
    g = torch.autograd.grad(outs, flat, grads)
    counts.kernel_calls += len(outs)
    return [g[3 * i : 3 * i + 3] for i in range(len(outs))]


_CAST_PIECES = 4
"""A gradient summed into a buffer of a wider dtype is cast in this many pieces, so the cast copy
alive at once is a quarter of it (a fixed number of kernels, whatever the call's size)."""


def _accumulate(buf: torch.Tensor, block: Block, calls_grads, d: int, copy: bool) -> None:
    """Add (or, when every pack vector is distinct, copy) a block's pack gradients into buf."""
    for call, grads in zip(block.calls, calls_grads):
        for (lo, n, _), gr in zip(call.parts(), grads):
            idx = block.gather[lo : lo + n]
            src = gr.reshape(-1, d)
            if copy:
                buf.index_put_((idx,), src.to(buf.dtype))
            elif src.dtype == buf.dtype:
                buf.index_add_(0, idx, src)
            else:
                step = -(-n // _CAST_PIECES)
                for a in range(0, n, step):
                    buf.index_add_(0, idx[a : a + step], src[a : a + step].to(buf.dtype))


class _Accumulator:
    """The gradient of X ([C*t*W, d] in the compute dtype), built from the blocks' pack
    gradients and the returned ones: Q vectors written (each is a gradient of one tile), K/V
    vectors summed - into dX itself when dKV is None (an exact dtype, or no vector repeats),
    else into dKV ([C*t*2kvl, d] fp32, rows of dX's K/V vectors), cast into dX by finish()."""

    def __init__(self, dX, dKV, W: int, hl: int, kvl: int):
        self.dX, self.dKV, self.W, self.hl, self.kvl = dX, dKV, W, hl, kvl

    def _kv_rows(self, idx):
        # X vector (token row * W + head, head >= hl) -> its row of dKV
        row = torch.div(idx, self.W, rounding_mode="floor")
        return row * (2 * self.kvl) + (idx - row * self.W - self.hl)

    def add_block(self, block: Block, calls_grads, d: int, copy: bool) -> None:
        if self.dKV is None:
            _accumulate(self.dX, block, calls_grads, d, copy)
            return
        for call, grads in zip(block.calls, calls_grads):
            for part, ((lo, n, _), gr) in enumerate(zip(call.parts(), grads)):
                idx = block.gather[lo : lo + n]
                if part == 0:  # the call's Q vectors: each appears once
                    self.dX.index_put_((idx,), gr.reshape(-1, d))
                else:
                    self._add_kv(idx, gr.reshape(-1, d))

    def _add_kv(self, idx, src) -> None:
        n = len(idx)
        step = -(-n // _CAST_PIECES)
        for a in range(0, n, step):  # cast piece by piece
            self.dKV.index_add_(0, self._kv_rows(idx[a : a + step]),
                                src[a : a + step].to(self.dKV.dtype))

    def add_returned(self, prog: SlotProgram, d_send) -> None:
        """The gradients of my vectors that other members' tiles read, returned in my send
        buffer's layout (per chunk and member: [Q | K | V])."""
        if self.dKV is None:
            self.dX.index_add_(0, prog.send_idx, d_send.to(self.dX.dtype))
            return
        o = 0
        for c in prog.chunks:
            for n, nq in zip(c.qkv_send, c.q_send):
                if nq:
                    self.dX.index_add_(0, prog.send_idx[o : o + nq], d_send[o : o + nq])
                if n > nq:
                    self._add_kv(prog.send_idx[o + nq : o + n], d_send[o + nq : o + n])
                o += n

    def finish(self) -> None:
        if self.dKV is not None:  # K/V rows into their slots of dX (one strided copy)
            view = self.dX.view(-1, self.W, self.dX.shape[-1])
            view[:, self.hl :].copy_(self.dKV.view(view.shape[0], 2 * self.kvl, -1))


def _place_outputs(dst: torch.Tensor, block: Block, outs, d: int) -> None:
    """Scatter a block's call outputs to their vectors of dst (block.out; in order when None)."""
    for call, o in zip(block.calls, outs):
        if block.out is None:
            dst[call.out_off : call.out_off + call.n_out].copy_(o.reshape(-1, d))
        else:
            dst.index_put_((block.out[call.out_off : call.out_off + call.n_out],),
                           o.reshape(-1, d))


def _output_grads(src: torch.Tensor, block: Block, d: int) -> list:
    """The mirror of placing a block's outputs: each call's [n_q, hc, d] gradient read from
    src, at block.out (or in order when the outputs were in order)."""
    out = []
    for call in block.calls:
        if block.out is None:
            g = src[call.out_off : call.out_off + call.n_out]
        else:
            g = src.index_select(0, block.out[call.out_off : call.out_off + call.n_out])
        out.append(g.view(call.n_q, call.hc, d))
    return out


def _outputs_in_order(outs, block: Block, n: int, like: torch.Tensor, d: int) -> torch.Tensor:
    """A chunk block's outputs laid out as its O message (owner-major)."""
    if block.out is None:
        flat = [o.reshape(-1, d) for o in outs]
        return flat[0] if len(flat) == 1 else torch.cat(flat)
    msg = like.new_empty(n, d)
    _place_outputs(msg, block, outs, d)
    return msg


def _cp_a2a(x: torch.Tensor, C: int, rows: int, d: int, env: ExecEnv, kind: str):
    """Equal all-to-all over the CP group of x ([C * rows] vectors: block j to cp rank j); x
    itself without context parallelism."""
    if C == 1:
        return x
    y = torch.empty_like(x)
    _a2a(y, x, [rows] * C, [rows] * C, d, env.cp_group, env, kind, False)
    return y


def _a2a(out, inp, out_vec, in_vec, d, group, env: ExecEnv, kind: str, async_op: bool):
    """all_to_all_single of flat [n, d] buffers with splits in vectors."""
    w = all_to_all(
        out.view(-1),
        inp.reshape(-1),
        [n * d for n in out_vec],
        [n * d for n in in_vec],
        group,
        env.counter,
        kind,
        async_op=async_op,
    )
    return w if async_op else None


class PlannedAttention(torch.autograd.Function):
    """(q [t, h, d], k, v [t, hkv, d]) -> out [t, h*d] for one micro-batch of a step plan."""

    @staticmethod
    def forward(ctx, q, k, v, prog: SlotProgram, env: ExecEnv):
        with env.stats.watch("fwd", prog.tiles_executed, prog.exec_blocks) as counts:
            return PlannedAttention._forward(ctx, q, k, v, prog, env, counts)

    @staticmethod
    def _forward(ctx, q, k, v, prog, env, counts):
        t, h, d = q.shape
        C, hkv = prog.cp, k.shape[1]
        hl, kvl = prog.heads_local, prog.kv_heads_local
        W = hl + 2 * kvl
        # Ulysses in: [t, h, d] -> X [C*t, W, d] (rank-major slots, my head slice)
        send = q.new_empty(C, t, W, d)
        send[:, :, :hl].copy_(q.reshape(t, C, hl, d).transpose(0, 1))
        _put_kv(send[:, :, hl : hl + kvl], k, C, hl)
        _put_kv(send[:, :, hl + kvl :], v, C, hl)
        X = _cp_a2a(send, C, t * W, d, env, "ulysses.in")
        del send  # (with cp > 1 X is a copy: free the send buffer now)
        xf = X.view(-1, d)
        pool, pipelined = env.pool_group, env.pipelined
        # pool exchange: every chunk's Q/K/V in flight before any compute
        works = []
        if prog.chunks:
            send_all = xf.index_select(0, prog.send_idx)
            recv_all = xf.new_empty(prog.n_recv, d)
            for c in prog.chunks:
                works.append(
                    _a2a(
                        recv_all[c.recv_off : c.recv_off + c.n_recv],
                        send_all[c.send_off : c.send_off + c.n_send],
                        c.qkv_recv,
                        c.qkv_send,
                        d,
                        pool,
                        env,
                        "pool.qkv",
                        pipelined,
                    )
                )
        local_pack = xf.index_select(0, prog.local.gather) if prog.local is not None else None
        # Every buffer is released once its last reader has run (device memory of a layer call:
        # the packs the kernels keep for backward, and what is in flight): X now, as the send
        # buffer and the local pack hold what is read of it.
        del X, xf
        out_flat = q.new_zeros(C * t * hl, d)
        saved = {}
        if local_pack is not None:  # my own tiles, while the exchange is in flight
            b = prog.local
            outs, leaves = _run_calls(local_pack, b, env, d, counts)
            del local_pack  # the kernel's leaves are views of it
            _place_outputs(out_flat, b, outs, d)
            saved["local"] = (outs, leaves)
        o_works = []
        if prog.chunks:
            o_recv_all = q.new_empty(prog.n_o_recv, d)
            for i, c in enumerate(prog.chunks):
                if works[i] is not None:
                    works[i].wait()
                if c.block is not None:
                    pack = recv_all.index_select(0, c.block.gather)
                    outs, leaves = _run_calls(pack, c.block, env, d, counts)
                    del pack
                    o_send = _outputs_in_order(outs, c.block, c.n_o_send, q, d)
                    saved[i] = (outs, leaves)
                else:
                    o_send = q.new_empty(0, d)
                o_works.append(
                    _a2a(
                        o_recv_all[c.o_recv_off : c.o_recv_off + c.n_o_recv],
                        o_send,
                        c.o_recv,
                        c.o_send,
                        d,
                        pool,
                        env,
                        "pool.o",
                        pipelined,
                    )
                )
            del send_all, recv_all, works, o_send  # every Q/K/V message has arrived
            for w in o_works:
                if w is not None:
                    w.wait()
            del o_works
            out_flat.index_put_((prog.o_out_idx,), o_recv_all)
            del o_recv_all
        # Ulysses out: [C*t*hl, d] (block j: rank j's slots) -> [t, h*d]
        Y = _cp_a2a(out_flat, C, t * hl, d, env, "ulysses.out")
        del out_flat
        ctx.prog, ctx.env, ctx.saved = prog, env, saved
        ctx.shape = (t, h, hkv, d)
        ctx.dtype = q.dtype
        return Y.view(C, t, hl, d).permute(1, 0, 2, 3).reshape(t, h * d)

    @staticmethod
    def backward(ctx, grad):
        with ctx.env.stats.watch("bwd") as counts:
            return PlannedAttention._backward(ctx, grad, counts)

    @staticmethod
    def _backward(ctx, grad, counts):
        prog, env, saved = ctx.prog, ctx.env, ctx.saved
        t, h, hkv, d = ctx.shape
        C, hl, kvl = prog.cp, prog.heads_local, prog.kv_heads_local
        W = hl + 2 * kvl
        dtype = ctx.dtype
        pool, pipelined = env.pool_group, env.pipelined
        dY = grad.reshape(t, C, hl, d).transpose(0, 1).contiguous()
        d_out = _cp_a2a(dY, C, t * hl, d, env, "ulysses.out.bwd")
        del dY
        dof = d_out.view(-1, d)
        chunks = prog.chunks
        n_ch = len(chunks)
        # dO to the executors, a chunk ahead of its backward: chunks are processed last first,
        # and one chunk's dO is in flight while the local tiles' (then the previous chunk's)
        # backward runs, so a rank holds at most two chunks' dO at once.
        d_o_recv = [None] * n_ch
        do_works = [None] * n_ch

        def post_do(i):
            c = chunks[i]
            d_o_recv[i] = d_o_send.new_empty(c.n_o_send, d)
            do_works[i] = _a2a(d_o_recv[i], d_o_send[c.o_recv_off : c.o_recv_off + c.n_o_recv],
                               c.o_send, c.o_recv, d, pool, env, "pool.do", pipelined)

        if n_ch:
            d_o_send = dof.index_select(0, prog.o_out_idx)
            post_do(n_ch - 1)
        local = saved.pop("local", None)  # released as soon as its backward has run
        local_grads = _output_grads(dof, prog.local, d) if local is not None else None
        del d_out, dof  # (the local gradients are views of it where its outputs were in order)
        exact = dtype == torch.float32 or dtype == torch.float64
        copy_local = prog.local_unique and not n_ch
        buf_dtype = dtype if (exact or copy_local) else torch.float32
        # dX in the compute dtype: a Q vector's gradient is written once (its tile runs once);
        # K/V rows read by several tiles are summed in fp32 in dKV (rows x 2 kvl) when the
        # dtype is narrower and they can repeat, and written into dX at the end.
        calls_grads = None
        if local is not None:  # (before dX exists: the kernel's gradients and dX never overlap
            outs, leaves = local  # with the saved pack and output)
            del local
            calls_grads = _backward_calls(outs, leaves, local_grads, counts)
            del outs, leaves, local_grads
        dX = grad.new_zeros(C * t * W, d, dtype=dtype)
        dKV = None if buf_dtype == dtype else grad.new_zeros(C * t * 2 * kvl, d, dtype=buf_dtype)
        acc = _Accumulator(dX, dKV, W, hl, kvl)
        if calls_grads is not None:
            acc.add_block(prog.local, calls_grads, d, copy_local)
            del calls_grads
        if n_ch:
            d_recv = dX.new_zeros(prog.n_recv, d, dtype=buf_dtype)
            d_send = dX.new_empty(prog.n_send, d, dtype=dtype)
            ret_works = []
            for i in reversed(range(n_ch)):
                c = chunks[i]
                if do_works[i] is not None:
                    do_works[i].wait()
                do_works[i], msg, d_o_recv[i] = None, d_o_recv[i], None
                if i:
                    post_do(i - 1)
                if i in saved:
                    outs, leaves = saved.pop(i)
                    grads = _output_grads(msg, c.block, d)
                    calls_grads = _backward_calls(outs, leaves, grads, counts)
                    del outs, leaves, grads
                    _accumulate(d_recv, c.block, calls_grads, d, False)
                    del calls_grads
                del msg
                ret = d_recv[c.recv_off : c.recv_off + c.n_recv].to(dtype)
                ret_works.append(
                    _a2a(
                        d_send[c.send_off : c.send_off + c.n_send],
                        ret,
                        c.qkv_send,
                        c.qkv_recv,
                        d,
                        pool,
                        env,
                        "pool.dqkv",
                        pipelined,
                    )
                )
            for w in ret_works:
                if w is not None:
                    w.wait()
            del ret_works, ret, d_recv, d_o_send
            acc.add_returned(prog, d_send)
            del d_send
        acc.finish()
        del acc, dKV
        dX = dX.view(C, t, W, d)
        dsend = _cp_a2a(dX, C, t * W, d, env, "ulysses.in.bwd")
        del dX
        dq = dsend[:, :, :hl].transpose(0, 1).reshape(t, h, d)
        dk = _take_kv(dsend[:, :, hl : hl + kvl], C, hl, hkv)
        dv = _take_kv(dsend[:, :, hl + kvl :], C, hl, hkv)
        ctx.saved = None
        return dq, dk, dv, None, None


class PerDocAttention(torch.autograd.Function):
    """WLB-LLM's per-document CP: (q [t, h, d], k, v [t, hkv, d]) -> out [t, h*d]."""

    @staticmethod
    def forward(ctx, q, k, v, prog: WlbProgram, env: ExecEnv):
        with env.stats.watch("fwd", prog.tiles_executed, 1) as counts:
            t, h, d = q.shape
            hkv, C = k.shape[1], prog.cp
            kv = torch.cat([k, v], dim=1)  # [t, 2 hkv, d]
            if C > 1:
                kv = all_gather_rows(kv, env.cp_group, env.counter, "wlb.kv")  # [C*t, ...]
            ql = q.detach().requires_grad_()  # the local slots are the query pack as they are
            kl = kv[:, :hkv].index_select(0, prog.kv_rows).requires_grad_()
            vl = kv[:, hkv:].index_select(0, prog.kv_rows).requires_grad_()
            del kv  # the key and value packs hold what the kernel reads of it
            with torch.enable_grad():
                o = env.kernel.attend(ql, kl, vl, prog.call.seg, env.scale, env.key)
            counts.kernel_calls += 1
            real = prog.real.to(o.dtype)[:, None, None]
            # Padding slots' outputs are zeroed in the kernel's own output, which it keeps for
            # its backward: a flash backward reads O only through D = rowsum(dO * O), and the
            # padding rows' dO is zeroed too (backward), so D and every gradient are unchanged.
            # The output is then a view of it, not a second copy. (.data: the change is not an
            # autograd edit of the saved tensor, which the kernel's backward would refuse.)
            o.data.mul_(real)
            ctx.prog, ctx.env, ctx.graph, ctx.real = prog, env, (o, (ql, kl, vl)), real
            ctx.shape = (t, h, hkv, d)
            return o.detach().view(t, h * d)

    @staticmethod
    def backward(ctx, grad):
        with ctx.env.stats.watch("bwd") as counts:
            prog, env = ctx.prog, ctx.env
            t, h, hkv, d = ctx.shape
            o, leaves = ctx.graph
            ctx.graph = None  # the packs and the output are released once the kernel is done
            dq, dk, dv = torch.autograd.grad(o, leaves, grad.reshape(t, h, d) * ctx.real)
            del o, leaves
            counts.kernel_calls += 1
            dtype = dq.dtype
            C = prog.cp
            acc = torch.promote_types(dtype, torch.float32)
            buf = dk.new_zeros(C * t, 2 * hkv, d, dtype=acc)
            n_k = len(prog.kv_rows)
            step = -(-n_k // _CAST_PIECES)
            for a in range(0, n_k, step):  # summed in fp32, cast piece by piece
                rows = prog.kv_rows[a : a + step]
                buf[:, :hkv].index_add_(0, rows, dk[a : a + step].to(acc))
                buf[:, hkv:].index_add_(0, rows, dv[a : a + step].to(acc))
            del dk, dv
            if C > 1:  # reduce-scatter: rank j gets every rank's gradient of its rows, summed
                send = buf.to(dtype)
                del buf
                recv = torch.empty_like(send)
                n = t * 2 * hkv * d
                all_to_all(recv.view(-1), send.view(-1), [n] * C, [n] * C, env.cp_group,
                           env.counter, "wlb.kv.bwd")
                del send
                mine = recv.view(C, t, 2 * hkv, d).sum(0, dtype=acc)
                del recv
            else:
                mine = buf
            return dq, mine[:, :hkv].to(dtype), mine[:, hkv:].to(dtype), None, None

