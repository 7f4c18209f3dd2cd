"""The per-slot programs (meta.py) run by the operator (exchange.py), checked in one process: a
whole exchange pool - every replica of the pool and every cp rank of each - runs as threads
whose collectives move real data (tests/loopback.py), on random plans of every shape; every
output and every Q/K/V gradient must equal independent attention per document, each rank must
send exactly the elements the plan promises, and the kernel calls must not grow with tiles or
documents."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from libra_ext import costmodel
from libra_ext.attention import kernels, meta, reference_kernel, thd
from libra_ext.attention.comm import ByteCounter
from libra_ext.attention.counters import RuntimeStats
from libra_ext.attention.exchange import ExecEnv, per_doc_attention, planned_attention
from libra_ext.planner import LayoutConfig, Planner, PlannerOptions, StepPlan
from libra_ext.workload import LengthSource, ModelConfig
from tests import loopback
from tests.strategies import layouts, step_inputs

D_HEAD = 4
SCALE = 0.5


def _expected(L, q, k, v, dout):
    """Per-document attention of the whole sequence and its gradients."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    outs, s = [], 0
    for n in L:
        o, _ = reference_kernel.reference_attention(*(x[s : s + n] for x in leaves), SCALE)
        outs.append(o)
        s += n
    if not outs:
        return torch.zeros_like(q), [torch.zeros_like(x) for x in (q, k, v)]
    out = torch.cat(outs)
    return out.detach(), list(torch.autograd.grad(out, leaves, dout))


def _err(a, b) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def _local(x, idx):
    """Rows idx of x (-1: a zero padding row)."""
    pad = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return pad[torch.as_tensor(np.where(idx >= 0, idx, len(x)))].clone()


def run_pool(plan, replica, slot, chunks, hkv, seed=0, pipelined=True, memory="keep",
             fused=False, early=None):
    """Forward and backward of every rank of replica's exchange pool for `slot`, each a thread
    (`fused`: q, k and v are views of one [t, h + 2 hkv, d] tensor, as split from a fused QKV
    projection - not contiguous; `early`: every program's early_returns set so). Returns
    {(member, cp rank): (program, output, (dq, dk, dv), counter)} and per member the
    sequence's (lengths, q, k, v, dout)."""
    px, C = plan.exchange_pool, plan.cp
    base = replica // px * px
    h, d = plan.heads_local * C, D_HEAD
    layout = thd.layout_of(plan.system)
    gen = torch.Generator().manual_seed(seed)
    seqs = {}
    for m in range(px):
        L = meta.sequence_lengths(plan, base + m, slot).tolist()
        n = sum(L)
        seqs[m] = (L, *(torch.randn(n, hh, d, generator=gen, dtype=torch.float64)
                        for hh in (h, hkv, hkv)), torch.randn(n, h, d, generator=gen,
                                                             dtype=torch.float64))
    cp_groups = {m: loopback.LoopGroup([(m, c) for c in range(C)], f"cp {m}") for m in range(px)}
    pool_groups = {c: loopback.LoopGroup([(m, c) for m in range(px)], f"pool {c}")
                   for c in range(C)}

    def member(mc):
        m, c = mc
        L, q, k, v, dout = seqs[m]
        if plan.system == "wlb":
            prog = meta.upload(meta.compile_rank(plan, base + m, c, chunks)[slot], "cpu")
        else:
            prog = meta.upload(meta.compile_slot(plan, base + m, slot, chunks), "cpu")
            if early is not None:
                prog.early_returns = early
        idx = thd.split(L or [thd.empty_sequence_tokens(C, layout)], C, c, layout).token_index
        if not L:
            idx = np.full_like(idx, -1)
        leaves = [_local(x, idx).requires_grad_() for x in (q, k, v)]
        inputs = leaves
        if fused:
            qkv = torch.cat(leaves, dim=1).detach().requires_grad_()
            leaves = [qkv]
            inputs = qkv.split([h, hkv, hkv], dim=1)
        env = ExecEnv(kernel=kernels.ReferenceBackend(), scale=SCALE, cp_group=cp_groups[m],
                      cp_rank=c, pool_group=pool_groups[c] if px > 1 else None, counter=ByteCounter(),
                      stats=RuntimeStats(), pipelined=pipelined, memory=memory)
        fn = per_doc_attention if isinstance(prog, meta.WlbProgram) else planned_attention
        out = fn(*inputs, prog, env)
        g = _local(dout, idx)
        pad = torch.Generator().manual_seed(1000 * seed + 10 * m + c)  # (the same each run)
        g[torch.as_tensor(idx < 0)] = torch.randn(int((idx < 0).sum()), h, d, generator=pad,
                                                  dtype=torch.float64)  # must not leak
        given = g.clone()
        grads = torch.autograd.grad(out, leaves, g.view(out.shape))
        # the output gradient autograd hands the operator is read, never written (another
        # consumer of the same tensor may read it after)
        assert torch.equal(g, given), "the output gradient was written"
        if fused:
            grads = grads[0].split([h, hkv, hkv], dim=1)
        return prog, out.detach().view(-1, h, d), grads, env.counter, idx

    members = [(m, c) for m in range(px) for c in range(C)]
    results = dict(zip(members, loopback.run_members(member, members)))
    return results, seqs


def check_pool(plan, replica, slot, chunks, hkv, **kw):
    """run_pool, every rank's output and gradients against the per-document reference."""
    results, seqs = run_pool(plan, replica, slot, chunks, hkv, **kw)
    for m, (L, q, k, v, dout) in seqs.items():
        want, want_grads = _expected(L, q, k, v, dout)
        got_grads = [torch.zeros_like(x) for x in (q, k, v)]
        for c in range(plan.cp):
            prog, out, grads, _, idx = results[(m, c)]
            real = torch.as_tensor(idx >= 0)
            rows = torch.as_tensor(idx[idx >= 0])
            assert _err(out[real], want[rows]) < 1e-10, (m, c, L)
            assert not out[~real].any(), "padding rows must be zero"
            for acc, g in zip(got_grads, grads):
                acc.index_add_(0, rows, g[real])
                if L or plan.system != "wlb":  # (wlb runs an empty sequence as a padding
                    # document of its own: attention among its zero rows)
                    assert not g[~real].any(), "padding rows must get no gradient"
        for got, ref in zip(got_grads, want_grads):
            assert _err(got, ref) < 1e-10, (m, L)
    return results


def _kv_heads(layout, model):
    return max(1, model.kv_heads // layout.tp)


@pytest.mark.parametrize("system", ["libra", "distca", "ulysses", "wlb"])
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_every_rank_of_a_pool_gets_exact_attention_and_gradients(system, data):
    layout, model = data.draw(layouts(max_dp=4))
    seqs = data.draw(step_inputs(layout))
    opts = PlannerOptions(
        system=system,
        block=data.draw(st.sampled_from([None, 7, 64])),
        head_group=data.draw(st.sampled_from([0, 1, 3])),
        max_tile_share=data.draw(st.sampled_from([0.0, 0.1, 0.01])),
    )
    plan = Planner(layout, model, opts).plan(seqs, flush=True)
    chunks = data.draw(st.integers(1, 4))
    replica = data.draw(st.integers(0, layout.dp - 1))
    slot = data.draw(st.integers(0, plan.slots - 1))
    results = check_pool(plan, replica, slot, chunks, _kv_heads(layout, model),
                         pipelined=data.draw(st.booleans()), fused=data.draw(st.booleans()))
    if system == "wlb":
        return
    px = plan.exchange_pool
    g = plan.group_of(replica, slot)
    for (m, c), (prog, _, _, counter, _) in results.items():
        # the elements each rank sends in the pool exchange are the plan's cells
        # (in vectors: the plan's cells count elements of its head_dim, float64 here)
        sent = {k: v // (8 * D_HEAD) for k, v in counter.sent.items()}

        def cell(x):
            return (x[g, m].sum() - x[g, m, m]) // plan.head_dim

        assert sent.get("pool.q", 0) == cell(plan.xchg_q)
        assert sent.get("pool.k", 0) + sent.get("pool.v", 0) == cell(plan.xchg_kv)
        assert sent.get("pool.o", 0) == cell(plan.xchg_o)
        assert sent.get("pool.do", 0) == sent.get("pool.q", 0)
        assert sent.get("pool.dq", 0) == sent.get("pool.o", 0)
        assert len(prog.calls) <= 3 + 2 * len(prog.subchunks)
        assert len(prog.subchunks) <= 2 * chunks
        assert px > 1 or not prog.subchunks


@pytest.mark.parametrize("memory", ["owner", "rebuild"])
@pytest.mark.parametrize("system", ["libra", "distca", "ulysses", "wlb"])
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_rebuilt_outputs_give_the_same_bits_and_ship_o_once_more(system, memory, data):
    """ExecEnv.memory: owner frees the moved units' outputs and inputs after the forward and
    rebuilds them in the backward, rebuild the kernels' O too - outputs and gradients bit for
    bit those of keeping them; in the pool the moved units' O and Q / K / V go again as in the
    forward, and (rebuild) O goes over the CP group as dO goes (the layer's O). WLB-LLM's key
    and value packs (both settings) are gathered again: its K and V all-gathered once more."""
    layout, model = data.draw(layouts(max_dp=4))
    seqs = data.draw(step_inputs(layout))
    opts = PlannerOptions(system=system, head_group=data.draw(st.sampled_from([0, 1])))
    plan = Planner(layout, model, opts).plan(seqs, flush=True)
    chunks = data.draw(st.integers(1, 3))
    replica = data.draw(st.integers(0, layout.dp - 1))
    slot = data.draw(st.integers(0, plan.slots - 1))
    hkv = _kv_heads(layout, model)
    kept, _ = run_pool(plan, replica, slot, chunks, hkv)
    rebuilt, _ = run_pool(plan, replica, slot, chunks, hkv, memory=memory)
    for mc, (_, out, grads, counter, _) in rebuilt.items():
        _, out0, grads0, counter0, _ = kept[mc]
        assert torch.equal(out, out0), mc
        for g, g0 in zip(grads, grads0):
            assert torch.equal(g, g0), mc
        extra = {k: v - counter0.sent.get(k, 0) for k, v in counter.sent.items()
                 if v != counter0.sent.get(k, 0)}
        want = {}
        if memory == "rebuild" and counter0.sent.get("ulysses.o.bwd"):  # as dO goes, O goes
            want["ulysses.o.rebuild"] = counter0.sent["ulysses.o.bwd"]
        for kind in ("wlb.k", "wlb.v"):  # the packs gathered again
            if counter0.sent.get(kind):
                want[f"{kind}.rebuild"] = counter0.sent[kind]
        for kind, like in (("o", "do"), ("q", "q"), ("k", "k"), ("v", "v")):
            if counter0.sent.get(f"pool.{like}"):  # moved units' O and inputs again
                want[f"pool.{kind}.rebuild"] = counter0.sent[f"pool.{like}"]
        assert extra == want, (mc, extra, want)


@pytest.mark.parametrize("memory", ["owner", "rebuild"])
def test_per_document_cp_reads_its_inputs_again_only_as_they_were(memory):
    """WLB-LLM's per-document CP under owner / rebuild holds K and V for its backward (its packs
    are gathered from them again) and drops them before the kernel's backward; a key modified
    in place after the forward is refused as autograd refuses a changed saved tensor, on every
    rank, before any collective."""
    model = ModelConfig(hidden=32, heads=4, kv_heads=2, head_dim=D_HEAD, ffn=32, layers=1,
                        moe_topk=0, moe_ffn=0)
    layout = LayoutConfig(dp=1, cp=2, pool_size=1, context=64)
    plan = Planner(layout, model, PlannerOptions(system="wlb")).plan([[40, 24]], flush=True)
    cp = loopback.LoopGroup([(0, c) for c in range(2)], "cp")
    gen = torch.Generator().manual_seed(0)

    def rank(mc):
        prog = meta.upload(meta.compile_rank(plan, 0, mc[1], 1)[0], "cpu")
        t = prog.t
        q, k, v = (torch.randn(t, n, D_HEAD, generator=gen, dtype=torch.float64,
                               requires_grad=True) for n in (4, 2, 2))
        k2 = k * 1  # the layer's key, made from a leaf; modified below
        env = ExecEnv(kernel=kernels.ReferenceBackend(), scale=SCALE, cp_group=cp,
                      cp_rank=mc[1], pool_group=None, counter=ByteCounter(),
                      stats=RuntimeStats(), memory=memory)
        out = per_doc_attention(q, k2, v, prog, env)
        with torch.no_grad():
            k2.add_(1.0)
        out.sum().backward()

    with pytest.raises(RuntimeError, match="key .* modified by an inplace operation"):
        loopback.run_members(rank, [(0, 0), (0, 1)])


@pytest.mark.parametrize("system", ["libra", "distca"])
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_executed_units_backward_first_gives_the_same_bits_and_bytes(system, data):
    """Under rebuild, a group whose plan says so (`meta.early_return_groups`) runs its executed
    units' backward and waits for every return before the direct call's backward, every
    returned dQ landing in a buffer: outputs, gradients and every transfer's bytes are those of
    the late order - and of keeping - bit for bit."""
    layout, model = data.draw(layouts(max_dp=4))
    seqs = data.draw(step_inputs(layout))
    plan = Planner(layout, model, PlannerOptions(system=system)).plan(seqs, flush=True)
    chunks = data.draw(st.integers(1, 3))
    replica = data.draw(st.integers(0, layout.dp - 1))
    slot = data.draw(st.integers(0, plan.slots - 1))
    hkv = _kv_heads(layout, model)
    kept, _ = run_pool(plan, replica, slot, chunks, hkv)
    late, _ = run_pool(plan, replica, slot, chunks, hkv, memory="rebuild", early=False)
    early, _ = run_pool(plan, replica, slot, chunks, hkv, memory="rebuild", early=True)
    for mc, (_, out, grads, counter, _) in early.items():
        for other in (late[mc], kept[mc]):
            assert torch.equal(out, other[1]), mc
            for g, g0 in zip(grads, other[2], strict=True):
                assert torch.equal(g, g0), mc
        assert counter.sent == late[mc][3].sent, mc


@pytest.mark.parametrize("ahead", ["every member", "none", "even members"])
def test_the_early_order_posts_the_next_sub_chunk_ahead_or_after_the_kernel_alike(
        ahead, monkeypatch):
    """In the early order an executor posts the next sub-chunk's backward messages before the
    current sub-chunk's kernel where its memory allows (`_Exchange._ahead`), else right after
    it: every member posts its transfers in one order either way, so members that decide
    differently still meet, and the bits are keeping's."""
    from libra_ext.attention import exchange

    def decide(self, t, executed, returned):
        yes = ahead == "every member" or ahead == "even members" and self.prog.replica % 2 == 0
        if yes and self.posted == t + 1 < len(self.turns):
            self._post_grad(executed)

    layout = LayoutConfig(dp=4, cp=2, pool_size=4, context=2048)
    model = ModelConfig(hidden=64, heads=8, kv_heads=4, head_dim=D_HEAD, ffn=64, layers=1,
                        moe_topk=0, moe_ffn=0)
    rng = np.random.default_rng(0)
    for _ in range(2):  # (the second: members that message each other in every sub-chunk -
        # posting two ahead on some of them fails it, tests/loopback.py matching in order)
        seqs = []
        for _ in range(layout.dp):
            L = []
            while sum(L) < layout.context - 64:
                L.append(int(min(layout.context - sum(L), rng.lognormal(5, 1.3) + 1)))
            seqs.append(L)
        plan = Planner(layout, model, PlannerOptions(system="libra")).plan(seqs, flush=True)
        kept, _ = run_pool(plan, 0, 0, 3, 4)
        with monkeypatch.context() as mp:
            mp.setattr(exchange._Exchange, "_ahead", decide)
            early, _ = run_pool(plan, 0, 0, 3, 4, memory="rebuild", early=True)
        assert any(len(p.subchunks) > 2 for p, *_ in early.values())
        for mc, (_, out, grads, counter, _) in early.items():
            assert torch.equal(out, kept[mc][1]), mc
            for g, g0 in zip(grads, kept[mc][2], strict=True):
                assert torch.equal(g, g0), mc


def test_the_early_order_is_chosen_where_it_lowers_the_modeled_peak():
    """`early_return_groups` per exchange group: the members that execute others' units keep
    their memory through the direct call's backward in the late order, the members whose units
    were moved keep their returns through it in the early one - the lower of the two peaks,
    weighed against PEAK_BASE times each member's X, is taken, the same for every member."""
    model = ModelConfig(hidden=64, heads=8, kv_heads=2, head_dim=8, ffn=64, layers=1,
                        moe_topk=0, moe_ffn=0)
    layout = LayoutConfig(dp=4, cp=2, pool_size=4, context=4096)
    plan = Planner(layout, model, PlannerOptions(system="libra")).plan(
        LengthSource(preset="libra-256k").step(8, 4096, seed=3, step=0))
    early = meta.early_return_groups(plan)
    assert early.shape == (plan.xchg_q.shape[0],) and early.dtype == bool
    assert meta.early_return_groups(plan) is early  # cached on the plan
    q, kv = plan.xchg_q.astype(float), plan.xchg_kv.astype(float)
    for g in range(len(early)):
        pool, slot = divmod(g, plan.slots)
        x = np.array([plan.cp * -(-sum(meta.sequence_lengths(plan, pool * 4 + j, slot)) // plan.cp)
                      for j in range(4)], dtype=float) * (plan.heads_local
                                                         + 2 * plan.kv_heads_local) * 8
        e, r = 3 * q[g].sum(0) + kv[g].sum(0), q[g].sum(1) + kv[g].sum(1)
        late = max(meta.PEAK_BASE * x + e)
        first = max(np.maximum((meta.PEAK_BASE - 1) * x + e + r, meta.PEAK_BASE * x + r))
        assert early[g] == (first < late) and (q[g].any() or not early[g]), g
        for j in range(4):  # every member's program carries its group's choice
            assert meta.compile_slot(plan, pool * 4 + j, slot).early_returns == early[g]
    # one member moves units with long K/V prefixes to each of the others: its returns (their
    # dQ, dK, dV) outweigh what any executor frees, so the late order stays; the others moving
    # units to one executor, its memory is the larger, and the early order is taken
    def fake(q, kv):
        return type("P", (), dict(exchange_pool=4, slots=1, dp=4, cp=1, heads_local=1,
                                  kv_heads_local=1, head_dim=1, xchg_q=q, xchg_kv=kv,
                                  doc_lengths=np.full(4, 8), seq_doc_offsets=np.arange(5),
                                  seq_replica=np.arange(4), seq_slot=np.zeros(4, dtype=int),
                                  sequence_tokens=StepPlan.sequence_tokens))()
    q, kv = np.zeros((1, 4, 4)), np.zeros((1, 4, 4))
    q[0, 0, 1:], kv[0, 0, 1:] = 10 ** 6, 2 * 10 ** 6
    assert not meta.early_return_groups(fake(q, kv))[0]
    assert meta.early_return_groups(fake(q.transpose(0, 2, 1).copy(), 0 * kv))[0]


def _scaled_preset_plan(preset_docs, system="libra", dp=4, pool=4, cp=2, context=4096, **kw):
    model = ModelConfig(
        hidden=64, heads=8, kv_heads=2, head_dim=8, ffn=64, layers=1, moe_topk=0, moe_ffn=0
    )
    layout = LayoutConfig(dp=dp, cp=cp, pool_size=pool, context=context)
    return Planner(layout, model, PlannerOptions(system=system, **kw)).plan(preset_docs)


def _many_short(context, seed=0):
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(8):
        docs, room = [], context
        while room:
            docs.append(int(min(room, rng.integers(8, 120))))
            room -= docs[-1]
        seqs.append(docs)
    return seqs


@pytest.mark.parametrize("workload", ["libra-256k", "many-short"])
@pytest.mark.parametrize("chunks", [1, 4])
def test_calls_and_descriptors_do_not_grow_with_tiles_or_documents(workload, chunks):
    context = 4096
    if workload == "many-short":
        seqs = _many_short(context)
    else:  # the preset's long-tail lengths, cut to the test context
        seqs = LengthSource(preset="libra-256k").step(8, context, seed=3, step=0)
    plan = _scaled_preset_plan(seqs, context=context, block=256)
    assert plan.n_tiles > 100
    for replica in range(4):
        for slot in range(plan.slots):
            p = meta.compile_slot(plan, replica, slot, chunks)
            assert len(p.lpacks) <= 2
            assert all(len(sc.packs) <= 2 for sc in p.subchunks)
            assert len(p.calls) <= 3 + 2 * len(p.subchunks) <= 3 + 4 * chunks
            # descriptors: one gather run per moved unit / stream, never one per vector
            runs = sum(len(g.runs) for g in (p.send_q, p.send_kv))
            assert runs <= 2 * p.n_q_send and p.send_q.size == p.n_q_send


def test_a_message_is_cut_into_ranges_sent_in_place_or_gathered():
    # items (start, vectors, contiguous): [0, 8) and [8, 20) join; two strided items travel
    # gathered together; a gap starts a new range
    r = meta._ranges([0, 8, 100, 200, 50], [8, 12, 2, 3, 6], [True, True, False, False, True])
    assert r == [(20, 0), (5, -1), (6, 50)]
    assert meta._ranges([], [], []) == []
    # beyond the limit the smaller in-place ranges travel gathered, merged with their
    # gathered neighbours; the larger keep their place (the earlier among equals)
    starts = [0, 100, 200, 300, 400, 500]
    r = meta._ranges(starts, [5, 9, 5, 9, 9, 1], [True] * 6, limit=3)
    assert r == [(5, -1), (9, 100), (5, -1), (9, 300), (9, 400), (1, -1)]
    r = meta._ranges(starts, [5, 9, 5, 9, 9, 1], [True] * 6, limit=1)
    assert r == [(5, -1), (9, 100), (24, -1)]


@settings(max_examples=60, deadline=None)
@given(kvl=st.integers(1, 4), items=st.lists(st.tuples(st.booleans(), st.integers(0, 30),
                                                       st.integers(0, 8), st.integers(0, 3)),
                                             max_size=12))
def test_the_k_v_vectors_sent_are_grouped_per_vector_from_their_runs(kvl, items):
    """The K/V vectors a rank sends - runs of whole rows (all KV heads) or of one KV head, a
    prefix going to several executors - are counted on the host from the runs alone
    (`distinct_vectors`), and grouped on the device per distinct vector in send order (what
    the returned gradients are summed by)."""
    runs = np.array([(ds * kvl if whole else ds * kvl + kh % kvl, n, kvl if whole else 1, kvl)
                     for whole, ds, n, kh in items], dtype=np.int64).reshape(-1, 4)
    g = meta.Gather(runs, int((runs[:, 1] * runs[:, 2]).sum()) if len(runs) else 0)
    idx = meta.expand_runs(torch.as_tensor(runs), g.size)
    distinct = meta.distinct_vectors(runs)
    assert distinct == len(torch.unique(idx))
    rows, order, offs = meta.vector_groups(idx, distinct)
    assert torch.equal(rows.long(), torch.unique(idx).long())
    assert offs.tolist()[0] == 0 and offs.tolist()[-1] == g.size
    for j in range(distinct):
        group = order[offs[j]:offs[j + 1]].long()
        assert len(group) and (idx[group] == rows[j]).all() and (group.diff() > 0).all()
    with pytest.raises(ValueError, match="leaves its row"):
        meta.distinct_vectors(np.array([[kvl - 1, 3, 2, kvl]]))


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_moved_pieces_are_sent_and_received_in_place(kv_heads):
    """With whole pieces moved (all heads of the slice), each message to an executor is one
    contiguous range of X - per KV head with kvl = 1 (kv_heads 2 at cp 2), as whole units with
    kvl > 1 (kv_heads 4) - so nothing is gathered for it; the pool stays exact."""
    model = ModelConfig(hidden=64, heads=8, kv_heads=kv_heads, head_dim=D_HEAD, ffn=64,
                        layers=1, moe_topk=0, moe_ffn=0)
    layout = LayoutConfig(dp=2, cp=2, pool_size=2, context=512)
    plan = Planner(layout, model, PlannerOptions(system="libra")).plan(
        [[400, 60, 52], [64] * 8], flush=True)
    progs = [meta.upload(meta.compile_slot(plan, r, 0, 2), "cpu") for r in range(2)]
    owner = max(progs, key=lambda p: p.n_q_send)
    assert owner.n_q_send > 0 and owner.messages.in_place > 0
    assert owner.messages.q_rest.numel() == 0 and owner.messages.kv_rest.numel() == 0
    if kv_heads // layout.cp > 1:  # whole units: the executor runs (hl, kvl) on what arrives
        exe = progs[1 - progs.index(owner)]
        calls = [sc.call for sc in exe.subchunks if sc.call is not None]
        assert calls and all((c.hc, c.hk) == (4, 2) for c in calls)
    for fused in (False, True):  # a fused QKV's views: not contiguous, sent from the gather
        check_pool(plan, 0, 0, 2, kv_heads, fused=fused)


def test_parts_balance_the_bytes_each_executor_receives():
    """Streams (a document's KV head for one executor, with its units) are atomic: each lands in
    the part where the middle of its bytes falls, so no part exceeds an even share by more than
    the largest stream."""
    seqs = LengthSource(preset="libra-256k").step(8, 8192, seed=1, step=0)
    plan = _scaled_preset_plan(seqs, context=8192, block=256)
    chunks, checked = 4, 0
    for replica in range(4):
        p = meta.compile_slot(plan, replica, 0, chunks)
        segs, base, _ = meta._group_segments(plan, replica, 0)
        moved = meta._merge_rows(segs.take(np.flatnonzero(segs.owner != segs.exe)))
        u, _, uhc, _, stream, st_ = meta._units(moved, plan.heads_local // plan.kv_heads_local,
                                                plan.kv_heads_local)
        mine = st_["exe"] == replica - base
        q = np.bincount(stream, weights=(u.b - u.a) * uhc, minlength=len(mine))
        size = (q + 2 * st_["len"])[mine]
        recv = {}
        for sc in p.subchunks:  # a part's two halves (direct, pack)
            recv[sc.part] = recv.get(sc.part, 0) + sc.n_q_recv + 2 * sc.n_kv_recv
        assert sum(recv.values()) == size.sum()
        if size.sum():
            checked += 1
            assert max(recv.values()) <= size.sum() / chunks + size.max()
    assert checked


def test_program_refuses_a_per_document_cp_plan_and_a_bad_slot():
    plan = _scaled_preset_plan([[100, 28]] * 4, system="wlb", context=128)
    with pytest.raises(ValueError, match="use compile_wlb"):
        meta.compile_slot(plan, 0, 0)
    plan = _scaled_preset_plan([[100, 28]] * 4, context=128)
    with pytest.raises(ValueError, match=r"\(replica, slot\) = \(0, 3\) outside"):
        meta.compile_slot(plan, 0, 3)
    with pytest.raises(ValueError, match="chunks must be at least 1"):
        meta.compile_slot(plan, 0, 0, chunks=0)
    with pytest.raises(ValueError, match=r"cp_rank must be in \[0, cp=2\)"):
        meta.compile_wlb([8], 2, 2, 4, 2, 8)


def test_upload_is_one_copy_of_compact_descriptors_expanded_on_the_device():
    plan = _scaled_preset_plan(LengthSource(preset="libra-256k").step(4, 2048, 0, 0),
                               context=2048)
    host = meta.compile_slot(plan, 1, 0, 2)
    staged = meta.stage(host)
    dev = meta.upload(staged, "cpu")
    assert isinstance(dev.send_q.runs, torch.Tensor) and isinstance(host.send_q.runs, np.ndarray)
    # every descriptor is a view of the one staged buffer
    base = staged.host.untyped_storage().data_ptr()
    for call in dev.calls:
        assert call.seg.cu_q.untyped_storage().data_ptr() == base
        assert call.seg.cu_q.dtype == torch.int32
        assert call.seg.max_q >= int(np.diff(call.seg.host_q).max(initial=0))
        assert call.seg.max_q & (call.seg.max_q - 1) == 0  # a power of two
    # the staged buffer holds O(runs + segments) integers, the expanded indices far more
    expanded = sum(g.size for g in (dev.send_q, dev.send_kv))
    assert staged.host.numel() * 8 < expanded + 8 * staged.host.numel()
    # expansion on the device gives exactly the vectors the runs describe
    for g_host, g_dev in ((host.send_q, dev.send_q), (host.send_kv, dev.send_kv)):
        want = np.concatenate([b + np.arange(r)[:, None] * s + np.arange(w)[None, :]
                               for b, r, w, s in g_host.runs.tolist()]).reshape(-1) \
            if len(g_host.runs) else np.zeros(0)
        assert g_dev.idx.dtype == torch.int32
        assert np.array_equal(g_dev.idx.numpy(), want)



def test_a_staged_only_program_is_unpacked_by_its_upload_to_the_same_device_program():
    """The sampler's programs (`staged_only`) stay native through staging - no SlotProgram and
    no numpy array per call or gather is made on the sampler's thread - and `upload` unpacks
    them into the device program a fully unpacked host program uploads to."""
    plan = _scaled_preset_plan(LengthSource(preset="libra-256k").step(8, 4096, 3, 0),
                               context=4096, block=256)
    for replica in range(plan.dp):
        native = meta.compile_rank(plan, replica, 0, 2, staged_only=True)
        full = meta.compile_rank(plan, replica, 0, 2)
        for slot, (n, f) in enumerate(zip(native, full, strict=True)):
            assert isinstance(n, meta.NativeProgram) and (n.replica, n.slot) == (replica, slot)
            staged = meta.stage(n, owned=True)
            assert staged.prog is n  # staged as it is: unpacked only by the upload
            bare = n.unpack(arrays=False)
            assert all(c.cu_q is None and c.cu_k is None for c in bare.calls)
            assert bare.send_q.runs is None and bare.send_kv.runs is None
            _assert_same_program(n.unpack(), f)  # every scalar, list, range and array
            a, b = meta.upload(staged, "cpu"), meta.upload(meta.stage(f), "cpu")
            assert torch.equal(staged.host, meta.stage(f).host)
            assert [sc.q_ranges for sc in a.subchunks] == [sc.q_ranges for sc in b.subchunks]
            for x, y in zip(a.calls, b.calls, strict=True):
                assert torch.equal(x.cu_q, y.cu_q) and torch.equal(x.cu_k, y.cu_k)
            for g, h in ((a.send_q, b.send_q), (a.send_kv, b.send_kv)):
                assert torch.equal(g.idx, h.idx) and torch.equal(g.runs, h.runs)
            if a.messages is not None:
                assert a.messages.q_send == b.messages.q_send
                assert torch.equal(a.messages.q_rest, b.messages.q_rest)
    with pytest.raises(ValueError, match="chunks must be at least 1"):
        meta.compile_rank(plan, 0, 0, 0, staged_only=True)

@pytest.mark.parametrize("system", ["libra", "distca", "ulysses", "wlb"])
def test_a_ranks_cost_features_come_from_its_native_programs_unpacked_or_not(system):
    """The sampler's cost-model features of a step (`meta.program_features`) are summed by the
    C++ compiler over the native programs it stages, bit for bit `costmodel.call_features` over
    the unpacked programs' calls - at every chunk count (a segment lands in one sub-chunk's
    call whatever the cut), every replica and cp rank; WLB-LLM's programs are numpy's."""
    plan = _scaled_preset_plan(LengthSource(preset="libra-256k").step(8, 4096, 5, 0),
                               system=system, context=4096, block=256)
    for replica in range(plan.dp):
        for cp_rank in range(plan.cp):
            want = costmodel.call_features(
                [c for p in meta.compile_rank(plan, replica, cp_rank, 1) for c in p.calls])
            assert want[costmodel.CONSTANT] == 1 and want[costmodel.SEGMENTS] > 0
            for chunks in (1, 2, 3):
                native = meta.compile_rank(plan, replica, cp_rank, chunks, staged_only=True)
                got = meta.program_features(native)
                assert np.array_equal(got, want), (replica, cp_rank, chunks)


def test_one_cp_rank_runs_one_call_on_the_inputs_themselves():
    """Ulysses (and wlb) at world 1: the program is one direct call, no pack, no exchange."""
    plan = _scaled_preset_plan([[100, 28], [50, 50, 28], [128], [1] * 128], system="ulysses",
                               cp=1, pool=1, context=128)
    for replica in range(4):
        p = meta.compile_slot(plan, replica, 0)
        assert not p.lpacks and not p.subchunks and len(p.calls) == 1
        L = meta.sequence_lengths(plan, replica, 0)
        assert p.direct.cu_q.tolist() == np.r_[0, np.cumsum(L)].tolist()
        assert p.direct.cu_k.tolist() == p.direct.cu_q.tolist()


def _assert_same_program(a, b, path="program"):
    """Two host programs equal field by field, array for array."""
    if isinstance(a, (list, tuple)):
        assert type(b) is type(a) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_program(x, y, f"{path}[{i}]")
    elif hasattr(a, "__dataclass_fields__"):
        assert type(a) is type(b), path
        for name in a.__dataclass_fields__:
            if name not in ("_keep", "_staged", "seg", "idx"):
                _assert_same_program(getattr(a, name), getattr(b, name), f"{path}.{name}")
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), path
        assert a.shape == b.shape and np.array_equal(a, b), (path, a, b)
    else:
        assert a == b and isinstance(a, (bool, int, type(None))) and type(a) is type(b), \
            (path, a, b)


def _assert_same_staging(native, reference):
    """The buffer the C++ compiler staged (with the GIL released) is the one `meta.stage`
    concatenates from the reference program's arrays: the same int32 entries and sizes."""
    assert native._staged is not None and reference._staged is None
    a, b = meta.stage(native), meta.stage(reference)
    assert a.host.dtype == b.host.dtype == torch.int32
    assert torch.equal(a.host, b.host) and a.sizes == b.sizes
    assert a.prog._staged is None  # the staged copy does not hold the buffer twice


@pytest.mark.parametrize("system", ["libra", "distca", "ulysses"])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_the_native_compiler_gives_the_reference_program(system, data):
    """compile_slot (C++, the GIL released) equals compile_slot_reference (numpy) on random
    plans of every shape: every call, gather run, sub-chunk count and offset."""
    layout, model = data.draw(layouts(max_dp=8))
    seqs = data.draw(step_inputs(layout))
    opts = PlannerOptions(system=system, block=data.draw(st.sampled_from([None, 7, 64])),
                          head_group=data.draw(st.sampled_from([0, 1, 3])),
                          max_tile_share=data.draw(st.sampled_from([0.0, 0.1, 0.01])))
    plan = Planner(layout, model, opts).plan(seqs, flush=True)
    chunks = data.draw(st.integers(1, 4))
    for replica in range(plan.dp):
        native = meta.compile_rank(plan, replica, 0, chunks)
        for slot in range(plan.slots):
            ref = meta.compile_slot_reference(plan, replica, slot, chunks)
            _assert_same_program(native[slot], ref)
            _assert_same_staging(native[slot], ref)


@pytest.mark.parametrize("workload", ["libra-256k", "many-short"])
def test_the_native_compiler_gives_the_reference_program_on_many_tiles(workload):
    seqs = (_many_short(4096) if workload == "many-short"
            else LengthSource(preset="libra-256k").step(8, 4096, seed=3, step=0))
    plan = _scaled_preset_plan(seqs, context=4096, block=256)
    assert plan.n_tiles > 100 and len(plan.send_order)
    for replica in range(4):
        for chunks in (1, 2, 4):
            for slot, prog in enumerate(meta.compile_rank(plan, replica, 0, chunks)):
                ref = meta.compile_slot_reference(plan, replica, slot, chunks)
                _assert_same_program(prog, ref)
                _assert_same_staging(prog, ref)


@pytest.mark.parametrize("field,value,message", [
    ("tile_owner", 99, r"plan tile \d+: owner 99 or executor \d+ outside its pool \[0, 4\)"),
    ("tile_executor", -3, r"plan tile \d+: owner \d+ or executor -3 outside its pool"),
    ("tile_doc", 10**6, r"plan tile \d+: document 1000000 outside the plan's \d+ documents"),
    ("tile_head_count", 0, r"plan tile \d+: heads \[\d+, \d+\) outside the 4 local heads"),
    ("tile_head_start", 3, r"plan tile \d+: heads \[3, \d+\) outside the 4 local heads"),
    ("tile_q_len", 10**6, r"plan tile \d+: its KV range must be its document's prefix"),
    ("send_order", 10**6, r"plan.send_order\[\d+\]: tile 1000000 outside the plan's \d+ tiles"),
    ("send_group_offsets", 10**6, r"plan.send_group_offsets: group \d+ spans \[\d+, 1000000\)"),
    ("seq_doc_offsets", 10**6, r"plan.seq_doc_offsets\[\d+\]: documents"),
])
def test_the_native_compiler_refuses_a_malformed_plan_naming_the_field(field, value, message):
    """Every index the C++ compiler reads from the plan is checked: a corrupt plan raises a
    ValueError naming the field (and the tile), never a crash."""
    plan = _scaled_preset_plan(LengthSource(preset="libra-256k").step(8, 4096, seed=3, step=0),
                               context=4096, block=256)
    arr = getattr(plan, field).copy()
    if field in ("send_group_offsets", "seq_doc_offsets"):
        arr[-1] = value
    else:
        arr[:] = value
    setattr(plan, field, arr)
    with pytest.raises(ValueError, match=message):
        meta.compile_rank(plan, 0, 0, 2)
