"""The operator's autograd Functions, driven by the per-slot programs of `meta`.

`planned_attention` (libra, distca, ulysses; wlb at one cp rank) for one rank and micro-batch,
at C > 1 three autograd nodes whose backwards run in turn - `_RebuildO` (with rebuild: O back
from the saved output), `_UlyssesOut` (dO to the kernel's layout), `PlannedAttention` - so the
layer's dO and the saved output are freed before any kernel backward begins:

  forward   q, k, v [t, h|hkv, d] --Ulysses all-to-all, one per tensor--> Xq [S', hl, d],
                Xk, Xv [S', kvl, d]: the sequence in order (contiguous layout), this rank's
                head slice; with C = 1 the inputs themselves (no copy at all)
            pool exchange: every sub-chunk's Q / K / V messages posted at once, point to
                point, range by range - a range that is one contiguous run of X sent from X
                itself, the others built by one gather (Q, K and V together)
            direct call on X itself -> O [S', hl, d], the layer's output buffer; local packs
                (rare) scattered into it; meanwhile the exchange is in flight
            sub-chunk k: wait, one call on the received buffers as they are (packs for the
                rare rest), its O straight back (async) - into O itself for an in-place range
            the other returned O scattered into O --Ulysses all-to-all (_UlyssesOut)-->
                [t, h*d]
  backward  the mirror: dO to the kernel's layout (this rank's own block copied in place, the
            others point to point), dO to the executors first (in place, the rest by one gather,
            sub-chunks last first), the direct call's own backward (its dQ/dK/dV are X's),
            local packs added in, each sub-chunk's kernel backward on the executor straight
            back to the owners (an in-place range's dQ into dQ itself), the other returned
            dQ written and the dK/dV returned added, each K/V vector's returns summed first
            (one row op), Ulysses back. With rebuild, where the plan says so, the executed
            units' backward runs first (`meta.early_return_groups`): in-place dQ lands in
            dO, the K/V returns wait summed per vector, and an executor posts the next
            sub-chunk's messages ahead only where it holds no more than its direct backward
            will.

`per_doc_attention` (wlb, cp > 1): K and V all-gathered in the CP group, the rank's chunks of
every document in one kernel call on a key pack gathered from them, dK/dV reduce-scattered back;
two autograd nodes, so the layer's dO is freed before the reduce-scatter.

Index arrays are int32 (meta.INDEX_DTYPE), expanded on the device once per slot (`meta.upload`).
Every collective is issued inside these Functions in one fixed order on every rank. Kernel calls
go through `kernels.Backend.attend` with their own autograd graph: the forward keeps each call's
(q, k, v leaves, output) and the backward runs the kernel's own backward from them. A call's
output is written in place (through `.data`) only on rows the call gave no keys: the kernel's
backward reads O only through rowsum(dO * O) of rows with keys, so its gradients do not change.

The gradients a K/V vector read on several members gets back, one per member, are summed in
fp32 in send order and rounded once, then added to the owner's own once (`rowops.sum_rows_`:
no atomics, the same bits in either backward order); the kernels sum inside a call in fp32.

Shape legend (shared by the attention modules; `meta` gives the program's details):
  C cp ranks; t slots of one cp rank; S' = C t rows of X; h, h_kv query and KV heads of a rank
  (after tp); hl = h / C, kvl = max(1, h_kv / C) heads of its Ulysses slice; gl = hl / kvl;
  d head dim; P pool members; n_q, n_k rows and hc, hk heads of one batched kernel call.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from libra_ext.attention import counters, rowops
from libra_ext.attention.comm import ByteCounter, all_gather_rows, all_to_all, send_recv
from libra_ext.attention.counters import CallCounts, RuntimeStats
from libra_ext.attention.kernels import Backend
from libra_ext.attention.meta import CallPlan, PackCall, SlotProgram, WlbProgram


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
    wait_timer: object = None
    """A context-manager factory timing the waits for exchange transfers (Megatron-LM's
    timers at --timing-log-level 2); None: not timed."""
    """Names the calling layer (the TE backend keeps one module per layer)."""
    kernel_timer: object = None
    """A context-manager factory timing every kernel call's forward and backward
    (`counters.KernelTimer`); None: not timed."""
    cp_rank: int = 0
    """This rank's index in `cp_group` (its own block of the Ulysses transfers stays in place)."""
    memory: str = "keep"
    """system.attention_memory. owner: the calls on copies of X's rows (local packs, executed
    units) keep nothing after the forward - their outputs and inputs are rebuilt in the backward
    with their values of the forward, the moved units' O and Q / K / V by the pool exchange
    again (from the owner's X and O, as in the forward), the local packs' by gathers from O and
    X. rebuild: that, and the direct call's O too (the layer's O, by the Ulysses all-to-all again
    from the saved output): nothing kept beside what a plain call keeps. WLB-LLM's per-document
    CP (owner, rebuild): its key and value packs freed after the forward and gathered again in
    the backward. Gradients are bit for bit those of keeping them."""

    @property
    def rebuild(self) -> bool:
        """The layer's O is rebuilt (memory = rebuild)."""
        return self.memory == "rebuild"

    @property
    def again(self) -> bool:
        """The moved units' and local packs' outputs and inputs are rebuilt (owner, rebuild)."""
        return self.memory != "keep"


class _Call:
    """One kernel call with its own autograd graph: forward on (views of) its inputs, the
    kernel's own backward later."""

    def __init__(self, call: CallPlan, q, k, v, env: ExecEnv, counts: CallCounts):
        self.leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
        self.timer = env.kernel_timer or contextlib.nullcontext
        with torch.enable_grad(), self.timer():
            self.out = env.kernel.attend(*self.leaves, call.seg, env.scale, env.key)
        counts.kernel_calls += 1

    def release(self, inputs: bool = False) -> None:
        """Free the output's memory (with `inputs`, the inputs' too; the kernel's saved tensors
        share it) until `restore`."""
        self._hold([self.out] + (list(self.leaves) if inputs else []))

    def release_keys(self) -> None:
        """Free the memory of the inputs k and v alone (packs of this call's own) until
        `restore`."""
        self._hold(self.leaves[1:])

    def _hold(self, tensors) -> None:
        self.held = list({x.untyped_storage()._cdata: x for x in tensors}.values())
        self.sizes = [counters.resize_storage(x, 0) for x in self.held]

    def restore(self) -> list:
        """The memory `release` freed, back, to be refilled with the same values: the output
        and (when released) the inputs q, k, v, each as [rows, d] (`.data`: writing it bumps no
        version the kernel's saved tensors check)."""
        for x, n in zip(self.held, self.sizes):
            counters.resize_storage(x, n)
        self.held = self.sizes = None
        return [x.data.view(-1, x.shape[-1]) for x in (self.out,) + self.leaves]

    def backward(self, grad, counts: CallCounts) -> tuple:
        """(dq, dk, dv) of the call for output gradient `grad`; the graph is released."""
        with self.timer():
            g = torch.autograd.grad(self.out, self.leaves, grad)
        self.out = self.leaves = None
        counts.kernel_calls += 1
        return g


def _a2a(out, inp, out_vec, in_vec, d, group, env: ExecEnv, kind: str, async_op: bool):
    """all_to_all_single of flat [n, d] buffers with splits in vectors."""
    w = all_to_all(out.view(-1), inp.reshape(-1), [n * d for n in out_vec],
                   [n * d for n in in_vec], group, env.counter, kind, async_op=async_op)
    return w if async_op else None


def _cp_a2a(x: torch.Tensor, C: int, d: int, env: ExecEnv, kind: str) -> torch.Tensor:
    """Equal all-to-all over the CP group of x [C, ...] (block j to cp rank j)."""
    y = torch.empty_like(x)
    rows = x.numel() // (C * d)
    _a2a(y, x, [rows] * C, [rows] * C, d, env.cp_group, env, kind, False)
    return y


ROUNDS = 2
"""Token ranges the Ulysses transfers between the layer's layout and the kernel's go in: their
staging buffer holds one range of the other ranks' blocks (~0.8 (C - 1) / (C ROUNDS) of Q/K/V
at 32 / 4 heads, 0.2 at C = 2)."""


def _ranges(t: int) -> list:
    """The ROUNDS token ranges [a, b) of t slots."""
    step = -(-t // ROUNDS)
    return [(a, min(t, a + step)) for a in range(0, t, step)]


def _others(C: int, me: int) -> list:
    """(rows of a staging buffer of the other ranks' blocks, the same blocks of a [C, ...]
    tensor): the blocks before rank `me` and those after it, each as one slice where it has
    any (at most two copies move them all)."""
    pairs = ((slice(0, me), slice(0, me)), (slice(me, C - 1), slice(me + 1, C)))
    return [(s, b) for s, b in pairs if s.stop > s.start]


def _to_heads(x: torch.Tensor, dst: torch.Tensor, C: int, env: ExecEnv, kind: str) -> None:
    """The Ulysses transfer from the layer's layout to the kernel's: x [t, C*hl*d] (this rank's
    tokens, every head) -> dst [C, t, hl, d] (every rank's tokens, this rank's heads). This
    rank's own block is copied in place; the C - 1 others go point to point, range by range
    (`ROUNDS`), from one staging buffer of theirs, straight into dst (a full [C, t, hl, d] send
    buffer would be C ROUNDS / (C - 1) times it)."""
    me, t = env.cp_rank, dst.shape[1]
    src = x.view(t, C, *dst.shape[2:]).transpose(0, 1)  # [C, t, hl, d], a view
    dst[me].copy_(src[me])
    peers = [j for j in range(C) if j != me]
    rounds = _ranges(t)
    stage = x.new_empty(C - 1, rounds[0][1], *dst.shape[2:])
    for a, b in rounds:
        n = b - a
        for rows, blocks in _others(C, me):
            stage[rows, :n].copy_(src[blocks, a:b])
        send_recv([(kind, [(j, stage[i, :n]) for i, j in enumerate(peers)],
                    [(j, dst[j, a:b]) for j in peers])], env.cp_group, env.counter)


def _from_heads(o: torch.Tensor, out: torch.Tensor, C: int, env: ExecEnv, kind: str) -> None:
    """The Ulysses transfer back, `_to_heads`'s mirror: o [C, t, hl, d] -> out [t, C*hl*d].
    Each block is sent from o itself; this rank's own is copied in place, the others' arrive
    range by range in one staging buffer and are copied into place."""
    me, t = env.cp_rank, o.shape[1]
    dst = out.view(t, C, *o.shape[2:])
    dst[:, me].copy_(o[me])
    peers = [j for j in range(C) if j != me]
    rounds = _ranges(t)
    stage = o.new_empty(C - 1, rounds[0][1], *o.shape[2:])
    for a, b in rounds:
        n = b - a
        send_recv([(kind, [(j, o[j, a:b]) for j in peers],
                    [(j, stage[i, :n]) for i, j in enumerate(peers)])], env.cp_group, env.counter)
        for rows, blocks in _others(C, me):
            dst[a:b, blocks].copy_(stage[rows, :n].transpose(0, 1))


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
    s = src.reshape(hkv, g // hl, t, d).sum(1, dtype=torch.promote_types(src.dtype,
                                                                          torch.float32))
    return s.to(src.dtype).transpose(0, 1).contiguous()


def _ulysses_in(q, k, v, prog: SlotProgram, env: ExecEnv) -> tuple:
    """(Xq, Xk, Xv): one all-to-all per tensor over the CP group (the receive is the kernel's
    input, in sequence order); with C = 1 the tensors themselves."""
    C, hl, kvl = prog.cp, prog.heads_local, prog.kv_heads_local
    if C == 1:
        return q, k, v
    t, _, d = q.shape
    sq = q.new_empty(C, t, hl, d)
    sq.copy_(q.view(t, C, hl, d).transpose(0, 1))
    xq = _cp_a2a(sq, C, d, env, "ulysses.q").view(C * t, hl, d)
    del sq
    out = [xq]
    for x, kind in ((k, "ulysses.k"), (v, "ulysses.v")):
        s = x.new_empty(C, t, kvl, d)
        _put_kv(s, x, C, hl)
        out.append(_cp_a2a(s, C, d, env, kind).view(C * t, kvl, d))
        del s
    return tuple(out)


def _flat(x: torch.Tensor, d: int) -> torch.Tensor:
    """x as [vectors, d] (a view of a contiguous tensor)."""
    return x.view(-1, d) if x.is_contiguous() else x.reshape(-1, d)


class _Held:
    """What the nodes of one layer call share: the direct call, whose output `_UlyssesOut`
    frees once sent and `_RebuildO` rebuilds (system.attention_memory = rebuild)."""

    call: _Call | None = None


def planned_attention(q, k, v, prog: SlotProgram, env: ExecEnv) -> torch.Tensor:
    """(q [t, h, d], k, v [t, hkv, d]) -> out [t, h*d] for one micro-batch of a step plan.

    With C > 1 three autograd nodes: `PlannedAttention` (the Ulysses all-to-alls in, the pool
    exchange and the kernels; its output is O in the kernel's layout), `_UlyssesOut` (the
    all-to-all back) and, with rebuild, `_RebuildO`. Their backwards run one after the other,
    so the layer's dO is freed once moved to the kernel's layout, before any kernel backward
    begins: one copy of dO, not two, beside what the kernels keep."""
    if prog.cp == 1:
        return PlannedAttention.apply(q, k, v, prog, env, None)
    held = _Held()
    o = PlannedAttention.apply(q, k, v, prog, env, held)
    out = _UlyssesOut.apply(o, prog, env, held)
    del o
    return _RebuildO.apply(out, prog, env, held) if env.rebuild else out


class PlannedAttention(torch.autograd.Function):
    """(q [t, h, d], k, v [t, hkv, d]) -> O [C t, hl, d] in the kernel's layout (with C = 1 the
    layer's output [t, h*d]); `planned_attention` puts it together with the all-to-all back."""

    @staticmethod
    def forward(ctx, q, k, v, prog: SlotProgram, env: ExecEnv, held: _Held | None):
        with env.stats.watch("fwd", prog.tiles_executed, prog.exec_blocks) as counts:
            return PlannedAttention._forward(ctx, q, k, v, prog, env, held, counts)

    @staticmethod
    def _forward(ctx, q, k, v, prog, env, held, counts):
        t, h, d = q.shape
        C = prog.cp
        xq, xk, xv = _ulysses_in(q, k, v, prog, env)
        moving = bool(prog.subchunks)
        xqf = _flat(xq, d) if moving or prog.lpacks else None
        xkf, xvf = (_flat(xk, d), _flat(xv, d)) if moving or prog.lpacks else (None, None)
        ex = _Exchange(prog, env, d, xq.dtype, xq.device)
        if moving:  # every sub-chunk's Q / K / V in flight before any compute
            ex.post_inputs(xqf, xkf, xvf)
        direct = _Call(prog.direct, xq, xk, xv, env, counts)
        o = direct.out.data  # [S', hl, d]: the layer's O, written in place where others run
        of = o.view(-1, d)
        lpacks = [_run_pack(p, xqf, xkf, xvf, env, counts) for p in prog.lpacks]
        if prog.tokens < prog.rows:
            o[prog.tokens:].zero_()  # the padding rows past the sequence
        executed = ex.execute(counts, of) if moving else []
        ex.place_outputs(of, lpacks, moving)
        del xqf, xkf, xvf, xq, xk, xv
        ctx.prog, ctx.env = prog, env
        ctx.graph = (direct, lpacks, executed, ex)
        ctx.shape = (t, h, k.shape[1], d)
        ctx.again = env.again and (bool(lpacks) or bool(executed))
        if ctx.again:  # each freed as soon as O holds what it was needed for
            for call in _moved_calls(lpacks, executed):
                call.release(inputs=True)
        if C > 1:  # O as the kernels left it; _UlyssesOut sends it (and frees it: rebuild)
            held.call = direct
            return direct.out.detach()
        return direct.out.detach().view(t, h * d)  # (the layer's output is the direct call's)

    @staticmethod
    def backward(ctx, grad):
        with ctx.env.stats.watch("bwd") as counts:
            return PlannedAttention._backward(ctx, grad, counts)

    @staticmethod
    def _backward(ctx, grad, counts):
        prog, env = ctx.prog, ctx.env
        direct, lpacks, executed, ex = ctx.graph
        ctx.graph = None
        t, h, hkv, d = ctx.shape
        C, hl = prog.cp, prog.heads_local
        do = grad.view(C * t, hl, d)  # C > 1: moved to the kernel's layout by _UlyssesOut
        if not do.is_contiguous():
            do = do.contiguous()
        dof = do.view(-1, d)
        rebuilt = _rebuild(direct, lpacks, d) if ctx.again else None
        # rebuild, where the plan says it lowers the group's peak: the executed units' backward
        # and every return before dX exists (their dQ lands in a buffer, added below)
        early = bool(executed) and env.rebuild and prog.early_returns
        if executed:  # early: the executed units' backward held to what the direct one holds
            ex.post_grads(dof, executed, rebuilt, sum(x.numel() for x in direct.leaves) // d
                          if early else None)
        del rebuilt
        if early:  # a dQ range returned in place lands in dO (its rows: zero-key in the direct
            # call) where dO is this operator's own (C > 1: _UlyssesOut made it; at C = 1 it is
            # autograd's, which others may hold: a buffer then), the K/V gradients are summed
            # per vector as they wait for dK/dV
            ex.return_grads(executed, counts, dof if C > 1 else None)
            ex.wait_returns()
        dq, dk, dv = direct.backward(do, counts)
        del direct
        if lpacks or executed:
            dqf, dkf, dvf = _flat(dq, d), _flat(dk, d), _flat(dv, d)
            _packs_backward(lpacks, dof, dqf, dkf, dvf, counts)
            if executed:
                if not early:
                    ex.return_grads(executed, counts, dqf)
                ex.add_returned(dqf, dkf, dvf)
        del do, dof, ex, lpacks, executed
        if C == 1:
            return dq, dk, dv, None, None, None
        return _ulysses_out(dq, dk, dv, prog, env, (t, h, hkv, d)) + (None, None, None)


class _UlyssesOut(torch.autograd.Function):
    """O [C t, hl, d] in the kernel's layout -> the layer's output [t, h*d]: the Ulysses
    all-to-all back (with rebuild the direct call's output, O, is freed once sent). Backward:
    dO to the kernel's layout (`_to_heads`), which frees the layer's dO as this node returns."""

    @staticmethod
    def forward(ctx, o, prog: SlotProgram, env: ExecEnv, held: _Held):
        with env.stats.watch("fwd"):
            C, hl = prog.cp, prog.heads_local
            d = o.shape[-1]
            t = o.shape[0] // C
            ctx.prog, ctx.env = prog, env
            if not env.rebuild:  # O stays (kept): its blocks are sent from where they lie
                out = o.new_empty(t, C * hl * d)
                _from_heads(o.view(C, t, hl, d), out, C, env, "ulysses.o")
                return out
            y = _cp_a2a(o.view(C, t, hl, d), C, d, env, "ulysses.o")
            del o
            held.call.release()  # O is freed before the output is made; _RebuildO rebuilds it
            return y.permute(1, 0, 2, 3).reshape(t, C * hl * d)

    @staticmethod
    def backward(ctx, grad):
        prog, env = ctx.prog, ctx.env
        with env.stats.watch("bwd"):
            C, hl = prog.cp, prog.heads_local
            t = grad.shape[0]
            do = grad.new_empty(C, t, hl, grad.shape[1] // (C * hl))
            _to_heads(grad, do, C, env, "ulysses.o.bwd")
            return do.view(C * t, hl, -1), None, None, None


class _RebuildO(torch.autograd.Function):
    """(system.attention_memory = rebuild) The layer's output as it is, saved: the first
    backward rebuilds from it the kernel's O into the direct call's memory (`_to_heads`), and
    the output is freed before dO is moved to the kernel's layout."""

    @staticmethod
    def forward(ctx, out, prog: SlotProgram, env: ExecEnv, held: _Held):
        ctx.save_for_backward(out)
        ctx.prog, ctx.env, ctx.held = prog, env, held
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        prog, env = ctx.prog, ctx.env
        with env.stats.watch("bwd"):
            (out,) = ctx.saved_tensors
            C, hl = prog.cp, prog.heads_local
            o = ctx.held.call.restore()[0]
            ctx.held = None
            _to_heads(out, o.view(C, out.shape[0], hl, -1), C, env, "ulysses.o.rebuild")
            return grad, None, None, None


def _moved_calls(lpacks, executed) -> list:
    """The calls on copies of X's rows: the local packs' and the executed units'."""
    return [call for _, call in lpacks] + [call for graph in executed for _, call in graph]


def _rebuild(direct, lpacks, d: int) -> tuple:
    """What `ExecEnv.again` released, back with its values of the forward: the local packs'
    outputs and inputs, gathered from O and X (the layer's O as the direct call left it - kept,
    or rebuilt by `_RebuildO` before). Returns O and X flat, what the owner sends its executed
    units again from."""
    of = direct.out.data.view(-1, d)
    x = tuple(_flat(leaf.detach(), d) for leaf in direct.leaves)
    for p, call in lpacks:
        rowops.gather_into(call.restore(), (of,) + x, [p.q.idx, p.q.idx, p.k.idx, p.k.idx])
    return (of,) + x


def _ulysses_out(dq, dk, dv, prog: SlotProgram, env: ExecEnv, shape) -> tuple:
    """The Ulysses all-to-alls backwards: X's gradients to each rank's tokens and heads."""
    t, h, hkv, d = shape
    C, hl, kvl = prog.cp, prog.heads_local, prog.kv_heads_local
    rq = _cp_a2a(dq.view(C, t, hl, d), C, d, env, "ulysses.q.bwd")
    out = [rq.transpose(0, 1).reshape(t, h, d)]
    del rq
    for x, kind in ((dk, "ulysses.k.bwd"), (dv, "ulysses.v.bwd")):
        r = _cp_a2a(x.view(C, t, kvl, d), C, d, env, kind)
        out.append(_take_kv(r, C, hl, hkv))
    return tuple(out)


def _run_pack(p: PackCall, qf, kf, vf, env: ExecEnv, counts: CallCounts):
    """A pack's call on vectors gathered from the sources (one gather into one buffer).
    Returns (the pack, its _Call); `_scatter_outputs` puts its output in place."""
    d = qf.shape[-1]
    c = p.call
    _, (q, k, v) = rowops.gather([qf, kf, vf], [p.q.idx, p.k.idx, p.k.idx])
    call = _Call(c, q.view(-1, c.hc, d), k.view(-1, c.hk, d), v.view(-1, c.hk, d), env, counts)
    del q, k, v
    return p, call


def _scatter_outputs(of, graph: list, idxs=(), srcs=()) -> None:
    """The outputs of packs' calls (`graph`: (pack, _Call) pairs) written into `of` at their
    query vectors, and `srcs` at `idxs` beside them: one scatter."""
    d = of.shape[-1]
    rowops.scatter([of] * (len(graph) + len(idxs)), [p.q.idx for p, _ in graph] + list(idxs),
                   [call.out.detach().view(-1, d) for _, call in graph] + list(srcs),
                   [False] * (len(graph) + len(idxs)))


def _packs_backward(graph: list, dof, dqf, dkf, dvf, counts: CallCounts) -> None:
    """The backward of packs' calls on one source (`graph`: (pack, _Call) pairs, at most two):
    their dO gathered at their query vectors (one gather), each call's backward, then dQ
    written there (each query vector is one piece's) and dK/dV added at their key vectors (one
    scatter)."""
    if not graph:
        return
    d = dof.shape[-1]
    _, gs = rowops.gather([dof] * len(graph), [p.q.idx for p, _ in graph])
    dsts, idxs, srcs = [], [], []
    for (p, call), g in zip(graph, gs):
        gq, gk, gv = call.backward(g.view(-1, p.call.hc, d), counts)
        dsts += [dqf, dkf, dvf]
        idxs += [p.q.idx, p.k.idx, p.k.idx]
        srcs += [gq.view(-1, d), gk.view(-1, d), gv.view(-1, d)]
    del gs
    rowops.scatter(dsts, idxs, srcs, [False, True, True] * len(graph))


def _wait(works: list, env: ExecEnv) -> None:
    """Wait for posted transfers (None: a synchronous one, done), timed when asked."""
    works = [w for w in works if w is not None]
    if not works:
        return
    with env.wait_timer() if env.wait_timer is not None else contextlib.nullcontext():
        for w in works:
            w.wait()


def _range(own, gathered, whole: bool, n: int, x: int, o: int, pos: int):
    """Where one range of an owner's message lies (`Messages.q_send`'s entries): in `own` (X,
    or O / dQ) from vector x when it is sent in place, else in the gathered buffer - at its
    offset o in the rest, or at its position pos among every message when the whole message
    set travels gathered (`whole`: own is not contiguous)."""
    if whole:
        return gathered[pos:pos + n]
    return own[x:x + n] if x >= 0 else gathered[o:o + n]


class _Exchange:
    """The pool exchange of one layer call: messages, the executor's calls, the returns.

    Messages travel point to point, one batch per sub-chunk and direction, range by range
    (`SlotProgram.messages`, set by `meta.upload`): a range that is one contiguous run of X (of
    dO) is sent from there and its returned O (dQ) lands in O (dQ) there; only the other
    ranges are gathered (one fused gather per direction) and scattered back (one fused
    scatter)."""

    def __init__(self, prog: SlotProgram, env: ExecEnv, d: int, dtype, device):
        self.prog, self.env, self.d = prog, env, d
        self.m = prog.messages
        self.new = lambda n: torch.empty(n, d, dtype=dtype, device=device)

    def _outgoing(self, srcs: list, qs: list) -> list:
        """Per source (Q-sized where qs[p], else KV-sized), (its messages that are not sent in
        place, in send order, whether that is all of them): one fused gather. A source that
        is not contiguous sends every message from the gather."""
        p, m = self.prog, self.m
        whole = [not x.is_contiguous() for x in srcs]
        idx = [(p.send_q.idx if q else p.send_kv.idx) if w else (m.q_rest if q else m.kv_rest)
               for q, w in zip(qs, whole)]
        return list(zip(rowops.gather(srcs, idx)[1], whole))

    def _back(self, dest) -> tuple:
        """(the buffer an owner's returned Q-sized messages land in where not in place,
        whether every message lands there: `dest`, its O or dQ, is None - not made yet - or
        not contiguous)."""
        whole = dest is None or not dest.is_contiguous()
        return self.new(self.prog.n_q_send if whole else int(self.m.q_rest.shape[0])), whole

    def _send(self, k: int, parts: list) -> list:
        """Sub-chunk k's messages out to the executors, range by range: parts (kind, q,
        source, its `_outgoing`, the buffer this rank receives into). Returns the posted
        transfers."""
        m, transfers = self.m, []
        for kind, q, src, (g, whole), buf in parts:
            sends = [(j, _range(src, g, whole, n, x, o, pos))
                     for j, n, x, o, pos in (m.q_send if q else m.kv_send)[k]]
            recvs = [(i, buf[off:off + n]) for i, n, off in (m.q_recv if q else m.kv_recv)[k]]
            transfers.append((kind, sends, recvs))
        return [send_recv(transfers, self.env.pool_group, self.env.counter, self.env.pipelined)]

    def _return(self, k: int, parts: list) -> list:
        """Sub-chunk k's results back to their owners, range by range: parts (kind, q, this
        executor's results in receive order, the owner's own flat buffer a Q-sized in-place
        range lands in, (the buffer the others land in, whether all of them do): Q-sized ones
        at their offsets in the gathered rest - or in send order, as K/V-sized ones always
        are). Returns the posted transfers."""
        m, transfers = self.m, []
        for kind, q, msg, dest, (ret, whole) in parts:
            sends = [(i, msg[off:off + n]) for i, n, off in (m.q_recv if q else m.kv_recv)[k]]
            if q:
                recvs = [(j, _range(dest, ret, whole, n, x, o, pos))
                         for j, n, x, o, pos in m.q_send[k]]
            else:
                recvs = [(j, ret[pos:pos + n]) for j, n, _, _, pos in m.kv_send[k]]
            transfers.append((kind, sends, recvs))
        return [send_recv(transfers, self.env.pool_group, self.env.counter, self.env.pipelined)]

    def post_inputs(self, xqf, xkf, xvf) -> None:
        """Every sub-chunk's Q / K / V messages out (one gather builds those that are not sent
        in place); each sub-chunk's arrive in buffers of their own (a pack sub-chunk's are
        freed once gathered, a direct one's are what its kernel keeps)."""
        p = self.prog
        sq, sk, sv = self._outgoing([xqf, xkf, xvf], [True, False, False])
        self.recv, self.in_works = [], []
        for k, sc in enumerate(p.subchunks):
            rq, rk, rv = self.new(sc.n_q_recv), self.new(sc.n_kv_recv), self.new(sc.n_kv_recv)
            self.recv.append((rq, rk, rv))
            self.in_works.append(self._send(k, [("pool.q", True, xqf, sq, rq),
                                                ("pool.k", False, xkf, sk, rk),
                                                ("pool.v", False, xvf, sv, rv)]))

    def execute(self, counts: CallCounts, of) -> list:
        """Each sub-chunk as it arrives: its calls, its O back to the owners (async; in place:
        into `of`, this rank's O). Returns per sub-chunk its calls' graphs."""
        p, d = self.prog, self.d
        self.o_back = self._back(of)
        self.o_works, done = [], []
        for i, (sc, works) in enumerate(zip(p.subchunks, self.in_works)):
            _wait(works, self.env)
            q, k, v = self.recv[i]
            self.recv[i] = None
            if sc.call is not None:  # direct: the kernel on the received buffers themselves
                c = sc.call
                call = _Call(c, q.view(-1, c.hc, d), k.view(-1, c.hk, d),
                             v.view(-1, c.hk, d), self.env, counts)
                msg, graph = call.out.detach().view(-1, d), [(None, call)]
            elif sc.packs:
                msg = self.new(sc.n_q_recv)
                graph = [_run_pack(pk, q, k, v, self.env, counts) for pk in sc.packs]
                _scatter_outputs(msg, graph)
            else:
                msg, graph = self.new(0), []
            del q, k, v
            done.append(graph)
            self.o_works += self._return(i, [("pool.o", True, msg, of, self.o_back)])
        del self.in_works, self.recv
        return done

    def place_outputs(self, of, lpacks: list, moving: bool) -> None:
        """The local packs' outputs and (`moving`) the returned O of this rank's moved units
        that did not land in place into its O buffer, in one scatter."""
        if not moving:
            _scatter_outputs(of, lpacks)
            return
        _wait(self.o_works, self.env)
        back, whole = self.o_back
        _scatter_outputs(of, lpacks, [self.prog.send_q.idx if whole else self.m.q_rest], [back])
        del self.o_back, self.o_works

    def post_grads(self, dof, executed: list, rebuilt=None, budget: int | None = None) -> None:
        """dO of the moved units to their executors, last sub-chunk first (the order their
        backward runs in); with `rebuilt` (ExecEnv.rebuild: this rank's O and X flat), their O
        and Q / K / V too, into the memory of the executed calls (a pack sub-chunk's through
        buffers its packs gather from). Every sub-chunk's messages are posted now - or, with
        `budget` (the early order: this rank's X in vectors), the first sub-chunk's, and each
        next one's while `return_grads` runs the one before (`_ahead`)."""
        srcs, qs, kinds = [dof], [True], ["pool.do"]
        if rebuilt is not None:
            srcs += list(rebuilt)
            qs += [True, True, False, False]
            kinds += ["pool.o.rebuild", "pool.q.rebuild", "pool.k.rebuild", "pool.v.rebuild"]
        gathered = self._outgoing(srcs, qs)  # one gather builds what is not sent in place
        self.grad_msgs = (kinds, qs, srcs, gathered, rebuilt is not None)
        self.d_o, self.do_works, self.again = {}, {}, {}
        self.turns = list(reversed(range(len(self.prog.subchunks))))
        self.posted, self.budget = 0, budget
        while self.posted < (1 if budget is not None else len(self.turns)):
            self._post_grad(executed)

    def _post_grad(self, executed: list) -> None:
        """The next sub-chunk's backward messages (in turn), into buffers made for them now."""
        i = self.turns[self.posted]
        self.posted += 1
        kinds, qs, srcs, gathered, again_too = self.grad_msgs
        sc = self.prog.subchunks[i]
        self.d_o[i] = self.new(sc.n_q_recv)
        bufs = [self.d_o[i]]
        if again_too:
            graph = executed[i]
            if sc.call is not None:  # straight into the call's output and inputs
                again = graph[0][1].restore()
            else:
                again = [self.new(sc.n_q_recv if q else sc.n_kv_recv) if graph else
                         self.new(0) for q in qs[1:]]
            self.again[i] = again
            bufs += again
        self.do_works[i] = self._send(i, list(zip(kinds, qs, srcs, gathered, bufs)))
        if self.posted == len(self.turns):
            del self.grad_msgs

    def _footprint(self, i: int, graph: list) -> tuple:
        """(vectors its backward messages land in, vectors its backward makes, vectors it
        returns) of sub-chunk i on this executor, from the program's counts (host integers)."""
        sc = self.prog.subchunks[i]
        q, kv = sc.n_q_recv, sc.n_kv_recv
        packs = [pk for pk, _ in graph] if sc.call is None else []
        inputs = 3 * q + 2 * kv + sum(2 * pk.q.size + 2 * pk.k.size for pk in packs)
        work = q + 2 * kv + sum(pk.q.size + 2 * pk.k.size for pk in packs)
        return inputs, work, q + 2 * kv

    def _ahead(self, t: int, executed: list, returned: int) -> None:
        """Before the backward of turn t (the early order): the next sub-chunk's messages
        posted now - their transfer under this one's kernel - where this rank then holds no
        more than its direct backward will (its X again, as dX, and the returns that wait for
        it), else right after this kernel (`return_grads`). One sub-chunk ahead at most, so
        every member posts its transfers in one order."""
        if self.posted != t + 1 or self.posted == len(self.turns):
            return
        waiting = self.dq_ret[0].shape[0] + 2 * self.m.kv_distinct  # (<= n_kv_send)
        landing = self.dq_ret[0].shape[0] + 2 * self.prog.n_kv_send
        inputs, work, _ = self._footprint(self.turns[t], executed[self.turns[t]])
        nxt = self._footprint(self.turns[t + 1], executed[self.turns[t + 1]])[0]
        if landing + returned + inputs + work + nxt <= self.budget + waiting:
            self._post_grad(executed)

    def return_grads(self, executed: list, counts: CallCounts, dest) -> None:
        """Each sub-chunk's kernel backward on this executor (last first), its dQ / dK / dV
        straight back to the owners. A dQ range returned in place lands in `dest` at its own
        vectors: this rank's dQ, or - before the direct call's backward has made it - its dO,
        whose rows of moved units the direct call gives no keys (`add_returned` moves them);
        None: every returned dQ in a buffer."""
        p, d = self.prog, self.d
        self.dq_ret, self.dq_dest = self._back(dest), dest
        self.kv_ret = (self.new(p.n_kv_send), self.new(p.n_kv_send), False)
        self.ret_works, returned = [], 0
        for t, i in enumerate(self.turns):
            sc, graph = p.subchunks[i], executed[i]
            if self.budget is not None:
                self._ahead(t, executed, returned)
            _wait(self.do_works[i], self.env)
            g = self.d_o.pop(i)
            bufs = self.again.pop(i, None)
            if bufs is not None and sc.call is None:  # the packs' from what arrived
                for pk, call in graph:
                    rowops.gather_into(call.restore(), bufs,
                                       [pk.q.idx, pk.q.idx, pk.k.idx, pk.k.idx])
            del bufs
            if sc.call is not None:
                gq, gk, gv = graph[0][1].backward(g.view(-1, sc.call.hc, d), counts)
                gq, gk, gv = gq.view(-1, d), gk.view(-1, d), gv.view(-1, d)
            else:  # a stream's keys are read by several pieces: their gradients add up
                gq, gkv = self.new(sc.n_q_recv), self.new(2 * sc.n_kv_recv)
                if graph:  # dK and dV in one buffer: one fill
                    gkv.zero_()
                gk, gv = gkv.view(2, sc.n_kv_recv, d)
                _packs_backward(graph, g, gq, gk, gv, counts)
            del g
            if self.posted == t + 1 and self.posted < len(self.turns):
                self._post_grad(executed)  # not ahead: now, this sub-chunk's inputs freed
            returned += self._footprint(i, graph)[2]
            self.ret_works += self._return(i, [("pool.dq", True, gq, dest, self.dq_ret),
                                               ("pool.dk", False, gk, None,
                                                (self.kv_ret[0], True)),
                                               ("pool.dv", False, gv, None,
                                                (self.kv_ret[1], True))])
            executed[i] = None
        del self.d_o, self.do_works, self.again, self.turns

    def wait_returns(self) -> None:
        """Wait for every return `return_grads` posted (what this rank sent is freed with them)
        and, where a K/V vector went to several executors, sum the K/V gradients received per
        vector into one buffer of the distinct vectors sent (the received ones freed): what
        waits for `add_returned` is a dQ range that did not land in place and each K/V vector's
        gradient once."""
        _wait(self.ret_works, self.env)
        self.ret_works = []
        m = self.m
        dk, dv, _ = self.kv_ret
        if m.kv_distinct == dk.shape[0]:  # each vector returned once: nothing to sum
            return
        acc = self.new(2 * m.kv_distinct)
        sk, sv = acc[:m.kv_distinct], acc[m.kv_distinct:]
        rowops.sum_into([sk, sv], [None, None], [dk, dv], [m.kv_order, m.kv_order],
                        [m.kv_offs, m.kv_offs], [False, False])
        self.kv_ret = (sk, sv, True)

    def add_returned(self, dqf, dkf, dvf) -> None:
        """The gradients of this rank's moved units, in one op: dQ written (each query vector
        ran once; what landed in dQ in place stays, what landed in dO moves to dQ), dK / dV
        added to the local ones, each vector's returns summed first in send order (or already,
        by `wait_returns`)."""
        _wait(self.ret_works, self.env)
        p, m = self.prog, self.m
        (dq, whole), (dk, dv, summed) = self.dq_ret, self.kv_ret
        order, offs = (None, None) if summed else (m.kv_order, m.kv_offs)
        dsts, rows, srcs, idxs = [dqf, dkf, dvf], [p.send_q.idx if whole else m.q_rest,
                                                  m.kv_rows, m.kv_rows], [dq, dk, dv], \
            [None, order, order]
        if self.dq_dest is not None and self.dq_dest is not dqf and not whole:
            dsts.append(dqf)  # the in-place ranges that landed in dO
            rows.append(m.q_in)
            srcs.append(self.dq_dest)
            idxs.append(m.q_in)
        rowops.sum_into(dsts, rows, srcs, idxs, [None, offs, offs, None][:len(dsts)],
                        [False, True, True, False][:len(dsts)])
        del self.ret_works, self.dq_ret, self.dq_dest, self.kv_ret


def per_doc_attention(q, k, v, prog: WlbProgram, env: ExecEnv) -> torch.Tensor:
    """WLB-LLM's per-document CP: (q [t, h, d], k, v [t, hkv, d]) -> out [t, h*d], as two
    autograd nodes: `_WlbPacks` (K and V all-gathered in the CP group, the key and value packs
    the rank's chunks read gathered from them; backward: the packs' gradients added into every
    rank's rows and reduce-scattered back) and `_WlbCall` (the kernel call on q and the packs).
    The call's backward runs first and returns, so the layer's dO is freed before the packs'
    gradients are summed and reduce-scattered. With system.attention_memory owner or rebuild
    the packs - copies of the other CP ranks' K/V rows - are freed after the forward and
    gathered again (one more all-gather of K and V) in the backward, bit for bit."""
    with env.stats.watch("fwd", prog.tiles_executed, 1) as counts:
        kp, vp = _WlbPacks.apply(k, v, prog, env)
        return _WlbCall.apply(q, kp, vp, k, v, prog, env, counts)


def _wlb_packs(k, v, prog: WlbProgram, env: ExecEnv, out: list | None = None) -> list:
    """The key and value packs [n, hkv*d] (into `out` when given: their rebuild): K and V
    all-gathered, the rows the rank's chunks read gathered from them in one gather."""
    again = ".rebuild" if out is not None else ""
    kg = all_gather_rows(k, env.cp_group, env.counter, "wlb.k" + again)  # [C*t, hkv, d]
    vg = all_gather_rows(v, env.cp_group, env.counter, "wlb.v" + again)
    rows = prog.kv.idx
    srcs = [kg.view(kg.shape[0], -1), vg.view(vg.shape[0], -1)]
    if out is not None:
        rowops.gather_into(out, srcs, [rows, rows])
        return out
    return rowops.gather(srcs, [rows, rows])[1]


class _WlbPacks(torch.autograd.Function):
    """(k, v [t, hkv, d]) -> the key and value packs [n, hkv, d] (`per_doc_attention`)."""

    @staticmethod
    def forward(ctx, k, v, prog: WlbProgram, env: ExecEnv):
        t, hkv, d = k.shape
        kp, vp = _wlb_packs(k, v, prog, env)
        ctx.prog, ctx.env, ctx.shape = prog, env, (t, hkv, d)
        return kp.view(-1, hkv, d), vp.view(-1, hkv, d)

    @staticmethod
    def backward(ctx, dkp, dvp):
        with ctx.env.stats.watch("bwd"):
            prog, env = ctx.prog, ctx.env
            t, hkv, d = ctx.shape
            C = prog.cp
            buf = dkp.new_zeros(2, C * t, hkv * d)  # dK and dV of every rank's rows
            rowops.scatter([buf[0], buf[1]], [prog.kv.idx, prog.kv.idx],
                           [dkp.reshape(-1, hkv * d), dvp.reshape(-1, hkv * d)], [True, True])
            del dkp, dvp
            # reduce-scatter: rank j gets every rank's gradient of its rows, summed
            recv = torch.empty_like(buf)
            n = t * hkv * d
            for i, kind in enumerate(("wlb.k.bwd", "wlb.v.bwd")):
                all_to_all(recv[i].view(-1), buf[i].view(-1), [n] * C, [n] * C, env.cp_group,
                           env.counter, kind)
            del buf
            out = recv.view(2, C, t, hkv, d).sum(1)
            return out[0], out[1], None, None


def _check_unchanged(tensors, versions) -> None:
    """Raise as autograd does for a saved tensor when one of `tensors` was modified in place
    since its version was taken."""
    for name, x, v in zip(("key", "value"), tensors, versions):
        if x._version != v:
            raise RuntimeError(
                f"the {name} a per-document CP call reads again in its backward was modified by "
                f"an inplace operation (version {x._version}, expected {v})")


class _WlbCall(torch.autograd.Function):
    """(q [t, h, d], the packs [n, hkv, d]; k, v for their rebuild) -> out [t, h*d]: the rank's
    chunks of every document in one kernel call (`per_doc_attention`)."""

    @staticmethod
    def forward(ctx, q, kp, vp, k, v, prog: WlbProgram, env: ExecEnv, counts: CallCounts):
        t, h, d = q.shape
        call = _Call(prog.call, q, kp, vp, env, counts)
        del kp, vp
        o = call.out.data
        if prog.pad.size:  # padding slots attend to nothing: zero, whatever the kernel wrote
            o.index_put_((prog.pad.idx,), o.new_zeros(()))
        ctx.prog, ctx.env, ctx.call, ctx.shape = prog, env, call, (t, h, d)
        ctx.again = env.again
        if ctx.again:  # the packs freed until the backward gathers them again
            call.release_keys()
            # k and v held on ctx, not saved: the backward drops them once the packs are
            # gathered again, before the kernel's backward (saved tensors live until the node
            # returns); their versions are checked as autograd checks a saved tensor's
            ctx.kv = (k, v)
            ctx.kv_versions = (k._version, v._version)
        return call.out.detach().view(t, h * d)

    @staticmethod
    def backward(ctx, grad):
        with ctx.env.stats.watch("bwd") as counts:
            prog, env = ctx.prog, ctx.env
            t, h, d = ctx.shape
            call, ctx.call = ctx.call, None
            if ctx.again:
                (k, v), ctx.kv = ctx.kv, None
                _check_unchanged((k, v), ctx.kv_versions)
                call.restore()
                _wlb_packs(k, v, prog, env,  # ([n, hkv*d]: n may be 0)
                           [x.data.view(x.shape[0], x.shape[1] * x.shape[2])
                            for x in call.leaves[1:]])
                del k, v
            dq, dkp, dvp = call.backward(grad.view(t, h, d), counts)
            return dq, dkp, dvp, None, None, None, None, None
